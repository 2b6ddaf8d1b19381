"""The split-KV merge with several heads a program (an experiment, off: FLASHTILE_DECODE_COMBINE_HEADS=N).

Why: inside a graph of layers at b = 32 the whole-row TMA kernel's merge took 4.4 us a call, against 2.6 us at
b = 1 (lease A21, scripts/probe_decode_timeline.py), and that merge is what keeps the kernel behind cuDNN, which
needs none there. ``_combine_kernel`` (kernels/decode.py) runs one program a (batch row, token, head): 1024 programs
of 4 warps at b = 32, each with 2 KB to read. Here a program merges HEADS_PER consecutive heads, so b = 32 takes
1024 / HEADS_PER programs with the same bytes in flight each thread.
"""

import triton
import triton.language as tl


@triton.jit
def _combine_heads_kernel(
    O_PART, LSE_PART, O, LSE,
    num_splits, seqlen_q, num_heads,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph, stride_lpm,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h, stride_lse_m,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s, for HEADS_PER heads [h0, h0 + HEADS_PER)
    of one (b, token): O_PART (ns, b, sq, h, d) fp32 and LSE_PART (ns, b, h, sq) (natural log, -inf for a split
    without keys) into O (b, sq, h, d) and LSE (b, h, sq) (+inf for a head without keys, whose output is 0).
    Flat grid: program = (b * seqlen_q + t) * (num_heads // HEADS_PER) + head block; num_heads is a multiple of
    HEADS_PER. Offsets are int64, as in ``_combine_kernel``."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = num_heads // HEADS_PER
    h0 = (pid % blocks) * HEADS_PER
    bt = pid // blocks
    t = bt % seqlen_q
    b = bt // seqlen_q
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    offs_h = h0 + tl.arange(0, HEADS_PER).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    # both loads before any arithmetic, so that they are in flight together (one memory latency)
    lse_s = tl.load(LSE_PART + offs_s[:, None] * stride_lps + b * stride_lpb + offs_h[None, :] * stride_lph
                    + t * stride_lpm, mask=s_ok[:, None], other=float("-inf"))  # [S, H]
    o_part = tl.load(O_PART + offs_s[:, None, None] * stride_ops + b * stride_opb + t * stride_opm
                     + offs_h[None, :, None] * stride_oph + offs_d[None, None, :],
                     mask=s_ok[:, None, None] & d_ok[None, None, :], other=0.0)  # [S, H, D]
    lse_max = tl.max(lse_s, 0)  # [H]
    empty = lse_max == float("-inf")
    w = tl.exp(lse_s - tl.where(empty, 0.0, lse_max)[None, :])
    w_sum = tl.sum(w, 0)
    out = tl.sum(o_part * w[:, :, None], 0) / tl.where(empty, 1.0, w_sum)[:, None]  # [H, D]
    lse = tl.where(empty, float("inf"), lse_max + tl.log(tl.where(empty, 1.0, w_sum)))
    tl.store(O + b * stride_ob + t * stride_om + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=d_ok[None, :])
    tl.store(LSE + b * stride_lse_b + offs_h * stride_lse_h + t * stride_lse_m, lse)
