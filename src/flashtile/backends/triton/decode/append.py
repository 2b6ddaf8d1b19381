"""Launcher of the append kernel (kernels/kv_append.py): new keys (rotated) and values into the cache, in place."""

from __future__ import annotations

import torch

from flashtile.backends.triton.decode.common import capacity_of
from flashtile.backends.triton.host import device_guard, next_pow2, run_kernel
from flashtile.fp8 import FP8_DTYPE
from flashtile.kernels.decode_mla import _kv_append_dv_kernel
from flashtile.kernels.kv_append import _kv_append_kernel


def kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table,
              rotary_cos, rotary_sin, rotary_interleaved, pdl: bool = False):
    """Write new k (rotated when cos/sin are given) (b, s_new, h_k, d) and v (b, s_new, h_k, dv) into the cache in
    place. ``pdl``: launched as a programmatic dependent of the kernel before it (Route.append_pdl)."""
    b, s_new, h_k, d = k.shape
    if b == 0 or s_new == 0:
        return
    if v.shape[-1] != d:
        _append_dv(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table, rotary_cos,
                   rotary_sin, rotary_interleaved, pdl)
        return
    if k.dtype == FP8_DTYPE:  # appending e4m3 values is a byte copy (fp8 takes no rotary)
        k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
    paged = block_table is not None
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    cos = rotary_cos if rotary_cos is not None else k
    sin = rotary_sin if rotary_sin is not None else k
    dummy = k
    with device_guard(k):
        run_kernel(_kv_append_kernel, (s_new * b,),  # flat grid: axis 1 would cap the batch at 65535
            k, v, k_cache, v_cache,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            block_table if paged else dummy, cos, sin,
            cache_len_const, s_new, h_k, k_cache.shape[1], capacity_of(k_cache, block_table),
            cos.shape[0] if rotary_dim else 0,
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0, cos.stride(0) if rotary_dim else 0,
            HEAD_DIM=d, BLOCK_H=next_pow2(h_k), BLOCK_D=max(16, next_pow2(d)),
            HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None, PAGED=paged,
            ROTARY_DIM=rotary_dim, INTERLEAVED=bool(rotary_interleaved),
            num_warps=4 if h_k * d >= 1024 else 1, **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}),
        )


def _append_dv(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table, rotary_cos,
               rotary_sin, rotary_interleaved, pdl):
    """kv_append for values with a head dim of their own (kernels/decode_mla.py's append kernel; not fp8)."""
    b, s_new, h_k, d = k.shape
    dv = v.shape[-1]
    paged = block_table is not None
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    cos = rotary_cos if rotary_cos is not None else k
    sin = rotary_sin if rotary_sin is not None else k
    dummy = k
    with device_guard(k):
        run_kernel(_kv_append_dv_kernel, (s_new * b,),  # flat grid: axis 1 would cap the batch at 65535
            k, v, k_cache, v_cache,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            block_table if paged else dummy, cos, sin,
            cache_len_const, s_new, h_k, k_cache.shape[1], capacity_of(k_cache, block_table),
            cos.shape[0] if rotary_dim else 0,
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0, cos.stride(0) if rotary_dim else 0,
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_H=next_pow2(h_k), BLOCK_D=max(16, next_pow2(d)),
            BLOCK_DV=max(16, next_pow2(dv)), HAS_SEQLENS=cache_seqlens is not None,
            HAS_BATCH_IDX=cache_batch_idx is not None, PAGED=paged, ROTARY_DIM=rotary_dim,
            INTERLEAVED=bool(rotary_interleaved),
            num_warps=4 if h_k * (d + dv) >= 2048 else 1, **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}),
        )
