"""The Gluon paged-decode launcher (backends/triton/gluon_decode.py), on CPU with the kernel launch
recorded instead of run: every argument lands on the kernel parameter of its name, with the strides of
the tensor it describes, the partial buffers when the keys are split, and the merge after them."""

import math

import pytest
import torch

from flashtile.backends.triton import decode as triton_launcher
from flashtile.backends.triton import gluon_decode as launcher


@pytest.mark.parametrize("num_splits", [1, 3])
def test_arguments_land_on_their_parameters(monkeypatch, num_splits):
    pytest.importorskip("triton.experimental.gluon")
    from flashtile.kernels.gluon_decode_paged import _gluon_paged_decode_kernel as kernel

    calls, merges = [], []
    monkeypatch.setattr(launcher, "run_kernel", lambda k, grid, *args, **meta: calls.append((k, grid, args, meta)))
    monkeypatch.setattr(triton_launcher, "combine", lambda *a, **k: merges.append(a))
    b, h, h_k, d, page = 2, 32, 8, 128, 16
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)
    pool = torch.randn(80, page, h_k, d, dtype=torch.bfloat16)
    table = torch.arange(80, dtype=torch.int32).view(b, 40)  # 640 keys a row: 5 key blocks, room for 3 splits
    lens = torch.tensor([100, 7], dtype=torch.int32)
    out, lse = launcher.gluon_paged_decode(q, pool, pool, s_new=1, cache_seqlens=lens, block_table=table,
                                           softmax_scale=0.125, num_splits=num_splits)
    assert out.shape == q.shape and lse.shape == (b, h, 1)
    (k, grid, args, meta), = calls
    assert k is kernel and grid == (b * h_k * num_splits,)
    named = dict(zip([n for n in kernel.arg_names if n not in meta], args))
    assert named["Q"] is q and named["O"] is out and named["LSE"] is lse
    assert named["SEQLENS"] is lens and named["BLOCK_TABLE"] is table
    assert math.isclose(named["qk_scale"], 0.125 * launcher.LOG2E)
    assert (named["s_new"], named["num_kv_heads"], named["group"], named["n_table"], named["n_pages"]) == (
        1, h_k, h // h_k, 40, 80)
    assert (named["stride_qb"], named["stride_qh"]) == (q.stride(0), q.stride(2))
    assert (named["stride_ob"], named["stride_oh"]) == (out.stride(0), out.stride(2))
    assert (named["stride_lse_b"], named["stride_lse_h"]) == (lse.stride(0), lse.stride(1))
    assert named["stride_bt_b"] == table.stride(0)
    for desc in (named["desc_k"], named["desc_v"]):
        assert desc.shape == [80 * page, h_k * d] and desc.block_shape == [page, d]
    assert meta["NUM_SPLITS"] == num_splits and meta["PAGE"] == page and meta["HEAD_DIM"] == d
    assert "launch_pdl" not in meta and "USE_PDL" not in meta  # CPU tensors: no programmatic dependent launch
    if num_splits == 1:
        assert named["O_PART"] is out and not merges
    else:
        o_part, lse_part = named["O_PART"], named["LSE_PART"]
        assert o_part.shape == (num_splits, b, 1, h, d) and lse_part.shape == (num_splits, b, h, 1)
        assert (named["stride_ops"], named["stride_opb"], named["stride_oph"]) == (
            o_part.stride(0), o_part.stride(1), o_part.stride(3))
        assert (named["stride_lps"], named["stride_lpb"], named["stride_lph"]) == (
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2))
        (m,), = [merges]
        assert m[0] is o_part and m[1] is lse_part and m[2] is out and m[3] is lse


def test_descriptor_equals_the_checked_constructors():
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    pool = torch.randn(6, 16, 4, 64, dtype=torch.float16)
    flat = pool.view(96, 256)
    checked = TensorDescriptor(flat, [96, 256], [256, 1], [16, 64], launcher._layout(16, 64, torch.float16))
    fast = launcher._descriptor(pool)
    for field in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(fast, field) == getattr(checked, field), field
    assert fast.base.data_ptr() == checked.base.data_ptr() and fast.base.shape == checked.base.shape
