"""The Gluon dK/dV route's rule (backends/triton/gluon_bwd.py) on CPU: what it refuses, by name."""

import pytest
import torch

from flashtile.backends.triton import gluon_bwd
from flashtile.params import AttnParams


def _p(**kw):
    return AttnParams(softmax_scale=0.1, **kw)


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_plain_and_causal_are_covered(monkeypatch):
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    # a kernel change not yet run on the GPU turns the route off entirely
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", False)
    assert "verified" in gluon_bwd.refusal(q, k, v, q.clone(), k.clone(), v.clone(), _p())
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", True)
    for p in (_p(), _p(window_right=0)):
        assert gluon_bwd.refusal(q, k, v, q.clone(), k.clone(), v.clone(), p) is None


def test_refusals_name_the_reason(monkeypatch):
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", True)
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    args = (q.clone(), k.clone(), v.clone())
    assert "dtype" in gluon_bwd.refusal(q.float(), k.float(), v.float(), *args, _p())
    assert "head_dim" in gluon_bwd.refusal(_t(2, 256, 4, 96), _t(2, 256, 2, 96), _t(2, 256, 2, 96),
                                           _t(2, 256, 4, 96), _t(2, 256, 2, 96), _t(2, 256, 2, 96), _p())
    d256 = (_t(2, 256, 4, 256), _t(2, 256, 2, 256), _t(2, 256, 2, 256))
    assert gluon_bwd.refusal(*d256, *(x.clone() for x in d256), _p()) is None  # verified in session 7
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED_HEAD_DIMS", (64, 128))  # a build not yet run on the GPU
    assert "256 not yet verified" in gluon_bwd.refusal(*d256, *(x.clone() for x in d256), _p())
    assert "seqlen" in gluon_bwd.refusal(q, _t(2, 200, 2, 128), _t(2, 200, 2, 128), q, _t(2, 200, 2, 128),
                                         _t(2, 200, 2, 128), _p())
    assert "window" in gluon_bwd.refusal(q, k, v, *args, _p(window_left=16, window_right=0))
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    assert "varlen" in gluon_bwd.refusal(q, k, v, *args, _p(cu_seqlens_q=cu, cu_seqlens_k=cu))
    assert "softcap" in gluon_bwd.refusal(q, k, v, *args, _p(softcap=5.0))
    dout_odd = _t(2, 256, 4, 129)[..., 1:]  # row stride of 258 bytes: not a TMA stride
    assert "dout" in gluon_bwd.refusal(q, k, v, dout_odd, *args[1:], _p())
    assert gluon_bwd.refusal(q, k, v, _t(2, 4, 256, 128).transpose(1, 2), *args[1:], _p()) is None  # aligned view


def test_never_on_cpu(monkeypatch):
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    monkeypatch.delenv("FLASHTILE_GLUON_BWD", raising=False)
    assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", True)
    assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())  # CPU tensors


def _on_sm90(monkeypatch, q, k, v, env, causal=False):
    # the route's rule as an sm_90 GPU would apply it, with CPU tensors standing in
    monkeypatch.setattr(gluon_bwd, "capability", lambda device: (9, 0))
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)
    if env is None:
        monkeypatch.delenv("FLASHTILE_GLUON_BWD", raising=False)
    else:
        monkeypatch.setenv("FLASHTILE_GLUON_BWD", env)
    return gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p(window_right=0) if causal else _p())


@pytest.mark.parametrize("d,dtype,s,causal,env,want", [
    (128, torch.bfloat16, 1024, False, None, True),   # measured faster: the default
    (128, torch.float16, 4096, False, None, True),    # measured faster too
    (128, torch.bfloat16, 512, False, None, False),   # shorter than measured: the Triton kernel's short tiles
    (128, torch.bfloat16, 1024, True, None, True),    # causal s = 1024: faster timed directly (session 8)
    (128, torch.bfloat16, 512, True, None, False),
    (128, torch.bfloat16, 2048, True, None, True),
    (256, torch.bfloat16, 1024, True, None, True),    # d = 256 won from s = 1024, causal too
    (256, torch.float16, 4096, False, None, True),   # fp16 d = 256 measured faster (session 8)
    (256, torch.float32, 4096, False, "1", False),   # fp32: the kernel takes fp16 / bf16 only
    (256, torch.float16, 4096, False, "1", True),
    (64, torch.bfloat16, 1024, False, None, False),   # measured slower from s = 4096: Triton unless forced
    (64, torch.bfloat16, 1024, False, "1", True),
    (128, torch.bfloat16, 512, True, "1", True),
    (128, torch.bfloat16, 1024, False, "0", False),   # the switch turns the default off
    (256, torch.bfloat16, 4096, True, "0", False),
    (128, torch.bfloat16, 1024, False, "", True),     # empty means unset
])
def test_default_rule_and_switch(monkeypatch, d, dtype, s, causal, env, want):
    q, k, v = _t(1, s, 4, d, dtype=dtype), _t(1, s, 2, d, dtype=dtype), _t(1, s, 2, d, dtype=dtype)
    assert _on_sm90(monkeypatch, q, k, v, env, causal) is want


def test_grids_past_the_second_axis_limit_are_refused():
    # b x h_k programs on the grid's y axis, which CUDA caps at 65535
    q, k = _t(32769, 1, 2, 128), _t(32769, 1, 2, 128)
    assert "65535" in gluon_bwd.refusal(q, k, k, q, k, k, _p())
    assert "65535" in gluon_bwd.dq_refusal(q, k, k, q, q, _p())


def test_dq_route_off_unless_forced_and_verified(monkeypatch):
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    monkeypatch.delenv("FLASHTILE_GLUON_BWD_DQ", raising=False)
    monkeypatch.setattr(gluon_bwd, "capability", lambda device: (9, 0))
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)
    monkeypatch.setattr(gluon_bwd, "DQ_GPU_VERIFIED", True)
    assert not gluon_bwd.use_gluon_bwd_dq(q, k, v, q, q, _p())  # not forced: off
    monkeypatch.setenv("FLASHTILE_GLUON_BWD_DQ", "1")
    assert gluon_bwd.use_gluon_bwd_dq(q, k, v, q, q, _p())
    monkeypatch.setattr(gluon_bwd, "DQ_GPU_VERIFIED", False)
    assert not gluon_bwd.use_gluon_bwd_dq(q, k, v, q, q, _p())


def test_dq_refusals_name_the_reason():
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    assert gluon_bwd.dq_refusal(q, k, v, q, q.clone(), _p()) is None
    assert "dtype" in gluon_bwd.dq_refusal(q, k, v, q, q.float(), _p())
    assert "softcap" in gluon_bwd.dq_refusal(q, k, v, q, q.clone(), _p(softcap=5.0))
    dq_odd = _t(2, 256, 4, 129)[..., 1:]  # row stride of 258 bytes: not a TMA stride
    assert "dq" in gluon_bwd.dq_refusal(q, k, v, q, dq_odd, _p())

