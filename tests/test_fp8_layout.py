"""V's layout for the fp8 kernels: quantize_qkv stores keys contiguously, v_keys_major reads it free.

Hopper's fp8 matrix instruction reads V^T (keys contiguous). A natural (b, s, h_k, d) V costs a full
transposing copy per call; quantize_qkv's output is already laid out so the kernels take a view.
"""

import pytest
import torch

from flashtile.fp8 import quantize, quantize_qkv, transpose_v, v_keys_major


def test_quantize_qkv_stores_v_keys_contiguous_with_the_same_values():
    q, k, v = (torch.randn(2, 37, 4, 64) for _ in range(3))
    _, _, v8, _, _, vd = quantize_qkv(q, k, v)
    ref8, ref_d = quantize(v, 4)
    assert v8.shape == v.shape and v8.stride(1) == 1
    assert torch.equal(v8.float(), ref8.float()) and torch.equal(vd, ref_d)
    vt = v_keys_major(v8, varlen=False)
    assert vt.data_ptr() == v8.data_ptr(), "quantize_qkv's layout must be read without a copy"
    assert vt.shape == (2, 4, 64, 37) and torch.equal(vt.float(), v8.float().permute(0, 2, 3, 1))


def test_natural_layout_is_copied_transposed():
    v8 = torch.randn(2, 37, 4, 64).to(torch.float8_e4m3fn)
    vt = v_keys_major(v8, varlen=False)
    assert vt.data_ptr() != v8.data_ptr()
    assert vt.stride(-1) == 1 and vt.stride(-2) % 16 == 0  # key dim padded to 16 for TMA
    assert torch.equal(vt.float(), v8.float().permute(0, 2, 3, 1))


def test_varlen_layout():
    total, cu = 50, torch.tensor([0, 20, 50], dtype=torch.int32)
    q, k, v = (torch.randn(total, 4, 32) for _ in range(3))
    _, _, v8, _, _, _ = quantize_qkv(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert v8.shape == v.shape and v8.stride(0) == 1
    vt = v_keys_major(v8, varlen=True)
    assert vt.data_ptr() == v8.data_ptr() and torch.equal(vt.float(), v8.float().permute(1, 2, 0))
    assert torch.equal(transpose_v(v8, varlen=True).float(), vt.float())


def test_public_fp8_call_reads_quantize_qkv_v_without_copying(monkeypatch, interpret):
    # the API must neither make V's head dim contiguous nor transpose it: both would copy V per call
    import flashtile
    from flashtile import config, fp8


    def no_copy(v, varlen):
        raise AssertionError("V was copied")

    q, k, v = (torch.randn(1, 40, 2, 32) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    with config.override(interpret=True, fp8_tiles=(16, 32, 4, 1)):
        expect = flashtile.flash_attn_func(q8, k8, v8.contiguous(), q_descale=qd, k_descale=kd, v_descale=vd)
        monkeypatch.setattr(fp8, "transpose_v", no_copy)
        out = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        assert torch.equal(out, expect)
        # and the check has teeth: a natural-layout V does go through the copy
        with pytest.raises(AssertionError, match="V was copied"):
            flashtile.flash_attn_func(q8, k8, v8.contiguous(), q_descale=qd, k_descale=kd, v_descale=vd)
