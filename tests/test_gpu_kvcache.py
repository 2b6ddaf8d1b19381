"""flash_attn_with_kvcache on the GPU: the Triton kernels at real sizes, against the PyTorch reference.

Grid of the issue: head dims 32..256, cache lengths up to 128k, contiguous and paged caches (pages
of 1, 16, 256), rotary on/off, GQA 8:1, fp16/bf16. Plus: no host syncs on the call, and a decode
step captured in a CUDA graph and replayed.
"""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.reference_kvcache import kvcache_ref
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _inputs(b, sq, s_new, h, h_k, d, cap, dtype, page=None, rotary=False, interleaved=True, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype, generator=g)
    kw = {}
    lens = torch.randint(0, cap - s_new + 1, (b,), device=DEV, dtype=torch.int32, generator=g)
    lens[0] = cap - s_new
    kw["cache_seqlens"] = lens
    if page is None:
        k_cache = torch.randn(b, cap, h_k, d, device=DEV, dtype=dtype, generator=g)
    else:
        per = -(-cap // page)
        pool = b * per + 5
        kw["block_table"] = torch.randperm(pool, device=DEV, generator=g)[: b * per].view(b, per).to(torch.int32)
        k_cache = torch.randn(pool, page, h_k, d, device=DEV, dtype=dtype, generator=g)
        cap = per * page
    v_cache = torch.randn(k_cache.shape, device=DEV, dtype=dtype, generator=g)  # seeded like the rest
    if s_new:
        kw["k"] = torch.randn(b, s_new, h_k, d, device=DEV, dtype=dtype, generator=g)
        kw["v"] = torch.randn(b, s_new, h_k, d, device=DEV, dtype=dtype, generator=g)
    if rotary:
        rd = d // 2 if d >= 64 else d
        rd -= rd % 2
        angle = torch.rand(cap, rd // 2, device=DEV, generator=g) * 6.3
        kw.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=interleaved)
    return q, k_cache, v_cache, kw


def _check(q, k_cache, v_cache, kw, on_views=False, **call):
    """The call against the reference. It runs on clones of the caches, unless ``on_views``: then on the caches
    themselves (a clone of a sliced or expanded view is contiguous, so a test of such views needs them)."""
    rkc, rvc = k_cache.clone(), v_cache.clone()
    kc, vc = (k_cache, v_cache) if on_views else (k_cache.clone(), v_cache.clone())
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw, **call)
    call.pop("num_splits", None)  # a kernel-side choice: the reference has one answer for every split
    ref, ref_lse = kvcache_ref(q, rkc, rvc, **kw, **call)
    pt, _ = kvcache_ref(q, k_cache.clone(), v_cache.clone(), **kw, **call, upcast=False)
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    assert torch.equal(vc, rvc)
    if kc.numel():  # a cache without keys has nothing to compare (and max() of nothing is an error)
        assert (kc.float() - rkc.float()).abs().max().item() <= 1e-2


def _capture(step, before_capture=None):
    """Run ``step`` once on a side stream (its kernels compile outside the capture), call ``before_capture``
    if given, then capture ``step`` in a CUDA graph: returns (graph, the graph's static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    # on the warm-up stream: per-stream state made there (the fused decode merges' counters) is used in the capture
    with torch.cuda.graph(graph, stream=s):
        out = step()
    return graph, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("page", [None, 1, 16, 256])
@pytest.mark.parametrize("rotary", [False, True])
def test_grid_decode(dtype, d, page, rotary):
    q, kc, vc, kw = _inputs(4, 1, 1, 16, 2, d, 3000, dtype, page=page, rotary=rotary, seed=d)
    _check(q, kc, vc, kw, causal=True)


# the 128k-key references take ~10 GiB each: one worker runs them in turn (gpu_check.sh's --dist loadgroup)
@pytest.mark.parametrize("seqlen_k", [8192, 32768,
                                      pytest.param(131072, marks=pytest.mark.xdist_group("big_reference"))])
@pytest.mark.parametrize("page", [None, 16, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_long_caches_gqa_8_to_1(seqlen_k, page, num_splits):
    q, kc, vc, kw = _inputs(2, 1, 1, 32, 4, 128, seqlen_k, torch.bfloat16, page=page, rotary=True)
    _check(q, kc, vc, kw, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(512, 0)), dict(softcap=30.0, causal=True),
                                dict(alibi=True, causal=True)])
@pytest.mark.parametrize("sq,s_new", [(1, 1), (4, 4), (128, 128), (3, 0)])
def test_features_prefill_and_speculative(kw, sq, s_new):
    kw = dict(kw)
    # rotary needs new keys to rotate (FA2 refuses cos/sin without k, v): none when s_new = 0
    q, kc, vc, args = _inputs(3, sq, s_new, 16, 2, 128, 2048, torch.bfloat16, rotary=s_new > 0, interleaved=False)
    if kw.pop("alibi", False):
        args["alibi_slopes"] = torch.rand(3, 16, device=DEV) * 0.1
    _check(q, kc, vc, args, **kw)


def test_batch_idx_and_leftpad():
    q, kc, vc, kw = _inputs(4, 1, 2, 8, 8, 64, 1000, torch.float16, rotary=True)
    kc = torch.cat([kc, torch.randn_like(kc)])
    vc = torch.cat([vc, torch.randn_like(vc)])
    kw["cache_batch_idx"] = torch.tensor([5, 0, 2, 7], device=DEV, dtype=torch.int32)
    kw["cache_leftpad"] = (kw["cache_seqlens"] // 3).to(torch.int32)
    _check(q, kc, vc, kw, causal=True)


def test_no_host_sync():
    q, kc, vc, kw = _inputs(8, 1, 1, 32, 8, 128, 4096, torch.bfloat16, page=16, rotary=True)
    flash_attn_with_kvcache(q, kc, vc, **kw, causal=True)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn_with_kvcache(q, kc, vc, **kw, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("page", [None, 16])
def test_cuda_graph_decode_step(page):
    """Capture one decode step (append + rotary + split-KV attention), replay it with new lengths."""
    q, kc, vc, kw = _inputs(4, 1, 1, 32, 8, 128, 8192, torch.bfloat16, page=page, rotary=True)
    lens = kw.pop("cache_seqlens")
    lens.copy_(torch.tensor([100, 4000, 0, 8000], device=DEV, dtype=torch.int32))
    static_lens = lens.clone()
    kc_eager, vc_eager = kc.clone(), vc.clone()

    def step():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=static_lens, causal=True, **kw)

    def reset():  # the warm-up appended once
        kc.copy_(kc_eager)
        vc.copy_(vc_eager)

    graph, static_out = _capture(step, reset)
    for t in range(3):
        static_lens.copy_(lens + t)
        graph.replay()
        ref = flash_attn_with_kvcache(q, kc_eager, vc_eager, cache_seqlens=lens + t, causal=True, **kw)
        torch.cuda.synchronize()
        assert (static_out.float() - ref.float()).abs().max().item() < 1e-2
    assert torch.equal(vc, vc_eager)


def test_config_past_shared_memory_runs_with_fewer_stages(monkeypatch):
    """A config the GPU cannot hold (as the H200 tables would be on a GPU with less shared memory)
    must still give the right answer: host.launch drops pipeline stages until it fits, warns once."""
    from flashtile import config
    from flashtile.backends.triton import host

    monkeypatch.setattr(host, "_REDUCED_STAGES", {})
    q, kc, vc, kw = _inputs(2, 1, 1, 16, 4, 128, 4096, torch.bfloat16, page=16)
    # 128-key paged tiles at 12 stages compile to 338 KB of shared memory for sm_90 (8 stages: 206 KB)
    with config.override(decode_tiles=(64, 128, 4, 12)):
        with pytest.warns(RuntimeWarning, match="pipeline stages"):
            _check(q, kc, vc, kw, causal=True)
        assert list(host._REDUCED_STAGES.values())[0] < 12
        _check(q, kc, vc, kw, causal=True)  # remembered: no second warning needed, same answer
