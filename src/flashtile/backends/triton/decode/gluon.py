"""Launcher of the Gluon warps-along-keys decode kernel (kernels/gluon_decode_warp_keys.py), cuDNN's warp shape on
Hopper. The route (route.gluon_unsplit, route.gluon_split) takes it for plain one-token calls on contiguous bf16 /
fp16 caches with about two programs on every SM, unsplit, or split up to that grid. Split launches take a learnable
sink, which the merge adds; the unsplit kernel has none (its route leaves such calls to the others)."""

from __future__ import annotations

from flashtile.backends.triton.decode.common import LOG2E, combine, one_token_outputs, split_partials
from flashtile.backends.triton.decode.route import Route
from flashtile.backends.triton.host import device_guard, run_kernel

# The ring: two 64-key K / V slots, 64 KB, two programs an SM (a third slot, and cuDNN's 128-key tiles, were slower:
# docs/inference.md, 'Kernels')
NUM_BUFFERS = 2
MAX_GROUP = 16  # the kernel's 16 query rows


def merge_rows(group: int) -> int:
    """Rows of the warps' merge that hold query heads: the group as a power of two of at least 4 (the merge's 4
    warps along the rows), at most 16. Reading back only these, not all 16 padded rows, saves time on every call."""
    return min(MAX_GROUP, max(4, 1 << (group - 1).bit_length()))


def decode(q, k_cache, v_cache, route: Route, *, cache_seqlens, cache_len_const, s_new, softmax_scale, k_new=None,
           v_new=None, learnable_sink=None):
    """Attention of q (b, 1, h, d) over the contiguous (b, capacity, h_k, d) cache holding cache_seqlens + s_new keys
    a row: out (b, 1, h, d), lse (b, h, 1). With k_new / v_new ((b, s_new, h_k, d), unsplit routes only) the kernel
    first appends them at cache_seqlens; without, the cache already holds them. ``route.splits`` > 1: each row's keys
    in that many programs, merged by the combine kernel, which adds ``learnable_sink`` (h,) when given (split
    launches only)."""
    from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel

    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    splits = route.splits
    out, lse = one_token_outputs(q)
    fused = k_new is not None and s_new > 0
    if fused and splits > 1:
        raise ValueError("gluon decode: a split launch reads the new keys from the cache (append them first)")
    if learnable_sink is not None and splits == 1:
        raise ValueError("gluon decode: an unsplit launch has no learnable sink (the route takes split launches only)")
    if b == 0:
        return out, lse
    has_seqlens = cache_seqlens is not None
    if splits > 1:  # the partials (splits, b, 1, h, d) / (splits, b, h, 1), merged below
        o_dst, lse_dst = split_partials(splits, b, 1, h, d, q.device)
        o_strides, lse_strides = (o_dst.stride(1), o_dst.stride(3)), lse_dst.stride()[1:3]
        split_strides = (o_dst.stride(0), lse_dst.stride(0))
    else:
        o_dst, lse_dst = out, lse
        o_strides, lse_strides = (out.stride(0), out.stride(2)), lse.stride()[:2]
        split_strides = (0, 0)
    with device_guard(q):
        run_kernel(_gluon_decode_warp_keys_kernel, (b * h_k * splits,),
            q, k_cache, v_cache, o_dst, lse_dst, cache_seqlens if has_seqlens else lse, k_new if fused else q,
            v_new if fused else q, softmax_scale * LOG2E, h_k, h // h_k, cache_len_const if not has_seqlens else 0,
            s_new, k_cache.shape[1],
            q.stride(0), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3], *o_strides, *lse_strides,
            *(k_new.stride()[:3] if fused else (0, 0, 0)), *(v_new.stride()[:3] if fused else (0, 0, 0)),
            *split_strides,
            HEAD_DIM=d, BLOCK_N=route.block_n, NUM_BUFFERS=NUM_BUFFERS, HAS_SEQLENS=has_seqlens, FUSED_NEW=fused,
            GROUP_ROWS=merge_rows(h // h_k), EARLY_TILES=splits == 1,
            **({} if splits == 1 else dict(NUM_SPLITS=splits, MERGE_EARLY=route.merge_pdl)), num_warps=4)
        if splits > 1:
            combine(o_dst, lse_dst, out, lse, pdl=route.merge_pdl, sink=learnable_sink)
    return out, lse
