"""The whole-row decode kernel through Triton's interpreter: the calls it takes match the dense oracle (ragged and
empty rows, splits without keys, appended keys, an int length, the whole cache, pages of whole tiles), with 1, 2
or 4 kv heads a program; and its rule's bounds (backends/triton/decode/route.py). GPU results:
tests/test_gpu_decode_rows.py."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import decode
from flashtile.backends.triton.decode import route as R
from test_kvcache import _run_and_check, make_case

CASES = {
    "ragged_append": dict(s_new=2),
    "read_only_int_len": dict(s_new=0, seqlens=20),
    "full_cache": dict(s_new=0, seqlens=None),
    "empty_rows": dict(s_new=0, seqlens=0),
}
H200 = R.DeviceProps((9, 0), 132, 139.8)
H100 = R.DeviceProps((9, 0), 132, 79.6)


@pytest.fixture
def rows_route(monkeypatch):
    """Send every call to the whole-row kernel in the interpreter on 16-key tiles and 2 stages: ``rows_route(heads,
    splits)``; returns the list of routes taken."""
    taken = []

    def force(heads, splits=3):
        route = R.Route("rows", splits=splits, block_n=16, warps=4, stages=2, heads=heads)
        monkeypatch.setattr(decode, "select_route", lambda *a, **k: taken.append(route) or route)
        return taken

    with config.override(interpret=True):
        yield force


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(rows_route, heads, name):
    taken = rows_route(heads)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, **CASES[name])
    _run_and_check(q, kc, vc, args)
    assert [r.heads for r in taken] == [heads]


@pytest.mark.parametrize("splits", [1, 2])
def test_splits_of_several_tiles(rows_route, splits):
    # 16-key tiles, rows of up to 110 keys in one or two splits: full tiles (the unmasked loop and its pointer
    # steps) then a partial one
    rows_route(2, splits)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=110, s_new=1)
    _run_and_check(q, kc, vc, args)


@pytest.mark.parametrize("page", [16, 32, 48])  # a tile a page; two; three (not a power of two)
@pytest.mark.parametrize("name", ["ragged_append", "read_only_int_len", "empty_rows"])
def test_paged_caches(rows_route, page, name):
    """Pages of whole 16-key tiles, scattered in the pool: each tile's page comes from the block table; keys
    appended through the table first."""
    rows_route(4, 2)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=100, page=page, **CASES[name])
    _run_and_check(q, kc, vc, args)


def test_forced_rows_in_the_interpreter():
    """FLASHTILE_DECODE_ROUTE=rows runs whole rows (all kv heads a program) through kvcache_fwd, also under the
    interpreter; a call the kernel does not cover (pages smaller than its 16-key tile) is refused by name."""
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, s_new=1)
    with config.override(interpret=True, decode_route="rows"):
        _run_and_check(q, kc, vc, args)
        q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, page=8, s_new=1)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROUTE='rows' cannot take this call"):
            _run_and_check(q, kc, vc, args)


def heads(b, capacity, page=0, props=H200, h_k=8, d=128, num_splits=0):
    """The whole-row rule's heads a program for a plain one-token call (0: another kernel)."""
    shape = R.DecodeShape(b, 1, 4 * h_k, h_k, d, capacity, 0, num_splits)
    return R._row_heads(shape, page > 0, page, props)


def test_rule_takes_long_caches_on_large_batches():
    # contiguous caches: 4 heads a program where those programs fill the SMs once (b = 32: 64 units x 2 splits;
    # b = 64: 128 units unsplit), the whole row elsewhere
    assert heads(32, 65536) == 4 and heads(32, 131072) == 4
    assert heads(32, 32768) == 0  # the per-head kernels were faster there
    assert heads(64, 8192) == 4
    assert heads(64, 4096) == 0  # unmeasured
    assert heads(128, 8192) == 8  # 256 narrow programs: two waves
    assert heads(48, 65536) == 8  # 96 narrow programs: 36 SMs idle
    assert heads(40, 65536) == 8  # 80 units x 2 splits: 160 programs
    # b = 16: whole rows (8 splits) lost at every length; half rows (32 units x 4 splits) win from 128k only
    assert heads(16, 131072) == 4 and heads(16, 262144) == 4
    assert heads(16, 65536) == 0
    assert heads(8, 131072) == 0  # 16 units x 8 splits: unmeasured as a rule
    assert heads(20, 131072) == 0  # 40 units x 3 splits: 120 programs, 12 SMs idle
    assert heads(24, 131072) == 0  # 48 units x 3 splits: 144 programs, two waves
    for b in (21, 22, 31):  # their half rows fill the SMs once too, but unmeasured: HALF_ROW_ONLY stops below 1.0
        assert heads(b, 131072) == 0
    # only the measured shape: Hopper, 8 kv heads of d = 128, the heuristic's split count
    assert heads(32, 65536, props=R.DeviceProps((8, 0), 132, 80.0)) == 0
    assert heads(32, 65536, props=R.INTERPRETER) == 0
    assert heads(64, 65536, h_k=4) == 0
    assert heads(32, 65536, d=64) == 0
    assert heads(32, 65536, num_splits=1) == 0
    # fewer SMs: the same batch is more programs an SM
    assert heads(16, 65536, props=R.DeviceProps((9, 0), 66, 80.0)) == 4  # 32 units x 2 splits on 66 SMs
    # paged caches: from 8k keys at b = 32, at b = 16 on 16-key pages only, never at b = 8
    for page in (16, 64, 256):
        assert heads(32, 8192, page) == 8
        assert heads(32, 4096, page) == 0
        assert heads(8, 131072, page) == 0
        assert heads(16, 131072, page) == (8 if page == 16 else 0)


def test_h100_rule_at_b32():
    """An H100's contiguous caches (the 80GB memory class): b = 32 below 96k keys on another kernel (the Gluon
    kernel's rule), whole rows from 96k, never half rows; every other grid and paged caches as on an H200."""
    assert heads(32, 65536, props=H100) == 0
    assert heads(32, 98303, props=H100) == 0
    assert heads(32, 98304, props=H100) == 8
    assert heads(32, 131072, props=H100) == 8
    assert heads(32, 131072) == 4  # the H200's half rows
    for kw in (dict(b=64, capacity=8192), dict(b=16, capacity=131072), dict(b=32, capacity=65536, page=256),
               dict(b=32, capacity=65536, page=16), dict(b=8, capacity=131072), dict(b=33, capacity=131072),
               dict(b=48, capacity=65536), dict(b=62, capacity=98304), dict(b=31, capacity=131072)):
        assert heads(**kw, props=H100) == heads(**kw), kw
    # an H100 PCIe (114 SMs) is not in the 132-SM boards' memory classes: the general bounds
    assert heads(32, 131072, props=R.DeviceProps((9, 0), 114, 79.6)) == heads(32, 131072, props=R.DeviceProps(
        (9, 0), 114, 139.8))


def test_launch_knobs():
    """Paged caches at 8 heads keep a third buffer of K and V, launched as 2 x 4 - 1 stages (the block-table load
    takes its own stages); 4 heads take 32-key tiles (16 on pages); the splits fill every SM's program slots."""
    shape = R.DecodeShape(32, 1, 32, 8, 128, 65536)
    paged = R._rows_route(shape, torch.bfloat16, True, 8, H200)
    assert (paged.block_n, paged.warps, paged.stages, paged.splits) == (16, 8, 7, 4)
    whole = R._rows_route(shape, torch.bfloat16, False, 8, H200)
    assert (whole.block_n, whole.warps, whole.stages, whole.splits) == (16, 8, 3, 4)
    half = R._rows_route(shape, torch.bfloat16, False, 4, H200)
    assert (half.block_n, half.warps, half.stages, half.splits) == (32, 4, 3, 2)
    assert R._rows_route(shape, torch.bfloat16, True, 4, H200).block_n == 16
    one = R._rows_route(R.DecodeShape(1, 1, 32, 8, 128, 80), torch.bfloat16, False, 8, H200)
    assert one.splits == 5  # at most one split a key block
    many = R._rows_route(R.DecodeShape(1, 1, 32, 8, 128, 1 << 24), torch.bfloat16, False, 8, H200)
    assert many.splits == R.MAX_SPLITS
