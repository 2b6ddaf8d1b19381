"""Why do some backward rows take two different times in different processes? (H200 probe)

Usage: PYTHONPATH=src python scripts/probe_bwd_modes.py --out probe_bwd_modes.json

Benchmark runs have shown the causal s = 1024 backward at d = 128 / 256 (b = 16, h * d = 2048) at
0.64 ms in one process and 0.99 ms in another with the same code (bench-bwd-pdl, session 9), and the
delta + dQ part of it at 0.30 or 0.58 ms (session 8). These rows come right after the heaviest rows
of a benchmark run (non-causal s = 16384). This probe times the row
- "fresh": before the heavy loop of its own round (only the very first round is before any heavy
  call; later rounds follow the previous round's heat and settling);
- right after about 2 s of s = 16384 backward calls, then again every ~0.25 s for about 3 s (does a
  hot GPU run slower for a while?);
- with the dQ kernel's programmatic dependent launch off and on (FLASHTILE_BWD_PDL);
and splits every measurement into kernels with torch.profiler, recording the SM clock and the
temperature (nvidia-smi) beside each.
"""

import argparse
import json
import os
import subprocess
import time

import torch
import triton

import flashtile
from flashtile.backends.triton import attn_bwd


def gpu_state() -> dict:
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout.strip()
        sm, temp, power, reasons = [x.strip() for x in line.split(",")]
        return {"sm_mhz": float(sm), "temp_c": float(temp), "power_w": float(power), "throttle": reasons}
    except Exception as e:  # no nvidia-smi: record why
        return {"error": repr(e)}


def make(d: int, s: int, causal: bool):
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)

    def step():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return step


def kernel_split(step, reps: int = 5) -> dict:
    """Mean device time per kernel name (us) over reps calls."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            name = e.key[:60]
            times[name] = round(times.get(name, 0.0) + e.device_time_total / reps, 1)
    return times


def measure(step, label: str) -> dict:
    ms = triton.testing.do_bench(step, warmup=25, rep=100)
    return {"label": label, "ms": round(ms, 4), "kernels_us": kernel_split(step), **gpu_state()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--d", type=int, nargs="+", default=[128, 256])
    args = ap.parse_args()
    rows = []
    heavy = make(128, 16384, False)
    heavy()  # compile before the first 2 s of heat, so every heavy loop is as long
    for d in args.d:
        row = make(d, 1024, True)
        for pdl in (False, True, False, True):
            attn_bwd.BWD_PDL_OVERRIDE = pdl
            tag = f"d={d} causal s=1024 pdl={int(pdl)}"
            row()  # compile outside the timing
            rows.append(measure(row, f"{tag} fresh"))
            print(rows[-1], flush=True)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 2.0:
                heavy()
            torch.cuda.synchronize()
            rows.append({**gpu_state(), "label": "after heavy"})
            for i in range(6):
                ms = triton.testing.do_bench(row, warmup=5, rep=50)
                rows.append({"label": f"{tag} +{i}", "ms": round(ms, 4), **gpu_state()})
                print(rows[-1], flush=True)
                time.sleep(0.25)
            rows.append(measure(row, f"{tag} settled"))
            print(rows[-1], flush=True)
    attn_bwd.BWD_PDL_OVERRIDE = None
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "env": {k: v for k, v in os.environ.items() if k.startswith("FLASHTILE")}}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
