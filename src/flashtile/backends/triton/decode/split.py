"""Launcher of the Triton split-KV decode kernel (kernels/decode.py): every feature of the call (paged caches of any
page size, cache_batch_idx, left padding, windows, softcap, ALiBi, rotary, several query tokens, fp8, learnable sinks,
chunks), on any GPU and in Triton's interpreter. The route (route.split) fixes its tiles, split count, TMA and PDL."""

from __future__ import annotations

import torch

from flashtile.backends.triton.decode.common import LOG2E, combine, features, split_partials
from flashtile.backends.triton.decode.route import Route
from flashtile.backends.triton.host import cdiv, device_guard, launch, next_pow2
from flashtile.fp8 import FP8_DTYPE
from flashtile.kernels.decode import _decode_kernel


def cache_descriptor(x: torch.Tensor, block_n: int, block_d: int):
    """A (batch, capacity, kv heads, d) cache's (or a (pages, page_size, kv heads, d) pool's) descriptor with box
    [1, block_n, 1, block_d].

    Built without TensorDescriptor's own checks, which the route has made (tma.tma_ok: non-empty, 16-byte aligned
    base and strides; a cache's last stride is 1): they cost over twice the construction itself on every eager
    decode call (tests/test_decode_tma.py compares the fields with the checked constructor's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = x, list(x.shape), list(x.stride())
    desc.block_shape, desc.padding = [1, block_n, 1, block_d], "zero"
    return desc


def decode(q, k_cache, v_cache, route: Route, *, s_new, cache_seqlens, cache_len_const, cache_batch_idx,
           cache_leftpad, block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_per_token, softmax_scale,
           window_left, window_right, softcap, alibi_slopes, descales=(None, None, None), learnable_sink=None,
           attention_chunk=0):
    """Attention of q (b, sq, h, d) over the (already updated) cache; returns out (b, sq, h, d), lse (b, h, sq).

    fp8 (e4m3) q and caches take ``descales`` = (q, k, v) fp32 (b, h_k) tensors or None (= 1); the output is then
    bf16. ``learnable_sink`` (h,) or None: in the kernel when unsplit, in the merge when split.
    ``attention_chunk`` > 0: each row's keys end at its diagonal's chunk."""
    b, sq, h, d = q.shape
    h_k = k_cache.shape[2]
    group = h // h_k
    paged = block_table is not None
    page_size = k_cache.shape[1]
    block_d = max(16, next_pow2(d))
    block_m, block_n, splits = route.block_m, route.block_n, route.splits
    m_blocks = cdiv(sq * group, block_m)
    is_fp8 = q.dtype == FP8_DTYPE
    out = torch.empty(q.shape, device=q.device, dtype=torch.bfloat16) if is_fp8 else torch.empty_like(q)
    lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    if b == 0 or sq == 0:
        return out, lse
    if is_fp8:
        ones = None
        ds = []
        for x in descales:
            if x is None:
                ones = ones if ones is not None else torch.ones(b, h_k, device=q.device, dtype=torch.float32)
                x = ones
            ds.append(x.contiguous())  # one (h_k, 1) stride pair serves all three in the kernel
        q_ds, k_ds, v_ds = ds
    else:
        q_ds = k_ds = v_ds = lse
    if splits > 1:
        o_part, lse_part = split_partials(splits, b, sq, h, d, q.device)
        ops = o_part.stride()[:4]
        lps = lse_part.stride()[:3]
    else:
        o_part, lse_part = out, lse
        ops, lps = (0, 0, 0, 0), (0, 0, 0)
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    qk_scale = softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E
    dummy = lse
    # a kernel built with USE_PDL but launched in order waits on nothing at its top (griddepcontrol.wait returns at
    # once) and still lets its merge launch after its key loop
    pdl = dict(USE_PDL=True, launch_pdl=True) if route.pdl else dict(USE_PDL=True) if route.merge_pdl else {}
    desc_k, desc_v = ((cache_descriptor(k_cache, block_n, block_d), cache_descriptor(v_cache, block_n, block_d))
                      if route.tma else (k_cache, v_cache))
    with device_guard(q):
        launch(
            _decode_kernel, (splits * b * h_k * m_blocks,),  # flat: b x kv heads on axis 1 would be capped at 65535
            q, k_cache, v_cache, out, lse, o_part, lse_part,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            cache_leftpad if cache_leftpad is not None else dummy,
            block_table if paged else dummy,
            alibi_slopes if alibi_slopes is not None else dummy,
            rotary_cos if rotary_dim else dummy, rotary_sin if rotary_dim else dummy,
            q_ds, k_ds, v_ds, desc_k, desc_v, learnable_sink if splits == 1 else None,
            qk_scale, softcap, window_left, window_right, attention_chunk or None,
            cache_len_const, s_new, sq, h_k, group, page_size, rotary_cos.shape[0] if rotary_dim else 0, m_blocks,
            # one stride() call per tensor: each stride(i) call costs host time on every decode step
            *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            *ops, *lps,
            block_table.stride(0) if paged else 0,
            0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0),
            rotary_cos.stride(0) if rotary_dim else 0, q_ds.stride(0) if is_fp8 else 0,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=splits,
            PAGED=paged, PAGE_ALIGNED=paged and page_size % block_n == 0 and cache_leftpad is None,
            PAGES_PER_TILE=route.pages_per_tile,
            PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1,
            HAS_SEQLENS=cache_seqlens is not None,
            HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
            HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
            HAS_ALIBI=alibi_slopes is not None, ROTARY_DIM=rotary_dim, ROTARY_INTERLEAVED=bool(rotary_interleaved),
            ROTARY_PER_TOKEN=bool(rotary_per_token),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", IS_FP8=is_fp8,
            num_warps=route.warps, num_stages=route.stages, **pdl, **({"USE_TMA": True} if route.tma else {}),
            **features(learnable_sink is not None and splits == 1, attention_chunk),
        )
    if splits > 1:
        combine(o_part, lse_part, out, lse, pdl=route.merge_pdl, sink=learnable_sink)
    return out, lse
