"""flashtile demo: attention on the available device, checked against the reference and SDPA.

Run with `make demo` (or `python examples/demo.py`). On a CUDA GPU it runs flashtile's Triton
kernels; on CPU it runs the chunked CPU path. It prints the max error against the fp32 reference
and against torch's scaled_dot_product_attention, and the time per call.
"""

import time

import torch

import flashtile
from flashtile.backends.reference import attention_ref


def timed(fn, reps):
    fn()  # warm-up (compiles the kernel on first use)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / reps * 1e3


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, h, h_k, d = (4, 2048, 16, 4, 128) if device == "cuda" else (2, 512, 8, 2, 64)
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype)
    k = torch.randn(b, s, h_k, d, device=device, dtype=dtype)
    v = torch.randn(b, s, h_k, d, device=device, dtype=dtype)
    print(f"flashtile {flashtile.__version__} on {device} ({dtype}), q {tuple(q.shape)}, "
          f"k/v {tuple(k.shape)} (GQA {h}:{h_k}), causal")

    out, ms = timed(lambda: flashtile.flash_attn_func(q, k, v, causal=True), 3 if device == "cpu" else 20)
    ref, _ = attention_ref(q, k, v, causal=True)
    # SDPA wants (b, h, s, d) and repeated kv heads for GQA
    rep = h // h_k
    sdpa_q, sdpa_k, sdpa_v = q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), \
        v.repeat_interleave(rep, 2).transpose(1, 2)
    sdpa, sdpa_ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        sdpa_q, sdpa_k, sdpa_v, is_causal=True).transpose(1, 2), 3 if device == "cpu" else 20)
    flops = 4 * b * h * s * s * d / 2
    print(f"max |flashtile - reference| = {(out.float() - ref.float()).abs().max().item():.2e}")
    print(f"max |flashtile - SDPA|      = {(out.float() - sdpa.float()).abs().max().item():.2e}")
    rate = f"{flops / ms / 1e9:.1f} TFLOP/s" if device == "cuda" else f"{flops / ms / 1e6:.1f} GFLOP/s"
    print(f"flashtile: {ms:.3f} ms/call ({rate}); SDPA: {sdpa_ms:.3f} ms/call")


if __name__ == "__main__":
    main()
