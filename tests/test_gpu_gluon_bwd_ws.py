"""GPU tests of the warp-specialised Gluon dK/dV kernel (kernels/gluon_bwd_ws.py) through the public
backward: the route pinned on with every dK/dV launch asking for that kernel
(backends/triton/gluon_bwd.py CONFIG_OVERRIDE). Each test checks that the kernel really ran. Not yet
run on a GPU (session 6 compiled it on the CPU only); its first run may hang on a barrier bug, so
it runs alone under a timeout (gpu_check.sh tests-gluon-bwd-ws)."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, repeated_grads
from flashtile.backends.triton import gluon_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture
def ws_on(monkeypatch):
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", True)
    monkeypatch.setattr(gluon_bwd, "CONFIG_OVERRIDE", {"WARP_SPECIALIZED": 1})
    calls = []
    real = gluon_bwd.gluon_attn_bwd_dkdv

    def counting(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", counting)
    return calls


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (256, 4, 1), (1000, 8, 8)])
def test_ws_dkdv_grads(ws_on, d, causal, s, h, h_k):
    # s = 1: one step, so consumer 1 has none and hands over zero partials
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    assert ws_on, "the warp-specialised kernel did not run"


def test_ws_dkdv_fp16_and_long(ws_on):
    check_padded(1, 4096, 4096, 4, 4, 128, torch.float16, device=DEV, causal=True)
    assert ws_on


def test_ws_dkdv_repeatable(ws_on):
    # fixed partition of the steps between the consumers and one fixed hand-off: bitwise equal
    runs = repeated_grads(6, shape=(2, 2048, 8, 128), device=DEV, causal=True)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


def test_ws_dkdv_matches_the_default_kernel(ws_on, monkeypatch):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert ws_on
    monkeypatch.setattr(gluon_bwd, "CONFIG_OVERRIDE", None)
    want = torch.autograd.grad(out, (q, k, v), g)
    assert torch.equal(got[0], want[0])  # dQ: the Triton kernel either way
    for a, b in zip(got[1:], want[1:]):
        # two fp32 summation orders (the consumers' halves are added at the end), one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()
