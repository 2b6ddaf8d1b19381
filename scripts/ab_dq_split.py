"""A/B of the Triton dQ kernel's head-dim split on the GPU: q / k of 192 columns as a 128-wide tile and a 64-wide
tail (the default, backends/triton/attn_bwd.dq_head_dims) against one tile padded to 256 (the kernel before the
split), in one process, alternated rounds.

Usage: PYTHONPATH=src python scripts/ab_dq_split.py --out $OUT/ab_dq_split.json [--seqlens 4096 16384 --rounds 3]

Rows: bf16, q / k 192 with v 128 (DeepSeek-V3) and 192 with v 192, hidden 16 heads, 16k tokens a batch, causal and
not; the time is the backward, (forward + backward) - forward. The gradients of the two builds are compared first
(the same products summed in another order: within a bf16 rounding of each other). Two more columns run the split
build with 2- and 3-stage dQ pipelines (the table's 256-bucket tile has 1 stage, which the padded tile needed; the
split one fits 2 in 160 KiB and 3 in 200 KiB of shared memory); a winner there becomes a d = 192 table row.
"""

import argparse
import json
import statistics
import sys
from contextlib import contextmanager

import torch
import triton

import flashtile
from flashtile import config
from flashtile.backends.triton import attn_bwd
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench, time_in_rounds
from flashtile.kernels.attn_bwd import bwd_configs


@contextmanager
def padded():
    """The dQ kernel with one padded tile, as before the split."""
    split = attn_bwd.dq_head_dims
    attn_bwd.dq_head_dims = lambda d, dv: dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
                                               **({} if dv == d else dict(HEAD_DIM_V=dv,
                                                                         BLOCK_DV=triton.next_power_of_2(dv))))
    try:
        yield
    finally:
        attn_bwd.dq_head_dims = split


def _row(d, dv, s, causal, rounds, tokens=16384, h=16):
    b = max(1, tokens // s)
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
    grads = lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), g)
    split_grads = grads()
    with padded():
        pad_grads = grads()
    diff = max((a.float() - b_.float()).abs().max().item() / max(b_.float().abs().max().item(), 1e-6)
               for a, b_ in zip(split_grads, pad_grads))

    def timer(ctx):
        def run():
            with ctx():
                step = bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal).backward(g), "cuda",
                             grad_to_none=[q, k, v])
                fwd = bench(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), "cuda")
            return step - fwd
        return run

    from contextlib import nullcontext

    kv_tiles, (bm, bn, warps, _) = bwd_configs("sm90", 256, causal=causal, max_seqlen=s)

    def stages(n):
        return lambda: config.override(bwd_tiles=(kv_tiles, (bm, bn, warps, n)))
    timers = [("split", timer(nullcontext)), ("padded", timer(padded)), ("split-s2", timer(stages(2))),
              ("split-s3", timer(stages(3)))]
    results, failed = time_in_rounds(timers, rounds)
    ms = {n: statistics.median(r) for n, r in results.items()}
    ratio = statistics.median(p / s_ for s_, p in zip(results.get("split", []), results.get("padded", []))) \
        if "split" in results and "padded" in results else None
    return dict(d=d, dv=dv, s=s, b=b, h=h, causal=causal, bwd_ms=ms, padded_over_split=ratio, rel_grad_diff=diff,
                errors={n: repr(e)[:200] for n, e in failed.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meta = collect_meta(sys.argv[1:], "cuda", program=f"python {sys.argv[0]}")
    rows = []
    for dv in (128, 192):
        for causal in (False, True):
            for s in args.seqlens:
                row = _row(192, dv, s, causal, args.rounds)
                rows.append(row)
                times = ", ".join(f"{n} {t:.3f}" for n, t in row["bwd_ms"].items())
                print(f"d=192 dv={dv} s={s} causal={causal}: bwd {times} ms, padded / split "
                      f"{row['padded_over_split'] or 0:.3f}, grad diff {row['rel_grad_diff']:.1e} "
                      f"{row['errors'] or ''}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
