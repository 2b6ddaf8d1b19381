"""GPU tests of the warp-specialised Gluon forward (kernels/gluon_fwd_ws.py, FLASHTILE_GLUON_WS=1, an experiment of
session 22): a loader warp issues every TMA copy and one consumer warpgroup computes 64 query rows. It must meet the
same bar as the default Gluon kernel (tests/test_gpu_gluon.py's ``_check``: FlashAttention's tolerance rule against
the fp32 reference, lse within 1e-3) for plain and causal calls, ragged lengths (a last tile and a last key block
cut short), GQA and strided views, fp16, every ring it may be given, and through the public API. A wrong barrier
parity hangs rather than fails: gpu_check.sh's tests-gluon-ws runs this file under a timeout."""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.backends.triton import gluon_fwd
from test_gpu_gluon import DEV, _check, _needs_hopper  # noqa: F401 (autouse fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]


@pytest.fixture(autouse=True)
def _ws(monkeypatch):
    monkeypatch.setenv("FLASHTILE_GLUON_WS", "1")
    calls = []
    real = gluon_fwd.gluon_attn_fwd_ws

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_fwd, "gluon_attn_fwd_ws", spy)
    yield calls
    assert calls, "the warp-specialised kernel did not run"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s", [1, 63, 65, 200, 1000, 4096])
def test_matches_reference(s, d, causal):
    q, k, v = (torch.randn(2, s, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128])
def test_fp16_gqa_and_strided_views(d):
    b, s, h, h_k = 2, 777, 4, 2
    packed = torch.randn(b, s, h + 2 * h_k, d, device=DEV, dtype=torch.float16)
    q, k, v = packed[:, :, :h], packed[:, :, h:h + h_k], packed[:, :, h + h_k:]
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False, scale=0.3)


@pytest.mark.parametrize("ring", ["64,32,4", "64,64,5", "64,128,3", "128,128,3", "128,64,4"])
def test_other_rings(monkeypatch, ring):
    monkeypatch.setenv("FLASHTILE_GLUON_WS_CONFIG", ring)
    for causal in (False, True):
        q, k, v = (torch.randn(1, 1500, 2, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        _check(q, k, v, causal)


def test_public_call_takes_it_and_matches_the_default_kernel(monkeypatch):
    from flashtile.backends.triton import gluon_route

    q, k, v = (torch.randn(2, 4096, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.setattr(gluon_route, "OVERRIDE", True)
    out = flash_attn_func(q, k, v, causal=True)
    monkeypatch.setenv("FLASHTILE_GLUON_WS", "0")
    ref = flash_attn_func(q, k, v, causal=True)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
