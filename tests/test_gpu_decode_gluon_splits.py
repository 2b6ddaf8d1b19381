"""The Gluon warps-along-keys decode kernel with key splits on the H200 (FLASHTILE_DECODE_GLUON_SPLITS=N, an
experiment of session 23): calls the split heuristic would split go to the kernel with N splits a (row, kv head)
and the split merge. Every such call must match the PyTorch reference (FlashAttention's tolerance rule), also
with splits that get no keys, rows without keys, appended keys and inside a CUDA graph."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode_gluon
from test_gpu_kvcache import _capture, _check, _inputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def split_calls(monkeypatch):
    """FLASHTILE_DECODE_GLUON_SPLITS=4, and a list of the split counts of every launch of the kernel."""
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "4")
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", raising=False)
    calls = []
    real = decode_gluon.gluon_decode

    def spy(*args, **kwargs):
        calls.append(kwargs.get("splits", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_gluon, "gluon_decode", spy)
    return calls


# (b, h, h_k, d, cap, s_new): grids the heuristic splits (b * h_k well under the SMs), GQA 4:1 / 8:1 and MHA,
# ragged lengths, caches off the tile grid, caches too short for every split to get a tile
SHAPES = [(8, 32, 8, 128, 8192, 0), (8, 32, 8, 128, 4133, 1), (1, 32, 8, 128, 3000, 0), (2, 64, 8, 128, 100, 1),
          (4, 16, 16, 64, 2049, 0), (1, 8, 1, 128, 700, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_matches_reference(split_calls, dtype, shape):
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, dtype, seed=cap)
    _check(q, kc, vc, kw, causal=True)
    assert split_calls == [4], split_calls


def test_rows_without_keys(split_calls):
    q, kc, vc, kw = _inputs(8, 1, 0, 32, 8, 128, 600, torch.bfloat16, seed=2)
    kw["cache_seqlens"][1::2] = 0  # out 0, lse +inf, from splits that all saw no key
    kw["cache_seqlens"][2] = 5  # one split with keys, three without
    _check(q, kc, vc, kw)
    assert split_calls == [4]


def test_explicit_num_splits_keeps_the_triton_kernel(split_calls):
    q, kc, vc, kw = _inputs(8, 1, 0, 32, 8, 128, 2000, torch.bfloat16)
    _check(q, kc, vc, kw, num_splits=3)
    assert not split_calls


def test_cuda_graph_step(split_calls, monkeypatch):
    q, kc, vc, kw = _inputs(8, 1, 1, 32, 8, 128, 1000, torch.bfloat16)
    lens = kw.pop("cache_seqlens")
    lens.clamp_(max=900)
    k_new, v_new = kw.pop("k"), kw.pop("v")

    def step():
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True)

    graph, out = _capture(step)
    for _ in range(3):
        lens += 1
        graph.replay()
        monkeypatch.delenv("FLASHTILE_DECODE_GLUON_SPLITS")  # the default kernels on the appended cache
        ref = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=lens + 1, causal=True)
        monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "4")
        torch.cuda.synchronize()
        assert (out.float() - ref.float()).abs().max().item() < 2e-2
    assert split_calls and set(split_calls) == {4}
