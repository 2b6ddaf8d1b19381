"""GPU tests of the Gluon dK/dV kernel (kernels/gluon_bwd.py) through the public backward, with the
route pinned on (backends/triton/gluon_bwd.py OVERRIDE, GPU_VERIFIED). Each test also checks that the
Gluon kernel really ran, so a refused call cannot pass as a Gluon result. The first version failed
two causal cases here on the H200 (session 5: a register hazard); the shared-memory version has
not run on a GPU yet."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, repeated_grads
from flashtile.backends.triton import gluon_bwd

# "gluon": run alone (gpu_check.sh tests-gluon-bwd), like the Gluon forward's tests, not in full runs
pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture
def gluon_on(monkeypatch):
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", True)
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED", True)  # what these tests decide
    monkeypatch.setattr(gluon_bwd, "GPU_VERIFIED_HEAD_DIMS", gluon_bwd.HEAD_DIMS)  # d = 256 too
    calls = []
    real = gluon_bwd.gluon_attn_bwd_dkdv

    def counting(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", counting)
    return calls


@pytest.mark.parametrize("d", [64, 128, 256])  # 256: two warpgroups side by side, not yet run on a GPU
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (256, 4, 1), (1000, 8, 8)])
def test_gluon_dkdv_grads(gluon_on, d, causal, s, h, h_k):
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


def test_gluon_dkdv_fp16_and_long(gluon_on):
    check_padded(1, 4096, 4096, 4, 4, 128, torch.float16, device=DEV, causal=True)
    assert gluon_on


def test_gluon_dkdv_repeatable(gluon_on):
    # a race or a register hazard shows as run-to-run differences (the kernel has one writer per output)
    runs = repeated_grads(6, shape=(2, 2048, 8, 128), device=DEV, causal=True)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


def test_gluon_dkdv_matches_triton(gluon_on, monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert gluon_on
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", False)
    want = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got, want):
        # two fp32 summation orders, one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_refused_calls_take_triton(gluon_on):
    q, k, v = (torch.randn(1, 128, 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, softcap=5.0)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not gluon_on  # softcap is outside the kernel's scope
