"""The fused split merge (FLASHTILE_DECODE_FUSED_COMBINE) inside CUDA graphs, on the GPU.

Its counters are per stream and never allocated during a capture, so a capture takes the fused
path only on a stream that ran the call once before (as `bench_graph` now does: warm-up and capture
on one stream); on a stream without counters it falls back to the merge kernel, with the same
results. Until session 9 the benchmark captured on torch's own capture stream, so its "fused merge"
rows had (all but by chance: side streams come from a pool of 32) measured the merge kernel.
Run alone: gpu_check.sh tests-decode-fused-graph."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as launcher
from test_gpu_kvcache import _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]  # gluon: not in the default GPU runs


def _count_merges(monkeypatch):
    merges = []
    real = launcher.combine

    def combine(*args, **kw):
        merges.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(launcher, "combine", combine)
    return merges


@pytest.mark.parametrize("page", [None, 16])
def test_fused_merge_is_captured_after_a_warm_up_on_the_capture_stream(monkeypatch, page):
    monkeypatch.setattr(launcher, "FUSED_COMBINE", True)
    merges = _count_merges(monkeypatch)
    q, kc, vc, kw = _inputs(1, 1, 0, 32, 8, 128, 8192, torch.bfloat16, page=page)

    def call():
        return flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True, **kw)

    monkeypatch.setattr(launcher, "FUSED_COMBINE", False)
    ref, ref_lse = call()
    monkeypatch.setattr(launcher, "FUSED_COMBINE", True)
    merges.clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager, eager_lse = call()  # allocates this stream's counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, lse = call()
    assert not merges, "the capture fell back to the merge kernel"
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    assert (out.float() - ref.float()).abs().max().item() < 1e-2
    assert (lse - ref_lse).abs().max().item() < 1e-4
    assert all(int(buf.abs().sum()) == 0 for buf in launcher._COUNTERS.values())


def test_capture_on_a_fresh_stream_falls_back_to_the_merge_kernel(monkeypatch):
    # torch hands out side streams round-robin from a pool, so "fresh" means: no counters anywhere
    monkeypatch.setattr(launcher, "_COUNTERS", {})
    monkeypatch.setattr(launcher, "FUSED_COMBINE", True)
    merges = _count_merges(monkeypatch)
    q, kc, vc, kw = _inputs(1, 1, 0, 32, 8, 128, 8192, torch.bfloat16)
    monkeypatch.setattr(launcher, "FUSED_COMBINE", False)
    flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)  # compile the fallback's kernels outside the capture
    monkeypatch.setattr(launcher, "FUSED_COMBINE", True)
    eager = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
    merges.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
    assert merges == [1]
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - eager.float()).abs().max().item() < 1e-2
