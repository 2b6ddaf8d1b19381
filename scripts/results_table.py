"""Print a markdown table from a `python -m flashtile.bench` JSON file (docs quote these tables): TFLOP/s for
the attention modes, microseconds with the HBM floor and the ratios for ``decode``.

Usage: python scripts/results_table.py benchmarks/results/fwd_h200_2026-11-29.json
"""

import json
import sys


def header(meta: dict, unit: str) -> None:
    print(f"{meta['mode']} {unit}, {meta['dtype']}, {meta['gpu']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, {meta['date'][:10]} (`{meta['command']}`)\n")


def attention_table(meta: dict, rows: list) -> None:
    impls = list(rows[0]["tflops"])
    peers = [i for i in impls if i != "flashtile"]
    header(meta, "TFLOP/s")
    print("| d | s | causal | " + " | ".join(impls) + " | " + " | ".join(f"ft/{p}" for p in peers) + " |")
    print("|" + "---|" * (3 + len(impls) + len(peers)))
    for r in rows:
        tf = [f"{r['tflops'][i]:.0f}" if r["tflops"][i] else "n/a" for i in impls]
        ratios = [f"{r['ratios'][p]:.2f}" if r["ratios"].get(p) else "n/a" for p in peers]
        print(f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | " + " | ".join(tf) + " | "
              + " | ".join(ratios) + " |")


def decode_table(meta: dict, rows: list) -> None:
    """us per call; `x floor` is flashtile / the HBM floor; pages and peers as ratios to flashtile's contiguous
    cache (a page ratio > 1: paged slower; a peer ratio > 1: the peer slower)."""
    impls = [i for i in rows[0]["us"] if i != "flashtile"]
    pages = [i for i in impls if i.startswith("flashtile-")]
    peers = [i for i in impls if i not in pages]
    header(meta, "us per call")
    cols = ["b", "seqlen_k", "layers", "flashtile", *pages, *peers, "floor", "x floor",
            *(f"{i} / flashtile" for i in pages + peers)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        us = r["us"]
        ft = us.get("flashtile")

        def fmt(x):
            return f"{x:.1f}" if x else "n/a"
        ratios = [f"{us[i] / ft:.3f}" if (us.get(i) and ft) else "n/a" for i in pages]
        ratios += [f"{us[i] / ft:.3f}" if (us.get(i) and ft) else "n/a" for i in peers]
        floor = r.get("floor_us")
        cells = [r["b"], r["seqlen_k"], r.get("layers", 1), fmt(ft), *(fmt(us.get(i)) for i in pages + peers),
                 fmt(floor), f"{ft / floor:.2f}" if (ft and floor) else "n/a", *ratios]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main(path: str) -> None:
    data = json.load(open(path))
    meta, rows = data["meta"], data["rows"]
    (decode_table if meta.get("mode") == "decode" else attention_table)(meta, rows)


if __name__ == "__main__":
    main(sys.argv[1])
