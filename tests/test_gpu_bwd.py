"""GPU tests of the Triton backward kernels (run by scripts/gpu_check.sh on the H200)."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, check_varlen

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 59, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_head_dims_and_seqlens(dtype, d, causal):
    for sq, sk in [(1, 239), (113, 203), (1023, 1024)]:
        check_padded(2, sq, sk, 4, 2, d, dtype, device=DEV, causal=causal)


FEATURES = [dict(window_size=(64, 0)), dict(window_size=(50, 30)), dict(softcap=30.0, causal=True),
            dict(alibi="h", causal=True), dict(alibi="bh"), dict(dropout_p=0.17), dict(dropout_p=0.1, causal=True)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("feature", range(len(FEATURES)))
def test_grads_features(d, feature):
    check_padded(2, 300, 500, 4, 1, d, torch.bfloat16, device=DEV, **FEATURES[feature])


def test_grads_varlen():
    check_varlen([1, 300, 0, 700, 77], [5, 300, 17, 900, 0], 8, 2, 128, torch.bfloat16, device=DEV, causal=True)


def test_deterministic_50_runs_and_no_races():
    q, k, v = (torch.randn(2, 1024, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 1024, 8, 128, device=DEV, dtype=torch.bfloat16)
    first = None
    for _ in range(50):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), g)
        if first is None:
            first = grads
        assert all(torch.equal(a, b) for a, b in zip(first, grads))


def test_large_magnitude_inputs_no_nan():
    q, k, v = (torch.randn(1, 512, 4, 64, device=DEV, dtype=torch.float16).mul(25).requires_grad_()
               for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(x).all() for x in grads)


def test_non_contiguous_dout():
    q, k, v = (torch.randn(2, 256, 4, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v)
    g = torch.randn(2, 4, 256, 64, device=DEV, dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d) view
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(flashtile.flash_attn_func(q, k, v), (q, k, v), g.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
