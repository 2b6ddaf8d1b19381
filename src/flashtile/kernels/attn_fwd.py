"""Forward attention kernel: one program computes BLOCK_M query rows of one (batch, head).

The key loop is split into three ranges (see ``_key_block_ranges``): blocks on the left edge of
the band (masked), blocks entirely inside it (no mask work at all), and blocks on its right edge
(masked: the causal diagonal, the window's right bound, the ragged end of the keys). Blocks outside
the band are never visited, so a window of width w costs O(s * w).

Softmax runs in base 2 with the scale folded into one multiply (``exp2``); the accumulator is
fp32 and is normalised once at the end. Dropout draws from a counter-based Philox stream keyed by
(seed, offset, batch*head, row, col), so the backward pass regenerates the same mask.

Beyond FlashAttention 2 (each behind a constexpr whose default compiles to the plain kernel): v may
have its own head dim (HEAD_DIM_V / BLOCK_DV), a learnable sink joins every row's denominator
(HAS_SINK: the running max and sum start from it), and chunked attention limits a row to its
diagonal's chunk of keys (HAS_CHUNK: in the mask and in the block ranges).
"""

import triton
import triton.language as tl

from flashtile.kernels.philox import philox_uniform

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # tanh through exp2 (portable to the interpreter); saturates cleanly to +-1 for large |x|
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tile_coords(seqlen_max, num_heads, group, BLOCK: tl.constexpr):
    """(row block, batch, head, kv head) of this program. The grid is one flat axis (CUDA caps grid
    y/z at 65535, which b * h can exceed) with row blocks varying fastest, so neighbouring programs
    share K/V in L2."""
    return _tile_coords_of(tl.program_id(0), seqlen_max, num_heads, group, BLOCK)


@triton.jit
def _heavy_rows_first(pid_m, seqlen_max, BLOCK: tl.constexpr, HAS_RIGHT: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """Row block to compute for launch-order row block pid_m. Under causal masks and right-only
    windows a query block's work grows with its index (two-sided windows: flat, order is moot), so the last (longest) block starts first and the grid's tail
    is short work, as in the Gluon forward. Only the order the programs start in changes: every block
    is computed the same way, so results are bitwise the same either way."""
    if HEAVY_FIRST and HAS_RIGHT:
        pid_m = tl.maximum(tl.cdiv(seqlen_max, BLOCK), 1) - 1 - pid_m
    return pid_m


@triton.jit
def _tile_coords_of(pid, seqlen_max, num_heads, group, BLOCK: tl.constexpr):
    """_tile_coords of flat program index pid (a kernel whose grid holds two kinds of programs)."""
    num_blocks = tl.maximum(tl.cdiv(seqlen_max, BLOCK), 1)
    pid_bh = pid // num_blocks
    h = pid_bh % num_heads
    return pid % num_blocks, pid_bh // num_heads, h, h // group


@triton.jit
def _sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, seqlen_q, seqlen_k,
                     IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """(first q row, first k row, seqlen_q, seqlen_k) of batch entry b: padded, varlen, seqused."""
    q_row0 = b * 0
    k_row0 = b * 0
    if IS_VARLEN:
        q_row0 = tl.load(CU_SEQLENS_Q + b)
        k_row0 = tl.load(CU_SEQLENS_K + b)
        seqlen_q = tl.load(CU_SEQLENS_Q + b + 1) - q_row0
        seqlen_k = tl.load(CU_SEQLENS_K + b + 1) - k_row0
    if HAS_SEQUSED_Q:
        seqlen_q = tl.minimum(seqlen_q, tl.load(SEQUSED_Q + b))
    if HAS_SEQUSED_K:
        seqlen_k = tl.minimum(seqlen_k, tl.load(SEQUSED_K + b))
    return q_row0, k_row0, seqlen_q, seqlen_k


@triton.jit
def _chunk_start(diag, chunk):
    """First key of diagonal ``diag``'s chunk: diag - diag mod chunk with a floored mod, so a negative
    diagonal (a query above the first key) falls in the chunk below 0. Triton's % truncates toward 0,
    as C's does, hence the correction."""
    r = diag % chunk
    return diag - tl.where(r < 0, r + chunk, r)


# --8<-- [start:key_block_ranges]
@triton.jit
def _key_block_ranges(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right,
                      BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      chunk=0, HAS_CHUNK: tl.constexpr = False):
    """For query rows [first_row, last_row]: key-block indices [lo, full_lo) masked,
    [full_lo, full_hi) unmasked, [full_hi, hi) masked; blocks outside [lo, hi) are invisible.

    A row's first visible key (max of the window's left bound and its chunk's start) and last one
    (min of the window's right bound and its chunk's end) never decrease with the row, so the first
    row bounds the band's left edge and the interior's right edge, the last row the others."""
    shift = seqlen_k - seqlen_q  # bottom-right alignment: row i's diagonal is column i + shift
    lo = 0
    hi = tl.cdiv(seqlen_k, BLOCK_N)
    full_lo = 0
    full_hi = seqlen_k // BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(first_row + shift - window_left, 0) // BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_row + shift - window_left, 0), BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(last_row + shift + window_right + 1, 0), BLOCK_N))
        full_hi = tl.minimum(full_hi, tl.maximum(first_row + shift + window_right + 1, 0) // BLOCK_N)
    if HAS_CHUNK:  # a row sees [c, c + chunk) of its diagonal's chunk start c, on top of the window
        c_first = _chunk_start(first_row + shift, chunk)
        c_last = _chunk_start(last_row + shift, chunk)
        lo = tl.maximum(lo, tl.maximum(c_first, 0) // BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c_last, 0), BLOCK_N))
        hi = tl.minimum(hi, tl.cdiv(tl.maximum(c_last + chunk, 0), BLOCK_N))
        full_hi = tl.minimum(full_hi, tl.maximum(c_first + chunk, 0) // BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
# --8<-- [end:key_block_ranges]


@triton.jit
def _load_k_tile(K, desc_k, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_kn,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, CHECK_N: tl.constexpr):
    """K tile transposed, [BLOCK_D, BLOCK_N]; zeros outside the sequence and past the head dim."""
    # (every path assigns and falls through to one return: the compiler does not prune code after
    # a return inside a constexpr branch)
    if USE_TMA:
        if IS_VARLEN:
            t = desc_k.load([k_row0 + start_n, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            t = desc_k.load([b, start_n, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
        kt = tl.trans(t)
    else:
        ptrs = K + (start_n + offs_n)[None, :] * stride_kn + offs_d[:, None]
        mask = offs_d[:, None] < HEAD_DIM
        if CHECK_N:
            mask = mask & ((start_n + offs_n)[None, :] < seqlen_k)
        kt = tl.load(ptrs, mask=mask, other=0.0)
    return kt


@triton.jit
def _load_v_tile(V, desc_v, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_vn,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, CHECK_N: tl.constexpr):
    """V tile, [BLOCK_N, BLOCK_D]."""
    if USE_TMA:
        if IS_VARLEN:
            v = desc_v.load([k_row0 + start_n, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            v = desc_v.load([b, start_n, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        ptrs = V + (start_n + offs_n)[:, None] * stride_vn + offs_d[None, :]
        mask = offs_d[None, :] < HEAD_DIM
        if CHECK_N:
            mask = mask & ((start_n + offs_n)[:, None] < seqlen_k)
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _scores(q, kt, offs_m, cols, seqlen_q, seqlen_k, qk_scale, softcap, slope, window_left, window_right,
            MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, chunk=0, HAS_CHUNK: tl.constexpr = False):
    """Scores of a tile in the log2 domain (scaled, softcapped, ALiBi-biased, masked to -inf)."""
    qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        # qk_scale already holds scale / softcap; the result is multiplied back by softcap*log2(e)
        s = _tanh(qk * qk_scale) * (softcap * 1.4426950408889634)
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        dist = tl.abs(offs_m[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).to(tl.float32)
        s = s - (slope * 1.4426950408889634) * dist
    if MASK:
        diag = offs_m[:, None] + (seqlen_k - seqlen_q)
        ok = cols[None, :] < seqlen_k
        if HAS_LEFT:
            ok = ok & (cols[None, :] >= diag - window_left)
        if HAS_RIGHT:
            ok = ok & (cols[None, :] <= diag + window_right)
        if HAS_CHUNK:
            start = _chunk_start(diag, chunk)
            ok = ok & (cols[None, :] >= start) & (cols[None, :] < start + chunk)
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _softmax_init(SINK, head, HAS_SINK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The running max and sum (base 2) a row starts its online softmax with. A learnable sink is one more
    logit of every row, with no value: starting the max at it and the sum at its exp2(sink - max) = 1 puts it
    in the denominator (and in lse) for free; a row that sees no key keeps m = sink, l = 1, so lse = sink and
    its output is 0 / 1. Kernels that merge splits afterwards fold the sink in the merge instead."""
    if HAS_SINK:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


# --8<-- [start:softmax_update]
@triton.jit
def _softmax_update(s, m_i, l_i, acc, MASK: tl.constexpr, P_SHIFT: tl.constexpr):
    """One online-softmax step in base 2 over a score tile: returns the tile's probabilities (times
    2**P_SHIFT), the new running max, and the running sum and accumulator rescaled to that max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MASK:
        # a row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if P_SHIFT != 0:
        p = tl.math.exp2(s - (m_use - P_SHIFT)[:, None])
    else:
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]
# --8<-- [end:softmax_update]


@triton.jit
def _attn_fwd_inner(acc, m_i, l_i, q, K, V, desc_k, desc_v, k_row0, kv_head, b, bh, block_lo, block_hi,
                    offs_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_kn, stride_vn,
                    qk_scale, softcap, slope, window_left, window_right, chunk, dropout_p, seed_lo, seed_hi,
                    rng_offset,
                    MASK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_CHUNK: tl.constexpr,
                    PIPELINE_EDGES: tl.constexpr = True):
    """Online-softmax update over key blocks [block_lo, block_hi).

    PIPELINE_EDGES = False (backends/triton/attn_fwd.py edge_setting): a masked range (MASK) loads its few
    blocks directly instead of through the software pipeline, whose prologue runs even when the range is
    empty (docs/forward.md, "Edge ranges load directly at short lengths").
    """
    # --8<-- [start:inner_loop]
    for blk in tl.range(block_lo, block_hi, num_stages=1 if (MASK and not PIPELINE_EDGES) else None):
        start_n = blk * BLOCK_N
        kt = _load_k_tile(K, desc_k, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_kn,
                          HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, MASK)
        cols = start_n + offs_n
        s = _scores(q, kt, offs_m, cols, seqlen_q, seqlen_k, qk_scale, softcap, slope, window_left,
                    window_right, MASK, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, chunk, HAS_CHUNK)
        p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc, MASK, 0)
        if HAS_DROPOUT:
            u = philox_uniform(seed_lo, seed_hi, rng_offset, bh, offs_m[:, None], cols[None, :])
            p = tl.where(u >= dropout_p, p, 0.0)
        v = _load_v_tile(V, desc_v, k_row0, kv_head, b, start_n, offs_n, offs_dv, seqlen_k, stride_vn,
                         HEAD_DIM_V, BLOCK_N, BLOCK_DV, IS_VARLEN, USE_TMA, MASK)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
    # --8<-- [end:inner_loop]


# Lengths and seeds change every call; specialising on them would only recompile. Strides stay
# specialised: an unspecialised batch stride hides the 16-byte alignment of every pointer-path load
# and Triton falls back to 2-byte loads (see kernels/attn_bwd.py).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right", "seed_lo", "seed_hi",
                              "rng_offset", "attention_chunk"])
def _attn_fwd_kernel(
    # pointers (desc_* are tensor descriptors when USE_TMA, else the same tensors again; SINK is None
    # without a sink)
    Q, K, V, O, LSE, PROBS, desc_q, desc_k, desc_v,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, ALIBI, SINK,
    # scalars (attention_chunk is None without a chunk)
    qk_scale, softcap, dropout_p, seed_lo, seed_hi, rng_offset, window_left, window_right, attention_chunk,
    # sizes
    seqlen_q, seqlen_k, num_heads, group,
    # strides
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_alibi_b,
    stride_pb, stride_ph, stride_pm,
    # constexprs
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, RETURN_PROBS: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HEAVY_FIRST: tl.constexpr = False, PIPELINE_EDGES: tl.constexpr = True,
    # v's head dim and its padded tile width; 0: the same as q/k's (HEAD_DIM, BLOCK_D)
    HEAD_DIM_V: tl.constexpr = 0, BLOCK_DV: tl.constexpr = 0,
    HAS_SINK: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False,
):
    HDV: tl.constexpr = HEAD_DIM_V if HEAD_DIM_V > 0 else HEAD_DIM
    BDV: tl.constexpr = BLOCK_DV if BLOCK_DV > 0 else BLOCK_D
    pid_m, b, h, kv_head = _tile_coords(seqlen_q, num_heads, group, BLOCK_M)
    pid_m = _heavy_rows_first(pid_m, seqlen_q, BLOCK_M, HAS_RIGHT, HEAVY_FIRST)

    q_row0, k_row0, seqlen_q, seqlen_k = _sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K,
                                                          seqlen_q, seqlen_k, IS_VARLEN, HAS_SEQUSED_Q,
                                                          HAS_SEQUSED_K)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BDV)
    # 64-bit offsets: packed varlen batches can exceed 2**31 elements
    q_base = Q + b.to(tl.int64) * stride_qb + q_row0.to(tl.int64) * stride_qm + h * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + k_row0.to(tl.int64) * stride_kn + kv_head * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + k_row0.to(tl.int64) * stride_vn + kv_head * stride_vh

    if USE_TMA:
        if IS_VARLEN:
            q = desc_q.load([q_row0 + start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            q = desc_q.load([b, start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_alibi_b + h)
    bh = b * num_heads + h

    m_i, l_i = _softmax_init(SINK, h, HAS_SINK, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BDV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, start_m + BLOCK_M - 1, seqlen_q, seqlen_k, window_left,
                                                 window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT, attention_chunk,
                                                 HAS_CHUNK)
    # left edge of the band (window start), masked
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, k_row0, kv_head, b, bh, lo, full_lo,
        offs_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope,
        window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset,
        True, HEAD_DIM, HDV, BLOCK_N, BLOCK_D, BDV, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK, PIPELINE_EDGES)
    # interior of the band: no masking work
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, k_row0, kv_head, b, bh, full_lo, full_hi,
        offs_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope,
        window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset,
        False, HEAD_DIM, HDV, BLOCK_N, BLOCK_D, BDV, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK)
    # right edge: causal diagonal / window end / ragged end of the keys, masked
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, k_base, v_base, desc_k, desc_v, k_row0, kv_head, b, bh, full_hi, hi,
        offs_m, offs_n, offs_d, offs_dv, seqlen_q, seqlen_k, stride_kn, stride_vn, qk_scale, softcap, slope,
        window_left, window_right, attention_chunk, dropout_p, seed_lo, seed_hi, rng_offset,
        True, HEAD_DIM, HDV, BLOCK_N, BLOCK_D, BDV, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
        HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, HAS_CHUNK, PIPELINE_EDGES)

    # --8<-- [start:epilogue]
    # rows that saw no key: output 0 and lse = +inf (the contract's rule; with a sink l >= 1, see above)
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    row_ok = offs_m < seqlen_q
    o_ptrs = (O + b.to(tl.int64) * stride_ob + q_row0.to(tl.int64) * stride_om + h * stride_oh
              + offs_m[:, None] * stride_om + offs_dv[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HDV))
    lse_ptrs = LSE + b.to(tl.int64) * stride_lse_b + h * stride_lse_h + q_row0 + offs_m
    tl.store(lse_ptrs, lse, mask=row_ok)
    # --8<-- [end:epilogue]

    if RETURN_PROBS:
        # testing aid: normalised probabilities, dropped ones negated (FlashAttention's convention)
        lse2 = lse * 1.4426950408889634
        p_base = PROBS + b.to(tl.int64) * stride_pb + h * stride_ph
        for blk in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
            start_n = blk * BLOCK_N
            cols = start_n + offs_n
            kt = _load_k_tile(k_base, desc_k, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k,
                              stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, False, True)
            s = _scores(q, kt, offs_m, cols, seqlen_q, seqlen_k, qk_scale, softcap, slope, window_left,
                        window_right, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                        attention_chunk, HAS_CHUNK)
            pr = tl.math.exp2(s - lse2[:, None])
            if HAS_DROPOUT:
                u = philox_uniform(seed_lo, seed_hi, rng_offset, bh, offs_m[:, None], cols[None, :])
                pr = tl.where(u >= dropout_p, pr, -pr)
            tl.store(p_base + offs_m[:, None] * stride_pm + cols[None, :], pr,
                     mask=row_ok[:, None] & (cols[None, :] < seqlen_k))


# ---------------------------------------------------------------------------------------------
# Tuning table: (BLOCK_M, BLOCK_N, num_warps, num_stages) keyed by (arch, BLOCK_D bucket, causal).
# sm90 rows: scripts/tune_fwd.py's winners on the H200 (bf16, TMA path; docs/forward.md, "Tuning table");
# "short" rows serve max_seqlen_k <= SHORT_SEQLEN. "interpret" is the tiny config of the CPU tests.
FWD_CONFIGS = {
    ("sm90", 32, False): (128, 64, 4, 3),
    ("sm90", 32, True): (64, 64, 4, 3),
    ("sm90", 64, False, "short"): (64, 64, 4, 3),
    ("sm90", 64, True, "short"): (64, 64, 4, 3),
    ("sm90", 64, False): (128, 64, 4, 3),
    ("sm90", 64, True): (128, 64, 4, 3),
    ("sm90", 128, False, "short"): (64, 64, 4, 3),
    # d=128 causal at s <= 1024: 64-row tiles waste less on the diagonal (2.3x at s = 512, 1.4x at 1024)
    ("sm90", 128, True, "short"): (64, 64, 4, 3),
    ("sm90", 128, False): (128, 128, 8, 3),
    ("sm90", 128, True): (128, 128, 8, 3),
    ("sm90", 256, False): (64, 32, 4, 3),
    ("sm90", 256, True): (64, 32, 4, 3),
    ("default", 32, False): (64, 64, 4, 2),
    ("default", 64, False): (64, 64, 4, 2),
    ("default", 128, False): (64, 64, 4, 2),
    ("default", 256, False): (64, 32, 4, 1),
    ("interpret", 0, False): (16, 16, 4, 1),
}


def fwd_config(arch: str, block_d: int, causal: bool, max_seqlen_k: int = 0, overrides=None):
    """Look up (BLOCK_M, BLOCK_N, num_warps, num_stages) for a head-dim bucket.

    Short sequences (max_seqlen_k <= SHORT_SEQLEN) may have their own row: a key tuple ending in
    "short". ``overrides`` (same keys) wins over the table.
    """
    if arch == "interpret":
        return FWD_CONFIGS[("interpret", 0, False)]
    bucket = 32 if block_d <= 32 else 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    keys = [(arch, bucket, causal)]
    if max_seqlen_k <= SHORT_SEQLEN:
        keys.insert(0, (arch, bucket, causal, "short"))
    for table in (overrides or {}, FWD_CONFIGS):
        for key in keys:
            if key in table:
                return tuple(table[key])
    return FWD_CONFIGS[("default", bucket, False)]


SHORT_SEQLEN = 1024
