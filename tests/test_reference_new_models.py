"""The reference's features beyond FlashAttention 2.8.3 (issue 48: FlashAttention-3 / CuTe semantics) against the
float64 brute force: v's own head dim, MLA's ``qv``, attention sinks and chunked attention."""

import pytest
import torch

from brute_force import brute_force
from flashtile.backends.reference import attention_ref

PAIRS = [(7, 7), (5, 11), (11, 5), (1, 9), (13, 13)]


def _inputs(b, sq, sk, h, h_k, d, dv):
    return (torch.randn(b, sq, h, d, dtype=torch.float64), torch.randn(b, sk, h_k, d, dtype=torch.float64),
            torch.randn(b, sk, h_k, dv, dtype=torch.float64))


def _same(got, want):
    (out, lse), (bo, bl) = got, want
    assert out.shape == bo.shape
    assert torch.allclose(out, bo, atol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(bl))
    finite = torch.isfinite(bl)
    assert torch.allclose(lse[finite], bl[finite], atol=1e-10)


@pytest.mark.parametrize("sq,sk", PAIRS)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 1))])
def test_head_dim_v(sq, sk, kw):
    q, k, v = _inputs(2, sq, sk, 4, 2, 8, 12)
    bf_window = kw.get("window_size", (-1, -1))
    _same(attention_ref(q, k, v, **kw), brute_force(q, k, v, [sq] * 2, [sk] * 2, causal=kw.get("causal", False),
                                                     window=bf_window))


@pytest.mark.parametrize("sq,sk", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_mla_qv(sq, sk, causal):
    q, k, v = _inputs(2, sq, sk, 4, 1, 4, 16)  # rope dims 4, latent 16, one latent kv head shared by all heads
    qv = torch.randn(2, sq, 4, 16, dtype=torch.float64)
    _same(attention_ref(q, k, v, qv=qv, causal=causal),
          brute_force(q, k, v, [sq] * 2, [sk] * 2, causal=causal, qv=qv))


@pytest.mark.parametrize("sq,sk", PAIRS + [(9, 2)])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(2, 0)), dict(softcap=2.0)])
def test_learnable_sink(sq, sk, kw):
    q, k, v = _inputs(2, sq, sk, 4, 2, 8, 8)
    sink = torch.randn(4, dtype=torch.float64)
    got = attention_ref(q, k, v, learnable_sink=sink, **kw)
    _same(got, brute_force(q, k, v, [sq] * 2, [sk] * 2, causal=kw.get("causal", False),
                           window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0), sink=sink))
    if kw.get("causal") and sq > sk:  # rows that see no key: out 0, lse = the sink (its own exp(0) = 1 term)
        out, lse = got
        assert (out[:, : sq - sk] == 0).all()
        assert torch.equal(lse[:, :, : sq - sk], sink.view(1, 4, 1).expand(2, 4, sq - sk))


def test_sink_lowers_every_probability_and_gets_a_gradient():
    q, k, v = _inputs(1, 6, 6, 2, 2, 8, 8)
    plain, plain_lse = attention_ref(q, k, v)
    sink = torch.full((2,), 3.0, dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref(q, k, v, learnable_sink=sink)
    assert (lse > plain_lse).all()
    # the rows' weights shrink by exp(plain_lse - lse): the output is the plain one scaled by that factor
    factor = torch.exp(plain_lse - lse).permute(0, 2, 1).unsqueeze(-1)
    assert torch.allclose(out, plain * factor, atol=1e-12)
    assert torch.autograd.gradcheck(lambda s: attention_ref(q, k, v, learnable_sink=s)[0], (sink,))


@pytest.mark.parametrize("sq,sk", PAIRS + [(20, 20), (6, 20)])
@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(2, 0)), dict(window_size=(-1, 3))])
def test_chunked_attention(sq, sk, chunk, kw):
    q, k, v = _inputs(2, sq, sk, 4, 2, 8, 8)
    _same(attention_ref(q, k, v, attention_chunk=chunk, **kw),
          brute_force(q, k, v, [sq] * 2, [sk] * 2, causal=kw.get("causal", False),
                      window=kw.get("window_size", (-1, -1)), chunk=chunk))


def test_chunk_of_the_whole_sequence_changes_nothing():
    q, k, v = _inputs(2, 9, 9, 4, 2, 8, 8)
    plain = attention_ref(q, k, v, causal=True)
    chunked = attention_ref(q, k, v, causal=True, attention_chunk=9)
    assert all(torch.equal(a, b) for a, b in zip(plain, chunked))


def test_varlen_with_sink_chunk_and_head_dim_v():
    lens_q, lens_k = [3, 7, 1], [5, 7, 6]
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, 8, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 12, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, learnable_sink=sink,
                             attention_chunk=3)
    assert out.shape == (sum(lens_q), 4, 12) and lse.shape == (4, sum(lens_q))
    for i in range(3):
        qi = q[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        ki, vi = k[cu_k[i]:cu_k[i + 1]].unsqueeze(0), v[cu_k[i]:cu_k[i + 1]].unsqueeze(0)
        bo, bl = brute_force(qi, ki, vi, [lens_q[i]], [lens_k[i]], causal=True, sink=sink, chunk=3)
        assert torch.allclose(out[cu_q[i]:cu_q[i + 1]], bo[0], atol=1e-10)
        assert torch.allclose(lse[:, cu_q[i]:cu_q[i + 1]], bl[0], atol=1e-10)
