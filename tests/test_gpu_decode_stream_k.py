"""GPU tests of the stream-K split (FLASHTILE_DECODE_STREAM_K=G, an experiment, off by default): one
program per SM, each an equal run of the rows' key blocks laid end to end (backends/triton/decode.py
stream_k_plan). b = 8 and b = 1 GQA 32/8 steps take it at these lengths; they must match the reference
with a fused append, rotary, pages and unequal row lengths, stay close to the ordinary split launch
(another partition of the same keys), and replay from a CUDA graph with new lengths. In gpu_check.sh
tests-decode-stream-k."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as launcher
from spies import record_launch_meta
from test_gpu_kvcache import DEV, _assert_paths_close, _capture, _check, _inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["1", "4"], ids=["G1", "G4"])
def stream_k(monkeypatch, request):
    """Stream-K on, with G = 1 (session 13's) or 4 kv heads in lockstep."""
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", request.param)
    return record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)


@pytest.mark.parametrize("b,cap", [(8, 16384), (8, 5000), (1, 65536)])
@pytest.mark.parametrize("page", [None, 16, 256])
@pytest.mark.parametrize("s_new,rotary", [(0, False), (1, True)])
def test_stream_k_against_reference_and_split(stream_k, monkeypatch, b, cap, page, s_new, rotary):
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, cap, torch.bfloat16, page=page, rotary=rotary, seed=11)
    _check(q, kc, vc, kw, causal=True)
    assert stream_k[-1].get("STREAM_K"), "the launch did not take stream-K"
    outs = [flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw)]
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "0")
    outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw))
    assert not stream_k[-1].get("STREAM_K")
    _assert_paths_close(outs)


def test_stream_k_cuda_graph_replay(stream_k):
    """Captured once, replayed with new (unequal) lengths: each replay equals an eager call."""
    q, kc, vc, kw = _inputs(8, 1, 1, 32, 8, 128, 16384, torch.bfloat16, rotary=True, seed=12)
    lens = kw.pop("cache_seqlens")
    lens.copy_(torch.tensor([100, 16000, 0, 8000, 5, 12000, 16382, 700], device=DEV, dtype=torch.int32))
    static_lens = lens.clone()
    kc_eager, vc_eager = kc.clone(), vc.clone()

    def step():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=static_lens, causal=True, **kw)

    def reset():  # the warm-up appended once
        kc.copy_(kc_eager)
        vc.copy_(vc_eager)

    graph, static_out = _capture(step, reset)
    assert stream_k[-1].get("STREAM_K")
    for t in range(2):
        static_lens.copy_(lens + t)
        graph.replay()
        ref = flash_attn_with_kvcache(q, kc_eager, vc_eager, cache_seqlens=lens + t, causal=True, **kw)
        torch.cuda.synchronize()
        assert (static_out.float() - ref.float()).abs().max().item() < 1e-2
    assert torch.equal(vc, vc_eager)
