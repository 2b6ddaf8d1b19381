"""The Gluon warps-along-keys decode kernel (kernels/gluon_decode_warp_keys.py; the rule for long unsplit programs on
Hopper, FLASHTILE_DECODE_GLUON_WARP_KEYS forces it on or off) without a GPU: its sm_90 build (shared memory for two
programs an SM, no spills, two CTA barriers in the key loop), which calls it covers and which of those the rule
gives it, and that asking for it on a machine where it cannot run leaves every call to the Triton kernel with
the same results. GPU results:
tests/test_gpu_decode_gluon_warp_keys.py."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtile.backends.triton import decode_gluon
from test_kvcache import CASES, _run_and_check, make_case

TESTS = pathlib.Path(__file__).resolve().parent
SM90_SMEM_PER_SM = 233472  # 228 KiB: two programs an SM need at most half of it each (less 1 KiB reserved)


def _compile(*args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["PYTHONPATH"] = str(TESTS.parent / "src")
    res = subprocess.run([sys.executable, str(TESTS / "aot_gluon_decode.py"), *map(str, args)], capture_output=True,
                         text=True, env=env, cwd=TESTS, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    f = res.stdout.split()
    return {key: int(val) for key, val in zip(f[::2], f[1::2])}


@pytest.mark.parametrize("d, has_seqlens, fused_new, group, early, splits", [
    (128, True, False, 4, False, 1), (64, False, False, 16, False, 1), (128, True, True, 8, False, 1),
    (128, True, False, 4, True, 1), (128, True, True, 8, True, 1), (128, True, False, 4, False, 4),
    (128, False, False, 8, False, 2)])
def test_builds_for_sm90_two_programs_an_sm(d, has_seqlens, fused_new, group, early, splits):
    got = _compile(d, decode_gluon.BLOCK_N, decode_gluon.NUM_BUFFERS, int(has_seqlens), int(fused_new),
                   decode_gluon.merge_rows(group), int(early), splits)
    assert 2 * (got["SHARED"] + 1024) <= SM90_SMEM_PER_SM, got
    assert got["SPILL_STORES"] == 0 and 0 < got["REGISTERS"] <= 255, got
    assert 2 * 128 * got["REGISTERS"] <= 65536, got  # two 128-thread programs in one SM's register file
    assert got["LDGSTS"] > 0 and got["HMMA"] > 0, got  # 16-byte cp.async copies, mma.sync
    assert got["LOOP_BARRIERS"] <= 2, got  # the Triton build has 9 a tile
    # the warps' merge through shared memory: its one barrier (and one the compiler adds), not the 9 that the
    # reductions across the warp axis took (3.3-3.6 us at the end of every program, session 23)
    assert got["TAIL_BARRIERS"] <= 2, got
    # no griddepcontrol but, in a split build, the merge's release (RELEASE_MERGE): launched as an ordinary kernel
    assert got["GDC"] == (1 if splits > 1 else 0), got
    assert got["EVICT_LAST"] == 0, got  # no L2 policy on the lengths' load unless asked for (below)


def test_split_build_keeps_the_lengths_in_l2():
    # FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1 on a split launch: the lengths' load marked evict_last (and it fits as
    # the default split build does)
    got = _compile(128, decode_gluon.BLOCK_N, decode_gluon.NUM_BUFFERS, 1, 0, 4, 0, 4, "evict_last")
    assert got["EVICT_LAST"] >= 1 and got["GDC"] == 1 and got["SPILL_STORES"] == 0, got


GOOD = dict(arch="sm90", dtype=torch.bfloat16, cache_dtype=torch.bfloat16, d=128, sq=1, group=4, paged=False,
            batch_idx=False, leftpad=False, window_left=-1, softcap=0.0, alibi=False, rotary=False, num_splits=0,
            grid_full=True, aligned=True)


def test_rule_takes_the_measured_shape():
    assert decode_gluon.refusal(**GOOD) is None
    assert decode_gluon.refusal(**dict(GOOD, dtype=torch.float16, cache_dtype=torch.float16, d=64, group=16,
                                       num_splits=1)) is None


@pytest.mark.parametrize("change, match", [
    (dict(arch="default"), "sm_90"), (dict(arch="interpret"), "sm_90"),
    (dict(dtype=torch.float32, cache_dtype=torch.float32), "dtype"), (dict(cache_dtype=torch.float16), "dtype"),
    (dict(dtype=torch.float8_e4m3fn, cache_dtype=torch.float8_e4m3fn), "dtype"),
    (dict(d=256), "head_dim"), (dict(d=96), "head_dim"), (dict(sq=2), "query tokens"), (dict(group=17), "query tokens"),
    (dict(paged=True), "paged"), (dict(batch_idx=True), "batch_idx"), (dict(leftpad=True), "leftpad"),
    (dict(window_left=8), "window"), (dict(softcap=2.0), "softcap"), (dict(alibi=True), "ALiBi"),
    (dict(rotary=True), "rotary"), (dict(num_splits=2), "split"), (dict(num_splits=0, grid_full=False), "split"),
    (dict(aligned=False), "aligned"),
])
def test_rule_refuses_what_the_kernel_does_not_compute(change, match):
    why = decode_gluon.refusal(**dict(GOOD, **change))
    assert why is not None and match in why, why


def test_alignment_check():
    x = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    assert decode_gluon.aligned(x)
    assert not decode_gluon.aligned(x[:, :, :, 1:])  # inner stride 1 but rows off 16 bytes
    assert not decode_gluon.aligned(torch.zeros(2, 16, 2, 68, dtype=torch.bfloat16)[..., :64])  # 68-element rows
    # 72-element heads: 16-byte rows, but a stride the JIT does not mark aligned (not a multiple of 16)
    assert not decode_gluon.aligned(torch.zeros(2, 16, 2, 72, dtype=torch.bfloat16)[..., :64])
    assert decode_gluon.aligned(torch.zeros(2, 16, 2, 80, dtype=torch.bfloat16)[..., :64])


@pytest.mark.parametrize("name", ["append_rows", "read_only_int_len", "gqa_8_to_1"])
def test_asked_for_on_cpu_the_triton_kernel_answers(decode_interp, monkeypatch, name):
    # not an sm_90 GPU: the rule refuses, the call runs the Triton kernel (through the interpreter) unchanged
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", "1")
    q, kc, vc, args = make_case(dtype=torch.float32, cap=40, **CASES[name])
    _run_and_check(q, kc, vc, args, num_splits=1)
    assert decode_interp, "the Triton decode kernel did not run"


def test_merge_reads_back_the_group_rows():
    # a power of two of at least 4 (the merge's 4 warps along the rows), at most the kernel's 16 rows
    assert [decode_gluon.merge_rows(g) for g in (1, 2, 3, 4, 5, 8, 9, 16)] == [4, 4, 4, 4, 8, 8, 16, 16]


def test_rule_takes_long_caches_with_two_programs_an_sm():
    cap = decode_gluon.MIN_CAPACITY
    rule = dict(capacity=cap, programs=256, sms=132, d=128)  # b = 32, 8 kv heads on an H200
    assert decode_gluon.by_rule(**rule)
    assert decode_gluon.by_rule(**dict(rule, capacity=8 * cap, programs=512))
    assert not decode_gluon.by_rule(**dict(rule, capacity=cap - 1))  # below 8k unmeasured: the Triton kernel
    assert not decode_gluon.by_rule(**dict(rule, programs=128))  # one program an SM: 17% slower
    assert not decode_gluon.by_rule(**dict(rule, programs=64))  # num_splits=1 on a small grid
    assert not decode_gluon.by_rule(**dict(rule, d=64))  # covered, but unmeasured: half the bytes in flight
    # appending in the kernel it was faster from 8k (since session 23 the bound without appends is the same)
    short = decode_gluon.MIN_CAPACITY_APPENDING
    assert short <= cap
    assert decode_gluon.by_rule(**dict(rule, capacity=short), appends=True)
    assert not decode_gluon.by_rule(**dict(rule, capacity=short - 1), appends=True)


@pytest.fixture
def fake_sm90_route(monkeypatch):
    """The route as on an H200 (arch faked, the kernel and the separate append stubbed, the rule's capacities
    scaled down to CPU-sized caches): returns (route(cap, new=None|"own"|"alias", d=128, b=32), launches, appends)."""
    from flashtile.backends.triton import decode

    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", raising=False)
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    monkeypatch.setattr(decode_gluon, "MIN_CAPACITY", 64)
    monkeypatch.setattr(decode_gluon, "MIN_CAPACITY_APPENDING", 32)
    launches, appends = [], []

    def kernel(q, kc, vc, **kw):
        launches.append(kw)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], 1)

    monkeypatch.setattr(decode_gluon, "gluon_decode", kernel)
    monkeypatch.setattr(decode, "kv_append", lambda *args: appends.append(args[2].shape))

    def route(cap, new=None, d=128, b=32):
        q = torch.zeros(b, 1, 32, d, dtype=torch.bfloat16)
        kc, vc = torch.zeros(b, cap, 8, d, dtype=torch.bfloat16), torch.zeros(b, cap, 8, d, dtype=torch.bfloat16)
        k = v = None
        if new == "own":
            k, v = torch.zeros(b, 1, 8, d, dtype=torch.bfloat16), torch.zeros(b, 1, 8, d, dtype=torch.bfloat16)
        elif new == "alias":
            k, v = kc[:, -1:], vc[:, -1:]
        lens = torch.full((b,), cap // 2, dtype=torch.int32)
        splits = decode_gluon.requested_splits(b * 8, decode.num_sms(q.device), cap)  # as kvcache_fwd asks it
        return decode._gluon_decode_route(q, kc, vc, k, v, None, lens, 0, None, None, None, 0.1, -1, 0.0, None, 0,
                                          0 if k is None else 1, forced=False, splits=splits)

    return route, launches, appends


def test_route_follows_the_rule(fake_sm90_route):
    route, launches, appends = fake_sm90_route
    assert route(64) is not None and launches[-1]["k_new"] is None  # long enough without new keys
    assert route(48) is None  # short without new keys
    assert route(48, "own") is not None and launches[-1]["k_new"] is not None and not appends  # appended inside
    assert route(48, "alias") is None  # aliased keys are appended apart: the bound without appends holds
    assert route(64, "alias") is not None and launches[-1]["k_new"] is None and len(appends) == 1
    assert route(64, d=64) is None and route(64, b=16) is None  # unmeasured d; one program an SM
    assert len(launches) == 3


def test_split_knob_routes_small_grids(fake_sm90_route, monkeypatch):
    # FLASHTILE_DECODE_GLUON_SPLITS=N (an experiment): heuristic calls whose unsplit grid would not fill the GPU run
    # split N ways where the split grid meets the rule; new keys then go through the separate append first
    route, launches, appends = fake_sm90_route
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "4")
    assert route(64, b=8) is not None and launches[-1]["splits"] == 4  # 64 pairs x 4: 256 programs
    assert route(64, "own", b=8) is not None and launches[-1]["k_new"] is None and len(appends) == 1
    assert route(64, b=32) is not None and launches[-1]["splits"] == 1  # a full grid stays unsplit
    assert route(64, b=4) is None  # 32 pairs x 4: one program an SM, not the rule's grid
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "8")
    assert route(64, b=4) is not None and launches[-1]["splits"] == 8
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "0")  # as many as reach the rule's grid (1.9 an SM)
    for b, splits in ((16, 2), (8, 4), (4, 8), (2, 16)):
        assert route(64, b=b) is not None and launches[-1]["splits"] == splits
    assert route(64, b=1) is None  # 8 pairs x 16 (the most): 128 programs, below the rule
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "1")  # never split
    assert route(64, b=8) is None
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_SPLITS")
    assert route(64, b=8) is None  # unset: the split rule, whose shortest cache (32k) this is far below
    for bad in ("17", "four"):
        monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_SPLITS"):
            route(64, b=8)


def test_split_rule(fake_sm90_route, monkeypatch):
    # unset knob: grids below the rule's run split into the fewest powers of two that reach it, at most 8 ways,
    # from the split rule's shortest cache (scaled down here like the unsplit rule's)
    route, launches, appends = fake_sm90_route
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_SPLITS", raising=False)
    monkeypatch.setattr(decode_gluon, "SPLIT_MIN_CAPACITY", 64)
    for b, splits in ((16, 2), (8, 4), (4, 8)):
        assert route(64, b=b) is not None and launches[-1]["splits"] == splits
    assert route(64, "own", b=8) is not None and launches[-1]["k_new"] is None and len(appends) == 1
    assert route(64, b=32) is not None and launches[-1]["splits"] == 1  # a full grid stays unsplit
    assert route(64, b=2) is None and route(64, b=1) is None  # 16 / 32 splits: unmeasured, more than 8
    assert route(48, b=8) is None  # below the split rule's shortest cache
    n = len(launches)
    assert decode_gluon.requested_splits(64, 132, 64) == 4 and decode_gluon.requested_splits(64, 132, 63) is None
    assert decode_gluon.requested_splits(256, 132, 1 << 17) is None and len(launches) == n


def test_split_rule_comes_before_the_row_kernels(monkeypatch):
    # kvcache_fwd asks the split Gluon rule before the whole-row kernels' rule (which takes b = 8, 128k otherwise)
    from flashtile.backends.triton import decode

    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_SPLITS", raising=False)
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", raising=False)
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(decode_gluon, "SPLIT_MIN_CAPACITY", 64)
    calls = []
    monkeypatch.setattr(decode, "_gluon_decode_route", lambda *a, **k: calls.append(a[0].shape[0]) or "gluon")
    q = torch.zeros(8, 1, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(8, 64, 8, 128, dtype=torch.bfloat16)
    lens = torch.full((8,), 10, dtype=torch.int32)
    out = decode.kvcache_fwd(q, kc, kc.clone(), None, None, None, None, lens, 0, None, None, None, 0.1, True, -1, 0,
                             0.0, False, None, 0)
    assert out == "gluon" and calls == [8]
    # a call its kernel refuses goes on to the Triton kernels, without a second ask of the Gluon route
    monkeypatch.setattr(decode, "_gluon_decode_route", lambda *a, **k: calls.append(a[0].shape[0]))
    monkeypatch.setattr(decode, "decode_attn", lambda *a, **k: "triton")
    out = decode.kvcache_fwd(q, kc, kc.clone(), None, None, None, None, lens, 0, None, None, None, 0.1, True, -1, 0,
                             0.0, False, None, 0)
    assert out == "triton" and calls == [8, 8]


def test_split_launch_refuses_its_own_append():
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="append them first"):
        decode_gluon.gluon_decode(q, kc, kc, cache_seqlens=None, cache_len_const=10, s_new=1, softmax_scale=0.1,
                                  k_new=kc[:, :1], v_new=kc[:, :1], splits=2)


def test_knob_value_checked(monkeypatch):
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", raising=False)
    assert decode_gluon.requested() is None  # unset: the rule
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", "1")
    assert decode_gluon.requested() is True
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", "on")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_WARP_KEYS"):
        decode_gluon.requested()
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_WARP_KEYS", "0")
    assert decode_gluon.requested() is False


def test_early_tiles_knob(monkeypatch):
    # the first tile copied before the row's length is read: on by default since session 31, the knob overrides it
    monkeypatch.delenv("FLASHTILE_DECODE_GLUON_EARLY", raising=False)
    assert decode_gluon.early_tiles() is decode_gluon.EARLY_TILES is True
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_EARLY", "0")
    assert decode_gluon.early_tiles() is False
    monkeypatch.setattr(decode_gluon, "EARLY_TILES", False)
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_EARLY", "1")
    assert decode_gluon.early_tiles() is True
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_EARLY", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_EARLY"):
        decode_gluon.early_tiles()
