"""Context parallelism on real gloo process groups (world sizes 2 and 4), against flash_attn_func.

Each world size is spawned once; its workers run every case of tests/distributed_cases.py and report
the largest differences per rank, which the tests below check case by case. Inputs are fp64 on the CPU
path, where the distributed schedule and the single-process call differ only by summation order; fp32
cases are held to FlashAttention's bar (twice flash_attn_func's own fp32 error against fp64, 3x for
gradients, tests/tolerance.py).
"""

from __future__ import annotations

import json
import time

import pytest
import torch.multiprocessing as mp

from distributed_cases import CASES, worker

ATOL = 1e-9
FA_ATOL = 1e-5  # tests/tolerance.py's slack


def _spawn(world: int, tmp_path) -> dict:
    ctx = mp.spawn(worker, args=(world, str(tmp_path)), nprocs=world, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"world {world}: workers did not finish in 240 s (a hang in the exchange?)")
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, tmp_path_factory.mktemp("cp4"))


def _check(results: dict, case) -> None:
    for rank, per_case in results.items():
        got = per_case[case.name]
        assert "crashed" not in got, f"rank {rank}: {got['crashed']}"
        if case.raises:
            assert case.raises in got.get("raised", ""), f"rank {rank}: expected an error with {case.raises!r}: {got}"
            continue
        assert "raised" not in got, f"rank {rank}: {got['raised']}"
        bad = {name: errs for name, errs in got.items() if not errs[0] <= _bar(name, errs)}
        assert not bad, f"rank {rank}: max |ours - flash_attn_func| above the bar: {bad}"


def _bar(name: str, errs: list) -> float:
    """fp64: ATOL; fp32 (errs = [ours, flash_attn_func's own]): FlashAttention's 2x rule, 3x for gradients."""
    if len(errs) == 1:
        return ATOL
    return (2 if name in ("out", "lse") else 3) * errs[1] + FA_ATOL


@pytest.mark.parametrize("case", CASES[2], ids=lambda c: c.name)
def test_world2(world2, case):
    _check(world2, case)


@pytest.mark.parametrize("case", CASES[4], ids=lambda c: c.name)
def test_world4(world4, case):
    _check(world4, case)
