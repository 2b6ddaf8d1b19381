"""Where a short training step's host time goes: flashtile's eager forward + backward against SDPA's, and a
profile of flashtile's Python by function.

Usage: PYTHONPATH=src python scripts/profile_host.py --out $OUT/host.json [--s 128 --d 128 --steps 300]

Host time per call is the median over batches of back-to-back calls timed with perf_counter (the GPU work of
a small call finishes long before the host issues the next one, so the host is what is timed); each batch ends
with a synchronize outside the timed span. The profile (cProfile, one batch) lists the functions with the
most time of their own and the most time under them, so the slow part of the launch path has a name. Rows:
SDPA flash and cuDNN steps, flashtile's step on each route (Gluon forward / dK/dV where they apply, Triton
only), its inference forward, and autograd alone (an identity Function's grad) as the floor every
autograd.Function pays.
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import config


def _per_call_us(fn, calls: int, batches: int = 7) -> float:
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
    return round(statistics.median(times), 2)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _ThreeInputs(torch.autograd.Function):
    """The shape of flashtile's Function without its work: three inputs, five saved tensors, three outputs."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = q.view_as(q), q.new_empty(1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse, None

    @staticmethod
    def backward(ctx, g, _dlse, _dprobs):
        q, k, v, *_ = ctx.saved_tensors
        return g, torch.empty_like(k), torch.empty_like(v)


def _profile(fn, calls: int, top: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        out[key] = buf.getvalue().splitlines()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--s", type=int, default=128)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="calls a timed batch")
    ap.add_argument("--top", type=int, default=40, help="functions listed per profile")
    args = ap.parse_args()
    if args.s < 1 or args.d < 1 or args.heads < 1 or args.steps < 1:
        ap.error("--s, --d, --heads and --steps must be positive")

    shape = (1, args.s, args.heads, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt, gt = (x.detach().transpose(1, 2).requires_grad_(x.requires_grad) for x in (q, k, v, g))

    def ft_step():
        q.grad = k.grad = v.grad = None
        flashtile.flash_attn_func(q, k, v, causal=True).backward(g)

    def ft_infer():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, causal=True)

    def sdpa_step(backend):
        def step():
            qt.grad = kt.grad = vt.grad = None
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(gt)
        return step

    x = torch.randn(8, device="cuda", requires_grad=True)

    def autograd_floor():
        torch.autograd.grad(_Identity.apply(x), x, torch.ones_like(x))

    def three_inputs():
        torch.autograd.grad(_ThreeInputs.apply(q, k, v)[0], (q, k, v), g)

    # flashtile's backward as the engine calls it, without the engine: the node's own backward on its context
    node = flashtile.flash_attn_func(q, k, v, causal=True).grad_fn

    def backward_alone():
        type(node)._forward_cls.backward(node, g, None, None)

    rows = {}
    for name, fn in (("autograd.grad, identity Function", autograd_floor),
                     ("autograd.grad, three inputs / five saved (no work)", three_inputs),
                     ("flashtile backward alone (no engine)", backward_alone),
                     ("SDPA flash step", sdpa_step(SDPBackend.FLASH_ATTENTION)),
                     ("SDPA cuDNN step", sdpa_step(SDPBackend.CUDNN_ATTENTION)),
                     ("flashtile inference forward", ft_infer),
                     ("flashtile step (routes as configured)", ft_step)):
        try:
            rows[name] = _per_call_us(fn, args.steps)
        except Exception as exc:  # noqa: BLE001 - a peer missing on this machine is a row, not a failure
            rows[name] = repr(exc)[:200]
        print(f"{name}: {rows[name]} us", flush=True)
    for name, forced in (("Gluon forced", True), ("Triton only", False)):
        with config.override(gluon=forced, gluon_fwd=forced or None, gluon_bwd=forced or None):
            try:
                rows[f"flashtile step, {name}"] = _per_call_us(ft_step, args.steps)
            except Exception as exc:  # noqa: BLE001 - the Gluon kernels need sm_90
                rows[f"flashtile step, {name}"] = repr(exc)[:200]
        print(f"flashtile step, {name}: {rows[f'flashtile step, {name}']} us", flush=True)

    profiles = {"flashtile step": _profile(ft_step, args.steps, args.top),
                "flashtile inference forward": _profile(ft_infer, args.steps, args.top)}
    for line in profiles["flashtile step"]["tottime"][:args.top + 10]:
        print(line)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                command=" ".join(sys.argv), shape=list(shape), dtype="bf16", causal=True,
                method=f"median of 7 batches of {args.steps} back-to-back calls, host perf_counter")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, us_per_call=rows, profiles=profiles), f, indent=1)


if __name__ == "__main__":
    main()
