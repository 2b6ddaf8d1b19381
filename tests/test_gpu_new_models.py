"""GPU: the FlashAttention-3 / CuTe features of issue 48 through the public functions, on whichever kernel the
routes pick (the Gluon forward for bf16 d = 128 plain / causal, with a sink too; the Triton kernels otherwise),
against ``attention_ref`` by FlashAttention's 2x rule (3x for gradients, the sink's included)."""

import pytest
import torch

import flashtile
from flashtile.backends.reference import attention_ref
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _check(fn, q, k, v, sink, ref_kw, grads=True):
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    out, lse = fn(q, k, v, sink)
    ref, ref_lse = attention_ref(q, k, v, learnable_sink=sink, **ref_kw)
    pt, _ = attention_ref(q, k, v, learnable_sink=sink, upcast=False, **ref_kw)
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse: +inf rows differ"
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3
    if not grads:
        return
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    same = torch.autograd.grad(pt, inputs, g)
    for name, x, r, p in zip(("dq", "dk", "dv", "dsink"), got, want, same):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4 if name != "dsink" else 1e-2, name=name)


def _padded(b, sq, sk, h, h_k, d, dv, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, device=DEV, dtype=dtype, requires_grad=True),
            torch.randn(b, sk, h_k, d, device=DEV, dtype=dtype, requires_grad=True),
            torch.randn(b, sk, h_k, dv, device=DEV, dtype=dtype, requires_grad=True))


def _sink(h):
    return (torch.randn(h, device=DEV) * 2).requires_grad_()


CASES = [  # (sq, sk, h, h_k, d, dv, kwargs)
    (2048, 2048, 8, 2, 128, 128, dict(causal=True)),       # the Gluon forward's shape, with a sink
    (2048, 2048, 8, 8, 128, 128, dict()),
    (1000, 1500, 6, 2, 64, 64, dict(causal=True, attention_chunk=256)),
    (1536, 1536, 4, 4, 128, 128, dict(attention_chunk=384)),
    (777, 777, 4, 1, 128, 128, dict(causal=True, window_size=(300, 0), attention_chunk=200)),
    (1024, 1024, 8, 8, 192, 128, dict(causal=True)),       # DeepSeek-V3's q/k 192, v 128
    (513, 700, 4, 2, 96, 64, dict()),
    (300, 300, 4, 4, 40, 80, dict(causal=True, attention_chunk=64)),
]


@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[4]}-dv{c[5]}-{c[6]}")
def test_padded(case, sink):
    sq, sk, h, h_k, d, dv, kw = case
    q, k, v = _padded(2, sq, sk, h, h_k, d, dv)
    s = _sink(h) if sink else None

    def fn(q, k, v, s):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, learnable_sink=s, return_attn_probs=True, **kw)
        return out, lse

    _check(fn, q, k, v, s, kw)


@pytest.mark.parametrize("kw", [dict(causal=True, attention_chunk=128), dict(attention_chunk=100)], ids=str)
def test_varlen_sink_chunk_dv(kw):
    lens_q, lens_k = [300, 1, 517, 0], [300, 450, 517, 90]
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 6, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    s = _sink(6)

    def fn(q, k, v, s):
        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       learnable_sink=s, return_attn_probs=True, **kw)
        return out, lse

    _check(fn, q, k, v, s, dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw))


def test_fp16_hopper_api():
    from flashtile import hopper

    q, k, v = _padded(1, 1024, 1024, 4, 4, 128, 128, torch.float16)
    s = _sink(4)

    def fn(q, k, v, s):
        return hopper.flash_attn_func(q, k, v, causal=True, attention_chunk=256, return_attn_probs=True,
                                      learnable_sink=s)

    _check(fn, q, k, v, s, dict(causal=True, attention_chunk=256))
