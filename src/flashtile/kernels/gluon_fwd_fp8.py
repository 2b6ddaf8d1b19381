"""FP8 (e4m3) entry point of the Gluon Hopper forward: same pipeline as ``gluon_fwd.py``.

What fp8 changes inside the shared body (``_attn_fwd_tile`` with ``FP8=True``), all following the
Triton fp8 kernel (``kernels/attn_fwd_fp8.py``) so the two agree to rounding:

- ``Q K^T`` is an e4m3 x e4m3 wgmma (32-wide reduction steps) with fp32 accumulation; the
  per-(batch, kv head) q and k descales are folded into the one score multiplier
  ``softmax_scale * log2(e) * q_descale * k_descale``.
- ``P`` is computed as ``exp2(s - m + 8)`` (row max mapped to 256, exact in e4m3 and < 448) and
  cast to e4m3 (round to nearest even) for the ``P V`` wgmma, straight from registers: the
  A operand of an 8-bit wgmma packs 4 elements per register (``k_width=4``), and Triton's
  convert_layout moves the accumulator-layout values there. The row sum ``l`` adds the fp32 P.
- V arrives as V^T ``(b, h_k, d, sk)`` with the keys contiguous (``transpose_v``'s layout): 8-bit
  wgmma reads its B operand K-major only, and in ``P V`` the reduction runs over keys. The smem
  tile ``[d, BLOCK_N]`` seen through a permute is that K-major ``[BLOCK_N, d]`` operand.
- ``out = acc * (v_descale / l)`` in bf16 (staged in its own shared buffer for the TMA store: Q's
  fp8 tile is half the size), ``lse = (m + log2 l - 8) ln 2``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashtile.kernels.gluon_fwd import _attn_fwd_tile


@gluon.jit
def _gluon_attn_fwd_fp8_kernel(desc_q, desc_k, desc_vt, desc_o, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, stride_lb,
                               stride_lh, seqlen, n_heads, heads_per_kv, qk_scale, HEAD_DIM: gl.constexpr,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                               CAUSAL: gl.constexpr, HAS_Q_DESCALE: gl.constexpr, HAS_K_DESCALE: gl.constexpr,
                               HAS_V_DESCALE: gl.constexpr):
    """e4m3 q (b, s, h, d), k (b, s, h_k, d), V^T (b, h_k, d, s); bf16 out (b, s, h, d)."""
    _attn_fwd_tile(desc_q, desc_q, desc_k, desc_k, desc_vt, desc_o, LSE, stride_lb, stride_lh, seqlen, n_heads,
                   heads_per_kv, qk_scale, Q_DESCALE, K_DESCALE, V_DESCALE, LSE, HEAD_DIM, 0, HEAD_DIM, BLOCK_M,
                   BLOCK_N, NUM_BUFFERS, CAUSAL, True, HAS_Q_DESCALE, HAS_K_DESCALE, HAS_V_DESCALE, False)
