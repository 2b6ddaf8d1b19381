"""flex_attention's kernel_options (FlexAttention's keys): the tile keys reach the three flex kernels' launches
(forward, dK/dV, dQ) and the results still match the float64 reference under the interpreter; plain keys
apply to both passes and fwd_ / bwd_ ones to one; FlexAttention's other keys are accepted; unknown or
misplaced keys and invalid values raise errors that name them."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import host
from flashtile.flex import create_block_mask, flex_attention
from flashtile.flex.options import tiles
from flashtile.kernels.flex_bwd import _flex_bwd_dkdv_kernel, _flex_bwd_dq_kernel
from flashtile.kernels.flex_fwd import _flex_fwd_kernel
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close

B, H, L, S, E = 1, 2, 37, 45, 16


def _record(monkeypatch) -> dict:
    """Each flex kernel's launch keywords (BLOCK_M, num_warps, ...), by kernel, recorded and forwarded."""
    metas, real = {}, host.launch
    names = {_flex_fwd_kernel: "fwd", _flex_bwd_dkdv_kernel: "dkdv", _flex_bwd_dq_kernel: "dq"}

    def record(kernel, grid, *args, **meta):
        if kernel in names:
            metas[names[kernel]] = meta
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(host, "launch", record)
    return metas


def test_tiles_reach_the_kernels_and_results_hold(monkeypatch):
    var = variants(B, H, L, S)
    variant = var["alibi"]  # a score_mod under a causal block mask: partial and full blocks, ragged ends
    mask = create_block_mask(variant[1], None, None, L, S, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(B, H, n, E).requires_grad_() for n in (L, S, S))
    opts = {"BLOCK_M": 32, "BLOCK_N": 16, "fwd_num_warps": 2, "num_stages": 2, "bwd_BLOCK_M1": 16, "BLOCK_N1": 32,
            "BLOCK_M2": 32, "bwd_BLOCK_N2": 16, "bwd_num_warps": 8, "PRESCALE_QK": False, "BACKEND": "TRITON"}
    metas = _record(monkeypatch)
    with config.override(interpret=True):  # the interpreter's own table: 16 x 16 tiles, 4 warps, 1 stage
        out = flex_attention(q, k, v, score_mod=variant[0], block_mask=mask, kernel_options=opts)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    picked = {name: (m["BLOCK_M"], m["BLOCK_N"], m["num_warps"], m["num_stages"]) for name, m in metas.items()}
    assert picked == {"fwd": (32, 16, 2, 2), "dkdv": (16, 32, 8, 2), "dq": (32, 16, 8, 2)}
    ref, _ = dense_reference(q, k, v, variant, var["_meta"])
    pt, _ = dense_reference(q, k, v, variant, var["_meta"], dtype=torch.float32)
    assert_fa_close(out, ref, pt)
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), g.double()),
                             torch.autograd.grad(pt, (q, k, v), g)):
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=name)


def test_plain_keys_apply_to_both_passes_and_prefixed_ones_to_one():
    # (fwd BLOCK_M, BLOCK_N, warps, stages), (dK/dV BLOCK_M1, BLOCK_N1, ...), (dQ BLOCK_M2, BLOCK_N2, ...)
    got = tiles({"num_warps": 8, "bwd_num_warps": 4, "BLOCK_M": 64, "fwd_num_stages": 3, "BLOCK_N2": 32}, (128, 128))
    assert got == (64, 0, 8, 3, 0, 0, 4, 0, 0, 32, 4, 0)
    assert tiles(None, (128, 128)) == tiles({"USE_TMA": True, "WRITE_DQ": False}, (128, 128)) == (0,) * 12


@pytest.mark.parametrize("opts, match", [
    ({"BLOCK_K": 64}, "unknown kernel_options key 'BLOCK_K'"),
    ({"BLOCK_M": 24}, r"kernel_options\['BLOCK_M'\] must be a power of two"),
    ({"bwd_BLOCK_N1": 8}, r"kernel_options\['bwd_BLOCK_N1'\] must be a power of two"),
    ({"BLOCK_N": 256}, r"kernel_options\['BLOCK_N'\] = 256 must divide the block mask's KV block size 128"),
    ({"BLOCK_M": 64.0}, r"kernel_options\['BLOCK_M'\] must be an int"),
    ({"num_warps": 3}, r"kernel_options\['num_warps'\]"),
    ({"fwd_num_stages": 0}, r"kernel_options\['fwd_num_stages'\] must be >= 1"),
    ({"fwd_BLOCK_M1": 32}, r"kernel_options\['fwd_BLOCK_M1'\]: the forward has no BLOCK_M1"),
    ({"bwd_BLOCK_N": 32}, r"kernel_options\['bwd_BLOCK_N'\]: the backward has no BLOCK_N"),
    ({"PRESCALE_QK": 1}, r"kernel_options\['PRESCALE_QK'\] must be a bool"),
    ({"BACKEND": "CUDNN"}, r"kernel_options\['BACKEND'\] = 'CUDNN'"),
    ({"OUTPUT_LOGSUMEXP": True}, "set by flex_attention itself"),
])
def test_invalid_options_raise_naming_the_key(opts, match):
    q, k, v = (torch.randn(B, H, n, E) for n in (L, S, S))
    with pytest.raises(ValueError, match=match):
        flex_attention(q, k, v, kernel_options=opts)


def test_kernel_options_must_be_a_dict():
    q = torch.randn(B, H, L, E)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        flex_attention(q, q, q, kernel_options=[("BLOCK_M", 32)])
