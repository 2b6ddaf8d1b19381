"""Per-page descriptor loads for small pages (backends/triton/decode.py use_page_tma, an experiment
behind FLASHTILE_DECODE_PAGE_TMA=1; kernels/decode.py _decode_inner_pages), on CPU through the
interpreter with 64-key tiles of 16-token pages (four pages per tile).

An unmasked tile loads each page's K and V by descriptor and steps the online softmax once per tile
(two passes over its pages).
Results must match the by-page gather (the default path; not bit for bit: the softmax steps in another
order) and the oracle of test_kvcache.py, also when every pool slot that holds no key of its row is
NaN and the table is padded with -1 past each row's pages (only pages in use may be read).
"""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from test_decode_tma import _call
from test_kvcache import _run_and_check, dense_oracle, make_case

CASES = {
    "read_only": dict(s_new=0),
    "append_rotary": dict(s_new=2, rotary="interleaved", rotary_dim=8),
    "causal_3_tokens": dict(s_new=3, sq=3, causal=True),
    "window": dict(s_new=1, window_size=(90, 0)),
    "gqa_8_1": dict(s_new=1, h=8, h_k=1),
    # a scale of 0 or below: the tile's max must be taken over scaled scores
    "negative_scale": dict(s_new=1, scale=-0.2),
}


@pytest.fixture
def page_tiles(decode_interp, monkeypatch):
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (64, 4, 1))
    monkeypatch.setattr(launcher, "PAGE_GATHER_OVERRIDE", True)
    return decode_interp


@pytest.mark.parametrize("name", list(CASES))
def test_page_tma_matches_gather_and_oracle(page_tiles, monkeypatch, name):
    torch.manual_seed(0)
    q, kc, vc, args = make_case(dtype=torch.float16, cap=230, page=16, **CASES[name])
    for splits in (1, 2):
        monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", False)
        ref = _call(q, kc, vc, args, splits)
        assert "PAGE_TMA" not in page_tiles[-1] and page_tiles[-1]["PAGES_PER_TILE"] == 4
        monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", True)
        got = _run_and_check(q, kc, vc, args, num_splits=splits)  # against the oracle
        assert page_tiles[-1].get("PAGE_TMA") is True, "the per-page descriptor path did not run"
        assert (got[0].float() - ref[0].float()).abs().max().item() <= 2e-3
        fin = torch.isfinite(ref[1])
        assert torch.equal(fin, torch.isfinite(got[1]))
        assert (got[1][fin] - ref[1][fin]).abs().max().item() <= 1e-3


def test_nan_outside_the_rows_pages_is_never_read(page_tiles, monkeypatch):
    torch.manual_seed(3)
    monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", True)
    q, kc, vc, args = make_case(cap=230, page=16, s_new=1)
    table, lens, page = args["block_table"], args["cache_seqlens"], kc.shape[1]
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i in range(q.shape[0]):
        for pos in range(int(lens[i]) + 1):
            keep[table[i, pos // page], pos % page] = True
    kc[~keep] = float("nan")
    vc[~keep] = float("nan")
    ref_out, ref_lse, _, _ = dense_oracle(q, kc, vc, **args)
    for i in range(q.shape[0]):
        table[i, -(-(int(lens[i]) + 1) // page):] = -1
    out, lse, _, _ = _call(q, kc, vc, args, 2)
    assert page_tiles[-1].get("PAGE_TMA") is True
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4


def test_rule(monkeypatch):
    kc = torch.zeros(8, 16, 2, 64, dtype=torch.float16)
    monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", None)
    monkeypatch.delenv("FLASHTILE_DECODE_PAGE_TMA", raising=False)
    assert not launcher.use_page_tma(kc, kc, 8, 16, True, True)  # off by default
    monkeypatch.setenv("FLASHTILE_DECODE_PAGE_TMA", "1")
    assert not launcher.use_page_tma(kc, kc, 8, 16, True, True)  # a CPU tensor: no descriptors there
    monkeypatch.setenv("FLASHTILE_DECODE_PAGE_TMA", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_PAGE_TMA"):
        launcher.use_page_tma(kc, kc, 8, 16, True, True)
    monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", True)
    assert launcher.use_page_tma(kc, kc, 8, 16, True, True)
    assert not launcher.use_page_tma(kc, kc, 0, 16, True, True)  # the by-page gather does not apply
    assert not launcher.use_page_tma(kc, kc, 16, 8, True, True)  # pages below one dot's 16 keys
    assert not launcher.use_page_tma(kc, kc, 8, 16, False, True)  # a padded head dim
    assert not launcher.use_page_tma(kc, kc, 8, 16, True, False)  # softcap or ALiBi
