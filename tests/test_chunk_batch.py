"""attention_chunk calls that are a batch of shorter sequences (q and k of one length that the chunk divides)
run as that batch on the plain kernels (chunk_batch.py); everything else stays on the chunk-aware kernels.
Checked on the CPU path in float64 against attention_ref (forward, lse, every gradient), and by recording what
the backend receives."""

import pytest
import torch

import flashtile
from flashtile import dispatch
from flashtile.backends import cpu as cpu_backend
from flashtile.backends.reference import attention_ref


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


CASES = [
    dict(attention_chunk=8),
    dict(attention_chunk=8, causal=True),
    dict(attention_chunk=16, window_size=(5, 3)),
    dict(attention_chunk=8, causal=True, softcap=3.0),
    dict(attention_chunk=4, alibi=True),
    dict(attention_chunk=8, causal=True, sink=True),
]


@pytest.mark.parametrize("kw", CASES, ids=str)
@pytest.mark.parametrize("packed", [False, True])
def test_folded_calls_match_the_reference(kw, packed):
    kw = dict(kw)
    b, s, h = 3, 32, 4
    alibi = torch.rand(b, h) if kw.pop("alibi", False) else None
    sink = _leaf(h) if kw.pop("sink", False) else None
    if packed:
        qkv = _leaf(b, s, 3, h, 16)
        q, k, v = qkv.unbind(2)
        leaves = [qkv]
        out, lse, _ = flashtile.flash_attn_qkvpacked_func(qkv, alibi_slopes=alibi, learnable_sink=sink,
                                                          return_attn_probs=True, **kw)
    else:
        q, k, v = _leaf(b, s, h, 16), _leaf(b, s, h // 2, 16), _leaf(b, s, h // 2, 24)
        leaves = [q, k, v]
        out, lse, _ = flashtile.flash_attn_func(q, k, v, alibi_slopes=alibi, learnable_sink=sink,
                                                return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, alibi_slopes=alibi, learnable_sink=sink, **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
    leaves += [sink] if sink is not None else []
    g = torch.randn_like(out)
    for name, a, r in zip(("q/qkv", "k", "v", "sink"), torch.autograd.grad(out, leaves, g),
                          torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10, msg=name)


@pytest.fixture
def seen(monkeypatch):
    """(op, q's shape, attention_chunk) of every call the CPU backend receives."""
    calls = []
    fwd, bwd = cpu_backend.fwd, cpu_backend.bwd

    def rec_fwd(q, k, v, p):
        calls.append(("fwd", tuple(q.shape), p.attention_chunk))
        return fwd(q, k, v, p)

    def rec_bwd(dout, q, k, v, out, lse, p, *grads):
        calls.append(("bwd", tuple(q.shape), p.attention_chunk))
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        return bwd(dout, q, k, v, out, lse, p, *grads)

    monkeypatch.setattr(cpu_backend, "fwd", rec_fwd)
    monkeypatch.setattr(cpu_backend, "bwd", rec_bwd)
    dispatch._CHOSEN.clear()
    yield calls
    dispatch._CHOSEN.clear()


@pytest.mark.parametrize("sq, sk, chunk, dropout, want", [
    (32, 32, 8, 0.0, [(8, 8, 0)]),          # folded: 2 x 4 sequences of 8, no chunk left
    (32, 32, 32, 0.0, [(2, 32, 0)]),        # the chunk is the sequence: dropped
    (32, 32, 64, 0.0, [(2, 32, 0)]),        # longer than the sequence: dropped
    (32, 32, 12, 0.0, [(2, 32, 12)]),       # does not divide: chunk-aware
    (32, 40, 8, 0.0, [(2, 32, 8)]),         # seqlen_q != seqlen_k: chunk-aware
    (32, 32, 8, 0.1, [(2, 32, 8)]),         # dropout's stream is keyed by coordinates: chunk-aware
])
def test_which_calls_fold(seen, sq, sk, chunk, dropout, want):
    q, k, v = _leaf(2, sq, 2, 8), _leaf(2, sk, 2, 8), _leaf(2, sk, 2, 8)
    out = flashtile.flash_attn_func(q, k, v, dropout_p=dropout, attention_chunk=chunk)
    out.sum().backward()
    assert seen == [("fwd", (n, s, 2, 8), c) for n, s, c in want] + [("bwd", (n, s, 2, 8), c) for n, s, c in want]


def test_a_layout_that_cannot_be_viewed_stays_chunk_aware(seen):
    # sequence-major storage: the batch stride is not seqlen times the sequence stride
    q, k, v = (torch.randn(32, 2, 2, 8, dtype=torch.float64).transpose(0, 1).requires_grad_() for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, attention_chunk=8)
    ref, _ = attention_ref(q, k, v, attention_chunk=8)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert seen == [("fwd", (2, 32, 2, 8), 8)]


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_gradient_kernel_matches_pytorch(interpret, varlen):
    from flashtile import ops
    from flashtile.backends.triton.sink_grad import sink_grad_triton

    torch.manual_seed(0)
    h, dv = 3, 20
    if varlen:
        out, dout = torch.randn(2, 77, h, dv).unbind(0)
        lse = torch.randn(h, 77)
    else:
        out, dout = torch.randn(2, 2, 77, h, dv).unbind(0)
        lse = torch.randn(2, h, 77)
    lse[..., 5] = float("inf")  # a row that saw nothing
    sink = torch.randn(h)
    got = sink_grad_triton(sink, lse, dout, out, varlen)
    acc = (dout.double() * out.double()).sum(-1)
    acc = acc.t() if varlen else acc.transpose(1, 2)
    want = -(torch.exp(sink.double()[:, None] - lse.double()) * acc)
    want = want.sum(1) if varlen else want.sum((0, 2))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    # and ops.sink_grad takes the kernel when the Triton backend runs the backward
    torch.testing.assert_close(ops.sink_grad(sink, lse, dout, out, varlen), got)
