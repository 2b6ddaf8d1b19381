"""The Gluon MLA decode kernel (kernels/gluon_decode_mla.py) on an sm_90 GPU: DeepSeek's shape (64 rope dims,
512 latent dims, one latent head) through flash_attn_with_kvcache against the reference with FlashAttention's
bar, contiguous and paged, split and not, several causal query tokens; the same calls with FLASHTILE_GLUON off
(the Triton MLA kernel) agree; a cache holding NaN past each row's length changes nothing."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import gluon_mla
from test_gpu_kvcache_mla import _check, _inputs

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture
def gluon_calls(monkeypatch):
    calls = []
    real = gluon_mla.decode

    def spy(*args, **kwargs):
        calls.append(args[4])  # the split count
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_mla, "decode", spy)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon MLA kernel is sm_90's")
    return calls


@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("page", [None, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("cap", [1000, 4096])
def test_matches_reference(gluon_calls, h, page, num_splits, cap):
    q, kc, vc, kw = _inputs(3, 1, 1, h, cap, torch.bfloat16, page=page, seed=h + cap)
    _check(q, kc, vc, kw, num_splits=num_splits)
    assert gluon_calls == [num_splits]


@pytest.mark.parametrize("sq", [2, 4])
def test_speculative_tokens_causal(gluon_calls, sq):
    q, kc, vc, kw = _inputs(2, sq, sq, 128, 2048, torch.float16, page=64)
    _check(q, kc, vc, kw, causal=True)
    _check(q, kc, vc, kw, causal=False)
    assert len(gluon_calls) == 2


@pytest.mark.parametrize("page", [None, 64])
def test_agrees_with_the_triton_kernel_and_ignores_nan_past_the_lengths(gluon_calls, page):
    q, kc, vc, kw = _inputs(4, 1, 0, 128, 3000, torch.bfloat16, page=page, seed=7)
    out = flash_attn_with_kvcache(q, kc, vc, **kw)
    with config.override(gluon=False):
        triton_out = flash_attn_with_kvcache(q, kc, vc, **kw)
    assert len(gluon_calls) == 1
    assert (out.float() - triton_out.float()).abs().max().item() <= 2e-2
    if page is None:  # a contiguous cache: every slot past a row's length becomes NaN
        lens = kw["cache_seqlens"]
        past = torch.arange(kc.shape[1], device=DEV)[None, :] >= lens[:, None]
        kc[past], vc[past] = float("nan"), float("nan")
        again = flash_attn_with_kvcache(q, kc, vc, **kw)
        assert torch.equal(again, out)
