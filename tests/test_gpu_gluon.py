"""GPU tests of the Gluon Hopper forward kernel (needs an sm_90 GPU; skipped elsewhere).

Written before the kernel ever ran on a GPU: a failure here may be the kernel's first contact with
hardware. Correctness bar as everywhere in flashtile (tests/tolerance.py): the error against the
fp32 reference must be within 2x the error of the same computation done by PyTorch in bf16, plus a
small absolute slack; lse within 1e-3 of the reference's.
"""

import math

import pytest
import torch

from flashtile.backends.reference import attention_ref
from tolerance import assert_fa_close, max_err

# "gluon": kept out of gpu_check.sh's `tests` step until it has run once: a wrong barrier phase
# would hang rather than fail, so `gpu_check.sh tests-gluon` runs it alone under a timeout
pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _hopper():
        pytest.skip("the Gluon kernel is sm_90 only (wgmma)")


def _poison():
    """Fill freed allocator blocks with NaN so an output element the kernel never wrote cannot pass."""
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device=DEV)
    del junk


def _check(q, k, v, causal, scale=None):
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _poison()
    out, lse = gluon_attn_fwd(q, k, v, scale, causal)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    pt, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert_fa_close(out, ref, pt)
    assert torch.isfinite(lse).all(), "lse: non-finite values"
    err = (lse - ref_lse.float()).abs().max().item()
    assert err <= 1e-3, f"lse: max err {err:.3e}"
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("s", [128, 1000, 4096])
def test_matches_reference(s, d, causal):
    b, h = 2, 4
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal)


@pytest.mark.parametrize("s", [1, 127, 129, 385])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_lengths(s, causal):
    # one partial block, a block boundary either side, and a ring that wraps (4 blocks > 3 slots)
    q, k, v = (torch.randn(1, s, 2, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal)


def test_agrees_with_sdpa():
    # an independent second opinion on the reference used above
    b, s, h, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out, _ = _check(q, k, v, causal=True)
    f32 = [x.float().transpose(1, 2) for x in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention(*f32, is_causal=True).transpose(1, 2)
    sdpa_bf16 = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                 is_causal=True).transpose(1, 2)
    assert max_err(out, sdpa) <= 2 * max_err(sdpa_bf16, sdpa) + 1e-5


def test_strided_inputs_and_gqa():
    # q, k, v as views of one packed qkv tensor (head strides != d), and 2 query heads per kv head
    b, s, h, h_k, d = 2, 777, 4, 2, 128
    packed = torch.randn(b, s, h + 2 * h_k, d, device=DEV, dtype=torch.bfloat16)
    q, k, v = packed[:, :, :h], packed[:, :, h:h + h_k], packed[:, :, h + h_k:]
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False, scale=0.3)


def test_refuses_misaligned_strides():
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    # 68-element rows: the head stride is 136 bytes, not a multiple of 16, so TMA cannot read it
    q = torch.randn(1, 64, 2, 68, device=DEV, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="16-byte"):
        gluon_attn_fwd(q, q, q, 0.125, False)
