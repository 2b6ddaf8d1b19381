"""Sweep a short list of forward tile configs on the GPU; print and save TFLOP/s per config.

Usage (on the H200): PYTHONPATH=src python scripts/tune_fwd.py --out $OUT/tune_fwd.json
The winners go into FWD_CONFIGS in src/flashtile/kernels/attn_fwd.py by hand, with the JSON committed.
"""

import argparse
import json
import sys
import time

import torch
import triton

import flashtile
from flashtile import config

CONFIGS = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
          (64, 32, 4, 3)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 1), (64, 32, 4, 2)],
}



# --refine: neighbours of the first sweep's winners, TMA path only
REFINE = {
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 3)],
    128: [(64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 2)],
    256: [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 1), (128, 64, 8, 2), (32, 32, 4, 2)],
}


# --fp8: the e4m3 kernel (kernels/attn_fwd_fp8.py), TMA path: the first sweep's winners (64-row, one
# warp group) and their neighbours, plus the old 128-row guesses for reference
FP8 = {
    64: [(128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4)],
    128: [(64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 4), (64, 128, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3)],
    256: [(64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 4, 2), (128, 64, 8, 3)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_fwd.json")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--seqlens-by-d", default=None,
                    help='per-head-dim seqlens, e.g. "64:512,4096;128:1024,8192" (overrides --seqlens)')
    ap.add_argument("--refine", action="store_true", help="sweep REFINE (TMA only) instead of CONFIGS")
    ap.add_argument("--fp8", action="store_true", help="sweep FP8 configs of the e4m3 kernel (TMA path)")
    ap.add_argument("--emit-table", default=None,
                    help="write the winners as a FLASHTILE_FWD_CONFIGS file (short rows for s <= 1024)")
    args = ap.parse_args()
    if args.fp8 and args.emit_table:
        ap.error("--emit-table writes FLASHTILE_FWD_CONFIGS rows for the bf16 kernel; fp8 winners go into "
                 "FWD_FP8_CONFIGS (kernels/attn_fwd_fp8.py) by hand")
    table, paths = (REFINE, (True,)) if args.refine else (CONFIGS, (True, False))
    call = lambda q, k, v, c: flashtile.flash_attn_func(q, k, v, causal=c)  # noqa: E731
    if args.fp8:
        from flashtile.fp8 import quantize_qkv

        table, paths = FP8, (True,)
        fp8_cache = {}

        def call(q, k, v, c):
            if id(q) not in fp8_cache:
                fp8_cache.clear()
                fp8_cache[id(q)] = quantize_qkv(q, k, v)
            q8, k8, v8, qd, kd, vd = fp8_cache[id(q)]
            return flashtile.flash_attn_func(q8, k8, v8, causal=c, q_descale=qd, k_descale=kd, v_descale=vd)
    rows = []
    by_d = {}
    if args.seqlens_by_d:
        for part in args.seqlens_by_d.split(";"):
            d_str, lens = part.split(":")
            by_d[int(d_str)] = [int(x) for x in lens.split(",")]
    for d in args.d:
        h = 2048 // d
        for s in by_d.get(d, args.seqlens):
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                for tma in paths:
                    for cfg in table[d]:
                        # the Triton kernel's configs, never the Gluon route; a config that does not fit
                        # is recorded as failing, never run as another
                        pin = dict(fp8_tiles=cfg) if args.fp8 else dict(fwd_tiles=cfg)
                        t0 = time.time()
                        try:
                            with config.override(tma=tma, gluon_fwd=False, reduce_stages_on_oor=False, **pin):
                                ms = triton.testing.do_bench(
                                    lambda q=q, k=k, v=v, c=causal: call(q, k, v, c),
                                    warmup=25, rep=100, return_mode="median")
                            tf, err = flops / ms / 1e9, None
                        except Exception as exc:  # a config can exceed shared memory: record it
                            ms, tf, err = None, None, f"{type(exc).__name__}: {str(exc)[:200]}"
                        row = dict(d=d, s=s, causal=causal, tma=tma, cfg=cfg, ms=ms, tflops=tf, error=err,
                                   wall_s=round(time.time() - t0, 1))
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    best = {}
    for r in rows:
        key = (r["d"], r["s"], r["causal"])
        if r["tflops"] and r["tflops"] > best.get(key, (0,))[0]:
            best[key] = (r["tflops"], r["tma"], r["cfg"])
    print("best per shape (d, s, causal): tflops, tma, cfg")
    for key, val in sorted(best.items()):
        print(key, f"{val[0]:.0f}", val[1], val[2])
    if args.emit_table:
        table = {}
        for (d, s, causal), (_, tma, cfg) in best.items():
            if tma:  # the table is for the TMA path, which every aligned input takes on Hopper
                short = ",short" if s <= 1024 else ""
                table[f"sm90,{d},{causal}{short}"] = list(cfg)
        with open(args.emit_table, "w") as f:
            json.dump(table, f, indent=1)
        print("table:", json.dumps(table))


if __name__ == "__main__":
    main()
