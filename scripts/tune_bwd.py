"""Sweep backward tile configs on the GPU; print, save and optionally emit the winners.

Usage (H200): PYTHONPATH=src python scripts/tune_bwd.py --out $OUT/tune_bwd.json --emit-table $OUT/bwd_table.json
then FLASHTILE_BWD_CONFIGS=$OUT/bwd_table.json python -m flashtile.bench bwd ... measures with the winners,
which go into BWD_CONFIGS in src/flashtile/kernels/attn_bwd.py with the JSON committed.
Time is the backward alone: one forward, then autograd.grad with retain_graph, median of do_bench.
"""

import argparse
import itertools
import json
import sys
import time

import torch
import triton

import flashtile
from flashtile.backends.triton import attn_bwd as launcher

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates for each kernel; pairs are swept jointly.
DKDV = {
    64: [(64, 128, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (32, 128, 4, 2)],
    128: [(64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2), (64, 128, 8, 1)],
    256: [(32, 64, 8, 1), (32, 64, 4, 1), (16, 64, 4, 1), (32, 32, 4, 2)],
}
DQ = {
    64: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2)],
    128: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
    256: [(64, 32, 8, 1), (64, 32, 4, 1), (32, 64, 4, 1)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bwd.json")
    ap.add_argument("--emit-table", default=None)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--tma", choices=("off", "on", "both"), default="both",
                    help="tensor-descriptor loads in the backward (FLASHTILE_BWD_TMA)")
    ap.add_argument("--fused-dq", action="store_true",
                    help="time the fused dK/dV + atomic-dQ variant (FLASHTILE_BWD_FUSED_DQ) instead of the split")
    args = ap.parse_args()
    rows, best = [], {}
    launcher.FUSED_OVERRIDE = bool(args.fused_dq)
    for d in args.d:
        h, b = 2048 // d, 16384 // args.s
        q, k, v = (torch.randn(b, args.s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, args.s, h, d, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
            flops = 2.5 * 4 * b * h * args.s * args.s * d / (2 if causal else 1)
            tma_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
            for tma, kv_cfg, q_cfg in itertools.product(tma_modes, DKDV[d], DQ[d]):
                launcher.CONFIG_OVERRIDE, launcher.TMA_OVERRIDE = (kv_cfg, q_cfg), tma
                try:
                    ms = triton.testing.do_bench(
                        lambda o=out, x=(q, k, v), g=g: torch.autograd.grad(o, x, g, retain_graph=True),
                        warmup=25, rep=100, return_mode="median")
                    tf, err = flops / ms / 1e9, None
                except Exception as exc:  # shared-memory or register limits: record and go on
                    ms, tf, err = None, None, f"{type(exc).__name__}: {str(exc)[:200]}"
                row = dict(d=d, s=args.s, causal=causal, tma=tma, fused_dq=bool(args.fused_dq), dkdv=kv_cfg, dq=q_cfg,
                           ms=ms, tflops=tf, error=err)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if tf and tf > best.get((d, causal), (0,))[0]:
                    best[(d, causal)] = (tf, kv_cfg, q_cfg, tma)
    launcher.CONFIG_OVERRIDE = launcher.TMA_OVERRIDE = launcher.FUSED_OVERRIDE = None
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("best per (d, causal): TFLOP/s, dkdv cfg, dq cfg, tma")
    for key, val in sorted(best.items()):
        print(key, f"{val[0]:.0f}", val[1], val[2], val[3])
    if args.emit_table:
        # one row per head-dim bucket: the config pair with the best causal + non-causal sum
        table = {}
        for d in args.d:
            score = {}
            for r in rows:
                if r["d"] == d and r["tflops"] and r["tma"] == best.get((d, False), (0, 0, 0, False))[3]:
                    key = (tuple(r["dkdv"]), tuple(r["dq"]))
                    score[key] = score.get(key, 0.0) + r["tflops"]
            if score:
                kv_cfg, q_cfg = max(score, key=score.get)
                table[f"sm90,{d}"] = [list(kv_cfg), list(q_cfg)]
        with open(args.emit_table, "w") as f:
            json.dump(table, f, indent=1)
        print("table:", json.dumps(table))


if __name__ == "__main__":
    main()
