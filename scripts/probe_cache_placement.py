"""Does a decode call's time depend on where its cache was allocated? (session 30)

In separate processes the contiguous cache at b = 8, 128k took 940.9-967.6 us a call while the same process's
256-key paged pool, whose pages lie in random order, took 948.1-948.3 every time (merge_pdl_leaseB30_...json).
This allocates ``--caches`` separate contiguous caches of one shape in one process and times the default decode
call on each (a CUDA graph of ``--layers`` calls on that one cache), ``--rounds`` times with the order rotating,
beside SDPA's cuDNN backend on a (b, h_k, s, d) copy of each cache. A spread that follows the cache, round after
round, is placement; one that moves between rounds is noise in time.

Usage (device): PYTHONPATH=src python scripts/probe_cache_placement.py --shapes 8x131072 32x65536 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from flashtile import flash_attn_with_kvcache
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench_graph

H, H_K, D, DEV = 32, 8, 128, "cuda"


def timers_for(b: int, s: int, n_caches: int, cudnn: bool):
    """(name, one call) for the default decode call on each of ``n_caches`` caches of (b, s) and, with ``cudnn``,
    SDPA's cuDNN backend on a (b, h_k, s, d) copy of each; and each flashtile cache's address."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=DEV).manual_seed(b * 1000003 + s)
    q = torch.randn(b, 1, H, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    qt = q.transpose(1, 2)
    lens = torch.full((b,), s, device=DEV, dtype=torch.int32)
    caches = []
    for _ in range(n_caches):
        kc = torch.randn(b, s, H_K, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        caches.append((kc, torch.randn_like(kc)))
    peers = [(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()) for k, v in caches] if cudnn else []

    def ours(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    def peer(kt, vt):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    timers = [(f"flashtile[{i}]", lambda kc=kc, vc=vc: ours(kc, vc)) for i, (kc, vc) in enumerate(caches)]
    timers += [(f"cudnn[{i}]", lambda kt=kt, vt=vt: peer(kt, vt)) for i, (kt, vt) in enumerate(peers)]
    return timers, {f"flashtile[{i}]": kc.data_ptr() for i, (kc, _) in enumerate(caches)}


def measure(b: int, s: int, args) -> dict:
    timers, addresses = timers_for(b, s, args.caches, not args.no_cudnn)
    times = {name: [] for name, _ in timers}
    for r in range(args.rounds):
        start = (r * len(timers)) // args.rounds  # each round starts elsewhere: an order effect moves
        for name, fn in timers[start:] + timers[:start]:
            us = bench_graph(lambda fn=fn: [fn() for _ in range(args.layers)], DEV) * 1e3 / args.layers
            times[name].append(us)
    print(f"b = {b}, s = {s}: us a call, {args.rounds} rounds (median, min-max, each round)")
    for name, ts in times.items():
        print(f"  {name:14s} {statistics.median(ts):8.1f}  {min(ts):8.1f}-{max(ts):8.1f}  "
              + " ".join(f"{t:.1f}" for t in ts), flush=True)
    return {"b": b, "seqlen_k": s, "us": times, "k_cache_addresses": addresses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8x131072"], help="BATCHxSEQLEN_K, e.g. 8x131072")
    p.add_argument("--caches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8, help="calls in one graph, all on the same cache")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cudnn", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        b, s = map(int, shape.split("x"))
        rows.append(measure(b, s, args))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"meta": collect_meta(sys.argv, "cuda"), "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
