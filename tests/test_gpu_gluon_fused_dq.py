"""GPU tests of the Gluon dK/dV kernel's fused dQ build (FUSED_DQ: each step's dQ^T = K^T dS^T added by TMA
reduce-add into an fp32 buffer, no dQ kernel), through the public backward with config.gluon_fused_dq pinned on.
Every feature the dK/dV kernel's plain order has, against the reference by FlashAttention's rule; each test checks
that the fused build really ran (the launcher got a dq_accum)."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, check_varlen, grads_switched, repeated_grads
from flashtile import config
from flashtile.backends.triton import gluon_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture
def fused(monkeypatch):
    """Pins the fused build on; the list collects, per Gluon dK/dV launch, whether it was the fused one."""
    seen, real = [], gluon_bwd.gluon_attn_bwd_dkdv

    def recording(*args, **kw):
        seen.append(kw.get("dq_accum") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", recording)
    with config.override(gluon_bwd=True, gluon_fused_dq=True):
        yield seen


def _ran(seen):
    assert seen and all(seen), f"the fused dQ build did not run: {seen}"


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (1000, 8, 1), (2048, 4, 4)])
def test_fused_grads(fused, d, causal, s, h, h_k):
    # GQA: a CTA walks every query head of its group and adds into each head's dQ rows
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    _ran(fused)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_fp16_long(fused, d, causal):
    check_padded(1, 4096, 4096, 4, 2, d, torch.float16, device=DEV, causal=causal)
    _ran(fused)


@pytest.mark.parametrize("window_left", [0, 64, 1000])
def test_fused_causal_window(fused, window_left):
    check_padded(2, 1000, 1000, 4, 2, 128, torch.bfloat16, device=DEV, causal=True, window_size=(window_left, 0))
    _ran(fused)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_softcap_and_alibi(fused, d, causal):
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=causal, softcap=30.0)
    if causal:
        check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=True, alibi="bh")
        check_padded(1, 777, 777, 4, 4, d, torch.bfloat16, device=DEV, causal=True, alibi="h", softcap=30.0,
                     window_size=(200, 0))
    _ran(fused)


@pytest.mark.parametrize("sq,sk", [(1000, 3000), (700, 129), (77, 1000)])
def test_fused_unequal_lengths(fused, sq, sk):
    # keys past seqlen_k are TMA's zero fill: their dS reaches dQ only as 0 * K
    check_padded(2, sq, sk, 4, 2, 128, torch.bfloat16, device=DEV, causal=False)
    if sk >= sq:
        check_padded(2, sq, sk, 4, 2, 128, torch.bfloat16, device=DEV, causal=True)
    _ran(fused)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_packed_sequences(fused, d, causal):
    # a key block running into the next sequence: non-causal, its keys there are masked before dQ reads them; a
    # query block running into the next sequence adds exact zeros to those rows
    lens = [1, 63, 64, 65, 1000, 300]
    check_varlen(lens, lens, 4, 2, d, torch.bfloat16, device=DEV, causal=causal)
    _ran(fused)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_k_sequences_of_their_own(fused, causal):
    check_varlen([1, 63, 300, 1000, 65, 128], [5, 63, 700, 1000, 70, 1100], 4, 2, 128, torch.bfloat16, device=DEV,
                 causal=causal)
    _ran(fused)


def test_fused_matches_the_split_backward(fused):
    got, want = grads_switched("gluon_fused_dq", fused, device=DEV)
    for a, b in zip(got, want):
        # two fp32 summation orders, one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_deterministic_keeps_the_dq_kernel(fused):
    # reduce-adds land in a varying order: deterministic=True takes the dQ kernel and stays bitwise repeatable
    runs = repeated_grads(5, shape=(2, 2048, 8, 128), device=DEV, causal=True, deterministic=True)
    assert fused and not any(fused)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


def test_packed_dqkv_gets_its_share(fused):
    # flash_attn_qkvpacked_func hands the backward a dq view into dqkv: the scaled sums land in that view
    qkv = torch.randn(2, 2048, 3, 4, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    g = torch.randn_like(out)
    got, = torch.autograd.grad(out, qkv, g)
    with config.override(gluon_fused_dq=False):
        want, = torch.autograd.grad(flashtile.flash_attn_qkvpacked_func(qkv, causal=True), qkv, g)
    _ran(fused[:1])
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
