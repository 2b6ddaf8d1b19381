"""Forward of programmable attention (flashtile.flex): one program computes BLOCK_M query rows of one
(batch, head) over the key blocks its block mask lists.

The mods arrive as constexpr jit functions (generated per mod, backends/triton/flex/codegen.py):
``SCORE_MOD(score, b, h, q_idx, kv_idx, BUFS)`` on the scaled score tile and ``MASK_MOD(b, h, q_idx,
kv_idx, BUFS)``; ``BUFS`` is the tuple of tensors the mods captured. The block mask lists, per
(batch, head, query block of SPARSE_Q rows), the key blocks (SPARSE_KV keys) that are partly visible
(mask_mod runs on them) and those fully visible (no mask work); every other block is skipped. A
sparse block is walked in BLOCK_N-key tiles (kernels/flex_common.py holds the helpers shared with the
backward).

Layout: (batch, heads, seq, dim) tensors with a unit last stride; lse (b, h, sq) fp32, natural log,
+inf for a row that sees no key (its output is 0).
"""

import triton
import triton.language as tl

from flashtile.kernels.attn_fwd import _softmax_update
from flashtile.kernels.flex_common import (
    _block_list,
    _bounded,
    _flex_scores,
    _list_offsets,
    _listed_start,
    _load_rows,
    _q_rows,
)


@triton.jit
def _flex_fwd_inner(acc, m_i, l_i, q, K, V, NUM, IDX, FULL_NUM, FULL_IDX, b, h, q_idx, offs_d, offs_dv,
                    seqlen_k, stride_kn, stride_vn, sm_scale, BUFS,
                    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPARSE_KV: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    desc_k=None, desc_v=None, kv_head=0, USE_TMA: tl.constexpr = False):
    """Online softmax over the query block's two key-block lists: the partly visible blocks (IDX[0 : NUM],
    mask_mod decides per element), then the fully visible ones (FULL_IDX[0 : FULL_NUM], no mask work).
    USE_TMA: K and V tiles come through tensor descriptors over (b, h_k, s, d) (desc_k, desc_v; the copy
    engine zero-fills rows past the keys and columns past the head dim)."""
    offs_n = tl.arange(0, BLOCK_N)
    for phase in tl.static_range(2):
        LIST, n_tiles = _block_list(phase, NUM, IDX, FULL_NUM, FULL_IDX, SPARSE_KV, BLOCK_N)
        for j in tl.range(0, n_tiles):
            col0 = _listed_start(LIST, j, SPARSE_KV, BLOCK_N)
            cols = col0 + offs_n
            if USE_TMA:
                kt = tl.trans(desc_k.load([b, kv_head, col0, 0]).reshape(BLOCK_N, offs_d.shape[0]))
            else:
                k_mask = offs_d[:, None] < HEAD_DIM
                if not EVEN_N:
                    k_mask = k_mask & (cols[None, :] < seqlen_k)
                kt = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=k_mask, other=0.0)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
            kv_idx = _bounded(cols, seqlen_k, EVEN_N)[None, :]
            _, s, _ = _flex_scores(qk, sm_scale, b, h, q_idx, kv_idx, q_idx >= 0, cols[None, :] < seqlen_k, BUFS,
                                   SCORE_MOD, MASK_MOD, HAS_SCORE_MOD, phase == 0, False, not EVEN_N)
            # MASK=True: a row may have seen only -inf so far (a mask, or a score_mod returning -inf)
            p, m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc, True, 0)
            if USE_TMA:
                v = desc_v.load([b, kv_head, col0, 0]).reshape(BLOCK_N, offs_dv.shape[0])
            else:
                v = _load_rows(V, cols, stride_vn, offs_dv, seqlen_k, HEAD_DIM_V, not EVEN_N)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flex_fwd_kernel(
    Q, K, V, O, LSE, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, BUFS, desc_k, desc_v,
    sm_scale, seqlen_q, seqlen_k, num_heads, group,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_lse_b, stride_lse_h,
    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
):
    """Out and lse of BLOCK_M query rows of one (batch, head). The block-mask tensors (KV_NUM (b, h, nq),
    KV_IDX (b, h, nq, nk), and FULL_*) come expanded to (b, h): a broadcast dimension has stride 0.
    USE_TMA: desc_k / desc_v are tensor descriptors of K and V (boxes of BLOCK_N rows of one head), else the
    tensors again, unused."""
    b, h, kv_head, start_m, offs_m = _q_rows(seqlen_q, num_heads, group, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q = _load_rows(Q + b64 * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, seqlen_q, HEAD_DIM, True)
    q_idx = _bounded(offs_m, seqlen_q, EVEN_M)[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row, idx_row = _list_offsets(b, h, start_m // SPARSE_Q, stride_nb, stride_nh, stride_nm, stride_ib, stride_ih,
                                 stride_im)
    acc, m_i, l_i = _flex_fwd_inner(acc, m_i, l_i, q, K + b64 * stride_kb + kv_head * stride_kh,
                                    V + b64 * stride_vb + kv_head * stride_vh, KV_NUM + row, KV_IDX + idx_row,
                                    FULL_NUM + row, FULL_IDX + idx_row, b, h, q_idx, offs_d, offs_dv,
                                    seqlen_k, stride_kn, stride_vn, sm_scale, BUFS, SCORE_MOD, MASK_MOD,
                                    HAS_SCORE_MOD, HEAD_DIM, HEAD_DIM_V, BLOCK_N, SPARSE_KV, EVEN_N, DOT_PRECISION,
                                    desc_k, desc_v, kv_head, USE_TMA)

    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    row_ok = offs_m < seqlen_q
    tl.store(O + b64 * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + b64 * stride_lse_b + h * stride_lse_h + offs_m, lse, mask=row_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by (arch, head-dim bucket). The sm90 d = 128 row is the plain
# forward's non-causal shape with 64-key tiles (registers left for the mods' arithmetic); scripts/tune_flex.py's
# sweep found 64 x 64 with 4 warps 9% faster summed over causal / document / softcap but twice as slow on the
# sliding window's mask (H100), so the row stays.
FLEX_FWD_CONFIGS = {
    ("sm90", 64): (128, 64, 4, 3),
    ("sm90", 128): (128, 64, 8, 3),
    ("sm90", 256): (64, 32, 4, 2),
    ("default", 64): (64, 64, 4, 2),
    ("default", 128): (64, 64, 4, 2),
    ("default", 256): (32, 32, 4, 1),
    ("interpret", 0): (16, 16, 4, 1),
}


def flex_fwd_config(arch: str, block_d: int) -> tuple:
    if arch == "interpret":
        return FLEX_FWD_CONFIGS[("interpret", 0)]
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    return FLEX_FWD_CONFIGS.get((arch, bucket), FLEX_FWD_CONFIGS[("default", bucket)])
