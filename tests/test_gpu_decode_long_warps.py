"""GPU tests of the long-program warp count (FLASHTILE_DECODE_LONG_WARPS, backends/triton/decode.py
long_program_warps; on by default for sm_90 programs of at least 256 key blocks since session 11): with
the threshold lowered so these small caches count as long, 8-warp launches must match the reference,
with and without appended keys (by the separate append kernel, the default, and by the decode kernel itself,
FUSED_APPEND), split or not. In gpu_check.sh tests-kv, and alone as
tests-decode-long-warps."""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from spies import record_launch_meta
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,cap,num_splits,s_new,rotary", [(32, 4096, 0, 0, False), (8, 8192, 1, 1, True),
                                                           (3, 5000, 4, 2, False), (1, 8192, 0, 1, True)])
@pytest.mark.parametrize("fused_append", [False, True])
def test_eight_warps_against_reference(monkeypatch, b, cap, num_splits, s_new, rotary, fused_append):
    monkeypatch.setattr(launcher, "FUSED_APPEND", fused_append)
    monkeypatch.setattr(launcher, "LONG_PROGRAM_BLOCKS", 1)
    # the programs the rule targets (>= 256 blocks) take pointer loads by default; these short
    # ones would take descriptor loads, so pin pointer loads to test the path that would run
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", False)
    monkeypatch.setenv("FLASHTILE_DECODE_LONG_WARPS", "8")
    metas = record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, cap, torch.bfloat16, rotary=rotary)
    _check(q, kc, vc, kw, causal=True, num_splits=num_splits)
    assert [m["num_warps"] for m in metas] == [8]
