"""The public functions with FlashAttention-3 / CuTe's features (issue 48): v's own head dim, ``learnable_sink``
and ``attention_chunk``, on the CPU path against ``attention_ref`` in float64 (forward, lse and every gradient,
the sink's included), and their argument errors."""

import pytest
import torch

import flashtile
from flashtile.backends.reference import attention_ref


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _check(got, want, inputs):
    """Forward, lse and gradients of every input (a float64 CPU run matches the reference to ~1e-12)."""
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-10, rtol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g)
    ref_grads = torch.autograd.grad(ref_out, inputs, g)
    for name, a, b in zip("qkvs", grads, ref_grads):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


FEATURES = [
    dict(),
    dict(causal=True),
    dict(attention_chunk=7),
    dict(causal=True, attention_chunk=8),
    dict(window_size=(5, 3), attention_chunk=16),
    dict(window_size=(2, 0), attention_chunk=5, softcap=4.0),
]


@pytest.mark.parametrize("kw", FEATURES, ids=str)
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37), (1, 20)])
def test_padded(kw, sink, sq, sk):
    q, k, v = _leaf(2, sq, 4, 16), _leaf(2, sk, 2, 16), _leaf(2, sk, 2, 24)
    s = _leaf(4) if sink else None
    inputs = [q, k, v] + ([s] if sink else [])
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=s, **kw)
    _check((out, lse), attention_ref(q, k, v, learnable_sink=s, **kw), inputs)


@pytest.mark.parametrize("kw", FEATURES[1:4], ids=str)
def test_varlen_with_sink_and_dv(kw):
    lens_q, lens_k = [5, 0, 9, 1], [9, 4, 6, 13]
    q, k, v = _leaf(sum(lens_q), 4, 8), _leaf(sum(lens_k), 1, 8), _leaf(sum(lens_k), 1, 12)
    s = _leaf(4)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   return_attn_probs=True, learnable_sink=s, **kw)
    _check((out, lse), attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=s, **kw),
           [q, k, v, s])


def test_rows_that_see_nothing_get_the_sink_as_lse():
    # sq > sk with causal: the first rows' diagonals are negative, so they see no key
    q, k, v = _leaf(1, 9, 2, 8), _leaf(1, 4, 2, 8), _leaf(1, 4, 2, 8)
    s = torch.tensor([0.5, -1.5], dtype=torch.float64)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=s)
    assert torch.equal(out[0, :5], torch.zeros_like(out[0, :5]))
    torch.testing.assert_close(lse[0, :, :5], s[:, None].expand(2, 5))
    assert torch.isfinite(lse).all()


def test_packed_functions_take_sink_and_chunk():
    qkv = _leaf(2, 10, 3, 4, 8)
    s = _leaf(4)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=s, attention_chunk=4)
    q, k, v = qkv.unbind(2)
    ref, _ = attention_ref(q, k, v, causal=True, learnable_sink=s, attention_chunk=4)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [qkv, s], g)
    want = torch.autograd.grad(ref, [qkv, s], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_sink_in_lower_precision_gets_its_own_dtype_grad():
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    s = torch.zeros(2, dtype=torch.float32, requires_grad=True)
    flashtile.flash_attn_func(q, k, v, learnable_sink=s).sum().backward()
    assert s.grad.dtype == torch.float32 and s.grad.shape == (2,)
    assert (s.grad != 0).all()


def test_sink_gradcheck():
    q, k, v = _leaf(1, 5, 2, 4), _leaf(1, 7, 1, 4), _leaf(1, 7, 1, 6)
    s = _leaf(2)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=s, attention_chunk=3),
        (q, k, v, s))


def _qkv():
    return torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)


@pytest.mark.parametrize("sink,err,match", [
    (torch.zeros(3), ValueError, r"learnable_sink must have shape \(h,\) = \(2,\)"),
    (torch.zeros(1, 2), ValueError, "learnable_sink must have shape"),
    (torch.zeros(2, dtype=torch.int32), TypeError, "learnable_sink must be float32 or q's dtype"),
    ([0.0, 0.0], TypeError, "learnable_sink must be a torch.Tensor"),
])
def test_bad_sink_is_named(sink, err, match):
    with pytest.raises(err, match=match):
        flashtile.flash_attn_func(*_qkv(), learnable_sink=sink)


@pytest.mark.parametrize("chunk", [-1, 2.5, True, "8"])
def test_bad_chunk_is_named(chunk):
    with pytest.raises(TypeError, match="attention_chunk must be an int >= 0"):
        flashtile.flash_attn_func(*_qkv(), attention_chunk=chunk)


def test_bad_v_head_dim_is_named():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match="v head dim dv=300"):
        flashtile.flash_attn_func(q, k, torch.randn(1, 4, 2, 300))
    with pytest.raises(ValueError, match="v must have k's shape but for its head dim"):
        flashtile.flash_attn_func(q, k, torch.randn(1, 5, 2, 8))


def test_fp8_refuses_sink_chunk_and_dv():
    q, k, v = (x.to(torch.float8_e4m3fn) for x in _qkv())
    with torch.no_grad():
        with pytest.raises(TypeError, match="learnable_sink is not supported with fp8"):
            flashtile.flash_attn_func(q, k, v, learnable_sink=torch.zeros(2))
        with pytest.raises(TypeError, match="attention_chunk is not supported with fp8"):
            flashtile.flash_attn_func(q, k, v, attention_chunk=4)
        with pytest.raises(ValueError, match="fp8 inputs need v's head dim to equal k's"):
            flashtile.flash_attn_func(q, k, torch.randn(1, 4, 2, 16).to(torch.float8_e4m3fn))


def test_docs_models_examples_run():
    """docs/models.md's code blocks run as written, in one namespace (later blocks reuse earlier imports)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"models.md#block{i}", "exec"), namespace)
