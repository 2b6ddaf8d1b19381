"""The whole-row decode kernel (FLASHTILE_DECODE_ROWS=H, or its rule on Hopper) through Triton's interpreter: the
calls it takes match the dense oracle (ragged and empty rows, splits without keys, appended keys, an int length,
the whole cache), with the combine kernel or the in-kernel merge; calls it does not cover keep the default
kernels; bad knob values are refused by name; the rule's bounds and its wiring. GPU results:
tests/test_gpu_decode_rows.py."""

import pytest
import torch

from flashtile.backends.triton import decode_rows
from test_kvcache import _run_and_check, make_case

CASES = {
    "ragged_append": dict(s_new=2),
    "read_only_int_len": dict(s_new=0, seqlens=20),
    "full_cache": dict(s_new=0, seqlens=None),
    "empty_rows": dict(s_new=0, seqlens=0),
}


@pytest.fixture
def rows_calls(monkeypatch):
    """The interpreter on 16-key tiles, 3 splits; a list that records the heads of every row-stream launch."""
    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_CFG", "16,4,2")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_SPLITS", "3")
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["heads"]), real(*a, **k))[1])
    return calls


@pytest.fixture
def launched(monkeypatch):
    """A list that records the kernel of every launch the row-kernel host code makes."""
    calls = []
    real = decode_rows.launch
    monkeypatch.setattr(decode_rows, "launch", lambda kernel, *a, **k: (calls.append(kernel), real(kernel, *a, **k))[1])
    return calls


@pytest.fixture
def combines(monkeypatch):
    """A list that records every launch of the combine kernel (the split merge when not fused)."""
    from flashtile.backends.triton import decode

    calls = []
    real = decode.combine
    monkeypatch.setattr(decode, "combine", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("heads, fused", [(1, "0"), (2, "1"), (4, "0")])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(rows_calls, combines, monkeypatch, heads, fused, name):
    from flashtile.backends.triton import decode

    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", str(heads))
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", "0")  # the split kernel (stream-K: the test below)
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_FUSED", fused)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, **CASES[name])
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [heads]
    # the merge ran where asked: in the kernel (its counters back at zero for the next call) or the combine kernel
    assert combines == ([] if fused == "1" else [1])
    if fused == "1":
        assert all(int(c.abs().sum()) == 0 for c in decode._COUNTERS.values())


@pytest.mark.parametrize("splits, fused", [("1", "0"), ("2", "0"), ("2", "1")])
def test_splits_of_several_tiles(rows_calls, monkeypatch, splits, fused):
    # 16-key tiles, rows of up to 110 keys in one or two splits: full tiles (the unmasked loop and its pointer
    # steps) then a partial one
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "2")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", "0")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_SPLITS", splits)
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_FUSED", fused)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=110, s_new=1)
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [2]


def test_uncovered_calls_keep_the_default_kernels(rows_calls, monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "4")
    q, kc, vc, args = make_case(dtype=torch.float16, h=6, h_k=2, d=16, cap=40, s_new=1)  # 4 does not divide 2
    _run_and_check(q, kc, vc, args)
    # pages smaller than a 16-key tile (a tile would span pages)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, page=8, s_new=1)
    _run_and_check(q, kc, vc, args)
    assert rows_calls == []


@pytest.mark.parametrize("page", [16, 32, 48])  # a tile a page; two; three (not a power of two)
@pytest.mark.parametrize("name", ["ragged_append", "read_only_int_len", "empty_rows"])
def test_paged_caches(rows_calls, combines, monkeypatch, page, name):
    """Pages of whole 16-key tiles, scattered in the pool: each tile's page comes from the block table; keys
    appended through the table first."""
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "4")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_SPLITS", "2")
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=100, page=page, **CASES[name])
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [4] and combines == [1]


def test_paged_caches_take_the_split_kernel_under_stream_k(rows_calls, launched, monkeypatch):
    """Stream-K reads contiguous caches only: a paged call with FLASHTILE_DECODE_ROWS_STREAMK=1 runs the split
    kernel."""
    from flashtile.kernels.decode_rows import _decode_rows_kernel

    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "4")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", "1")
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=64, page=32, s_new=1)
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [4] and launched == [_decode_rows_kernel]


@pytest.mark.parametrize("programs", ["1", "5", "100", ""])  # one for all; units across programs; more than tiles
# ragged rows, rows without keys, none at all, and a long row among short ones (5 programs: its 5 segments pass the
# 4 fixed slots a unit, so the merge reads the overflow slots)
@pytest.mark.parametrize("lens", [[40, 30, 0], [0, 40, 17], [1, 0, 40], [0, 0, 0], [160, 1, 0]])
@pytest.mark.parametrize("s_new", [0, 1])
def test_stream_k_shares_every_unit_among_the_programs(rows_calls, combines, launched, monkeypatch, programs, lens,
                                                         s_new):
    """FLASHTILE_DECODE_ROWS_STREAMK=1: the programs take equal runs of all units' key tiles end to end; a unit's
    segments meet again in the stream-K merge kernel (not the combine kernel), whatever the program count; units
    without keys get a zero output and +inf lse."""
    from flashtile.kernels import decode_rows_streamk

    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "4")  # all 4 kv heads a unit: 3 units, a row each
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_PROGRAMS", programs)
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=max(40, *lens), s_new=s_new)
    args["cache_seqlens"] = (torch.tensor(lens, dtype=torch.int32) - s_new).clamp_(min=0)  # rows without keys too
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [4] and combines == []
    assert launched == [decode_rows_streamk._rows_streamk_kernel, decode_rows_streamk._rows_streamk_combine]


def test_knobs_are_checked(monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "3")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROWS"):
        decode_rows.requested()
    for bad in ("16,4", "24,4,3", "16,x,3"):
        monkeypatch.setenv("FLASHTILE_DECODE_ROWS_CFG", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROWS_CFG"):
            decode_rows.config(8)
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    assert decode_rows.requested() is None  # the rule
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "0")
    assert decode_rows.requested() == 0


def test_rule_takes_long_caches_on_large_batches():
    rule = dict(arch="sm90", h_k=8, d=128, num_splits=0, sms=132)
    # contiguous caches: 4 heads a program where those programs fill the SMs once (b = 32: 64 units x 2 splits;
    # b = 64: 128 units unsplit), the whole row elsewhere
    assert decode_rows.by_rule(b=32, capacity=65536, **rule) == 4
    assert decode_rows.by_rule(b=32, capacity=131072, **rule) == 4
    assert decode_rows.by_rule(b=32, capacity=32768, **rule) == 0  # the per-head kernel was faster there
    assert decode_rows.by_rule(b=64, capacity=8192, **rule) == 4
    assert decode_rows.by_rule(b=64, capacity=4096, **rule) == 0  # unmeasured
    assert decode_rows.by_rule(b=128, capacity=8192, **rule) == 8  # 256 narrow programs: two waves
    assert decode_rows.by_rule(b=48, capacity=65536, **rule) == 8  # 96 narrow programs: 36 SMs idle
    assert decode_rows.by_rule(b=40, capacity=65536, **rule) == 8  # 80 units x 2 splits: 160 programs
    # b = 16: whole rows (8 splits) lost at every length; half rows (32 units x 4 splits) win from 128k only
    assert decode_rows.by_rule(b=16, capacity=131072, **rule) == 4
    assert decode_rows.by_rule(b=16, capacity=262144, **rule) == 4
    assert decode_rows.by_rule(b=16, capacity=65536, **rule) == 0
    assert decode_rows.by_rule(b=8, capacity=131072, **rule) == 0  # 16 units x 8 splits: unmeasured as a rule
    assert decode_rows.by_rule(b=20, capacity=131072, **rule) == 0  # 40 units x 3 splits: 120 programs, 12 SMs idle
    assert decode_rows.by_rule(b=24, capacity=131072, **rule) == 0  # 48 units x 3 splits: 144 programs, two waves
    for b in (21, 22, 31):  # their half rows fill the SMs once too, but unmeasured: NARROW_RULE_BOUNDS stops below 1.0
        assert decode_rows.by_rule(b=b, capacity=131072, **rule) == 0
    # only the measured shape: Hopper, 8 kv heads of d = 128, the heuristic's split count
    assert decode_rows.by_rule(b=32, capacity=65536, **dict(rule, arch="default")) == 0
    assert decode_rows.by_rule(b=32, capacity=65536, **dict(rule, arch="interpret")) == 0
    assert decode_rows.by_rule(b=64, capacity=65536, **dict(rule, h_k=4)) == 0
    assert decode_rows.by_rule(b=32, capacity=65536, **dict(rule, d=64)) == 0
    assert decode_rows.by_rule(b=32, capacity=65536, **dict(rule, num_splits=1)) == 0
    # fewer SMs: the same batch is more programs an SM
    assert decode_rows.by_rule(b=16, capacity=65536, **dict(rule, sms=66)) == 4  # 32 units x 2 splits on 66 SMs
    # paged caches (against the per-head paged kernel): from 8k keys at b = 32, at b = 16 on 16-key pages only, never
    # at b = 8
    for page in (16, 64, 256):
        assert decode_rows.by_rule(b=32, capacity=8192, page_size=page, **rule) == 8
        assert decode_rows.by_rule(b=32, capacity=4096, page_size=page, **rule) == 0
        assert decode_rows.by_rule(b=8, capacity=131072, page_size=page, **rule) == 0
        assert decode_rows.by_rule(b=16, capacity=131072, page_size=page, **rule) == (8 if page == 16 else 0)


def test_h100_rule_at_b32():
    """An H100's contiguous caches (session 34, lease C34): b = 32 below 96k keys on another kernel (the Gluon
    kernel's rule), whole rows from 96k, never half rows; every other grid (measured on H200s only) and paged caches
    as on an H200."""
    rule = dict(arch="sm90", h_k=8, d=128, num_splits=0, sms=132)
    h100 = dict(rule, h100=True)
    assert decode_rows.by_rule(b=32, capacity=65536, **h100) == 0
    assert decode_rows.by_rule(b=32, capacity=98303, **h100) == 0
    assert decode_rows.by_rule(b=32, capacity=98304, **h100) == 8
    assert decode_rows.by_rule(b=32, capacity=131072, **h100) == 8
    assert decode_rows.by_rule(b=32, capacity=131072, **rule) == 4  # the H200's half rows
    for kw in (dict(b=64, capacity=8192), dict(b=16, capacity=131072), dict(b=32, capacity=65536, page_size=256),
               dict(b=32, capacity=65536, page_size=16), dict(b=8, capacity=131072), dict(b=33, capacity=131072),
               dict(b=48, capacity=65536), dict(b=62, capacity=98304), dict(b=31, capacity=131072)):
        assert decode_rows.by_rule(**kw, **h100) == decode_rows.by_rule(**kw, **rule), kw
    assert decode_rows.by_rule(b=64, capacity=8192, **h100) == 4
    assert decode_rows.by_rule(b=48, capacity=65536, **h100) == 8  # the H200's whole rows: unmeasured on an H100
    assert decode_rows.by_rule(b=32, capacity=131072, **dict(h100, arch="default")) == 0


def test_the_rule_is_wired_into_the_decode_path(rows_calls, monkeypatch):
    from flashtile.backends.triton import decode

    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    monkeypatch.setattr(decode_rows, "RULE_BOUNDS", ((0.0, 0),))  # every grid and cache
    q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args)
    assert rows_calls == []  # the interpreter is not Hopper: the rule keeps the default kernels
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    _run_and_check(q, kc, vc, args)
    assert rows_calls == [4]  # a contiguous cache whose 4-head programs fill the SMs once (split 33 ways here)
    # an explicit split count keeps the default kernels
    _run_and_check(q, kc, vc, args, num_splits=2)
    assert rows_calls == [4]
    # paged caches too, whole rows, with pages of whole tiles (the CPU tests' 16-key tiles); smaller pages keep the
    # default
    monkeypatch.setattr(decode_rows, "SMALL_PAGE_RULE_BOUNDS", ((0.0, 0),))
    for page, taken in ((16, [4, 8]), (8, [4, 8])):
        q, kc, vc, args = make_case(dtype=torch.float16, h=16, h_k=8, d=128, cap=40, s_new=1, page=page)
        _run_and_check(q, kc, vc, args)
        assert rows_calls == taken


def test_paged_launches_keep_three_buffers(monkeypatch):
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS_CFG", raising=False)
    assert decode_rows.config(8) == (16, 8, 3)
    assert decode_rows.config(8, paged=True) == (16, 8, 4)  # a third buffer of K and V: faster on pages only
    assert decode_rows.launch_stages(4, paged=True) == 7 and decode_rows.launch_stages(4, paged=False) == 4
    assert decode_rows.config(4) == (32, 4, 3)  # one program an SM (session 28)
    assert decode_rows.config(4, paged=True) == (16, 4, 3)  # pages of 16 keys stay whole tiles
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_CFG", "32,4,2")
    assert decode_rows.config(8, paged=True) == (32, 4, 2)


def test_splits_fill_the_program_slots(monkeypatch):
    from flashtile.backends.triton.decode import MAX_SPLITS

    monkeypatch.delenv("FLASHTILE_DECODE_ROWS_SPLITS", raising=False)
    # 8 heads, 16-key tiles at d = 128: 64 KB a stage, three stages, one program an SM; b = 32 on 132 SMs
    assert decode_rows.num_splits(32, 64 * 1024, 3, 132, key_blocks=8192) == 4
    # 4 heads: 32 KB a stage, two programs an SM; b = 32 with two head groups
    assert decode_rows.num_splits(64, 32 * 1024, 3, 132, key_blocks=8192) == 4
    # one program: at most one split a key block, and never more than MAX_SPLITS
    assert decode_rows.num_splits(1, 8 * 1024, 3, 132, key_blocks=5) == 5
    assert decode_rows.num_splits(1, 8 * 1024, 3, 132, key_blocks=10**6) == MAX_SPLITS
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_SPLITS", "0")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROWS_SPLITS"):
        decode_rows.num_splits(1, 8 * 1024, 3, 132, key_blocks=5)



@pytest.mark.parametrize("route", [
    dict(FLASHTILE_DECODE_ROWS="0"),  # the per-head split kernel
    dict(FLASHTILE_DECODE_ROWS="2", FLASHTILE_DECODE_ROWS_STREAMK="0"),
    dict(FLASHTILE_DECODE_ROWS="4", FLASHTILE_DECODE_ROWS_STREAMK="1"),
], ids=["per_head", "rows", "stream_k"])
@pytest.mark.parametrize("knob", ["0", "1"])
def test_lengths_evict_last_knob(rows_calls, monkeypatch, route, knob):
    """FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1 builds each decode kernel with its lengths' load marked evict_last
    (decode_rows.seqlens_policy; the sm_90 compile test checks the PTX); results equal the oracle's either way, and
    without the knob (or without a lengths tensor) no launch names the policy."""
    from flashtile.backends.triton import decode

    for name, value in route.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLASHTILE_DECODE_SEQLENS_EVICT_LAST", knob)
    policies = {}
    for module in (decode, decode_rows):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda kernel, *a, real=real, **k: (
            policies.setdefault(kernel.fn.__name__, k.get("SEQLENS_POLICY")), real(kernel, *a, **k))[1])
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args)
    kernels = {"0": "_decode_kernel", "2": "_decode_rows_kernel", "4": "_rows_streamk_kernel"}
    kernel = kernels[route["FLASHTILE_DECODE_ROWS"]]
    assert policies[kernel] == ("evict_last" if knob == "1" else None), policies
    assert all(p is None for name, p in policies.items() if name != kernel), policies  # merges read no lengths first
    assert decode_rows.seqlens_policy(None) == {}  # no lengths tensor: nothing to keep
