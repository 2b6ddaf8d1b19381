"""The CPU path (chunked online softmax in PyTorch) against the reference: outputs and gradients."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, check_varlen
from flashtile.backends import cpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # tiny tiles so that odd sizes cross several query and key tiles and the band skipping runs
    monkeypatch.setattr(cpu, "BLOCK_Q", 16)
    monkeypatch.setattr(cpu, "BLOCK_K", 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (113, 113), (1, 113), (113, 17), (17, 113)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_seqlens(dtype, sq, sk, causal):
    check_padded(2, sq, sk, 4, 2, 40, dtype, causal=causal)


@pytest.mark.parametrize("d", [8, 40, 59, 64, 80, 128, 256])
def test_head_dims(d):
    check_padded(1, 33, 47, 2, 1, d, torch.float16, causal=True)


FEATURES = [
    dict(window_size=(7, 3)),
    dict(window_size=(0, 0)),
    dict(window_size=(20, -1), causal=True),
    dict(window_size=(-1, 5)),
    dict(softcap=3.0),
    dict(softcap=1.0, causal=True),
    dict(alibi="h"),
    dict(alibi="bh", causal=True),
    dict(alibi="h", window_size=(9, 4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feature", range(len(FEATURES)))
@pytest.mark.parametrize("sq,sk", [(45, 45), (30, 77), (77, 30)])
def test_features(dtype, feature, sq, sk):
    check_padded(2, sq, sk, 4, 1, 24, dtype, **FEATURES[feature])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 6)])
def test_gqa_mqa(h, h_k):
    check_padded(2, 37, 41, h, h_k, 32, torch.float16, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_with_returned_mask(causal):
    out = check_padded(2, 50, 70, 4, 2, 32, torch.float32, dropout_p=0.17, causal=causal)
    assert torch.isfinite(out).all()


def test_dropout_keep_fraction_and_reproducibility():
    q, k, v = (torch.randn(2, 64, 4, 16) for _ in range(3))
    torch.manual_seed(123)
    o1, _, s1 = flashtile.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    torch.manual_seed(123)
    o2, _, s2 = flashtile.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    o3, _, _ = flashtile.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    assert not torch.equal(o1, o3)
    keep = (s1 >= 0).float().mean().item()
    assert abs(keep - 0.7) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(5, 2)), dict(alibi="bh"),
                                dict(softcap=2.0, causal=True)])
def test_varlen_with_empty_sequences(dtype, kw):
    check_varlen([17, 0, 40, 1, 33], [20, 5, 0, 13, 33], 4, 2, 24, dtype, **kw)


def test_varlen_seqused_k_limits_keys():
    from attn_cases import varlen_inputs
    from flashtile.backends.reference import attention_ref

    lens = [20, 31, 9]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, 2, 2, 16, torch.float32, grads=False)
    used = torch.tensor([5, 31, 0], dtype=torch.int32)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 31, 31, causal=True, seqused_k=used)
    ref, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, causal=True)
    assert (out - ref).abs().max().item() < 1e-5
    assert (out[51:] == 0).all()  # the third sequence sees no key


def test_gradcheck_float64():
    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, softcap=2.0, window_size=(3, -1))

    q = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_fully_masked_rows_zero_output_and_grads():
    q = torch.randn(1, 9, 2, 16, requires_grad=True)
    k = torch.randn(1, 3, 2, 16, requires_grad=True)
    v = torch.randn(1, 3, 2, 16, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (out[:, :6] == 0).all() and torch.isposinf(lse[:, :, :6]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :6] == 0).all()
