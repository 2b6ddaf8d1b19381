"""GPU tests of the long-program warp count (route.LONG_PROGRAM_WARPS: sm_90 split-kernel programs of at least 256
key blocks take 8 warps): with every route's warps set to 8, so that these small caches run as long programs do,
launches must match the reference, with and without appended keys, split or not."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton.decode import split
from spies import patch_routes, record_launch_meta
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,cap,num_splits,s_new,rotary", [(32, 4096, 0, 0, False), (8, 8192, 1, 1, True),
                                                           (3, 5000, 4, 2, False), (1, 8192, 0, 1, True)])
def test_eight_warps_against_reference(monkeypatch, b, cap, num_splits, s_new, rotary):
    patch_routes(monkeypatch, warps=8)
    metas = record_launch_meta(monkeypatch, split, split._decode_kernel)
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, cap, torch.bfloat16, rotary=rotary)
    # the programs the rule targets (>= 256 blocks) take pointer loads by default; these short ones would take
    # descriptor loads, so pin pointer loads to test the path that would run
    with config.override(tma=False):
        _check(q, kc, vc, kw, causal=True, num_splits=num_splits)
    assert [m["num_warps"] for m in metas] == [8]
