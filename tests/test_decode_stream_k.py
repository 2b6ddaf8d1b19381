"""The stream-K split of the decode kernel (FLASHTILE_DECODE_STREAM_K=1, an experiment, off by default):
its plan on the host, checked by simulating the programs' runs, and its results in the interpreter
against the independent oracle of test_kvcache.py and against the ordinary split launch.

The interpreter cases shrink the GPU to a few SMs (``num_sms`` patched) and allow runs of one key block,
so that small caches give programs that end one row and start the next, rows whose partials come from
three programs, and slots that no program takes (filled with empty partials by the row's last program).
"""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from flashtile.kvcache import flash_attn_with_kvcache
from test_kvcache import CASES, _run_and_check, make_case


def _segments(rows: int, key_blocks: int, programs: int, run: int):
    """What the kernel's program loop does: (program, row, slot, first block, end block) of every segment."""
    for p in range(programs):
        g, g_end = p * run, min(p * run + run, rows * key_blocks)
        for row in range(g // key_blocks, -(-g_end // key_blocks)):
            start = row * key_blocks
            yield p, row, p - start // run, max(g - start, 0), min(g_end - start, key_blocks)


def test_plan_off_by_default_and_switch_checked(monkeypatch):
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", None)
    monkeypatch.delenv("FLASHTILE_DECODE_STREAM_K", raising=False)
    assert launcher.stream_k_plan(64, 512, 2, 132) is None
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "1")
    assert launcher.stream_k_plan(64, 512, 2, 132) == (132, 249, 4)  # b = 8, 64k: 249 blocks a program
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "0")
    assert launcher.stream_k_plan(64, 512, 2, 132) is None
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_STREAM_K"):
        launcher.stream_k_plan(64, 512, 2, 132)


def test_plan_applies_to_one_wave_split_grids_only(monkeypatch):
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", True)
    assert launcher.stream_k_plan(64, 512, 1, 132) is None  # unsplit
    assert launcher.stream_k_plan(64, 512, 3, 132) is None  # more than one wave
    assert launcher.stream_k_plan(8, 64, 16, 132) is None  # runs of 4 blocks: below STREAM_K_MIN_RUN
    assert launcher.stream_k_plan(64, 128, 2, 132) == (131, 63, 4)  # b = 8, 16k


@pytest.mark.parametrize("rows,key_blocks,sms", [(64, 512, 132), (64, 128, 132), (6, 5, 13), (7, 9, 20),
                                                 (3, 40, 11), (5, 17, 16), (40, 1024, 132)])
def test_plan_covers_every_block_once(monkeypatch, rows, key_blocks, sms):
    """Simulated runs: every row's capacity blocks covered exactly once, in segments whose slots are
    distinct, below the plan's slot count, and numbered from 0 at the row's first block."""
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", True)
    monkeypatch.setattr(launcher, "STREAM_K_MIN_RUN", 1)
    plan = launcher.stream_k_plan(rows, key_blocks, 2, sms)
    assert plan is not None
    programs, run, slots = plan
    assert programs <= sms
    covered = {r: [] for r in range(rows)}
    for _, row, slot, lo, hi in _segments(rows, key_blocks, programs, run):
        assert 0 <= slot < slots and 0 <= lo < hi <= key_blocks
        covered[row].append((lo, hi, slot))
    for segs in covered.values():
        segs.sort()
        assert segs[0][0] == 0 and segs[0][2] == 0 and segs[-1][1] == key_blocks
        assert all(a[1] == b[0] and b[2] == a[2] + 1 for a, b in zip(segs, segs[1:]))


@pytest.fixture
def stream_k(monkeypatch):
    """The interpreter's kernels on a 13-SM GPU with stream-K on: the tests' 3 x 2 rows of 5 blocks (cap 70,
    16-key tiles) take the heuristic's 2 splits, which stream-K replaces by 10 programs of 3 blocks and
    3 slots a row. Yields the list of (grid, STREAM_K) of every decode launch."""
    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (16, 4, 1))
    monkeypatch.setattr(launcher, "MAX_BLOCK_M", 16)
    monkeypatch.setattr(launcher, "num_sms", lambda device: 13)
    monkeypatch.setattr(launcher, "STREAM_K_MIN_RUN", 1)
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", True)
    seen = []
    real = launcher.launch

    def record(kernel, grid, *args, **meta):
        if kernel is launcher._decode_kernel:
            seen.append((grid, meta.get("STREAM_K", False), meta["NUM_SPLITS"]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher, "launch", record)
    return seen


@pytest.mark.parametrize("name", ["append_rows", "paged_3", "paged_16", "window", "rotary_half_full_local", "leftpad",
                                  "causal_prefill", "read_only_full_cache", "empty_rows", "batch_idx"])
def test_stream_k_against_oracle_and_split(stream_k, monkeypatch, name):
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    out, lse, kcache = _run_and_check(q, kc, vc, args)
    assert stream_k and all(on for _, on, _ in stream_k), stream_k
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", False)
    ref_out, ref_lse, ref_kcache = _run_and_check(q, kc, vc, args)
    assert not stream_k[-1][1]
    assert (out - ref_out).abs().max().item() <= 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert not fin.any() or (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-5
    assert torch.equal(kcache, ref_kcache)


def test_stream_k_launch_shape(stream_k):
    """The launch stream-K makes for the 6 rows of 5 blocks on 13 SMs: 10 programs, 3 slots a row."""
    q, kc, vc, args = make_case(cap=70, s_new=0, seqlens=None)
    flash_attn_with_kvcache(q, kc, vc, **args)
    assert stream_k == [((10,), True, 3)]


def test_stream_k_fills_the_slots_no_program_takes(stream_k, monkeypatch):
    """NaN in the partial buffers before the launch: the slots no program takes must be overwritten with
    empty partials, or the merge would turn them into NaN output."""
    real = launcher.launch  # the fixture's recorder

    def poison_then_launch(kernel, grid, *args, **meta):
        if kernel is launcher._decode_kernel:
            args[5].fill_(float("nan"))  # O_PART
            args[6].fill_(float("nan"))  # LSE_PART
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher, "launch", poison_then_launch)
    q, kc, vc, args = make_case(cap=70, s_new=1, seqlens=60, causal=True)
    _run_and_check(q, kc, vc, args)
    assert stream_k == [((10,), True, 3)]


def test_caller_num_splits_keeps_the_split_launch(stream_k):
    q, kc, vc, args = make_case(cap=70, s_new=0, seqlens=None)
    flash_attn_with_kvcache(q, kc, vc, num_splits=2, **args)
    assert stream_k == [((12,), False, 2)]
