"""Hopper (sm_90) attention backward, dQ half, in Gluon (experimental: off by default).

The Triton dQ kernel (kernels/attn_bwd.py) computes, per query block and key block,

    S = Q K^T,  dP = dO V^T,  P = exp2(S * scale - lse),  dS = P (dP - delta),  dQ += dS K

and, as in its dK/dV kernel, Triton 3.6 waits for S and dP right after issuing them. Here the
schedule is the one of the Gluon dK/dV kernel (kernels/gluon_bwd.py) with the roles of queries and
keys swapped:

    step j (S_j and dP_j are in registers; dQ += dS_{j-1} K_{j-1} is still running)
      issue  S_{j+1} = Q K_{j+1}^T, dP_{j+1} = dO V_{j+1}^T
      dS_j                                     <- runs under the three MMAs in flight
      wait(0); refill the ring slot of step j-1
      issue  dQ += dS_j K_j                    in flight into step j+1

ROTATED = False (session 7, a tuning candidate) is the dK/dV kernel's plain order instead: each step
issues S and dP, waits, writes dS, issues dQ += dS K and waits, so nothing is in flight across steps
and the overlap has to come from another CTA on the SM.

dS reaches its product through shared memory (two buffers, alternating by step), never as a register
operand: the dK/dV kernel's register-operand version hit a ptxas register hazard on the H200. lse
and delta are loaded per step (as in the dK/dV kernel, from L1/L2): loaded once before the loop and
kept live across it, the kernel crashed Triton 3.6's ptxas (segmentation fault at -O1 and above).

One CTA (one or two warpgroups) owns BLOCK_M query rows of one (batch, head) and walks the key blocks of its
kv head (GQA: head // heads_per_kv), so dQ is summed in registers and written once, with no atomics.
Q and dO stay in shared memory as the A operands of S and dP; K and V stream through a
NUM_BUFFERS-deep TMA ring. Scope as the dK/dV kernel: bf16 / fp16, (b, s, h, d) tensors with
seqlen_q == seqlen_k, plain or causal. Rows past the sequence get lse = +inf (P = 0, dQ rows that
the TMA store clips). Keys past it arrive as zero rows of K and V (TMA fills out-of-bounds rows
with 0), which give S = 0 and so P = exp(-lse), not 0: they are masked explicitly, since their dS
could overflow fp16 and turn the zero rows of K into NaN. Causal also masks keys after the query row.
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

from flashtile.kernels.gluon_bwd import LOG2E, _barriers, _invalidate, _issue_scores, _load_pair, operand_smem_layout
from flashtile.kernels.gluon_fwd import mma_layout


@gluon.jit
def _load_k_v(desc_k, desc_v, k_smem, v_smem, ready, step, off_b, off_hk, NUM_BUFFERS: gl.constexpr,
              BLOCK_N: gl.constexpr):
    slot = step % NUM_BUFFERS
    _load_pair(desc_k, desc_v, k_smem.index(slot), v_smem.index(slot), ready.index(slot), off_b, step * BLOCK_N,
               off_hk)


@gluon.jit
def _ds_of_step(s, dp, ds_buf, LSE, DELTA, base, seqlen, q_idx, step, qk_scale, key_layout: gl.constexpr,
                dtype: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """dS of one step, written in bf16 / fp16 to the shared buffer the dQ product reads as its A
    operand (the caller makes sure no product in flight reads this buffer)."""
    row_ok = q_idx < seqlen
    # rows past the sequence: lse = +inf makes their P (and so dS) exactly 0
    lse2 = gl.load(LSE + base + q_idx, mask=row_ok, other=float("inf")) * LOG2E
    delta = gl.load(DELTA + base + q_idx, mask=row_ok, other=0.0)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    key_idx = step * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
    if CAUSAL:
        # sq == sk: key j is visible to query i iff j <= i (which also drops keys past the sequence)
        p = gl.where(gl.expand_dims(key_idx, 0) <= gl.expand_dims(q_idx, 1), p, 0.0)
    else:
        p = gl.where(gl.expand_dims(key_idx < seqlen, 0), p, 0.0)
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_buf.store(ds.to(dtype))
    # generic-proxy writes must be visible to wgmma (async proxy) before it reads them
    fence_async_shared()


@gluon.jit
def _gluon_attn_bwd_dq_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, LSE, DELTA, stride_lb, stride_lh, seqlen,
                              n_heads, heads_per_kv, qk_scale, grad_scale, HEAD_DIM: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                              CAUSAL: gl.constexpr, ROTATED: gl.constexpr = True):
    """dQ (b, s, h, d) of q, dout (b, s, h, d), k, v (b, s, h_k, d), lse and delta (b, h, s) fp32
    (natural log for lse). qk_scale = softmax_scale * log2(e); grad_scale = softmax_scale.
    ROTATED = False: the plain order of the dK/dV kernel's d = 128 / 256 configs (every product
    waited for within its step, one dS buffer; the overlap comes from another CTA or warpgroup), a
    tuning candidate here."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N, 16)  # S, dP: [BLOCK_M queries, BLOCK_N keys]
    acc_layout: gl.constexpr = mma_layout(NUM_WARPS, HEAD_DIM, 16)  # dQ: [BLOCK_M, HEAD_DIM]
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = desc_q.dtype

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    off_b = pid_bh // n_heads
    off_h = pid_bh % n_heads
    off_hk = off_h // heads_per_kv
    m0 = pid_m * BLOCK_M
    n_end = seqlen
    if CAUSAL:
        # keys after the block's last query row are masked for all of its rows
        n_end = gl.minimum(seqlen, m0 + BLOCK_M)
    n_steps = gl.cdiv(n_end, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, desc_do.block_type.shape, desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_v.block_type.shape, desc_v.layout)
    ds_layout: gl.constexpr = operand_smem_layout(BLOCK_M, BLOCK_N, dtype)
    if ROTATED:
        # dS of two consecutive steps: step j writes buffer j % 2 while step j-1's product reads the other
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    else:
        # the plain order retires a step's product before the next step writes dS: one buffer
        ds_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, BLOCK_N], ds_layout)
    q_ready, ready = _barriers(NUM_BUFFERS)
    _load_pair(desc_q, desc_do, q_smem, do_smem, q_ready, off_b, m0, off_h)
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_steps:
            _load_k_v(desc_k, desc_v, k_smem, v_smem, ready, i, off_b, off_hk, NUM_BUFFERS, BLOCK_N)
    q_idx = m0 + gl.arange(0, BLOCK_M, row_layout)
    base = off_b * stride_lb + off_h * stride_lh
    q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_smem.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready, 0)

    if ROTATED:
        # step j+NUM_BUFFERS-1 is loaded during step j (see the refill): step j+1 must be resident
        # when step j issues its scores, so the ring needs three slots at least
        gl.static_assert(NUM_BUFFERS >= 3)
        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
        s, dp = _issue_scores(q_tile, do_tile, k_smem, v_smem, ready, 0, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N,
                              HEAD_DIM)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        for j in range(0, n_steps - 1):
            s_next, dp_next = _issue_scores(q_tile, do_tile, k_smem, v_smem, ready, j + 1, s_layout, NUM_BUFFERS,
                                            BLOCK_M, BLOCK_N, HEAD_DIM)
            # the tensor cores hold dQ of step j-1 and the scores of step j+1: this runs under them.
            # Buffer j % 2 was last read by step j-2's product, retired by step j-1's wait.
            _ds_of_step(s, dp, ds_smem.index(j % 2), LSE, DELTA, base, seqlen, q_idx, j, qk_scale, key_layout, dtype,
                        BLOCK_N, CAUSAL)
            dq, s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(dq, s_next, dp_next))
            # step j-1's slot is free: its scores retired at the previous wait, its dQ product just now
            refill = j - 1 + NUM_BUFFERS
            if (j >= 1) & (refill < n_steps):
                _load_k_v(desc_k, desc_v, k_smem, v_smem, ready, refill, off_b, off_hk, NUM_BUFFERS, BLOCK_N)
            k_tile = k_smem.index(j % NUM_BUFFERS).reshape([BLOCK_N, HEAD_DIM])
            dq = warpgroup_mma(ds_smem.index(j % 2), k_tile, dq, is_async=True)
        last = n_steps - 1
        _ds_of_step(s, dp, ds_smem.index(last % 2), LSE, DELTA, base, seqlen, q_idx, last, qk_scale, key_layout, dtype,
                    BLOCK_N, CAUSAL)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        k_tile = k_smem.index(last % NUM_BUFFERS).reshape([BLOCK_N, HEAD_DIM])
        dq = warpgroup_mma(ds_smem.index(last % 2), k_tile, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    else:
        gl.static_assert(NUM_BUFFERS >= 2)
        # a plain tensor: the loop carries it waited for, not as an in-flight accumulator
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        for j in range(0, n_steps):
            s, dp = _issue_scores(q_tile, do_tile, k_smem, v_smem, ready, j, s_layout, NUM_BUFFERS, BLOCK_M, BLOCK_N,
                                  HEAD_DIM)
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            _ds_of_step(s, dp, ds_smem.index(0), LSE, DELTA, base, seqlen, q_idx, j, qk_scale, key_layout, dtype,
                        BLOCK_N, CAUSAL)
            k_tile = k_smem.index(j % NUM_BUFFERS).reshape([BLOCK_N, HEAD_DIM])
            dq = warpgroup_mma(ds_smem.index(0), k_tile, dq, is_async=True)
            # nothing stays in flight across steps (as in the dK/dV kernel's plain order)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            if j + NUM_BUFFERS < n_steps:  # step j's slot is free: load the step NUM_BUFFERS ahead
                _load_k_v(desc_k, desc_v, k_smem, v_smem, ready, j + NUM_BUFFERS, off_b, off_hk, NUM_BUFFERS,
                          BLOCK_N)

    _invalidate(q_ready, ready, NUM_BUFFERS)
    # Q is dead (every wgmma reading it retired): stage dQ there for the TMA store, which also clips
    # the rows past the sequence
    q_tile.store((dq * grad_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dq, [off_b, m0, off_h, 0], q_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps[, ROTATED]) per head dim. Session 7 added the plain order
# (ROTATED = 0) as tuning candidates, compiled on the CPU only; the rotated builds of this table
# compile to the same SASS as before that change, so their GPU verification stands. d = 128: two warpgroups on 128 query rows
# share each K / V tile of a 4-slot ring (224 KiB of shared memory, one CTA per SM): the fastest of
# the nine configs swept on the H200 at every length from 2048
# (benchmarks/results/tune_gluon_bwd_h200_2026-11-30.json, tune_gluon_bwd_dq_h200_2026-11-30.json),
# yet slower than the Triton dQ kernel, so the route leaves it off. d = 64 is a first guess.
BWD_DQ_CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=4, num_warps=4),
    128: dict(BLOCK_M=128, BLOCK_N=64, NUM_BUFFERS=4, num_warps=8),
}
