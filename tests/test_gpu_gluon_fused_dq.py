"""GPU tests of the Gluon dK/dV kernel's fused dQ build (FUSED_DQ: each step's dQ^T = K^T dS^T added by TMA
reduce-add into an fp32 buffer, no dQ kernel), through the public backward with config.gluon_fused_dq pinned on.
Every feature the dK/dV kernel's plain order has, against the reference by FlashAttention's rule; each test checks
that the fused build really ran (the launcher got a dq_accum)."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, grads_switched, make_alibi, repeated_grads
from flashtile import config
from flashtile.backends.triton import gluon_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]  # (d, dv) of every fused config


@pytest.fixture
def fused(monkeypatch):
    """Pins the fused build on; the list collects each Gluon dK/dV launch's keyword arguments."""
    seen, real = [], gluon_bwd.gluon_attn_bwd_dkdv

    def recording(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", recording)
    with config.override(gluon_bwd=True, gluon_fused_dq=True):
        yield seen


def _is_fused(launch: dict) -> bool:
    return launch.get("dq_accum") is not None


def _ran(seen):
    assert seen and all(map(_is_fused, seen)), f"the fused dQ build did not run: {list(map(_is_fused, seen))}"


def _varlen_grads(lens_q, lens_k, h, h_k, d, *, shared=False, seqused_k=None, alibi=None, dtype=torch.bfloat16,
                  dv=None, **kw):
    """flash_attn_varlen_func's gradients against the reference (FlashAttention's rule). ``shared``: q and k take
    the same cu_seqlens tensor (the VARLEN build; separate tensors take the VARLEN_K one); ``seqused_k``: keys
    each sequence uses; ``alibi``: "h" / "bh" slopes; ``dv``: v's head dim (default d)."""
    from flashtile.backends.reference import attention_ref
    from tolerance import assert_fa_close

    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).to(torch.int32)
    cu_k = cu_q if shared else torch.tensor([0, *lens_k], device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), h_k, n, device=DEV, dtype=dtype, requires_grad=True) for n in (d, dv or d))
    slopes = make_alibi(alibi, len(lens_q), h, DEV)
    used = None if seqused_k is None else torch.tensor(seqused_k, device=DEV, dtype=torch.int32)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), alibi_slopes=slopes,
                                           seqused_k=used, **kw)
    ref = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, alibi_slopes=slopes, **kw)[0]
    pt = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, alibi_slopes=slopes,
                       upcast=False, **kw)[0]
    g = torch.randn_like(out)
    for name, x, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                             torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(pt, (q, k, v), g)):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (1000, 8, 1), (2048, 4, 4)])
def test_fused_grads(fused, d, causal, s, h, h_k):
    # GQA: a CTA walks every query head of its group and adds into each head's dQ rows
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    _ran(fused)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(77, 4, 2), (1000, 8, 1), (2048, 4, 4)])
def test_fused_q_k_192_with_v_128(fused, causal, s, h, h_k):
    # dQ in two column ranges (128 + 64), each staged and added on its own
    check_padded(2, s, s, h, h_k, 192, torch.bfloat16, device=DEV, causal=causal, dv=128)
    _ran(fused)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_fp16_long(fused, d, causal):
    check_padded(1, 4096, 4096, 4, 2, d, torch.float16, device=DEV, causal=causal)
    _ran(fused)


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("window_left", [0, 64, 1000])
def test_fused_causal_window(fused, d, dv, window_left):
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=True, window_size=(window_left, 0),
                 dv=dv)
    _ran(fused)


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_softcap_and_alibi(fused, d, dv, causal):
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=causal, softcap=30.0, dv=dv)
    if causal:
        check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=True, alibi="bh", dv=dv)
        check_padded(1, 777, 777, 4, 4, d, torch.bfloat16, device=DEV, causal=True, alibi="h", softcap=30.0,
                     window_size=(200, 0), dv=dv)
    _ran(fused)


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("sq,sk", [(1000, 3000), (700, 129), (77, 1000)])
def test_fused_unequal_lengths(fused, d, dv, sq, sk):
    check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=False, dv=dv)
    if sk >= sq:
        check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=True, dv=dv)
    _ran(fused)


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (1000, 777), (300, 1000)])
def test_fused_keys_past_the_end_with_negative_lse(fused, sq, sk):
    # keys past seqlen_k (a ragged last key block) are TMA's zero fill, scoring 0, which no row's lse counted. With
    # every real score near -45 the lse is far below 0, so an unmasked zero-filled key's P = exp(-lse) overflows
    # fp16's dS^T and 0 * inf poisons dQ: the non-causal fused build must mask those keys
    from flashtile.backends.reference import attention_ref
    from tolerance import assert_fa_close

    q = (4 + 0.1 * torch.randn(2, sq, 4, 128, device=DEV)).half().requires_grad_()
    k = (-1 + 0.1 * torch.randn(2, sk, 2, 128, device=DEV)).half().requires_grad_()
    v = torch.randn(2, sk, 2, 128, device=DEV, dtype=torch.float16, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.max().item() < -11, "the case needs a negative lse"
    ref = attention_ref(q, k, v)[0]
    pt = attention_ref(q, k, v, upcast=False)[0]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert all(torch.isfinite(x).all() for x in got)
    for name, x, r, p in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref, (q, k, v), g),
                             torch.autograd.grad(pt, (q, k, v), g)):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)
    _ran(fused)


LENS = [1, 63, 64, 65, 1000, 300]


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_packed_sequences(fused, d, dv, causal):
    # one cu_seqlens for q and k (the VARLEN build): a key block running into the next sequence is masked there
    # (non-causal), a query block running into it adds exact zeros to those rows
    _varlen_grads(LENS, LENS, 4, 2, d, shared=True, causal=causal, dv=dv)
    _ran(fused)
    assert all("cu_seqlens_k" not in kw for kw in fused), "k's own sequences: the VARLEN_K build ran"


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("kw", [dict(causal=True, window_size=(200, 0)), dict(causal=True, alibi="bh"),
                                dict(causal=False, softcap=20.0), dict(causal=True, softcap=20.0)],
                         ids=["window", "alibi", "softcap", "causal_softcap"])
def test_fused_packed_sequences_with_features(fused, d, dv, kw):
    # d = 64 reaches these only through the fused build (its split config is the rotated schedule)
    _varlen_grads(LENS, LENS, 4, 2, d, shared=True, dv=dv, **kw)
    _ran(fused)


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("used", [False, True], ids=["cu_seqlens_k", "seqused_k"])
def test_fused_k_sequences_of_their_own(fused, d, dv, causal, used):
    # VARLEN_K: k's own sequences (longer, shorter, empty); seqused_k hides real keys of a sequence, which the
    # non-causal mask must drop as it drops the next sequence's
    lens_q, lens_k = [1, 63, 300, 1000, 65, 128], [5, 63, 700, 1000, 70, 1100]
    _varlen_grads(lens_q, lens_k, 4, 2, d, causal=causal, dv=dv,
                  seqused_k=[5, 40, 650, 1000, 0, 900] if used else None)
    _ran(fused)
    assert all(kw.get("cu_seqlens_k") is not None or kw.get("seqused_k") is not None for kw in fused)


def test_fused_k_sequences_with_softcap(fused):
    _varlen_grads([1, 63, 300, 1000], [5, 63, 700, 1100], 4, 2, 128, causal=False, softcap=20.0)
    _ran(fused)


def test_fused_matches_the_split_backward(fused):
    got, want = grads_switched("gluon_fused_dq", fused, device=DEV)
    for a, b in zip(got, want):
        # two fp32 summation orders, one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_deterministic_keeps_the_dq_kernel(fused):
    # reduce-adds land in a varying order: deterministic=True takes the dQ kernel and stays bitwise repeatable
    runs = repeated_grads(5, shape=(2, 2048, 8, 128), device=DEV, causal=True, deterministic=True)
    assert fused and not any(map(_is_fused, fused))
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
