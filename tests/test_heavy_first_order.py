"""Causal forward and dQ programs start with their longest row blocks (kernels/attn_fwd.py
_heavy_rows_first, config.heavy_first): through the interpreter on CPU, the output,
lse and gradients are bitwise the same in either launch order, so the reordering maps every row
block to exactly one program (a block computed twice or never would show here; the kernels' own
tests check the values against the reference)."""

import pytest
import torch

import flashtile
from attn_cases import varlen_inputs
from flashtile import config

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("tiny_triton_tiles")]


def _nan_filled(alloc):
    # a row block no program computes would keep NaN where it might otherwise keep stale memory
    def wrapped(*args, **kwargs):
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return wrapped


def _both_orders(monkeypatch, call):
    results = []
    for heavy_first in (True, False):
        with config.override(heavy_first=heavy_first), monkeypatch.context() as m:
            m.setattr(torch, "empty", _nan_filled(torch.empty))
            m.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
            results.append(call())
    for result in results:  # lse may be +inf (rows that see no key), never NaN
        assert not any(torch.isnan(x.float()).any() for x in result)
    return results


@pytest.mark.parametrize("sq,sk,window,dropout", [(45, 45, (-1, 0), 0.0), (37, 20, (-1, 0), 0.0),
                                                  (20, 45, (-1, 0), 0.0), (50, 50, (7, 3), 0.0),
                                                  (33, 33, (-1, 0), 0.25)])  # dropout: the mask follows
def test_padded_same_in_both_orders(monkeypatch, sq, sk, window, dropout):  # positions, not programs
    torch.manual_seed(0)
    q = torch.randn(2, sq, 2, 16, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, sk, 1, 16, dtype=torch.float16, requires_grad=True) for _ in range(2))
    g = torch.randn(2, sq, 2, 16, dtype=torch.float16)

    def call():
        torch.manual_seed(1)  # the same dropout seed for both orders
        out, lse, probs = flashtile.flash_attn_func(q, k, v, dropout_p=dropout, window_size=window,
                                                    return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), g)
        return (out, lse, *grads) if probs is None else (out, lse, probs, *grads)

    on, off = _both_orders(monkeypatch, call)
    for a, b in zip(on, off):
        assert torch.equal(a, b)


def test_varlen_same_in_both_orders(monkeypatch):
    # row blocks are counted from the longest sequence: shorter ones map some programs past their end
    lens = [3, 40, 0, 17]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 2, 16, torch.float16, "cpu", True)
    g = torch.randn_like(q)

    def call():
        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=True,
                                                       return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), g))

    on, off = _both_orders(monkeypatch, call)
    for a, b in zip(on, off):
        assert torch.equal(a, b)
