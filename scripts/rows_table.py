"""Backward config table for the rows dK/dV orientation, from a tune_bwd.py --rows sweep.

Usage: python scripts/rows_table.py tune_bwd.json > rows_table.json
then FLASHTILE_BWD_ROWS=1 FLASHTILE_BWD_CONFIGS=rows_table.json python -m flashtile.bench bwd ...
For each (head dim, causal) of the sweep: the fastest "rows" dK/dV config and the fastest dQ config.
"""

import json
import sys


def main(path: str) -> None:
    rows = json.load(open(path))["rows"]
    table = {}
    for d, causal in sorted({(r["d"], r["causal"]) for r in rows}):
        mine = [r for r in rows if r["d"] == d and r["causal"] == causal and r["ms"] and not r["tma"]]
        kv = [r for r in mine if r["kind"] == "rows"]
        dq = [r for r in mine if r["phase"] == "dq"]
        if kv and dq:
            table[f"sm90,{d},{causal}"] = [min(kv, key=lambda r: r["ms"])["dkdv"], min(dq, key=lambda r: r["ms"])["dq"]]
    json.dump(table, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
