"""Sweep the split-KV decode kernel's configs (BLOCK_N, num_warps, num_stages) and split counts on the GPU.

Usage (H200): PYTHONPATH=src python scripts/tune_decode.py --out $OUT/tune_decode.json
Times CUDA-graph replays of one decode step (GQA 32/8, d 128, bf16, one query token, no new keys)
on contiguous and paged caches, so the numbers are kernel time without the host launch path.
Every call takes the split route (FLASHTILE_DECODE_ROUTE=split) with the config as its tiles (the ``decode_tiles``
setting). Paged launches add two pipeline stages on top of the config's (as backends/triton/decode/route.py does),
so a config's stages mean the same pipeline depth for both layouts. The winners go into DECODE_CONFIGS
(src/flashtile/kernels/decode.py) by hand.
"""

import argparse
import itertools
import json
import sys
import time

import torch
import triton

from flashtile import config, flash_attn_with_kvcache
from flashtile.bench.timing import bench_graph

# NUM_SPLITS is a constexpr: keep the product small. (128, 4, 2): paged launches at 4 stages fit
# two CTAs per SM (74 KB of shared memory against 140 KB at 5, compiled for sm_90)
CONFIGS = [(64, 4, 3), (128, 4, 3), (32, 4, 3), (64, 8, 3), (128, 4, 2)]
SPLITS = [0, 32]  # 0 = the heuristic


def caches(b, sk, h_k, d, page, order="random"):
    g = torch.Generator(device="cuda").manual_seed(0)
    if page is None:
        kc = torch.randn(b, sk, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g)
        return kc, torch.randn_like(kc), None
    n = sk // page
    kc = torch.randn(b * n, page, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g)
    # random: pages scattered as an allocator leaves them (the benchmark's layout); sequential: in
    # memory order, which tells the cost of the page lookup apart from that of the scattered reads
    if order == "random":
        perm = torch.randperm(b * n, device="cuda", generator=g)
    else:
        perm = torch.arange(b * n, device="cuda")
    table = perm.view(b, n).to(torch.int32)
    return kc, torch.randn_like(kc), table


def time_step(q, kc, vc, lens, table, splits) -> float:
    """Microseconds of one decode step replayed from a CUDA graph."""
    step = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,  # noqa: E731
                                           causal=True, num_splits=splits)
    return 1e3 * bench_graph(step, "cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_decode.json")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--pages", type=int, nargs="*", default=[16, 256], help="paged variants besides contiguous")
    ap.add_argument("--page-orders", nargs="+", default=["random"], choices=["random", "sequential"],
                    help="page orders of the paged variants")
    ap.add_argument("--configs", default=None, help='override the config list, e.g. "64,4,3;128,8,3"')
    ap.add_argument("--splits", type=int, nargs="+", default=SPLITS,
                    help="split counts to try (0 = the heuristic), e.g. 0 4 8 16 for b = 1 paged caches")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_decode.py times CUDA graphs: it needs a GPU")
    h, h_k, d = 32, 8, 128
    rows = []
    configs = [tuple(map(int, c.split(","))) for c in args.configs.split(";")] if args.configs else CONFIGS
    layouts = [(None, None)] + [(p, o) for p in args.pages for o in args.page_orders]
    for b, sk, (page, order) in itertools.product(args.batch, args.seqlens, layouts):
        kc, vc, table = caches(b, sk, h_k, d, page, order)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
        floor_bytes = 2 * b * sk * h_k * d * 2
        for cfg, splits in itertools.product(configs, args.splits):
            tiles = (64, *cfg) if page is None else (64, cfg[0], cfg[1], cfg[2] + 2)
            # a config that does not fit is recorded as failing, never run as another
            with config.override(decode_route="split", decode_tiles=tiles, reduce_stages_on_oor=False):
                try:
                    us, err = time_step(q, kc, vc, lens, table, splits), None
                except Exception as exc:  # shared memory limits: record and go on
                    us, err = None, f"{type(exc).__name__}: {str(exc)[:160]}"
            row = dict(b=b, seqlen_k=sk, page=page, order=order, cfg=cfg, num_splits=splits, us=us,
                       gb_s=floor_bytes / us / 1e3 if us else None, error=err)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del kc, vc, table
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("best per (b, seqlen_k, page, order): us, GB/s, cfg, num_splits")
    shape = lambda r: (r["b"], r["seqlen_k"], r["page"], r["order"])  # noqa: E731
    for key in dict.fromkeys(shape(r) for r in rows):
        ok = [r for r in rows if shape(r) == key and r["us"]]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            print(key, f"{best['us']:.1f}", f"{best['gb_s']:.0f}", best["cfg"], best["num_splits"])


if __name__ == "__main__":
    main()
