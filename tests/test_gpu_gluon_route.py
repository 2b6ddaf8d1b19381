"""GPU tests of the public API where it routes to the Gluon kernel (backends/triton/gluon_route.py).

These run in the main GPU suite (marker ``gpu`` only): once the route is on by default, every
d = 128 bf16 call of 1024+ tokens takes it, so it must pass everything the Triton path passes here.
"""

import pytest
import torch

import flashtile
from attn_cases import check_padded
from flashtile import config
from flashtile.backends.triton import gluon_route

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def gluon_calls(monkeypatch):
    """Count the calls that reach the Gluon kernel."""
    calls = []
    real = gluon_route.gluon_fwd

    def spy(q, k, v, p):
        calls.append(tuple(q.shape))
        return real(q, k, v, p)

    monkeypatch.setattr(gluon_route, "gluon_fwd", spy)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s, h, h_k", [(2048, 4, 4), (4096, 8, 2), (3001, 4, 1)])
def test_routed_forward_and_gradients_match_reference(gluon_calls, s, h, h_k, causal):
    check_padded(1, s, s, h, h_k, 128, torch.bfloat16, device=DEV, causal=causal, grads=True)
    assert gluon_calls, "the call did not take the Gluon route"


def test_route_switch_and_unsupported_calls_stay_on_triton(gluon_calls, monkeypatch):
    q, k, v = (torch.randn(1, 2048, 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, window_size=(256, 256))  # a two-sided window
    flashtile.flash_attn_func(q, k, v, dropout_p=0.1)
    flashtile.flash_attn_func(q[:, :512], k[:, :512], v[:, :512])  # below the route table's start
    flashtile.flash_attn_func(q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous())
    q256, k256, v256 = (torch.randn(1, 2048, 4, 256, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    flashtile.flash_attn_func(q256, k256, v256, causal=True, softcap=30.0)  # d = 256 takes plain / causal only
    flashtile.flash_attn_func(q256, k256, v256, window_size=(1024, 0))
    assert not gluon_calls
    flashtile.flash_attn_func(q256, k256, v256, causal=True)
    assert len(gluon_calls) == 1
    gluon_calls.clear()
    with config.override(gluon=False):  # FLASHTILE_GLUON=0
        flashtile.flash_attn_func(q, k, v)
    assert not gluon_calls
    flashtile.flash_attn_func(q, k, v)
    assert len(gluon_calls) == 1


def test_routed_output_equals_triton_closely(monkeypatch):
    q, k, v = (torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out_g, lse_g, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    with config.override(gluon_fwd=False):
        out_t, lse_t, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # two fp32-accumulating kernels with different block orders: bf16 rounding apart, no more
    assert (out_g.float() - out_t.float()).abs().max().item() < 2e-2
    assert (lse_g - lse_t).abs().max().item() < 1e-3


def test_routed_call_is_graph_capturable_and_compiles(gluon_calls):
    q, k, v = (torch.randn(1, 2048, 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    expect = flashtile.flash_attn_func(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flashtile.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashtile.flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(out, expect)
    compiled = torch.compile(lambda a, b, c: flashtile.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), out)
    assert len(gluon_calls) >= 4


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_route_matches_triton_fp8_and_reference(gluon_calls, monkeypatch, d, causal):
    from flashtile.fp8 import dequantize, quantize_qkv

    b, s, h, h_k = 1, 4096, 4, 2
    q, k, v = (torch.randn(b, s, n, d, device=DEV, dtype=torch.bfloat16) for n in (h, h_k, h_k))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    kw = dict(causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    out = flashtile.flash_attn_func(q8, k8, v8, **kw)
    assert gluon_calls, "the fp8 call did not take the Gluon route"
    assert out.dtype == torch.bfloat16 and out.shape == (b, s, h, d)
    with config.override(gluon_fwd=False):
        out_t = flashtile.flash_attn_func(q8, k8, v8, **kw)
    # the reference: attention on the dequantised inputs, fp32
    qf, kf, vf = (dequantize(x, ds) for x, ds in ((q8, qd), (k8, kd), (v8, vd)))
    rep = h // h_k
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.repeat_interleave(rep, 2).transpose(1, 2), vf.repeat_interleave(rep, 2).transpose(1, 2),
        is_causal=causal).transpose(1, 2)
    err_g, err_t = ((x.float() - ref).abs().max().item() for x in (out, out_t))
    # both quantise P to e4m3 the same way: the Gluon kernel must be no worse than the Triton one
    assert err_g <= 1.25 * err_t + 1e-3, (err_g, err_t)
    assert (out.float() - out_t.float()).abs().max().item() <= 2 * err_t + 1e-3
