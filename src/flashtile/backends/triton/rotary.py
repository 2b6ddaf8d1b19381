"""Launcher of the rotary kernel: output allocation, strides, grid and block sizes."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.host import cdiv, device_guard, next_pow2, run_kernel
from flashtile.kernels.rotary import _rotary_kernel, rotary_config


def rotary_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offsets, cu_seqlens,
               max_seqlen: int | None, interleaved: bool, inplace: bool, conjugate: bool) -> torch.Tensor:
    """Rotate x (b, s, h, d) or varlen (total, h, d); returns x itself when ``inplace``.

    cos/sin: (seqlen_ro, rotary_dim / 2); seqlen_offsets: int or int32 (b,) tensor. Arguments are
    already checked by the caller (``flashtile.layers.rotary``).
    """
    rotary_dim = 2 * cos.shape[1]
    d = x.shape[-1]
    out = x if inplace else torch.empty_like(x)
    if not inplace and rotary_dim < d:
        # the untouched tail is a plain copy: torch does it at memory speed, the kernel skips it
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    if x.numel() == 0:
        return out
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    varlen = cu_seqlens is not None
    if varlen:
        batch = cu_seqlens.numel() - 1
        seqlen = int(max_seqlen)
        nheads = x.shape[1]
        sx = (0, x.stride(0), x.stride(1))
        so = (0, out.stride(0), out.stride(1))
    else:
        batch, seqlen, nheads = x.shape[0], x.shape[1], x.shape[2]
        sx = (x.stride(0), x.stride(1), x.stride(2))
        so = (out.stride(0), out.stride(1), out.stride(2))
    if x.stride(-1) != 1:
        raise ValueError("flashtile: rotary kernel needs a contiguous last dim of x")
    if out.stride(-1) != 1:
        raise ValueError("flashtile: rotary kernel needs a contiguous last dim of out")
    block_m, num_warps = rotary_config(rotary_dim)
    block_m = config.get().rotary_block_m or block_m
    block_k = next_pow2(max(rotary_dim // 2, 1))
    offsets_is_tensor = isinstance(seqlen_offsets, torch.Tensor)
    dummy = cos  # never read: the matching HAS_/IS_ flag is off
    m_blocks = cdiv(max(seqlen, 1), block_m)
    grid = (m_blocks * nheads * batch,)  # flat: axes 1 and 2 would cap batch * heads at 65535
    if grid[0] == 0:
        return out
    with device_guard(x):
        run_kernel(_rotary_kernel, grid,
            x, out, cos, sin,
            cu_seqlens if varlen else dummy,
            seqlen_offsets if offsets_is_tensor else dummy,
            seqlen, cos.shape[0], 0 if offsets_is_tensor else int(seqlen_offsets), nheads, m_blocks,
            *sx, *so, cos.stride(0), sin.stride(0),
            ROTARY_DIM=rotary_dim, BLOCK_M=block_m, BLOCK_K=block_k,
            INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=varlen,
            HAS_OFFSET_TENSOR=offsets_is_tensor, num_warps=num_warps,
        )
    return out
