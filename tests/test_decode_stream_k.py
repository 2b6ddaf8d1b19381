"""The stream-K split of the decode kernel (FLASHTILE_DECODE_STREAM_K=G, an experiment, off by default):
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


def _segments(rows: int, key_blocks: int, programs: int, run: int, group: int = 1, m_blocks: int = 1):
    """What the kernel's program loop does: (program, row, slot, first block, end block) of every segment,
    ``row`` the per-kv-head row (b * kv heads + kv head) * m_blocks + pid_m."""
    for p in range(programs):
        stream, h_in = divmod(p, group)
        g, g_end = stream * run, min(stream * run + run, rows // group * key_blocks)
        for group_row in range(g // key_blocks, -(-g_end // key_blocks)):
            start = group_row * key_blocks
            bg, pid_m = divmod(group_row, m_blocks)
            row = (bg * group + h_in) * m_blocks + pid_m
            yield p, row, stream - start // run, max(g - start, 0), min(g_end - start, key_blocks)


def test_plan_off_by_default_and_switch_checked(monkeypatch):
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", None)
    monkeypatch.delenv("FLASHTILE_DECODE_STREAM_K", raising=False)
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) is None
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "1")
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) == (132, 249, 4, 1)  # b = 8, 64k: 249 blocks a program
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "4")  # 33 streams of 4 kv heads in lockstep
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) == (132, 249, 4, 4)
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "8")  # 16 streams of 8: the 2-split launch's runs
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) == (128, 256, 3, 8)
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "3")  # does not divide the 8 kv heads
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) is None
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "0")
    assert launcher.stream_k_plan(64, 512, 2, 132, 8) is None
    monkeypatch.setenv("FLASHTILE_DECODE_STREAM_K", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_STREAM_K"):
        launcher.stream_k_plan(64, 512, 2, 132, 8)


def test_plan_applies_to_one_wave_grids_only(monkeypatch):
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", 1)
    assert launcher.stream_k_plan(64, 512, 1, 132) == (132, 249, 4, 1)  # unsplit grids of one wave too
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", 8)  # b = 32, 8k at 2 stages: 264 slots, 33 streams
    assert launcher.stream_k_plan(256, 64, 1, 264, 8) == (264, 63, 3, 8)
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", 1)
    assert launcher.stream_k_plan(64, 512, 3, 132) is None  # more than one wave
    assert launcher.stream_k_plan(8, 64, 16, 132) is None  # runs of 4 blocks: below STREAM_K_MIN_RUN
    assert launcher.stream_k_plan(64, 128, 2, 132) == (131, 63, 4, 1)  # b = 8, 16k


@pytest.mark.parametrize("rows,key_blocks,sms,group,m_blocks", [
    (64, 512, 132, 1, 1), (64, 128, 132, 1, 1), (6, 5, 13, 1, 1), (7, 9, 20, 1, 1), (3, 40, 11, 1, 1),
    (5, 17, 16, 1, 1), (40, 1024, 132, 1, 1), (64, 512, 132, 4, 1), (64, 512, 132, 2, 1), (64, 512, 132, 8, 1),
    (16, 5, 40, 2, 2), (24, 7, 50, 4, 3), (8, 9, 17, 4, 1)])
def test_plan_covers_every_block_once(monkeypatch, rows, key_blocks, sms, group, m_blocks):
    """Simulated runs: every row's capacity blocks covered exactly once, in segments whose slots are
    distinct, below the plan's slot count, and numbered from 0 at the row's first block."""
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", group)
    monkeypatch.setattr(launcher, "STREAM_K_MIN_RUN", 1)
    plan = launcher.stream_k_plan(rows, key_blocks, 2, sms, group * 2)
    assert plan is not None
    programs, run, slots, g = plan
    assert programs <= sms and g == group and programs % group == 0
    covered = {r: [] for r in range(rows)}
    for _, row, slot, lo, hi in _segments(rows, key_blocks, programs, run, group, m_blocks):
        assert 0 <= slot < slots and 0 <= lo < hi <= key_blocks
        covered[row].append((lo, hi, slot))
    for segs in covered.values():
        segs.sort()
        assert segs[0][0] == 0 and segs[0][2] == 0 and segs[-1][1] == key_blocks
        assert all(a[1] == b[0] and b[2] == a[2] + 1 for a, b in zip(segs, segs[1:]))


class Launches(list):
    group: int


@pytest.fixture(params=[1, 2], ids=["G1", "G2"])
def stream_k(monkeypatch, request):
    """The interpreter's kernels on a 13-SM GPU with stream-K on: the tests' 3 x 2 rows of 5 blocks (cap 70,
    16-key tiles) take the heuristic's 2 splits, which stream-K replaces by 10 programs of 3 blocks and
    3 slots a row (G = 1: 10 streams; G = 2, both kv heads in lockstep: 5 streams of 2 programs). Yields the
    list of (grid, STREAM_K, NUM_SPLITS) of every decode launch; ``.group`` is G."""
    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (16, 4, 1))
    monkeypatch.setattr(launcher, "MAX_BLOCK_M", 16)
    monkeypatch.setattr(launcher, "num_sms", lambda device: 13)
    monkeypatch.setattr(launcher, "STREAM_K_MIN_RUN", 1)
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", request.param)
    seen = Launches()
    seen.group = request.param
    real = launcher.launch

    def record(kernel, grid, *args, **meta):
        if kernel is launcher._decode_kernel:
            seen.append((grid, meta.get("STREAM_K", 0), meta["NUM_SPLITS"]))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher, "launch", record)
    return seen


@pytest.mark.parametrize("name", ["append_rows", "paged_3", "paged_16", "window", "rotary_half_full_local", "leftpad",
                                  "causal_prefill", "read_only_full_cache", "empty_rows", "batch_idx"])
def test_stream_k_against_oracle_and_split(stream_k, monkeypatch, name):
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    out, lse, kcache = _run_and_check(q, kc, vc, args)
    assert stream_k and all(on == stream_k.group for _, on, _ in stream_k), stream_k
    monkeypatch.setattr(launcher, "STREAM_K_OVERRIDE", 0)
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
    assert stream_k == [((10,), stream_k.group, 3)]


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
    assert stream_k == [((10,), stream_k.group, 3)]


def test_caller_num_splits_keeps_the_split_launch(stream_k):
    q, kc, vc, args = make_case(cap=70, s_new=0, seqlens=None)
    flash_attn_with_kvcache(q, kc, vc, num_splits=2, **args)
    assert stream_k == [((12,), 0, 2)]
