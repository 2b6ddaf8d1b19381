"""Eager training calls skip the custom-op dispatcher (ops.EagerAttention) but must compute exactly
what the op and its registered autograd formula compute: same outputs, same gradients, bit for bit."""

import pytest
import torch

import flashtile
from flashtile import autograd as ag
from flashtile.ops import PACK_KV, PACK_NONE, PACK_QKV


def _leaf(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).requires_grad_()


def _op_call(q, k, v, p, packing, rng_state):
    out, _, _ = torch.ops.flashtile.attn_fwd(*ag.fwd_op_args(q, k, v, p, rng_state, packing))
    return out


@pytest.mark.parametrize("packing", [PACK_NONE, PACK_KV, PACK_QKV], ids=["separate", "kv", "qkv"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_eager_path_matches_op_bitwise(packing, dropout_p):
    b, s, h, d = 2, 37, 3, 16
    if packing == PACK_QKV:
        qkv = _leaf(b, s, 3, h, d, seed=0)
        tensors = (qkv, None, None)
        q, k, v = qkv.unbind(2)
    elif packing == PACK_KV:
        q, kv = _leaf(b, s, h, d, seed=0), _leaf(b, s, 2, h, d, seed=1)
        tensors = (q, kv, None)
        k, v = kv.unbind(2)
    else:
        q, k, v = (_leaf(b, s, h, d, seed=i) for i in range(3))
        tensors = (q, k, v)
    _, _, _, p = ag.padded_params(q, k, v, dropout_p, None, True, (-1, -1), 0.0, None, False, False)
    rng_state = torch.tensor([1234, 0], dtype=torch.int64) if dropout_p > 0 else None
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(9))

    eager_out = ag.eager_attention(*tensors, p, packing, rng_state)[0]
    assert type(eager_out.grad_fn).__name__ == "EagerAttentionBackward"
    leaves = [t for t in tensors if t is not None]
    eager_grads = torch.autograd.grad(eager_out, leaves, dout)
    op_out = _op_call(*tensors, p, packing, rng_state)
    op_grads = torch.autograd.grad(op_out, leaves, dout)
    assert torch.equal(eager_out, op_out)
    for got, want in zip(eager_grads, op_grads):
        assert torch.equal(got, want)


def test_public_functions_train_through_the_eager_path():
    q, k, v = (_leaf(1, 8, 2, 16, seed=i) for i in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    qkv = _leaf(1, 8, 3, 2, 16, seed=3)
    out = flashtile.flash_attn_qkvpacked_func(qkv)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape


def test_second_derivative_fails_loudly():
    # the kernels' gradients carry no graph: a gradient penalty must raise, never silently add zero
    q, k, v = (_leaf(1, 8, 2, 16, seed=i) for i in range(3))
    for out in (flashtile.flash_attn_func(q, k, v, causal=True),
                flashtile.flash_attn_interface.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None,
                                                                   False, False)):
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError):
            torch.autograd.grad(dq.pow(2).sum(), q)
    # the incoming gradient itself requires grad, and the penalty sits beside another term of q: a backward whose
    # gradients merely lack a graph would return that term's gradient alone (2 q), silently
    for out in (flashtile.flash_attn_func(q, k, v, causal=True),
                flashtile.flash_attn_interface.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None,
                                                                   False, False)):
        (dq,) = torch.autograd.grad(out.sum() ** 2, q, create_graph=True)
        with pytest.raises(RuntimeError, match="second derivative"):
            torch.autograd.grad(dq.pow(2).sum() + q.pow(2).sum(), [q])
    # first-order gradients under create_graph=True still work
    (dq,) = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True).sum(), q, create_graph=True)
    assert torch.isfinite(dq).all()


def test_meta_tensors_trace_through_the_op():
    # tracers and meta/fake tensors need the op's fake implementation, with or without grad
    q, k, v = (torch.empty(2, 9, 4, 16, device="meta", requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 9, 4, 16) and out.device.type == "meta"
    with torch.no_grad():
        assert flashtile.flash_attn_func(q, k, v).shape == (2, 9, 4, 16)


def test_varlen_partial_grads_and_probs_match_op():
    total, h, d = 23, 2, 16
    q, k, v = (_leaf(total, h, d, seed=i) for i in range(3))
    k.requires_grad_(False)  # only q and v want gradients
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    _, _, _, p = ag.varlen_params(q, k, v, cu, cu, 14, 14, 0.25, None, True, (-1, -1), 0.0, None, False, True)
    rng_state = torch.tensor([77, 0], dtype=torch.int64)
    dout = torch.randn(total, h, d, generator=torch.Generator().manual_seed(5))
    eager = ag.eager_attention(q, k, v, p, PACK_NONE, rng_state)
    op = torch.ops.flashtile.attn_fwd(*ag.fwd_op_args(q, k, v, p, rng_state, PACK_NONE))
    for got, want in zip(eager, op):  # out, lse and the dropout probabilities
        assert torch.equal(got, want)
    got = torch.autograd.grad(eager[0], (q, v), dout)
    want = torch.autograd.grad(op[0], (q, v), dout)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_plain_function_apply_matches_the_fast_apply():
    # eager_attention skips Function.apply's Python preamble; the class's own apply must agree
    q, k, v = (_leaf(1, 11, 2, 16, seed=i) for i in range(3))
    _, _, _, p = ag.padded_params(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    fast = ag.eager_attention(q, k, v, p, PACK_NONE, None)
    plain = ag.EagerAttention.apply(q, k, v, None, p, PACK_NONE, None)
    assert fast[2] is None and plain[2] is None  # no probabilities allocated when not asked for
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])
    dout = torch.randn(1, 11, 2, 16, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(fast[0], (q, k, v), dout), torch.autograd.grad(plain[0], (q, k, v), dout)):
        assert torch.equal(a, b)


class _NoGradient(torch.autograd.Function):
    """Passes its input through and sends no gradient back (None, not materialised as zeros)."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "op"])
def test_a_missing_output_gradient_gives_zero_input_gradients(eager):
    # gradients are not materialised for the Function's outputs: when none reaches `out`, the
    # inputs must still get zeros, as on the op path (optimizers and DDP treat None differently)
    q, k, v = (_leaf(1, 9, 2, 16, seed=i) for i in range(3))
    _, _, _, p = ag.padded_params(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    out = ag.eager_attention(q, k, v, p, PACK_NONE, None)[0] if eager else _op_call(q, k, v, p, PACK_NONE, None)
    _NoGradient.apply(out).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_in_place_change_of_a_side_tensor_fails_the_backward():
    q, k, v = (_leaf(1, 9, 2, 16, seed=i) for i in range(3))
    alibi = torch.rand(2, dtype=torch.float32)
    out = flashtile.flash_attn_func(q, k, v, alibi_slopes=alibi, causal=True)
    alibi.mul_(3)  # the backward would silently use other slopes
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


_FEATURES = [
    dict(causal=False),
    dict(window_size=(3, 2)),
    dict(softcap=5.0, causal=True),
    dict(alibi=True),
    dict(deterministic=True, causal=True),
    dict(return_probs=True),  # dropout 0: an empty probabilities tensor, as from the op
    dict(return_probs=True, dropout_p=0.3),
]


@pytest.mark.parametrize("feature", range(len(_FEATURES)))
def test_eager_path_matches_op_with_features(feature):
    kw = dict(_FEATURES[feature])
    b, s, h, h_k, d = 2, 21, 4, 2, 16  # GQA
    q = _leaf(b, s, h, d, seed=0)
    k, v = _leaf(b, s + 5, h_k, d, seed=1), _leaf(b, s + 5, h_k, d, seed=2)
    k.requires_grad_(False)  # gradients for q and v only
    alibi = torch.rand(h, dtype=torch.float32) if kw.pop("alibi", False) else None
    _, _, _, p = ag.padded_params(q, k, v, kw.get("dropout_p", 0.0), None, kw.get("causal", False),
                                  kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0), alibi,
                                  kw.get("deterministic", False), kw.get("return_probs", False))
    rng_state = torch.tensor([99, 0], dtype=torch.int64) if p.dropout_p > 0 else None
    eager = ag.eager_attention(q, k, v, p, PACK_NONE, rng_state)
    op = torch.ops.flashtile.attn_fwd(*ag.fwd_op_args(q, k, v, p, rng_state, PACK_NONE))
    assert torch.equal(eager[0], op[0]) and torch.equal(eager[1], op[1])
    if p.return_probs:
        assert torch.equal(eager[2], op[2])
    else:
        assert eager[2] is None  # never returned to the caller: not allocated
    dout = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(eager[0], (q, v), dout)
    want = torch.autograd.grad(op[0], (q, v), dout)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
