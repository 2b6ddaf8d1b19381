"""The reference against a float64 brute force for every masking rule of the contract."""

import pytest
import torch

from brute_force import brute_force
from flashtile.backends.reference import attention_ref

CASES = [
    dict(),
    dict(causal=True),
    dict(window_size=(3, 2)),
    dict(window_size=(0, 0)),
    dict(window_size=(-1, 4)),
    dict(window_size=(2, -1)),
    dict(window_size=[40, 40]),  # bounds past the edges act as unbounded
    dict(window_size=torch.tensor([1, 0])),
    dict(causal=True, window_size=(4, -1)),
    dict(softcap=1.5),
    dict(softcap=2.0, causal=True),
    dict(alibi="h"),
    dict(alibi="bh", causal=True),
]


def _alibi(kind, b, h):
    if kind == "h":
        return torch.rand(h) * 0.5
    if kind == "bh":
        return torch.rand(b, h) * 0.5
    return None


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 11), (11, 5), (1, 9), (9, 1), (13, 13)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_brute_force(sq, sk, case):
    kw = dict(CASES[case])
    b, h, h_k, d = 2, 4, 2, 8
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h_k, d), torch.randn(b, sk, h_k, d)
    alibi = _alibi(kw.pop("alibi", None), b, h)
    window = kw.get("window_size", (-1, -1))
    window = window.tolist() if isinstance(window, torch.Tensor) else window
    out, lse = attention_ref(q.double(), k.double(), v.double(), alibi_slopes=alibi, **kw)
    bo, bl = brute_force(q, k, v, [sq] * b, [sk] * b, causal=kw.get("causal", False), window=tuple(window),
                         softcap=kw.get("softcap", 0.0), alibi=alibi)
    assert torch.allclose(out, bo, atol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(bl))
    finite = torch.isfinite(bl)
    assert torch.allclose(lse[finite], bl[finite], atol=1e-10)


def test_fully_masked_rows_give_zero_and_inf_lse():
    # sq > sk with causal: the first sq - sk rows see nothing
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    assert (out[:, :4] == 0).all() and torch.isinf(lse[:, :, :4]).all() and (lse[:, :, :4] > 0).all()
    assert (out[:, 4:].abs() > 0).any() and torch.isfinite(lse[:, :, 4:]).all()


def test_empty_keys():
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 0, 2, 8), torch.randn(1, 0, 2, 8)
    out, lse = attention_ref(q, k, v)
    assert (out == 0).all() and torch.isinf(lse).all()


def test_dropout_mask_against_brute_force():
    b, sq, sk, h, d, p = 2, 6, 9, 2, 8, 0.3
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    keep = torch.rand(b, h, sq, sk) >= p
    out, _ = attention_ref(q.double(), k.double(), v.double(), dropout_p=p, dropout_mask=keep, causal=True)
    bo, _ = brute_force(q, k, v, [sq] * b, [sk] * b, causal=True, keep=keep, dropout_p=p)
    assert torch.allclose(out, bo, atol=1e-10)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(2, 1)), dict(alibi="bh")])
def test_varlen_with_empty_sequences(kw):
    kw = dict(kw)
    lens_q, lens_k = [3, 0, 7, 1, 5], [4, 3, 0, 6, 5]
    b, h, h_k, d = len(lens_q), 4, 1, 8
    alibi = _alibi(kw.pop("alibi", None), b, h)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q, k, v = torch.randn(sum(lens_q), h, d), torch.randn(sum(lens_k), h_k, d), torch.randn(sum(lens_k), h_k, d)
    out, lse = attention_ref(q.double(), k.double(), v.double(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             alibi_slopes=alibi, **kw)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    # brute force on the padded layout
    mq, mk = max(lens_q), max(lens_k)
    qp, kp, vp = torch.zeros(b, mq, h, d), torch.zeros(b, mk, h_k, d), torch.zeros(b, mk, h_k, d)
    for i in range(b):
        qp[i, : lens_q[i]] = q[cu_q[i] : cu_q[i + 1]]
        kp[i, : lens_k[i]] = k[cu_k[i] : cu_k[i + 1]]
        vp[i, : lens_k[i]] = v[cu_k[i] : cu_k[i + 1]]
    bo, bl = brute_force(qp, kp, vp, lens_q, lens_k, causal=kw.get("causal", False),
                         window=kw.get("window_size", (-1, -1)), alibi=alibi)
    for i in range(b):
        rows = slice(cu_q[i], cu_q[i + 1])
        assert torch.allclose(out[rows], bo[i, : lens_q[i]], atol=1e-10)
        ref_lse = bl[i, :, : lens_q[i]]
        assert torch.equal(torch.isinf(lse[:, rows]), torch.isinf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert torch.allclose(lse[:, rows][fin], ref_lse[fin], atol=1e-10)


def test_padding_masks_shorten_rows():
    b, s, h, d = 2, 8, 2, 8
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    lens = [5, 8]
    mask = torch.arange(s).view(1, s) < torch.tensor(lens).view(b, 1)
    out, _ = attention_ref(q.double(), k.double(), v.double(), causal=True, query_padding_mask=mask,
                           key_padding_mask=mask)
    bo, _ = brute_force(q, k, v, lens, lens, causal=True)
    assert torch.allclose(out, bo, atol=1e-10)


def test_upcast_false_runs_in_input_dtype_and_reorder_ops():
    q, k, v = (torch.randn(1, 16, 2, 32, dtype=torch.float16) for _ in range(3))
    ref, _ = attention_ref(q, k, v, causal=True)
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    ro, _ = attention_ref(q, k, v, causal=True, reorder_ops=True)
    assert ref.dtype == pt.dtype == torch.float16
    err = (pt.float() - ref.float()).abs().max().item()
    assert 0 < err < 1e-2  # the fp16 run differs from the upcast one, by rounding only
    assert (ro.float() - ref.float()).abs().max().item() < 1e-2
