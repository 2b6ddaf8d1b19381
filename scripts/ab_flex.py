"""A/B of one setting of the flex kernels on the GPU, on against off in alternated rounds in one process, the
results compared first: ``--setting gluon_flex`` (the Gluon forward against the Triton one), ``tma`` (the Triton
forward's K / V through tensor descriptors against pointer loads), ``gluon_flex_bwd`` (the backward with its
dK/dV half on the Gluon kernel against the Triton one; timed as the backward alone, gradients compared) or
``gluon_fused_dq`` (the Gluon dK/dV kernel's fused dQ build against the same kernel with the Triton dQ kernel).

Usage: PYTHONPATH=src python scripts/ab_flex.py --setting gluon_flex --out $OUT/ab_flex.json [--seqlens 4096 16384]

Rows: the variants of `python -m flashtile.bench flex` (d = 128, bf16, h = 16, b = 16k / s). A path
wins a default only where it is faster beyond noise; else it is removed (its numbers in the commit message).
"""

import argparse
import json
import statistics
import sys

import torch

from flashtile import config
from flashtile.bench.flex import VARIANTS, build_variant
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench, time_in_rounds
from flashtile.flex import create_block_mask, flex_attention


def _row(setting, name, s, rounds, d=128, hidden=2048, tokens=16384):
    h, b = hidden // d, max(1, tokens // s)
    score_mod, mask_mod = build_variant(name, b, h, s, "cuda")
    mask = create_block_mask(mask_mod, b if name == "document" else None, None, s, s, device="cuda")
    backward = setting in ("gluon_flex_bwd", "gluon_fused_dq")
    # the fused build is a build of the Gluon dK/dV kernel: both sides run that kernel
    base = dict(gluon_flex_bwd=True) if setting == "gluon_fused_dq" else {}
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
    if backward:  # one forward; each call runs the backward alone
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
        g = torch.randn_like(out)

    def call(on):
        with config.override(**base, **{setting: on}):
            if backward:
                return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)

    def flat(result):  # outside the timed calls: a copy there would time both sides' extra work
        return torch.cat([x.flatten() for x in result]).float() if backward else result.float()

    diff = (flat(call(True)) - flat(call(False))).abs().max().item()

    def timer(on):
        return lambda: bench(lambda: call(on), "cuda")
    results, failed = time_in_rounds([("on", timer(True)), ("off", timer(False))], rounds)
    ms = {n: statistics.median(r) for n, r in results.items()}
    ratios = [p / t for t, p in zip(results.get("on", []), results.get("off", []))]
    return dict(setting=setting, variant=name, s=s, b=b, h=h, d=d, ms=ms, rounds_ms=results, max_diff=diff,
                off_over_on=statistics.median(ratios) if ratios else None,
                errors={n: repr(e)[:200] for n, e in failed.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--setting", choices=("gluon_flex", "tma", "gluon_flex_bwd", "gluon_fused_dq"), required=True)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meta = collect_meta(sys.argv[1:], "cuda", program=f"python {sys.argv[0]}")
    rows = []
    for s in args.seqlens:
        for name in args.variants:
            row = _row(args.setting, name, s, args.rounds)
            rows.append(row)
            print(f"{name} s={s}: on {row['ms'].get('on', 0):.3f} ms, off {row['ms'].get('off', 0):.3f} ms,"
                  f" off / on {row['off_over_on'] or 0:.3f}, |diff| {row['max_diff']:.1e} "
                  f"{row['errors'] or ''}", flush=True)
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
