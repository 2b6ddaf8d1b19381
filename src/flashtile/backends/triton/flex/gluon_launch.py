"""The Gluon flex kernels' routes and launchers (kernels/gluon_flex_fwd.py, gluon_flex_bwd.py): which calls they
take, and the launches.

It takes a flex forward on sm_90 in bf16 / fp16 whose q / k / v share a head dim of 128 (the one measured), a
positive scale, at most 65535 (batch, head) pairs (the grid's second axis), whose tensors
allow tensor descriptors (16-byte aligned base and strides), whose block mask's blocks hold whole kernel tiles,
and whose tiles the call did not choose (``kernel_options`` / ``config.fwd_tiles`` tile the Triton kernel).
``config.gluon`` (FLASHTILE_GLUON=0) turns it off with every Gluon route; ``config.gluon_flex`` True / False
forces it on (where it can run) / off. The dK/dV kernel of the backward runs only where ``config.gluon_flex_bwd``
is True (it has not yet run on a GPU), for the calls the forward's rule takes, with the call's backward tiles unset;
with ``config.gluon_fused_dq`` True as well it also computes dQ (its fused build: no dQ kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile import config
from flashtile.backends.triton import host
from flashtile.backends.triton.gluon_fwd import _descriptor as descriptor
from flashtile.backends.triton.tma import tma_ok

HEAD_DIMS = (128,)


def _config(head_dim: int) -> tuple[int, int, int, int]:
    from flashtile.kernels.gluon_flex_fwd import GLUON_FLEX_FWD_CONFIGS

    return GLUON_FLEX_FWD_CONFIGS[head_dim]


def wanted(q: Tensor, k: Tensor, v: Tensor, block_size: tuple[int, int], tiles: tuple, scale: float) -> bool:
    """Does this flex forward run on the Gluon kernel? (``tiles``: the call's own, zeros where it chose none.)"""
    settings = config.get()
    if not settings.gluon or settings.gluon_flex is False or any(tiles) or settings.fwd_tiles:
        return False
    if q.device.type != "cuda" or host.arch_of(q.device) != "sm90":
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if k.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:  # no descriptor over an empty dimension
        return False
    # the kernel hides a masked raw score as -inf before the scale multiplies it (no score_mod): a zero or negative
    # scale would make that NaN / +inf
    if not scale > 0 or q.shape[0] * q.shape[1] > host.MAX_GRID_Y:
        return False
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return False
    bm, bn = _config(d)[:2]
    if block_size[0] % bm or block_size[1] % bn:
        return False
    return all(tma_ok(x) for x in (q, k, v))


def _descriptor(x: Tensor, rows: int):
    return descriptor(x, [1, 1, rows, x.shape[-1]])


def gluon_flex_fwd(q: Tensor, k: Tensor, v: Tensor, block: tuple, buffers: tuple, kernels, scale: float,
                   block_size: tuple[int, int], out: Tensor, lse: Tensor) -> None:
    """Fills ``out`` (B, H, L, E) and ``lse`` (B, H, L) fp32 for q (B, H, L, E), k / v (B, H_k, S, E) with the
    block mask's ``block`` (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, expanded to (B, H))
    and the mods' generated ``kernels`` (their captured tensors ``buffers``)."""
    from flashtile.kernels.gluon_flex_fwd import _gluon_flex_fwd_kernel

    B, H, L, E = q.shape
    S = k.shape[2]
    bm, bn, nb, warps = _config(E)
    num, idx, fnum, fidx = block
    bq, bkv = block_size
    with host.device_guard(q):
        host.run_kernel(_gluon_flex_fwd_kernel, (host.cdiv(L, bm), B * H),
                    _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(out, bm), out, lse,
                    num, idx, fnum, fidx, buffers, scale, L, S, H, H // k.shape[1],
                    out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                    num.stride(0), num.stride(1), num.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
                    SCORE_MOD=kernels.score_mod, MASK_MOD=kernels.mask_mod, HAS_SCORE_MOD=kernels.has_score_mod,
                    HEAD_DIM=E, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, SPARSE_Q=bq, SPARSE_KV=bkv,
                    EVEN_M=L % bm == 0, EVEN_N=S % bkv == 0, num_warps=warps)


def bwd_wanted(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, block_size: tuple[int, int], tiles: tuple) -> bool:
    """Does this flex backward's dK/dV half run on the Gluon kernel? (``tiles``: the call's dK/dV tiles.)"""
    settings = config.get()
    if not settings.gluon or settings.gluon_flex_bwd is not True or any(tiles) or settings.bwd_tiles:
        return False
    if q.device.type != "cuda" or host.arch_of(q.device) != "sm90" or k.shape[2] == 0 or q.numel() == 0:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype == dout.dtype):
        return False
    from flashtile.kernels.gluon_flex_bwd import GLUON_FLEX_BWD_CONFIGS

    d = q.shape[-1]
    if d not in GLUON_FLEX_BWD_CONFIGS or k.shape[-1] != d or v.shape[-1] != d:
        return False
    bm, bn = GLUON_FLEX_BWD_CONFIGS[d][:2]
    if block_size[0] % bm or block_size[1] % bn or k.shape[0] * k.shape[1] > host.MAX_GRID_Y:
        return False
    return all(tma_ok(x) for x in (q, k, v, dout))


def fused_dq_wanted() -> bool:
    """Does the Gluon dK/dV kernel (bwd_wanted) also compute dQ? Only under ``config.gluon_fused_dq=True``: flex's
    Gluon dK/dV kernel itself runs only when asked (bwd_wanted), so the main backward's route table
    (gluon_bwd.FUSED_ROUTE_TABLE) has no say here."""
    return config.get().gluon_fused_dq is True


def gluon_flex_dkdv(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, dk: Tensor,
                    dv: Tensor, qlists: tuple, buffers: tuple, grads: tuple, kernels, scale: float,
                    block_size: tuple[int, int], dq_accum: Tensor | None = None) -> None:
    """Fills ``dk`` / ``dv`` (B, H_k, S, E) of q / dout (B, H, L, E), k / v (B, H_k, S, E), lse and delta (B, H, L)
    fp32 (delta = rowsum(dout * out) - dlse), with the block mask's transposed lists ``qlists`` (q_num_blocks,
    q_indices, full_q_num_blocks, full_q_indices, expanded to (B, H)); ``grads``: fp32 tensors the captured
    tensors' gradients are added to (empty: none). ``dq_accum``: contiguous fp32 zeros of q's shape that the fused
    build adds dQ into (already scaled: the caller casts it into dq)."""
    from flashtile.kernels.gluon_flex_bwd import GLUON_FLEX_BWD_CONFIGS, _gluon_flex_bwd_dkdv_kernel

    B, H, L, E = q.shape
    Hk, S = k.shape[1], k.shape[2]
    bm, bn, nb, warps = GLUON_FLEX_BWD_CONFIGS[E]
    fused = dq_accum is not None
    if fused and (dq_accum.dtype != torch.float32 or dq_accum.shape != q.shape or not dq_accum.is_contiguous()):
        raise ValueError(f"gluon flex dK/dV: dq_accum must be contiguous fp32 of q's shape {tuple(q.shape)}, got "
                         f"{dq_accum.dtype} {tuple(dq_accum.shape)}")
    qnum, qidx, fqnum, fqidx = qlists
    bq, bkv = block_size
    with host.device_guard(q):
        host.run_kernel(_gluon_flex_bwd_dkdv_kernel, (host.cdiv(S, bn), B * Hk),
                        _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(dout, bm),
                        _descriptor(dk, bn), _descriptor(dv, bn), lse, delta, qnum, qidx, fqnum, fqidx, buffers,
                        tuple(grads) if grads else buffers, scale, L, S, Hk, H // Hk, lse.stride(0), lse.stride(1),
                        qnum.stride(0), qnum.stride(1), qnum.stride(2), qidx.stride(0), qidx.stride(1),
                        qidx.stride(2),
                        # without dq_accum the kernel never reads it: dK's descriptor stands in
                        _descriptor(dq_accum, bm) if fused else _descriptor(dk, bn),
                        SCORE_MOD=kernels.score_mod, SCORE_GRAD=kernels.score_grad,
                        MASK_MOD=kernels.mask_mod, HAS_SCORE_MOD=kernels.has_score_mod, HAS_BUFFER_GRADS=bool(grads),
                        HEAD_DIM=E, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, SPARSE_Q=bq, SPARSE_KV=bkv,
                        EVEN_M=L % bq == 0, EVEN_N=S % bn == 0, FUSED_DQ=fused, num_warps=warps)
