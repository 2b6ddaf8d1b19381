"""Launchers of the flex kernels (kernels/flex_fwd.py, kernels/flex_bwd.py): allocation, strides, tiles, grid.

Tiles come from the call's ``kernel_options`` (flex/options.py) where it gives them, else from the
kernels' tables (or the ``fwd_tiles`` / ``bwd_tiles`` settings, which tests pin), clipped to the block
mask's block sizes: a kernel tile must divide a sparse block, since a program
walks each listed block in whole tiles. The block-mask tensors are expanded to (batch, heads), so a
mask built with B or H None costs nothing per head (stride 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile import config
from flashtile.backends.triton import host
from flashtile.backends.triton.flex import gluon_launch
from flashtile.backends.triton.flex.modules import ModKernels
from flashtile.kernels.attn_bwd import _attn_bwd_preprocess_kernel
from flashtile.kernels.flex_bwd import _flex_bwd_dkdv_kernel, _flex_bwd_dq_kernel, flex_bwd_configs
from flashtile.kernels.flex_fwd import _flex_fwd_kernel, flex_fwd_config


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dots (the interpreter and the tests' fp32 runs compare against fp64)
    return "ieee" if dtype == torch.float32 else "tf32"


def _fit(tile: int, sparse: int) -> int:
    """A kernel tile no larger than the sparse block (both powers of two, so it divides it)."""
    return min(tile, sparse)


def _chosen(given: tuple, default: tuple) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the call's values where given (non-zero), else the default's."""
    return tuple(g or d for g, d in zip(given, default))


def _expand(t: Tensor, B: int, H: int) -> Tensor:
    return t.expand(B, H, *t.shape[2:])


def _buffers(kernels: ModKernels, device) -> tuple:
    """The captured tensors as the kernels read them (on the inputs' device, a unit last stride is not needed:
    offsets use their strides). A kernel needs at least one tuple element; a dummy stands in."""
    bufs = tuple(kernels.buffers)
    for t in bufs:
        if t.device != device:
            raise ValueError(f"a tensor captured by a mod is on {t.device}, the inputs on {device}: move it")
    return bufs if bufs else (torch.empty(1, device=device),)


def _kv_descriptors(k: Tensor, v: Tensor, bn: int, bd: int, bdv: int):
    """K and V tensor descriptors (boxes of ``bn`` rows of one (batch, kv head)) where ``descriptors_wanted``
    says so, else the tensors again (the pointer path). H100, bench flex's variants: ties with the pointer loads,
    up to 1.05x faster with ALiBi, softcap or a bias table (scripts/ab_flex.py --setting tma)."""
    from flashtile.backends.triton.tma import descriptors_wanted

    if not descriptors_wanted(k, v) or min(bd, bdv) * k.element_size() < 16:
        return k, v, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, bn, width]) for x, width in ((k, bd),
                                                                                                    (v, bdv))]
    return desc[0], desc[1], True


def flex_fwd(q: Tensor, k: Tensor, v: Tensor, block: tuple, kernels: ModKernels, scale: float,
             block_size: tuple[int, int], tiles: tuple = (0, 0, 0, 0)) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, Ev) in q's dtype and lse (B, Hq, L) fp32 (+inf on rows that see no key).
    ``block``: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices); ``tiles``: the call's
    (BLOCK_M, BLOCK_N, num_warps, num_stages), 0 where the table decides."""
    B, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    out = torch.empty(B, H, L, Ev, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, L, device=q.device, dtype=torch.float32)
    if L == 0:
        return out, lse
    bq, bkv = block_size
    bd, bdv = max(16, host.next_pow2(E)), max(16, host.next_pow2(Ev))
    num, idx, fnum, fidx = (_expand(t, B, H) for t in block)
    if gluon_launch.wanted(q, k, v, block_size, tiles, scale):
        gluon_launch.gluon_flex_fwd(q, k, v, (num, idx, fnum, fidx), _buffers(kernels, q.device), kernels, scale,
                                    block_size, out, lse)
        return out, lse
    tiles = _chosen(tiles, config.get().fwd_tiles or flex_fwd_config(host.arch_of(q.device), max(bd, bdv)))
    bm, bn, warps, stages = _fit(tiles[0], bq), _fit(tiles[1], bkv), tiles[2], tiles[3]
    grid = (host.cdiv(L, bm) * B * H,)
    desc_k, desc_v, tma = _kv_descriptors(k, v, bn, bd, bdv)
    with host.device_guard(q):
        host.launch(_flex_fwd_kernel, grid, q, k, v, out, lse, num, idx, fnum, fidx, _buffers(kernels, q.device),
                    desc_k, desc_v,
                    scale, L, S, H, H // k.shape[1],
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                    lse.stride(0), lse.stride(1), num.stride(0), num.stride(1), num.stride(2),
                    idx.stride(0), idx.stride(1), idx.stride(2),
                    SCORE_MOD=kernels.score_mod, MASK_MOD=kernels.mask_mod, HAS_SCORE_MOD=kernels.has_score_mod,
                    HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv, SPARSE_Q=bq,
                    SPARSE_KV=bkv, EVEN_M=L % bm == 0, EVEN_N=S % bkv == 0, DOT_PRECISION=_dot_precision(q.dtype),
                    num_warps=warps, num_stages=stages, **({"USE_TMA": True} if tma else {}))
    return out, lse


def flex_bwd(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             block: tuple, kernels: ModKernels, scale: float, block_size: tuple[int, int], buffer_grads: bool,
             tiles: tuple = (0,) * 8) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, grads of the captured tensors in ``kernels.grad_buffers`` order, fp32; empty when
    ``buffer_grads`` is False). ``dlse``: the gradient of the lse output (None: none), zero on rows that see
    no key. ``block``: the block mask's eight tensors (BlockMask.tensors()); ``tiles``: the call's dK/dV
    then dQ (BLOCK_M, BLOCK_N, num_warps, num_stages), 0 where the table decides."""
    B, H, L, E = q.shape
    Hk, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grads = [torch.zeros(kernels.buffers[i].shape, device=q.device, dtype=torch.float32)
             for i in kernels.grad_buffers] if buffer_grads else []
    if L == 0 or S == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, grads
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    bq, bkv = block_size
    bd, bdv = max(16, host.next_pow2(E)), max(16, host.next_pow2(Ev))
    arch = host.arch_of(q.device)
    (kv_cfg, q_cfg) = config.get().bwd_tiles or flex_bwd_configs(arch, max(bd, bdv))
    kv_cfg, q_cfg = _chosen(tiles[:4], kv_cfg), _chosen(tiles[4:], q_cfg)
    delta = torch.empty_like(lse)
    num, idx, fnum, fidx, qnum, qidx, fqnum, fqidx = (_expand(t, B, H) for t in block)
    bufs = _buffers(kernels, q.device)
    common = dict(SCORE_MOD=kernels.score_mod, SCORE_GRAD=kernels.score_grad, MASK_MOD=kernels.mask_mod,
                  HAS_SCORE_MOD=kernels.has_score_mod, HEAD_DIM=E, HEAD_DIM_V=Ev, BLOCK_D=bd, BLOCK_DV=bdv,
                  SPARSE_Q=bq, SPARSE_KV=bkv, DOT_PRECISION=_dot_precision(q.dtype))
    with host.device_guard(q):
        pre_m = 64 if arch != "interpret" else 16
        host.launch(_attn_bwd_preprocess_kernel, (host.cdiv(L, pre_m) * B * H,), out, dout, delta, None, None, L, H,
                    out.stride(0), out.stride(2), out.stride(1), dout.stride(0), dout.stride(2), dout.stride(1),
                    lse.stride(0), lse.stride(1), HEAD_DIM=Ev, BLOCK_M=pre_m, BLOCK_D=bdv, IS_VARLEN=False,
                    HAS_SEQUSED_Q=False, num_warps=4, num_stages=1)
        if dlse is not None:  # d lse_i / d S_ij = P_ij: dS = P * (dP - delta) + P * dlse folds into delta
            delta.sub_(dlse)
        bm, bn = _fit(kv_cfg[0], bq), _fit(kv_cfg[1], bkv)
        if gluon_launch.bwd_wanted(q, k, v, dout, block_size, tiles[:4]):
            # the fused build adds dQ into fp32 zeros (no dQ kernel follows): gluon_launch.fused_dq_wanted
            fused = gluon_launch.fused_dq_wanted()
            dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if fused else None
            gluon_launch.gluon_flex_dkdv(q, k, v, dout, lse, delta, dk, dv, (qnum, qidx, fqnum, fqidx), bufs, grads,
                                         kernels, scale, block_size, dq_accum=dq_accum)
            if dq_accum is not None:
                dq.copy_(dq_accum)
                return dq, dk, dv, grads
        else:
            _launch_triton_dkdv(q, k, v, dout, lse, delta, dk, dv, (qnum, qidx, fqnum, fqidx), bufs, grads, scale,
                                kv_cfg, bm, bn, bq, common)
        bm, bn = _fit(q_cfg[0], bq), _fit(q_cfg[1], bkv)
        host.launch(_flex_bwd_dq_kernel, (host.cdiv(L, bm) * B * H,), q, k, v, dout, lse, delta, dq,
                    num, idx, fnum, fidx, bufs, scale, L, S, H, H // Hk,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                    dq.stride(0), dq.stride(1), dq.stride(2), lse.stride(0), lse.stride(1),
                    num.stride(0), num.stride(1), num.stride(2), idx.stride(0), idx.stride(1), idx.stride(2),
                    BLOCK_M=bm, BLOCK_N=bn, EVEN_M=L % bm == 0, EVEN_N=S % bkv == 0, num_warps=q_cfg[2],
                    num_stages=q_cfg[3], **common)
    return dq, dk, dv, grads


def _launch_triton_dkdv(q, k, v, dout, lse, delta, dk, dv, qlists, bufs, grads, scale, kv_cfg, bm, bn, bq, common):
    B, H, L, _ = q.shape
    Hk, S = k.shape[1], k.shape[2]
    qnum, qidx, fqnum, fqidx = qlists
    host.launch(_flex_bwd_dkdv_kernel, (host.cdiv(S, bn) * B * Hk,), q, k, v, dout, lse, delta, dk, dv,
                qnum, qidx, fqnum, fqidx, bufs, tuple(grads) if grads else bufs, scale, L, S, H, Hk, H // Hk,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                lse.stride(0), lse.stride(1), qnum.stride(0), qnum.stride(1), qnum.stride(2),
                qidx.stride(0), qidx.stride(1), qidx.stride(2), HAS_BUFFER_GRADS=bool(grads),
                BLOCK_M=bm, BLOCK_N=bn, EVEN_M=L % bq == 0, EVEN_N=S % bn == 0, num_warps=kv_cfg[2],
                num_stages=kv_cfg[3], **common)
