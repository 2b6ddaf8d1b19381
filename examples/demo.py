"""flashtile demo: attention on the available device, checked against the reference and SDPA.

Run with `make demo` (or `python examples/demo.py`). On a CUDA GPU it runs flashtile's Triton
kernels; on CPU it runs the CPU path, which is for development (correct, O(s) memory, not fast).
It prints the max error against the fp32 reference and against torch's
scaled_dot_product_attention, and the median time per call over several timed rounds.
"""

import statistics
import time

import torch

import flashtile
from flashtile.backends.reference import attention_ref

ROUNDS = 5            # timed rounds; the median is printed
MIN_ROUND_S = 0.2     # each round repeats the call until it has run this long


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(output, median ms per call): warm up, then ROUNDS rounds of enough calls to fill MIN_ROUND_S each,
    so a single slow call (a compile, a page fault, a busy core) does not decide the number."""
    out = fn()  # warm-up (compiles the kernel on first use)
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    per_call = max(time.perf_counter() - t, 1e-6)
    reps = max(1, int(MIN_ROUND_S / per_call))
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn()
        _sync()
        times.append((time.perf_counter() - t) / reps * 1e3)
    return out, statistics.median(times)


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
    if device == "cpu":
        print("no CUDA device: this runs flashtile's CPU path, which is for development and tests "
              "(correct, O(s) memory, not fast); the Triton kernels need a CUDA GPU")

    out, ms = timed(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
    ref, _ = attention_ref(q, k, v, causal=True)
    # SDPA wants (b, h, s, d) and repeated kv heads for GQA
    rep = h // h_k
    sdpa_q, sdpa_k, sdpa_v = q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), \
        v.repeat_interleave(rep, 2).transpose(1, 2)
    sdpa, sdpa_ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        sdpa_q, sdpa_k, sdpa_v, is_causal=True).transpose(1, 2))
    flops = 4 * b * h * s * s * d / 2
    print(f"max |flashtile - reference| = {(out.float() - ref.float()).abs().max().item():.2e}")
    print(f"max |flashtile - SDPA|      = {(out.float() - sdpa.float()).abs().max().item():.2e}")
    rate = f"{flops / ms / 1e9:.1f} TFLOP/s" if device == "cuda" else f"{flops / ms / 1e6:.1f} GFLOP/s"
    print(f"flashtile: {ms:.3f} ms/call ({rate}); SDPA: {sdpa_ms:.3f} ms/call "
          f"(median of {ROUNDS} rounds of at least {MIN_ROUND_S} s each)")


if __name__ == "__main__":
    main()
