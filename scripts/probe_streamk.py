"""What does stream-K whole-row decode cost against the split row kernel, and does the board need it? (session 25)

Usage: PYTHONPATH=src python scripts/probe_streamk.py --out streamk.json [--batch 32] [--seqlens 65536 131072]
       [--settings NAME=VAR=VALUE,VAR=VALUE ...]

Session 24 found boards (lease J24) where one streaming program an SM on 128 SMs reads 2.3% slower than on all
132, so the split row kernel (4 splits at b = 32: 128 programs) trails cuDNN there, while stream-K (one program a
slot, 132) was 0.2%-0.5% slower than the split kernel on a board where 128 programs read as fast as 132 (K24).
This probe runs, in one process on one board, in 8-layer graphs (probe_read_ceiling.run_row):
- the flat read on 128 and 132 programs: the board's class;
- flashtile's default (the split row kernel at these shapes), stream-K on 132 programs, and stream-K on 128
  (``FLASHTILE_DECODE_ROWS_PROGRAMS=128``: at uniform lengths each program then holds a quarter of one row, the
  split kernel's work, so split against it is the merge and bookkeeping, and it against 132 the unit crossings
  less what 4 more SMs bring), plus any ``--settings``;
- cuDNN;
then each setting's kernels one by one (torch.profiler, eager calls): the attention kernel's and the merge's own
device time, and an nvidia-smi clock / power / throttle log sampled beside the whole run.
"""

import argparse
import subprocess
import sys

import torch
from probe_read_ceiling import flat_call, layer_inputs, print_and_save, run_row

from flashtile import flash_attn_with_kvcache
from flashtile.bench.report import collect_meta
from flashtile.env import overrides

ROWS8 = {"FLASHTILE_DECODE_ROWS": "8"}
SETTINGS = {
    "flashtile_split": ROWS8,
    "flashtile_streamk": {**ROWS8, "FLASHTILE_DECODE_ROWS_STREAMK": "1"},
    "flashtile_streamk_p128": {**ROWS8, "FLASHTILE_DECODE_ROWS_STREAMK": "1", "FLASHTILE_DECODE_ROWS_PROGRAMS": "128"},
}


def parse_settings(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, _, body = item.partition("=")
        out[name] = {**ROWS8, **dict(kv.split("=", 1) for kv in body.split(",") if kv)}
    return out


def kernel_times(b: int, sk: int, settings: dict, calls: int = 20) -> dict:
    """Per setting: {kernel name: mean device us a call} from torch.profiler over ``calls`` eager calls."""
    _, _, q, lens, caches = layer_inputs(b, sk)
    kc, vc = caches[0]
    del caches
    out = {}
    for name, env in settings.items():
        with overrides(env):
            for _ in range(3):
                flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
                torch.cuda.synchronize()
        table = {}
        for evt in prof.key_averages():
            total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if total and evt.count:
                table[evt.key[:80]] = round(total / calls, 2)
        out[name] = table
    del kc, vc
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", nargs="*", default=[], help="NAME=VAR=VALUE,VAR=VALUE: more flashtile settings")
    ap.add_argument("--clock-log", default=None, help="nvidia-smi clock log CSV written beside the run")
    args = ap.parse_args()
    meta = collect_meta(sys.argv, "cuda")
    meta["command"] = "PYTHONPATH=src python scripts/probe_streamk.py " + " ".join(sys.argv[1:])
    settings = {**SETTINGS, **parse_settings(args.settings)}
    log = None
    if args.clock_log:
        log = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
             "temperature.memory,clocks_throttle_reasons.active", "--format=csv,nounits", "-lms", "100"],
            stdout=open(args.clock_log, "w"), stderr=subprocess.STDOUT)
    variants = {"flat_P128_b16384_w8_s3": (flat_call, dict(programs=128, block=16384, warps=8, stages=3)),
                "flat_P132_b16384_w8_s3": (flat_call, dict(programs=132, block=16384, warps=8, stages=3))}
    rows = []
    try:
        for sk in args.seqlens:
            row = run_row(args.batch, sk, variants, args.rounds, 25, 100, extra_settings=settings)
            row["kernel_us"] = kernel_times(args.batch, sk, {"flashtile": {}, **settings})
            rows.append(row)
            print(f"b={row['b']} s={sk} layers={row['layers']} errors: {row['errors']}", flush=True)
            for name, table in row["kernel_us"].items():
                print(f"  kernels {name}: {table}", flush=True)
            print_and_save(row, args.out, meta, rows)
    finally:
        if log is not None:
            log.terminate()


if __name__ == "__main__":
    main()
