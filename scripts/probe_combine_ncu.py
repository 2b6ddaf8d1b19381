"""Decode calls whose split merge Nsight Compute profiles (session 21: why does the whole-row TMA kernel's merge take
4.4 us at b = 32 and 2.8 at b = 8, with the same 2 MB of partials?). Each case runs under an NVTX range of its name;
profile with ncu --nvtx --nvtx-include "<case>/" -k regex:combine.
    PYTHONPATH=src python scripts/probe_combine_ncu.py [CASE ...]
Cases: tma_b32 (the whole-row TMA kernel, 4 splits), tma_b8 (16 splits), triton_b32 (the Triton split kernel
forced to 4 splits). GQA 32 / 8, d = 128, bf16, 16k keys."""

import sys

import torch

from flashtile import flash_attn_with_kvcache
from flashtile.env import overrides

CASES = {"tma_b32": (32, {"FLASHTILE_DECODE_GLUON_ROWS": "1"}, 0),
         "tma_b8": (8, {"FLASHTILE_DECODE_GLUON_ROWS": "1"}, 0),
         "triton_b32": (32, {"FLASHTILE_DECODE_GLUON_WARP_KEYS": "0"}, 4)}


def main(names):
    for name in names or CASES:
        b, env, splits = CASES[name]
        with overrides(env):
            q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(b, 16384, 8, 128, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            lens = torch.full((b,), 16384, device="cuda", dtype=torch.int32)
            for _ in range(2):
                flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
            for _ in range(3):
                flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(name, "ran", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
