"""A/B of flashtile's own routes in one process: the same calls with the Gluon kernels on (the route table's
choice) and off (the Triton kernels), in alternated rounds; prints and saves each row's median times and ratio.

Usage: PYTHONPATH=src python scripts/ab_routes.py --out $OUT/ab.json [--d 128 --dv 128 --seqlens 2048 8192
       --windows -1 256 1024 --softcaps 0 30 --modes fwd bwd --rounds 3 --varlen [--own-k] --dtype fp16]

Rows: bf16 (--dtype), hidden 2048 (h = 2048 / d), 16k tokens a batch (--tokens), causal, window_size = (w, 0) for
each w (-1: no window), each softcap (0: none); --varlen packs the batch's sequences into one (total, h, d) call with
cu_seqlens (flash_attn_varlen_func), and --own-k gives k 2s tokens a sequence with cu_seqlens of its own (the
queries are the last s: a prompt after a cached prefix). bwd is (forward + backward) - forward. This is how a
route-table entry (gluon_route.ROUTE_TABLE, gluon_bwd.ROUTE_TABLE) is decided: the Gluon side must be faster
beyond noise at the row's length.
"""

import argparse
import json
import statistics
import sys

import torch

import flashtile
from flashtile import config
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench, bench_graph, time_in_rounds
from flashtile.modules.mha import get_alibi_slopes


def _row(d, dv, s, w, cap, mode, rounds, varlen=False, graph=False, tokens=16384, alibi=False, own_k=False,
         dtype=torch.bfloat16):
    h, b = 2048 // d, max(1, tokens // s)
    shape = (b * s,) if varlen else (b, s)
    # own_k: each sequence's s queries are the last of its 2s keys (a prompt after a cached prefix)
    sk = 2 * s if own_k else s
    shape_k = (b * sk,) if varlen else (b, s)
    q = torch.randn(*shape, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(*shape_k, h, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(*shape_k, h, dv, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(*shape, h, dv, device="cuda", dtype=dtype)
    cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, b * sk + 1, sk, device="cuda", dtype=torch.int32) if own_k else cu
    slopes = torch.tensor(get_alibi_slopes(h), device="cuda", dtype=torch.float32) if alibi else None

    def call():
        if varlen:
            return flashtile.flash_attn_varlen_func(q, k, v, cu, cu_k, s, sk, causal=True, window_size=(w, 0),
                                                    softcap=cap, alibi_slopes=slopes)
        return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0), softcap=cap, alibi_slopes=slopes)

    def timer(gluon):
        def run():
            with config.override(gluon=gluon):
                if graph:  # the kernels alone: short rows are otherwise bound by the host's launch path
                    return bench_graph(call, "cuda")
                f_ms = bench(call, "cuda")
                if mode == "fwd":
                    return f_ms
                return bench(lambda: call().backward(g), "cuda", grad_to_none=[q, k, v]) - f_ms
        return run

    with config.override(gluon=True):
        on = call()
    with config.override(gluon=False):
        off = call()
    err = (on.float() - off.float()).abs().max().item()
    results, failed = time_in_rounds([("gluon", timer(True)), ("triton", timer(False))], rounds)
    ms = {name: statistics.median(r) for name, r in results.items()}
    ratios = [t / g for g, t in zip(results.get("gluon", []), results.get("triton", []))]
    return dict(dtype=str(dtype).removeprefix("torch."), d=d, dv=dv, s=s, window_left=w, softcap=cap, varlen=varlen,
                alibi=alibi, own_k=own_k, graph=graph,
                mode=mode,
                b=b, h=h, ms=ms,
                rounds_ms=results, ratio=statistics.median(ratios) if ratios else None, max_diff=err,
                errors={n: repr(e)[:200] for n, e in failed.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dv", type=int, default=None)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--windows", type=int, nargs="+", default=[-1, 256, 1024])
    ap.add_argument("--softcaps", type=float, nargs="+", default=[0.0])
    ap.add_argument("--modes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--varlen", action="store_true", help="the batch as packed sequences (flash_attn_varlen_func)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi with the standard slopes")
    ap.add_argument("--own-k", action="store_true",
                    help="with --varlen: k of 2s tokens a sequence with its own cu_seqlens_k (q: the last s)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a batch (more: short rows outgrow host time)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernels alone; --modes fwd)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    args = ap.parse_args()
    if args.own_k and not args.varlen:
        ap.error("--own-k needs --varlen")
    if args.graph and "bwd" in args.modes:
        # a capture of the backward after the forward's in one process failed on an H100 (stream capture
        # invalidated); --tokens takes short backward rows past host time instead
        ap.error("--graph times the forward only: pass --modes fwd (or --tokens for backward rows)")
    meta = collect_meta(sys.argv[1:], "cuda", program=f"python {sys.argv[0]}")
    rows = []
    for s in args.seqlens:
        for w, cap, mode in ((w, c, m) for w in args.windows for c in args.softcaps for m in args.modes):
            row = _row(args.d, args.dv or args.d, s, w, cap, mode, args.rounds, args.varlen, args.graph,
                       args.tokens, args.alibi, args.own_k, dict(bf16=torch.bfloat16, fp16=torch.float16)[args.dtype])
            rows.append(row)
            print(f"{args.dtype} d={row['d']} dv={row['dv']} s={s} window={w} softcap={cap} alibi={args.alibi} "
                  f"own_k={args.own_k} {mode}: gluon {row['ms'].get('gluon', 0):.3f} "
                  f"triton {row['ms'].get('triton', 0):.3f} ms, triton / gluon {row['ratio'] or 0:.3f}, "
                  f"|diff| {row['max_diff']:.1e} {row['errors'] or ''}", flush=True)
            with open(args.out, "w") as f:  # after every row, so a run cut short keeps what it measured
                json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
