"""Where the Gluon dK/dV kernel disagrees with the Triton one (H200 diagnostic).

Usage: PYTHONPATH=src python scripts/probe_gluon_bwd.py
For a few causal and plain shapes: the largest |gluon - triton| of dk and dv relative to the largest
Triton value, and whether two Gluon runs agree bitwise (a race shows as a run-to-run difference).
"""

import torch

import flashtile
from flashtile.backends.triton import gluon_bwd

SHAPES = [(2, 2048, 8, True), (4, 2048, 16, True), (2, 2048, 16, True), (8, 2048, 8, True), (2, 1000, 8, True),
          (2, 1000, 8, False), (2, 2048, 8, False), (16, 1024, 16, True)]


def grads(out, q, k, v, g, on):
    gluon_bwd.OVERRIDE = on
    try:
        return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    finally:
        gluon_bwd.OVERRIDE = None


for b, s, h, causal in SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    t = grads(out, q, k, v, g, False)
    a = grads(out, q, k, v, g, True)
    a2 = grads(out, q, k, v, g, True)
    rel = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(a, t)]
    # where dk differs most: (batch, key, head)
    err = (a[1].float() - t[1].float()).abs().amax(-1)
    idx = (err == err.max()).nonzero()[0].tolist()
    print(f"b={b} s={s} h={h} causal={causal}: rel dq/dk/dv {rel[0]:.1e} {rel[1]:.1e} {rel[2]:.1e}  "
          f"runs equal {all(torch.equal(x, y) for x, y in zip(a, a2))}  worst dk at (b, key, h) {idx}", flush=True)
