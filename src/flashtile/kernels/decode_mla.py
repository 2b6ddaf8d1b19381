"""Decode with a value head dim of its own, and multi-head latent attention (MLA) in absorbed form.

DeepSeek's MLA decodes against one latent kv head that every query head shares: k holds the rope part
(d = 64) and v the latent part (dv = 512) of each key, and a query brings ``q`` (h, d) and ``qv`` (h, dv).
The scores are ``(q . k + qv . v) * softmax_scale`` and the output is ``P V`` (h, dv). The value tile is
read once per key block and feeds both the scores (as the second half of the key) and the output.

Decode is bound by reading the cache, so a program owns one (batch row, kv head, key split, block of
query rows), its rows being the ``sq`` new tokens times the query heads of that kv head (row r = token
r // group, head kv_head * group + r % group), as in the split kernel (kernels/decode.py): every query
head of a latent head shares one read of each key block. A block holds at most 64 rows: the fp32
accumulator of 64 rows x 512 latent dims is 128 KB, half an SM's registers, so 128 query heads take two
programs. They are adjacent in the grid (the row block varies fastest) and stream the same keys side by
side, so the second read of a key block comes from L2, not HBM.

``_mla_decode_kernel`` reads lengths on the device and cuts the visible key blocks in three (masked left
edge, unmasked interior, masked right edge) and ``NUM_SPLITS`` ways, as the split kernel does; split
partials are merged by ``kernels/decode.py::_combine_kernel``. Masks, softcap, ALiBi, cache_batch_idx,
left padding, rotary on q (qv is not rotated: it pairs with v) and paged caches of any page size (with the
by-page gather of power-of-two pages smaller than a tile, PAGES_PER_TILE), learnable sinks (HAS_SINK, unsplit
launches; the merge adds it to split ones) and chunks (HAS_CHUNK) are those of the split kernel.
``_kv_append_dv_kernel`` appends new keys (rotated) and values whose head dims differ, before the decode
kernel runs.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels.attn_fwd import _chunk_start, _softmax_init, _softmax_update, _tanh
from flashtile.kernels.decode_keys import _key_offsets, _split_share
from flashtile.kernels.kv_append import _rotary_rows


@triton.jit
def _mla_inner(acc, m_i, l_i, q, qv, K, V, BLOCK_TABLE, b, cache_row, blk_lo, blk_hi, t, slope, offs_n, offs_d,
               offs_dv, leftpad, seqlen_q, seqlen_k, page_size, qk_scale, softcap, window_left, window_right,
               stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
               MASK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr, HAS_QV: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DOT_PRECISION: tl.constexpr, PAGES_PER_TILE: tl.constexpr = 0, chunk=0,
               HAS_CHUNK: tl.constexpr = False):
    """Online softmax (base 2) over key blocks [blk_lo, blk_hi); MASK adds the band, chunk and length masks.

    The value tile [BLOCK_N, BLOCK_DV] is loaded once: transposed, it is the latent half of the key for
    ``qv``; as it is, the right operand of ``P V``."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    BLOCK_DV: tl.constexpr = offs_dv.shape[0]
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    # only the interior loop is pipelined: an edge range holds a few blocks at most (a program's rows span at most
    # 64 tokens), and a pipelined loop's prologue runs even when the loop is empty (kernels/decode.py measured it)
    for blk in tl.range(blk_lo, blk_hi, num_stages=1 if MASK else None):
        start_n = blk * BLOCK_N
        cols = start_n + offs_n
        k_off, v_off = _key_offsets(BLOCK_TABLE, b, cache_row, start_n, cols, leftpad, seqlen_k, page_size,
                                    stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                                    PAGED, PAGE_ALIGNED, PAGE_SHIFT, MASK, PAGES_PER_TILE)
        k_ptrs = K + k_off[None, :] + offs_d[:, None]
        v_ptrs = V + v_off[:, None] + offs_dv[None, :]
        if MASK:
            # slots past a row's length may hold anything (NaN included): they load as 0
            n_ok = cols < seqlen_k
            kt = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            vt = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        else:
            # the head-dim masks only where the tile is wider than the head (a mask costs registers here)
            if BLOCK_D == HEAD_DIM:
                kt = tl.load(k_ptrs)
            else:
                kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            if BLOCK_DV == HEAD_DIM_V:
                vt = tl.load(v_ptrs)
            else:
                vt = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if HAS_QV:
            qk = tl.dot(qv, tl.trans(vt), qk, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            # qk_scale holds scale / softcap here; multiply back by softcap, in the log2 domain
            s = _tanh(qk * qk_scale) * (softcap * 1.4426950408889634)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            dist = tl.abs(t[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).to(tl.float32)
            s = s - (slope * 1.4426950408889634)[:, None] * dist
        if MASK:
            diag = t[:, None] + (seqlen_k - seqlen_q)
            ok = n_ok[None, :]
            if HAS_LEFT:
                ok = ok & (cols[None, :] >= diag - window_left)
            if HAS_RIGHT:
                ok = ok & (cols[None, :] <= diag + window_right)
            if HAS_CHUNK:
                start = _chunk_start(diag, chunk)
                ok = ok & (cols[None, :] >= start) & (cols[None, :] < start + chunk)
            s = tl.where(ok, s, float("-inf"))
        p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc, MASK, 0)
        acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Lengths and window bounds change between calls: not specialised (a captured decode step must not
# depend on them). Strides stay specialised so loads vectorise.
@triton.jit(do_not_specialize=["cache_len_const", "s_new", "window_left", "window_right", "seqlen_q",
                              "seqlen_ro", "num_m_blocks", "attention_chunk"])
def _mla_decode_kernel(
    # pointers (SINK: None unless HAS_SINK)
    Q, QV, K, V, O, LSE, O_PART, LSE_PART, SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, COS, SIN, SINK,
    # scalars (attention_chunk: None unless HAS_CHUNK)
    qk_scale, softcap, window_left, window_right, attention_chunk,
    # sizes
    cache_len_const, s_new, seqlen_q, num_kv_heads, group, page_size, seqlen_ro, num_m_blocks,
    # strides
    stride_qb, stride_qm, stride_qh,
    stride_qvb, stride_qvm, stride_qvh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph,
    stride_bt_b, stride_alibi_b, stride_cos,
    # constexprs
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGED: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr, HAS_QV: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_TOKEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False, PAGES_PER_TILE: tl.constexpr = 0, HAS_SINK: tl.constexpr = False,
    HAS_CHUNK: tl.constexpr = False,
):
    if USE_PDL:
        # launched early (programmatic dependent launch): wait, before the first read, for the kernel before
        # it in the stream (the append, a previous layer's merge) to finish and flush its writes
        gdc_wait()
    # one flat grid axis (axes 1 and 2 are capped at 65535): program =
    # ((b * num_kv_heads + kv_head) * NUM_SPLITS + split) * num_m_blocks + pid_m, the row block fastest, so the
    # programs that read the same keys for different query heads run side by side and share them in L2
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_s = pid // num_m_blocks
    split = pid_s % NUM_SPLITS
    pid_bk = pid_s // NUM_SPLITS
    b = pid_bk // num_kv_heads
    kv_head = pid_bk % num_kv_heads

    if HAS_SEQLENS:
        cache_len = tl.load(SEQLENS + b)
    else:
        cache_len = cache_len_const
    leftpad = cache_len * 0
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD + b)
    seqlen_k = cache_len + s_new - leftpad
    cache_row = b.to(tl.int64)
    if HAS_BATCH_IDX:
        cache_row = tl.load(BATCH_IDX + b).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // group  # query token of each row
    head = kv_head * group + rows % group  # query head of each row
    t64 = t.to(tl.int64)  # element offsets in int64: t * stride can pass 2^31 on large outputs
    head64 = head.to(tl.int64)
    b64 = b.to(tl.int64)
    row_ok = rows < seqlen_q * group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b64 * stride_qb + t64 * stride_qm + head64 * stride_qh
    if ROTARY_DIM > 0:
        if ROTARY_PER_TOKEN:
            pos = cache_len + t
        else:
            pos = cache_len + t * 0  # every query at the first new position (FlashAttention's rule)
        q = _rotary_rows(q_ptrs, offs_d, pos, row_ok, COS, SIN, stride_cos, seqlen_ro, HEAD_DIM, ROTARY_DIM,
                         ROTARY_INTERLEAVED).to(Q.dtype.element_ty)
    else:
        q = tl.load(q_ptrs[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                    other=0.0)
    if HAS_QV:
        qv_ptrs = QV + b64 * stride_qvb + t64 * stride_qvm + head64 * stride_qvh
        qv = tl.load(qv_ptrs[:, None] + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                     other=0.0)
    else:
        qv = q  # unused
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_alibi_b + head, mask=row_ok, other=0.0)

    # visible key blocks of this block's tokens, and this split's equal share of them
    lo, full_lo, full_hi, hi, s_lo, s_hi = _split_share(pid_m, split, group, seqlen_q, seqlen_k, window_left,
                                                        window_right, attention_chunk, BLOCK_M, BLOCK_N, NUM_SPLITS,
                                                        HAS_LEFT, HAS_RIGHT, HAS_CHUNK)

    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    # HAS_SINK: unsplit launches only (the merge adds it to split ones)
    m_i, l_i = _softmax_init(SINK, head, HAS_SINK, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, m_i, l_i = _mla_inner(
        acc, m_i, l_i, q, qv, k_base, v_base, BLOCK_TABLE, b, cache_row, tl.maximum(lo, s_lo),
        tl.minimum(full_lo, s_hi), t, slope, offs_n, offs_d, offs_dv, leftpad, seqlen_q, seqlen_k, page_size,
        qk_scale, softcap, window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
        True, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_QV, HAS_LEFT, HAS_RIGHT,
        HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, chunk=attention_chunk, HAS_CHUNK=HAS_CHUNK)
    acc, m_i, l_i = _mla_inner(
        acc, m_i, l_i, q, qv, k_base, v_base, BLOCK_TABLE, b, cache_row, tl.maximum(full_lo, s_lo),
        tl.minimum(full_hi, s_hi), t, slope, offs_n, offs_d, offs_dv, leftpad, seqlen_q, seqlen_k, page_size,
        qk_scale, softcap, window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
        False, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_QV, HAS_LEFT, HAS_RIGHT,
        HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, PAGES_PER_TILE)
    acc, m_i, l_i = _mla_inner(
        acc, m_i, l_i, q, qv, k_base, v_base, BLOCK_TABLE, b, cache_row, tl.maximum(full_hi, s_lo),
        tl.minimum(hi, s_hi), t, slope, offs_n, offs_d, offs_dv, leftpad, seqlen_q, seqlen_k, page_size,
        qk_scale, softcap, window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
        True, HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_QV, HAS_LEFT, HAS_RIGHT,
        HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, chunk=attention_chunk, HAS_CHUNK=HAS_CHUNK)

    if USE_PDL:
        # the next kernel (the split merge) may start launching; it waits for this grid's end itself
        gdc_launch_dependents()
    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    if NUM_SPLITS == 1:
        # the final result; a row that saw no key gives out 0 and lse +inf (the contract's rule)
        lse = tl.where(empty, float("inf"), lse)
        o_ptrs = O + b64 * stride_ob + t64 * stride_om + head64 * stride_oh
        tl.store(o_ptrs[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(LSE + b64 * stride_lse_b + head64 * stride_lse_h + t64, lse, mask=row_ok)
    else:
        # a partial result; an empty split gets lse -inf, so the merge gives it no weight
        lse = tl.where(empty, float("-inf"), lse)
        o_ptrs = (O_PART + split.to(tl.int64) * stride_ops + b64 * stride_opb + t64 * stride_opm
                  + head64 * stride_oph)
        tl.store(o_ptrs[:, None] + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok)
        tl.store(LSE_PART + split.to(tl.int64) * stride_lps + b64 * stride_lpb + head64 * stride_lph + t64, lse,
                 mask=row_ok)


# Lengths change between calls; specialising on them would only recompile. Strides stay specialised.
@triton.jit(do_not_specialize=["cache_len_const", "s_new", "seqlen_ro", "capacity"])
def _kv_append_dv_kernel(
    # pointers
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, BATCH_IDX, BLOCK_TABLE, COS, SIN,
    # sizes
    cache_len_const, s_new, num_kv_heads, page_size, capacity, seqlen_ro,
    # strides
    stride_knb, stride_knt, stride_knh,
    stride_vnb, stride_vnt, stride_vnh,
    stride_kcb, stride_kcn, stride_kch,
    stride_vcb, stride_vcn, stride_vch,
    stride_bt_b, stride_cos,
    # constexprs
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """One new token of one batch row: all kv heads of its key (rotated, head dim HEAD_DIM) and its value
    (head dim HEAD_DIM_V) into the cache, at absolute position cache_seqlens + t (kernels/kv_append.py's
    layout rules, with a value head dim of its own)."""
    if USE_PDL:
        # a programmatic dependent of the kernel before it: wait for its writes, then let the decode kernel
        # after this one start launching (it waits for this grid's end before its first read)
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)  # flat: pid = b * s_new + t
    t = pid % s_new
    b = pid // s_new
    if HAS_SEQLENS:
        cache_len = tl.load(SEQLENS + b)
    else:
        cache_len = cache_len_const
    pos = cache_len + t
    if pos < capacity:  # a token past the cache's end is dropped, never written out of bounds
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        h_ok = offs_h < num_kv_heads
        b64 = b.to(tl.int64)
        if PAGED:
            page = tl.load(BLOCK_TABLE + b64 * stride_bt_b + pos // page_size).to(tl.int64)
            k_dst = K_CACHE + page * stride_kcb + (pos % page_size) * stride_kcn
            v_dst = V_CACHE + page * stride_vcb + (pos % page_size) * stride_vcn
        else:
            row = b64
            if HAS_BATCH_IDX:
                row = tl.load(BATCH_IDX + b).to(tl.int64)
            k_dst = K_CACHE + row * stride_kcb + pos.to(tl.int64) * stride_kcn
            v_dst = V_CACHE + row * stride_vcb + pos.to(tl.int64) * stride_vcn
        k_mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        k_src = K_NEW + b64 * stride_knb + t.to(tl.int64) * stride_knt + offs_h * stride_knh
        if ROTARY_DIM > 0:
            k = _rotary_rows(k_src, offs_d, pos + offs_h * 0, h_ok, COS, SIN, stride_cos, seqlen_ro,
                             HEAD_DIM, ROTARY_DIM, INTERLEAVED)
        else:
            k = tl.load(k_src[:, None] + offs_d[None, :], mask=k_mask, other=0.0)
        tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(K_CACHE.dtype.element_ty),
                 mask=k_mask)
        v_mask = h_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        v = tl.load(V_NEW + b64 * stride_vnb + t.to(tl.int64) * stride_vnt + offs_h[:, None] * stride_vnh
                    + offs_dv[None, :], mask=v_mask, other=0.0)
        tl.store(v_dst + offs_h[:, None] * stride_vch + offs_dv[None, :], v.to(V_CACHE.dtype.element_ty),
                 mask=v_mask)


# ---------------------------------------------------------------------------------------------
# Tiles: (BLOCK_N, num_warps, num_stages) by (arch, BLOCK_M). Rows a program are sq x (query heads of a kv
# head), padded to a power of two of at least 16 (the smallest MMA tile) and cut at MLA_MAX_BLOCK_M.
# Sized for d = 64, dv = 512 in 2-byte dtypes, the layout DeepSeek's models use: a stage holds BLOCK_N keys
# of K and V, BLOCK_N x 1152 bytes. "interpret" keeps the interpreter fast while crossing several key blocks.
MLA_MAX_BLOCK_M = 64
MLA_CONFIGS = {
    ("sm90", 16): (64, 4, 2),
    ("sm90", 32): (64, 4, 2),
    ("sm90", 64): (64, 8, 2),
    ("default", 16): (32, 4, 2),
    ("default", 32): (32, 4, 2),
    ("default", 64): (32, 8, 2),
    ("interpret", 0): (16, 4, 1),
}


def mla_config(arch: str, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a launch of ``block_m`` query rows a program."""
    if arch == "interpret":
        return MLA_CONFIGS[("interpret", 0)]
    return MLA_CONFIGS.get((arch, block_m), MLA_CONFIGS[("default", block_m)])
