"""Split-KV attention over a KV cache ("flash decoding"), and the kernel that merges the splits.

Decode is bound by reading the cache, so the kernel is laid out around that: one program owns one
(split of the keys, block of query rows, batch row, kv head) and its query rows are *all* the
query heads of that kv head times the ``sq`` new tokens (row r = token r // group, head
kv_head * group + r % group). Each key/value byte is then read once per kv head, not once per
query head, and a GQA decode step with a single token still fills a 16-row MMA tile.

The keys of a batch row are ``[0, seqlen_k)`` in *relative* positions (absolute cache position
minus ``cache_leftpad``), with ``seqlen_k = cache_seqlens + s_new - leftpad``; masking and ALiBi
use relative positions, aligned bottom-right as in the prefill kernel. Paged caches map absolute
position p to page ``block_table[b, p // page_size]``, row ``p % page_size``, for any page size:
when pages are whole multiples of the key tile (and there is no left padding) one table entry
serves the tile; power-of-two pages smaller than a tile read one entry per page of an unmasked tile
(PAGES_PER_TILE, the by-page gather); otherwise each key looks its page up.

The band of visible key blocks is cut in three (masked left edge, unmasked interior, masked right
edge, as in ``attn_fwd``) and split ``NUM_SPLITS`` ways, each split taking an equal share of the
row's *actual* blocks (lengths are read on the device, so the grid never depends on them and a
decode step can be captured in a CUDA graph). With one split the kernel writes the final output;
otherwise each split writes fp32 partial output and lse and ``_combine_kernel`` merges them.
New keys are in the cache before the kernel runs (the append kernel, kernels/kv_append.py).

A learnable sink (HAS_SINK, one logit a query head) joins every row's softmax denominator: an unsplit
launch starts each row's running max at it and its running sum at 1, as the prefill kernel does; a
split launch leaves the partials alone and the merge adds the sink once (``_combine_kernel``), so the
key loop costs nothing more either way. A chunk (HAS_CHUNK, Llama 4's chunked attention) is one more
left and right bound of each row's keys, in the band's block ranges and in the edge masks.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels.attn_fwd import _chunk_start, _softmax_init, _softmax_update, _tanh
from flashtile.kernels.decode_keys import _key_offsets, _split_share
from flashtile.kernels.kv_append import _rotary_rows

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _decode_inner(acc, m_i, l_i, q, K, V, DESC_K, DESC_V, kv_head, BLOCK_TABLE, b, cache_row, blk_lo, blk_hi, t,
                  slope, offs_n, offs_d,
                  leftpad, seqlen_q, seqlen_k, page_size, qk_scale, softcap, window_left, window_right,
                  stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                  MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  USE_TMA: tl.constexpr, PAGES_PER_TILE: tl.constexpr = 0, chunk=0,
                  HAS_CHUNK: tl.constexpr = False):
    """Online softmax (base 2) over key blocks [blk_lo, blk_hi); MASK adds the band, chunk and length masks.

    USE_TMA (contiguous or page-aligned caches, unmasked blocks only): K and V tiles come by tensor
    descriptor (DESC_K / DESC_V over the whole (batch, capacity, kv heads, d) cache, or its (pages,
    page_size, kv heads, d) pool) instead of pointer loads.
    Masked blocks keep pointer loads: a descriptor zero-fills only past the cache's capacity, and
    keys between a row's length and the capacity may hold anything (NaN included) that the
    probabilities' zeros would not cancel in P V.
    """
    d_ok = offs_d < HEAD_DIM
    # Only the interior loop is pipelined. The masked edges (MASK: at most two blocks a program, as
    # a program's query rows span at most 64 / group tokens) are too short to overlap anything, and a
    # pipelined loop's prologue runs even when the loop is empty: on the H200 (Nsight Compute's stall
    # samples, b = 1, 8k) the edge loops' prologues were a quarter of the warps' time in a
    # 16-token-page launch, whose edges compute every key's page.
    for blk in tl.range(blk_lo, blk_hi, num_stages=1 if MASK else None):
        start_n = blk * BLOCK_N
        cols = start_n + offs_n
        k_off, v_off = _key_offsets(BLOCK_TABLE, b, cache_row, start_n, cols, leftpad, seqlen_k, page_size,
                                    stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
                                    PAGED, PAGE_ALIGNED, PAGE_SHIFT, MASK, PAGES_PER_TILE)
        if MASK:
            n_ok = cols < seqlen_k
            kt = tl.load(K + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        elif USE_TMA:
            # the descriptor's box is [1, BLOCK_N, 1, BLOCK_D] (BLOCK_D = offs_d's length); V's
            # coordinates are the same
            if PAGED:
                # page-aligned caches only (the launcher's rule): the tile lies in one page, the
                # descriptor spans (pages, page_size, kv heads, d), and there is no left padding
                page_idx = start_n // page_size
                page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt_b + page_idx)
                tma_at = [page, (start_n - page_idx * page_size).to(tl.int32), kv_head, 0]
            else:
                tma_at = [cache_row.to(tl.int32), (start_n + leftpad).to(tl.int32), kv_head, 0]
            kt = tl.trans(DESC_K.load(tma_at).reshape(BLOCK_N, offs_d.shape[0]))
        else:
            kt = tl.load(K + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        # fp8 caches: e4m3 -> fp16 is exact; the descales are folded into qk_scale and the output
        qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)
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
        if MASK:
            vt = tl.load(V + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif USE_TMA:
            vt = DESC_V.load(tma_at).reshape(BLOCK_N, offs_d.shape[0])
        else:
            vt = tl.load(V + v_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(q.dtype), vt.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Lengths and window bounds change between calls; specialising on them would only recompile (and
# would make a captured decode step depend on them). Strides stay specialised so loads vectorise.
@triton.jit(do_not_specialize=["cache_len_const", "s_new", "window_left", "window_right", "seqlen_q",
                              "seqlen_ro", "num_m_blocks", "attention_chunk"])
def _decode_kernel(
    # pointers (SINK: None unless HAS_SINK)
    Q, K, V, O, LSE, O_PART, LSE_PART, SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, COS, SIN,
    Q_DESCALE, K_DESCALE, V_DESCALE, DESC_K, DESC_V, SINK,
    # scalars (attention_chunk: None unless HAS_CHUNK)
    qk_scale, softcap, window_left, window_right, attention_chunk,
    # sizes
    cache_len_const, s_new, seqlen_q, num_kv_heads, group, page_size, seqlen_ro, num_m_blocks,
    # strides
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph,
    stride_bt_b, stride_alibi_b, stride_cos, stride_ds_b,
    # constexprs
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PAGED: tl.constexpr, PAGE_ALIGNED: tl.constexpr, PAGE_SHIFT: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ROTARY_DIM: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr, ROTARY_PER_TOKEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr, USE_PDL: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    PAGES_PER_TILE: tl.constexpr = 0, HAS_SINK: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False,
):
    if USE_PDL:
        # launched early (programmatic dependent launch): wait here, before the first read, until the
        # previous kernel in the stream (an append, a previous layer's merge) has finished and
        # flushed its writes
        gdc_wait()
    # one flat grid axis (CUDA allows 2^31 - 1 programs there, 65535 on axes 1 and 2, which batch *
    # kv heads can exceed): program = ((b * num_kv_heads + kv_head) * num_m_blocks + pid_m) * NUM_SPLITS + split
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    pid_mb = pid // NUM_SPLITS
    pid_m = pid_mb % num_m_blocks
    pid_bk = pid_mb // num_m_blocks
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
    row_ok = rows < seqlen_q * group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + t64 * stride_qm + head64 * stride_qh
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
    v_scale = 1.0
    if IS_FP8:
        # e4m3 q/k/v with per-(batch, kv head) descales: the dots run in fp16 on exactly upcast tiles
        # (decode is bound by reading the cache, which stays fp8); q and k descales scale the scores,
        # the v descale the output
        q = q.to(tl.float16)
        ds = b.to(tl.int64) * stride_ds_b + kv_head
        qk_scale = qk_scale * tl.load(Q_DESCALE + ds) * tl.load(K_DESCALE + ds)
        v_scale = tl.load(V_DESCALE + ds)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_alibi_b + head, mask=row_ok, other=0.0)

    lo, full_lo, full_hi, hi, s_lo, s_hi = _split_share(pid_m, split, group, seqlen_q, seqlen_k, window_left,
                                                        window_right, attention_chunk, BLOCK_M, BLOCK_N, NUM_SPLITS,
                                                        HAS_LEFT, HAS_RIGHT, HAS_CHUNK)

    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    # HAS_SINK: unsplit launches only (split ones fold the sink in the merge)
    m_i, l_i = _softmax_init(SINK, head, HAS_SINK, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _decode_inner(
        acc, m_i, l_i, q, k_base, v_base, DESC_K, DESC_V, kv_head, BLOCK_TABLE, b, cache_row, tl.maximum(lo, s_lo),
        tl.minimum(full_lo, s_hi), t, slope, offs_n, offs_d, leftpad, seqlen_q, seqlen_k, page_size, qk_scale,
        softcap, window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
        True, HEAD_DIM, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        DOT_PRECISION, USE_TMA, chunk=attention_chunk, HAS_CHUNK=HAS_CHUNK)
    acc, m_i, l_i = _decode_inner(
        acc, m_i, l_i, q, k_base, v_base, DESC_K, DESC_V, kv_head, BLOCK_TABLE, b, cache_row,
        tl.maximum(full_lo, s_lo), tl.minimum(full_hi, s_hi), t, slope, offs_n, offs_d, leftpad, seqlen_q, seqlen_k,
        page_size, qk_scale, softcap, window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn,
        stride_bt_b,
        False, HEAD_DIM, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        DOT_PRECISION, USE_TMA, PAGES_PER_TILE)
    acc, m_i, l_i = _decode_inner(
        acc, m_i, l_i, q, k_base, v_base, DESC_K, DESC_V, kv_head, BLOCK_TABLE, b, cache_row, tl.maximum(full_hi, s_lo),
        tl.minimum(hi, s_hi), t, slope, offs_n, offs_d, leftpad, seqlen_q, seqlen_k, page_size, qk_scale, softcap,
        window_left, window_right, stride_kb, stride_kn, stride_vb, stride_vn, stride_bt_b,
        True, HEAD_DIM, BLOCK_N, PAGED, PAGE_ALIGNED, PAGE_SHIFT, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        DOT_PRECISION, USE_TMA, chunk=attention_chunk, HAS_CHUNK=HAS_CHUNK)

    if USE_PDL:
        # the next kernel (the split merge) may start launching; it waits for this grid's end itself
        gdc_launch_dependents()
    empty = l_i == 0.0
    out = acc * (tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i)) * v_scale)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    d_ok = offs_d[None, :] < HEAD_DIM
    if NUM_SPLITS == 1:
        # final result; a row that saw no key gives out 0 and lse +inf (the contract's rule)
        lse = tl.where(empty, float("inf"), lse)
        o_ptrs = O + b.to(tl.int64) * stride_ob + t64 * stride_om + head64 * stride_oh
        tl.store(o_ptrs[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok)
        tl.store(LSE + b.to(tl.int64) * stride_lse_b + head64 * stride_lse_h + t64, lse, mask=row_ok)
    else:
        # partial result; an empty split gets lse -inf so the combine gives it zero weight
        lse = tl.where(empty, float("-inf"), lse)
        o_ptrs = (O_PART + split.to(tl.int64) * stride_ops + b.to(tl.int64) * stride_opb + t64 * stride_opm
                  + head64 * stride_oph)
        tl.store(o_ptrs[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & d_ok)
        tl.store(LSE_PART + split.to(tl.int64) * stride_lps + b.to(tl.int64) * stride_lpb + head64 * stride_lph
                 + t64, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    O_PART, LSE_PART, O, LSE, SINK,
    num_splits, seqlen_q, num_heads,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph, stride_lpm,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h, stride_lse_m,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False,
):
    """out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s, for one (b, token, head).

    HAS_SINK: SINK (h,) holds a learnable sink, one more term of lse with no value (the split kernels
    leave it out of their partials), so lse = logsumexp(lse_s..., sink) and a row no split saw a key
    of gets out 0, lse = sink. Without it SINK is None.

    Flat grid (axis 0): program = (b * seqlen_q + t) * num_heads + h. Offsets are int64: a split's
    stride times the split index passes 2^31 on large partial outputs. USE_PDL: launched early
    behind the split kernel (programmatic dependent launch); it waits for it before reading.
    """
    if USE_PDL:
        gdc_wait()
        # and lets the next kernel (the next layer's decode) start launching behind it
        gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    h = pid % num_heads
    bt = pid // num_heads
    t = bt % seqlen_q
    b = bt // seqlen_q
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    # both loads before any arithmetic: the partial outputs do not depend on the lse values, and
    # written in this order the compiler issues them together (one memory latency, not two, on the
    # path between a layer's decode and the next)
    lse_s = tl.load(LSE_PART + offs_s * stride_lps + b * stride_lpb + h * stride_lph + t * stride_lpm,
                    mask=s_ok, other=float("-inf"))
    o_part = tl.load(O_PART + offs_s[:, None] * stride_ops + b * stride_opb + t * stride_opm + h * stride_oph
                     + offs_d[None, :], mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    lse_max = tl.max(lse_s, 0)
    if HAS_SINK:
        sink = tl.load(SINK + h).to(tl.float32)
        lse_max = tl.maximum(lse_max, sink)
    empty = lse_max == float("-inf")
    w = tl.exp(lse_s - tl.where(empty, 0.0, lse_max))
    w_sum = tl.sum(w, 0)
    if HAS_SINK:
        w_sum += tl.exp(sink - tl.where(empty, 0.0, lse_max))
    out = tl.sum(o_part * w[:, None], 0) / tl.where(empty, 1.0, w_sum)
    # no key and no sink term (a sink of -inf): lse +inf, the contract's rule, or the sink's -inf
    lse = tl.where(empty, sink if HAS_SINK else float("inf"), lse_max + tl.log(tl.where(empty, 1.0, w_sum)))
    tl.store(O + b * stride_ob + t * stride_om + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(LSE + b * stride_lse_b + h * stride_lse_h + t * stride_lse_m, lse)


# ---------------------------------------------------------------------------------------------
# Tuning table: (BLOCK_N, num_warps, num_stages) keyed by (arch, BLOCK_D bucket); "interpret" is a
# tiny config, so the interpreter stays fast while crossing several key blocks and splits.
DECODE_CONFIGS = {
    ("sm90", 32): (128, 4, 3),
    ("sm90", 64): (128, 4, 3),
    # 128-key tiles: 3-5% faster than 64 on contiguous caches and 1.3-1.5x on 16-token pages, where
    # a tile then gathers 8 pages (docs/inference.md, 'Kernels')
    ("sm90", 128): (128, 4, 3),
    ("sm90", 256): (32, 4, 3),
    ("default", 32): (64, 4, 2),
    ("default", 64): (64, 4, 2),
    ("default", 128): (64, 4, 2),
    ("default", 256): (32, 4, 2),
    ("interpret", 0): (16, 4, 1),
}
# Query rows per program are sq * group (tokens x query heads of one kv head), padded to a power of
# two of at least 16 (the smallest MMA tile) and tiled beyond MAX_BLOCK_M.
MAX_BLOCK_M = 64


def decode_config(arch: str, block_d: int) -> tuple[int, int, int]:
    if arch == "interpret":
        return DECODE_CONFIGS[("interpret", 0)]
    bucket = 32 if block_d <= 32 else 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    return DECODE_CONFIGS.get((arch, bucket), DECODE_CONFIGS[("default", bucket)])
