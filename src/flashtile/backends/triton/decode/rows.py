"""Launcher of the whole-row decode kernel (kernels/decode_rows.py): one program per (batch row, group of adjacent kv
heads, key split), the splits merged by the combine kernel. The route (route.rows) takes it for long caches on large
batches on Hopper, contiguous or paged with pages of whole tiles; new keys are appended by the append kernel first.
A learnable sink costs the kernel nothing: the merge adds it."""

from __future__ import annotations

from flashtile.backends.triton.decode.common import LOG2E, capacity_of, combine, one_token_outputs, split_partials
from flashtile.backends.triton.decode.route import Route
from flashtile.backends.triton.host import device_guard, launch
from flashtile.kernels.decode_rows import _decode_rows_kernel


def decode(q, k_cache, v_cache, route: Route, *, cache_seqlens, cache_len_const, s_new, softmax_scale,
           block_table=None, learnable_sink=None):
    """Attention of q (b, 1, h, d) over the (b, capacity, h_k, d) cache holding cache_seqlens (or cache_len_const)
    + s_new keys a row: out (b, 1, h, d), lse (b, h, 1). With ``block_table`` (b, pages a row), int32, the caches are
    (pages, page_size, h_k, d) pools and row i's keys lie in the pages block_table[i] lists. ``learnable_sink`` (h,)
    or None: added to every row's softmax denominator by the merge."""
    b, _, h, d = q.shape
    h_k = k_cache.shape[2]
    out, lse = one_token_outputs(q)
    if b == 0:
        return out, lse
    heads, splits = route.heads, route.splits
    groups = h_k // heads
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    with device_guard(q):
        launch(
            _decode_rows_kernel, (b * groups * splits,),
            q, k_cache, v_cache, o_part, lse_part,
            cache_seqlens if cache_seqlens is not None else lse, block_table if block_table is not None else lse,
            softmax_scale * LOG2E, cache_len_const, s_new, capacity_of(k_cache, block_table), h // h_k,
            q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            0 if block_table is None else block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(3), lse_part.stride(0), lse_part.stride(1),
            lse_part.stride(2),
            HEADS=heads, GROUPS=groups, NUM_SPLITS=splits, HEAD_DIM=d, BLOCK_M=16, BLOCK_N=route.block_n,
            HAS_SEQLENS=cache_seqlens is not None, num_warps=route.warps, num_stages=route.stages,
            **(dict(USE_PDL=True, launch_pdl=True) if route.pdl else {}),
            **({} if block_table is None else dict(PAGE_SIZE=k_cache.shape[1])),
        )
    return combine(o_part, lse_part, out, lse, pdl=route.merge_pdl, sink=learnable_sink)
