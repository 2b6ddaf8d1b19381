"""Tile helpers the flex kernels share (kernels/flex_fwd.py, kernels/flex_bwd.py): program coordinates, the
walk over a block list, row-tile loads, and the score tile (score_mod, mask_mod, sequence ends) that the
forward and both backward kernels compute alike, in either orientation.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: jit code may read no other global


@triton.jit
def _flex_coords(seqlen, num_heads, BLOCK: tl.constexpr):
    """(block, batch, head) of this program: one flat grid axis, blocks fastest (neighbours share K/V in L2)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(seqlen, BLOCK)
    bh = pid // n_blocks
    return pid % n_blocks, bh // num_heads, bh % num_heads


@triton.jit
def _q_rows(seqlen_q, num_heads, group, BLOCK_M: tl.constexpr):
    """(batch, head, kv head, first row, rows) of a program that owns BLOCK_M query rows of one (batch, head)."""
    pid_m, b, h = _flex_coords(seqlen_q, num_heads, BLOCK_M)
    start_m = pid_m * BLOCK_M
    return b, h, h // group, start_m, start_m + tl.arange(0, BLOCK_M)


@triton.jit
def _list_offsets(b, h, block, stride_nb, stride_nh, stride_nn, stride_ib, stride_ih, stride_in):
    """Offsets of (b, h, block)'s count in a (b, h, n) count tensor and of its list in a (b, h, n, m) index
    tensor (expanded views: a broadcast dimension has stride 0)."""
    return (b * stride_nb + h * stride_nh + block * stride_nn,
            b * stride_ib + h * stride_ih + block * stride_in)


@triton.jit
def _bounded(offs, n, EVEN: tl.constexpr):
    """Indices handed to the mods: past the end they repeat the last one, so a mod that reads a captured
    tensor never reads past it (those lanes are masked out anyway)."""
    if EVEN:
        return offs
    return tl.minimum(offs, n - 1)


@triton.jit
def _block_list(PHASE: tl.constexpr, NUM, IDX, FULL_NUM, FULL_IDX, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """(list, tiles) of a program's block walk in PHASE 0, the partly visible blocks (mask_mod decides per
    element), or PHASE 1, the fully visible ones (no mask work), so the kernels run both phases with one
    body; tiles: how many BLOCK tiles its listed blocks of SPARSE positions hold (see _listed_start)."""
    if PHASE == 0:
        return IDX, tl.load(NUM) * (SPARSE // BLOCK)
    return FULL_IDX, tl.load(FULL_NUM) * (SPARSE // BLOCK)


@triton.jit
def _listed_start(IDX, j, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """First position of tile j of a block list: each listed sparse block (SPARSE positions) is walked in
    SPARSE // BLOCK whole tiles, all blocks' tiles flattened into one loop so the pipeliner sees one range."""
    SUBS: tl.constexpr = SPARSE // BLOCK
    return tl.load(IDX + j // SUBS) * SPARSE + (j % SUBS) * BLOCK


@triton.jit
def _load_rows(PTR, rows, stride, offs_d, n_rows, D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A [rows, BLOCK_D] tile of a (seq, dim) matrix with a unit last stride: zero past the head dim and,
    with CHECK_ROWS, past row ``n_rows``."""
    mask = offs_d[None, :] < D
    if CHECK_ROWS:
        mask = mask & (rows[:, None] < n_rows)
    return tl.load(PTR + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _flex_scores(qk, sm_scale, b, h, q_idx, kv_idx, q_in, kv_in, BUFS,
                 SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
                 APPLY_MASK: tl.constexpr, CHECK_Q: tl.constexpr, CHECK_KV: tl.constexpr):
    """(x, s, valid) of a tile of q.k products ``qk``, in either orientation (``q_idx`` / ``kv_idx``, the
    indices the mods see, and ``q_in`` / ``kv_in``, whether a position lies inside its sequence, broadcast
    to the tile's shape): x = sm_scale * q.k (the score_mod's input), s = score_mod(x) in base 2, -inf
    where not valid, and valid = what mask_mod keeps (APPLY_MASK: a partly visible block) inside the
    sequences (checked only where a tile can cross an end: CHECK_Q, CHECK_KV). Without a score_mod, s
    takes one multiply by the folded factor, as in the plain kernels. Nothing hidden: valid is all True in
    the tile's shape (the gradient helper masks with it) and s is left as is."""
    x = qk * sm_scale
    if HAS_SCORE_MOD:
        s = SCORE_MOD(x, b, h, q_idx, kv_idx, BUFS) * LOG2E
    else:
        s = qk * (sm_scale * LOG2E)
    # the predicates are combined only where they exist: an all-True term costs compares per element
    if APPLY_MASK:
        valid = MASK_MOD(b, h, q_idx, kv_idx, BUFS)
        if CHECK_Q:
            valid = valid & q_in
        if CHECK_KV:
            valid = valid & kv_in
    elif CHECK_Q and CHECK_KV:
        valid = q_in & kv_in
    elif CHECK_Q:
        valid = q_in
    elif CHECK_KV:
        valid = kv_in
    else:
        valid = (q_idx >= 0) & (kv_idx >= 0)
    if APPLY_MASK or CHECK_Q or CHECK_KV:
        s = tl.where(valid, s, float("-inf"))
    return x, s, valid


@triton.jit
def _row_stats(LSE, DELTA, offs_m, seqlen_q):
    """(lse in base 2, delta) of query rows; rows past the sequence get lse = +inf, which zeroes their
    probabilities, and delta = 0."""
    row_ok = offs_m < seqlen_q
    lse2 = tl.load(LSE + offs_m, mask=row_ok, other=float("inf")) * LOG2E
    return lse2, tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
