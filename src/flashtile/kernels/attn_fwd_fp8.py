"""FP8 (e4m3) forward attention kernel, FlashAttention-3's fp8 semantics, in the bf16 kernel's family.

Same program shape, three-range key loop, masking and exp2 online softmax as ``attn_fwd.py``
(whose helpers it imports, so the two cannot drift apart on masking); what differs:

- ``Q @ K^T`` is an fp8 x fp8 dot with fp32 accumulation. The per-(batch, kv head) descales of q
  and k are folded into the one score multiplier (``softmax_scale * log2(e) * q_descale *
  k_descale``), so dequantisation costs nothing per element.
- ``P`` is quantised to e4m3 for the ``P @ V`` dot. It is computed as ``exp2(s - m + P_SHIFT)``,
  i.e. scaled so the running row max is 2**8 = 256 (exact, and below e4m3's 448): probabilities
  down to 2**-14 of the max then keep e4m3's 3-bit mantissa instead of falling into its subnormals
  (2**-6 and below), for free, because the shift rides on the max subtraction. The row sum ``l``
  carries the same factor, so it cancels in ``acc / l``; the lse subtracts it back out.
- ``v_descale`` is folded into the final normalisation ``acc * (v_descale / l)``.
- V arrives transposed, ``V^T`` with the key index contiguous (the launcher makes that copy):
  Hopper's fp8 wgmma reads its B operand K-major only, and for ``P @ V`` the reduction dim is the
  key index. ``tl.trans`` of a K-major tile is then a free view in shared memory.
- No dropout (FA3 has none for fp8); no ``return_attn_probs`` probabilities (they exist only with
  dropout).

``SOFT_ROUND_P`` (set by the launcher for Triton's CPU interpreter only) rounds P to the e4m3 grid
in integer arithmetic before the cast: the interpreter's fp32 -> e4m3 cast truncates with a
broken carry (0.98 becomes 0.5), while the GPU's cast is a correct round-to-nearest-even. With the
pre-rounding both give the same e4m3 values, so interpreter tests check the GPU's numerics.
"""

import triton
import triton.language as tl

from flashtile.kernels.attn_fwd import (
    _heavy_rows_first,
    _key_block_ranges,
    _load_k_tile,
    _scores,
    _sequence_bounds,
    _softmax_update,
    _tile_coords,
)

P_SHIFT = 8.0  # log2 of the scale of P before its e4m3 cast (see the module docstring)


@triton.jit
def _round_to_e4m3_grid(x):
    """Round non-negative fp32 x (<= 448) to the nearest e4m3 value (ties to even), still in fp32."""
    # normals (x >= 2**-6): keep 3 of fp32's 23 mantissa bits; adding 0x7FFFF + lsb to the bit
    # pattern rounds to nearest even and lets a mantissa overflow carry into the exponent
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormals (x < 2**-6): multiples of 2**-9; adding 1.5 * 2**14 (whose fp32 ulp is 2**-9) rounds
    # to that grid with the FPU's own round-to-nearest-even
    sub = (x + 24576.0) - 24576.0
    return tl.where(x < 0.015625, sub, normal)


@triton.jit
def _load_vt_tile(VT, desc_vt, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_vtd,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, CHECK_N: tl.constexpr):
    """V^T tile, [BLOCK_D, BLOCK_N], key index contiguous; zeros outside the sequence / head dim.

    Varlen V^T always takes pointer loads: a sequence starts at any key row, and a descriptor's
    innermost (here: key) offset must be a 16-byte multiple (Triton's rule for tensor descriptors).
    """
    if USE_TMA and not IS_VARLEN:
        vt = desc_vt.load([b, kv_head, 0, start_n]).reshape(BLOCK_D, BLOCK_N)
    else:
        ptrs = VT + offs_d[:, None] * stride_vtd + (start_n + offs_n)[None, :]
        mask = offs_d[:, None] < HEAD_DIM
        if CHECK_N:
            mask = mask & ((start_n + offs_n)[None, :] < seqlen_k)
        vt = tl.load(ptrs, mask=mask, other=0.0)
    return vt


@triton.jit
def _attn_fwd_fp8_inner(acc, m_i, l_i, q, K, VT, desc_k, desc_vt, k_row0, kv_head, b, block_lo, block_hi,
                        offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vtd,
                        qk_scale, softcap, slope, window_left, window_right,
                        MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        IS_VARLEN: tl.constexpr, USE_TMA: tl.constexpr, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                        SOFT_ROUND_P: tl.constexpr):
    """Online-softmax update over key blocks [block_lo, block_hi), P in e4m3."""
    for blk in range(block_lo, block_hi):
        start_n = blk * BLOCK_N
        kt = _load_k_tile(K, desc_k, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_kn,
                          HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, MASK)
        cols = start_n + offs_n
        # fp8 x fp8 -> fp32; the precision argument only matters for fp32 operands
        s = _scores(q, kt, offs_m, cols, seqlen_q, seqlen_k, qk_scale, softcap, slope, window_left,
                    window_right, MASK, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, "ieee")
        # P scaled by 2**P_SHIFT (= 2**8) for free (the shift is applied to the per-row max): keeps small
        # probabilities out of e4m3's subnormal range
        p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc, MASK, 8.0)
        if SOFT_ROUND_P:
            p = _round_to_e4m3_grid(p)
        vt = _load_vt_tile(VT, desc_vt, k_row0, kv_head, b, start_n, offs_n, offs_d, seqlen_k, stride_vtd,
                           HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, MASK)
        acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)
        m_i = m_new
    return acc, m_i, l_i


# Lengths change every call; specialising on them would only recompile. Strides stay specialised
# so pointer-path loads can be vectorised (see kernels/attn_bwd.py).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def _attn_fwd_fp8_kernel(
    # pointers (desc_* are tensor descriptors when USE_TMA, else the same tensors again)
    Q, K, VT, O, LSE, desc_q, desc_k, desc_vt,
    CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, ALIBI, Q_DESCALE, K_DESCALE, V_DESCALE,
    # scalars
    qk_scale, softcap, window_left, window_right,
    # sizes
    seqlen_q, seqlen_k, num_heads, group,
    # strides (V^T: (b, h_k, d, sk) padded / (h_k, d, total_k) varlen, key index contiguous;
    # descales are contiguous (b, h_k))
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vtb, stride_vth, stride_vtd,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    stride_alibi_b,
    # constexprs
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
    USE_TMA: tl.constexpr, SOFT_ROUND_P: tl.constexpr, HEAVY_FIRST: tl.constexpr = False,
):
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
    # 64-bit offsets: packed varlen batches can exceed 2**31 elements
    q_base = Q + b.to(tl.int64) * stride_qb + q_row0.to(tl.int64) * stride_qm + h * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + k_row0.to(tl.int64) * stride_kn + kv_head * stride_kh
    vt_base = VT + b.to(tl.int64) * stride_vtb + kv_head.to(tl.int64) * stride_vth + k_row0.to(tl.int64)

    if USE_TMA:
        if IS_VARLEN:
            q = desc_q.load([q_row0 + start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            q = desc_q.load([b, start_m, h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)

    # descales of this (batch, kv head): q's and k's fold into the score multiplier, v's into the end
    kv_index = b * (num_heads // group) + kv_head
    if HAS_Q_DESCALE:
        qk_scale = qk_scale * tl.load(Q_DESCALE + kv_index)
    if HAS_K_DESCALE:
        qk_scale = qk_scale * tl.load(K_DESCALE + kv_index)
    v_scale = 1.0
    if HAS_V_DESCALE:
        v_scale = tl.load(V_DESCALE + kv_index)

    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * stride_alibi_b + h)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _key_block_ranges(start_m, start_m + BLOCK_M - 1, seqlen_q, seqlen_k, window_left,
                                                 window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # left edge of the band (window start), masked
    acc, m_i, l_i = _attn_fwd_fp8_inner(
        acc, m_i, l_i, q, k_base, vt_base, desc_k, desc_vt, k_row0, kv_head, b, lo, full_lo,
        offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vtd, qk_scale, softcap, slope,
        window_left, window_right,
        True, HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        SOFT_ROUND_P)
    # interior of the band: no masking work
    acc, m_i, l_i = _attn_fwd_fp8_inner(
        acc, m_i, l_i, q, k_base, vt_base, desc_k, desc_vt, k_row0, kv_head, b, full_lo, full_hi,
        offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vtd, qk_scale, softcap, slope,
        window_left, window_right,
        False, HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        SOFT_ROUND_P)
    # right edge: causal diagonal / window end / ragged end of the keys, masked
    acc, m_i, l_i = _attn_fwd_fp8_inner(
        acc, m_i, l_i, q, k_base, vt_base, desc_k, desc_vt, k_row0, kv_head, b, full_hi, hi,
        offs_m, offs_n, offs_d, seqlen_q, seqlen_k, stride_kn, stride_vtd, qk_scale, softcap, slope,
        window_left, window_right,
        True, HEAD_DIM, BLOCK_N, BLOCK_D, IS_VARLEN, USE_TMA, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        SOFT_ROUND_P)

    # rows that saw no key: output 0 and lse = +inf (the contract's rule); l carries 2**P_SHIFT
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"),
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) - 8.0) * 0.6931471805599453)

    row_ok = offs_m < seqlen_q
    o_ptrs = (O + b.to(tl.int64) * stride_ob + q_row0.to(tl.int64) * stride_om + h * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    lse_ptrs = LSE + b.to(tl.int64) * stride_lse_b + h * stride_lse_h + q_row0 + offs_m
    tl.store(lse_ptrs, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Tuning table: (BLOCK_M, BLOCK_N, num_warps, num_stages) keyed by (arch, BLOCK_D bucket, causal).
# d = 128 and 256: scripts/tune_fwd.py --fp8 on the H200 at s = 4096 (docs/fp8.md, "GPU numbers"): one
# warp group on 64 query rows beat every 128-row, 8-warp tile by 10-30%. d <= 64: first guesses, not
# measured. fp8 dots need a reduction dim >= 32, hence BLOCK_N >= 32 and BLOCK_D >= 32 everywhere, the
# interpreter row included.
FWD_FP8_CONFIGS = {
    ("sm90", 32, False): (128, 64, 4, 3),
    ("sm90", 32, True): (128, 64, 4, 3),
    ("sm90", 64, False): (128, 128, 8, 3),
    ("sm90", 64, True): (128, 128, 8, 3),
    ("sm90", 128, False): (64, 128, 4, 3),
    ("sm90", 128, True): (64, 128, 4, 3),
    ("sm90", 256, False): (64, 64, 4, 3),
    ("sm90", 256, True): (64, 64, 4, 3),
    ("default", 32, False): (64, 64, 4, 2),
    ("default", 64, False): (64, 64, 4, 2),
    ("default", 128, False): (64, 64, 4, 2),
    ("default", 256, False): (64, 32, 4, 1),
    ("interpret", 0, False): (16, 32, 4, 1),
}


def fwd_fp8_config(arch: str, block_d: int, causal: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the fp8 kernel."""
    if arch == "interpret":
        return FWD_FP8_CONFIGS[("interpret", 0, False)]
    bucket = 32 if block_d <= 32 else 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    return FWD_FP8_CONFIGS.get((arch, bucket, causal), FWD_FP8_CONFIGS[("default", bucket, False)])
