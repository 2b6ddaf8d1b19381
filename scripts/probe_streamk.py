"""What does stream-K whole-row decode cost against the split row kernel, and does the board need it? (session 25)

Usage: PYTHONPATH=src python scripts/probe_streamk.py --out streamk.json [--batch 32] [--seqlens 65536 131072]
       [--settings NAME=VAR=VALUE,VAR=VALUE ...]

Session 24 found boards (lease J24) where one streaming program an SM on 128 SMs reads 2.3% slower than on all
132, so the split row kernel (4 splits at b = 32: 128 programs) trails cuDNN there, while stream-K (one program a
slot, 132) was 0.2%-0.5% slower than the split kernel on a board where 128 programs read as fast as 132 (K24).
This probe runs, in one process on one board, in 8-layer graphs (probe_read_ceiling.run_row):
- the flat read on 128 and 132 programs: the board's class;
- flashtile's default (the split row kernel at these shapes) and stream-K on 132 programs, plus any ``--settings``
  (session 25 also ran stream-K on 128, ``FLASHTILE_DECODE_ROWS_PROGRAMS=128``, where at equal lengths each program
  holds a quarter of a row, the split kernel's work);
- cuDNN;
then each setting's kernels one by one (torch.profiler, eager calls: with programmatic dependent launch a kernel's
span can include its wait for the one before), and an nvidia-smi clock / power / throttle log sampled beside the whole
run. ``--stamps``: instead, per setting, one graph of the layers replayed with the row kernels' STAMP diagnostic
(backends/triton/decode_rows.STAMPS): each program's start, end of its key loop(s), end and SM; per layer the
kernel's span, the spread of the loop ends and of the ends, the SMs left idle, and the gap to the next layer's first
start; ``--new-tokens N`` makes every call append N keys first (session 28: does launching the append as a
programmatic dependent change which SMs the row kernel leaves idle?).
"""

import json
import subprocess
import sys

import torch
from probe_read_ceiling import (
    flat_call,
    layer_gaps,
    layer_inputs,
    parse_settings,
    print_and_save,
    replay_stamped,
    row_parser,
    run_row,
)

from flashtile import flash_attn_with_kvcache
from flashtile.bench.report import collect_meta
from flashtile.env import overrides

ROWS8 = {"FLASHTILE_DECODE_ROWS": "8"}
SETTINGS = {
    "flashtile_split": {**ROWS8, "FLASHTILE_DECODE_ROWS_STREAMK": "0"},
    "flashtile_streamk": {**ROWS8, "FLASHTILE_DECODE_ROWS_STREAMK": "1"},
}


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


def _layer_summary(stamps: torch.Tensor, sms: int) -> dict:
    """One layer's stamps (programs, 4: start, loop end, end in ns, SM id) as spans in microseconds, the slowest
    loops with their SMs, the SMs of the device's ``sms`` that ran none of its programs, and the stamps themselves."""
    live = stamps.double()
    t0, t1, t2, sm = live[:, 0], live[:, 1], live[:, 2], live[:, 3]
    origin = t0.min()
    loop = t1 - t0
    slow = torch.argsort(loop, descending=True)[:6]
    return {
        "programs": len(live), "span_us": (t2.max() - origin).item() / 1e3,
        "start_skew_us": (t0.max() - origin).item() / 1e3,
        "loop_end_spread_us": (t1.max() - t1.min()).item() / 1e3,
        "end_spread_us": (t2.max() - t2.min()).item() / 1e3,
        "last_loop_end_to_last_end_us": (t2.max() - t1.max()).item() / 1e3,
        "epilogue_us_med_max": [((t2 - t1).median() / 1e3).item(), ((t2 - t1).max() / 1e3).item()],
        "loop_us_min_med_max": [(loop.min() / 1e3).item(), (loop.median() / 1e3).item(), (loop.max() / 1e3).item()],
        "slowest_loops": [[int(sm[j].item()), round(loop[j].item() / 1e3, 2)] for j in slow],
        "sms_used": int(torch.unique(sm).numel()),
        "idle_sms": sorted(set(range(sms)) - {int(x) for x in sm.tolist()}),
        "raw_start_loopend_end_sm": stamps.tolist(),
    }


def stamp_layers(b: int, sk: int, settings: dict, replays: int = 5, new_tokens: int = 0) -> dict:
    """--stamps: per setting, the row kernels' per-program stamps (start, loop end, end: ns; SM id) in the last of
    ``replays`` replays of a graph of the layers, summarized per layer. ``new_tokens`` N: every call appends N keys
    first (the append kernel, as a serving step; lengths N shorter), so the append's launch is in the chain."""
    from flashtile.backends.triton import decode_rows

    _, layers, q, lens, caches = layer_inputs(b, sk)
    stamps = torch.full((layers, 1024, 4), -1, dtype=torch.int64, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    new = None
    if new_tokens:
        lens = lens - new_tokens
        new = torch.randn(b, new_tokens, *caches[0][0].shape[2:], device="cuda", dtype=caches[0][0].dtype)
    result = {}
    for name, env in settings.items():
        def step():
            for i, (kc, vc) in enumerate(caches):
                decode_rows.STAMPS = stamps[i]
                try:
                    flash_attn_with_kvcache(q, kc, vc, k=new, v=new, cache_seqlens=lens)
                finally:
                    decode_rows.STAMPS = None

        with overrides(env):
            replay_stamped(step, stamps, replays)
        st = stamps.cpu()
        live = [st[i][st[i, :, 0] > 0] for i in range(layers)]  # (programs that ran)
        result[name] = {"per_layer": [_layer_summary(x, sms) for x in live], **layer_gaps(live)}
    return result


# The flat read's 128- against 132-program time in these graphs: 1.0186 on E26 (J24's kind, where the split row
# kernel trails cuDNN by 1.4% at b = 32 from 64k) and 0.9999-1.0004 on session 27's normal boards (A27-E27).
J24_LIKE_RATIO = 1.01


def board_class_line(us: dict) -> str:
    """One line naming the board's kind from the flat reads' times (us a call by variant name)."""
    p128, p132 = us.get("flat_P128_b16384_w8_s3"), us.get("flat_P132_b16384_w8_s3")
    if not p128 or not p132:
        return "board class: not measured (a flat read failed)"
    ratio = p128 / p132
    kind = "J24 / E26-like: 128 programs read slower" if ratio > J24_LIKE_RATIO else "normal"
    return f"board class: flat read P128 / P132 = {ratio:.4f} ({kind}; J24-like above {J24_LIKE_RATIO})"


def main():
    ap = row_parser([65536, 131072])
    ap.add_argument("--settings", nargs="*", default=[], help="NAME=VAR=VALUE,VAR=VALUE: more flashtile settings")
    ap.add_argument("--clock-log", default=None, help="nvidia-smi clock log CSV written beside the run")
    ap.add_argument("--stamps", action="store_true", help="the row kernels' per-program stamps instead of timings")
    ap.add_argument("--new-tokens", type=int, default=0, help="--stamps: keys each call appends first (serving)")
    args = ap.parse_args()
    meta = collect_meta(sys.argv, "cuda")
    meta["command"] = "PYTHONPATH=src python scripts/probe_streamk.py " + " ".join(sys.argv[1:])
    settings = {**SETTINGS, **parse_settings(args.settings, ROWS8)}
    log = None
    if args.clock_log:
        log = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
             "temperature.memory,clocks_throttle_reasons.active", "--format=csv,nounits", "-lms", "100"],
            stdout=open(args.clock_log, "w"), stderr=subprocess.STDOUT)
    variants = {"flat_P128_b16384_w8_s3": (flat_call, dict(programs=128, block=16384, warps=8, stages=3)),
                "flat_P132_b16384_w8_s3": (flat_call, dict(programs=132, block=16384, warps=8, stages=3))}
    rows = []
    if args.stamps:
        for sk in args.seqlens:
            row = {"b": args.batch, "seqlen_k": sk, "new_tokens": args.new_tokens,
                   "stamps": stamp_layers(args.batch, sk, settings, new_tokens=args.new_tokens)}
            rows.append(row)
            for name, res in row["stamps"].items():
                print(f"b={args.batch} s={sk} {name}: per call {res['first_start_to_last_end_per_call_us']:.1f} us, "
                      f"gaps {[round(g, 2) for g in res['gaps_us']]}", flush=True)
                for layer in res["per_layer"]:
                    print("   ", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in layer.items()
                                  if not k.startswith("raw")}, flush=True)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        return
    try:
        for sk in args.seqlens:
            row = run_row(args.batch, sk, variants, args.rounds, 25, 100, extra_settings=settings)
            row["kernel_us"] = kernel_times(args.batch, sk, {"flashtile": {}, **settings})
            rows.append(row)
            print(f"b={row['b']} s={sk} layers={row['layers']} errors: {row['errors']}", flush=True)
            for name, table in row["kernel_us"].items():
                print(f"  kernels {name}: {table}", flush=True)
            print_and_save(row, args.out, meta, rows)
            print(board_class_line(row["us"]), flush=True)
    finally:
        if log is not None:
            log.terminate()


if __name__ == "__main__":
    main()
