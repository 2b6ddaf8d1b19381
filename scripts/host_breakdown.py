"""Host time of each piece of an eager attention call on the GPU machine, beside the peers' calls.

Usage: PYTHONPATH=src python scripts/host_breakdown.py [--out f.json]

scripts/host_profile.py times whole phases and runs cProfile, whose own overhead distorts small
calls. This times pieces in isolation instead: an empty Triton kernel with 1 and with 30
arguments launched through ``kernel[grid](...)`` and through the compiled kernel directly, Gluon
and Triton tensor descriptors, torch allocations, the autograd engine on a trivial Function, and
whole calls (flashtile and SDPA flash, inference and forward + backward) at a tiny shape whose
kernels take a few microseconds, so a loop of back-to-back calls runs at the host's speed.
Each number is microseconds per call: the median of 7 batches of back-to-back calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

import flashtile


@triton.jit
def _noop1(x):
    pass


@triton.jit
def _noop30(t0, t1, t2, t3, t4, t5, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15,
            i16, i17, i18, i19, f0, f1, f2, f3, C: tl.constexpr):
    pass


def per_call_us(fn, calls: int = 300, batches: int = 7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ab-cache", type=int, default=0, metavar="N",
                    help="only an A/B of the launch cache: N rounds alternating it on and off in this process")
    args = ap.parse_args()
    dev = "cuda"
    x = torch.empty(64, device=dev)
    tens = [torch.empty(64, device=dev, dtype=torch.bfloat16) for _ in range(6)]
    ints = list(range(3, 23))
    floats = [0.5, 1.5, 2.5, 3.5]
    args30 = (*tens, *ints, *floats)
    compiled1 = _noop1[(1,)](x)
    compiled30 = _noop30[(1,)](*args30, C=1)
    b, s, h, d = 1, 128, 16, 128
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
    qtg, ktg, vtg = (t.detach().clone().requires_grad_(True) for t in (qt, kt, vt))
    xg = torch.randn(16, device=dev, requires_grad=True)
    gx = torch.ones(16, device=dev)
    from flashtile.backends.triton.attn_fwd import _descriptor as triton_descriptor
    from flashtile.backends.triton.gluon_fwd import _descriptor as gluon_descriptor

    def sdpa_flash(*a):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True)

    def ft_step():
        torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), do)

    def sdpa_step():
        torch.autograd.grad(sdpa_flash(qtg, ktg, vtg), (qtg, ktg, vtg), dot)

    pieces = {
        "torch.empty_like (b,s,h,d)": lambda: torch.empty_like(q),
        "torch.empty fp32 (b,h,s)": lambda: torch.empty(b, h, s, device=dev),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "noop kernel, 1 arg, kernel[grid](...)": lambda: _noop1[(1,)](x),
        "noop kernel, 1 arg, compiled[grid](...)": lambda: compiled1[(1, 1, 1)](x),
        "noop kernel, 30 args, kernel[grid](...)": lambda: _noop30[(1,)](*args30, C=1),
        "noop kernel, 30 args, compiled[grid](...)": lambda: compiled30[(1, 1, 1)](*args30, 1),
        "Gluon TensorDescriptor (cached layout)": lambda: gluon_descriptor(q, [1, 64, 1, d]),
        "Triton TensorDescriptor": lambda: triton_descriptor(q, 64, d),
        "autograd.grad, identity Function": lambda: torch.autograd.grad(_Identity.apply(xg), xg, gx),
        "SDPA flash fwd, inference (causal)": lambda: sdpa_flash(qt, kt, vt),
        "flashtile fwd, inference (causal)": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "flashtile fwd, with grad (causal)": lambda: flashtile.flash_attn_func(qg, kg, vg, causal=True),
        "SDPA flash fwd+bwd step (causal)": sdpa_step,
        "flashtile fwd+bwd step (causal)": ft_step,
        "flashtile fwd+bwd step, Gluon fwd + Gluon dK/dV forced": ("gluon", ft_step),
        "flashtile fwd+bwd step, Triton only": ("triton", ft_step),
        "flashtile fwd, inference, Gluon forced": ("gluon", lambda: flashtile.flash_attn_func(q, k, v, causal=True)),
        "flashtile fwd, inference, Triton only": ("triton", lambda: flashtile.flash_attn_func(q, k, v, causal=True)),
    }
    from flashtile.backends.triton import gluon_bwd, gluon_route, host

    if args.ab_cache:
        # the machine's host times drift by 20% between runs: alternate the two settings in one
        # process, several rounds, and compare medians
        ab = ("inference", "step", "step, Gluon fwd + dK/dV forced")
        samples = {(name, flag): [] for name in ab for flag in (True, False)}
        for _ in range(args.ab_cache):
            for flag in (True, False):
                host.FAST_LAUNCH = flag
                with torch.no_grad():
                    samples[("inference", flag)].append(
                        per_call_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True), 200, 3))
                samples[("step", flag)].append(per_call_us(ft_step, 200, 3))
                gluon_route.OVERRIDE = gluon_bwd.OVERRIDE = True
                samples[(ab[2], flag)].append(per_call_us(ft_step, 200, 3))
                gluon_route.OVERRIDE = gluon_bwd.OVERRIDE = None
        results = {f"{name}, cache {'on' if flag else 'off'}": round(statistics.median(v), 2)
                   for (name, flag), v in samples.items()}
        for name, us in results.items():
            print(f"{us:9.1f} us  {name} (median of {args.ab_cache} alternated rounds)", flush=True)
        pieces = {}
    else:
        results = {}
    for name, fn in pieces.items():
        if isinstance(fn, tuple):  # pin both Gluon routes on or off for this piece
            route, fn = fn
            gluon_route.OVERRIDE = gluon_bwd.OVERRIDE = route == "gluon"
        else:
            gluon_route.OVERRIDE = gluon_bwd.OVERRIDE = None
        if "inference" in name:
            with torch.no_grad():
                us = per_call_us(fn)
        else:
            us = per_call_us(fn)
        results[name] = round(us, 2)
        print(f"{us:9.1f} us  {name}", flush=True)
    method = ("median of 7 batches of 300 back-to-back calls, host perf_counter" if not args.ab_cache else
              f"{args.ab_cache} rounds, each measuring the cache on then off (host.FAST_LAUNCH flipped in one "
              "process); per measurement the median of 3 batches of 200 calls; reported: the median over rounds")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shape": [b, s, h, d], "method": method}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "us_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
