"""Eager kernel calls of flex_attention go through flex/eager.py (the launchers under a plain autograd.Function),
not the custom ops, whose dispatch costs host time; the results and every gradient (the learned table's too)
equal the custom op's, which torch.compile uses. Triton's interpreter stands in for the GPU."""

import pytest
import torch

from flashtile import config
from flashtile.flex import api, create_block_mask, flex_attention, ops, options
from flex_variants import variants

B, H, L, S, E = 1, 2, 33, 40, 16


def _call(name, through_op: bool):
    torch.manual_seed(0)  # the variants' captured tensors are random too
    var = variants(B, H, L, S)
    score_mod, mask_mod, _, _, table = var[name]
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    g = torch.randn(B, H, L, E)
    leaves = [q, k, v] + ([table] if table is not None else [])
    with config.override(interpret=True, fwd_tiles=(16, 16, 4, 1), bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        if through_op:
            # what a compiled graph runs: the custom op and its registered backward
            key = api._register(score_mod, mask_mod, "cpu")
            bufs = list(api._captured(key))
            out, lse = ops.flex_fwd(q, k, v, *mask.tensors(), bufs, 1.0 / E ** 0.5, key, *mask.BLOCK_SIZE,
                                    list(options.tiles(None, mask.BLOCK_SIZE)))
        else:
            out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True)
            lse = torch.where(lse == float("-inf"), float("inf"), lse)
        grads = torch.autograd.grad((out * g).sum() + lse.sum(), leaves)
    return out.detach(), lse.detach(), grads


def test_eager_calls_skip_the_custom_op(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager kernel call reached the custom op")

    monkeypatch.setattr(api, "flex_fwd", refuse)
    monkeypatch.setattr(ops, "flex_bwd", refuse)
    out, _, grads = _call("rel_bias", through_op=False)
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)


def test_eager_path_equals_the_custom_op():
    for name in ("rel_bias", "document"):
        out, lse, grads = _call(name, through_op=False)
        out_op, lse_op, grads_op = _call(name, through_op=True)
        assert torch.equal(out, out_op) and torch.equal(lse, lse_op)
        assert len(grads) == len(grads_op)
        for a, b in zip(grads, grads_op):
            assert torch.equal(a, b)


def test_no_grad_calls_launch_without_autograd(monkeypatch):
    from flashtile.flex import eager

    def refuse(*args, **kwargs):
        raise AssertionError("a call that needs no gradient built an autograd node")

    monkeypatch.setattr(eager._FlexAttention, "apply", refuse)
    var = variants(B, H, L, S)
    q, k, v = (torch.randn(B, H, n, E) for n in (L, S, S))
    with config.override(interpret=True, fwd_tiles=(16, 16, 4, 1)):
        out = flex_attention(q, k, v, score_mod=var["alibi"][0])
    assert out.shape == (B, H, L, E) and torch.isfinite(out).all()


def _leaves_and_call(name="rel_bias"):
    torch.manual_seed(0)
    var = variants(B, H, L, S)
    score_mod, mask_mod, _, _, table = var[name]
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    return q, k, v, table, lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=mask), mask


def test_second_derivative_raises_never_drops_a_term():
    # a gradient penalty beside another term: the kernels' gradients have no derivative, so this must raise (as
    # the custom op's path does), not return the other term's gradient alone
    q, k, v, table, call, _ = _leaves_and_call()
    with config.override(interpret=True, fwd_tiles=(16, 16, 4, 1), bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        out = call()
        (gq,) = torch.autograd.grad(out.sum() ** 2, q, create_graph=True)
        with pytest.raises(RuntimeError, match="second derivative"):
            torch.autograd.grad((gq ** 2).sum() + (q ** 2).sum(), [q])
        # first-order gradients under create_graph=True still work
        (gq,) = torch.autograd.grad(call().sum(), q, create_graph=True)
        assert torch.isfinite(gq).all()


@pytest.mark.parametrize("change", ["table", "mask"])
def test_inplace_change_before_backward_is_caught(change):
    q, k, v, table, call, mask = _leaves_and_call()
    with config.override(interpret=True, fwd_tiles=(16, 16, 4, 1), bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        out = call()
        with torch.no_grad():
            (table if change == "table" else mask.tensors()[1]).add_(1)
        with pytest.raises(RuntimeError, match="inplace"):
            out.sum().backward()


def test_fake_tensors_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def softcap(score, b, h, q_idx, kv_idx):  # captures no tensor: nothing real meets the fake ones
        return 20.0 * torch.tanh(score / 20.0)

    with FakeTensorMode(allow_non_fake_inputs=True), config.override(interpret=True):
        q, k, v = (torch.empty(B, H, n, E) for n in (L, S, S))
        out = flex_attention(q, k, v, score_mod=softcap)
    assert out.shape == (B, H, L, E) and isinstance(out, torch._subclasses.fake_tensor.FakeTensor)
