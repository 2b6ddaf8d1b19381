"""Rotary embeddings against a plain PyTorch reference: PyTorch path, and the Triton kernel in the interpreter."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import rotary as launcher
from flashtile.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)
from spies import spy_launches


def rotary_ref(x, cos, sin, interleaved=False, offsets=0):
    """x (b, s, h, d): rotate_half formulation in fp32, positions s + offsets[b]."""
    b, s = x.shape[:2]
    rd = 2 * cos.shape[1]
    offs = offsets.tolist() if isinstance(offsets, torch.Tensor) else [offsets] * b
    out = x.float().clone()
    for i in range(b):
        pos = torch.arange(s) + offs[i]
        ok = (pos < cos.shape[0]).unsqueeze(-1)
        c = torch.where(ok, cos.float()[pos.clamp(max=cos.shape[0] - 1)], 1.0)
        sn = torch.where(ok, sin.float()[pos.clamp(max=cos.shape[0] - 1)], 0.0)
        if interleaved:
            c = c.repeat_interleave(2, -1)[:, None]
            sn = sn.repeat_interleave(2, -1)[:, None]
            xr = out[i, :, :, :rd]
            rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        else:
            c = torch.cat((c, c), -1)[:, None]
            sn = torch.cat((sn, sn), -1)[:, None]
            xr = out[i, :, :, :rd]
            x1, x2 = xr.chunk(2, -1)
            rot = torch.cat((-x2, x1), -1)
        out[i, :, :, :rd] = xr * c + rot * sn
    return out.to(x.dtype)


def tables(seqlen_ro, rd, dtype=torch.float32):
    ang = torch.rand(seqlen_ro, rd // 2) * 6.28
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.fixture(params=["torch", "triton-interp"])
def backend(request, monkeypatch):
    """Run each test on the PyTorch path and through the Triton kernel in Triton's interpreter."""
    calls = []
    interp = request.param == "triton-interp"
    if interp:
        real = launcher.rotary_fwd

        def spy(*a, **k):
            calls.append(1)
            return real(*a, **k)

        monkeypatch.setattr(launcher, "rotary_fwd", spy)
    # several row blocks on short sequences
    with config.override(interpret=interp, rotary_block_m=4 if interp else None):
        yield request.param
    if request.param == "triton-interp":
        assert calls, "the Triton kernel did not run"


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [32, 12])  # full head dim, and partial (12 of 32)
@pytest.mark.parametrize("offset_kind", ["int", "tensor"])
def test_apply_rotary(backend, dtype, interleaved, rd, offset_kind):
    b, s, h, d = 2, 13, 3, 32
    x = torch.randn(b, s, h, d).to(dtype)
    cos, sin = tables(40, rd, dtype)
    offsets = 5 if offset_kind == "int" else torch.tensor([0, 19], dtype=torch.int32)
    ref = rotary_ref(x, cos, sin, interleaved, offsets)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    torch.testing.assert_close(out, ref, **tol(dtype))
    assert torch.equal(out[..., rd:], x[..., rd:])


def test_position_past_table_is_unrotated(backend):
    x = torch.randn(2, 6, 2, 16)
    cos, sin = tables(8, 16)
    offsets = torch.tensor([0, 5], dtype=torch.int32)  # row 1 reaches positions 5..10 > 7
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    torch.testing.assert_close(out, rotary_ref(x, cos, sin, False, offsets))
    torch.testing.assert_close(out[1, 3:], x[1, 3:])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_offsets", [False, True])
def test_varlen(backend, interleaved, tensor_offsets):
    lens = [5, 0, 11, 1]
    h, d, rd = 2, 24, 16
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lens), h, d)
    cos, sin = tables(32, rd)
    offsets = torch.tensor([3, 0, 7, 20], dtype=torch.int32) if tensor_offsets else 2
    out = apply_rotary_emb(x, cos, sin, interleaved, cu_seqlens=cu, max_seqlen=max(lens), seqlen_offsets=offsets)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        off = int(offsets[i]) if tensor_offsets else offsets
        ref = rotary_ref(x[cu[i]:cu[i + 1]].unsqueeze(0), cos, sin, interleaved, off)[0]
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inplace_and_grad(backend, dtype):
    b, s, h, d, rd = 2, 9, 2, 16, 8
    cos, sin = tables(20, rd, dtype)
    base = torch.randn(b, s, h, d).to(dtype)
    offsets = torch.tensor([1, 4], dtype=torch.int32)
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        x = leaf * 1  # a non-leaf, so the in-place variant may write into it
        out = apply_rotary_emb(x, cos, sin, interleaved=True, inplace=inplace, seqlen_offsets=offsets)
        if inplace:
            assert out.data_ptr() == x.data_ptr()
        g = torch.randn_like(out)
        out.backward(g)
        ref_leaf = base.float().clone().requires_grad_()
        ref = rotary_ref(ref_leaf, cos.float(), sin.float(), True, offsets)
        ref.backward(g.float())
        torch.testing.assert_close(out.float(), ref.detach(), **tol(dtype))
        torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad, **tol(dtype))


def test_gradcheck_fp64():
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(8, 6, torch.float64)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, False, seqlen_offsets=2), (x,))


def test_qkv_and_kv_inplace(backend):
    b, s, h, d = 2, 7, 2, 16
    cos, sin = tables(16, d)
    cos_k, sin_k = tables(16, d)
    qkv = torch.randn(b, s, 3, h, d)
    ref = qkv.clone()
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=3)
    assert out is qkv
    torch.testing.assert_close(qkv[:, :, 0], rotary_ref(ref[:, :, 0], cos, sin, False, 3))
    torch.testing.assert_close(qkv[:, :, 1], rotary_ref(ref[:, :, 1], cos_k, sin_k, False, 3))
    torch.testing.assert_close(qkv[:, :, 2], ref[:, :, 2])
    # GQA layout: (b, s, h_q + 2 h_k, d)
    qkv = torch.randn(b, s, 4 + 2, d)
    ref = qkv.clone()
    apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=True, num_heads_q=4)
    torch.testing.assert_close(qkv[:, :, :5], rotary_ref(ref[:, :, :5], cos, sin, True))
    torch.testing.assert_close(qkv[:, :, 5:], ref[:, :, 5:])
    kv = torch.randn(b, s, 2, h, d)
    ref = kv.clone()
    apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=torch.tensor([0, 2], dtype=torch.int32))
    torch.testing.assert_close(kv[:, :, 0], rotary_ref(ref[:, :, 0], cos, sin, False, torch.tensor([0, 2])))
    torch.testing.assert_close(kv[:, :, 1], ref[:, :, 1])


def test_qkv_grad():
    qkv0 = torch.randn(2, 5, 3, 2, 8, requires_grad=True)
    cos, sin = tables(8, 8)
    out = apply_rotary_emb_qkv_(qkv0 * 1, cos, sin)
    g = torch.randn_like(out)
    out.backward(g)
    expect = g.clone()
    for j in (0, 1):
        expect[:, :, j] = rotary_ref(g[:, :, j], cos, -sin)
    torch.testing.assert_close(qkv0.grad, expect)


@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(backend, scale_base):
    d, rd = 32, 16
    rot = RotaryEmbedding(rd, base=500.0, interleaved=False, scale_base=scale_base)
    qkv = torch.randn(2, 10, 3, 2, d)
    ref = qkv.clone()
    rot(qkv, seqlen_offset=4)
    inv = 1.0 / 500.0 ** (torch.arange(0, rd, 2).float() / rd)
    n = rot._seq_len_cached
    ang = torch.outer(torch.arange(n).float(), inv)
    cos, sin = ang.cos(), ang.sin()
    cos_k, sin_k = cos, sin
    if scale_base is not None:
        scale = ((torch.arange(0, rd, 2) + 0.4 * rd) / (1.4 * rd))[None] ** (
            (torch.arange(n) - n // 2) / scale_base)[:, None]
        cos, sin, cos_k, sin_k = cos * scale, sin * scale, cos / scale, sin / scale
    torch.testing.assert_close(qkv[:, :, 0], rotary_ref(ref[:, :, 0], cos, sin, False, 4))
    torch.testing.assert_close(qkv[:, :, 1], rotary_ref(ref[:, :, 1], cos_k, sin_k, False, 4))
    # separate q / kv form, cache grows on demand
    q, kv = torch.randn(1, 40, 2, d), torch.randn(1, 40, 2, 2, d)
    rot(q, kv, seqlen_offset=30)
    assert rot._seq_len_cached >= 70


def test_bad_arguments():
    cos, sin = tables(8, 8)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(torch.randn(1, 4, 1, 4), cos, sin)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(torch.randn(1, 6, 1, 8), cos, sin, seqlen_offsets=4)
    with pytest.raises(TypeError, match="cu_seqlens"):
        apply_rotary_emb(torch.randn(6, 1, 8), cos, sin, cu_seqlens=torch.tensor([0, 6]), max_seqlen=6)


def _fa2_xpos_tables(dim, scale_base, n, base=10000.0):
    """FlashAttention's XPos tables built at exactly length n, all in fp32: (cos, sin, cos_k, sin_k)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    scale = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
    s = scale ** ((torch.arange(n, dtype=torch.float32) - n // 2) / scale_base).unsqueeze(-1)
    return torch.cos(freqs) * s, torch.sin(freqs) * s, torch.cos(freqs) / s, torch.sin(freqs) / s


def test_rotary_embedding_cache_from_inference_mode_trains():
    """A table built under inference_mode is rebuilt for training (else: 'cannot be saved for backward')."""
    rot = RotaryEmbedding(8)
    with torch.inference_mode():
        rot(torch.randn(1, 4, 3, 2, 8))
    assert rot._cos_cached.is_inference()
    leaf = torch.randn(1, 4, 3, 2, 8, requires_grad=True)
    rot(leaf.clone()).sum().backward()
    assert leaf.grad is not None and not rot._cos_cached.is_inference()


def test_xpos_table_does_not_depend_on_growth_or_half():
    rot = RotaryEmbedding(8, scale_base=512)
    rot(torch.randn(1, 10, 3, 2, 8))
    rot(torch.randn(1, 15, 3, 2, 8))  # grows: rebuilt at exactly 15 (the scale is centred on seqlen // 2)
    cos, sin, cos_k, sin_k = _fa2_xpos_tables(8, 512, 15)
    assert rot._seq_len_cached == 15 and rot._cos_cached.shape[0] == 15
    for got, want in zip((rot._cos_cached, rot._sin_cached, rot._cos_k_cached, rot._sin_k_cached),
                         (cos, sin, cos_k, sin_k)):
        torch.testing.assert_close(got, want)
    # after .half() the scale is still computed in fp32 (the fp16 `scale` buffer is not used)
    rot = RotaryEmbedding(64, scale_base=64).half()
    rot(torch.randn(1, 2048, 3, 1, 64, dtype=torch.float16))
    cos, _, cos_k, _ = _fa2_xpos_tables(64, 64, 2048)
    assert torch.equal(rot._cos_cached, cos.half()) and torch.equal(rot._cos_k_cached, cos_k.half())


def test_tensor_offset_without_max_seqlen_uses_cache():
    """FlashAttention: a tensor seqlen_offset with max_seqlen=None uses the existing table."""
    rot = RotaryEmbedding(16, base=500.0)
    rot(torch.randn(2, 20, 3, 2, 16))  # table of 20 positions
    qkv = torch.randn(2, 3, 3, 2, 16)
    ref = qkv.clone()
    offsets = torch.tensor([5, 15], dtype=torch.int32)
    rot(qkv, seqlen_offset=offsets)
    cos, sin = rot._cos_cached, rot._sin_cached
    assert cos.shape[0] >= 20
    torch.testing.assert_close(qkv[:, :, 0], rotary_ref(ref[:, :, 0], cos, sin, False, offsets))
    # no table yet: one is built for the tokens themselves; positions past it stay unrotated
    fresh = RotaryEmbedding(16)
    q, kv = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 2, 16)
    fresh(q, kv, seqlen_offset=offsets)
    assert fresh._seq_len_cached >= 3


def test_argument_errors_name_the_argument():
    cos, sin = tables(8, 8)
    x = torch.randn(2, 4, 1, 8)
    with pytest.raises(TypeError, match="cos and sin"):
        apply_rotary_emb(x, cos, sin.double())
    with pytest.raises(TypeError, match="cos and sin"):
        apply_rotary_emb(x, cos.to(torch.int32), sin.to(torch.int32))
    with pytest.raises(ValueError, match="seqlen_offsets must be on"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="cu_seqlens must be on"):
        apply_rotary_emb(torch.randn(6, 1, 8), cos, sin, max_seqlen=6,
                         cu_seqlens=torch.tensor([0, 6], dtype=torch.int32, device="meta"))


def test_kernel_grid_is_flat(monkeypatch):
    """batch * heads goes on grid axis 0 (CUDA caps axes 1 and 2 at 65535)."""
    grids = spy_launches(monkeypatch, launcher, "_rotary_kernel").grids
    cos, sin = tables(16, 8)
    x = torch.randn(3, 10, 5, 8)
    with config.override(interpret=True, rotary_block_m=4):
        out = apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
    torch.testing.assert_close(out, rotary_ref(x, cos, sin, False, 2))
    assert grids == [(3 * 5 * 3,)]  # cdiv(10, 4) row blocks x 5 heads x 3 batch


def test_second_derivative_raises():
    # the backward rotates the gradient with the kernel: its result has no derivative of its own, so a gradient
    # penalty must raise (first_order.py), never lose its second-order part silently
    x = torch.randn(1, 8, 2, 16, requires_grad=True)
    cos, sin = torch.randn(8, 8), torch.randn(8, 8)
    qkv = torch.randn(1, 8, 3, 2, 16, requires_grad=True)
    for leaf, out in ((x, apply_rotary_emb(x, cos, sin)), (qkv, apply_rotary_emb_qkv_(qkv.clone(), cos, sin))):
        (g,) = torch.autograd.grad((out ** 2).sum(), leaf, create_graph=True)
        with pytest.raises(RuntimeError, match="rotary has no second derivative"):
            torch.autograd.grad((g ** 2).sum() + (leaf ** 2).sum(), [leaf])
