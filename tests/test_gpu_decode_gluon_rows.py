"""The whole-row Gluon decode kernel on the H200 (FLASHTILE_DECODE_GLUON_ROWS=1, an experiment): every call routed
there must match the PyTorch reference (FlashAttention's tolerance rule), with ragged rows, rows without keys,
splits past a row's end, appended keys (by the separate append kernel), GQA 1:1 to 8:1, 4 or 8 kv heads and
d = 64 / 128, and stay capturable in a CUDA graph. Every test runs twice: with 16-byte copies
(kernels/gluon_decode_rows.py) and with TMA copies (FLASHTILE_DECODE_GLUON_ROWS_TMA=1,
kernels/gluon_decode_rows_tma.py, session 20). Marked gluon (gpu_check's tests-decode-gluon-rows runs them under
its timeout)."""

import pytest
import torch

from flashtile.backends.triton import decode_gluon_rows
from test_gpu_decode_gluon_warp_keys import (  # noqa: F401 (three of the per-head kernel's tests, run here too)
    _record_launches,
    graph_steps_match_the_default,
    test_full_cache_without_lengths_and_noncontiguous_q,
    test_nan_past_the_lengths_is_never_read,
    test_scale_right_window_and_explicit_single_split,
)
from test_gpu_kvcache import _check, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]


@pytest.fixture(params=["copies", "tma"])
def gluon_calls(monkeypatch, request):
    """The whole-row kernel's knob on (with 16-byte or TMA copies), and its launches (the name the imported tests
    ask for)."""
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_TMA", "0" if request.param == "copies" else "1")
    return _record_launches(monkeypatch, decode_gluon_rows, "gluon_rows_decode", 0)


# (b, h, h_k, d, cap, s_new)
SHAPES = [(32, 32, 8, 128, 8192, 0), (32, 32, 8, 128, 4133, 1), (8, 64, 8, 128, 3000, 3), (16, 16, 4, 64, 2049, 1),
          (3, 8, 8, 128, 700, 0), (1, 32, 8, 128, 20000, 1), (64, 32, 8, 64, 300, 2)]


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,h_k,d,cap,s_new", SHAPES)
def test_matches_reference(gluon_calls, half, b, h, h_k, d, cap, s_new):
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, half, seed=cap + b)
    if b > 1:
        kw["cache_seqlens"][1::3] = 0  # rows without cache keys (with new keys: only those)
    _check(q, kc, vc, kw, causal=True)
    assert gluon_calls, "the whole-row kernel did not run"


def test_int_length(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 5000, torch.bfloat16)
    kw["cache_seqlens"] = 4321
    _check(q, kc, vc, kw)
    assert gluon_calls


def test_cuda_graph_step(gluon_calls, monkeypatch):
    graph_steps_match_the_default(monkeypatch, "FLASHTILE_DECODE_GLUON_ROWS")
    assert gluon_calls


# After a review of the kernel (session 19): layouts and strides the shapes above leave out
@pytest.mark.parametrize("h, h_k, d", [(32, 4, 128), (8, 4, 128), (24, 8, 128), (28, 4, 64), (32, 8, 64)])
def test_other_groups_and_head_dims(gluon_calls, h, h_k, d):
    # 4 kv heads at d = 128 (its own copy layout), groups of 8, 2, 3 and 7
    q, kc, vc, kw = _inputs(256 // h_k, 1, 1, h, h_k, d, 1500, torch.bfloat16, seed=h + d)
    _check(q, kc, vc, kw, causal=True)
    assert gluon_calls


def test_head_major_cache_and_more_cache_rows_than_batch(gluon_calls):
    # (b, cap, h_k, d) views of head-major memory (a head stride of cap * d), with two cache rows past the batch
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 1024, torch.bfloat16, seed=11)
    hm_k = torch.randn(34, 8, 1024, 128, device=q.device, dtype=q.dtype).transpose(1, 2)
    hm_v = torch.randn_like(hm_k)
    _check(q, hm_k, hm_v, kw)
    assert gluon_calls


@pytest.mark.parametrize("length, s_new", [(777, 2), (0, 1), (0, 0)])
def test_int_lengths(gluon_calls, length, s_new):
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, 1000, torch.bfloat16)
    kw["cache_seqlens"] = length
    _check(q, kc, vc, kw)
    assert gluon_calls


def test_one_split(gluon_calls):
    # b = 600 on 132 SMs: the split count rounds to one
    q, kc, vc, kw = _inputs(600, 1, 1, 32, 8, 128, 64, torch.bfloat16)
    _check(q, kc, vc, kw, causal=True)
    assert gluon_calls


@pytest.fixture
def tma_calls(monkeypatch):
    """The whole-row route with TMA copies, and its launches."""
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_TMA", "1")
    return _record_launches(monkeypatch, decode_gluon_rows, "gluon_rows_decode", 0)


@pytest.mark.parametrize("slots", ["1,1", "2,1", "4,2"])
@pytest.mark.parametrize("b,h,h_k,d,cap,s_new", [(32, 32, 8, 128, 4133, 1), (16, 16, 4, 64, 2049, 1)])
def test_tma_rings(tma_calls, monkeypatch, slots, b, h, h_k, d, cap, s_new):
    # the TMA kernel's other rings (two programs an SM at 1,1 and 2,1 for h_k = 8, d = 128)
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SLOTS", slots)
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap + 10 * int(slots[0]) + int(slots[2]))
    kw["cache_seqlens"][1::3] = 0
    _check(q, kc, vc, kw, causal=True)
    assert tma_calls


# After a review of the TMA kernel (session 20): views its descriptors must describe, and caches they cannot
# (called on the views themselves: a clone of a sliced or expanded view is contiguous)
def test_row_and_head_slices_of_a_bigger_cache(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 1500, torch.bfloat16, seed=21)
    big_k = torch.randn(32, 1501, 9, 128, device=q.device, dtype=q.dtype)
    big_v = torch.randn_like(big_k)
    k_view, v_view = big_k[:, 1:, 1:], big_v[:, 1:, 1:]  # a row offset and a head stride of 9 * d
    assert k_view.stride(2) == 128 and k_view.stride(1) == 9 * 128
    _check(q, k_view, v_view, kw, on_views=True, causal=True)
    assert gluon_calls


def test_caches_without_keys_or_with_a_zero_batch_stride(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 0, torch.bfloat16, seed=22)
    _check(q, kc, vc, kw, on_views=True)  # no keys at all (the TMA route takes the 16-byte copies)
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 600, torch.bfloat16, seed=23)
    kw["cache_seqlens"] = 577
    k_view, v_view = kc[:1].expand_as(kc), vc[:1].expand_as(vc)  # one cache row read by every batch row
    assert k_view.stride(0) == 0
    _check(q, k_view, v_view, kw, on_views=True)
    assert len(gluon_calls) == 2
