"""GPU tests of the pipeline depth of grids of more than one wave (route.GRID_FULL_STAGES): unsplit split-kernel
launches of more programs (b * kv heads * query-row blocks) than SMs take 2 stages on a contiguous cache in the
measured shape (sm_90). They must match the reference with descriptor and pointer loads, with and without appended
keys and rotary, and equal the table's 3-stage launch bit for bit with either load (the same tiles in the same
order; only the pipeline's depth differs). 8 warps with 2 stages (b = 32 from 32k) run in
test_gpu_decode_long_warps.py's b = 32 case."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import route, split
from spies import patch_routes, record_launch_meta
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9  # as route.arch reads it


@pytest.mark.parametrize("tma", [None, False])  # None: the default rule (descriptor loads at these lengths)
@pytest.mark.parametrize("cap,s_new,rotary", [(4096, 0, False), (5000, 1, True), (2048, 2, False)])
def test_two_stages_against_reference(monkeypatch, tma, cap, s_new, rotary):
    metas = record_launch_meta(monkeypatch, split, split._decode_kernel)
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, cap, torch.bfloat16, rotary=rotary)
    with config.override(tma=tma):
        _check(q, kc, vc, kw, causal=True)
    assert len(metas) == 1
    if _sm90():
        assert metas[0]["num_stages"] == route.GRID_FULL_STAGES


@pytest.mark.parametrize("tma", [None, False])
@pytest.mark.parametrize("s_new", [0, 1])
def test_two_stages_bitwise_equal_to_three(monkeypatch, tma, s_new):
    metas = record_launch_meta(monkeypatch, split, split._decode_kernel)
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, 4096, torch.bfloat16, seed=3)
    outs = []
    with config.override(tma=tma):
        outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw))
        with monkeypatch.context() as m:
            patch_routes(m, stages=3)
            outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True,
                                                **kw))
    table = route.decode_config("sm90" if _sm90() else "default", 128)[2]
    assert [m["num_stages"] for m in metas] == [2 if _sm90() else table, 3]
    (o2, l2), (o3, l3) = outs
    assert torch.equal(o2, o3) and torch.equal(l2, l3)
