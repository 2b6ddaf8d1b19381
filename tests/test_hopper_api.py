"""``flashtile.hopper``: FlashAttention-3's ``flash_attn_interface`` signatures and return values (issue 48, item
5), on the CPU path against ``attention_ref``, and ``import flash_attn_interface`` through the compat shim."""

import importlib
import inspect
import sys

import pytest
import torch

import flashtile
import flashtile.compat
from flashtile import hopper
from flashtile.backends.reference import attention_ref

# FlashAttention-3's parameter lists (hopper/flash_attn_interface.py), in order, before flashtile's keyword-only
# learnable_sink
FA3_PARAMS = {
    "flash_attn_qkvpacked_func": "qkv softmax_scale causal q_descale k_descale v_descale window_size attention_chunk "
                                 "softcap deterministic num_heads_q sm_margin return_attn_probs",
    "flash_attn_func": "q k v softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                       "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k "
                              "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                              "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx "
                               "cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens "
                               "q_descale k_descale v_descale softmax_scale causal window_size attention_chunk "
                               "softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin "
                               "return_softmax_lse",
    "flash_attn_combine": "out_partial lse_partial out out_dtype",
    "get_scheduler_metadata": "batch_size max_seqlen_q max_seqlen_k num_heads_q num_heads_kv headdim cache_seqlens "
                              "qkv_dtype headdim_v cu_seqlens_q cu_seqlens_k_new cache_leftpad page_size "
                              "max_seqlen_k_new causal window_size attention_chunk has_softcap num_splits pack_gqa "
                              "sm_margin",
}


@pytest.mark.parametrize("name", sorted(FA3_PARAMS))
def test_signatures_are_fa3s(name):
    params = inspect.signature(getattr(hopper, name)).parameters.values()
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == FA3_PARAMS[name].split()


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_func_returns_out_or_out_and_lse_and_has_gradients():
    q, k, v = _leaf(2, 9, 4, 8), _leaf(2, 13, 2, 8), _leaf(2, 13, 2, 12)
    sink = _leaf(4)
    out = hopper.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 9, 4, 12)
    out, lse = hopper.flash_attn_func(q, k, v, None, True, attention_chunk=4, return_attn_probs=True,
                                      learnable_sink=sink)
    ref, ref_lse = attention_ref(q, k, v, causal=True, attention_chunk=4, learnable_sink=sink)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, k, v, sink], g), torch.autograd.grad(ref, [q, k, v, sink], g)):
        torch.testing.assert_close(a, b)


def test_varlen_with_seqused():
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 14], dtype=torch.int32)
    q, k, v = _leaf(12, 2, 8), _leaf(14, 2, 8), _leaf(14, 2, 8)
    used_k = torch.tensor([6, 4], dtype=torch.int32)
    out, lse = hopper.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 8, None, used_k, causal=True,
                                             return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k, causal=True)
    torch.testing.assert_close(out, ref)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite])


@pytest.mark.parametrize("packed", ["5d", "4d-gqa"])
def test_qkvpacked(packed):
    if packed == "5d":
        qkv = _leaf(2, 10, 3, 4, 8)
        q, k, v = qkv.unbind(2)
        out = hopper.flash_attn_qkvpacked_func(qkv, causal=True)
    else:  # 4 query heads then 2 + 2 kv heads along the head dim
        qkv = _leaf(2, 10, 8, 8)
        q, k, v = qkv.split([4, 2, 2], dim=2)
        out = hopper.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)
    ref, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, g)[0], torch.autograd.grad(ref, qkv, g)[0])


def test_qkvpacked_4d_needs_num_heads_q():
    with pytest.raises(ValueError, match="needs num_heads_q"):
        hopper.flash_attn_qkvpacked_func(torch.randn(1, 4, 8, 8))
    with pytest.raises(ValueError, match="needs num_heads_q"):
        hopper.flash_attn_qkvpacked_func(torch.randn(1, 4, 8, 8), num_heads_q=5)


def test_qv_outside_the_cache_is_refused_by_name():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="qv .* flash_attn_with_kvcache only"):
        hopper.flash_attn_func(q, q, q, qv=torch.randn(1, 4, 2, 8))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="qv"):
        hopper.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, qv=q[0])


@pytest.mark.parametrize("kw", [dict(num_splits=1.5), dict(pack_gqa="yes"), dict(sm_margin=None)])
def test_hints_are_type_checked(kw):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=next(iter(kw))):
        hopper.flash_attn_func(q, q, q, **kw)


def test_hints_do_not_change_results():
    q, k, v = (torch.randn(1, 6, 4, 8) for _ in range(3))
    base = hopper.flash_attn_func(q, k, v, causal=True)
    hinted = hopper.flash_attn_func(q, k, v, causal=True, num_splits=4, pack_gqa=True, sm_margin=8)
    assert torch.equal(base, hinted)


def test_kvcache_matches_flashtiles_and_takes_scheduler_metadata():
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    lens = torch.tensor([7, 20], dtype=torch.int32)
    meta = hopper.get_scheduler_metadata(2, 1, 20, 4, 2, 16, lens)
    assert meta.dtype == torch.int32
    out, lse = hopper.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                              scheduler_metadata=meta, return_softmax_lse=True)
    want, want_lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                       return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens"])
def test_kvcache_unsupported_arguments_are_named(name):
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    value = 1 if name == "max_seqlen_q" else torch.zeros(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=name):
        hopper.flash_attn_with_kvcache(q, cache, cache, **{name: value})


def test_compat_makes_flash_attn_interface_resolve_here():
    flashtile.compat.install()
    try:
        sys.modules.pop("flash_attn_interface", None)
        fa3 = importlib.import_module("flash_attn_interface")
        assert fa3 is hopper.flash_attn_interface
        from flash_attn_interface import flash_attn_func  # noqa: PLC0415 - the import is what is tested

        assert flash_attn_func is hopper.flash_attn_func
    finally:
        flashtile.compat.uninstall()
    assert "flash_attn_interface" not in sys.modules


def test_kvcache_mla_qv_through_fa3s_signature():
    # MLA in absorbed form: q / k with 16 rope dims, qv / v with a 32-dim latent, one latent head for 4 query heads
    torch.manual_seed(1)
    q, qv = torch.randn(2, 1, 4, 16, dtype=torch.float64), torch.randn(2, 1, 4, 32, dtype=torch.float64)
    k_cache = torch.randn(2, 24, 1, 16, dtype=torch.float64)
    v_cache = torch.randn(2, 24, 1, 32, dtype=torch.float64)
    lens = torch.tensor([9, 24], dtype=torch.int32)
    out = hopper.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=lens)
    assert out.shape == (2, 1, 4, 32)
    for i, n in enumerate(lens.tolist()):  # the default scale is 1 / sqrt(d + dv)
        ref, _ = attention_ref(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], qv=qv[i:i + 1])
        torch.testing.assert_close(out[i:i + 1], ref)
