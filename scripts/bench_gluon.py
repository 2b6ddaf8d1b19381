"""The Gluon forward kernels beside flashtile's Triton kernels and SDPA cuDNN, one process.

Usage (H200): PYTHONPATH=src python scripts/bench_gluon.py --out gluon.json
              PYTHONPATH=src python scripts/bench_gluon.py --fp8 --out gluon_fp8.json
Shapes of BASELINES.md (16k tokens, hidden 2048) at d = 64 and 128 (bf16 table) or 64 / 128 / 256
(--fp8), causal and not. Each row first checks the Gluon output against flashtile's Triton kernel
(max abs difference, recorded), then times them with triton's do_bench (median ms) and reports
TFLOP/s. The "triton" columns are the Triton kernels even where dispatch would route to Gluon.

--fp8 rows: Gluon fp8 (``gluon_fp8``: ``fp8.v_keys_major`` + kernel, as the dispatch route calls it:
quantize_qkv stores V keys-contiguous, so V^T is a view and no copy is made; ``gluon_fp8_k``: the
kernel alone on a prepared V^T),
Triton fp8 (the launcher ``attn_fwd_fp8``), Gluon bf16, Triton bf16 and cuDNN bf16 on the same
shape, and the fp8 / bf16 speed ratios (gluon_fp8 over gluon bf16, triton fp8 over triton bf16).
Run it after `gpu_check.sh tests-gluon` passes: an untested kernel may hang, so gpu_check runs this
under a timeout too (bench-gluon).
"""

import argparse
import json
import sys
import time

import torch
import triton

import flashtile
from flashtile import config
from flashtile.backends.triton.attn_fwd_fp8 import attn_fwd_fp8
from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd, gluon_attn_fwd_fp8
from flashtile.bench.peers import PEERS
from flashtile.bench.shapes import Shape, attention_flops
from flashtile.fp8 import quantize_qkv, v_keys_major
from flashtile.params import AttnParams


def _time_all(q, k, v, causal, extra=None) -> dict:
    """Median ms of the Gluon kernel, the Triton kernel and SDPA cuDNN on one input (plus ``extra``)."""
    b, s, h, d = q.shape
    cudnn = PEERS["cudnn"]  # the benchmark's own peer: (b, h, s, d) views, backend chosen once
    sdpa = cudnn.build(Shape(b, h, s, d, causal), "cuda")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns = dict(extra or {})
    fns.update(gluon=lambda: gluon_attn_fwd(q, k, v, None, causal),
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


def _fp8_fns(q8, k8, v8, v8t, qd, kd, vd, p) -> dict:
    return dict(gluon_fp8=lambda: gluon_attn_fwd_fp8(q8, k8, v_keys_major(v8, varlen=False), qd, kd, vd, None,
                                                     p.causal),
                gluon_fp8_k=lambda: gluon_attn_fwd_fp8(q8, k8, v8t, qd, kd, vd, None, p.causal),
                triton_fp8=lambda: attn_fwd_fp8(q8, k8, v8, p))


def _fp8_rows(args) -> list:
    """fp8 beside bf16 on each shape; one printed line per row."""
    rows = []
    names = ("gluon_fp8", "gluon_fp8_k", "triton_fp8", "gluon", "triton", "cudnn")
    print(f"{'d':>4} {'s':>6} {'causal':>6} " + " ".join(f"{n:>11}" for n in names)
          + "  gluon fp8/bf16  triton fp8/bf16  gluon/triton fp8  max|diff|")
    for d in args.d:
        h = 2048 // d
        for s in args.seqlens:
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
            v8t = v_keys_major(v8, varlen=False)
            for causal in (False, True):
                p = AttnParams(softmax_scale=1.0 / d**0.5, causal=causal, window_right=0 if causal else -1,
                               q_descale=qd, k_descale=kd, v_descale=vd)
                extra = _fp8_fns(q8, k8, v8, v8t, qd, kd, vd, p)
                try:
                    diff = (gluon_attn_fwd_fp8(q8, k8, v8t, qd, kd, vd, None, causal)[0].float()
                            - attn_fwd_fp8(q8, k8, v8, p)[0].float()).abs().max().item()
                except Exception as exc:
                    diff = float("nan")
                    print(f"  check: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                ms = _time_all(q, k, v, causal, extra)
                flops = attention_flops(b, h, s, d, causal)
                tf = {n: (flops / t / 1e9 if t else None) for n, t in ms.items()}

                def ratio(a, c, ms=ms):
                    return ms[c] / ms[a] if ms.get(a) and ms.get(c) else float("nan")

                ratios = dict(gluon_fp8_over_bf16=ratio("gluon_fp8", "gluon"),
                              triton_fp8_over_bf16=ratio("triton_fp8", "triton"),
                              gluon_over_triton_fp8=ratio("gluon_fp8", "triton_fp8"))
                rows.append(dict(d=d, s=s, b=b, h=h, causal=causal, ms=ms, tflops=tf, speedups=ratios,
                                 max_abs_diff_fp8=diff))
                cells = " ".join(f"{tf[n]:11.1f}" if tf.get(n) else "        n/a" for n in names)
                print(f"{d:>4} {s:>6} {str(causal):>6} {cells}  {ratios['gluon_fp8_over_bf16']:14.2f}  "
                      f"{ratios['triton_fp8_over_bf16']:15.2f}  {ratios['gluon_over_triton_fp8']:16.2f}  {diff:.2e}",
                      flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gluon.json")
    ap.add_argument("--d", type=int, nargs="+", default=None, help="default 64 128 (bf16), 64 128 256 (--fp8)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--fp8", action="store_true", help="fp8 rows (Gluon and Triton fp8 beside bf16)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon.py needs a GPU")
    if args.d is None:
        args.d = [64, 128, 256] if args.fp8 else [64, 128]
    if args.fp8:
        _write(args, _fp8_rows(args))
        return
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
    _write(args, rows)


def _write(args, rows):
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv), unit="TFLOP/s, ms")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    with config.override(gluon_fwd=False):  # the "triton" columns time the Triton kernel, whatever the route table says
        main()
