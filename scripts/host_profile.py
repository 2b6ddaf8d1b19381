"""Host (CPU) time of flashtile's eager calls on a GPU machine, and where it goes (cProfile).

Usage: PYTHONPATH=src python scripts/host_profile.py [--rows 128,512,32,16 128,128,1,16] [--out f.txt]

scripts/host_overhead.py measures the Python path with the kernels stubbed out, on CPU; this runs
the real launchers (Triton's JIT dispatch, descriptors, allocations) on CUDA. For each row
d,s,b,h it times, host side only, each phase of a training step after a sync: the forward call,
then autograd.grad, then the GPU's own time for the step. A phase whose host time grows with the
problem size is waiting for the GPU somewhere (a hidden sync). The last row is then run 200 times
under cProfile and the top functions printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import flashtile


def _inputs(d, s, b, h):
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, do


def _phase_us(fn, n=30) -> float:
    """Median host time of fn() started on an idle GPU (sync before each run)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def _steps(d, s, b, h):
    """The phases of one training step on fresh inputs: (inference fwd, fwd, bwd-only, whole step)."""
    q, k, v, do = _inputs(d, s, b, h)

    def fwd_infer():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v)

    def fwd_grad():
        return flashtile.flash_attn_func(q, k, v)

    def step():
        torch.autograd.grad(flashtile.flash_attn_func(q, k, v), (q, k, v), do)

    for _ in range(3):
        step()
    out = fwd_grad()
    torch.cuda.synchronize()

    def bwd_only():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    return fwd_infer, fwd_grad, bwd_only, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["128,128,1,16", "128,512,32,16", "128,2048,8,16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}"]
    for spec in args.rows:
        d, s, b, h = (int(x) for x in spec.split(","))
        phases = _steps(d, s, b, h)
        t_inf, t_fwd, t_bwd, t_step = (_phase_us(f) for f in phases)
        step = phases[-1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            step()
        end.record()
        torch.cuda.synchronize()
        gpu_us = start.elapsed_time(end) / 20 * 1e3
        lines.append(f"d={d} s={s} b={b} h={h}: host us: inference fwd {t_inf:.0f} | fwd (grad) {t_fwd:.0f} | "
                     f"autograd.grad {t_bwd:.0f} | whole step {t_step:.0f};  step back-to-back {gpu_us:.0f} us")
        print(lines[-1], flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    lines.append(buf.getvalue())
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
