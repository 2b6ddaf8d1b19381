"""The experimental Gluon forward kernel beside flashtile's Triton kernel and SDPA cuDNN, one process.

Usage (H200): PYTHONPATH=src python scripts/bench_gluon.py --out gluon.json
Shapes of BASELINES.md (16k tokens, hidden 2048) at d = 64 and 128, causal and not. Each row first
checks the Gluon output against flashtile's (max abs difference, recorded), then times the three
with triton's do_bench (median ms) and reports TFLOP/s. Run it after `gpu_check.sh tests-gluon`
passes: an untested kernel may hang, so gpu_check runs this under a timeout too (bench-gluon).
"""

import argparse
import json
import sys
import time

import torch
import triton

import flashtile
from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd
from flashtile.bench.peers import PEERS
from flashtile.bench.shapes import Shape, attention_flops


def _time_all(q, k, v, causal) -> dict:
    """Median ms of the Gluon kernel, the Triton kernel and SDPA cuDNN on one input."""
    b, s, h, d = q.shape
    cudnn = PEERS["cudnn"]  # the benchmark's own peer: (b, h, s, d) views, backend chosen once
    sdpa = cudnn.build(Shape(b, h, s, d, causal), "cuda")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns = dict(gluon=lambda: gluon_attn_fwd(q, k, v, None, causal),
               triton=lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
               cudnn=lambda: sdpa(qt, kt, vt))
    ms = {}
    with torch.no_grad(), cudnn.context():
        for name, fn in fns.items():
            try:
                ms[name] = triton.testing.do_bench(fn, warmup=100, rep=100, return_mode="median")
            except Exception as exc:  # a peer missing on this build: record, go on
                ms[name] = None
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gluon.json")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon.py needs a GPU")
    rows = []
    print(f"{'d':>4} {'s':>6} {'causal':>6} {'gluon':>7} {'triton':>7} {'cudnn':>7}  gluon/triton  max|diff|")
    for d in args.d:
        h = 2048 // d
        for s in args.seqlens:
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                diff = (gluon_attn_fwd(q, k, v, None, causal)[0].float()
                        - flashtile.flash_attn_func(q, k, v, causal=causal).float()).abs().max().item()
                ms = _time_all(q, k, v, causal)
                flops = attention_flops(b, h, s, d, causal)
                tf = {n: (flops / t / 1e9 if t else None) for n, t in ms.items()}
                rows.append(dict(d=d, s=s, b=b, h=h, causal=causal, ms=ms, tflops=tf, max_abs_diff=diff))
                ratio = ms["triton"] / ms["gluon"] if ms["gluon"] and ms["triton"] else float("nan")
                cells = " ".join(f"{tf[n]:7.1f}" if tf[n] else "    n/a" for n in ("gluon", "triton", "cudnn"))
                print(f"{d:>4} {s:>6} {str(causal):>6} {cells}  {ratio:12.2f}  {diff:.2e}", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv), unit="TFLOP/s, ms")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
