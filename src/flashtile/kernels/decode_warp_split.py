"""The decode kernel's unmasked key blocks with each 128-key tile cut into WARP_SPLIT sub-tiles that keep
their own online softmax (an experiment: FLASHTILE_DECODE_WARP_SPLIT).

In ``_decode_inner`` every tile's score row spans all warps: its max and its sum are reductions across
warps (through shared memory, with a barrier each), and the probabilities go back through shared
memory to become the PV product's operand. Cut the tile into W sub-tiles of BLOCK_N / W keys, laid out
as the batch dimension of 3-D dots, and each warp owns one sub-tile: its max, sum and PV product stay
inside the warp, and the W running states (max, sum, output) are merged once, after the loop, the way
split-KV partial results are. That is how cuDNN's decode kernel splits its warps (16 x 128 x 128 tiles,
warps 1 x 4 x 1 along the keys; docs/decode_tuning_log.md). At b = 32 a program issues its next tile's
copies only after the current tile's arithmetic; a shorter arithmetic phase leaves the copies in
flight longer.

Only the interior (no mask, no new keys) takes it, with pointer loads (contiguous or paged caches);
the masked edges keep ``_decode_inner`` and its (m, l, acc) state, which this merges into.
"""

import triton
import triton.language as tl

from flashtile.kernels.attn_fwd import _tanh
from flashtile.kernels.decode_keys import _key_offsets


@triton.jit
def _decode_interior_warp_split(acc, m_i, l_i, q, K, V, BLOCK_TABLE, b, cache_row, blk_lo, blk_hi, t, slope,
                                offs_d, leftpad, seqlen_q, seqlen_k, page_size, qk_scale, softcap,
                                stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                                PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                                HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr,
                                WARP_SPLIT: tl.constexpr):
    """Online softmax over the unmasked key blocks [blk_lo, blk_hi) in WARP_SPLIT independent sub-tiles,
    merged into (acc, m_i, l_i) at the end; returns the merged state as ``_decode_inner`` does."""
    SUB: tl.constexpr = BLOCK_N // WARP_SPLIT
    BLOCK_M: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    qs = tl.broadcast_to(tl.expand_dims(q, 0), (WARP_SPLIT, BLOCK_M, BLOCK_D))
    ms = tl.full([WARP_SPLIT, BLOCK_M], float("-inf"), dtype=tl.float32)
    ls = tl.zeros([WARP_SPLIT, BLOCK_M], dtype=tl.float32)
    accs = tl.zeros([WARP_SPLIT, BLOCK_M, BLOCK_D], dtype=tl.float32)
    for blk in tl.range(blk_lo, blk_hi):
        start_n = blk * BLOCK_N
        cols = start_n + offs_n
        k_off, v_off = _key_offsets(BLOCK_TABLE, b, cache_row, start_n, cols, leftpad, seqlen_k, page_size,
                                    stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                                    PAGED, PAGE_ALIGNED, PAGE_SHIFT, False, PAGES_PER_TILE)
        # 2-D tile loads, as _decode_inner's (the pipeliner turns them into asynchronous copies; 3-D loads
        # it leaves synchronous), then viewed as WARP_SPLIT sub-tiles
        kt = tl.load(K + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        kt = tl.permute(tl.reshape(kt, (BLOCK_D, WARP_SPLIT, SUB)), (1, 0, 2))
        qk = tl.dot(qs, kt.to(q.dtype), input_precision=DOT_PRECISION)  # (W, BLOCK_M, SUB)
        if HAS_SOFTCAP:
            s = _tanh(qk * qk_scale) * (softcap * 1.4426950408889634)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            cols3 = tl.reshape(cols, (WARP_SPLIT, SUB))
            dist = tl.abs(t[None, :, None] + (seqlen_k - seqlen_q) - cols3[:, None, :]).to(tl.float32)
            s = s - (slope * 1.4426950408889634)[None, :, None] * dist
        # unmasked keys: every score is finite, so the running max is finite from the first tile on
        m_new = tl.maximum(ms, tl.max(s, 2))
        p = tl.math.exp2(s - m_new[:, :, None])
        alpha = tl.math.exp2(ms - m_new)
        ls = ls * alpha + tl.sum(p, 2)
        vt = tl.load(V + v_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        vt = tl.permute(tl.reshape(vt, (BLOCK_D, WARP_SPLIT, SUB)), (1, 2, 0))
        accs = tl.dot(p.to(q.dtype), vt.to(q.dtype), accs * alpha[:, :, None], input_precision=DOT_PRECISION)
        ms = m_new
    # merge the sub-tiles' states and the edges' (either may be empty: m = -inf, l = 0, acc = 0)
    m_all = tl.maximum(m_i, tl.max(ms, 0))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    a_prev = tl.math.exp2(m_i - m_safe)
    a_sub = tl.math.exp2(ms - m_safe[None, :])
    l_i = l_i * a_prev + tl.sum(ls * a_sub, 0)
    acc = acc * a_prev[:, None] + tl.sum(accs * a_sub[:, :, None], 0)
    return acc, m_all, l_i
