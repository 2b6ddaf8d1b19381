"""Forward throughput beyond the square shapes: sliding window and varlen with mixed lengths.

Usage (GPU): PYTHONPATH=src python scripts/bench_fwd_extras.py --out fwd_extras.json
FLOPs count only the attended (i, j) pairs, so the numbers compare with the dense rows.
"""

import argparse
import json
import time

import torch
import triton

import flashtile


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def window_pairs(s: int, w: int) -> int:
    """Attended pairs of a causal window of w keys left of the diagonal (inclusive)."""
    return sum(min(i, w) + 1 for i in range(s))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fwd_extras.json")
    args = ap.parse_args()
    dev, dt, d = "cuda", torch.bfloat16, 128
    rows = []
    # sliding window: s = 16k, w = 1024, causal (left window), h = 16, b = 1
    s, h, w = 16384, 16, 1024
    q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=dt) for _ in range(3))
    ms_win = bench(lambda: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0)))
    ms_causal = bench(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
    flops_win = 4 * h * window_pairs(s, w) * d
    flops_causal = 4 * h * s * (s + 1) // 2 * d
    rows.append(dict(case="sliding_window", s=s, w=w, h=h, d=d, ms=ms_win, tflops=flops_win / ms_win / 1e9,
                     causal_ms=ms_causal, causal_tflops=flops_causal / ms_causal / 1e9,
                     speedup_vs_causal=ms_causal / ms_win))
    # varlen: mixed lengths 64..4096, about 64k tokens, causal, h = 16
    g = torch.Generator().manual_seed(0)
    lens = []
    while sum(lens) < 65536:
        lens.append(int(torch.randint(64, 4097, (1,), generator=g)))
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, device=dev, dtype=dt) for _ in range(3))
    ms_var = bench(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True))
    flops_var = sum(4 * h * n * (n + 1) // 2 * d for n in lens)
    # the padded alternative a user would otherwise run: every sequence padded to the longest
    qp, kp, vp = (torch.randn(len(lens), max(lens), h, d, device=dev, dtype=dt) for _ in range(3))
    ms_pad = bench(lambda: flashtile.flash_attn_func(qp, kp, vp, causal=True))
    rows.append(dict(case="varlen_mixed", sequences=len(lens), total_tokens=total, h=h, d=d, ms=ms_var,
                     tflops=flops_var / ms_var / 1e9, padded_ms=ms_pad, speedup_vs_padded=ms_pad / ms_var))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command="python scripts/bench_fwd_extras.py")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    for r in rows:
        print(r["case"], f"{r['ms']:.3f} ms", f"{r['tflops']:.0f} TFLOP/s",
              {key: round(val, 2) for key, val in r.items() if key.startswith("speedup")})


if __name__ == "__main__":
    main()
