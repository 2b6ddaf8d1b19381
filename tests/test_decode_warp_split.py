"""The decode kernel's warp-split interior (kernels/decode_warp_split.py, FLASHTILE_DECODE_WARP_SPLIT; an
experiment, off by default) on CPU through the interpreter: each 32-key tile of the unmasked interior cut
into 2 sub-tiles with their own online softmax, merged after the loop with the masked edges' state. Results
must match the independent oracle of test_kvcache.py and the default kernel (to rounding: the sums run in
another order) for every feature the interior sees: GQA, paged caches (table per tile, per page and per key),
left padding, windows, softcap, ALiBi, splits, appended keys and rotary; the knob's values are checked."""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from flashtile.kvcache import flash_attn_with_kvcache
from test_decode_tma import _call  # (out, lse, k cache, v cache) on copies of the caches
from test_kvcache import CASES, _run_and_check, make_case

# windows wide enough that a left edge block (masked, merged before the interior's sub-tiles) and interior
# blocks both hold keys, with 32-key tiles
CASES = dict(CASES, wide_window=dict(s_new=0, sq=1, window_size=(100, 0)),
             wide_window_append=dict(s_new=2, sq=2, window_size=(90, 3), softcap=3.0))
NAMES = ["wide_window", "wide_window_append", "read_only_full_cache",
         "append_rows", "batch_idx", "leftpad", "paged_3", "paged_16", "paged_16_leftpad",
         "window", "softcap", "alibi_h", "alibi_bh_window", "gqa_8_to_1", "mha_odd_d", "empty_rows",
         "larger_cache_than_batch", "rotary_half_full_local"]


@pytest.fixture
def warp_split_interp(decode_interp, monkeypatch):
    # 32-key tiles: two 16-key sub-tiles, the smallest a dot takes
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (32, 4, 1))
    return decode_interp


@pytest.mark.parametrize("name", NAMES)
def test_warp_split_matches_oracle_and_default(warp_split_interp, monkeypatch, name):
    q, kc, vc, args = make_case(dtype=torch.float32, cap=150, **CASES[name])
    for splits in (1, 2):
        monkeypatch.delenv("FLASHTILE_DECODE_WARP_SPLIT", raising=False)
        ref = _call(q, kc, vc, args, splits)
        assert "WARP_SPLIT" not in warp_split_interp[-1]
        monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", "2")
        got = _run_and_check(q, kc, vc, args, num_splits=splits)  # against the oracle
        assert warp_split_interp[-1]["WARP_SPLIT"] == 2, "the warp-split interior did not run"
        assert "USE_TMA" not in warp_split_interp[-1]
        assert (got[0] - ref[0]).abs().max().item() <= 1e-5
        fin = torch.isfinite(ref[1])
        assert torch.equal(fin, torch.isfinite(got[1]))
        assert (got[1][fin] - ref[1][fin]).abs().max().item() <= 1e-5 if fin.any() else True


@pytest.mark.parametrize("name", ["wide_window_append", "paged_16", "alibi_h", "gqa_8_to_1"])
def test_four_sub_tiles_of_64_keys(decode_interp, monkeypatch, name):
    # the other shape the GPU A/B runs: 64-key tiles in 4 sub-tiles of 16 keys
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (64, 4, 1))
    monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", "4")
    q, kc, vc, args = make_case(dtype=torch.float32, cap=300, **CASES[name])
    _run_and_check(q, kc, vc, args, num_splits=2)
    assert decode_interp[-1]["WARP_SPLIT"] == 4


def test_warp_split_fp16(warp_split_interp, monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", "2")
    q, kc, vc, args = make_case(dtype=torch.float16, cap=150, **CASES["paged_16"])
    _run_and_check(q, kc, vc, args, num_splits=1)
    assert warp_split_interp[-1]["WARP_SPLIT"] == 2


@pytest.mark.parametrize("value, tiles, split", [("4", 64, 4), ("8", 128, 8), ("4", 32, 2), ("8", 64, 4), ("2", 16, 1)])
def test_knob_values(monkeypatch, value, tiles, split):
    # as many sub-tiles as asked for, while each keeps at least 16 keys (none below 2)
    monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", value)
    assert launcher.decode_warp_split(tiles) == split
    for off in ("", "0", "1"):
        monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", off)
        assert launcher.decode_warp_split(tiles) == 1
    for bad in ("3", "on", "16"):
        monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_WARP_SPLIT"):
            launcher.decode_warp_split(tiles)


@pytest.mark.parametrize("page", [None, 8], ids=["contiguous", "paged"])
def test_fp8_cache(warp_split_interp, monkeypatch, page):
    # e4m3 caches: the sub-tiles upcast their K / V tiles to fp16 as the default interior does
    from test_kvcache_fp8 import _case, _oracle

    monkeypatch.setenv("FLASHTILE_DECODE_WARP_SPLIT", "2")
    q8, kc8, vc8, args = _case(cap=160, page=page)
    ref_out, ref_lse, *_ = _oracle(q8, kc8, vc8, args, causal=True)
    out, lse = flash_attn_with_kvcache(q8, kc8, vc8, **args, causal=True, return_softmax_lse=True)
    assert warp_split_interp[-1]["WARP_SPLIT"] == 2 and warp_split_interp[-1]["IS_FP8"] is True
    assert (out.double() - ref_out).abs().max().item() < 2e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3
