"""GPU tests of the by-page gather for small pages (Route.pages_per_tile, on for power-of-two pages smaller than the
key tile): against the reference, and bit for bit against the per-key gather, at the launch configs the GPU picks
(128-, 64- and, at d = 256, 32-key tiles)."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton.decode import split
from spies import patch_routes, record_launch_meta
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("b,cap,page,s_new,rotary,d", [(1, 8192, 16, 0, False, 128), (2, 5000, 16, 1, True, 128),
                                                       (40, 2048, 16, 1, False, 128), (3, 3000, 1, 2, False, 64),
                                                       (4, 4096, 16, 0, False, 256)])
def test_gather_by_page(monkeypatch, b, cap, page, s_new, rotary, d):
    metas = record_launch_meta(monkeypatch, split, split._decode_kernel)
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, d, cap, torch.bfloat16, page=page, rotary=rotary, seed=b)
    _check(q, kc, vc, kw, causal=True)
    assert metas[-1]["PAGES_PER_TILE"] > 0
    outs = [flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw)]
    with monkeypatch.context() as m:
        patch_routes(m, pages_per_tile=0)
        outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw))
    assert metas[-1]["PAGES_PER_TILE"] == 0
    assert all(torch.equal(x, y) for x, y in zip(*outs)), "by-page and per-key gathers differ"
