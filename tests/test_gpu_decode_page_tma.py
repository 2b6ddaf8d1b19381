"""GPU tests of per-page descriptor loads for small pages (FLASHTILE_DECODE_PAGE_TMA=1, an experiment:
backends/triton/decode.py use_page_tma, kernels/decode.py _decode_inner_pages): against the reference and
close to the by-page gather (the default; the softmax steps in another order, so not bit for bit), at
the launch configs the GPU picks (128-key tiles of 16- and 32-token pages, 64-key tiles at b = 40, d = 64
and 256), with a fused append, rotary, splits, and NaN in every pool slot outside a row's pages with the
table padded by -1. Run alone: gpu_check.sh tests-decode-page-tma."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import decode as launcher
from spies import record_launch_meta
from test_gpu_kvcache import _assert_paths_close, _check, _check_pages_outside_rows_never_read, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]  # an experiment: run alone, not in the gpu suite


@pytest.mark.parametrize("b,cap,page,s_new,rotary,d", [(1, 8192, 16, 0, False, 128), (2, 5000, 16, 1, True, 128),
                                                       (40, 2048, 16, 1, False, 128), (3, 3000, 32, 2, False, 64),
                                                       (4, 4096, 16, 0, False, 256), (8, 8192, 16, 0, False, 128)])
def test_page_tma(monkeypatch, b, cap, page, s_new, rotary, d):
    metas = record_launch_meta(monkeypatch, launcher, launcher._decode_kernel)
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, d, cap, torch.bfloat16, page=page, rotary=rotary, seed=b)
    monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", True)
    _check(q, kc, vc, kw, causal=True)
    assert metas[-1].get("PAGE_TMA") is True
    outs = []
    for on in (False, True):
        monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", on)
        outs.append(flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, return_softmax_lse=True, **kw))
        assert (metas[-1].get("PAGE_TMA") is True) is on
    _assert_paths_close(outs)


def test_page_tma_never_reads_outside_the_rows_pages(monkeypatch):
    monkeypatch.setattr(launcher, "PAGE_TMA_OVERRIDE", True)
    _check_pages_outside_rows_never_read()
