"""Where the Gluon dK/dV kernel disagrees with the Triton one (H200 diagnostic).

Usage: PYTHONPATH=src python scripts/probe_gluon_bwd.py
For causal and plain shapes (the first two failed with the session-5 version): the largest
|gluon - triton| of dq, dk and dv relative to the largest Triton value, how many distinct results
five Gluon runs give (a race or a register hazard shows as more than one), and where dk and dv
differ most. dq comes from the Triton kernel either way, so its difference must be 0.
"""

import torch

import flashtile
from flashtile.backends.triton import gluon_bwd

# (b, s, h, d, causal)
SHAPES = [(2, 2048, 8, 128, True), (2, 1000, 8, 128, True), (4, 2048, 16, 128, True), (8, 2048, 8, 128, True),
          (16, 1024, 16, 128, True), (2, 2048, 16, 64, True), (2, 1000, 8, 128, False), (2, 2048, 8, 128, False)]


def grads(out, q, k, v, g, on, calls):
    gluon_bwd.OVERRIDE = on
    before = len(calls)
    try:
        result = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    finally:
        gluon_bwd.OVERRIDE = None
    assert (len(calls) > before) == on, "the Gluon kernel ran when it should not, or did not run"
    return result


def main():
    gluon_bwd.GPU_VERIFIED = True  # what this probe examines
    gluon_bwd.GPU_VERIFIED_HEAD_DIMS = gluon_bwd.HEAD_DIMS
    calls = []
    real = gluon_bwd.gluon_attn_bwd_dkdv
    gluon_bwd.gluon_attn_bwd_dkdv = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    for b, s, h, d, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn_like(q)
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        t = grads(out, q, k, v, g, False, calls)
        runs = [grads(out, q, k, v, g, True, calls) for _ in range(5)]
        a = runs[0]
        distinct = 1 + sum(not all(torch.equal(x, y) for x, y in zip(a, r)) for r in runs[1:])
        rel = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, t)]
        worst = []
        for i in (1, 2):  # dk, dv: (batch, key, head) of the largest difference
            err = (a[i].float() - t[i].float()).abs().amax(-1)
            worst.append((err == err.max()).nonzero()[0].tolist())
        print(f"b={b} s={s} h={h} d={d} causal={causal}: rel dq/dk/dv {rel[0]:.1e} {rel[1]:.1e} {rel[2]:.1e}  "
              f"distinct results in 5 runs: {distinct}  worst dk at {worst[0]}, dv at {worst[1]}", flush=True)


if __name__ == "__main__":
    main()
