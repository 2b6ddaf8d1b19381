"""Launcher of the fp8 (e4m3) forward kernel: V^T (view or copy), allocation, strides, descriptors, grid, config."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.host import arch_of, cdiv, device_guard, launch, next_pow2
from flashtile.backends.triton.tma import descriptors_wanted
from flashtile.backends.triton.tma import row_descriptor as _descriptor
from flashtile.fp8 import transpose_v, v_keys_major  # noqa: F401  (transpose_v: tests and scripts import it here)
from flashtile.kernels.attn_fwd_fp8 import _attn_fwd_fp8_kernel, fwd_fp8_config
from flashtile.params import AttnParams

LOG2E = 1.4426950408889634


def _vt_descriptor(vt: torch.Tensor, block_n: int, block_d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(vt, list(vt.shape), list(vt.stride()), [1, 1, block_d, block_n])


def unsupported_fp8_feature(q, v, p: AttnParams) -> str | None:
    """The issue-48 feature of this call the fp8 kernel lacks (its V^T tiles share q/k's head dim, and its
    softmax has no sink or chunk mask), named as the API argument; None if there is none."""
    if v.shape[-1] != q.shape[-1]:
        return "head dim of v different from q/k's (dv != d)"
    if p.learnable_sink is not None:
        return "learnable_sink"
    if p.attention_chunk > 0:
        return "attention_chunk"
    return None


def attn_fwd_fp8(q, k, v, p: AttnParams):
    """fp8 forward on e4m3 q (b, sq, h, d) / (total_q, h, d); returns (out bf16, lse fp32, None)."""
    with device_guard(q):  # Triton launches on the current device: make it q's
        return _attn_fwd_fp8(q, k, v, p)


def _attn_fwd_fp8(q, k, v, p: AttnParams):
    if p.dropout_p > 0:
        raise ValueError("flashtile: the fp8 forward has no dropout (dropout_p must be 0)")
    unsupported = unsupported_fp8_feature(q, v, p)
    if unsupported:
        raise ValueError(f"flashtile: the fp8 forward has no {unsupported} (the bf16/fp16 kernels have it)")
    d = q.shape[-1]
    h, h_k = q.shape[-2], k.shape[-2]
    block_d = max(32, next_pow2(d))  # fp8 dots need a reduction dim >= 32
    settings = config.get()
    block_m, block_n, num_warps, num_stages = settings.fp8_tiles or fwd_fp8_config(arch_of(q.device), block_d,
                                                                                   p.causal)
    out = torch.empty(*q.shape[:-1], v.shape[-1], device=q.device, dtype=torch.bfloat16)
    if p.varlen:
        b = p.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = p.max_seqlen_q, p.max_seqlen_k
        # rows cut off by seqused_q are never visited by the kernel: they keep out 0 / lse +inf
        if p.seqused_q is not None:
            lse = torch.full((h, q.shape[0]), float("inf"), device=q.device, dtype=torch.float32)
            out.zero_()
        else:
            lse = torch.empty(h, q.shape[0], device=q.device, dtype=torch.float32)
        sq_b, sq_m, sq_h = 0, q.stride(0), q.stride(1)
        sk_b, sk_n, sk_h = 0, k.stride(0), k.stride(1)
        so_b, so_m, so_h = 0, out.stride(0), out.stride(1)
        lse_b, lse_h = 0, lse.stride(0)
    else:
        b, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        lse = torch.empty(b, h, seqlen_q, device=q.device, dtype=torch.float32)
        sq_b, sq_m, sq_h = q.stride(0), q.stride(1), q.stride(2)
        sk_b, sk_n, sk_h = k.stride(0), k.stride(1), k.stride(2)
        so_b, so_m, so_h = out.stride(0), out.stride(1), out.stride(2)
        lse_b, lse_h = lse.stride(0), lse.stride(1)
    if b * h == 0 or seqlen_q == 0:
        return out, lse, None
    vt = v_keys_major(v, p.varlen)  # a view for quantize_qkv's layout, a copy otherwise
    svt_b, svt_h, svt_d = (0, *vt.stride()[:2]) if p.varlen else vt.stride()[:3]

    # descriptors need 16-byte strides: with 1-byte elements, d % 16 == 0 (config.tma cannot lift that)
    tma = descriptors_wanted(q, k, vt)
    if tma:
        desc_q = _descriptor(q, block_m, block_d)
        desc_k = _descriptor(k, block_n, block_d)
        # varlen V^T is read through pointers (see _load_vt_tile)
        desc_vt = vt if p.varlen else _vt_descriptor(vt, block_n, block_d)
    else:
        desc_q, desc_k, desc_vt = q, k, vt

    qk_scale = p.softmax_scale / p.softcap if p.softcap > 0 else p.softmax_scale * LOG2E
    descales = [x.contiguous() if x is not None else None for x in (p.q_descale, p.k_descale, p.v_descale)]
    alibi = p.alibi_slopes
    alibi_stride_b = 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0)
    dummy = lse
    grid = (cdiv(max(seqlen_q, 1), block_m) * b * h,)  # flat: b * h may exceed grid y's 65535
    launch(
        _attn_fwd_fp8_kernel, grid,
        q, k, vt, out, lse, desc_q, desc_k, desc_vt,
        p.cu_seqlens_q if p.varlen else dummy, p.cu_seqlens_k if p.varlen else dummy,
        p.seqused_q if p.seqused_q is not None else dummy,
        p.seqused_k if p.seqused_k is not None else dummy,
        alibi if alibi is not None else dummy,
        *(x if x is not None else dummy for x in descales),
        qk_scale, p.softcap, p.window_left, p.window_right,
        seqlen_q, seqlen_k, h, h // h_k,
        sq_b, sq_m, sq_h, sk_b, sk_n, sk_h, svt_b, svt_h, svt_d, so_b, so_m, so_h,
        lse_b, lse_h, alibi_stride_b,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IS_VARLEN=p.varlen, HAS_SEQUSED_Q=p.seqused_q is not None, HAS_SEQUSED_K=p.seqused_k is not None,
        HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, HAS_SOFTCAP=p.softcap > 0,
        HAS_ALIBI=alibi is not None, HAS_Q_DESCALE=descales[0] is not None,
        HAS_K_DESCALE=descales[1] is not None, HAS_V_DESCALE=descales[2] is not None,
        USE_TMA=tma, SOFT_ROUND_P=q.device.type == "cpu", HEAVY_FIRST=settings.heavy_first,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse, None
