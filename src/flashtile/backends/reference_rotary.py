"""Rotary position embeddings in plain PyTorch: the math the rotary layer's CPU path and the KV-cache reference share.

Channel pairs: ``interleaved=False`` (GPT-NeoX) pairs channel ``i`` with ``i + rotary_dim/2``; ``interleaved=True``
(GPT-J) pairs ``2i`` with ``2i+1``. A token at position ``p`` has its pair ``(x0, x1)`` replaced by
``(x0*cos[p] - x1*sin[p], x0*sin[p] + x1*cos[p])``; a position past the table is left unrotated, as the kernels do.
"""

from __future__ import annotations

import torch


def positions(x: torch.Tensor, seqlen_offsets, cu_seqlens) -> torch.Tensor:
    """Position of every token of x: (b, s) for padded x (b, s, h, d), (total,) for varlen x (total, h, d), int64;
    a token's index in its sequence plus ``seqlen_offsets`` (an int or a (b,) tensor)."""
    dev = x.device
    if cu_seqlens is None:
        pos = torch.arange(x.shape[1], device=dev).unsqueeze(0)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=dev, dtype=torch.long).unsqueeze(1)
        return pos + int(seqlen_offsets)
    tokens = torch.arange(x.shape[0], device=dev)
    cu = cu_seqlens.to(torch.long)
    # batch row of each packed token; right=True so a token at cu[i+1] belongs to row i+1
    seq = torch.searchsorted(cu[1:], tokens, right=True).clamp_(max=cu.numel() - 2)
    pos = tokens - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=dev, dtype=torch.long)[seq]
    return pos + int(seqlen_offsets)


def rotate_at_positions(x, cos, sin, positions, interleaved, inplace=False, conjugate=False):
    """Rotate the first ``2 * cos.shape[1]`` channels of x at explicit ``positions``; any device.

    ``positions`` (int64) has x's shape without the last two dims ((b, s) or (total,)) and indexes the
    rows of ``cos``/``sin``; a position past the table is left unrotated. Computes in fp32 (fp64 for
    fp64 inputs) and rounds once to x's dtype, as the kernels do.
    """
    rotary_dim = 2 * cos.shape[1]
    wide = torch.promote_types(x.dtype, torch.float32)
    in_table = positions < cos.shape[0]
    idx = positions.clamp(max=max(cos.shape[0] - 1, 0))
    c = torch.where(in_table.unsqueeze(-1), cos[idx].to(wide), 1.0).unsqueeze(-2)  # (..., 1, rotary_dim/2)
    s = torch.where(in_table.unsqueeze(-1), sin[idx].to(wide), 0.0).unsqueeze(-2)
    if conjugate:
        s = -s
    xr = x[..., :rotary_dim].to(wide)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr.chunk(2, dim=-1)
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    if inplace:
        x[..., :rotary_dim].copy_(rot)
        return x
    if rotary_dim == x.shape[-1]:
        return rot.to(x.dtype)
    return torch.cat((rot.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rotary_torch(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, inplace, conjugate):
    """The rotary kernel's math in PyTorch (fp32 compute, fp64 for fp64 inputs); any device."""
    return rotate_at_positions(x, cos, sin, positions(x, seqlen_offsets, cu_seqlens), interleaved, inplace, conjugate)
