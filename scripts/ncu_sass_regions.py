"""Where a kernel's warps spend their time, from Nsight Compute's per-instruction SASS table.

Reads the CSV that ``gpu_check.sh probe-decode-ncu`` writes with NCU_SOURCE=1 (``ncu --page source
--print-source sass --csv``, gzipped or not) and prints, per profiled kernel, its stall-reason
breakdown (warp-state samples over all its instructions) and the samples and executed instructions
of each run of BUCKET consecutive SASS instructions, with the memory, MMA and barrier instructions
the run holds. A run executed once per warp (its instruction count times the warps) outside the key
loop is one-time code: prologues, epilogues, index arithmetic.

Usage: python scripts/ncu_sass_regions.py SASS.csv[.gz] [--bucket 100] [--kernels 0 2 ...]
"""

import argparse
import collections
import csv
import gzip

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# opcode stems worth naming in a run: memory, MMA, synchronisation, special functions
KEY_OPS = ("LDGSTS", "LDG", "STG", "LDS", "STS", "LDSM", "STSM", "HMMA", "UTMALDG", "SYNCS", "BAR", "DEPBAR",
           "MUFU", "SHFL", "BRA")


def read_kernels(path: str) -> list[dict]:
    """[{name, header, rows}] in profiling order; rows are the CSV's per-instruction lines."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels = []
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append({"name": row[1], "header": None, "rows": []})
            elif row[0] == "Address":
                kernels[-1]["header"] = row
            elif kernels:
                kernels[-1]["rows"].append(row)
    return kernels


def opcode(sass: str) -> str:
    words = sass.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
    return word


def as_int(cell: str) -> int:
    return int(cell) if cell and cell not in ("-", "") else 0


def stall_breakdown(kernel: dict, top: int = 8) -> list[tuple[str, float]]:
    head, rows = kernel["header"], kernel["rows"]
    total = sum(as_int(r[head.index(SAMPLES)]) for r in rows) or 1
    reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
    sums = {c[len("stall_"):]: sum(as_int(r[head.index(c)]) for r in rows) for c in reasons}
    return [(k, 100.0 * v / total) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]]


def regions(kernel: dict, bucket: int):
    head, rows = kernel["header"], kernel["rows"]
    s_col, e_col = head.index(SAMPLES), head.index(EXECUTED)
    for start in range(0, len(rows), bucket):
        run = rows[start:start + bucket]
        ops = collections.Counter(opcode(r[1]) for r in run)
        named = {op: n for op, n in sorted(ops.items()) if op.split(".")[0] in KEY_OPS}
        yield start, sum(as_int(r[s_col]) for r in run), sum(as_int(r[e_col]) for r in run), named


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--bucket", type=int, default=100, help="SASS instructions per run (default 100)")
    ap.add_argument("--kernels", type=int, nargs="*", help="kernel indices to detail (default: all)")
    args = ap.parse_args()
    kernels = read_kernels(args.csv)
    for i, k in enumerate(kernels):
        total = sum(as_int(r[k["header"].index(SAMPLES)]) for r in k["rows"])
        stalls = ", ".join(f"{name} {pct:.1f}%" for name, pct in stall_breakdown(k))
        print(f"[{i}] {k['name'][:70]}: {len(k['rows'])} SASS instructions, {total} samples; {stalls}")
    for i in args.kernels if args.kernels is not None else range(len(kernels)):
        print(f"\n== [{i}] {kernels[i]['name'][:70]}")
        print(f"{'first':>6} {'samples':>8} {'executed':>9}  instructions of note")
        for start, samples, executed, named in regions(kernels[i], args.bucket):
            print(f"{start:6d} {samples:8d} {executed:9d}  {' '.join(f'{op}x{n}' for op, n in named.items())}")


if __name__ == "__main__":
    main()
