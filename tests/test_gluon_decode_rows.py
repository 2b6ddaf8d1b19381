"""The whole-row Gluon decode kernel (kernels/gluon_decode_rows.py, FLASHTILE_DECODE_GLUON_ROWS=1, an experiment)
without a GPU: its sm_90 build (two programs an SM: shared memory and registers), which calls it covers, its split
count, and that asking for it where it cannot run leaves calls to the default kernels with the same results.
GPU results: tests/test_gpu_decode_gluon_rows.py."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtile.backends.triton import decode_gluon_rows
from test_gluon_decode_warp_keys import SM90_SMEM_PER_SM
from test_kvcache import _run_and_check, make_case

TESTS = pathlib.Path(__file__).resolve().parent


def _compile(*args, script="aot_gluon_decode_rows.py") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["PYTHONPATH"] = str(TESTS.parent / "src")
    res = subprocess.run([sys.executable, str(TESTS / script), *map(str, args)],
                         capture_output=True, text=True, env=env, cwd=TESTS, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    f = res.stdout.split()
    return {key: int(val) for key, val in zip(f[::2], f[1::2])}


@pytest.mark.parametrize("heads, d", [(8, 128), (4, 64)])
def test_builds_for_sm90_two_programs_an_sm(heads, d):
    got = _compile(heads, d)
    # two K slots and one V slot of 16 whole rows
    assert got["SHARED"] >= 3 * heads * 16 * d * 2, got
    assert 2 * (got["SHARED"] + 1024) <= SM90_SMEM_PER_SM, got
    assert got["SPILL_STORES"] == 0 and 2 * heads * 32 * got["REGISTERS"] <= 65536, got
    assert got["LDGSTS"] > 0 and got["HMMA"] > 0, got


@pytest.mark.parametrize("heads, d", [(8, 128), (4, 64)])
def test_tma_variant_builds_for_sm90_two_programs_an_sm(heads, d):
    got = _compile(heads, d, 2, 1, script="aot_gluon_decode_rows_tma.py")
    assert got["SHARED"] >= 3 * heads * 16 * d * 2, got  # the default ring: two K tiles and one V tile
    assert 2 * (got["SHARED"] + 1024) <= SM90_SMEM_PER_SM, got
    assert got["SPILL_STORES"] == 0 and 2 * heads * 32 * got["REGISTERS"] <= 65536, got
    # tiles by TMA copies (none by 16-byte copies), MMA operands by ldmatrix
    assert got["LDGSTS"] == 0 and got["UTMALDG"] > 0 and got["LDSM"] > 0 and got["HMMA"] > 0, got


def test_tma_default_ring_builds_for_sm90_one_program_an_sm():
    got = _compile(8, 128, 3, 3, script="aot_gluon_decode_rows_tma.py")
    assert 6 * 8 * 16 * 128 * 2 <= got["SHARED"] <= 227 * 1024, got  # three K and three V tiles fit one program
    assert got["SPILL_STORES"] == 0 and got["UTMALDG"] > 0, got


def test_split_count_knob(monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SPLITS", "33")
    assert decode_gluon_rows.num_splits(32, 131072, 132) == 33
    assert decode_gluon_rows.num_splits(32, 40, 132) == 3  # still at most one a 16-key tile
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SPLITS", "0")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_ROWS_SPLITS"):
        decode_gluon_rows.num_splits(32, 131072, 132)


def test_tma_copies_only_where_a_descriptor_fits(monkeypatch):
    q, kc, vc = _call(cap=64)
    assert decode_gluon_rows.use_tma(kc, vc)
    assert not decode_gluon_rows.use_tma(kc[:, :0], vc[:, :0])  # no keys: a descriptor's dims must be positive
    expanded = kc[:1].expand(32, -1, -1, -1)  # a zero batch stride
    assert not decode_gluon_rows.use_tma(expanded, vc)
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_TMA", "0")
    assert not decode_gluon_rows.use_tma(kc, vc)


def test_a_ring_past_shared_memory_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SLOTS", "4,4")  # 256 KB at h_k = 8, d = 128
    q, kc, vc = _call(cap=64)
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_ROWS_SLOTS=4,4"):
        decode_gluon_rows.gluon_rows_decode(q, kc, vc, cache_seqlens=None, cache_len_const=64, s_new=0,
                                            softmax_scale=1.0, sms=132)


def test_tma_slots_knob(monkeypatch):
    assert decode_gluon_rows.tma_slots() == (3, 3)
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SLOTS", "3,3")
    assert decode_gluon_rows.tma_slots() == (3, 3)
    for bad in ("3", "0,1", "2,x", "9,1"):
        monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS_SLOTS", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_ROWS_SLOTS"):
            decode_gluon_rows.tma_slots()


def _call(b=32, h=32, h_k=8, d=128, cap=64, sq=1, dtype=torch.bfloat16):
    q = torch.empty(b, sq, h, d, dtype=dtype)
    kc = torch.empty(b, cap, h_k, d, dtype=dtype)
    return q, kc, torch.empty_like(kc)


def test_covers():
    q, kc, vc = _call()
    assert decode_gluon_rows.refusal(q, kc, vc, "sm90") is None
    assert "sm_90" in decode_gluon_rows.refusal(q, kc, vc, "default")
    assert "dtype" in decode_gluon_rows.refusal(*_call(dtype=torch.float32), "sm90")
    assert "kv heads" in decode_gluon_rows.refusal(*_call(h=16, h_k=2), "sm90")
    assert "query heads a kv head" in decode_gluon_rows.refusal(*_call(h=128, h_k=8), "sm90")  # group 16
    assert "d = 96" in decode_gluon_rows.refusal(*_call(d=96), "sm90")
    assert "query tokens" in decode_gluon_rows.refusal(*_call(sq=2), "sm90")
    q, kc, vc = _call(cap=65)
    assert decode_gluon_rows.refusal(q, kc[:, 1:], vc[:, 1:], "sm90") is None  # one row in: still aligned
    padded = torch.empty(32, 64, 8, 136, dtype=torch.bfloat16)[..., :128]  # a head stride of 136 elements
    assert "aligned" in decode_gluon_rows.refusal(q, padded, padded, "sm90")


def test_num_splits():
    assert decode_gluon_rows.num_splits(32, 131072, 132) == 8  # 256 programs, two an SM
    assert decode_gluon_rows.num_splits(8, 131072, 132) == 33
    assert decode_gluon_rows.num_splits(1, 131072, 132) == 128  # capped
    assert decode_gluon_rows.num_splits(1, 40, 132) == 3  # one a 16-key tile
    assert decode_gluon_rows.num_splits(512, 131072, 132) == 1


def test_knob_off_the_gpu_keeps_the_default_kernels(monkeypatch):
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS", "1")
    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(decode_gluon_rows, "gluon_rows_decode", lambda *a, **k: calls.append(1))
    q, kc, vc, args = make_case(dtype=torch.float16, h=8, h_k=4, d=16, cap=40, s_new=1)
    _run_and_check(q, kc, vc, args)
    assert calls == []
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_ROWS", "yes")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_GLUON_ROWS"):
        decode_gluon_rows.requested()
