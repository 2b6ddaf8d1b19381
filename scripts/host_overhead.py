"""Host time of flashtile's Python path with the kernels stubbed out (CPU, no GPU needed).

Usage: PYTHONPATH=src python scripts/host_overhead.py [--calls 3000] [--triton-launchers]
--triton-launchers: stub only the kernel launches and run the Triton backend's launchers (the code a
GPU call runs, through the interpreter's dispatch on CPU tensors; set before torch/triton import),
instead of the CPU backend.
Replaces the CPU backend's compute with empty outputs, so what is timed is everything around the
kernels: argument checks, dispatch, autograd, the custom op's dispatcher. Prints microseconds per
call (best of 5 batches) for: an inference call, a forward + backward through the public function
(eager path, ops.EagerAttention) and the same through torch.ops.flashtile.attn_fwd and its
registered autograd (the path torch.compile traces). docs/compile.md quotes it.
"""

import argparse
import os
import time

import torch

import flashtile
from flashtile import autograd as ag
from flashtile.backends import cpu


def _stub_backends():
    def fwd(q, k, v, p):
        b, s, h, _ = q.shape
        return torch.empty_like(q), torch.empty(b, h, s), None

    def bwd(dout, q, k, v, out, lse, p, dq, dk, dv):
        return None

    cpu.fwd, cpu.bwd = fwd, bwd


def _best_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    per_batch = max(1, calls // 5)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_batch * 1e6)
    return best


def _stub_launches():
    from flashtile.backends.triton import attn_bwd, attn_fwd, host

    def no_launch(*args, **kwargs):
        return None

    for module in (host, attn_fwd, attn_bwd):
        for name in ("launch", "run_kernel"):
            if hasattr(module, name):
                setattr(module, name, no_launch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--triton-launchers", action="store_true")
    args = ap.parse_args()
    if args.triton_launchers:
        if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("FLASHTILE_INTERPRET") != "1":
            raise SystemExit("--triton-launchers needs TRITON_INTERPRET=1 FLASHTILE_INTERPRET=1 in the environment")
        _stub_launches()
    else:
        _stub_backends()
    q, k, v = (torch.randn(1, 16, 1, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 16, 1, 16)
    _, _, _, p = ag.padded_params(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)

    def op_step():
        out = torch.ops.flashtile.attn_fwd(*ag.fwd_op_args(q, k, v, p, None, 0))[0]
        out.backward(dout)

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    rows = [("inference call (public function)", lambda: flashtile.flash_attn_func(qd, kd, vd, causal=True)),
            ("forward + backward, public function (eager path)",
             lambda: flashtile.flash_attn_func(q, k, v, causal=True).backward(dout)),
            ("forward + backward through the custom op", op_step)]
    for name, fn in rows:
        print(f"{_best_us(fn, args.calls):8.0f} us  {name}")


if __name__ == "__main__":
    main()
