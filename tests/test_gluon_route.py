"""Which forward calls the Gluon kernel takes (backends/triton/gluon_route.py), checked on CPU.

The rule has two halves: ``refusal`` (what the kernel computes exactly) and ``preferred`` (where it
measured faster). A call outside the first must never reach the kernel, whatever the override.
"""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import gluon_route
from flashtile.params import AttnParams


def _qkv(b=2, s=2048, h=4, h_k=4, d=128, dtype=torch.bfloat16):
    return (torch.empty(b, s, h, d, dtype=dtype), torch.empty(b, s, h_k, d, dtype=dtype),
            torch.empty(b, s, h_k, d, dtype=dtype))


def _params(**kw):
    return AttnParams(softmax_scale=0.1, **kw)


def test_plain_causal_and_gqa_calls_are_supported():
    q, k, v = _qkv(h=8, h_k=2)
    assert gluon_route.refusal(q, k, v, _params()) is None
    assert gluon_route.refusal(q, k, v, _params(causal=True, window_right=0)) is None
    # an explicit (-1, 0) window is causal too
    assert gluon_route.refusal(q, k, v, _params(window_right=0)) is None
    # return_attn_probs without dropout returns no probabilities
    assert gluon_route.refusal(q, k, v, _params(return_probs=True)) is None
    # a causal sliding window (the 16-bit kernel's LOCAL build); not with fp8, not in the dK/dV kernel
    assert gluon_route.refusal(q, k, v, _params(causal=True, window_left=256, window_right=0)) is None
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    assert "window" in gluon_route.refusal(q8, k8, v8, _params(causal=True, window_left=256, window_right=0))
    # packed sequences sharing one cu_seqlens (the VARLEN build), not two different ones, not with fp8
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    packed = [x[0] for x in (q, k, v)]
    varlen = _params(causal=True, window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=724,
                     max_seqlen_k=724)
    assert gluon_route.refusal(*packed, varlen) is None
    assert "varlen" in gluon_route.refusal(*(x[0] for x in (q8, k8, v8)), varlen)
    assert gluon_route.preferred(packed[0], varlen) == gluon_route.preferred(q[:, :724], varlen)
    # softcap: the 16-bit kernel's SOFTCAP build; not with fp8
    assert gluon_route.refusal(q, k, v, _params(softcap=30.0)) is None
    assert "softcap" in gluon_route.refusal(q8, k8, v8, _params(softcap=30.0))
    # ALiBi: the 16-bit kernel's ALIBI build, causal only; slopes of (h,) or (b, h) with a unit last stride
    slopes = torch.ones(2, q.shape[2])
    assert gluon_route.refusal(q, k, v, _params(alibi_slopes=slopes, window_right=0)) is None
    assert "causal" in gluon_route.refusal(q, k, v, _params(alibi_slopes=slopes))
    assert "stride" in gluon_route.refusal(q, k, v, _params(alibi_slopes=slopes.t().contiguous().t(), window_right=0))
    assert "ALiBi" in gluon_route.refusal(q8, k8, v8, _params(alibi_slopes=slopes, window_right=0))


@pytest.mark.parametrize("change, reason", [
    (dict(window_left=64), "window"),
    (dict(window_right=5), "window"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(alibi_slopes=torch.ones(4)), "ALiBi"),
    (dict(seqused_k=torch.ones(2, dtype=torch.int32)), "seqused"),  # padded: the varlen build's only
])
def test_features_the_kernel_lacks_are_refused(change, reason):
    q, k, v = _qkv()
    assert reason in gluon_route.refusal(q, k, v, _params(**change))


def test_shapes_and_dtypes_the_kernel_lacks_are_refused():
    q, k, v = _qkv(d=96)
    assert "head_dim" in gluon_route.refusal(q, k, v, _params())
    q, k, v = _qkv(dtype=torch.float32)
    assert "dtype" in gluon_route.refusal(q, k, v, _params())
    q, k, v = _qkv()
    # q and k of different lengths: the forward's UNEQUAL build (bottom-right diagonal), but causal needs the
    # longer k (rows left of the diagonal would see no key); fp8 keeps equal lengths
    assert gluon_route.refusal(q[:, :1000], k, v, _params()) is None
    assert gluon_route.refusal(q[:, :1000], k, v, _params(window_right=0)) is None
    assert "seqlen_k < seqlen_q" in gluon_route.refusal(q, k[:, :1000], v[:, :1000], _params(window_right=0))
    q8, k8, v8 = _qkv(dtype=torch.float8_e4m3fn)
    assert "seqlen" in gluon_route.refusal(q8[:, :1000], k8, v8, _params())
    assert "dtype" in gluon_route.refusal(q, k.float(), v, _params())
    # a head-dim slice starting one element in: its base is 2 bytes off TMA's 16-byte alignment
    wide = torch.empty(2, 2048, 4, 130, dtype=torch.bfloat16)
    assert "TMA" in gluon_route.refusal(wide[..., 1:129], k, v, _params())
    varlen = _params(cu_seqlens_q=torch.zeros(3, dtype=torch.int32), cu_seqlens_k=torch.zeros(3, dtype=torch.int32))
    assert "varlen" in gluon_route.refusal(q8[0], k8[0], v8[0], varlen)


def test_preferred_where_measured_faster():
    q, _, _ = _qkv(s=4096)
    assert gluon_route.preferred(q, _params())
    assert gluon_route.preferred(q, _params(causal=True, window_right=0))
    short, _, _ = _qkv(s=1024)
    assert gluon_route.preferred(short, _params())
    assert not gluon_route.preferred(short, _params(causal=True, window_right=0))
    d64, _, _ = _qkv(d=64)
    assert not gluon_route.preferred(d64, _params())


def test_fp16_takes_the_bf16_route():
    # the same kernel with another element type: fp16 calls are covered and read bf16's route-table entries
    for s, causal in ((1024, False), (1024, True), (4096, True)):
        q, k, v = _qkv(s=s, dtype=torch.float16)
        half = _params(causal=causal, window_right=0 if causal else -1)
        assert gluon_route.refusal(q, k, v, half) is None
        bf = _qkv(s=s)[0]
        assert gluon_route.preferred(q, half) == gluon_route.preferred(bf, half)
    q, k, v = _qkv(dtype=torch.float16)
    assert "dtype" in gluon_route.refusal(q, k.bfloat16(), v, _params())


def test_cpu_tensors_never_take_the_gluon_route():
    q, k, v = _qkv()
    with config.override(gluon_fwd=True):
        assert not gluon_route.use_gluon(q, k, v, _params())


def _on_gpu(monkeypatch, q, cap=(9, 0)):
    monkeypatch.setattr(gluon_route, "capability", lambda device: cap)
    monkeypatch.setattr(type(q), "device", property(lambda t: torch.device("cuda")), raising=False)


@pytest.mark.parametrize("setting,s,want", [
    ({}, 4096, True),  # the route table
    ({}, 512, False),
    (dict(gluon_fwd=True), 512, True),  # forced wherever the kernel can run
    (dict(gluon_fwd=False), 4096, False),
    (dict(gluon=False), 4096, False),  # FLASHTILE_GLUON=0: no Gluon kernel at all
    (dict(gluon=False, gluon_fwd=True), 4096, False),
])
def test_settings_and_route_table_on_sm90(monkeypatch, setting, s, want):
    q, k, v = _qkv(s=s)
    _on_gpu(monkeypatch, q)
    with config.override(**setting):
        assert gluon_route.use_gluon(q, k, v, _params()) is want


def test_other_gpus_keep_the_triton_kernel(monkeypatch):
    q, k, v = _qkv(s=4096)
    for cap in ((8, 0), (10, 0)):
        _on_gpu(monkeypatch, q, cap)
        with config.override(gluon_fwd=True):
            assert not gluon_route.use_gluon(q, k, v, _params())


def test_fp8_calls_take_the_gluon_kernel_at_d128_and_d256_from_4096_tokens():
    fp8 = torch.float8_e4m3fn
    for d in (128, 256):
        q, k, v = _qkv(s=4096, d=d, dtype=fp8)
        assert gluon_route.refusal(q, k, v, _params()) is None
        assert gluon_route.preferred(q, _params(causal=True, window_right=0))
    short, k, v = _qkv(s=2048, dtype=fp8)
    assert not gluon_route.preferred(short, _params())
    d64, _, _ = _qkv(s=4096, d=64, dtype=fp8)
    assert not gluon_route.preferred(d64, _params())
    # V is read transposed (a view of quantize_qkv's layout, else a copy): its strides never refuse
    q, k, v = _qkv(s=4096, dtype=fp8)
    keys_contiguous = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert gluon_route.refusal(q, k, keys_contiguous, _params()) is None
    assert "head_dim" in gluon_route.refusal(*_qkv(d=96, dtype=fp8), _params())


def test_k_with_sequences_of_its_own():
    # packed k with its own cu_seqlens or seqused_k: the VARLEN_K build (bottom-right per sequence, rows that see
    # no key get zeros), plain or causal, softcap too; no window, ALiBi or sink there; not fp8, not seqused_q
    q, k, v = (x[0] for x in _qkv())
    cu_q, cu_k = torch.tensor([0, 300, 1024], dtype=torch.int32), torch.tensor([0, 500, 2048], dtype=torch.int32)
    used = torch.tensor([400, 1000], dtype=torch.int32)
    own = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=724, max_seqlen_k=1548)
    for kw in (dict(), dict(window_right=0), dict(softcap=30.0, window_right=0)):
        assert gluon_route.refusal(q, k, v, _params(**own, **kw)) is None
    shared_used = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=724, max_seqlen_k=724, seqused_k=used)
    assert gluon_route.refusal(q, k, v, _params(**shared_used)) is None
    slopes = torch.ones(2, q.shape[1])
    for kw in (dict(window_left=64, window_right=0), dict(alibi_slopes=slopes, window_right=0),
               dict(learnable_sink=torch.zeros(q.shape[1]))):
        assert "own cu_seqlens" in gluon_route.refusal(q, k, v, _params(**own, **kw))
        assert "own cu_seqlens" in gluon_route.refusal(q, k, v, _params(**shared_used, **kw))
    assert "seqused" in gluon_route.refusal(q, k, v, _params(**own, seqused_q=used))
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    assert "varlen" in gluon_route.refusal(q8, k8, v8, _params(**own))
    # the launcher gets k's sequences only where they differ from q's
    assert gluon_route.own_k(_params(**own)) == dict(cu_seqlens_k=cu_k, max_seqlen_k=1548)
    assert gluon_route.own_k(_params(**shared_used)) == dict(seqused_k=used)
    assert gluon_route.own_k(_params(cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=724,
                                      max_seqlen_k=724)) == {}
    assert gluon_route.own_k(_params()) == {}


def test_k_with_sequences_of_its_own_takes_gluon_with_a_softcap_only():
    # measured: the Triton kernel is faster on plain / causal calls whose k has its own sequences, the Gluon one
    # with a softcap (gluon_route.preferred)
    q = _qkv(s=4096)[0][0]
    cu_q, cu_k = torch.tensor([0, 2048, 4096], dtype=torch.int32), torch.tensor([0, 4096, 8192], dtype=torch.int32)
    own = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2048, max_seqlen_k=4096, window_right=0)
    assert not gluon_route.preferred(q, _params(**own))
    assert gluon_route.preferred(q, _params(**own, softcap=30.0))
    shared = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=2048, max_seqlen_k=2048, window_right=0)
    assert gluon_route.preferred(q, _params(**shared))


def test_one_cu_seqlens_is_shared_whatever_the_max_seqlens():
    # q and k's sequences are the one cu_seqlens' (max_seqlen_k only bounds them): a window is covered, as for any
    # shared call, and the launcher gets no k sequences of its own
    q, k, v = (x[0] for x in _qkv())
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    p = _params(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=724, max_seqlen_k=1024, window_left=64, window_right=0)
    assert gluon_route.refusal(q, k, v, p) is None
    assert gluon_route.own_k(p) == {}


def test_d256_takes_plain_and_causal_calls_from_the_table_start(monkeypatch):
    # measured: plain 1.15x-1.22x from 1k, causal 1.07x-1.11x from 2k; a softcap or a window lost at 2k (0.63x-0.85x)
    q, k, v = _qkv(s=4096, d=256)
    _on_gpu(monkeypatch, q)
    causal = dict(window_right=0)
    assert gluon_route.use_gluon(q, k, v, _params())
    assert gluon_route.use_gluon(q, k, v, _params(**causal))
    assert not gluon_route.use_gluon(q, k, v, _params(softcap=30.0, **causal))
    assert not gluon_route.use_gluon(q, k, v, _params(window_left=1024, **causal))
    slopes = torch.ones(q.shape[2])
    assert not gluon_route.use_gluon(q, k, v, _params(alibi_slopes=slopes, **causal))
    cu = torch.tensor([0, 4096], dtype=torch.int32)  # one cu_seqlens shared by q and k
    packed = _params(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4096, max_seqlen_k=4096)
    assert not gluon_route.use_gluon(q[0], k[0], v[0], packed), "packed d = 256: neither timed nor GPU-tested"
    monkeypatch.setattr(gluon_route, "PLAIN_ONLY", ())
    assert gluon_route.use_gluon(q[0], k[0], v[0], packed), "the refusal above is PLAIN_ONLY's"
    monkeypatch.undo()
    _on_gpu(monkeypatch, q)
    short = _qkv(s=1024, d=256)
    assert gluon_route.use_gluon(*short, _params())
    assert not gluon_route.use_gluon(*short, _params(**causal))


def test_scale_and_grid_limits_refuse():
    # a masked score is -inf before the scale multiplies it: a zero or negative scale would make it NaN / +inf
    q, k, v = _qkv()
    for scale in (0.0, -0.1):
        assert "softmax_scale" in gluon_route.refusal(q, k, v, AttnParams(softmax_scale=scale))
    many = torch.empty(16384, 1, 4, 128, dtype=torch.bfloat16)  # 65536 (batch, head) pairs: the grid's y axis
    assert "batch x heads" in gluon_route.refusal(many, many, many, _params())
    assert gluon_route.refusal(many[:16383], many[:16383], many[:16383], _params()) is None
