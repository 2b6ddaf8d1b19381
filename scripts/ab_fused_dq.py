"""A/B of the backward's fused dQ build (config.gluon_fused_dq: the Gluon dK/dV kernel adds dQ by TMA reduce-add,
no dQ kernel) against the split backward (the route's dK/dV kernel, Gluon or at d = 64 Triton, then the Triton dQ
kernel), with torch SDPA's cuDNN backend beside them, in alternated rounds in one process; gradients compared
first.

Usage: PYTHONPATH=src python scripts/ab_fused_dq.py --out $OUT/ab_fused_dq.json [--d 128 256 --seqlens 1024 4096
       16384 --rounds 3]

Rows: bf16, hidden 2048 (h = 2048 / dv; --d 192 takes v of 128), 16k tokens a batch, causal and not; each time is
the backward alone (one forward, then torch.autograd.grad with the graph kept). TFLOP/s count the backward as 2.5x
the forward's 2 * b * h * s^2 * (d + dv) (halved when causal), as `python -m flashtile.bench bwd` does. The fused
build becomes the route where it is faster than the split beyond noise; if it loses everywhere it is removed.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import config
from flashtile.backends.triton.gluon_bwd import V_HEAD_DIM
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench, time_in_rounds


def _row(d, s, causal, rounds, tokens=16384, hidden=2048):
    dv = V_HEAD_DIM[d]  # 192: v of 128 (DeepSeek-V3's split)
    h, b = hidden // dv, max(1, tokens // s)  # 16 heads at (192, 128), as docs/models.md's rows
    q, k, v = (torch.randn(b, s, h, n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (d, d, dv))
    g = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    gt = g.transpose(1, 2)

    def ours(fused):
        def call():
            with config.override(gluon_fused_dq=fused):
                return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        return call

    def cudnn():
        return torch.autograd.grad(ref, (qt, kt, vt), gt, retain_graph=True)

    split, fused, peer = ours(False)(), ours(True)(), cudnn()
    scale = max(x.float().abs().max().item() for x in split)
    diff = dict(fused=max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, split)) / scale,
                cudnn=max((a.float() - b.transpose(1, 2).float()).abs().max().item()
                          for a, b in zip(split, peer)) / scale)
    del split, fused, peer
    timers = [("fused", lambda: bench(ours(True), "cuda")), ("split", lambda: bench(ours(False), "cuda")),
              ("cudnn", lambda: bench(cudnn, "cuda"))]
    results, failed = time_in_rounds(timers, rounds)
    ms = {n: statistics.median(r) for n, r in results.items()}
    flops = 2.5 * 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
    tflops = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}

    def ratio(a, b_):
        pairs = list(zip(results.get(a, []), results.get(b_, [])))
        return statistics.median(y / x for x, y in pairs) if pairs else None

    return dict(d=d, s=s, causal=causal, b=b, h=h, ms=ms, tflops=tflops, rounds_ms=results,
                split_over_fused=ratio("fused", "split"), cudnn_over_fused=ratio("fused", "cudnn"),
                relative_diff=diff, errors={n: repr(e)[:200] for n, e in failed.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meta = collect_meta(sys.argv[1:], "cuda", program=f"python {sys.argv[0]}")
    rows = []
    for d in args.d:
        for s in args.seqlens:
            for causal in (False, True):
                row = _row(d, s, causal, args.rounds)
                rows.append(row)
                t = row["tflops"]
                print(f"d={d} s={s} causal={causal}: fused {t.get('fused', 0):.0f} split {t.get('split', 0):.0f} "
                      f"cudnn {t.get('cudnn', 0):.0f} TFLOP/s; split/fused {row['split_over_fused'] or 0:.3f} "
                      f"cudnn/fused {row['cudnn_over_fused'] or 0:.3f}; rel diff {row['relative_diff']} "
                      f"{row['errors'] or ''}", flush=True)
                with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
