"""How steady is the board class's measurement? (session 29)

Usage: PYTHONPATH=src python scripts/probe_board_ratio.py --out board_ratio.json [--mib 256 1024] [--repeats 5]

Runs backends/triton/board.py's measure_ratio (P128 / P132 of a plain read, CUDA-graph replays) several times at
each buffer size and prints each ratio, with the class the default threshold (board.FULL_GRID_RATIO) would give.
The margin between the boards' classes at the default size is what the detector relies on.
"""

import argparse
import json
import sys
import time

import torch

from flashtile.backends.triton import board
from flashtile.bench.report import collect_meta


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for mib in args.mib:
        ratios, seconds = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ratios.append(board.measure_ratio(device, read_bytes=mib << 20))
            seconds.append(time.perf_counter() - t0)
        full = [r > board.FULL_GRID_RATIO for r in ratios]
        rows.append(dict(mib=mib, ratios=ratios, seconds=seconds, full_grid=full))
        print(f"{mib:5d} MiB: P128 / P132 {' '.join(f'{r:.4f}' for r in ratios)}  full-grid {full}  "
              f"({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f} ms a measurement)", flush=True)
    meta = collect_meta(sys.argv, "cuda")
    meta["threshold"] = board.FULL_GRID_RATIO
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
