"""Can an eager timing tell a board where 128 streaming programs read slower than 132 (lease J24, E26) from the
others? (session 26)

Usage: PYTHONPATH=src python scripts/probe_board_class.py --out board_class.json

Times the flat read (probe_read_ceiling's pipelined kernel, no programmatic dependent launch) on 128 and 132
programs over buffers of several sizes, eagerly (one launch between CUDA events, repeated, alternating), and in a
CUDA graph of one launch, and prints each size's P128 / P132 ratio.
"""

import argparse
import json
import sys

import torch
from probe_read_ceiling import flat_call

from flashtile.bench.report import collect_meta


def eager_us(call, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(call, reps):
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return eager_us(g.replay, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block", type=int, default=8192, help="elements a tile (probe_read_ceiling's BLOCK)")
    args = ap.parse_args()
    out = torch.zeros(4096, dtype=torch.int32, device="cuda")
    rows = []
    for gib in args.gib:
        n = int(gib * (1 << 30)) // 2 // 2  # bf16 elements of K and of V
        k = torch.empty(n, dtype=torch.bfloat16, device="cuda").view(-1, args.block)
        v = torch.empty_like(k)
        row = {"gib": gib}
        for mode, timer in (("eager", eager_us), ("graph", graph_us)):
            for rnd in range(2):
                for p in (128, 132) if rnd == 0 else (132, 128):
                    call = flat_call(k, v, out, p, args.block, 8, stages=3)
                    call()
                    row.setdefault(f"{mode}_P{p}", []).append(timer(call, args.reps))
        for mode in ("eager", "graph"):
            a, b = min(row[f"{mode}_P128"]), min(row[f"{mode}_P132"])
            row[f"{mode}_ratio"] = a / b
        print(json.dumps({kk: (round(vv, 4) if isinstance(vv, float) else [round(x, 1) for x in vv]
                               if isinstance(vv, list) else vv) for kk, vv in row.items()}), flush=True)
        rows.append(row)
        del k, v
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"meta": collect_meta(sys.argv, "cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
