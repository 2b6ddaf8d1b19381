"""flash_attn_with_kvcache with ``qv`` (MLA) on the GPU: the MLA kernel at DeepSeek's sizes (one latent kv head,
d = 64 rope dims, dv = 512 latent dims, 16-128 query heads), bf16 / fp16, contiguous and paged caches, against the
PyTorch reference with FlashAttention's correctness bar; a decode step captured in a CUDA graph; no host syncs."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.reference_kvcache import kvcache_ref
from test_gpu_kvcache import _capture
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _inputs(b, sq, s_new, h, cap, dtype, page=None, h_k=1, d=64, dv=512, rotary=False, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)

    q, qv = randn(b, sq, h, d), randn(b, sq, h, dv)
    kw = {"qv": qv}
    lens = torch.randint(0, cap - s_new + 1, (b,), device=DEV, dtype=torch.int32, generator=g)
    lens[0] = cap - s_new
    kw["cache_seqlens"] = lens
    if page is None:
        k_cache, v_cache = randn(b, cap, h_k, d), randn(b, cap, h_k, dv)
    else:
        per = -(-cap // page)
        pool = b * per + 3
        kw["block_table"] = torch.randperm(pool, device=DEV, generator=g)[: b * per].view(b, per).to(torch.int32)
        k_cache, v_cache = randn(pool, page, h_k, d), randn(pool, page, h_k, dv)
        cap = per * page
    if s_new:
        kw["k"], kw["v"] = randn(b, s_new, h_k, d), randn(b, s_new, h_k, dv)
    if rotary:
        angle = torch.rand(cap, d // 2, device=DEV, generator=g) * 6.3
        kw.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=False)
    return q, k_cache, v_cache, kw


def _check(q, k_cache, v_cache, kw, **call):
    rkc, rvc = k_cache.clone(), v_cache.clone()
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw, **call)
    call.pop("num_splits", None)
    ref, ref_lse = kvcache_ref(q, rkc, rvc, **kw, **call)
    pt, _ = kvcache_ref(q, k_cache.clone(), v_cache.clone(), **kw, **call, upcast=False)
    assert out.shape == q.shape[:3] + (v_cache.shape[-1],)
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    assert torch.equal(vc, rvc)
    assert (kc.float() - rkc.float()).abs().max().item() <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h", [16, 64, 128])
@pytest.mark.parametrize("page", [None, 1, 64])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_mla_decode(dtype, h, page, num_splits):
    # the reference repeats v for every query head in fp32 (b x keys x h x 2 KB): short caches keep it small
    q, kc, vc, kw = _inputs(3, 1, 1, h, 1500, dtype, page=page, seed=h)
    _check(q, kc, vc, kw, num_splits=num_splits)


@pytest.mark.parametrize("sq", [2, 4])
def test_mla_speculative_tokens_causal_rotary(sq):
    q, kc, vc, kw = _inputs(2, sq, sq, 128, 2048, torch.bfloat16, page=64, rotary=True)
    _check(q, kc, vc, kw, causal=True)


def test_value_head_dim_of_its_own_without_qv():
    q, kc, vc, kw = _inputs(2, 1, 1, 32, 2048, torch.bfloat16, h_k=8, d=192, dv=128, rotary=True)
    kw.pop("qv")
    _check(q, kc, vc, kw, causal=True)


def test_mla_no_host_sync():
    q, kc, vc, kw = _inputs(8, 1, 1, 128, 4096, torch.bfloat16, page=64)
    flash_attn_with_kvcache(q, kc, vc, **kw)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn_with_kvcache(q, kc, vc, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_mla_cuda_graph_decode_step():
    """Capture one MLA decode step (append + split attention + merge), replay it with new lengths."""
    q, kc, vc, kw = _inputs(4, 1, 1, 128, 8192, torch.bfloat16, page=64)
    lens = kw.pop("cache_seqlens")
    lens.copy_(torch.tensor([100, 4000, 0, 8000], device=DEV, dtype=torch.int32))
    static_lens = lens.clone()
    kc_eager, vc_eager = kc.clone(), vc.clone()

    def step():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=static_lens, **kw)

    def reset():  # the warm-up appended once
        kc.copy_(kc_eager)
        vc.copy_(vc_eager)

    graph, static_out = _capture(step, reset)
    for t in range(3):
        static_lens.copy_(lens + t)
        graph.replay()
        ref = flash_attn_with_kvcache(q, kc_eager, vc_eager, cache_seqlens=lens + t, **kw)
        torch.cuda.synchronize()
        assert (static_out.float() - ref.float()).abs().max().item() < 1e-2
    assert torch.equal(vc, vc_eager)
