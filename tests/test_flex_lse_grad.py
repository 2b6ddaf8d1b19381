"""Gradients through flex_attention's returned lse (the natural-log logsumexp of the scaled, modded scores,
d lse_i / d s_ij = P_ij): a loss on out and lse, and one on lse alone, through the Triton kernels in the
interpreter, the CPU path and a compiled graph, against the float64 dense reference (tests/flex_variants.py),
for a score_mod variant (softcap: its derivative is not 1, so the lse term must pass through the mod) and a
block-masked one whose hidden rows lie both inside partly visible blocks and in a query block with no
listed block at all."""

import pytest
import torch

from flashtile import config
from flashtile.flex import create_block_mask, flex_attention
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close

B, H, L, S, E = 1, 2, 37, 45, 16


def hidden_rows(b, h, q_idx, kv_idx):
    # causal, with rows q % 7 == 3 and every row from 32 on (query block 2 of 16) seeing no key
    return (q_idx >= kv_idx) & (q_idx % 7 != 3) & (q_idx < 32)


def _variant(name):
    var = variants(B, H, L, S)
    q, kv = var["_meta"]["q"], var["_meta"]["kv"]
    var["hidden_rows"] = (None, hidden_rows, None, ((q >= kv) & (q % 7 != 3) & (q < 32)).expand(B, H, L, S), None)
    return var[name], var["_meta"]


def _loss(out, lse, g, glse, use_out):
    # a row that sees no key has lse = -inf: the loss leaves it out, as a z-loss on the lse would
    loss = (torch.where(torch.isfinite(lse), lse, 0.0) * glse).sum()
    return loss + (out * g).sum() if use_out else loss


def _inputs():
    return [torch.randn(B, H, n, E, dtype=torch.float32).requires_grad_() for n in (L, S, S)]


def _check(name, interpret, use_out=True):
    variant, meta = _variant(name)
    score_mod, mask_mod = variant[:2]
    q, k, v = _inputs()
    mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=16) if mask_mod else None
    g, glse = torch.randn(B, H, L, E), torch.randn(B, H, L)
    with config.override(interpret=interpret):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True)
        grads = torch.autograd.grad(_loss(out, lse, g, glse, use_out), (q, k, v))
    ref, ref_lse = dense_reference(q, k, v, variant, meta)
    pt, pt_lse = dense_reference(q, k, v, variant, meta, dtype=torch.float32)
    ref_grads = torch.autograd.grad(_loss(ref, ref_lse, g.double(), glse.double(), use_out), (q, k, v),
                                    allow_unused=True)
    pt_grads = torch.autograd.grad(_loss(pt, pt_lse, g, glse, use_out), (q, k, v), allow_unused=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    for gname, a, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        if gname == "dv" and not use_out:  # lse does not depend on v
            assert torch.equal(a, torch.zeros_like(a)), "dv from a loss on lse alone"
            continue
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=gname)
    if name == "hidden_rows":  # rows that see no key get no gradient, even from the lse term
        dq = grads[0][0, :, 32:]
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(grads[0][0, :, 3], torch.zeros_like(dq[:, 0]))


@pytest.mark.parametrize("name", ["softcap", "hidden_rows"])
@pytest.mark.parametrize("interpret", [True, False], ids=["triton", "cpu"])
def test_lse_gradient(name, interpret):
    _check(name, interpret)


def test_lse_alone_gradient_triton():
    """out unused: its gradient reaches the backward as None, the lse term alone drives dq and dk."""
    _check("hidden_rows", interpret=True, use_out=False)


def test_compiled_graph_differentiates_lse():
    """torch.compile(fullgraph=True) through the custom ops (the CPU op's backward) matches eager autograd."""
    variant, _ = _variant("hidden_rows")
    mask = create_block_mask(variant[1], None, None, L, S, device="cpu", BLOCK_SIZE=16)
    q, k, v = _inputs()
    g, glse = torch.randn(B, H, L, E), torch.randn(B, H, L)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, return_lse=True)

    eager = torch.autograd.grad(_loss(*fn(q, k, v), g, glse, True), (q, k, v))
    out, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled = torch.autograd.grad(_loss(out, lse, g, glse, True), (q, k, v))
    for a, b in zip(eager, compiled):
        assert (a - b).abs().max() < 1e-5
