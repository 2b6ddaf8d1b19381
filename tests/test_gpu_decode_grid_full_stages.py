"""GPU tests of the pipeline depth of grids of more than one wave (backends/triton/decode.py
grid_full_stages; on by default for sm_90 since session 12): unsplit launches of more programs (b * kv
heads * query-row blocks) than SMs take 2 stages on a contiguous cache in the measured shape. They must
match the reference with descriptor and pointer loads, with and without appended keys (by the separate append
kernel, the default, and by the decode kernel itself, FUSED_APPEND) and rotary, and
equal the table's 3-stage launch bit for bit with either load (the same tiles in the same order; only
the pipeline's depth differs). 8 warps with 2 stages (b = 32 from 32k) run in
test_gpu_decode_long_warps.py's b = 32 case. In gpu_check.sh tests-kv."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as launcher
from spies import record_launch_meta
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9  # as the launcher's _arch reads it


@pytest.mark.parametrize("fused_append", [False, True])
@pytest.mark.parametrize("tma", [None, False])  # None: the default rule (descriptor loads at these lengths)
@pytest.mark.parametrize("cap,s_new,rotary", [(4096, 0, False), (5000, 1, True), (2048, 2, False)])
def test_two_stages_against_reference(monkeypatch, tma, cap, s_new, rotary, fused_append):
    monkeypatch.setattr(launcher, "FUSED_APPEND", fused_append)
    monkeypatch.delenv("FLASHTILE_DECODE_STAGES", raising=False)
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", tma)
    metas = record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, cap, torch.bfloat16, rotary=rotary)
    _check(q, kc, vc, kw, causal=True)
    assert len(metas) == 1
    if _sm90():
        assert metas[0]["num_stages"] == launcher.GRID_FULL_STAGES


@pytest.mark.parametrize("tma", [None, False])
@pytest.mark.parametrize("s_new", [0, 1])
def test_two_stages_bitwise_equal_to_three(monkeypatch, tma, s_new):
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", tma)
    metas = record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, 4096, torch.bfloat16, seed=3)
    outs = []
    for stages in ("", "3"):
        if stages:
            monkeypatch.setenv("FLASHTILE_DECODE_STAGES", stages)
        else:
            monkeypatch.delenv("FLASHTILE_DECODE_STAGES", raising=False)
        outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw))
    table = launcher.decode_config("sm90" if _sm90() else "default", 128)[2]
    assert [m["num_stages"] for m in metas] == [2 if _sm90() else table, 3]
    (o2, l2), (o3, l3) = outs
    assert torch.equal(o2, o3) and torch.equal(l2, l3)
