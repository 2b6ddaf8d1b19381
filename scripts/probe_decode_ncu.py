"""Decode calls for Nsight Compute to profile one kernel at a time (gpu_check.sh probe-decode-ncu).

Each case runs twice unprofiled (compile, warm caches) and then ``--calls`` times inside an NVTX
range named after it, so ``ncu --nvtx --nvtx-include "<case>/"`` profiles just those launches:
flashtile at b = 1, 8k (contiguous, 16- and 256-token pages in random order: the start-up-bound
row and the two paged columns of issue 5's table), b = 32, 8k (contiguous, the cuDNN row) and b = 8,
64k (a split grid of 128 programs on 132 SMs, where cuDNN was 1%-2% ahead in session 13), and
SDPA's cuDNN backend on the head-major copies ``bench decode`` gives it; and, at b = 32, 64k, each kernel on
the other's layout (``ft_b32_64k_head``, ``cudnn_b32_64k_seq``); and b = 32, 8k with one new key appended by each
decode kernel (``ft_b32_8k_append_triton`` / ``_gluon``: the Triton kernel's append cost it 5% there in session 18,
the Gluon kernel's little). GQA 32 / 8, d = 128, bf16, one query token, as in the table. Run without ncu it only
checks that every case runs.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_with_kvcache
from flashtile.env import overrides

H, H_K, D = 32, 8, 128


def flashtile_case(b: int, sk: int, page: int | None, head_major: bool = False, append_on: str | None = None):
    """flashtile's decode on FlashAttention's (b, s, h_k, d) cache, or (head_major) on a (b, s, h_k, d) view
    of head-major memory, as SDPA's cache is laid out. ``append_on`` "0" / "1": each call also appends one key
    (the cache's last, written back in place) on the Triton / Gluon decode kernel
    (FLASHTILE_DECODE_GLUON_WARP_KEYS, read by every call)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    if head_major:
        kc = torch.randn(b, H_K, sk, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        table = None
    elif page is None:
        kc = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
        table = None
    else:
        n = sk // page
        kc = torch.randn(b * n, page, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
        table = torch.randperm(b * n, device="cuda", generator=g).view(b, n).to(torch.int32)
    vc = torch.randn_like(kc)
    if append_on is None:
        return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
    k_new, v_new, shorter = kc[:, -1:].clone(), vc[:, -1:].clone(), lens - 1

    def run():
        with overrides({"FLASHTILE_DECODE_GLUON_WARP_KEYS": append_on}):  # the other cases keep the rule
            return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=shorter, causal=True)
    return run


def cudnn_case(b: int, sk: int, seq_major: bool = False):
    """SDPA cuDNN on head-major (b, h_k, s, d) tensors, as `bench decode` gives it, or (seq_major) on the
    transposed view of a FlashAttention-layout cache."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if seq_major:
        k = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    else:
        k = torch.randn(b, H_K, sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2, help="profiled calls per case")
    ap.add_argument("--cases", nargs="*", help="the cases to run (default: all)")
    args = ap.parse_args()
    cases = {
        "ft_b1_8k": lambda: flashtile_case(1, 8192, None),
        "ft_b1_8k_p16": lambda: flashtile_case(1, 8192, 16),
        "ft_b1_8k_p256": lambda: flashtile_case(1, 8192, 256),
        "ft_b32_8k": lambda: flashtile_case(32, 8192, None),
        "cudnn_b1_8k": lambda: cudnn_case(1, 8192),
        "cudnn_b32_8k": lambda: cudnn_case(32, 8192),
        "ft_b8_64k": lambda: flashtile_case(8, 65536, None),
        "cudnn_b8_64k": lambda: cudnn_case(8, 65536),
        # both kernels on both layouts at b = 32, 64k (session 16: on FlashAttention's layout flashtile leads,
        # on head-major memory cuDNN does; probe_decode_layout_h200_2026-11-30_session16.json)
        "ft_b32_64k": lambda: flashtile_case(32, 65536, None),
        "ft_b32_64k_head": lambda: flashtile_case(32, 65536, None, head_major=True),
        "cudnn_b32_64k": lambda: cudnn_case(32, 65536),
        "cudnn_b32_64k_seq": lambda: cudnn_case(32, 65536, seq_major=True),
        "ft_b32_8k_append_triton": lambda: flashtile_case(32, 8192, None, append_on="0"),
        "ft_b32_8k_append_gluon": lambda: flashtile_case(32, 8192, None, append_on="1"),
    }
    for name in args.cases or list(cases):
        make = cases[name]
        fn = make()
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        for _ in range(args.calls):
            torch.cuda.nvtx.range_push(name)
            fn()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"{name}: ran", flush=True)
        del fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
