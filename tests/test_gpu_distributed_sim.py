"""The context-parallel schedule on CUDA in bf16, its ranks simulated in one process.

``simulated_ring_attention`` runs every rank's steps with the same per-step code (blocks.py) the
process-group functions run, on flashtile's Triton kernels. Bar (FlashAttention's): against the fp32
single-call result ``ref``, within 2x (3x for gradients) the error of the single bf16 call ``pt``.
"""

from __future__ import annotations

import pytest
import torch

import flashtile.distributed as cp
from distributed_cases import reference
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu

DOCS = [0, 300, 301, 1500, 2100, 4096]


@pytest.mark.parametrize("layout,world,kw,docs", [
    ("contiguous", 4, dict(causal=True), None),
    ("zigzag", 8, dict(causal=True), None),
    ("zigzag", 4, dict(causal=True, window_size=(700, 0)), None),
    ("contiguous", 4, dict(softcap=20.0, window_size=(256, 512)), None),
    ("zigzag", 4, dict(causal=True), DOCS),
], ids=["ring-causal", "zigzag8-causal", "zigzag-window", "ring-softcap-window", "zigzag-varlen"])
def test_simulated_ring_bf16(layout, world, kw, docs):
    b, s, h, hk, d = 1, 4096, 8, 2, 128
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = cp.simulated_ring_attention(q, k, v, world, layout, dout=dout, cu_seqlens=docs, **kw)
    results = {}
    for name, dtype in (("ref", torch.float32), ("pt", torch.bfloat16)):
        full = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse_ = reference(*full, kw, None if docs is None else tuple(docs))
        o.backward(dout.to(dtype))
        results[name] = (o, lse_, *(x.grad for x in full))
    ref, pt = results["ref"], results["pt"]
    assert_fa_close(out, ref[0], pt[0])
    assert torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-4)
    for name, got, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], pt[2:]):
        assert_fa_close(got, r, p, factor=3.0, name=name)
