"""Test setup: the CPU suite runs the Triton kernels through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, at collection, on
machines without a GPU. Kernel tests then opt in per test with FLASHTILE_INTERPRET=1.
"""

import os
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.sh runs these)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_triton_tiles(monkeypatch):
    """The Triton forward and backward kernels through the interpreter, on 16 x 16 tiles (tiny odd
    shapes then cross both the masked and the unmasked block paths)."""
    from flashtile import config

    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")  # read by dispatch.interpret_requested
    with config.override(interpret=True, fwd_tiles=(16, 16, 4, 1), bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        yield


@pytest.fixture
def decode_interp(monkeypatch):
    """The decode kernel through the interpreter on a tiny config (16-key tiles, 16-row query blocks),
    and the keywords of every decode launch, recorded and forwarded to the real launch."""
    from flashtile.backends.triton import decode as launcher
    from spies import record_launch_meta

    monkeypatch.setenv("FLASHTILE_INTERPRET", "1")
    monkeypatch.setattr(launcher, "CONFIG_OVERRIDE", (16, 4, 1))
    monkeypatch.setattr(launcher, "MAX_BLOCK_M", 16)
    return record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)


@pytest.fixture(autouse=True)
def _normal_board(monkeypatch):
    # The decode rules' tests assert the normal boards' routes: the board class is pinned (backends/triton/board.py)
    # unless the run sets it; tests of the measurement itself unset it.
    if "FLASHTILE_DECODE_BOARD" not in os.environ:
        monkeypatch.setenv("FLASHTILE_DECODE_BOARD", "normal")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible draw per test: never the same inputs everywhere.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
    if "gpu" in request.node.keywords and torch.cuda.is_available() and torch.cuda.is_initialized():
        try:  # a kernel fault is sticky: it must be charged to this test, not to every later one
            torch.cuda.synchronize()
        except Exception as e:
            sys.stderr.write(f"\n{request.node.nodeid}: CUDA error after the test: {e}\n")
            if os.environ.get("PYTEST_XDIST_WORKER"):
                os._exit(3)  # xdist reports the crash against this test and starts a fresh worker
            raise
        torch.cuda.empty_cache()  # hand cached blocks back: eight xdist workers share one GPU's memory
