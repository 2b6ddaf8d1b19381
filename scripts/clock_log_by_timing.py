"""SM clock, power and throttle reasons during each timing of a probe run (session 23).

Usage: python scripts/clock_log_by_timing.py RESULTS.json CLOCKS.csv

RESULTS.json is a `probe_read_ceiling.py` output (each row's ``timeline``: name, unix start, unix end);
CLOCKS.csv is an nvidia-smi log taken beside it:

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,\
clocks_throttle_reasons.active --format=csv,nounits -lms 100 > clocks.csv

nvidia-smi's timestamps are the machine's local time, read here as UTC (the H200 machines run in UTC).
power.draw is averaged by the driver over a window of its own, so a short timing's figures carry some of the
timing before it. Throttle reason 0x4 is the software power cap.
"""

import csv
import datetime
import json
import sys


def read_log(path: str) -> list[tuple]:
    samples = []
    with open(path) as f:
        for r in list(csv.reader(f))[1:]:
            try:
                t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
                t = t.replace(tzinfo=datetime.timezone.utc).timestamp()
                samples.append((t, float(r[1]), float(r[3]), r[6].strip()))
            except (ValueError, IndexError):  # a header repeated or a line cut short
                continue
    return samples


def main() -> None:
    results, log = sys.argv[1], sys.argv[2]
    samples = read_log(log)
    for row in json.load(open(results))["rows"]:
        print(f"b={row['b']} seqlen_k={row['seqlen_k']}")
        for name, t0, t1 in row.get("timeline", []):
            inside = [s for s in samples if t0 <= s[0] <= t1]
            if not inside:
                print(f"  {name:34s} no samples")
                continue
            sm = [s[1] for s in inside]
            watts = [s[2] for s in inside]
            capped = sum(s[3] != "0x0000000000000000" for s in inside)
            print(f"  {name:34s} {len(inside):3d} samples  SM {min(sm):.0f}-{max(sm):.0f} MHz  "
                  f"power {min(watts):.0f}-{max(watts):.0f} W  throttled in {capped}")


if __name__ == "__main__":
    main()
