"""The context-parallel schedule on CUDA in bf16, its ranks simulated in one process.

``simulated_ring_attention`` runs every rank's steps with the same per-step code (blocks.py) the
process-group functions run, on flashtile's Triton kernels. Bar (FlashAttention's): against the fp32-upcast
reference ``ref`` on the whole sequence, within 2x (3x for gradients) the error of the same reference
computed in bf16 (``pt``).
"""

from __future__ import annotations

import pytest
import torch

import flashtile.distributed as cp
from flashtile.backends.reference import attention_ref
from flashtile.modules.mha import get_alibi_slopes
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu

DOCS = [0, 300, 301, 1500, 2100, 4096]


@pytest.mark.parametrize("layout,world,kw,docs", [
    ("contiguous", 4, dict(causal=True), None),
    ("zigzag", 8, dict(causal=True), None),
    ("zigzag", 4, dict(causal=True, window_size=(700, 0)), None),
    ("contiguous", 4, dict(softcap=20.0, window_size=(256, 512)), None),
    ("zigzag", 4, dict(causal=True), DOCS),
    ("contiguous", 4, dict(alibi=True, attention_chunk=1536), None),
    ("zigzag", 4, dict(causal=True, alibi=True, window_size=(700, 0)), DOCS),
], ids=["ring-causal", "zigzag8-causal", "zigzag-window", "ring-softcap-window", "zigzag-varlen", "ring-alibi-chunk",
        "zigzag-alibi-varlen"])
def test_simulated_ring_bf16(layout, world, kw, docs):
    b, s, h, hk, d = 1, 4096, 8, 2, 128
    kw = dict(kw)
    if kw.pop("alibi", False):  # the standard slopes: the largest, 1/2, is where the lse shift costs most
        kw["alibi_slopes"] = torch.tensor(get_alibi_slopes(h), device="cuda")
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, hk, hk))
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = cp.simulated_ring_attention(q, k, v, world, layout, dout=dout, cu_seqlens=docs, **kw)
    results = {}
    for name, upcast in (("ref", True), ("pt", False)):
        full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o, lse_ = _reference(*full, kw, docs, upcast)
        o.backward(dout)
        results[name] = (o, lse_, *(x.grad for x in full))
    ref, pt = results["ref"], results["pt"]
    assert_fa_close(out, ref[0], pt[0])
    assert torch.allclose(lse, ref[1], atol=1e-3, rtol=1e-4)
    for name, got, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], pt[2:]):
        assert_fa_close(got, r, p, factor=3.0, name=name)


def _reference(q, k, v, kw, docs, upcast):
    """attention_ref on the whole sequence: out (b, s, h, d), lse (b, h, s); packed documents as varlen."""
    if docs is None:
        return attention_ref(q, k, v, upcast=upcast, **kw)
    b, s = q.shape[:2]
    cu = torch.tensor([c + i * s for i in range(b) for c in docs[:-1]] + [b * s], dtype=torch.int32, device=q.device)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    out, lse = attention_ref(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, upcast=upcast, **kw)
    return out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)
