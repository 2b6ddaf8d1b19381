"""The decode kernel's K-prefetch interior (kernels/decode_k_prefetch.py, FLASHTILE_DECODE_K_PREFETCH; an
experiment, off by default) on CPU through the interpreter: the unmasked interior of a contiguous cache reads
each K tile one key block ahead into registers. Results must equal the default kernel's bit for bit (same
data, same arithmetic, same order) and match the independent oracle of test_kvcache.py for every feature the
interior sees: GQA, left padding, cache_batch_idx, windows, softcap, ALiBi, splits, appended keys, rotary and
fp8 caches. Paged caches keep the default interior."""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from test_decode_tma import _call  # (out, lse, k cache, v cache) on copies of the caches
from test_kvcache import CASES, _run_and_check, make_case

# a window wide enough that a masked left edge and several interior blocks both hold keys (16-key tiles)
CASES = dict(CASES, wide_window=dict(s_new=0, sq=1, window_size=(100, 0)),
             wide_window_append=dict(s_new=2, sq=2, window_size=(90, 3), softcap=3.0))
NAMES = ["wide_window", "wide_window_append", "read_only_int_len", "read_only_full_cache", "append_rows",
         "batch_idx", "leftpad", "window", "softcap", "alibi_h", "alibi_bh_window", "gqa_8_to_1", "mha_odd_d",
         "empty_rows", "larger_cache_than_batch", "rotary_half_full_local"]


@pytest.fixture
def small_tiles(decode_interp, monkeypatch):
    # 16-key tiles: a 150-key cache has many interior blocks, so the prefetch crosses several
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (16, 4, 2))
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", False)
    return decode_interp


def _equal_or_both_inf(a, b):
    return torch.equal(torch.nan_to_num(a, neginf=-1e30), torch.nan_to_num(b, neginf=-1e30))


@pytest.mark.parametrize("name", NAMES)
def test_k_prefetch_equals_default_and_oracle(small_tiles, monkeypatch, name):
    torch.manual_seed(0)
    q, kc, vc, args = make_case(dtype=torch.float32, cap=150, **CASES[name])
    for splits in (1, 3):
        monkeypatch.delenv("FLASHTILE_DECODE_K_PREFETCH", raising=False)
        ref = _call(q, kc, vc, args, splits)
        assert "K_PREFETCH" not in small_tiles[-1]
        monkeypatch.setenv("FLASHTILE_DECODE_K_PREFETCH", "1")
        got = _run_and_check(q, kc, vc, args, num_splits=splits)  # against the oracle
        assert small_tiles[-1].get("K_PREFETCH") is True, "the K-prefetch interior did not run"
        assert torch.equal(got[0], ref[0]), "K prefetch changed the output"
        assert _equal_or_both_inf(got[1], ref[1]), "K prefetch changed the lse"


def test_k_prefetch_fp16(small_tiles, monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_K_PREFETCH", "1")
    q, kc, vc, args = make_case(dtype=torch.float16, cap=150, **CASES["gqa_8_to_1"])
    _run_and_check(q, kc, vc, args, num_splits=2)
    assert small_tiles[-1].get("K_PREFETCH") is True


@pytest.mark.parametrize("name", ["paged_16", "paged_3"])
def test_paged_caches_keep_the_default_interior(small_tiles, monkeypatch, name):
    monkeypatch.setenv("FLASHTILE_DECODE_K_PREFETCH", "1")
    q, kc, vc, args = make_case(dtype=torch.float32, cap=150, **CASES[name])
    _run_and_check(q, kc, vc, args, num_splits=2)
    assert "K_PREFETCH" not in small_tiles[-1]


def test_knob_value_checked(small_tiles, monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_K_PREFETCH", "yes")
    q, kc, vc, args = make_case(dtype=torch.float32, cap=40, **CASES["append_rows"])
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_K_PREFETCH"):
        _call(q, kc, vc, args, 1)
