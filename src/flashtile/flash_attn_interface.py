"""FlashAttention 2.8.3's public functions, with its signatures, defaults and return values.

Shapes: ``b`` batch, ``s`` sequence length, ``h`` query heads, ``h_k`` key/value heads
(``h % h_k == 0``), ``d`` head dim (1..256). Varlen functions pack the batch into ``total`` rows
described by int32 ``cu_seqlens`` of shape ``(b+1,)``.

Every function returns ``out`` (same shape and dtype as q), or ``(out, softmax_lse, S_dmask)`` when
``return_attn_probs=True``: ``softmax_lse`` is fp32 ``(b, h, sq)`` (varlen: ``(h, total_q)``), the
natural-log sum of exponentials of each row's scaled scores (+inf for a row that sees no key);
``S_dmask`` (testing aid) is ``(b, h, sq, sk)`` softmax probabilities with dropped entries negated
when ``dropout_p > 0``, else an empty tensor.
"""

from __future__ import annotations

import torch

from flashtile.autograd import (
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
)

__all__ = [
    "FlashAttnFunc",
    "FlashAttnKVPackedFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc",
    "FlashAttnVarlenKVPackedFunc",
    "FlashAttnVarlenQKVPackedFunc",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]

_COMMON_DOC = """
    dropout_p: probability of dropping an attention probability (use 0.0 in evaluation).
    softmax_scale: scale of q @ k^T before the softmax; default ``d ** -0.5``.
    causal: bottom-right aligned causal mask (row i sees key j iff j <= i + sk - sq).
    window_size: (left, right) sliding window, -1 = unbounded; a tuple, list or 2-element tensor.
    softcap: > 0 applies ``softcap * tanh(scores / softcap)``; cannot be combined with dropout.
    alibi_slopes: fp32 (h,) or (b, h); adds ``-slope * |i + sk - sq - j|`` to the scores.
    deterministic: backward gives bit-identical gradients run to run.
    return_attn_probs: also return ``(softmax_lse, S_dmask)`` (testing aid).

    Returns ``out``, or ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs`` (module docstring).
"""


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention over padded batches.

    q: (b, sq, h, d); k, v: (b, sk, h_k, d). Returns out (b, sq, h, d).
    """
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs, torch.is_grad_enabled())


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """Self-attention with q, k, v packed: qkv (b, s, 3, h, d). Returns out (b, s, h, d).

    The gradient is written straight into a (b, s, 3, h, d) buffer (no concatenation).
    """
    return FlashAttnQKVPackedFunc.apply(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                                        alibi_slopes, deterministic, return_attn_probs,
                                        torch.is_grad_enabled())


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                             return_attn_probs=False):
    """Attention with k, v packed: q (b, sq, h, d), kv (b, sk, 2, h_k, d). Returns out (b, sq, h, d)."""
    return FlashAttnKVPackedFunc.apply(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                                       alibi_slopes, deterministic, return_attn_probs,
                                       torch.is_grad_enabled())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None):
    """Attention over variable-length sequences packed along the first dim.

    q: (total_q, h, d); k, v: (total_k, h_k, d); cu_seqlens_q/k: int32 (b+1,) starting at 0;
    max_seqlen_q/k: Python ints. Returns out (total_q, h, d); lse (h, total_q).
    seqused_q/seqused_k (FlashAttention-3 extension): int32 (b,), only the first seqused tokens of
    each sequence take part (the rest of its rows get out 0, lse +inf).
    """
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p, softmax_scale, causal, window_size, softcap,
                                     alibi_slopes, deterministic, return_attn_probs, block_table,
                                     torch.is_grad_enabled(), seqused_q, seqused_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Varlen self-attention, qkv (total, 3, h, d). Returns out (total, h, d)."""
    return FlashAttnVarlenQKVPackedFunc.apply(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                                              causal, window_size, softcap, alibi_slopes,
                                              deterministic, return_attn_probs, torch.is_grad_enabled())


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """Varlen attention with kv packed: q (total_q, h, d), kv (total_k, 2, h_k, d)."""
    return FlashAttnVarlenKVPackedFunc.apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dropout_p, softmax_scale, causal,
                                             window_size, softcap, alibi_slopes, deterministic,
                                             return_attn_probs, torch.is_grad_enabled())


for _fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
            flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func):
    _fn.__doc__ = (_fn.__doc__ or "") + "\n    Keywords:" + _COMMON_DOC
