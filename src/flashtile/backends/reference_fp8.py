"""``attention_ref_fp8``: the semantics of flashtile's fp8 forward, in plain PyTorch.

The fp8 forward attends over the *dequantised* inputs: ``x.float() * x_descale[batch, kv_head]``
for x in q, k, v (query head h takes its kv head's q descale, as FlashAttention-3 does). This
module dequantises and calls :func:`attention_ref`, so every masking feature comes for free.

``round_probs=True`` also rounds the probabilities to e4m3 before ``P @ V`` the way the fp8 kernel
does (each row scaled so its largest probability maps to 256, see ``kernels/attn_fwd_fp8.py``):
that run is the "same precision" side of FlashAttention's tolerance rule for fp8.
"""

from __future__ import annotations

import torch

from flashtile.backends.reference import attention_ref
from flashtile.fp8 import FP8_DTYPE, dequantize

# The kernel computes P scaled so the running row max is 2**P_SHIFT (exact in e4m3, < 448): small
# probabilities then stay in e4m3's normal range instead of its 2-bit subnormals.
P_SHIFT = 8


def round_probs_like_kernel(probs: torch.Tensor) -> torch.Tensor:
    """Round each row of ``probs`` to e4m3 relative to its max scaled to ``2**P_SHIFT``."""
    rowmax = probs.amax(-1, keepdim=True)
    scale = torch.where(rowmax > 0, (2.0**P_SHIFT) / rowmax.clamp_min(1e-38), torch.zeros_like(rowmax))
    inv = torch.where(rowmax > 0, 1.0 / scale.clamp_min(1e-38), torch.zeros_like(rowmax))
    return (probs * scale).to(FP8_DTYPE).to(probs.dtype) * inv


def attention_ref_fp8(q, k, v, q_descale=None, k_descale=None, v_descale=None, *, round_probs=False,
                      cu_seqlens_q=None, cu_seqlens_k=None, **kw):
    """Reference fp8 attention; returns ``(out, lse)`` with out in fp32 (the kernels return bf16).

    q, k, v: ``torch.float8_e4m3fn`` (or any float dtype: they are only upcast), shaped as for
    :func:`attention_ref`; descales fp32 ``(b, h_k)`` or None (= 1). Keyword arguments (causal,
    window_size, softcap, alibi_slopes, softmax_scale, seqused_k, ...) pass through to
    :func:`attention_ref`.
    """
    qf = dequantize(q, q_descale, cu_seqlens=cu_seqlens_q)
    kf = dequantize(k, k_descale, cu_seqlens=cu_seqlens_k)
    vf = dequantize(v, v_descale, cu_seqlens=cu_seqlens_k)
    hook = round_probs_like_kernel if round_probs else None
    out, lse = attention_ref(qf, kf, vf, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, upcast=True,
                             probs_hook=hook, **kw)
    return out, lse
