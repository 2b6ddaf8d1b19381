"""Print a markdown table from a `python -m flashtile.bench` JSON file (docs quote these tables).

Usage: python scripts/results_table.py benchmarks/results/fwd_h200_2026-11-29.json
"""

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    meta, rows = data["meta"], data["rows"]
    impls = list(rows[0]["tflops"])
    peers = [i for i in impls if i != "flashtile"]
    print(f"{meta['mode']} TFLOP/s, {meta['dtype']}, {meta['gpu']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date'][:10]} (`{meta['command']}`)\n")
    print("| d | s | causal | " + " | ".join(impls) + " | " + " | ".join(f"ft/{p}" for p in peers) + " |")
    print("|" + "---|" * (3 + len(impls) + len(peers)))
    for r in rows:
        tf = [f"{r['tflops'][i]:.0f}" if r["tflops"][i] else "n/a" for i in impls]
        ratios = [f"{r['ratios'][p]:.2f}" if r["ratios"].get(p) else "n/a" for p in peers]
        print(f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | " + " | ".join(tf) + " | "
              + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
