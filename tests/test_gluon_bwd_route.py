"""The Gluon dK/dV route's rule (backends/triton/gluon_bwd.py) on CPU: what it refuses, by name."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import gluon_bwd
from flashtile.params import AttnParams


def _p(**kw):
    return AttnParams(softmax_scale=0.1, **kw)


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_plain_and_causal_are_covered():
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    for p in (_p(), _p(window_right=0)):
        assert gluon_bwd.refusal(q, k, v, q.clone(), k.clone(), v.clone(), p) is None


def test_refusals_name_the_reason():
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    args = (q.clone(), k.clone(), v.clone())
    assert "dtype" in gluon_bwd.refusal(q.float(), k.float(), v.float(), *args, _p())
    assert "head_dim" in gluon_bwd.refusal(_t(2, 256, 4, 96), _t(2, 256, 2, 96), _t(2, 256, 2, 96),
                                           _t(2, 256, 4, 96), _t(2, 256, 2, 96), _t(2, 256, 2, 96), _p())
    d256 = (_t(2, 256, 4, 256), _t(2, 256, 2, 256), _t(2, 256, 2, 256))
    assert gluon_bwd.refusal(*d256, *(x.clone() for x in d256), _p()) is None
    # q and k of different lengths: the UNEQUAL build; causal needs k the longer
    k2, v2 = _t(2, 200, 2, 128), _t(2, 200, 2, 128)
    assert gluon_bwd.refusal(q, k2, v2, q, k2.clone(), v2.clone(), _p()) is None
    assert "seqlen_k < seqlen_q" in gluon_bwd.refusal(q, k2, v2, q, k2.clone(), v2.clone(), _p(window_right=0))
    assert gluon_bwd.refusal(q[:, :100], k2, v2, q[:, :100], k2.clone(), v2.clone(), _p(window_right=0)) is None
    # a causal sliding window is the kernel's LOCAL build; a window reaching right of the diagonal is not
    assert gluon_bwd.refusal(q, k, v, *args, _p(window_left=16, window_right=0)) is None
    assert "window" in gluon_bwd.refusal(q, k, v, *args, _p(window_left=16, window_right=4))
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    # packed sequences sharing one cu_seqlens: the VARLEN build
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    grads = [x.clone() for x in packed]
    varlen = dict(cu_seqlens_q=cu, max_seqlen_q=256, max_seqlen_k=256)
    assert gluon_bwd.refusal(*packed, *grads, _p(cu_seqlens_k=cu, **varlen)) is None
    # k with its own cu_seqlens (the VARLEN_K build), not with a window or ALiBi
    assert gluon_bwd.refusal(*packed, *grads, _p(cu_seqlens_k=cu.clone(), **varlen)) is None
    assert "own cu_seqlens" in gluon_bwd.refusal(*packed, *grads, _p(cu_seqlens_k=cu.clone(), window_left=32,
                                                                     window_right=0, **varlen))
    # softcap: the plain-order builds' SOFTCAP (d = 128 here); d = 64's rotated schedule has none
    assert gluon_bwd.refusal(q, k, v, *args, _p(softcap=5.0)) is None
    d64 = (_t(2, 256, 4, 64), _t(2, 256, 2, 64), _t(2, 256, 2, 64))
    assert "softcap" in gluon_bwd.refusal(*d64, *(x.clone() for x in d64), _p(softcap=5.0))
    dout_odd = _t(2, 256, 4, 129)[..., 1:]  # row stride of 258 bytes: not a TMA stride
    assert "dout" in gluon_bwd.refusal(q, k, v, dout_odd, *args[1:], _p())
    assert gluon_bwd.refusal(q, k, v, _t(2, 4, 256, 128).transpose(1, 2), *args[1:], _p()) is None  # aligned view


def test_never_on_cpu():
    q, k, v = _t(2, 256, 4, 128), _t(2, 256, 2, 128), _t(2, 256, 2, 128)
    assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())
    with config.override(gluon_bwd=True):
        assert not gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p())  # CPU tensors


def _on_sm90(monkeypatch, q, k, v, causal=False, cap=(9, 0)):
    # the route's rule as an sm_90 GPU would apply it, with CPU tensors standing in
    monkeypatch.setattr(gluon_bwd, "capability", lambda device: cap)
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)
    return gluon_bwd.use_gluon_bwd(q, k, v, q, k, v, _p(window_right=0) if causal else _p())


@pytest.mark.parametrize("d,dtype,s,causal,setting,want", [
    (128, torch.bfloat16, 1024, False, {}, True),    # measured faster: the default
    (128, torch.float16, 4096, False, {}, True),     # measured faster too
    (128, torch.bfloat16, 512, False, {}, False),    # shorter than measured: the Triton kernel's short tiles
    (128, torch.bfloat16, 1024, True, {}, True),
    (128, torch.bfloat16, 512, True, {}, False),
    (128, torch.bfloat16, 2048, True, {}, True),
    (256, torch.bfloat16, 1024, True, {}, True),     # d = 256 from s = 1024, causal too
    (256, torch.float16, 4096, False, {}, True),
    (256, torch.float32, 4096, False, dict(gluon_bwd=True), False),  # fp32: the kernel takes fp16 / bf16 only
    (256, torch.float16, 4096, False, dict(gluon_bwd=True), True),
    (64, torch.bfloat16, 1024, False, {}, False),    # measured slower: Triton unless forced
    (64, torch.bfloat16, 1024, False, dict(gluon_bwd=True), True),
    (128, torch.bfloat16, 512, True, dict(gluon_bwd=True), True),
    (128, torch.bfloat16, 1024, False, dict(gluon_bwd=False), False),  # forced off
    (256, torch.bfloat16, 4096, True, dict(gluon=False), False),  # FLASHTILE_GLUON=0: no Gluon kernel at all
    (256, torch.bfloat16, 4096, True, dict(gluon=False, gluon_bwd=True), False),
])
def test_route_table_and_settings(monkeypatch, d, dtype, s, causal, setting, want):
    q, k, v = _t(1, s, 4, d, dtype=dtype), _t(1, s, 2, d, dtype=dtype), _t(1, s, 2, d, dtype=dtype)
    with config.override(**setting):
        assert _on_sm90(monkeypatch, q, k, v, causal) is want


def test_other_gpus_keep_the_triton_kernels(monkeypatch):
    q, k, v = _t(1, 4096, 4, 128), _t(1, 4096, 2, 128), _t(1, 4096, 2, 128)
    with config.override(gluon_bwd=True):
        assert not _on_sm90(monkeypatch, q, k, v, cap=(10, 0))
        assert not _on_sm90(monkeypatch, q, k, v, cap=(8, 0))


def test_grids_past_the_second_axis_limit_are_refused():
    # b x h_k programs on the grid's y axis, which CUDA caps at 65535
    q, k = _t(32769, 1, 2, 128), _t(32769, 1, 2, 128)
    assert "65535" in gluon_bwd.refusal(q, k, k, q, k, k, _p())


@pytest.mark.parametrize("d,window_left,softcap,want", [
    (128, 256, 0.0, True),    # a causal window alone: the LOCAL build, measured faster
    (128, -1, 30.0, True),    # a softcap alone: measured faster
    (128, 256, 30.0, False),  # both at d = 128: measured slower, the Triton kernel
    (192, 1024, 30.0, True),  # both at d = 192: measured faster
])
def test_windowed_softcap_preference(monkeypatch, d, window_left, softcap, want):
    dv = gluon_bwd.V_HEAD_DIM[d]
    q, k, v = _t(1, 2048, 4, d), _t(1, 2048, 2, d), _t(1, 2048, 2, dv)
    monkeypatch.setattr(gluon_bwd, "capability", lambda device: (9, 0))
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)
    p = _p(window_left=window_left, window_right=0, softcap=softcap)
    assert gluon_bwd.use_gluon_bwd(q, k, v, _t(1, 2048, 4, dv), k.clone(), v.clone(), p) is want


def test_causal_alibi_is_covered_and_the_rest_refused_by_name(monkeypatch):
    # the ALIBI build: causal only, slopes (h,) or (b, h) with a unit last stride; the plain-order configs only
    q, k, v = _t(2, 1024, 4, 128), _t(2, 1024, 2, 128), _t(2, 1024, 2, 128)
    args = (q.clone(), k.clone(), v.clone())
    for slopes in (torch.rand(4), torch.rand(2, 4)):
        assert gluon_bwd.refusal(q, k, v, *args, _p(alibi_slopes=slopes, window_right=0)) is None
        assert gluon_bwd.refusal(q, k, v, *args, _p(alibi_slopes=slopes, window_left=64, window_right=0,
                                                    softcap=30.0)) is None
    why = gluon_bwd.refusal(q, k, v, *args, _p(alibi_slopes=torch.rand(4)))
    assert "ALiBi" in why and "causal" in why
    assert "stride" in gluon_bwd.refusal(q, k, v, *args, _p(alibi_slopes=torch.rand(4, 2).t(), window_right=0))
    d64 = (_t(2, 1024, 4, 64), _t(2, 1024, 2, 64), _t(2, 1024, 2, 64))
    why = gluon_bwd.refusal(*d64, *(x.clone() for x in d64), _p(alibi_slopes=torch.rand(4), window_right=0))
    assert "ALiBi" in why and "rotated" in why
    # on sm_90 the route table takes it as any causal call of its length
    monkeypatch.setattr(gluon_bwd, "capability", lambda device: (9, 0))
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)
    assert gluon_bwd.use_gluon_bwd(q, k, v, *args, _p(alibi_slopes=torch.rand(4), window_right=0))
    assert not gluon_bwd.use_gluon_bwd(q, k, v, *args, _p(alibi_slopes=torch.rand(4)))


def test_launcher_checks_alibi_slopes():
    # the launcher's own checks run before anything touches a GPU
    q, k = _t(1, 128, 2, 128), _t(1, 128, 2, 128)
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match="alibi_slopes needs causal"):
        gluon_bwd.gluon_attn_bwd_dkdv(q, k, k, q, lse, lse, k, k, 0.1, False, alibi_slopes=torch.rand(2))
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        gluon_bwd.gluon_attn_bwd_dkdv(q, k, k, q, lse, lse, k, k, 0.1, True, alibi_slopes=torch.rand(3))


def test_the_fused_route_table_also_takes_the_kernel(monkeypatch):
    # a FUSED_ROUTE_TABLE row sends a call to the Gluon kernel where ROUTE_TABLE has none (d = 64), the fused build
    # being the plain order, so the plain-order-only features pass too; deterministic calls keep Triton there
    d64 = (_t(2, 1024, 4, 64), _t(2, 1024, 2, 64), _t(2, 1024, 2, 64))
    assert not _on_sm90(monkeypatch, *d64)
    monkeypatch.setattr(gluon_bwd, "FUSED_ROUTE_TABLE", {(64, False): 1024})
    assert _on_sm90(monkeypatch, *d64)
    q, k, v = d64
    args = (q.clone(), k.clone(), v.clone())
    assert gluon_bwd.refusal(q, k, v, *args, _p(softcap=30.0)) is None
    assert gluon_bwd.use_gluon_bwd(q, k, v, *args, _p(softcap=30.0))
    assert not gluon_bwd.use_gluon_bwd(q, k, v, *args, _p(deterministic=True))
    with config.override(gluon_fused_dq=False):
        assert not gluon_bwd.use_gluon_bwd(q, k, v, *args, _p())
        assert "rotated" in gluon_bwd.refusal(q, k, v, *args, _p(softcap=30.0))
