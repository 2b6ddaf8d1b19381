"""Launcher of the MLA decode kernel (kernels/decode_mla.py): calls with ``qv`` (multi-head latent attention in
absorbed form) or a value head dim of their own, with every feature of the split kernel but fp8 (paged caches of any
page size, cache_batch_idx, left padding, windows, softcap, ALiBi, rotary on q, several query tokens, learnable sinks,
chunks), on any GPU and
in Triton's interpreter. The route (route.mla) fixes its tiles, split count and programmatic dependent launch; the
splits are merged by the combine kernel (common.combine)."""

from __future__ import annotations

import torch

from flashtile.backends.triton.decode.common import LOG2E, combine, features, split_partials
from flashtile.backends.triton.decode.route import Route
from flashtile.backends.triton.host import cdiv, device_guard, launch, next_pow2
from flashtile.kernels.decode_mla import _mla_decode_kernel


def decode(q, qv, k_cache, v_cache, route: Route, *, s_new, cache_seqlens, cache_len_const, cache_batch_idx,
           cache_leftpad, block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_per_token, softmax_scale,
           window_left, window_right, softcap, alibi_slopes, learnable_sink=None, attention_chunk=0):
    """Attention of q (b, sq, h, d) and qv (b, sq, h, dv) or None over the (already updated) caches, k_cache's head
    dim d and v_cache's dv: scores (q . k + qv . v) * softmax_scale. Returns out (b, sq, h, dv), lse (b, h, sq).
    ``learnable_sink`` (h,) or None (in the kernel when unsplit, in the merge when split); ``attention_chunk``."""
    from flashtile.backends.triton.decode import gluon_mla

    # DeepSeek's shape on Hopper: the Gluon kernel, which splits the work between its two warpgroups
    # (kernels/gluon_decode_mla.py); everything else, and other GPUs, this module's Triton kernel
    if gluon_mla.refusal(q, qv, k_cache, v_cache, block_table=block_table, cache_batch_idx=cache_batch_idx,
                         cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, window_left=window_left,
                         window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
                         learnable_sink=learnable_sink, attention_chunk=attention_chunk) is None:
        return gluon_mla.decode(q, qv, k_cache, v_cache, route.splits, s_new=s_new, cache_seqlens=cache_seqlens,
                                cache_len_const=cache_len_const, block_table=block_table,
                                softmax_scale=softmax_scale, causal=window_right == 0)
    b, sq, h, d = q.shape
    dv = v_cache.shape[-1]
    h_k = k_cache.shape[2]
    group = h // h_k
    paged = block_table is not None
    page_size = k_cache.shape[1]
    block_m, splits = route.block_m, route.splits
    m_blocks = cdiv(sq * group, block_m)
    out = torch.empty(b, sq, h, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    if b == 0 or sq == 0:
        return out, lse
    if splits > 1:
        o_part, lse_part = split_partials(splits, b, sq, h, dv, q.device)
        ops = o_part.stride()[:4]
        lps = lse_part.stride()[:3]
    else:
        o_part, lse_part = out, lse
        ops, lps = (0, 0, 0, 0), (0, 0, 0)
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    qk_scale = softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E
    dummy = lse
    has_qv = qv is not None
    qv_ = qv if has_qv else q
    # a kernel built with USE_PDL but launched in order waits on nothing at its top (griddepcontrol.wait returns at
    # once) and still lets its merge launch after its key loop
    pdl = dict(USE_PDL=True, launch_pdl=True) if route.pdl else dict(USE_PDL=True) if route.merge_pdl else {}
    with device_guard(q):
        launch(
            # flat grid (b x kv heads on axis 1 would be capped at 65535), the row blocks fastest
            _mla_decode_kernel, (b * h_k * splits * m_blocks,),
            q, qv_, k_cache, v_cache, out, lse, o_part, lse_part,
            cache_seqlens if cache_seqlens is not None else dummy,
            cache_batch_idx if cache_batch_idx is not None else dummy,
            cache_leftpad if cache_leftpad is not None else dummy,
            block_table if paged else dummy,
            alibi_slopes if alibi_slopes is not None else dummy,
            rotary_cos if rotary_dim else dummy, rotary_sin if rotary_dim else dummy,
            learnable_sink if splits == 1 else None,
            qk_scale, softcap, window_left, window_right, attention_chunk or None,
            cache_len_const, s_new, sq, h_k, group, page_size, rotary_cos.shape[0] if rotary_dim else 0, m_blocks,
            # one stride() call per tensor: each stride(i) call costs host time on every decode step
            *q.stride()[:3], *(qv.stride()[:3] if has_qv else (0, 0, 0)), *k_cache.stride()[:3],
            *v_cache.stride()[:3], *out.stride()[:3], *lse.stride()[:2], *ops, *lps,
            block_table.stride(0) if paged else 0,
            0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0),
            rotary_cos.stride(0) if rotary_dim else 0,
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=block_m, BLOCK_N=route.block_n, BLOCK_D=max(16, next_pow2(d)),
            BLOCK_DV=max(16, next_pow2(dv)), NUM_SPLITS=splits, PAGED=paged,
            PAGE_ALIGNED=paged and page_size % route.block_n == 0 and cache_leftpad is None,
            PAGE_SHIFT=page_size.bit_length() - 1 if paged and page_size & (page_size - 1) == 0 else -1,
            PAGES_PER_TILE=route.pages_per_tile,
            HAS_QV=has_qv, HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
            HAS_LEFTPAD=cache_leftpad is not None, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
            HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, ROTARY_DIM=rotary_dim,
            ROTARY_INTERLEAVED=bool(rotary_interleaved), ROTARY_PER_TOKEN=bool(rotary_per_token),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=route.warps, num_stages=route.stages, **pdl,
            **features(learnable_sink is not None and splits == 1, attention_chunk),
        )
    if splits > 1:
        combine(o_part, lse_part, out, lse, pdl=route.merge_pdl, sink=learnable_sink)
    return out, lse
