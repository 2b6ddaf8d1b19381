"""Hopper (sm_90) attention forward in Gluon, with FlashAttention-3's intra-warpgroup overlap.

Plain Triton lowers ``tl.dot`` to an async wgmma but waits for QK^T right after issuing it, so the
softmax of a key block runs while the tensor cores sit idle. Gluon exposes the wgmma issue and the
``wgmma.wait_group`` count directly, so this kernel keeps two MMAs in flight across each softmax:

    iteration j (S_j = Q K_j^T is in registers; O += P_{j-1} V_{j-1} is still running)
      issue  S_{j+1} = Q K_{j+1}^T            in flight: PV_{j-1}, S_{j+1}
      softmax(S_j) -> P_j, alpha_j            <- runs under both MMAs
      wait(0)                                 PV_{j-1} and S_{j+1} retired
      refill the ring slot of block j-1; O *= alpha_j
      issue  O += P_j V_j                     in flight into iteration j+1

One CTA owns BLOCK_M query rows of one (batch, head); all its warps compute (no producer warp):
the TMA loads are issued by the same warps, ahead of use, into a NUM_BUFFERS-deep ring of K/V
tiles. The body (``_attn_fwd_tile``) serves two entry points: ``_gluon_attn_fwd_kernel`` here
(bf16 / fp16, V as (b, s, h_k, d)) and ``_gluon_attn_fwd_fp8_kernel`` in ``gluon_fwd_fp8.py`` (e4m3,
V transposed, descales, P quantised to e4m3). See docs/gluon.md for the full picture, the ptxas
constraints that shaped it, and what is not done.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.constexpr_function
def mma_layout(num_warps, n, k):
    # every warp takes 16 rows; a warpgroup (4 warps) issues one wgmma over its 64 rows, and
    # several warpgroups split BLOCK_M rather than N so that row reductions stay inside one warp.
    # k is the instruction's reduction width: 32 bytes of operand (16 for 16-bit types, 32 for fp8)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, k])


@gluon.jit
def _sequence(CU_SEQLENS, off_b, seqlen, VARLEN: gl.constexpr):
    """(seq0, seqlen, tb) of batch entry ``off_b``: the first row of its sequence in the (packed) tensors, its
    length, and the descriptors' batch coordinate (VARLEN: one packed sequence of all the tokens, found in
    CU_SEQLENS; else the padded batch entry itself, ``seqlen`` long)."""
    seq0 = 0
    tb = off_b
    if VARLEN:
        seq0 = gl.load(CU_SEQLENS + off_b)
        seqlen = gl.load(CU_SEQLENS + off_b + 1) - seq0
        tb = 0
    return seq0, seqlen, tb


# --8<-- [start:load_kv]
@gluon.jit
def _load_k(desc_k, desc_k2, k_smem, k2_smem, k_ready, block, off_b, off_hk, NUM_BUFFERS: gl.constexpr,
            BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, key0=0, seq0=0):
    # K and V sit in rings of their own with a barrier a slot, so QK^T of a block never waits for that
    # block's V, and a K slot refills as soon as its S retires (two iterations before that block's V is
    # done). A split head dim (SPLIT: K's tail columns through their own descriptor) lands both parts on
    # the slot's one barrier.
    slot = block % NUM_BUFFERS
    if SPLIT:
        mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes + desc_k2.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k2, [off_b, seq0 + key0 + block * BLOCK_N, off_hk, 0], k_ready.index(slot),
                                        k2_smem.index(slot))
    else:
        mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [off_b, seq0 + key0 + block * BLOCK_N, off_hk, 0], k_ready.index(slot),
                                    k_smem.index(slot))


@gluon.jit
def _load_v(desc_v, v_smem, v_ready, block, off_b, off_hk, NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr,
            V_TRANSPOSED: gl.constexpr, key0=0, seq0=0):
    slot = block % NUM_BUFFERS
    mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
    if V_TRANSPOSED:
        # V^T (b, h_k, d, sk): the block is [1, 1, d, BLOCK_N], keys contiguous
        tma.async_copy_global_to_shared(desc_v, [off_b, off_hk, 0, key0 + block * BLOCK_N], v_ready.index(slot),
                                        v_smem.index(slot))
    else:
        tma.async_copy_global_to_shared(desc_v, [off_b, seq0 + key0 + block * BLOCK_N, off_hk, 0], v_ready.index(slot),
                                        v_smem.index(slot))
# --8<-- [end:load_kv]


# --8<-- [start:ring_barriers]
@gluon.jit
def _ring_barriers(NUM_BUFFERS: gl.constexpr):
    """Q's barrier and one a slot of the K and V rings (count 1: one expect a use), initialised and fenced."""
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    # barrier initialisation must be visible to the TMA unit (async proxy) before it signals them
    fence_async_shared()
    return q_ready, k_ready, v_ready
# --8<-- [end:ring_barriers]


@gluon.jit
def _invalidate_rings(q_ready, k_ready, v_ready, NUM_BUFFERS: gl.constexpr):
    mbarrier.invalidate(q_ready)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))


# --8<-- [start:issue_qk]
@gluon.jit
def _issue_qk(q_tile, q2_tile, k_smem, k2_smem, k_ready, block, s_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr):
    slot = block % NUM_BUFFERS
    # each slot's barrier completes once per use of the slot: its parity flips every NUM_BUFFERS blocks
    mbarrier.wait(k_ready.index(slot), (block // NUM_BUFFERS) & 1)
    k_tile = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    # use_acc=False: the hardware ignores the accumulator, so no zero fill is paid per block
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = warpgroup_mma(q_tile, k_tile.permute((1, 0)), acc, use_acc=False, is_async=True)
    acc2 = acc
    if HEAD_DIM_TAIL > 0:
        # the tail columns' scores go to an accumulator of their own, added after the wait: chained into
        # acc, ptxas waits for the pair right after issuing it and the softmax no longer overlaps them
        k2_tile = k2_smem.index(slot).reshape([BLOCK_N, HEAD_DIM_TAIL])
        acc2 = warpgroup_mma(q2_tile, k2_tile.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                             use_acc=False, is_async=True)
    return acc, acc2
# --8<-- [end:issue_qk]


@gluon.jit
def _issue_pv(p, v_smem, v_ready, o, block, NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM_V: gl.constexpr, V_TRANSPOSED: gl.constexpr):
    slot = block % NUM_BUFFERS
    mbarrier.wait(v_ready.index(slot), (block // NUM_BUFFERS) & 1)
    if V_TRANSPOSED:
        # fp8 wgmma reads B K-major only: V^T's tile [d, BLOCK_N] (keys contiguous) seen as [BLOCK_N, d]
        v_tile = v_smem.index(slot).reshape([HEAD_DIM_V, BLOCK_N]).permute((1, 0))
    else:
        v_tile = v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM_V])
    # P stays in registers as wgmma's A operand: FlashAttention-3's trick that saves the smem round trip
    return warpgroup_mma(p, v_tile, o, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_i, block, row_idx, seqlen, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, MASK: gl.constexpr, P_SHIFT: gl.constexpr, key0=0, window_left=0,
                  LOCAL: gl.constexpr = False, softcap_log2e=0.0, SOFTCAP: gl.constexpr = False,
                  alibi_log2e=0.0, ALIBI: gl.constexpr = False, row0=0, EMPTY_ROWS: gl.constexpr = False):
    """Online softmax of one key block in base 2; returns unnormalised P (fp32, times 2**P_SHIFT),
    alpha and the new stats. ``row_idx``: each row's diagonal key (its index when q and k have one length);
    ``seqlen``: the keys. Block numbers count from key ``key0``; LOCAL also hides keys more than
    ``window_left`` before the row (a causal sliding window). SOFTCAP: scores become
    ``softcap * tanh(score * softmax_scale / softcap)`` (qk_scale is then softmax_scale / softcap and
    softcap_log2e is softcap * log2(e)), capped before the mask, as FlashAttention does. ALIBI (causal):
    the bias ``-slope * |row - key|`` after the cap (alibi_log2e = slope * log2(e)), less its per-row part
    ``slope * (row - row0)``, which the caller restores. EMPTY_ROWS: a row may see no key of this block or
    any before it (packed sequences with k of their own lengths: rows above k's diagonal, or no keys), so
    its max may still be -inf, guarded as LOCAL's."""
    # MASK is a compile-time choice (two copies of the loop), not a runtime branch: ptxas answers a
    # branch joining inside the softmax with a full wgmma wait at the join, which kills the overlap
    if SOFTCAP:
        # tanh through exp2 (the Triton kernel's form), then in base-2 units: the exponent needs no scale
        s = (1.0 - 2.0 / (gl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)) * softcap_log2e
        qk_scale = 1.0
    col = key0 + block * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    if ALIBI:
        # causal only (q and k of one length): on every visible key -slope * |row - key| = slope * (key - row).
        # The row's part is one constant per row, which the softmax does not see (the tile adds it back to the
        # lse and the sink), so a score gains slope * (key - row0) alone: one add, in base-2 units after the
        # scale, small near the diagonal (row0: the tile's first row)
        s = s * qk_scale + gl.expand_dims(alibi_log2e * (col - row0).to(gl.float32), 0)
        qk_scale = 1.0
    if MASK:
        keep = gl.expand_dims(col < seqlen, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(col, 0) <= gl.expand_dims(row_idx, 1))
        if LOCAL:
            keep = keep & (gl.expand_dims(col, 0) >= gl.expand_dims(row_idx - window_left, 1))
        s = gl.where(keep, s, float("-inf"))
    # the scale is folded into the exponent (one FMA per element) instead of a pass over S
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_base = m_new
    if LOCAL or EMPTY_ROWS:
        # a window's first blocks can hide every key of a row: its max is still -inf, and subtracting 0
        # instead keeps P and alpha at 0 rather than NaN (the row's own key arrives in a later block)
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    if P_SHIFT != 0:
        # fp8: P scaled so the row max maps to 2**P_SHIFT (free: it rides on the max subtraction)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_base - P_SHIFT, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_base, 1))
    # without a window (or k's own sequences: EMPTY_ROWS, guarded above), key 0 is visible to every row, so m_new
    # is finite from the first block on
    alpha = gl.exp2(m_i - m_base)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, block, o_layout: gl.constexpr, p_layout: gl.constexpr,
                          NUM_BUFFERS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                          V_TRANSPOSED: gl.constexpr):
    # O must be rescaled in registers before the wgmma accumulates into it: only legal once the
    # previous PV has retired, which is why every caller waits first
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    # P in V's dtype (bf16, fp16, or e4m3 with round-to-nearest-even as in the Triton fp8 kernel)
    p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return _issue_pv(p, v_smem, v_ready, o, block, NUM_BUFFERS, BLOCK_N, HEAD_DIM_V, V_TRANSPOSED), p


# --8<-- [start:key_block]
@gluon.jit
def _key_block(j, s, o, p_prev, m_i, l_i, q_tile, q2_tile, k_smem, k2_smem, v_smem, k_ready, v_ready, desc_k,
               desc_k2, desc_v, off_b, off_hk, n_blocks, row_idx, seqlen, qk_scale, s_layout: gl.constexpr,
               o_layout: gl.constexpr, p_layout: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
               HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
               CAUSAL: gl.constexpr, MASK: gl.constexpr, P_SHIFT: gl.constexpr, V_TRANSPOSED: gl.constexpr,
               key0=0, window_left=0, LOCAL: gl.constexpr = False, softcap_log2e=0.0,
               SOFTCAP: gl.constexpr = False, seq0=0, alibi_log2e=0.0, ALIBI: gl.constexpr = False, row0=0,
               EMPTY_ROWS: gl.constexpr = False, KV_LENS=None, batch=0):
    """One steady-state iteration: S_j is in registers, PV_{j-1} is in flight, block j+1 exists (block
    numbers count from key ``key0``; ``seq0``: the keys' first row in the packed tensors). EMPTY_ROWS: k's own
    sequences, whose length ``seqlen`` is read again from KV_LENS[batch] (see _attn_fwd_tile)."""
    s_next, s_tail = _issue_qk(q_tile, q2_tile, k_smem, k2_smem, k_ready, j + 1, s_layout, NUM_BUFFERS, BLOCK_M,
                               BLOCK_N, HEAD_DIM, HEAD_DIM_TAIL)
    if EMPTY_ROWS:
        seqlen = gl.load(KV_LENS + batch, volatile=True)
    # the tensor cores now hold PV_{j-1} and QK^T_{j+1}: this softmax runs under both
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, row_idx, seqlen, qk_scale, s_layout, BLOCK_N, CAUSAL, MASK,
                                       P_SHIFT, key0, window_left, LOCAL, softcap_log2e, SOFTCAP, alibi_log2e, ALIBI,
                                       row0, EMPTY_ROWS)
    # one full wait for both. Finer waits (wait(1) for PV_{j-1} here, wait(1) for S_{j+1} after
    # issuing PV_j) made ptxas serialise every wgmma in the kernel (C7514); see docs/gluon.md
    # p_prev is PV_{j-1}'s A operand: naming it here keeps its registers untouched until retirement
    if V_TRANSPOSED:
        # fp8: Triton 3.6 cannot lower 8-bit wait deps ("Unexpected bitwidth in WGMMAWaitGroupOp: 8").
        # P_{j-1}'s packed registers are protected by ptxas's own wgmma register tracking instead
        # (a hazard would make it serialise, which the compile test rejects)
        o, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(o, s_next))
    else:
        if HEAD_DIM_TAIL > 0:
            o, p_prev, s_next, s_tail = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_prev, s_next, s_tail))
            s_next = s_next + s_tail
        else:
            o, p_prev, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_prev, s_next))
    # S_{j+1} retired, so block j+1's K slot is free; PV_{j-1} too, so block j-1's V slot is: each ring refills
    # its own slot. The CTA-wide barrier Triton puts before a TMA issue also covers the other warpgroup's reads.
    if j + 1 + NUM_BUFFERS < n_blocks:
        _load_k(desc_k, desc_k2, k_smem, k2_smem, k_ready, j + 1 + NUM_BUFFERS, off_b, off_hk, NUM_BUFFERS, BLOCK_N,
                HEAD_DIM_TAIL > 0, key0, seq0)
    if (j >= 1) & (j - 1 + NUM_BUFFERS < n_blocks):
        _load_v(desc_v, v_smem, v_ready, j - 1 + NUM_BUFFERS, off_b, off_hk, NUM_BUFFERS, BLOCK_N, V_TRANSPOSED,
                key0, seq0)
    # PV_j stays in flight into the next iteration's softmax
    o, p = _rescale_and_issue_pv(o, p, alpha, v_smem, v_ready, j, o_layout, p_layout, NUM_BUFFERS, BLOCK_N,
                                 HEAD_DIM_V, V_TRANSPOSED)
    return s_next, o, p, m_i, l_i
# --8<-- [end:key_block]


@gluon.jit
def _attn_fwd_tile(desc_q, desc_q2, desc_k, desc_k2, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads,
                   heads_per_kv, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, SINK, HEAD_DIM: gl.constexpr,
                   HEAD_DIM_TAIL: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr,
                   HAS_Q_DESCALE: gl.constexpr, HAS_K_DESCALE: gl.constexpr, HAS_V_DESCALE: gl.constexpr,
                   HAS_SINK: gl.constexpr, window_left=0, LOCAL: gl.constexpr = False, softcap_log2e=0.0,
                   SOFTCAP: gl.constexpr = False, CU_SEQLENS=None, OUT=None, stride_om=0, stride_oh=0,
                   VARLEN: gl.constexpr = False, ALIBI_SLOPES=None, stride_ab=0, ALIBI: gl.constexpr = False,
                   seqlen_k=0, UNEQUAL: gl.constexpr = False, CU_SEQLENS_K=None, KV_LENS=None,
                   VARLEN_K: gl.constexpr = False):
    """The whole forward of one (query tile, batch, head). LOCAL (with CAUSAL): a causal sliding window, each
    row seeing its own key and the ``window_left`` before it. SOFTCAP: capped scores (_softmax_step). FP8
    switches on V^T, the descales (contiguous (b, h_k) fp32), P in e4m3 scaled by 2**8, and a bf16 output
    staged in its own buffer. HAS_SINK adds the head's learnable sink logit (SINK, (h,)) to every row's
    denominator. VARLEN: packed sequences (descriptors over (1, total, h, d), CU_SEQLENS (b + 1,) int32
    shared by q and k, the lse (h, total)); a tile's rows and keys count from its sequence's start, and a
    last tile that ends past its sequence stores O row by row (OUT, stride_om, stride_oh) instead of by TMA,
    which would overwrite the next sequence's rows. ALIBI (with CAUSAL): the slope of (batch, head) from
    ALIBI_SLOPES (stride_ab between batch rows, 0 for one (h,) vector) biases every score by
    ``-slope * |row - key|``. UNEQUAL (padded calls): k's length ``seqlen_k`` differs from q's ``seqlen``,
    and row r's diagonal key is r + seqlen_k - seqlen (bottom-right causal, FlashAttention's alignment; the
    caller keeps seqlen_k >= seqlen under CAUSAL, so every row sees a key). A build of its own: the two
    lengths and the shift cost the tightest builds (d = 128 with a window) a spill. VARLEN_K (with VARLEN):
    k has sequences of its own starting at CU_SEQLENS_K[b], KV_LENS[b] keys long (seqused_k, or the
    cu_seqlens_k differences); masks align bottom-right per sequence, and a row that sees no key (above k's
    diagonal when causal, or a sequence without keys) gets out 0 and lse +inf, as FlashAttention's.

    q / k's head dim is HEAD_DIM + HEAD_DIM_TAIL: Gluon tiles are powers of two, so a head dim such as
    192 arrives as two column ranges (desc_q / desc_k the first HEAD_DIM columns, desc_q2 / desc_k2 the
    HEAD_DIM_TAIL after them; with no tail they repeat desc_q / desc_k and go unused) whose QK^T
    wgmmas accumulate into one score tile. v's and out's head dim is HEAD_DIM_V."""
    SPLIT: gl.constexpr = HEAD_DIM_TAIL > 0
    # iteration j loads V of block j-1+NUM_BUFFERS (into the slot PV_{j-1} just freed), which PV reads in iteration
    # j-1+NUM_BUFFERS: a single slot would make every V copy wait in the iteration that issues it
    gl.static_assert(NUM_BUFFERS >= 2)
    # ALiBi's bias is linear in the key only where every visible key is left of the row (_softmax_step)
    gl.static_assert(CAUSAL or not ALIBI)
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # wgmma's reduction step is 32 bytes: 16 elements of a 16-bit type, 32 of fp8
    MMA_K: gl.constexpr = 32 if FP8 else 16
    # the e4m3 A operand packs 4 elements per 32-bit register, a 16-bit one 2
    K_WIDTH: gl.constexpr = 4 if FP8 else 2
    # fp8: P in [0, 2**8] (exact max 256 < 448) keeps small probabilities out of e4m3's subnormals
    P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, MMA_K)
    o_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM_V, MMA_K)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_bh = gl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    off_hk = off_h // heads_per_kv
    seq0, seqlen, tb = _sequence(CU_SEQLENS, off_b, seqlen, VARLEN)
    # kv_len: the keys; shift: how far right of its own row index a row's diagonal key sits
    kv_len = seqlen
    shift = 0
    if UNEQUAL:
        kv_len = seqlen_k
        shift = seqlen_k - seqlen
    kseq0 = seq0
    if VARLEN_K:
        # kv_len is read again where the masked blocks need it (_key_block): live across the key loop beside q's
        # length it cost the d = 128 causal build its overlap at 255 registers
        kseq0 = gl.load(CU_SEQLENS_K + off_b)
        kv_len = gl.load(KV_LENS + off_b)
        shift = kv_len - seqlen
    n_m_blocks = gl.cdiv(seqlen, BLOCK_M)
    pid_m = gl.program_id(0)
    if VARLEN:
        # the grid covers the longest sequence: programs past this one's tiles have nothing to do
        if pid_m >= n_m_blocks:
            return
    if CAUSAL:
        # the longest (bottom) query tiles start first: the tail of the grid is then short work
        pid_m = n_m_blocks - 1 - pid_m
    m0 = pid_m * BLOCK_M
    if VARLEN_K:
        # no key at all for this tile (a sequence without keys, or every row above k's diagonal): out 0, lse +inf,
        # before any barrier or copy (the key loop below always runs its first block)
        nothing = kv_len <= 0
        if CAUSAL:
            nothing = nothing | (m0 + shift + BLOCK_M <= 0)
        if nothing:
            rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
            cols = gl.arange(0, HEAD_DIM_V, gl.SliceLayout(0, o_layout))
            ptrs = (OUT + gl.expand_dims((seq0 + rows).to(gl.int64) * stride_om, 1) + off_h * stride_oh
                    + gl.expand_dims(cols, 0))
            gl.store(ptrs, gl.zeros([BLOCK_M, HEAD_DIM_V], OUT.dtype.element_ty, o_layout),
                     mask=gl.expand_dims(rows < seqlen, 1))
            gl.store(LSE + off_b * stride_lb + off_h * stride_lh + seq0 + rows,
                     gl.full([BLOCK_M], float("inf"), gl.float32, gl.SliceLayout(1, o_layout)), mask=rows < seqlen)
            return

    # descales of this (batch, kv head): q's and k's fold into the score multiplier, v's into the end
    # (the Triton fp8 kernel's order, so the two agree to the rounding of one product)
    kv_index = off_b * (n_heads // heads_per_kv) + off_hk
    if HAS_Q_DESCALE:
        qk_scale = qk_scale * gl.load(Q_DESCALE + kv_index)
    if HAS_K_DESCALE:
        qk_scale = qk_scale * gl.load(K_DESCALE + kv_index)
    alibi_log2e = 0.0
    if ALIBI:
        alibi_log2e = gl.load(ALIBI_SLOPES + off_b * stride_ab + off_h) * 1.4426950408889634
    v_scale = 1.0
    if HAS_V_DESCALE:
        v_scale = gl.load(V_DESCALE + kv_index)

    # --8<-- [start:smem_and_barriers]
    # shared memory: Q (16-bit: later reused to stage O), a ring of K and V tiles, one barrier per tile.
    # The 4-D block [1, rows, 1, d] is what the (b, s, h, d) descriptors move; MMAs see a 2-D view.
    q_smem = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    q2_smem = q_smem
    k2_smem = k_smem
    if SPLIT:
        q2_smem = gl.allocate_shared_memory(desc_q2.dtype, desc_q2.block_type.shape, desc_q2.layout)
        k2_smem = gl.allocate_shared_memory(desc_k2.dtype, [NUM_BUFFERS] + desc_k2.block_type.shape,
                                            desc_k2.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    q_ready, k_ready, v_ready = _ring_barriers(NUM_BUFFERS)
    # --8<-- [end:smem_and_barriers]

    # key0: the first key of block 0. A window starts the key loop at the first block any row of the tile
    # sees; block numbers below count from there, so the ring's slots and barrier phases start at 0 as always
    key0 = 0
    n_left = 0
    # d0: the diagonal key of the tile's first row
    d0 = m0 + shift
    if CAUSAL:
        # keys past the tile's last diagonal are never visible: those blocks are skipped, not masked
        n_blocks = gl.cdiv(gl.minimum(kv_len, d0 + BLOCK_M), BLOCK_N)
        # blocks whose every key is <= the tile's first diagonal (and inside the keys) need no mask
        n_unmasked = gl.minimum((d0 + 1) // BLOCK_N, kv_len // BLOCK_N)
        if LOCAL:
            first = gl.maximum(d0 - window_left, 0) // BLOCK_N
            key0 = first * BLOCK_N
            n_blocks = n_blocks - first
            n_unmasked = n_unmasked - first
            # the blocks before the first one that every row of the tile sees whole: masked on the left
            n_left = gl.cdiv(gl.maximum(d0 + BLOCK_M - 1 - window_left, 0), BLOCK_N) - first
    else:
        n_blocks = gl.cdiv(kv_len, BLOCK_N)
        n_unmasked = kv_len // BLOCK_N
    if VARLEN_K:
        # k shorter than q in a sequence puts the tile's first diagonal left of key 0
        n_unmasked = gl.maximum(n_unmasked, 0)

    if SPLIT:
        mbarrier.expect(q_ready, desc_q.block_type.nbytes + desc_q2.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q2, [tb, seq0 + m0, off_h, 0], q_ready, q2_smem)
    else:
        mbarrier.expect(q_ready, desc_q.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [tb, seq0 + m0, off_h, 0], q_ready, q_smem)
    # fill both rings; later refills happen inside the loop as slots drain
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_blocks:
            _load_k(desc_k, desc_k2, k_smem, k2_smem, k_ready, i, tb, off_hk, NUM_BUFFERS, BLOCK_N, SPLIT, key0, kseq0)
            _load_v(desc_v, v_smem, v_ready, i, tb, off_hk, NUM_BUFFERS, BLOCK_N, FP8, key0, kseq0)

    q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
    q2_tile = q_tile
    if SPLIT:
        q2_tile = q2_smem.reshape([BLOCK_M, HEAD_DIM_TAIL])
    mbarrier.wait(q_ready, 0)

    # the key loop masks by each row's diagonal key
    diag = d0 + gl.arange(0, BLOCK_M, row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    # O is carried across iterations as an in-flight accumulator (PV_j completes in iteration j+1)
    o = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, o_layout))
    # P_{j-1} feeds the PV wgmma still in flight: it must stay alive (in registers) until that wgmma
    # retires, which is what passing it through warpgroup_mma_wait's deps guarantees
    p = gl.zeros([BLOCK_M, BLOCK_N], desc_v.dtype, p_layout)

    s, s_tail = _issue_qk(q_tile, q2_tile, k_smem, k2_smem, k_ready, 0, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N,
                          HEAD_DIM, HEAD_DIM_TAIL)
    if HEAD_DIM_TAIL > 0:
        s, s_tail = warpgroup_mma_wait(num_outstanding=0, deps=(s, s_tail))
        s = s + s_tail
    else:
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    # S_0 retired: K slot 0 takes block NUM_BUFFERS (iteration j refills block j+1+NUM_BUFFERS)
    if NUM_BUFFERS < n_blocks:
        _load_k(desc_k, desc_k2, k_smem, k2_smem, k_ready, NUM_BUFFERS, tb, off_hk, NUM_BUFFERS, BLOCK_N, SPLIT, key0,
                kseq0)

    # every block but the last, in copies of the same pipelined loop (the unmasked one without LOCAL: every row
    # sees all of such a block's keys, so its max is finite and the window's -inf guard would only cost the
    # overlap, which ptxas then dropped): first the blocks that need no mask,
    # then the diagonal / ragged ones (a window first runs its left-edge blocks masked). The pipeline state
    # (S_j ready, PV_{j-1} in flight) flows from one loop into the next unchanged.
    n_steady = n_blocks - 1
    n_fast = gl.minimum(n_unmasked, n_steady)
    if LOCAL:
        n_left = gl.minimum(gl.maximum(n_left, 0), n_steady)
        n_fast = gl.maximum(n_fast, n_left)
        for j in range(0, n_left):
            s, o, p, m_i, l_i = _key_block(j, s, o, p, m_i, l_i, q_tile, q2_tile, k_smem, k2_smem, v_smem, k_ready,
                                           v_ready, desc_k, desc_k2, desc_v, tb, off_hk, n_blocks, diag,
                                           kv_len, qk_scale, s_layout, o_layout, p_layout, HEAD_DIM, HEAD_DIM_TAIL,
                                           HEAD_DIM_V, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, True, P_SHIFT, FP8,
                                           key0, window_left, LOCAL, softcap_log2e, SOFTCAP, kseq0,
                                           alibi_log2e, ALIBI, d0, VARLEN_K, KV_LENS, off_b)
    for j in range(n_left, n_fast):
        s, o, p, m_i, l_i = _key_block(j, s, o, p, m_i, l_i, q_tile, q2_tile, k_smem, k2_smem, v_smem, k_ready,
                                       v_ready, desc_k, desc_k2, desc_v, tb, off_hk, n_blocks, diag, kv_len,
                                       qk_scale, s_layout, o_layout, p_layout, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V,
                                       BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, False, P_SHIFT, FP8, key0,
                                       window_left, False, softcap_log2e, SOFTCAP, kseq0,
                                           alibi_log2e, ALIBI, d0)
    for j in range(n_fast, n_steady):
        s, o, p, m_i, l_i = _key_block(j, s, o, p, m_i, l_i, q_tile, q2_tile, k_smem, k2_smem, v_smem, k_ready,
                                       v_ready, desc_k, desc_k2, desc_v, tb, off_hk, n_blocks, diag, kv_len,
                                       qk_scale, s_layout, o_layout, p_layout, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V,
                                       BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, True, P_SHIFT, FP8, key0,
                                       window_left, LOCAL, softcap_log2e, SOFTCAP, kseq0,
                                           alibi_log2e, ALIBI, d0, VARLEN_K, KV_LENS, off_b)

    # last block: no QK^T left to issue. ptxas puts a full wgmma wait at this loop exit, so this
    # softmax does not overlap PV of the block before (one exposed softmax per CTA). Masking it
    # unconditionally is correct (a no-op when the block is full) and keeps the code branch-free.
    last = n_blocks - 1
    if VARLEN_K:
        kv_len = gl.load(KV_LENS + off_b, volatile=True)
    p_last, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, last, diag, kv_len, qk_scale, s_layout, BLOCK_N, CAUSAL,
                                            True, P_SHIFT, key0, window_left, LOCAL, softcap_log2e, SOFTCAP,
                                            alibi_log2e, ALIBI, d0, VARLEN_K)
    if FP8:
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    else:
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
    o, p_last = _rescale_and_issue_pv(o, p_last, alpha, v_smem, v_ready, last, o_layout, p_layout, NUM_BUFFERS,
                                      BLOCK_N, HEAD_DIM_V, FP8)
    if FP8:
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    else:
        o, p_last = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_last))

    _invalidate_rings(q_ready, k_ready, v_ready, NUM_BUFFERS)

    o_scale = v_scale + gl.zeros([BLOCK_M], gl.float32, row_layout)
    # ALiBi's per-row part the key loop left out (_softmax_step): the row's logits there are the true ones
    # plus row_shift, base 2
    row_idx = diag - shift
    if VARLEN_K:
        # q's sequence start and length read again, the rows from m0: kept across the key loop they cost the
        # d = 128 causal build a 4-byte spill; volatile, so the loads are not merged with the prologue's
        seq0 = gl.load(CU_SEQLENS + off_b, volatile=True)
        seqlen = gl.load(CU_SEQLENS + off_b + 1, volatile=True) - seq0
        row_idx = m0 + gl.arange(0, BLOCK_M, row_layout)
    row_shift = gl.zeros([BLOCK_M], gl.float32, row_layout)
    if ALIBI:
        row_shift = alibi_log2e * (row_idx - m0).to(gl.float32)
    if HAS_SINK:
        # the sink joins the denominator once, after the loop, so the pipelined loop is today's: the
        # running max takes the sink's logit (base 2) and the sum and output rescale to it
        sink = gl.load(SINK + off_h).to(gl.float32) * 1.4426950408889634 + row_shift
        m_end = gl.maximum(m_i, sink)
        alpha_end = gl.exp2(m_i - m_end)
        l_i = l_i * alpha_end + gl.exp2(sink - m_end)
        o_scale = o_scale * alpha_end
        m_i = m_end
    if VARLEN_K:
        # a row that saw no key (above k's diagonal): its sum is 0 and its O too; divide by 1, lse +inf below
        empty = l_i == 0.0
        l_i = gl.where(empty, 1.0, l_i)
    # O = acc * (v_descale / l); lse = (m + log2 l - P_SHIFT) ln 2 (l carries the 2**P_SHIFT of P)
    inv_l = gl.convert_layout(o_scale / l_i, gl.SliceLayout(1, o_layout))
    o = o * gl.expand_dims(inv_l, 1)
    # FlashAttention's lse is natural-log: ln(sum e^(x*scale)) = (m + log2 l) * ln 2 with m in base 2
    lse = (m_i + gl.log2(l_i) - P_SHIFT - row_shift) * 0.6931471805599453
    if VARLEN_K:
        lse = gl.where(empty, float("inf"), lse)
    gl.store(LSE + off_b * stride_lb + off_h * stride_lh + seq0 + row_idx, lse, mask=row_idx < seqlen)
    if VARLEN and (m0 + BLOCK_M > seqlen):
        # a TMA store would write the next sequence's rows too: store this tile's rows one by one
        o_rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM_V, gl.SliceLayout(0, o_layout))
        o_ptrs = (OUT + gl.expand_dims((seq0 + o_rows).to(gl.int64) * stride_om, 1) + off_h * stride_oh
                  + gl.expand_dims(o_cols, 0))
        gl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=gl.expand_dims(o_rows < seqlen, 1))
    elif FP8 or HEAD_DIM_V != HEAD_DIM:
        # O unlike Q's first tile (fp8: bf16 O is twice Q's bytes; or v's own head dim) gets a buffer of its
        # own (allocated here, after the ring is dead, so the allocator may overlap it with the ring)
        o_smem = gl.allocate_shared_memory(desc_o.dtype, desc_o.block_type.shape, desc_o.layout)
        o_smem.reshape([BLOCK_M, HEAD_DIM_V]).store(o.to(desc_o.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_o, [tb, seq0 + m0, off_h, 0], o_smem)
    else:
        # Q's tile is dead (every wgmma reading it has retired): stage O there for one TMA store,
        # which also clips the rows past seqlen
        q_tile.store(o.to(desc_o.dtype))
        # generic-proxy smem writes must be visible to the TMA engine (async proxy) before it reads them
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_o, [tb, seq0 + m0, off_h, 0], q_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_attn_fwd_kernel(desc_q, desc_q2, desc_k, desc_k2, desc_v, desc_o, LSE, SINK, stride_lb, stride_lh,
                           seqlen, n_heads, heads_per_kv, qk_scale, window_left, softcap_log2e, CU_SEQLENS, OUT,
                           stride_om, stride_oh, ALIBI_SLOPES, stride_ab, seqlen_k, CU_SEQLENS_K, KV_LENS,
                           HEAD_DIM: gl.constexpr,
                           HEAD_DIM_TAIL: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr,
                           HAS_SINK: gl.constexpr, LOCAL: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                           VARLEN: gl.constexpr = False, ALIBI: gl.constexpr = False,
                           UNEQUAL: gl.constexpr = False, VARLEN_K: gl.constexpr = False):
    """bf16 / fp16 forward (dtype from the descriptors): q, k (b, s, h, HEAD_DIM + HEAD_DIM_TAIL) through
    desc_q / desc_q2 and desc_k / desc_k2 (the leading and tail columns), v, out (b, s, h, HEAD_DIM_V); SINK
    (h,) when HAS_SINK; LOCAL: a causal sliding window of ``window_left`` keys before each row's own; SOFTCAP:
    capped scores (qk_scale = softmax_scale / softcap in base e, softcap_log2e = softcap * log2(e)); VARLEN:
    packed sequences, q / k / v / out (1, total, h, d) descriptors, CU_SEQLENS (b + 1,) (q's, and k's too without
    VARLEN_K),
    OUT / stride_om / stride_oh the output tensor for ragged last tiles, the lse (h, total); ALIBI: fp32 slopes
    ALIBI_SLOPES (h,) or (b, h) (stride_ab: its batch stride, 0 for (h,)); UNEQUAL: k's length ``seqlen_k``
    differs from q's ``seqlen`` (padded calls, bottom-right alignment); VARLEN_K (with VARLEN): k's own sequences,
    starting at CU_SEQLENS_K (b + 1,), KV_LENS (b,) keys each."""
    _attn_fwd_tile(desc_q, desc_q2, desc_k, desc_k2, desc_v, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads,
                   heads_per_kv, qk_scale, LSE, LSE, LSE, SINK, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V, BLOCK_M,
                   BLOCK_N, NUM_BUFFERS, CAUSAL, False, False, False, False, HAS_SINK, window_left, LOCAL,
                   softcap_log2e, SOFTCAP, CU_SEQLENS, OUT, stride_om, stride_oh, VARLEN, ALIBI_SLOPES, stride_ab,
                   ALIBI, seqlen_k, UNEQUAL, CU_SEQLENS_K, KV_LENS, VARLEN_K)


# Launch configs: BLOCK_M query rows (64 per warpgroup, num_warps = BLOCK_M / 16), BLOCK_N keys per
# block, NUM_BUFFERS slots in each of the K and V rings (>= 2). Power-of-two tiles only (Gluon tensors).
# Every entry and every tuning candidate is compiled for sm_90 by tests/test_gluon_compile.py (no spills,
# no serialised wgmma, shared memory within 227 KiB, exp2 under an in-flight wgmma in the SASS).
#   16-bit d = 64 / 128: the measured configs (d = 64's ties Triton, which the route keeps).
#   16-bit d = 256: two warpgroups on 128 rows, 64 keys a block in two-slot rings (196,648 B of shared
#     memory, FlashAttention-3's d = 256 tile is 128 x 80); the route keeps Triton until it measures faster.
#   16-bit d = 192 (q / k as 128 + 64 columns) with v's 128: 64-key blocks, 4 slots (~208 KiB).
#   fp8 d = 128 / 256: one warpgroup on 64 query rows, the sweep's winner at s = 4096, causal and not,
#     by 10%-17% over 128-row tiles on two warpgroups (docs/gluon.md, "Configs"): small CTAs let two
#     share an SM, so one's softmax hides under the other's MMAs as well.
#   fp8 d = 64: the 16-bit shape, not measured.
FWD_CONFIGS = {
    ("16bit", 64): dict(BLOCK_M=64, BLOCK_N=128, NUM_BUFFERS=3, num_warps=4),
    ("16bit", 128): dict(BLOCK_M=128, BLOCK_N=128, NUM_BUFFERS=3, num_warps=8),
    ("16bit", 192): dict(BLOCK_M=128, BLOCK_N=64, NUM_BUFFERS=4, num_warps=8),
    ("16bit", 256): dict(BLOCK_M=128, BLOCK_N=64, NUM_BUFFERS=2, num_warps=8),
    ("fp8", 64): dict(BLOCK_M=128, BLOCK_N=128, NUM_BUFFERS=3, num_warps=8),
    ("fp8", 128): dict(BLOCK_M=64, BLOCK_N=128, NUM_BUFFERS=3, num_warps=4),
    ("fp8", 256): dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=3, num_warps=4),
}
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps")

# What scripts/tune_gluon.py times, per (dtype class, head_dim): (BLOCK_M, BLOCK_N, NUM_BUFFERS,
# num_warps), the table's entry first. Kept short (each one costs a GPU compile) and limited to
# what compiles without spills: 64-row tiles on one warpgroup may fit two CTAs per SM.
TUNE_CANDIDATES = {
    ("16bit", 64): [(64, 128, 3, 4), (128, 128, 3, 8), (64, 128, 2, 4)],
    ("16bit", 128): [(128, 128, 3, 8), (128, 128, 2, 8), (64, 128, 3, 4), (64, 64, 2, 4)],
    ("16bit", 192): [(128, 64, 4, 8), (128, 64, 3, 8), (128, 64, 2, 8), (64, 64, 3, 4)],
    ("16bit", 256): [(128, 64, 2, 8), (128, 32, 3, 8), (64, 32, 4, 4), (64, 64, 2, 4)],
    ("fp8", 64): [(128, 128, 3, 8), (128, 128, 4, 8), (128, 128, 6, 8), (64, 128, 3, 4), (64, 128, 4, 4)],
    ("fp8", 128): [(64, 128, 3, 4), (64, 128, 4, 4), (128, 128, 3, 8), (128, 128, 5, 8)],
    ("fp8", 256): [(64, 64, 3, 4), (64, 64, 4, 4), (128, 64, 3, 8), (128, 64, 4, 8)],
}


def dtype_class(dtype) -> str:
    """"fp8" for any float8 dtype (torch or its name), else "16bit"."""
    name = str(dtype)
    return "fp8" if "float8" in name or "fp8" in name else "16bit"


def fwd_config(head_dim: int, causal: bool, dtype="bfloat16") -> dict:
    """The table entry for (head_dim, dtype); causal does not change it yet. dtype: a torch dtype or
    its name; any float8 means the e4m3 kernel. Returns a fresh dict (callers may edit it)."""
    key = (dtype_class(dtype), head_dim)
    if key not in FWD_CONFIGS:
        raise ValueError(f"gluon fwd: no config for head_dim {head_dim} with {dtype}")
    return dict(FWD_CONFIGS[key])
