"""Which keys a decode tile reads and where they live: the visible key blocks of its tokens and a split's share
of them, and element offsets of key positions in a contiguous or paged K / V cache."""

import triton
import triton.language as tl

from flashtile.kernels.attn_fwd import _key_block_ranges


@triton.jit
def _split_share(pid_m, split, group, seqlen_q, seqlen_k, window_left, window_right, attention_chunk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """(lo, full_lo, full_hi, hi) of the key blocks visible to tile ``pid_m``'s tokens (``group`` query rows,
    a GQA group's heads, per token) and split ``split``'s equal share [s_lo, s_hi) of that band."""
    t_first = (pid_m * BLOCK_M) // group
    t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    lo, full_lo, full_hi, hi = _key_block_ranges(t_first, t_last, seqlen_q, seqlen_k, window_left, window_right,
                                                 BLOCK_N, HAS_LEFT, HAS_RIGHT, attention_chunk, HAS_CHUNK)
    per_split = tl.cdiv(hi - lo, NUM_SPLITS)
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, hi)
    return lo, full_lo, full_hi, hi, s_lo, s_hi


@triton.jit
def _key_offsets(BLOCK_TABLE, b, cache_row, start_n, cols, leftpad, seqlen_k, page_size,
                 stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                 PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr, CHECK_N: tl.constexpr,
                 PAGES_PER_TILE: tl.constexpr = 0):
    """Element offsets (int64, [BLOCK_N]) of keys ``cols`` in the K and V caches.

    Page arithmetic stays in int32 and never divides a vector by the runtime page size: a 64-bit
    division per key costs about as much issue time as the tile's loads in this memory-bound loop.
    Power-of-two pages (PAGE_SHIFT >= 0) use shifts; a tile inside one page needs one scalar divide.
    PAGES_PER_TILE > 0 (power-of-two pages smaller than the tile, no left padding; the launcher's
    rule): an unmasked tile is that many whole pages, so it reads that many table entries, not one
    per key, and spreads them to its keys in registers (tl.gather; a reshape of per-page offsets
    there compiled to unpipelined loads).
    """
    if PAGED and PAGES_PER_TILE > 0 and not CHECK_N:
        # every key of an unmasked tile is below seqlen_k <= capacity: all its pages are in use (and
        # the launcher never sets PAGES_PER_TILE with left padding, which would shift tiles off pages)
        tl.static_assert(PAGE_SHIFT >= 0, "the by-page gather needs power-of-two pages")
        ids = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt_b + (start_n >> PAGE_SHIFT)
                      + tl.arange(0, PAGES_PER_TILE)).to(tl.int64)
        rel = cols - start_n
        page = tl.gather(ids, rel >> PAGE_SHIFT, 0)
        in_page = (rel & ((1 << PAGE_SHIFT) - 1)).to(tl.int64)
        k_off = page * stride_kb + in_page * stride_kn
        v_off = page * stride_vb + in_page * stride_vn
    elif PAGED:
        pos = cols + leftpad  # int32: cache positions are < 2^31
        if PAGE_ALIGNED:
            # the whole tile lies in one page: one table read, offsets inside the page by subtraction
            page_idx = start_n // page_size
            page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt_b + page_idx).to(tl.int64)
            in_page = pos - page_idx * page_size
        else:
            if PAGE_SHIFT >= 0:
                page_idx = pos >> PAGE_SHIFT
            else:
                page_idx = pos // page_size
            in_page = pos - page_idx * page_size
            if CHECK_N:
                page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt_b + page_idx,
                               mask=cols < seqlen_k, other=0).to(tl.int64)
            else:
                page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt_b + page_idx).to(tl.int64)
        # the multiplies in int64: a page-major cache view can have a row stride near 2^31 / page_size
        k_off = page * stride_kb + in_page.to(tl.int64) * stride_kn
        v_off = page * stride_vb + in_page.to(tl.int64) * stride_vn
    else:
        pos = (cols + leftpad).to(tl.int64)
        k_off = cache_row * stride_kb + pos * stride_kn
        v_off = cache_row * stride_vb + pos * stride_vn
    return k_off, v_off
