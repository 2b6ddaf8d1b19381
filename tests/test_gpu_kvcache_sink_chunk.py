"""flash_attn_with_kvcache with ``learnable_sink`` and ``attention_chunk`` on the GPU, bf16, on every route that takes
them (forced through FLASHTILE_DECODE_ROUTE): the split kernel (sink in the kernel unsplit, in the merge split;
chunk), the whole-row and split Gluon kernels (sink in the merge), the MLA kernel; against the PyTorch reference
with FlashAttention's correctness bar. Plus a sink + chunk decode step captured in a CUDA graph."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import route as R
from spies import record_kernels
from test_gpu_kvcache import _capture, _check, _inputs
from test_gpu_kvcache_mla import _check as _check_mla
from test_gpu_kvcache_mla import _inputs as _inputs_mla

pytestmark = pytest.mark.gpu

DEV = "cuda"
FEATURES = {"sink": dict(sink=True), "chunk": dict(chunk=1000), "both": dict(sink=True, chunk=384)}


def _features(h, sink=False, chunk=0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    kw = {}
    if sink:
        kw["learnable_sink"] = torch.randn(h, device=DEV, generator=g) * 2
    if chunk:
        kw["attention_chunk"] = chunk
    return kw


def _hopper():
    return torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("page", [None, 16, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_split_route(monkeypatch, feature, page, num_splits):
    taken = record_kernels(monkeypatch)
    # two query tokens (speculative decoding), causal: a chunk boundary can fall between them
    q, kc, vc, kw = _inputs(4, 2, 2, 32, 8, 128, 3000, torch.bfloat16, page=page, seed=len(feature))
    with config.override(decode_route="split"):
        _check(q, kc, vc, kw, causal=True, num_splits=num_splits, **_features(32, **FEATURES[feature]))
    assert [r.kernel for r in taken] == ["split"] and (num_splits == 0 or taken[0].splits == 1)


@pytest.mark.parametrize("window", [(700, 0), (-1, -1)])
def test_split_route_window_and_empty_rows(window):
    # rows 1..3 hold no key (cache_seqlens 0, no append): out 0, lse = the sink
    q, kc, vc, kw = _inputs(4, 1, 0, 16, 4, 64, 2048, torch.bfloat16, seed=7)
    kw["cache_seqlens"][1:] = 0
    feats = _features(16, sink=True, chunk=512)
    with config.override(decode_route="split"):
        _check(q, kc, vc, kw, window_size=window, **feats)
        out, lse = flash_attn_with_kvcache(q, kc, vc, window_size=window, return_softmax_lse=True, **kw, **feats)
    assert (out[1:] == 0).all()
    torch.testing.assert_close(lse[1:], feats["learnable_sink"].view(1, -1, 1).expand(3, -1, 1))


@pytest.mark.parametrize("page", [None, 64])
def test_rows_route_takes_a_sink(monkeypatch, page):
    taken = record_kernels(monkeypatch)
    q, kc, vc, kw = _inputs(8, 1, 1, 32, 8, 128, 4133, torch.bfloat16, page=page, seed=11)
    with config.override(decode_route="rows"):
        _check(q, kc, vc, kw, causal=True, **_features(32, sink=True))
    assert [r.kernel for r in taken] == ["rows"]


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="the Gluon kernel is Hopper's")
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_split_route_takes_a_sink(monkeypatch, d):
    taken = record_kernels(monkeypatch)
    q, kc, vc, kw = _inputs(2, 1, 1, 32, 8, d, 8192, torch.bfloat16, seed=d)
    with config.override(decode_route="gluon"):
        _check(q, kc, vc, kw, causal=True, **_features(32, sink=True, seed=d))
    assert [r.kernel for r in taken] == ["gluon"] and taken[0].splits > 1


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="the Gluon kernel is Hopper's")
def test_gluon_and_rows_refuse_a_chunk_by_name():
    q, kc, vc, kw = _inputs(2, 1, 0, 32, 8, 128, 8192, torch.bfloat16)
    for name in ("gluon", "rows"):
        with config.override(decode_route=name), pytest.raises(ValueError, match=f"'{name}' cannot take this call"):
            flash_attn_with_kvcache(q, kc, vc, **kw, attention_chunk=256)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("page", [None, 64])
def test_mla_route(monkeypatch, page, num_splits):
    taken = record_kernels(monkeypatch)
    q, kc, vc, kw = _inputs_mla(3, 2, 2, 64, 1500, torch.bfloat16, page=page, seed=5)
    _check_mla(q, kc, vc, kw, causal=True, num_splits=num_splits, **_features(64, sink=True, chunk=256))
    assert [r.kernel for r in taken] == ["mla"]


def test_sink_and_chunk_step_in_a_cuda_graph():
    q, kc, vc, kw = _inputs(4, 1, 1, 32, 8, 128, 4096, torch.bfloat16, seed=3)
    feats = _features(32, sink=True, chunk=1024)
    lens = kw["cache_seqlens"]
    base = lens.clone()

    def step():
        return flash_attn_with_kvcache(q, kc, vc, kw["k"], kw["v"], cache_seqlens=lens, return_softmax_lse=True,
                                       **feats)

    graph, (out, lse) = _capture(step, before_capture=lambda: lens.copy_(base))
    lens.copy_(base)
    graph.replay()
    lens.copy_(base)
    want, want_lse = step()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_route_table_on_this_device():
    # the rule (nothing forced): a sink keeps the rows route, a chunk sends the call to the split kernel
    props = R.device_props(torch.device(DEV))
    s = R.DecodeShape(64, 1, 32, 8, 128, 16384)
    for extra, want in (({"sink": True}, R.select_route(s, torch.bfloat16, False, 0, props).kernel),
                        ({"chunk": True}, "split")):
        assert R.select_route(s._replace(**extra), torch.bfloat16, False, 0, props).kernel == want
