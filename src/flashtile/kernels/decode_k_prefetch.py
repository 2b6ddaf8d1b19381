"""The decode kernel's interior loop with K read one key block ahead into registers (an experiment).

At b = 32's 2 stages the software pipeliner gives K and V one shared-memory buffer each, so it can
issue block i + 1's copies only after block i's last read of them: in the sm_90 PTX both copies sit at
the end of the loop body and the next trip waits on them at its top, so a program has nothing in
flight while it computes (cuDNN's decode spreads its copies through the loop body instead). Here K
comes by plain loads into registers, issued a whole block ahead: block i + 1's K is in flight during
block i's dots and softmax, and V keeps the pipeliner's buffer (its copy in flight during the next
block's first dot). Contiguous caches only: a masked-off read of the block past the interior needs
no page-table entry there. ``FLASHTILE_DECODE_K_PREFETCH=1`` turns it on (backends/triton/decode.py).
"""

import triton
import triton.language as tl

from flashtile.kernels.attn_fwd import _softmax_update, _tanh


@triton.jit
def _decode_interior_k_prefetch(acc, m_i, l_i, q, K, V, cache_row, blk_lo, blk_hi, t, slope, offs_n, offs_d,
                                leftpad, seqlen_q, seqlen_k, qk_scale, softcap, stride_kb, stride_kn, stride_vb,
                                stride_vn, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                                HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax (base 2) over the unmasked key blocks [blk_lo, blk_hi) of a contiguous cache;
    the same result as decode._decode_inner with MASK = False."""
    d_ok = offs_d < HEAD_DIM
    k_row = K + cache_row * stride_kb
    v_row = V + cache_row * stride_vb
    # (BLOCK_D, BLOCK_N) K^T tile of block blk_lo; all lanes off when the range is empty
    pos = (blk_lo * BLOCK_N + offs_n + leftpad).to(tl.int64)
    kt_next = tl.load(k_row + pos[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None] & (blk_lo < blk_hi),
                      other=0.0)
    for blk in tl.range(blk_lo, blk_hi):
        kt = kt_next
        cols = blk * BLOCK_N + offs_n
        # the next block's K, in flight through this block's work (off past the range)
        pos_next = (cols + BLOCK_N + leftpad).to(tl.int64)
        kt_next = tl.load(k_row + pos_next[None, :] * stride_kn + offs_d[:, None],
                          mask=d_ok[:, None] & (blk + 1 < blk_hi), other=0.0)
        qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = _tanh(qk * qk_scale) * (softcap * 1.4426950408889634)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            dist = tl.abs(t[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).to(tl.float32)
            s = s - (slope * 1.4426950408889634)[:, None] * dist
        p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc, False, 0)
        pos_v = (cols + leftpad).to(tl.int64)
        vt = tl.load(v_row + pos_v[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(q.dtype), vt.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
