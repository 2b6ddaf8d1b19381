"""Print the flashtile / cuDNN times of several `bench decode` result files side by side, one column a file (in
the order their names' trailing run seconds give): a quick look at an A/B before merging it with merge_ab.py.
    python scripts/ab_table.py RESULT.json...
"""

import json
import re
import sys


def main(paths: list[str]):
    def order(path):
        m = re.search(r"_(\d+)\.json$", path)
        return int(m.group(1)) if m else 0

    paths = sorted(paths, key=order)
    runs = [json.load(open(p))["rows"] for p in paths]
    for i, p in enumerate(paths):
        print(f"[{i}] {p}")
    keys = [(r["b"], r["seqlen_k"]) for r in runs[0]]
    print("b      s  " + " ".join(f"{f'[{i}] ft':>9} {'cudnn':>7}" for i in range(len(runs))))
    for key in keys:
        cells = []
        for rows in runs:
            r = next((r for r in rows if (r["b"], r["seqlen_k"]) == key), None)
            us = {k: (v if v is not None else float("nan")) for k, v in (r["us"] if r else {}).items()}
            nan = float("nan")
            cells.append(f"{us.get('flashtile', nan):9.1f} {us.get('cudnn', nan):7.1f}" if r else " " * 17)
        print(f"{key[0]:<3} {key[1]:>6}  " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
