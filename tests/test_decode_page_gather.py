"""The split decode kernel's by-page gather for small pages (Route.pages_per_tile), on CPU through the interpreter
with 16-key tiles.

Power-of-two pages smaller than a tile, without left padding: an unmasked tile reads one table entry
per page instead of one per key. Results must equal the per-key path's bit for bit (same addresses,
same arithmetic) and the oracle of test_kvcache.py, also when every pool slot that holds no key of
its row is NaN (the gather must read only pages in use).
"""

import dataclasses

import pytest
import torch

from flashtile.backends.triton import decode
from flashtile.backends.triton.decode import route as R
from test_decode_tma import _call
from test_kvcache import _run_and_check, dense_oracle, make_case

CASES = {
    "page_1": dict(page=1, s_new=2, rotary="interleaved", rotary_dim=8),
    "page_4_causal": dict(page=4, s_new=3, sq=3, causal=True),
    "page_8_read_only": dict(page=8, s_new=0),
    "page_8_window": dict(page=8, s_new=1, window_size=(40, 0)),
    "page_2_gqa": dict(page=2, s_new=1, h=8, h_k=1),
    # ALiBi makes a key's position count, so pages swapped inside a tile change the result
    "page_4_alibi": dict(page=4, s_new=0, alibi="bh"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gather_by_page_matches_per_key_and_oracle(decode_interp, monkeypatch, name):
    torch.manual_seed(0)
    q, kc, vc, args = make_case(dtype=torch.float16, cap=70, **CASES[name])
    page = kc.shape[1]
    real = decode.select_route
    for splits in (1, 3):
        # the per-key page lookup: the same route without the gather
        monkeypatch.setattr(decode, "select_route",
                            lambda *a, **k: dataclasses.replace(real(*a, **k), pages_per_tile=0))
        ref = _call(q, kc, vc, args, splits)
        assert decode_interp[-1]["PAGES_PER_TILE"] == 0
        monkeypatch.setattr(decode, "select_route", real)
        got = _run_and_check(q, kc, vc, args, num_splits=splits)
        assert decode_interp[-1]["PAGES_PER_TILE"] == 16 // page, "the by-page gather did not run"
        for a, b in zip(got, ref):
            assert torch.equal(a, b), "by-page and per-key gathers differ"


@pytest.mark.parametrize("name", ["page_4_causal", "page_8_read_only"])
def test_nan_outside_the_rows_pages_is_never_read(decode_interp, name):
    torch.manual_seed(3)
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    table, lens, page = args["block_table"], args["cache_seqlens"], kc.shape[1]
    s_new = args["k"].shape[1] if "k" in args else 0
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i in range(q.shape[0]):
        for pos in range(int(lens[i]) + s_new):
            keep[table[i, pos // page], pos % page] = True
    kc[~keep] = float("nan")
    vc[~keep] = float("nan")
    ref_out, ref_lse, _, _ = dense_oracle(q, kc, vc, **args)
    # and the table padded with -1 past each row's pages in use (the oracle read it unpadded)
    per_row = table.shape[1]
    for i in range(q.shape[0]):
        used = -(-(int(lens[i]) + s_new) // page)
        table[i, used:per_row] = -1
    out, lse, _, _ = _call(q, kc, vc, args, 3)
    assert decode_interp[-1]["PAGES_PER_TILE"] == 16 // page
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4


def test_rule():
    def gather(page, block_n=128, leftpad=False, paged=True):
        shape = R.DecodeShape(1, 1, 32, 8, 128, 8192, plain=not leftpad, leftpad=leftpad)
        route = R.select_route(shape, torch.float16, paged, page if paged else 0, R.INTERPRETER,
                               tiles=(16, block_n, 4, 1))
        return route.pages_per_tile

    assert gather(16) == 8 and gather(1, 64) == 64
    assert gather(16, leftpad=True) == 0  # left padding shifts tiles off pages
    assert gather(24) == 0  # not a power of two
    assert gather(128) == 0  # page-aligned: one entry per tile already
    assert gather(16, paged=False) == 0
