"""GPU tests of the decode kernel's L2 prefetch under programmatic dependent launch
(FLASHTILE_DECODE_PREFETCH, backends/triton/decode.py PREFETCH_OVERRIDE): a kernel launched early
asks L2 for its first key blocks before griddepcontrol.wait. Prefetches move lines into L2 and
nothing else, so results must be bitwise those without them: eager, and in a CUDA graph of chained
layers whose lengths change between replays (the prefetch reads the lengths racing the previous
kernel). Run alone: gpu_check.sh tests-decode-prefetch."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as launcher
from test_gpu_kvcache import _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


def _needs_sm90():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")


def _prefetch_requests(monkeypatch):
    """Record the PREFETCH_BLOCKS each decode launch asked for."""
    seen = []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, *args, **meta):
        if kernel is launcher._decode_kernel:
            seen.append(meta.get("PREFETCH_BLOCKS", 0))
        return real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    return seen


@pytest.mark.parametrize("b,num_splits", [(1, 0), (1, 1), (8, 0), (3, 5)])
@pytest.mark.parametrize("s_new", [0, 1])
@pytest.mark.parametrize("extra", ["plain", "leftpad", "window", "past-capacity-blocks"])
def test_prefetch_matches_no_prefetch(monkeypatch, b, num_splits, s_new, extra):
    _needs_sm90()
    seen = _prefetch_requests(monkeypatch)
    monkeypatch.setattr(launcher, "PDL_OVERRIDE", True)
    results = []
    for blocks in (0, 4 if extra != "past-capacity-blocks" else 64):
        monkeypatch.setattr(launcher, "PREFETCH_OVERRIDE", blocks)
        q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, 8192, torch.bfloat16, rotary=s_new > 0)
        call = dict(causal=True)
        if extra == "leftpad":
            kw["cache_leftpad"] = torch.randint(0, 300, (b,), device=DEV, dtype=torch.int32,
                                                generator=torch.Generator(device=DEV).manual_seed(7))
            kw["cache_seqlens"] = torch.maximum(kw["cache_seqlens"], kw["cache_leftpad"])
        if extra == "window":
            call["window_size"] = (1000, 0)
        out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **kw, **call)
        torch.cuda.synchronize()
        results.append((out, lse, kc, vc))
    assert seen[0] == 0 and seen[-1] > 0, seen  # the second call really prefetched
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_no_prefetch_for_paged_or_batch_index(monkeypatch):
    # the launcher's rule: a paged tile's addresses need the table, a batch index could point anywhere
    _needs_sm90()
    seen = _prefetch_requests(monkeypatch)
    monkeypatch.setattr(launcher, "PDL_OVERRIDE", True)
    monkeypatch.setattr(launcher, "PREFETCH_OVERRIDE", 4)
    q, kc, vc, kw = _inputs(2, 1, 0, 32, 8, 128, 4096, torch.bfloat16, page=16)
    flash_attn_with_kvcache(q, kc, vc, **kw)
    q, kc, vc, kw = _inputs(2, 1, 0, 32, 8, 128, 4096, torch.bfloat16)
    flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=torch.tensor([1, 0], device=DEV, dtype=torch.int32), **kw)
    flash_attn_with_kvcache(q, kc, vc, **kw)
    torch.cuda.synchronize()
    assert seen == [0, 0, 4]


def test_prefetch_in_a_graph_of_layers(monkeypatch):
    """Eight decode calls with fused appends captured in one graph with PDL and the prefetch on,
    each layer's query the previous layer's output, replayed with new lengths, against the same chain
    without the prefetch: outputs and appended caches bit for bit."""
    _needs_sm90()
    monkeypatch.setattr(launcher, "PDL_OVERRIDE", True)
    layers = [_inputs(1, 1, 1, 32, 8, 128, 8192, torch.bfloat16, rotary=True, seed=i) for i in range(8)]
    q0 = layers[0][0]
    lens = torch.tensor([5000], device=DEV, dtype=torch.int32)
    static_lens = lens.clone()
    saved = [(kc.clone(), vc.clone()) for _, kc, vc, _ in layers]
    for _, _, _, kw in layers:
        kw.pop("cache_seqlens")

    def chain(caches, seqlens):
        q, outs = q0, []
        for (_, _, _, kw), (kc, vc) in zip(layers, caches):
            q = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, **kw)
            outs.append(q)
        return outs

    graph_caches = [(kc, vc) for _, kc, vc, _ in layers]
    monkeypatch.setattr(launcher, "PREFETCH_OVERRIDE", 4)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(graph_caches, static_lens)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    for (kc, vc), (k0, v0) in zip(graph_caches, saved):
        kc.copy_(k0)
        vc.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = chain(graph_caches, static_lens)
    for t in range(3):
        static_lens.copy_(lens + 37 * t)  # lengths change between replays, racing nothing but still read early
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(launcher, "PREFETCH_OVERRIDE", 0)
        ref_caches = [(k0.clone(), v0.clone()) for k0, v0 in saved]
        refs = chain(ref_caches, lens + 37 * t)
        torch.cuda.synchronize()
        monkeypatch.setattr(launcher, "PREFETCH_OVERRIDE", 4)
        for out, ref in zip(outs, refs):
            assert torch.equal(out, ref)
        for (kc, vc), (rk, rv) in zip(graph_caches, ref_caches):
            assert torch.equal(kc, rk) and torch.equal(vc, rv)
        saved = [(kc.clone(), vc.clone()) for kc, vc in graph_caches]
