"""GPU tests of the Gluon dQ kernel (kernels/gluon_bwd_dq.py) through the public backward, with its
route pinned on (backends/triton/gluon_bwd.py DQ_OVERRIDE, DQ_GPU_VERIFIED). Each test also checks that
the kernel really ran, so a refused call cannot pass as a Gluon result. dK/dV come from whatever the
route picks (the Gluon dK/dV kernel at bf16 d = 128)."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, grads_switched, record_calls, repeated_grads
from flashtile.backends.triton import gluon_bwd

# "gluon": run alone (gpu_check.sh tests-gluon-bwd), not in full runs
pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture
def dq_on(monkeypatch):
    monkeypatch.setattr(gluon_bwd, "DQ_OVERRIDE", True)
    monkeypatch.setattr(gluon_bwd, "DQ_GPU_VERIFIED", True)  # what these tests decide
    return record_calls(monkeypatch, gluon_bwd, "gluon_attn_bwd_dq")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (256, 4, 1), (1000, 8, 8)])
def test_gluon_dq_grads(dq_on, d, causal, s, h, h_k):
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    assert dq_on, "the Gluon dQ kernel did not run"


def test_gluon_dq_fp16_and_long(dq_on):
    check_padded(1, 4096, 4096, 4, 4, 128, torch.float16, device=DEV, causal=True)
    assert dq_on


def test_gluon_dq_repeatable(dq_on):
    # one writer per dQ element and a fixed summation order: bitwise equal run to run
    runs = repeated_grads(6, shape=(2, 2048, 8, 128), device=DEV, causal=True)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


def test_gluon_dq_matches_triton(dq_on, monkeypatch):
    got, want = grads_switched(monkeypatch, gluon_bwd, "DQ_OVERRIDE", dq_on, device=DEV)
    # dK / dV: the same kernel either way; dQ: two fp32 summation orders, one bf16 rounding each
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2e-2 * want[0].float().abs().max().item()


def test_refused_dq_takes_triton(dq_on):
    q, k, v = (torch.randn(1, 128, 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, softcap=5.0)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not dq_on  # softcap is outside the kernel's scope


def test_keys_past_the_sequence_add_nothing_at_very_negative_scores(dq_on, monkeypatch):
    # Every score about -20, so lse is about -15: the zero-filled key rows past s = 100 (S = 0) would
    # get P = exp(15) and an fp16 dS past 65504 unless masked, and inf * (zero K row) is NaN in dQ.
    torch.manual_seed(0)
    d = 128
    u = torch.nn.functional.normalize(torch.randn(d, device=DEV), dim=0)
    k = (u * 4 + 0.01 * torch.randn(1, 100, 2, d, device=DEV)).half().requires_grad_()
    q = (-u * (20 * d ** 0.5 / 4) + 0.01 * torch.randn(1, 100, 2, d, device=DEV)).half().requires_grad_()
    v = torch.randn(1, 100, 2, d, device=DEV, dtype=torch.float16, requires_grad=True)
    g = torch.randn(1, 100, 2, d, device=DEV, dtype=torch.float16)
    out = flashtile.flash_attn_func(q, k, v)
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert dq_on
    assert all(torch.isfinite(x).all() for x in got)
    monkeypatch.setattr(gluon_bwd, "DQ_OVERRIDE", False)
    want = torch.autograd.grad(out, (q, k, v), g)
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2e-2 * want[0].float().abs().max().item()


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("d,config,dtype", [(128, (64, 64, 2, 4), BF16), (128, (128, 64, 2, 8), BF16),
                                            (128, (64, 128, 2, 4), BF16), (128, (64, 64, 2, 4), FP16),
                                            (64, (64, 64, 2, 4), BF16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [77, 1000])
def test_plain_order_candidates_match_triton(monkeypatch, d, config, dtype, causal, s):
    # scripts/tune_gluon_bwd.py's ROTATED = 0 dQ candidates (session 7, compiled on the CPU only),
    # launched directly, against the Triton dQ kernel (the route never takes them)
    monkeypatch.setattr(gluon_bwd, "DQ_OVERRIDE", False)  # the reference is the Triton dQ kernel
    torch.manual_seed(0)
    b, h, h_k = 2, 4, 2
    q = torch.randn(b, s, h, d, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, h_k, d, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    g = torch.randn_like(q)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    want = torch.autograd.grad(out, q, g)[0]
    delta = (g.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dq = torch.full_like(q, float("nan"))  # rows the kernel skipped would stay NaN
    cfg = dict(zip(("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps"), config), ROTATED=0)
    gluon_bwd.gluon_attn_bwd_dq(q.detach(), k.detach(), v.detach(), g, lse.contiguous(), delta, dq, d ** -0.5,
                                causal, config=cfg)
    assert torch.isfinite(dq).all()
    assert (dq.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()
