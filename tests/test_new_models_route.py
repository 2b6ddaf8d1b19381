"""Calls with v's own head dim or attention_chunk route to the Triton kernels, which have them, never to the
Gluon kernels or the fp8 forward, which do not; a learnable sink takes the Gluon routes (the bf16 forward folds
it in, the backward needs nothing) and stays off the fp8 forward. Checked on CPU with an sm_90 GPU faked (as
tests/test_gluon_route.py does)."""

import pytest
import torch

from flashtile import config
from flashtile.backends import triton as triton_backend
from flashtile.backends.triton import attn_fwd as fwd_launcher
from flashtile.backends.triton import attn_fwd_fp8, gluon_bwd, gluon_route
from flashtile.params import AttnParams

SINK = (dict(learnable_sink=torch.zeros(4)), 128)
# the features the Gluon kernels lack
FEATURES = {
    "dv": (dict(), 64),
    "attention_chunk": (dict(attention_chunk=256), 128),
}


def _qkv(dv, s=4096, d=128, dtype=torch.bfloat16):
    return (torch.empty(2, s, 4, d, dtype=dtype), torch.empty(2, s, 4, d, dtype=dtype),
            torch.empty(2, s, 4, dv, dtype=dtype))


def _p(**kw):
    return AttnParams(softmax_scale=0.1, **kw)


def _on_sm90(monkeypatch):
    for module in (gluon_route, gluon_bwd):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")), raising=False)


@pytest.mark.parametrize("name", FEATURES)
def test_gluon_forward_refuses_and_names_the_feature(name):
    kw, dv = FEATURES[name]
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        why = gluon_route.refusal(*_qkv(dv, dtype=dtype), _p(**kw))
        assert why is not None and (name in why or "dv != d" in why), why
    assert gluon_route.refusal(*_qkv(128), _p()) is None  # the same call without it is covered


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("forced", [None, True], ids=["table", "forced"])
def test_the_default_forward_route_is_the_triton_kernel(monkeypatch, name, forced):
    kw, dv = FEATURES[name]
    q, k, v = _qkv(dv)
    taken = []
    monkeypatch.setattr(gluon_route, "gluon_fwd", lambda *a: taken.append("gluon"))
    monkeypatch.setattr(fwd_launcher, "attn_fwd", lambda *a: taken.append("triton"))
    _on_sm90(monkeypatch)
    with config.override(gluon_fwd=forced):
        assert not gluon_route.use_gluon(q, k, v, _p(**kw))
        triton_backend.fwd(q, k, v, _p(**kw))
        assert gluon_route.use_gluon(*_qkv(128), _p())  # the plain call of that shape takes the Gluon kernel
    assert taken == ["triton"]


@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("forced", [None, True], ids=["table", "forced"])
def test_the_backward_keeps_the_triton_dkdv_kernel(monkeypatch, name, forced):
    kw, dv = FEATURES[name]
    q, k, v = _qkv(dv, s=2048)
    _on_sm90(monkeypatch)
    with config.override(gluon_bwd=forced):
        assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p(**kw))
        q, k, v = _qkv(128, s=2048)
        assert gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())


@pytest.mark.parametrize("forced", [None, True], ids=["table", "forced"])
def test_a_sink_takes_the_gluon_routes(monkeypatch, forced):
    kw, dv = SINK
    taken = []
    monkeypatch.setattr(gluon_route, "gluon_fwd", lambda *a: taken.append("gluon"))
    monkeypatch.setattr(fwd_launcher, "attn_fwd", lambda *a: taken.append("triton"))
    _on_sm90(monkeypatch)
    with config.override(gluon_fwd=forced, gluon_bwd=forced):
        assert gluon_route.refusal(*_qkv(dv), _p(**kw)) is None
        triton_backend.fwd(*_qkv(dv), _p(**kw))
        q, k, v = _qkv(dv, s=2048)
        assert gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p(**kw))
    assert taken == ["gluon"]


@pytest.mark.parametrize("name", [*FEATURES, "learnable_sink"])
def test_fp8_forward_names_what_it_lacks(monkeypatch, name):
    kw, dv = FEATURES.get(name, SINK)
    q, k, v = _qkv(dv, s=64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="learnable_sink" if name == "learnable_sink" else
                       "attention_chunk" if name == "attention_chunk" else r"dv != d"):
        attn_fwd_fp8.attn_fwd_fp8(q, k, v, _p(**kw))
    # and an sm_90 call of the Gluon fp8 kernel's own shape comes to it, not to the Gluon kernel
    q, k, v = _qkv(dv, dtype=torch.float8_e4m3fn)
    _on_sm90(monkeypatch)
    monkeypatch.setattr(gluon_route, "gluon_fwd", lambda *a: pytest.fail("the Gluon fp8 kernel took the call"))
    with pytest.raises(ValueError, match="fp8 forward has no"):
        triton_backend.fwd(q, k, v, _p(**kw))


@pytest.mark.parametrize("forced", [None, True], ids=["table", "forced"])
def test_q_k_192_with_v_128_takes_the_gluon_forward(monkeypatch, forced):
    # DeepSeek-V3's training shape: the 16-bit Gluon kernel splits q / k's 192 columns into 128 + 64
    taken = []
    monkeypatch.setattr(gluon_route, "gluon_fwd", lambda *a: taken.append("gluon"))
    monkeypatch.setattr(fwd_launcher, "attn_fwd", lambda *a: taken.append("triton"))
    _on_sm90(monkeypatch)
    q, k, v = _qkv(128, d=192)
    with config.override(gluon_fwd=forced):
        assert gluon_route.refusal(q, k, v, _p()) is None
        triton_backend.fwd(q, k, v, _p())
        # v of 192 columns, or fp8, stay on Triton
        why = gluon_route.refusal(*_qkv(192, d=192), _p())
        assert why is not None and "(192, 192)" in why
        assert gluon_route.refusal(*_qkv(128, d=192, dtype=torch.float8_e4m3fn), _p()) is not None
    assert taken == ["gluon"]
