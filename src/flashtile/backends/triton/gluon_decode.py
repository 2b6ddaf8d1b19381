"""Launcher of the Gluon paged-decode kernel (kernels/gluon_decode_paged.py), an experiment behind
FLASHTILE_DECODE_GLUON_PAGED=1: the decode step of a pool of small pages (16 / 32 / 64 tokens) with one
TMA box per page and one warp-group MMA per 128-key tile, where the Triton kernel gathers per key.

It takes the plain decode step only (one query token, a cache_seqlens tensor, a contiguous bf16 / fp16
pool, d = 64 / 128, no softcap, ALiBi, left window, left padding, rotary or fp8); anything else stays on
the Triton kernel. New keys are appended first by the separate append kernel. Programmatic dependent
launch follows the Triton kernel's rule (use_pdl). Nothing reads a tensor's values, so a step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from flashtile import env
from flashtile.backends.triton.attn_fwd import _tma_ok
from flashtile.backends.triton.host import capability, cdiv, device_guard, run_kernel

LOG2E = 1.4426950408889634
BLOCK_N = 128
BLOCK_M = 64  # one warpgroup's MMA rows: the query heads of a kv head, padded
NUM_BUFFERS = 3  # K + V ring: 3 x 64 KB at d = 128 (213 KB of shared memory with q's tile)
PAGE_SIZES = (16, 32, 64)
OVERRIDE: bool | None = None  # tests pin it; None: FLASHTILE_DECODE_GLUON_PAGED


def use_gluon_paged(q, k_cache, v_cache, *, block_table, cache_seqlens, cache_leftpad, rotary_cos, window_left,
                    softcap, alibi_slopes, descales) -> bool:
    """Take the Gluon kernel for this call? Only when asked (``OVERRIDE`` or the environment), on an sm_90
    GPU, for the plain decode step it implements (see the module docstring)."""
    if block_table is None:  # contiguous caches (most calls) pay no environment lookup
        return False
    on = OVERRIDE
    if on is None:
        setting = env.get("FLASHTILE_DECODE_GLUON_PAGED", "")
        if setting not in ("", "0", "1"):
            raise ValueError(f"FLASHTILE_DECODE_GLUON_PAGED must be 1 (on) or 0 / unset (off), got {setting!r}")
        on = setting == "1"
    if not on or not plain_step(q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad,
                                rotary_cos=rotary_cos, window_left=window_left, softcap=softcap,
                                alibi_slopes=alibi_slopes, descales=descales):
        return False
    return q.device.type == "cuda" and torch.version.hip is None and capability(q.device)[0] == 9


def plain_step(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad, rotary_cos, window_left, softcap,
               alibi_slopes, descales) -> bool:
    """Whether the kernel implements this paged call, from shapes, dtypes and arguments only (no device)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        return False
    b, sq, h, d = q.shape
    page, h_k = k_cache.shape[1], k_cache.shape[2]
    plain = (cache_leftpad is None and rotary_cos is None and window_left < 0 and softcap <= 0
             and alibi_slopes is None and all(x is None for x in descales))
    if not plain or sq != 1 or page not in PAGE_SIZES or d not in (64, 128) or h // h_k > BLOCK_M:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    return all(_pool_2d_ok(x) for x in (k_cache, v_cache)) and q.stride(-1) == 1


def _pool_2d_ok(x: torch.Tensor) -> bool:
    # the kernel's descriptors see the pool as (pages * page_size, h_k * d): its first three dims packed
    _, page, h_k, d = x.shape
    return x.stride(3) == 1 and x.stride(2) == d and x.stride(1) == h_k * d and x.stride(0) == page * h_k * d \
        and _tma_ok(x)


@functools.lru_cache(maxsize=16)
def _layout(page: int, d: int, dtype: torch.dtype):
    import triton.experimental.gluon.language as gl

    return gl.NVMMASharedLayout.get_default_for([page, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(pool: torch.Tensor):
    """The pool's (pages * page_size, h_k * d) descriptor with box [page_size, d], built without the
    constructor's checks (as decode.cache_descriptor does): plain_step has made them (_pool_2d_ok), and an
    eager decode step should not pay for them twice."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, page, h_k, d = pool.shape
    flat = pool.view(n * page, h_k * d)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = flat, [n * page, h_k * d], [h_k * d, 1]
    desc.block_shape, desc.layout, desc.padding = [page, d], _layout(page, d, pool.dtype), "zero"
    return desc


def gluon_paged_decode(q, k_cache, v_cache, *, s_new: int, cache_seqlens, block_table, softmax_scale: float,
                       num_splits: int):
    """Attention of q (b, 1, h, d) over the (already appended) paged cache: out (b, 1, h, d), lse (b, h, 1)."""
    from flashtile.backends.triton.decode import MAX_SPLITS, combine, num_sms, num_splits_heuristic, use_pdl
    from flashtile.kernels.gluon_decode_paged import _gluon_paged_decode_kernel

    b, _, h, d = q.shape
    page, h_k = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, 1, device=q.device, dtype=torch.float32)
    if b == 0:
        return out, lse
    key_blocks = cdiv(max(block_table.shape[1] * page, 1), BLOCK_N)
    if num_splits <= 0:
        num_splits = num_splits_heuristic(b * h_k, key_blocks, num_sms(q.device))
    num_splits = max(1, min(num_splits, MAX_SPLITS, key_blocks))
    if num_splits > 1:
        o_part = torch.empty(num_splits, b, 1, h, d, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(num_splits, b, h, 1, device=q.device, dtype=torch.float32)
        ops, lps = o_part.stride(), lse_part.stride()
    else:
        o_part, lse_part, ops, lps = out, lse, (0,) * 5, (0,) * 4
    # programmatic dependent launch by the Triton kernel's rule (PDL_MAX_KV_BYTES at the pool's capacity)
    pdl = use_pdl(q.device, 2 * b * block_table.shape[1] * page * h_k * d * k_cache.element_size())
    with device_guard(q):
        run_kernel(_gluon_paged_decode_kernel, (b * h_k * num_splits,),
                   q, _descriptor(k_cache), _descriptor(v_cache), out, lse, o_part, lse_part, cache_seqlens,
                   block_table, softmax_scale * LOG2E, s_new, h_k, h // h_k, block_table.shape[1], k_cache.shape[0],
                   q.stride(0), q.stride(2), out.stride(0), out.stride(2), lse.stride(0), lse.stride(1),
                   ops[0], ops[1], ops[3], lps[0], lps[1], lps[2], block_table.stride(0),
                   HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=page, NUM_BUFFERS=NUM_BUFFERS,
                   NUM_SPLITS=num_splits, num_warps=4, **(dict(USE_PDL=True, launch_pdl=True) if pdl else {}))
    if num_splits > 1:
        combine(o_part, lse_part, out, lse, pdl=pdl)
    return out, lse
