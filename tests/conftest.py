"""Test setup: the CPU suite runs the Triton kernels through Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is set here, at collection, on
machines without a GPU. Kernel tests then opt in per test through the `interpret` fixture (config.override).
"""

import os
import sys
import zlib

import pytest
import torch

from flashtile import config

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
def interpret():
    """CPU tensors through the Triton kernels in Triton's interpreter, for the test."""
    with config.override(interpret=True) as settings:
        yield settings


@pytest.fixture
def tiny_triton_tiles(interpret):
    """The Triton forward and backward kernels through the interpreter, on 16 x 16 tiles (tiny odd
    shapes then cross both the masked and the unmasked block paths)."""
    from flashtile import config

    with config.override(fwd_tiles=(16, 16, 4, 1), bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        yield


@pytest.fixture
def decode_interp(monkeypatch):
    """The split-KV decode kernel through the interpreter on a tiny config (16-key tiles, 16-row query blocks),
    and the keywords of every such launch, recorded and forwarded to the real launch."""
    from flashtile.backends.triton.decode import split
    from spies import record_launch_meta

    with config.override(interpret=True, decode_tiles=(16, 16, 4, 1)):
        yield record_launch_meta(monkeypatch, split, split._decode_kernel)


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
