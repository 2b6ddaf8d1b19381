"""Paged caches on the whole-row kernel against the per-head paged kernel, and both against the contiguous cache
(session 26).

Usage: PYTHONPATH=src python scripts/probe_paged_rows.py --out paged_rows.json [--batches 8 32 64]
       [--seqlens 8192 32768 131072] [--pages 16 256] [--rounds 2] [--settings NAME=VAR=V,VAR=V ...]
       [--paged-settings NAME=VAR=V,VAR=V ...]

Until session 26 a paged call (block_table) never reached the whole-row kernel: at b = 64 the per-head paged kernel
took 24%-29% longer than the contiguous cache on 16-token pages. A page of 16 keys at 8 kv heads of d = 128 is 32 KB
of whole key rows, the row kernel's tile, so the row kernel can read a paged cache as it reads a contiguous one.
For each (b, seqlen_k), in 8-layer graphs (bench decode's layer budget) with rounds rotating, one process:
- ``contiguous``: the default on the contiguous cache (the row kernel where its rule takes the call);
- ``paged{P}_rows``: pages of P tokens, scattered as an allocator leaves them, on the row kernel
  (FLASHTILE_DECODE_ROWS=8);
- ``paged{P}_per_head``: the same pages on the per-head paged kernel (FLASHTILE_DECODE_ROWS=0);
- any ``--settings`` on the contiguous cache (e.g. ``w16=FLASHTILE_DECODE_ROWS=8,FLASHTILE_DECODE_ROWS_CFG=16,16,3``),
  and any ``--paged-settings`` on the row kernel over every page size (``paged{P}_NAME``).
Every setting's output is checked against the contiguous default's (``check_max_abs``).
"""

import argparse
import sys

import torch
from probe_read_ceiling import layer_inputs, parse_settings, print_and_save

from flashtile import flash_attn_with_kvcache
from flashtile.bench.decode import _page_order, _paged, _time_in_rounds
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench_graph
from flashtile.env import overrides

ROWS = {"FLASHTILE_DECODE_ROWS": "8"}
PER_HEAD = {"FLASHTILE_DECODE_ROWS": "0"}


def _timer(calls, env, warmup, rep):
    def run():
        with overrides(env):  # read when the graph is captured
            return bench_graph(lambda: [c() for c in calls], "cuda", warmup, rep) * 1e3 / len(calls)
    return run


def run_row(b, sk, pages, settings, rounds, paged_settings=None, warmup=25, rep=100):
    kv_bytes, layers, q, lens, caches = layer_inputs(b, sk)
    row = {"b": b, "seqlen_k": sk, "layers": layers, "kv_bytes": kv_bytes, "us": {}, "rounds_us": {}, "tb_s": {},
           "check_max_abs": {}, "errors": {}}
    contiguous = [lambda kc=kc, vc=vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens) for kc, vc in caches]
    base = contiguous[0]().float()
    timers = [("contiguous", _timer(contiguous, {}, warmup, rep))]
    for name, env in settings.items():
        with overrides(env):
            row["check_max_abs"][name] = (contiguous[0]().float() - base).abs().max().item()
        timers.append((name, _timer(contiguous, env, warmup, rep)))
    _time_in_rounds(timers, rounds, row)
    gen = torch.Generator(device="cpu").manual_seed(b + sk)
    for page in pages:  # one page size's pools at a time (a row's caches twice over at most)
        order = _page_order(caches[0][0], page, gen)
        pools = [_paged(kc, vc, page, order) for kc, vc in caches]
        table = pools[0][2]  # every layer's pool in one order: one table serves them all
        calls = [lambda kp=kp, vp=vp, t=table: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=t)
                 for kp, vp, _ in pools]
        timers = []
        kinds = {"rows": ROWS, "per_head": PER_HEAD, **{n: {**ROWS, **e} for n, e in (paged_settings or {}).items()}}
        for kind, env in kinds.items():
            name = f"paged{page}_{kind}"
            with overrides(env):
                row["check_max_abs"][name] = (calls[0]().float() - base).abs().max().item()
            timers.append((name, _timer(calls, env, warmup, rep)))
        _time_in_rounds(timers, rounds, row)
        del pools, calls, timers
        torch.cuda.empty_cache()
    for n, us in row["us"].items():
        row["rounds_us"].setdefault(n, [us] if us else [])
        row["tb_s"][n] = kv_bytes / (us * 1e-6) / 1e12 if us else None
    del caches
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--pages", type=int, nargs="*", default=[16, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", nargs="*", default=[], help="NAME=VAR=VALUE,VAR=VALUE: contiguous-cache settings")
    ap.add_argument("--paged-settings", nargs="*", default=[],
                    help="NAME=VAR=VALUE,...: more row-kernel settings on every page size (paged{P}_NAME)")
    args = ap.parse_args()
    settings, paged_settings = parse_settings(args.settings), parse_settings(args.paged_settings)
    meta = collect_meta(sys.argv, "cuda")
    rows = []
    for b in args.batches:
        for sk in args.seqlens:
            print(f"b={b} seqlen_k={sk}", flush=True)
            rows.append(run_row(b, sk, args.pages, settings, args.rounds, paged_settings))
            print_and_save(rows[-1], args.out, meta, rows)
            for n, err in rows[-1]["check_max_abs"].items():
                print(f"  check {n}: max |diff| {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
