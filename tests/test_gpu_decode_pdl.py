"""GPU tests of programmatic dependent launch for the decode kernels (Route.pdl / merge_pdl / append_pdl; the
``decode_pdl`` setting forces it on or off): results bitwise equal to ordinary launches, eager and in a CUDA graph of
several calls (the way a serving step runs its layers), and the default rule for serving steps."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import route, split
from spies import patch_routes
from test_gpu_kvcache import _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _sm90():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")


def _launches(monkeypatch):
    """Record, per split-kernel / merge launch, whether it asked for programmatic dependent launch."""
    calls = []
    real_launch, real_combine = split.launch, split.combine

    def counting_launch(kernel, grid, *args, **meta):
        calls.append(meta.get("launch_pdl", False))
        return real_launch(kernel, grid, *args, **meta)

    def counting_combine(*args, pdl=False, **kw):
        calls.append(pdl)
        return real_combine(*args, pdl=pdl, **kw)

    monkeypatch.setattr(split, "launch", counting_launch)
    monkeypatch.setattr(split, "combine", counting_combine)
    return calls


def _large_caches(monkeypatch, serving_rows=route.PDL_APPEND_MAX_ROWS):
    """Every cache counted as large (the size rule says no), the serving-step rule up to ``serving_rows``."""
    monkeypatch.setattr(route, "PDL_MAX_KV_BYTES", 0)
    monkeypatch.setattr(route, "PDL_APPEND_MAX_ROWS", serving_rows)
    route.select_route.cache_clear()  # routes made under the real bounds (_fresh_routes clears these after)


@pytest.fixture(autouse=True)
def _fresh_routes():
    yield
    route.select_route.cache_clear()


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("b,num_splits", [(1, 0), (1, 1), (8, 0), (3, 5)])
@pytest.mark.parametrize("s_new", [0, 1])
def test_pdl_matches_ordinary_launch(monkeypatch, page, b, num_splits, s_new):
    calls = _launches(monkeypatch)
    results = []
    for pdl in (False, True):
        q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, 8192, torch.bfloat16, page=page, rotary=s_new > 0)
        with config.override(decode_pdl=pdl):
            out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, num_splits=num_splits,
                                               return_softmax_lse=True, **kw)
        torch.cuda.synchronize()
        results.append((out, lse, kc, vc))
    assert calls and calls[-1] is True and calls[0] is False
    for a, c in zip(*results):
        assert torch.equal(a, c)  # same kernels, same order of work: bit for bit


@pytest.mark.parametrize("b,expected", [(1, True), (2, True), (4, False)])
def test_serving_step_rule(monkeypatch, b, expected):
    """By default a call that appends through the separate kernel on at most PDL_APPEND_MAX_ROWS (row, kv head)
    pairs takes programmatic dependent launch whatever the cache's size (here every cache counts as large), more
    pairs do not; results bit for bit those of ordinary launches."""
    _large_caches(monkeypatch)
    calls = _launches(monkeypatch)
    results = []
    for pdl in (None, False):
        q, kc, vc, kw = _inputs(b, 1, 1, 32, 8, 128, 8192, torch.bfloat16, rotary=True)
        with config.override(decode_pdl=pdl):
            out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True, **kw)
        torch.cuda.synchronize()
        results.append((out, lse, kc, vc))
        if pdl is None:  # split, merge: the merge a dependent in any case (merge_pdl)
            assert calls and all(c is expected for c in calls[:-1]) and calls[-1] is True, calls
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("b,num_splits", [(8, 0), (3, 5)])
def test_merge_alone_as_a_dependent(monkeypatch, page, b, num_splits):
    """A split call the size rule leaves on ordinary launches (every cache counted as large): by default its merge
    launches as a dependent of the split kernel; bit for bit the launch with an ordinary merge."""
    _large_caches(monkeypatch)
    calls = _launches(monkeypatch)
    results = []
    for merge_pdl in (False, True):
        q, kc, vc, kw = _inputs(b, 1, 0, 32, 8, 128, 8192, torch.bfloat16, page=page)
        with monkeypatch.context() as m:
            if not merge_pdl:
                patch_routes(m, merge_pdl=False)
            out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, num_splits=num_splits,
                                               return_softmax_lse=True, **kw)
        torch.cuda.synchronize()
        results.append((out, lse))
    assert calls == [False, False, False, True], calls  # split, merge; then the split in order, the merge early
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("merge_only", [False, True])
def test_pdl_in_a_graph_of_layers(monkeypatch, merge_only):
    """Eight decode calls captured in one CUDA graph with PDL on, each layer's query being the previous layer's
    output (so a kernel that read before its wait would see a stale input), replayed with new lengths, against the
    same chain launched ordinarily: outputs and appended caches bit for bit. The append runs as its own kernel, a
    programmatic dependent too, between a layer's merge and the next layer's decode. ``merge_only``: the default
    launches of a large call (every cache counted as large, no serving-step rule): each layer's merge alone a
    dependent of its split kernel."""
    on = None if merge_only else True
    if merge_only:
        _large_caches(monkeypatch, serving_rows=0)
    layers = [_inputs(1, 1, 1, 32, 8, 128, 8192, torch.bfloat16, page=16, rotary=True, seed=i) for i in range(8)]
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
    calls = _launches(monkeypatch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with config.override(decode_pdl=on), torch.cuda.stream(s):
        chain(graph_caches, static_lens)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    # each layer: its split launch, then its merge (the separate append is not recorded); merge_only: in order,
    # then a dependent
    assert calls == ([False, True] if merge_only else [True, True]) * len(layers), calls
    for (kc, vc), (k0, v0) in zip(graph_caches, saved):
        kc.copy_(k0)
        vc.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with config.override(decode_pdl=on), torch.cuda.graph(graph):
        outs = chain(graph_caches, static_lens)
    for t in range(3):
        static_lens.copy_(lens + t)
        graph.replay()
        torch.cuda.synchronize()
        # the reference chain appends into copies of the caches as they were before this replay
        ref_caches = [(k0.clone(), v0.clone()) for k0, v0 in saved]
        with config.override(decode_pdl=False):
            refs = chain(ref_caches, lens + t)
        torch.cuda.synchronize()
        for out, ref in zip(outs, refs):
            assert torch.equal(out, ref)
        for (kc, vc), (rk, rv) in zip(graph_caches, ref_caches):
            assert torch.equal(kc, rk) and torch.equal(vc, rv)
        saved = [(kc.clone(), vc.clone()) for kc, vc in graph_caches]
