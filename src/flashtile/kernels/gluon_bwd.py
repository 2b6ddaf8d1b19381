"""Hopper (sm_90) attention backward, dK/dV half, in Gluon (the default at d = 128 / 256 on sm_90).

The Triton dK/dV kernel (kernels/attn_bwd.py) computes, per key block and query block,

    S^T = K Q^T,  dP^T = V dO^T,  P^T = exp2(S^T * scale - lse),  dS^T = P^T (dP^T - delta),
    dV += P^T dO,  dK += dS^T Q

and Triton 3.6 waits for S^T and dP^T right after issuing them, so the exponentials run with the
tensor cores idle. Here the wgmma issue and waits are explicit, as in the Gluon forward
(kernels/gluon_fwd.py):

    step j (S^T_j and dP^T_j are in registers; dV/dK += ..._{j-1} are still running)
      issue  S^T_{j+1} = K Q_{j+1}^T, dP^T_{j+1} = V dO_{j+1}^T
      P^T_j, dS^T_j                           <- runs under the four MMAs in flight
      wait(0); refill the ring slot of step j-1
      issue  dV += P^T_j dO_j, dK += dS^T_j Q_j   in flight into step j+1

P^T and dS^T reach their products through shared memory (two buffers each, alternating by step),
not registers. With register A operands, ptxas reused the in-flight products' operand registers
for the next step's P^T / dS^T before the wait (the waits' deps hold unpacked copies, not the packed
registers the wgmma reads): a hazard in the causal build that corrupted gradients on the H200 for
some shapes (tests/test_gpu_gluon_bwd.py). Converting after the wait instead cost the
overlap (ptxas then ran the exponentials after the wait, at 255 registers). A buffer written while
the other one feeds the in-flight products has neither problem.

One CTA (one warpgroup) owns BLOCK_N keys of one (batch, kv head) and walks every query block of
every query head of its GQA group ("steps"), so dK and dV are summed in registers and written once.
K and V stay in shared memory as the A operands of S^T and dP^T; Q and dO stream through a
NUM_BUFFERS-deep TMA ring. Scope: bf16 / fp16 (b, s, h, d) tensors, plain or causal, no dropout (causal
windows, softcap, causal ALiBi, packed sequences and q / k of different lengths are the LOCAL / SOFTCAP /
ALIBI / VARLEN / UNEQUAL builds); delta comes from the Triton preprocess.
Rows past the sequence get lse = +inf (P = 0), and keys past it only produce dK/dV rows that the
TMA store clips, so no key mask is needed; causal masks keys after the query row. The fused dQ build
(FUSED_DQ) reads every key of a block, so its non-causal builds mask the keys past the sequence: a key TMA
zero-filled scores 0, which the row's lse never counted, and its P = exp(-lse) may overflow the 16-bit dS^T.
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from flashtile.kernels.gluon_fwd import _sequence

LOG2E = gl.constexpr(1.4426950408889634)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into global memory at ``coord`` of ``tensor_desc`` (TMA reduce-add,
    cp.reduce.async.bulk.tensor: the adds happen in L2, element by element atomic). Asynchronous like a TMA store:
    ``tma.store_wait`` before ``src`` is written again. Triton 3.6 builds the op but Gluon does not name it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _load_pair(desc_a, desc_b, a_smem, b_smem, bar, off_b, row0, head):
    """TMA-load the [rows, d] tiles of (b, s, h, d) tensors a and b at (off_b, row0, head) onto one
    barrier: a step needs both (Q and dO, or K and V) together."""
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_a, [off_b, row0, head, 0], bar, a_smem)
    tma.async_copy_global_to_shared(desc_b, [off_b, row0, head, 0], bar, b_smem)


@gluon.jit
def _barriers(NUM_BUFFERS: gl.constexpr):
    """The barrier of the tiles a CTA keeps for its whole run, and one per ring slot; initialised."""
    pinned = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(pinned, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    return pinned, ready


@gluon.jit
def _invalidate(pinned, ready, NUM_BUFFERS: gl.constexpr):
    mbarrier.invalidate(pinned)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, step, off_b, h0, m_start, steps_per_head,
               NUM_BUFFERS: gl.constexpr, BLOCK_M: gl.constexpr, desc_q2=None, q2_smem=None,
               SPLIT: gl.constexpr = False, seq0=0):
    """Step's Q and dO tiles into their ring slot (SPLIT: Q's tail columns too, on the same barrier)."""
    slot = step % NUM_BUFFERS
    head = h0 + step // steps_per_head
    m0 = seq0 + (m_start + step % steps_per_head) * BLOCK_M
    if SPLIT:
        mbarrier.expect(ready.index(slot), desc_q.block_type.nbytes + desc_do.block_type.nbytes
                        + desc_q2.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [off_b, m0, head, 0], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(desc_do, [off_b, m0, head, 0], ready.index(slot), do_smem.index(slot))
        tma.async_copy_global_to_shared(desc_q2, [off_b, m0, head, 0], ready.index(slot), q2_smem.index(slot))
    else:
        _load_pair(desc_q, desc_do, q_smem.index(slot), do_smem.index(slot), ready.index(slot), off_b, m0, head)


@gluon.jit
def _issue_scores(a1, a2, ring1, ring2, ready, step, out_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                  OUT_M: gl.constexpr, RING_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """Issue a1 ring1_step^T and a2 ring2_step^T (async) once step's ring slot has landed: a backward
    step's two score products, [OUT_M, RING_ROWS] each: S^T = K Q^T over q / k's head dim, dP^T = V dO^T
    over v's (the ring holds Q, dO)."""
    slot = step % NUM_BUFFERS
    # each slot's barrier completes once per use: its parity flips every NUM_BUFFERS steps
    mbarrier.wait(ready.index(slot), (step // NUM_BUFFERS) & 1)
    b1 = ring1.index(slot).reshape([RING_ROWS, HEAD_DIM])
    b2 = ring2.index(slot).reshape([RING_ROWS, HEAD_DIM_V])
    acc = gl.zeros([OUT_M, RING_ROWS], gl.float32, out_layout)
    s = warpgroup_mma(a1, b1.permute((1, 0)), acc, use_acc=False, is_async=True)
    dp = warpgroup_mma(a2, b2.permute((1, 0)), acc, use_acc=False, is_async=True)
    return s, dp


@gluon.jit
def _issue_score_tail(a1b, ring1b, step, out_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr, OUT_M: gl.constexpr,
                      RING_ROWS: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr):
    """S^T's share of q / k's tail columns (a head dim of 192 = 128 + 64), into an accumulator of its own that
    the caller adds after the wait: chained into S^T's, ptxas waits for the pair right after issuing it. The
    slot's barrier was waited for by _issue_scores."""
    b1b = ring1b.index(step % NUM_BUFFERS).reshape([RING_ROWS, HEAD_DIM_TAIL])
    acc = gl.zeros([OUT_M, RING_ROWS], gl.float32, out_layout)
    return warpgroup_mma(a1b, b1b.permute((1, 0)), acc, use_acc=False, is_async=True)


@gluon.constexpr_function
def mma_layout_cols(num_warps, warps_n, n, k):
    # gluon_fwd.mma_layout with the warps split into warps_n groups side by side along N, each
    # taking n // warps_n columns: at d = 256 two warpgroups share the 64 key rows and each holds
    # half of the dK / dV columns (warps_n = 1 is mma_layout itself)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // warps_n, warps_n],
                                     instr_shape=[16, n // warps_n, k])


@gluon.constexpr_function
def operand_smem_layout(rows, cols, dtype):
    # the shared-memory layout wgmma reads an A operand [rows, cols] from (K = cols contiguous)
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


@gluon.jit
def _grads_of_step(s_t, dp_t, p_buf, ds_buf, LSE, DELTA, step, off_b, h0, m_start, steps_per_head, key_idx, seqlen,
                   stride_lb, stride_lh, qk_scale, col_layout: gl.constexpr, dtype: gl.constexpr,
                   BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, window_left=0, LOCAL: gl.constexpr = False):
    """P^T and dS^T of one step, written in bf16 / fp16 to the shared buffers the dV and dK products
    read as their A operands (the caller makes sure no product in flight reads these buffers)."""
    head = h0 + step // steps_per_head
    q_idx = (m_start + step % steps_per_head) * BLOCK_M + gl.arange(0, BLOCK_M, col_layout)
    row_ok = q_idx < seqlen
    base = off_b * stride_lb + head * stride_lh
    # rows past the sequence: lse = +inf makes their P (and so dS) exactly 0
    lse2 = gl.load(LSE + base + q_idx, mask=row_ok, other=float("inf")) * LOG2E
    delta = gl.load(DELTA + base + q_idx, mask=row_ok, other=0.0)
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    if CAUSAL:
        # key j (in query-row coordinates) is visible to query i iff j <= i (and, in a window, i - j <= window_left)
        if LOCAL:
            dist = gl.expand_dims(q_idx, 0) - gl.expand_dims(key_idx, 1)
            p_t = gl.where((dist >= 0) & (dist <= window_left), p_t, 0.0)
        else:
            p_t = gl.where(gl.expand_dims(key_idx, 1) <= gl.expand_dims(q_idx, 0), p_t, 0.0)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
    p_buf.store(p_t.to(dtype))
    ds_buf.store(ds_t.to(dtype))
    # generic-proxy writes must be visible to wgmma (async proxy) before it reads them
    fence_async_shared()


@gluon.jit
def _grads_of_step_lean(s_t, dp_t, p_buf, ds_buf, LSE, DELTA, step, off_b, h0, m_start, steps_per_head, key_idx,
                        seqlen, stride_lb, stride_lh, qk_scale, col_layout: gl.constexpr, dtype: gl.constexpr,
                        BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, window_left=0, LOCAL: gl.constexpr = False,
                        softcap_log2e=0.0, SOFTCAP: gl.constexpr = False, ALIBI_SLOPES=None, stride_ab=0, n0=0,
                        ALIBI: gl.constexpr = False, key_end=0, KEY_MASK: gl.constexpr = False):
    """_grads_of_step ordered for fewer live registers (the plain order's 64-row steps): P^T is
    stored before delta is loaded and dS^T computed. SOFTCAP: the scores are ``softcap * tanh(x * scale /
    softcap)`` (qk_scale is then scale / softcap in base e), so dS^T carries tanh's derivative 1 - t^2.
    ALIBI (causal): every score gains ``slope * (key - row)`` after the cap, the slope the step's query head's
    (ALIBI_SLOPES at off_b * stride_ab + head); n0: the key block's first key. KEY_MASK: keys at key_end (query-row
    coordinates, as key_idx) and after lie past the keys (zero fill, or another packed sequence's), so their P^T is
    0 (the fused dQ reads every key of the block)."""
    head = h0 + step // steps_per_head
    q_idx = (m_start + step % steps_per_head) * BLOCK_M + gl.arange(0, BLOCK_M, col_layout)
    row_ok = q_idx < seqlen
    base = off_b * stride_lb + head * stride_lh
    lse2 = gl.load(LSE + base + q_idx, mask=row_ok, other=float("inf")) * LOG2E
    if ALIBI:
        # the lse is the true one (the full bias inside), so P needs the full bias slope * (key - row) in base 2.
        # Split at the block's first key n0: the row's part joins the row's lse term (a +inf row stays +inf),
        # the key's part is one add per score; both stay as small as the bias itself, whatever the row
        slope2 = gl.load(ALIBI_SLOPES + off_b * stride_ab + head) * LOG2E
        lse2 = lse2 + slope2 * (q_idx - n0).to(gl.float32)
        key_bias = gl.expand_dims(slope2 * (key_idx - n0).to(gl.float32), 1)
    if SOFTCAP:
        # tanh through exp2, as the forward; the capped score in base-2 units needs no further scale
        t = 1.0 - 2.0 / (gl.exp2(s_t * (qk_scale * 2.8853900817779268)) + 1.0)
        if ALIBI:
            p_t = gl.exp2(t * softcap_log2e + key_bias - gl.expand_dims(lse2, 0))
        else:
            p_t = gl.exp2(t * softcap_log2e - gl.expand_dims(lse2, 0))
    elif ALIBI:
        p_t = gl.exp2(s_t * qk_scale + key_bias - gl.expand_dims(lse2, 0))
    else:
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
    if CAUSAL:
        if LOCAL:
            dist = gl.expand_dims(q_idx, 0) - gl.expand_dims(key_idx, 1)
            p_t = gl.where((dist >= 0) & (dist <= window_left), p_t, 0.0)
        else:
            p_t = gl.where(gl.expand_dims(key_idx, 1) <= gl.expand_dims(q_idx, 0), p_t, 0.0)
    if KEY_MASK:
        p_t = gl.where(gl.expand_dims(key_idx < key_end, 1), p_t, 0.0)
    p_buf.store(p_t.to(dtype))
    delta = gl.load(DELTA + base + q_idx, mask=row_ok, other=0.0)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t * t)
    ds_buf.store(ds_t.to(dtype))
    fence_async_shared()


@gluon.jit
def _issue_grads(p_buf, ds_buf, dk, dv, q_smem, do_smem, step, NUM_BUFFERS: gl.constexpr, BLOCK_M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr):
    """Issue dV += P^T dO and dK += dS^T Q of one step (async; every operand in shared memory)."""
    slot = step % NUM_BUFFERS
    q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_V])
    dv = warpgroup_mma(p_buf, do_tile, dv, is_async=True)
    dk = warpgroup_mma(ds_buf, q_tile, dk, is_async=True)
    return dk, dv


@gluon.jit
def _reduce_dq(k_rows, ds_buf, p_buf, dk, dv, q_smem, do_smem, step, desc_dq, dq_smem, coord, dq_scale,
               st_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               HEAD_DIM_V: gl.constexpr):
    """A fused step's three products: dQ^T = K^T dS^T (k_rows: K^T in shared memory, [HEAD_DIM, BLOCK_N]) issued
    first so it retires first, then dV += P^T dO and dK += dS^T Q (returned in flight). dQ^T times dq_scale is
    staged in dq_smem (fp32, desc_dq's box: BLOCK_M rows of HEAD_DIM) and added into desc_dq at coord by TMA
    reduce-add while dV and dK run. dQ^T's columns are split between the warps as S^T's (st_layout)."""
    acc = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, st_layout)
    dq_t = warpgroup_mma(k_rows, ds_buf, acc, use_acc=False, is_async=True)
    dk, dv = _issue_grads(p_buf, ds_buf, dk, dv, q_smem, do_smem, step, NUM_BUFFERS, BLOCK_M, HEAD_DIM, HEAD_DIM_V)
    dq_t = warpgroup_mma_wait(num_outstanding=2, deps=(dq_t,))
    tma.store_wait(pendings=0)  # the previous step's reduce-add has read the staging tile
    dq_smem.reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)).store(dq_t * dq_scale)
    fence_async_shared()
    _tma_reduce_add(desc_dq, coord, dq_smem)
    return dk, dv


@gluon.jit
def _reduce_dq_split(k_rows, k2_rows, ds_buf, p_buf, dk, dv, dk2, q_smem, q2_smem, do_smem, step, desc_dq, desc_dq2,
                     dq_smem, dq2_smem, coord, dq_scale, st_layout: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                     BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
                     HEAD_DIM_V: gl.constexpr):
    """_reduce_dq for a head dim split in two column ranges (192 = 128 + 64): dQ^T's two ranges from K's two
    (k_rows, k2_rows), each staged and added into its own descriptor (desc_dq, desc_dq2: views of one buffer), and
    dK's tail product issued with the others. Returns dK, dV, dK_tail in flight."""
    dq_t = warpgroup_mma(k_rows, ds_buf, gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, st_layout), use_acc=False,
                         is_async=True)
    dq2_t = warpgroup_mma(k2_rows, ds_buf, gl.zeros([HEAD_DIM_TAIL, BLOCK_M], gl.float32, st_layout), use_acc=False,
                          is_async=True)
    dk, dv = _issue_grads(p_buf, ds_buf, dk, dv, q_smem, do_smem, step, NUM_BUFFERS, BLOCK_M, HEAD_DIM, HEAD_DIM_V)
    dk2 = _issue_dk_tail(ds_buf, dk2, q2_smem, step, NUM_BUFFERS, BLOCK_M, HEAD_DIM_TAIL)
    dq_t, dq2_t = warpgroup_mma_wait(num_outstanding=3, deps=(dq_t, dq2_t))
    tma.store_wait(pendings=0)  # the previous step's reduce-adds have read the staging tiles
    dq_smem.reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)).store(dq_t * dq_scale)
    dq2_smem.reshape([BLOCK_M, HEAD_DIM_TAIL]).permute((1, 0)).store(dq2_t * dq_scale)
    fence_async_shared()
    _tma_reduce_add(desc_dq, coord, dq_smem)
    _tma_reduce_add(desc_dq2, coord, dq2_smem)
    return dk, dv, dk2


@gluon.jit
def _issue_dk_tail(ds_buf, dk2, q2_smem, step, NUM_BUFFERS: gl.constexpr, BLOCK_M: gl.constexpr,
                   HEAD_DIM_TAIL: gl.constexpr):
    """dK's tail columns += dS^T Q_tail of one step (async)."""
    q2_tile = q2_smem.index(step % NUM_BUFFERS).reshape([BLOCK_M, HEAD_DIM_TAIL])
    return warpgroup_mma(ds_buf, q2_tile, dk2, is_async=True)


@gluon.jit
def _gluon_attn_bwd_dkdv_kernel(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_q2, desc_k2, desc_dk2, LSE,
                                DELTA, stride_lb, stride_lh, seqlen, n_kv_heads, heads_per_kv, qk_scale, grad_scale,
                                window_left, CU_SEQLENS, DK_OUT, DV_OUT, stride_dkn, stride_dkh, stride_dvn,
                                stride_dvh, softcap_log2e, ALIBI_SLOPES, stride_ab, seqlen_k, CU_SEQLENS_K, KV_LENS,
                                desc_dq, desc_dq2, HEAD_DIM: gl.constexpr,
                                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                NUM_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WARPS_N: gl.constexpr = 1,
                                ROTATED: gl.constexpr = True, LAUNCH_DEPENDENTS: gl.constexpr = False,
                                HEAD_DIM_TAIL: gl.constexpr = 0, HEAD_DIM_V: gl.constexpr = 0,
                                LOCAL: gl.constexpr = False, VARLEN: gl.constexpr = False,
                                SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
                                UNEQUAL: gl.constexpr = False, VARLEN_K: gl.constexpr = False,
                                FUSED_DQ: gl.constexpr = False):
    """dK, dV (b, s, h_k, d / dv) of q, k (b, s, h[_k], d), v, dout (b, s, h[_k], dv), lse and delta (b, h, s)
    fp32 (natural log for lse). qk_scale = softmax_scale * log2(e); grad_scale = softmax_scale (dK's factor).
    d = HEAD_DIM + HEAD_DIM_TAIL: a head dim of 192 arrives as 128 columns (desc_q / desc_k / desc_dk) and a
    64-column tail (desc_q2 / desc_k2 / desc_dk2; with no tail they repeat the others and go unused), whose
    products run beside the leading ones (plain order only). HEAD_DIM_V: v's head dim (0: HEAD_DIM). LOCAL
    (with CAUSAL): a causal sliding window, query i seeing keys i - window_left .. i. SOFTCAP: capped scores
    (qk_scale = softmax_scale / softcap, softcap_log2e = softcap * log2(e); plain order only). VARLEN: packed sequences
    (descriptors over (1, total, h, d), CU_SEQLENS (b + 1,) shared by q and k, lse / delta (h, total) with
    stride_lb 0); a key block ending past its sequence stores dK / dV row by row (DK_OUT, DV_OUT and their row
    and head strides) instead of by TMA, which would overwrite the next sequence's rows. ALIBI (with CAUSAL; plain
    order only): fp32 slopes ALIBI_SLOPES (h,) or (b, h) (stride_ab: its batch stride, 0 for (h,)), one per query
    head, each score biased by ``-slope * |row - key|``. UNEQUAL (padded): k's length ``seqlen_k`` differs from
    q's ``seqlen``; query i's diagonal key is i + seqlen_k - seqlen (bottom-right, the forward's alignment), and
    the masks and the bias read each key shifted back by that much. VARLEN_K (with VARLEN): k's own sequences,
    starting at CU_SEQLENS_K[b], KV_LENS[b] keys long, aligned with q's bottom-right per sequence as UNEQUAL's.
    WARPS_N = 2 (d = 256, 8 warps): two warpgroups side by side, each with half of every tile's
    columns (half the queries of S^T / dP^T, half of d in dK / dV); P^T / dS^T meet in shared memory.
    ROTATED = False (the d = 128 / 256 table's choice): the plain order, every product
    waited for within its step, so no scores are held across steps and 64-row steps fit in
    registers; the overlap then comes from a second CTA on the SM (d = 128) or from the two
    warpgroups (d = 256). ROTATED = True: the next step's scores are issued before this step's
    gradient products (d = 64's default). LAUNCH_DEPENDENTS: let the dQ kernel launched after this one
    with programmatic dependent launch start on the SMs this grid's last wave leaves idle. FUSED_DQ (plain order): each
    step also computes its share of dQ, dQ^T = K^T dS^T over the block's keys, and adds it by TMA reduce-add into
    desc_dq, an fp32 (b, s, h, d) buffer of zeros (scaled by grad_scale: the caller only casts it), so no dQ kernel
    follows; the adds' order varies run to run (not deterministic). With a tail, desc_dq covers the leading columns
    and desc_dq2 the tail (views of one buffer); without one desc_dq2 goes unread."""
    if LAUNCH_DEPENDENTS:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    NUM_WARPS: gl.constexpr = gl.num_warps()
    SPLIT: gl.constexpr = HEAD_DIM_TAIL > 0
    DV: gl.constexpr = HEAD_DIM_V if HEAD_DIM_V > 0 else HEAD_DIM
    # each column group is whole warpgroups, and its share of a step's queries a wgmma width
    gl.static_assert((NUM_WARPS // WARPS_N) % 4 == 0)
    gl.static_assert(BLOCK_M % (8 * WARPS_N) == 0)
    # the rotated schedule keeps one more score tile in flight: a split head dim's does not fit beside it
    gl.static_assert(not (SPLIT and ROTATED))
    gl.static_assert(not (VARLEN and ROTATED))  # packed sequences: the plain order only
    gl.static_assert(not (SOFTCAP and ROTATED))  # softcap: the plain order only
    gl.static_assert(not (ALIBI and ROTATED))  # ALiBi: the plain order only
    # ALiBi's bias is slope * (key - row) only where every visible key is left of the row
    gl.static_assert(CAUSAL or not ALIBI)
    # k's own sequences: no window or ALiBi (the route keeps those calls on Triton)
    gl.static_assert(not VARLEN_K or (VARLEN and not LOCAL and not ALIBI))
    gl.static_assert(not (FUSED_DQ and ROTATED))  # dQ rides the plain order
    st_layout: gl.constexpr = mma_layout_cols(NUM_WARPS, WARPS_N, BLOCK_M, 16)  # S^T, dP^T: [BLOCK_N, BLOCK_M]
    acc_layout: gl.constexpr = mma_layout_cols(NUM_WARPS, WARPS_N, HEAD_DIM, 16)  # dK: [BLOCK_N, HEAD_DIM]
    accv_layout: gl.constexpr = mma_layout_cols(NUM_WARPS, WARPS_N, DV, 16)  # dV: [BLOCK_N, DV]
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = desc_q.dtype

    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    off_b = pid_bh // n_kv_heads
    off_hk = pid_bh % n_kv_heads
    n0 = pid_n * BLOCK_N
    seq0, seqlen, tb = _sequence(CU_SEQLENS, off_b, seqlen, VARLEN)
    kseq0 = seq0
    kv_len = seqlen
    if VARLEN_K:
        kseq0 = gl.load(CU_SEQLENS_K + off_b)
        kv_len = gl.load(KV_LENS + off_b)
    if VARLEN:
        # the grid covers the longest sequence: a key block past this one has nothing to do
        if n0 >= kv_len:
            return
        LSE = LSE + seq0
        DELTA = DELTA + seq0
    h0 = off_hk * heads_per_kv
    # r0: the block's first key in query-row coordinates (the row whose diagonal it is)
    r0 = n0
    if UNEQUAL:
        r0 = n0 - (seqlen_k - seqlen)
    if VARLEN_K:
        r0 = n0 - (kv_len - seqlen)
    m_start = 0
    if CAUSAL:
        # query rows before the block's first key see none of its keys (UNEQUAL: r0 may be negative)
        if UNEQUAL or VARLEN_K:
            m_start = gl.maximum(r0, 0) // BLOCK_M
        else:
            m_start = n0 // BLOCK_M
    m_end = gl.cdiv(seqlen, BLOCK_M)
    if LOCAL:
        # queries more than window_left after the block's last key see none of its keys
        m_end = gl.cdiv(gl.minimum(seqlen, r0 + BLOCK_N + window_left), BLOCK_M)
    steps_per_head = m_end - m_start
    n_steps = steps_per_head * heads_per_kv

    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_do.block_type.shape, desc_do.layout)
    ps_layout: gl.constexpr = operand_smem_layout(BLOCK_N, BLOCK_M, dtype)
    if ROTATED:
        # P^T and dS^T of two consecutive steps: step j writes buffer j % 2 while step j-1's products
        # read the other one
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    else:
        # the plain order retires a step's products before the next step writes: one buffer each
        p_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ps_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ps_layout)
    k2_smem = k_smem
    q2_smem = q_smem
    if SPLIT:
        k2_smem = gl.allocate_shared_memory(dtype, desc_k2.block_type.shape, desc_k2.layout)
        q2_smem = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + desc_q2.block_type.shape, desc_q2.layout)
    kv_ready, ready = _barriers(NUM_BUFFERS)
    if SPLIT:
        mbarrier.expect(kv_ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes + desc_k2.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [tb, kseq0 + n0, off_hk, 0], kv_ready, k_smem)
        tma.async_copy_global_to_shared(desc_v, [tb, kseq0 + n0, off_hk, 0], kv_ready, v_smem)
        tma.async_copy_global_to_shared(desc_k2, [tb, kseq0 + n0, off_hk, 0], kv_ready, k2_smem)
    else:
        _load_pair(desc_k, desc_v, k_smem, v_smem, kv_ready, tb, kseq0 + n0, off_hk)
    for i in gl.static_range(NUM_BUFFERS):
        if i < n_steps:
            _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, i, tb, h0, m_start, steps_per_head, NUM_BUFFERS,
                       BLOCK_M, desc_q2, q2_smem, SPLIT, seq0)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, DV])
    k2_tile = k_tile
    if SPLIT:
        k2_tile = k2_smem.reshape([BLOCK_N, HEAD_DIM_TAIL])
    mbarrier.wait(kv_ready, 0)

    # the block's keys in query-row coordinates: every mask and the bias compare them with query rows
    key_idx = r0 + gl.arange(0, BLOCK_N, key_layout)
    if ROTATED:
        # step j+NUM_BUFFERS-1 is loaded during step j (see the refill): step j+1 must be resident
        # when step j issues its scores, so the ring needs three slots at least
        gl.static_assert(NUM_BUFFERS >= 3)
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, DV], gl.float32, accv_layout))
        s_t, dp_t = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, 0, st_layout, NUM_BUFFERS, BLOCK_N, BLOCK_M,
                                  HEAD_DIM, DV)
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
        for j in range(0, n_steps - 1):
            s_next, dp_next = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, j + 1, st_layout, NUM_BUFFERS,
                                            BLOCK_N, BLOCK_M, HEAD_DIM, DV)
            # the tensor cores hold dV/dK of step j-1 and the scores of step j+1: this runs under them.
            # Buffer j % 2 was last read by step j-2's products, retired by step j-1's wait.
            _grads_of_step(s_t, dp_t, p_smem.index(j % 2), ds_smem.index(j % 2), LSE, DELTA, j, off_b, h0, m_start,
                           steps_per_head, key_idx, seqlen, stride_lb, stride_lh, qk_scale, col_layout, dtype, BLOCK_M,
                           CAUSAL, window_left, LOCAL)
            dk, dv, s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, s_next, dp_next))
            # step j-1's slot is free: its scores retired in step j-1, its dV/dK products just now
            refill = j - 1 + NUM_BUFFERS
            if (j >= 1) & (refill < n_steps):
                _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, refill, off_b, h0, m_start, steps_per_head,
                           NUM_BUFFERS, BLOCK_M)
            dk, dv = _issue_grads(p_smem.index(j % 2), ds_smem.index(j % 2), dk, dv, q_smem, do_smem, j, NUM_BUFFERS,
                                  BLOCK_M, HEAD_DIM, DV)
        last = n_steps - 1
        _grads_of_step(s_t, dp_t, p_smem.index(last % 2), ds_smem.index(last % 2), LSE, DELTA, last, off_b, h0, m_start,
                       steps_per_head, key_idx, seqlen, stride_lb, stride_lh, qk_scale, col_layout, dtype, BLOCK_M, CAUSAL,
                       window_left, LOCAL)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        dk, dv = _issue_grads(p_smem.index(last % 2), ds_smem.index(last % 2), dk, dv, q_smem, do_smem, last,
                              NUM_BUFFERS, BLOCK_M, HEAD_DIM, DV)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    else:
        gl.static_assert(NUM_BUFFERS >= 2)
        # plain tensors: the loop carries them waited for, not as in-flight accumulators
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([BLOCK_N, DV], gl.float32, accv_layout)
        if SPLIT:
            acc2_layout: gl.constexpr = mma_layout_cols(NUM_WARPS, WARPS_N, HEAD_DIM_TAIL, 16)
            dk2 = gl.zeros([BLOCK_N, HEAD_DIM_TAIL], gl.float32, acc2_layout)
        if FUSED_DQ:
            # a step's dQ^T [HEAD_DIM, BLOCK_M] is staged here for the reduce-add
            dq_smem = gl.allocate_shared_memory(gl.float32, desc_dq.block_type.shape, desc_dq.layout)
            k_rows = k_tile.permute((1, 0))
            if SPLIT:  # q / k's tail columns give dQ's: their own staging tile and descriptor (desc_dq2)
                dq2_smem = gl.allocate_shared_memory(gl.float32, desc_dq2.block_type.shape, desc_dq2.layout)
                k2_rows = k2_tile.permute((1, 0))
        # in query-row coordinates the keys end at q's length in every layout (padded, UNEQUAL, VARLEN, VARLEN_K);
        # causal masks keys after the row, so only non-causal builds need it
        KEY_MASK: gl.constexpr = FUSED_DQ and not CAUSAL
        for j in range(0, n_steps):
            s_t, dp_t = _issue_scores(k_tile, v_tile, q_smem, do_smem, ready, j, st_layout, NUM_BUFFERS, BLOCK_N,
                                      BLOCK_M, HEAD_DIM, DV)
            if SPLIT:
                s_tail = _issue_score_tail(k2_tile, q2_smem, j, st_layout, NUM_BUFFERS, BLOCK_N, BLOCK_M,
                                           HEAD_DIM_TAIL)
                s_t, dp_t, s_tail = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t, s_tail))
                s_t = s_t + s_tail
            else:
                s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
            _grads_of_step_lean(s_t, dp_t, p_smem.index(0), ds_smem.index(0), LSE, DELTA, j, off_b, h0, m_start,
                                steps_per_head, key_idx, seqlen, stride_lb, stride_lh, qk_scale, col_layout, dtype,
                                BLOCK_M, CAUSAL, window_left, LOCAL, softcap_log2e, SOFTCAP, ALIBI_SLOPES, stride_ab,
                                r0, ALIBI, seqlen, KEY_MASK)
            dq_coord = [tb, seq0 + (m_start + j % steps_per_head) * BLOCK_M, h0 + j // steps_per_head, 0]
            if FUSED_DQ and SPLIT:
                dk, dv, dk2 = _reduce_dq_split(k_rows, k2_rows, ds_smem.index(0), p_smem.index(0), dk, dv, dk2,
                                               q_smem, q2_smem, do_smem, j, desc_dq, desc_dq2, dq_smem, dq2_smem,
                                               dq_coord, grad_scale, st_layout, NUM_BUFFERS, BLOCK_M, HEAD_DIM,
                                               HEAD_DIM_TAIL, DV)
            elif FUSED_DQ:
                dk, dv = _reduce_dq(k_rows, ds_smem.index(0), p_smem.index(0), dk, dv, q_smem, do_smem, j, desc_dq,
                                    dq_smem, dq_coord, grad_scale, st_layout, NUM_BUFFERS, BLOCK_M, HEAD_DIM, DV)
            else:
                dk, dv = _issue_grads(p_smem.index(0), ds_smem.index(0), dk, dv, q_smem, do_smem, j, NUM_BUFFERS,
                                      BLOCK_M, HEAD_DIM, DV)
                if SPLIT:
                    dk2 = _issue_dk_tail(ds_smem.index(0), dk2, q2_smem, j, NUM_BUFFERS, BLOCK_M, HEAD_DIM_TAIL)
            # nothing stays in flight across steps (an in-flight product there made ptxas serialise)
            if SPLIT:
                dk, dv, dk2 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dk2))
            else:
                dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            if j + NUM_BUFFERS < n_steps:  # step j's slot is free: load the step NUM_BUFFERS ahead
                _load_q_do(desc_q, desc_do, q_smem, do_smem, ready, j + NUM_BUFFERS, tb, h0, m_start,
                           steps_per_head, NUM_BUFFERS, BLOCK_M, desc_q2, q2_smem, SPLIT, seq0)

    _invalidate(kv_ready, ready, NUM_BUFFERS)
    if FUSED_DQ:
        tma.store_wait(pendings=0)  # the last reduce-add has read its tile before the CTA's shared memory goes
    if VARLEN_K:
        # from here on the rows are keys: k's start and length (read again, not kept across the loop)
        seq0 = gl.load(CU_SEQLENS_K + off_b, volatile=True)
        seqlen = gl.load(KV_LENS + off_b, volatile=True)
    if VARLEN and (n0 + BLOCK_N > seqlen):
        # a TMA store would write the next sequence's rows too: store this block's rows one by one
        dk_rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc_layout))
        dk_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
        dk_ptrs = (DK_OUT + gl.expand_dims((seq0 + dk_rows).to(gl.int64) * stride_dkn, 1) + off_hk * stride_dkh
                   + gl.expand_dims(dk_cols, 0))
        gl.store(dk_ptrs, (dk * grad_scale).to(dtype), mask=gl.expand_dims(dk_rows < seqlen, 1))
        dv_rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, accv_layout))
        dv_cols = gl.arange(0, DV, gl.SliceLayout(0, accv_layout))
        dv_ptrs = (DV_OUT + gl.expand_dims((seq0 + dv_rows).to(gl.int64) * stride_dvn, 1) + off_hk * stride_dvh
                   + gl.expand_dims(dv_cols, 0))
        gl.store(dv_ptrs, dv.to(dtype), mask=gl.expand_dims(dv_rows < seqlen, 1))
        if SPLIT:
            acc2_layout_s: gl.constexpr = mma_layout_cols(NUM_WARPS, WARPS_N, HEAD_DIM_TAIL, 16)
            t_rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc2_layout_s))
            t_cols = HEAD_DIM + gl.arange(0, HEAD_DIM_TAIL, gl.SliceLayout(0, acc2_layout_s))
            t_ptrs = (DK_OUT + gl.expand_dims((seq0 + t_rows).to(gl.int64) * stride_dkn, 1) + off_hk * stride_dkh
                      + gl.expand_dims(t_cols, 0))
            gl.store(t_ptrs, (dk2 * grad_scale).to(dtype), mask=gl.expand_dims(t_rows < seqlen, 1))
        return
    # K and V are dead (every wgmma reading them retired): stage dK and dV there for the TMA stores,
    # which also clip the key rows past the sequence
    k_tile.store((dk * grad_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    if SPLIT:
        k2_tile.store((dk2 * grad_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [tb, seq0 + n0, off_hk, 0], k_smem)
    tma.async_copy_shared_to_global(desc_dv, [tb, seq0 + n0, off_hk, 0], v_smem)
    if SPLIT:
        tma.async_copy_shared_to_global(desc_dk2, [tb, seq0 + n0, off_hk, 0], k2_smem)
    tma.store_wait(pendings=0)


# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps[, WARPS_N, ROTATED]) per head dim, the fastest of
# scripts/tune_gluon_bwd.py's candidates at every measured row (docs/gluon.md, "The backward's dK/dV kernel").
# d = 128 and 256 take the plain order (ROTATED = 0): 64 query rows per step, every product waited for
# within its step, a 2-slot ring; d = 128 fits two CTAs on an SM (one's exponentials hide under the
# other's MMAs; causal spills 24 bytes and is still the fastest), d = 256 runs two warpgroups side by side
# (each half of d in dK / dV and half of a step's queries; 208 KiB of shared memory, one CTA per SM). The
# plain order took 5%-15% (d = 128) and 18%-21% (d = 256) off this kernel's time against the rotated
# schedule. d = 64 (taken only when config.gluon_bwd forces it) keeps the rotated schedule.
BWD_DKDV_CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=4, num_warps=4),
    128: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=2, num_warps=4, WARPS_N=1, ROTATED=0),
    192: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=2, num_warps=8, WARPS_N=2, ROTATED=0),
    256: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=2, num_warps=8, WARPS_N=2, ROTATED=0),
}
# The FUSED_DQ build's configs (the dQ kernel's work done in this one, docs/backward.md): 32-row steps at d = 128 /
# 256, so that a step's dQ^T ([d, 32] fp32) fits in registers beside dK and dV. ptxas -v: d = 128 220-244 registers
# with every feature, no spills, 90 KB of shared memory (two CTAs an SM); d = 256 211-220 registers, 172 KB;
# (192, 128) keeps 64-row steps on its two warpgroups: 231 registers, 188 KB (32-row steps: 178, 115 KB, still
# one CTA an SM). d = 64 takes 64-row steps: 195-211 registers plain or causal, 237-255 with a softcap / ALiBi, no
# spills, 82 KB (two CTAs an SM).
BWD_FUSED_CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=2, num_warps=4, WARPS_N=1, ROTATED=0),
    128: dict(BLOCK_M=32, BLOCK_N=64, NUM_BUFFERS=2, num_warps=4, WARPS_N=1, ROTATED=0),
    192: dict(BLOCK_M=64, BLOCK_N=64, NUM_BUFFERS=2, num_warps=8, WARPS_N=2, ROTATED=0),
    256: dict(BLOCK_M=32, BLOCK_N=64, NUM_BUFFERS=2, num_warps=8, WARPS_N=2, ROTATED=0),
}
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps", "WARPS_N", "ROTATED")
