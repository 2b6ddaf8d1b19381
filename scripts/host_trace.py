"""Where the host time of an eager flashtile call goes, function by function, on the GPU machine.

Usage: PYTHONPATH=src python scripts/host_trace.py [--out f.txt] [--shape b,s,h,d]

Wraps every function defined in a flashtile module (in every module namespace that holds it, and
the autograd Functions' forward/backward), Triton's JITFunction.run, and a
few torch calls, with a timer that adds the call's inclusive wall time to a per-name total. Then
runs inference forwards and training steps back to back at a tiny shape (kernels of a few
microseconds, so the loop runs at the host's speed) and prints microseconds per call of the outer
operation for every wrapped name, largest first. Times are inclusive (a caller's time contains its
callees'); the wrappers add about a microsecond each. scripts/host_breakdown.py gives the untraced
totals to compare with.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import pkgutil
import sys
import threading
import time
import types

import torch

import flashtile

TOTALS: collections.Counter = collections.Counter()
COUNTS: collections.Counter = collections.Counter()
THREADS: dict = {}


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t0
            COUNTS[name] += 1
            THREADS.setdefault(name, threading.current_thread().name)

    wrapper.__wrapped_for_trace__ = True
    return wrapper


def _wrap_flashtile() -> int:
    mods = [importlib.import_module(m.name) for m in pkgutil.walk_packages(flashtile.__path__, "flashtile.")
            if "bench" not in m.name and "integrations" not in m.name]
    wrapped: dict = {}
    count = 0
    for mod in mods:
        for attr, val in list(vars(mod).items()):
            if isinstance(val, types.FunctionType) and (val.__module__ or "").startswith("flashtile"):
                if getattr(val, "__wrapped_for_trace__", False):
                    continue
                if val not in wrapped:
                    wrapped[val] = _timed(f"{val.__module__}.{val.__qualname__}", val)
                setattr(mod, attr, wrapped[val])
                count += 1
            elif isinstance(val, type) and issubclass(val, torch.autograd.Function) \
                    and val.__module__.startswith("flashtile") and val not in wrapped:
                wrapped[val] = val
                for meth in ("forward", "backward", "setup_context"):
                    raw = val.__dict__.get(meth)
                    if isinstance(raw, staticmethod):
                        name = f"{val.__module__}.{val.__name__}.{meth}"
                        setattr(val, meth, staticmethod(_timed(name, raw.__func__)))
                        count += 1
    return count


def _wrap_triton_and_torch() -> None:
    from triton.runtime.jit import JITFunction

    JITFunction.run = _timed("triton JITFunction.run (kernel[grid](...))", JITFunction.run)
    torch.autograd.grad = _timed("torch.autograd.grad (whole backward)", torch.autograd.grad)
    for name in ("empty", "empty_like", "zeros"):
        setattr(torch, name, _timed(f"torch.{name}", getattr(torch, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="1,128,16,128")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the tracing itself")
    args = ap.parse_args()
    b, s, h, d = (int(x) for x in args.shape.split(","))
    dev = args.device
    if dev == "cpu":
        torch.cuda.synchronize = lambda: None
        torch.cuda.get_device_name = lambda: "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, dtype=dtype) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}; shape b,s,h,d = {args.shape}, causal"]

    def infer():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, causal=True)

    def step():
        torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), do)

    untraced = {}
    for name, fn in (("inference forward", infer), ("training step", step)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        untraced[name] = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
    n = _wrap_flashtile()
    _wrap_triton_and_torch()
    lines.append(f"wrapped {n} flashtile function bindings")
    for name, fn in (("inference forward", infer), ("training step", step)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        TOTALS.clear()
        COUNTS.clear()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        total = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        lines.append(f"\n== {name}: {untraced[name]:.1f} us per call untraced, {total:.1f} us traced")
        for key, secs in TOTALS.most_common(40):
            lines.append(f"{secs / args.calls * 1e6:9.1f} us  {COUNTS[key] / args.calls:5.1f}x  "
                         f"[{THREADS[key][:12]}]  {key}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
