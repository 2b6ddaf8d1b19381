"""Launcher of the Gluon Hopper forward kernel (experimental, not wired into dispatch).

``gluon_attn_fwd(q, k, v, softmax_scale, causal) -> (out, lse)`` with FlashAttention's layout:
q, k, v (batch, seqlen, heads, head_dim) bf16, out likewise, lse (batch, heads, seqlen) fp32 in
natural log. See docs/gluon.md for what the kernel does and does not cover.
"""

from __future__ import annotations

import math

import torch

from flashtile.backends.triton.host import capability, cdiv, device_guard

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)


def _check_tma(name: str, x: torch.Tensor) -> None:
    """TMA reads through a descriptor: unit last stride, 16-byte aligned base and other strides."""
    es = x.element_size()
    if x.stride(-1) != 1:
        raise ValueError(f"gluon_attn_fwd: {name} needs a unit stride in its last (head_dim) dimension")
    if x.data_ptr() % 16 or any((s * es) % 16 for s in x.stride()[:-1]):
        raise ValueError(f"gluon_attn_fwd: {name} needs a 16-byte aligned base and strides (TMA), got strides "
                         f"{tuple(x.stride())}")


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    # what the inputs are first, where they live second: the former is checkable without a GPU
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"gluon_attn_fwd: {name} must be a torch.Tensor")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"gluon_attn_fwd: bf16 only, {name} is {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"gluon_attn_fwd: {name} must be (batch, seqlen, heads, head_dim), got {tuple(x.shape)}")
    b, sq, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"gluon_attn_fwd: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    bk, sk, h_k, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"gluon_attn_fwd: q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head_dim")
    if sq != sk:
        raise ValueError(f"gluon_attn_fwd: needs seqlen_q == seqlen_k, got {sq} and {sk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"gluon_attn_fwd: head_dim must be one of {HEAD_DIMS}, got {d}")
    if h_k == 0 or h % h_k:
        raise ValueError(f"gluon_attn_fwd: heads of q ({h}) must be a multiple of heads of k/v ({h_k})")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"gluon_attn_fwd: CUDA tensors only, {name} is on {x.device}")
    if q.device != k.device or q.device != v.device:
        raise ValueError("gluon_attn_fwd: q, k, v must be on one device")
    major_minor = capability(q.device)
    if major_minor != (9, 0):
        # wgmma exists on sm_90(a) only: Blackwell dropped it for tcgen05, Ampere never had it
        raise ValueError(f"gluon_attn_fwd: needs a Hopper GPU (sm_90), got sm_{major_minor[0]}{major_minor[1]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tma(name, x)


def _descriptor(x: torch.Tensor, rows: int):
    import triton.experimental.gluon.language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, rows, 1, x.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on Hopper through the Gluon kernel; returns (out, lse).

    Raises ValueError for what the kernel does not cover: non-CUDA or non-bf16 tensors, head_dim
    other than 64 / 128, seqlen_q != seqlen_k, a GPU other than sm_90, TMA-unfriendly strides.
    """
    _validate(q, k, v)
    b, s, h, d = q.shape
    h_k = k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse

    from flashtile.kernels.gluon_fwd import _gluon_attn_fwd_kernel, fwd_config

    cfg = fwd_config(d, causal)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (cdiv(s, bm), b * h)
    with device_guard(q):
        _gluon_attn_fwd_kernel[grid](
            _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(out, bm),
            lse, lse.stride(0), lse.stride(1), s, h, h // h_k, softmax_scale * LOG2E,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
            num_warps=cfg["num_warps"])
    return out, lse
