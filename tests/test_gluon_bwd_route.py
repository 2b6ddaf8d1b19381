"""The Gluon dK/dV route's rule (backends/triton/gluon_bwd.py) on CPU: what it refuses, by name."""

import torch

from flashtile.backends.triton import gluon_bwd
from flashtile.params import AttnParams


def _p(**kw):
    return AttnParams(softmax_scale=0.1, **kw)


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_plain_and_causal_are_covered(monkeypatch):
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    # nothing until the fixed kernel has passed its GPU tests
    assert "verified" in gluon_bwd.refusal(q, k, v, q.clone(), k.clone(), v.clone(), _p())
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", True)
    for p in (_p(), _p(window_right=0)):
        assert gluon_bwd.refusal(q, k, v, q.clone(), k.clone(), v.clone(), p) is None


def test_refusals_name_the_reason(monkeypatch):
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", True)
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    args = (q.clone(), k.clone(), v.clone())
    assert "dtype" in gluon_bwd.refusal(q.float(), k.float(), v.float(), *args, _p())
    assert "head_dim" in gluon_bwd.refusal(_t(2, 256, 4, 256), _t(2, 256, 2, 256), _t(2, 256, 2, 256),
                                           _t(2, 256, 4, 256), _t(2, 256, 2, 256), _t(2, 256, 2, 256), _p())
    assert "seqlen" in gluon_bwd.refusal(q, _t(2, 200, 2, 128), _t(2, 200, 2, 128), q, _t(2, 200, 2, 128),
                                         _t(2, 200, 2, 128), _p())
    assert "window" in gluon_bwd.refusal(q, k, v, *args, _p(window_left=16, window_right=0))
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    assert "varlen" in gluon_bwd.refusal(q, k, v, *args, _p(cu_seqlens_q=cu, cu_seqlens_k=cu))
    assert "softcap" in gluon_bwd.refusal(q, k, v, *args, _p(softcap=5.0))
    dout_odd = _t(2, 256, 4, 129)[..., 1:]  # row stride of 258 bytes: not a TMA stride
    assert "dout" in gluon_bwd.refusal(q, k, v, dout_odd, *args[1:], _p())
    assert gluon_bwd.refusal(q, k, v, _t(2, 4, 256, 128).transpose(1, 2), *args[1:], _p()) is None  # aligned view


def test_off_by_default_and_never_on_cpu(monkeypatch):
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    monkeypatch.delenv("FLASHTILE_GLUON_BWD", raising=False)
    assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", True)
    assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())  # CPU tensors
