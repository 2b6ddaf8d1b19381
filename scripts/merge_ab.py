"""Merge the runs of an A/B (``gpu_check.sh`` ``decode_ab`` / ``decode_runs`` write NAME_VAR-<value>_<seconds>.json
/ NAME_<setting>_<seconds>.json per run; ``bench fwd`` runs too) into one results file, and print each run's
times (decode) or TFLOP/s (forward) per row.

Usage: python scripts/merge_ab.py OUT.json --prefix NAME --setting VAR --command "..." --note "..." RUN.json ...

Runs are kept in the order they were measured (the seconds in their names); each becomes
``{VAR: value, "file_order_s": seconds, "meta": ..., "rows": ...}`` under ``"runs"``.
"""

import argparse
import json
import re
from pathlib import Path


def parse_name(path: str, prefix: str) -> tuple[str, int]:
    """(setting value, seconds) of a run file PREFIX<value>_<seconds>.json, e.g. with prefix
    decode_layers8_p16_gluon: decode_layers8_p16_gluon1_143.json -> ("1", 143)."""
    name = Path(path).name
    m = re.fullmatch(re.escape(prefix) + r"(?P<value>.*)_(?P<seconds>\d+)\.json", name)
    if not m:
        raise ValueError(f"{path}: not {prefix}<value>_<seconds>.json")
    return m.group("value"), int(m.group("seconds"))


def merge(paths: list[str], prefix: str, setting: str, command: str, note: str) -> dict:
    runs = []
    for path in paths:
        value, seconds = parse_name(path, prefix)
        data = json.loads(Path(path).read_text())
        runs.append({setting: value, "file_order_s": seconds, "meta": data["meta"], "rows": data["rows"]})
    runs.sort(key=lambda r: r["file_order_s"])
    return {"command": command, "note": note, "runs": runs}


def summary(merged: dict, setting: str) -> str:
    lines = []
    for run in merged["runs"]:
        cells = []
        for row in run["rows"]:
            if "us" in row:  # decode rows: microseconds per implementation
                times = " ".join(f"{k}={v:.2f}" for k, v in row["us"].items() if v is not None)
                cells.append(f"  b={row['b']} s={row['seqlen_k']}: {times}")
            else:  # attention rows (bench fwd / bwd): TFLOP/s per implementation
                rates = " ".join(f"{k}={v:.1f}" for k, v in row["tflops"].items() if v is not None)
                cells.append(f"  d={row['d']} s={row['s']} causal={row['causal']}: {rates} TFLOP/s")
        lines.append(f"{setting}={run[setting]} (t={run['file_order_s']} s)")
        lines.extend(cells)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--prefix", required=True,
                    help="the run files' name before the value, e.g. decode_route_FLASHTILE_DECODE_ROUTE-")
    ap.add_argument("--setting", required=True, help="the environment variable the A/B varied")
    ap.add_argument("--command", required=True)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    merged = merge(args.runs, args.prefix, args.setting, args.command, args.note)
    Path(args.out).write_text(json.dumps(merged, indent=1))
    print(summary(merged, args.setting))


if __name__ == "__main__":
    main()
