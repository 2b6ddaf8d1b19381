"""FlashAttention 2.8.3's public functions, with its signatures, defaults and return values.

Shapes: ``b`` batch, ``s`` sequence length, ``h`` query heads, ``h_k`` key/value heads
(``h % h_k == 0``), ``d`` head dim (1..256); v may have its own head dim ``dv`` (1..256, e.g.
DeepSeek-V3's d = 192, dv = 128), and out then has dv. Varlen functions pack the batch into ``total`` rows
described by int32 ``cu_seqlens`` of shape ``(b+1,)``.

Every function returns ``out`` (q's dtype, shape ``q.shape[:-1] + (dv,)``), or ``(out, softmax_lse, S_dmask)`` when
``return_attn_probs=True``: ``softmax_lse`` is fp32 ``(b, h, sq)`` (varlen: ``(h, total_q)``), the
natural-log sum of exponentials of each row's scaled scores (+inf for a row that sees no key);
``S_dmask`` (testing aid) is ``(b, h, sq, sk)`` softmax probabilities with dropped entries negated
when ``dropout_p > 0``, else an empty tensor.
"""

from __future__ import annotations

import torch

from flashtile import autograd as _ag
from flashtile.autograd import (
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
)
from flashtile.kvcache import flash_attn_combine, flash_attn_with_kvcache
from flashtile.ops import PACK_NONE

__all__ = [
    "flash_attn_combine",
    "flash_attn_with_kvcache",
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
    learnable_sink (keyword, FlashAttention-CuTe's): float32 or q's dtype ``(h,)``, one logit per query head
        (score units, after the scale) that joins every row's softmax denominator; ``softmax_lse`` includes
        it, a row that sees no key gets out 0 and lse = its sink, and it receives a gradient (gpt-oss).
    attention_chunk (keyword, FlashAttention-3's): > 0 limits each query to the keys of its diagonal's
        chunk of that many tokens, on top of causal / window (Llama 4); 0 = no chunking.

    Returns ``out``, or ``(out, softmax_lse, S_dmask)`` when ``return_attn_probs`` (module docstring).
"""


_FP8_DOC = """
    fp8 (FlashAttention-3 extension, forward only): q, k, v all ``torch.float8_e4m3fn`` with the
    keyword-only fp32 ``q_descale, k_descale, v_descale`` of shape ``(b, h_k)`` (None = 1.0); attention
    runs on ``x.float() * x_descale[batch, kv_head]`` (query head h uses its kv head's q_descale) and
    ``out`` is bf16. No dropout, no gradients. ``flashtile.fp8.quantize_qkv`` makes all six tensors."""


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    q_descale=None, k_descale=None, v_descale=None, learnable_sink=None, attention_chunk=0):
    """Attention over padded batches.

    q: (b, sq, h, d); k: (b, sk, h_k, d); v: (b, sk, h_k, dv). Returns out (b, sq, h, dv).
    """
    return _ag.flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, return_attn_probs, q_descale, k_descale, v_descale,
                          learnable_sink, attention_chunk)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, q_descale=None, k_descale=None,
                              v_descale=None, learnable_sink=None, attention_chunk=0):
    """Self-attention with q, k, v packed: qkv (b, s, 3, h, d). Returns out (b, s, h, d).

    The gradient is written straight into a (b, s, 3, h, d) buffer (no concatenation).
    """
    return _ag.flash_attn_qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, q_descale, k_descale, v_descale,
                          learnable_sink, attention_chunk)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                             return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None,
                             learnable_sink=None, attention_chunk=0):
    """Attention with k, v packed: q (b, sq, h, d), kv (b, sk, 2, h_k, d). Returns out (b, sq, h, d)."""
    return _ag.flash_attn_kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   deterministic, return_attn_probs, q_descale, k_descale, v_descale,
                          learnable_sink, attention_chunk)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None, q_descale=None, k_descale=None, v_descale=None,
                           learnable_sink=None, attention_chunk=0):
    """Attention over variable-length sequences packed along the first dim.

    q: (total_q, h, d); k: (total_k, h_k, d); v: (total_k, h_k, dv); cu_seqlens_q/k: int32 (b+1,)
    starting at 0; max_seqlen_q/k: Python ints. Returns out (total_q, h, dv); lse (h, total_q).
    block_table: int32 (b, max_blocks) for paged KV: k, v are then caches (num_blocks, page_size,
    h_k, d), any page size, and cu_seqlens_k gives the key lengths (forward: flashtile/paged.py).
    seqused_q/seqused_k (FlashAttention-3 extension): int32 (b,), only the first seqused tokens of
    each sequence take part (the rest of its rows get out 0, lse +inf).
    """
    return _ag.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                 return_attn_probs, block_table, seqused_q, seqused_k, q_descale, k_descale,
                                 v_descale, learnable_sink, attention_chunk)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                     q_descale=None, k_descale=None, v_descale=None,
                                     learnable_sink=None, attention_chunk=0):
    """Varlen self-attention, qkv (total, 3, h, d). Returns out (total, h, d)."""
    return _ag.flash_attn_varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                           q_descale, k_descale, v_descale, learnable_sink, attention_chunk)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, q_descale=None,
                                    k_descale=None, v_descale=None, learnable_sink=None, attention_chunk=0):
    """Varlen attention with kv packed: q (total_q, h, d), kv (total_k, 2, h_k, d)."""
    return _ag.flash_attn_varlen_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          deterministic, return_attn_probs, q_descale, k_descale, v_descale,
                                          learnable_sink, attention_chunk)


for _fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
            flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func):
    _fn.__doc__ = (_fn.__doc__ or "") + "\n    Keywords:" + _COMMON_DOC
for _fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
            flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func):
    _fn.__doc__ += _FP8_DOC


# ------------------------------------------------------------------------------------------------------
# FlashAttention 2.8.3's private forward/backward helpers. They are not in its public API, but libraries
# (ring / context-parallel attention, custom autograd Functions) call them, so they keep FA's
# signatures and return values. ``rng_state`` is an int64 (2,) ``[seed, offset]`` tensor (on the CPU
# here; FA keeps it on the GPU): hand it back to the backward and it regenerates the forward's dropout
# mask. Both run through the same custom ops as the public functions, so they also trace under
# torch.compile.


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax):
    """Forward only: q (b, sq, h, d), k/v (b, sk, h_k, d) -> ``(out, softmax_lse, S_dmask, rng_state)``.

    ``S_dmask`` is the probabilities (dropped ones negated) when ``return_softmax`` and
    ``dropout_p > 0``, else empty. No autograd graph is meant to be built through it: call it inside
    your own autograd.Function, and :func:`_flash_attn_backward` in its backward.
    """
    q, k, v, p = _ag.padded_params(q, k, v, dropout_p, softmax_scale, causal,
                                   (window_size_left, window_size_right), softcap, alibi_slopes, False,
                                   return_softmax)
    return _helper_forward(q, k, v, p)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    """Varlen forward only: q (total_q, h, d) -> ``(out, softmax_lse (h, total_q), S_dmask, rng_state)``.

    ``zero_tensors`` is accepted and ignored: every output row is written (rows that see no key get
    out 0 and lse +inf), so there is nothing left uninitialised to zero. ``leftpad_k`` is not
    supported yet.
    """
    if leftpad_k is not None:
        raise NotImplementedError("flashtile: leftpad_k in _flash_attn_varlen_forward is not implemented yet")
    q, k, v, p = _ag.varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, (window_size_left, window_size_right), softcap,
                                   alibi_slopes, False, return_softmax, block_table, None, seqused_k)
    return _helper_forward(q, k, v, p)


def _helper_forward(q, k, v, p):
    rng_state = _ag.rng_state_for(p, q.device)
    out, lse, s_dmask = torch.ops.flashtile.attn_fwd(*_ag.fwd_op_args(q, k, v, p, rng_state, PACK_NONE))
    if rng_state is None:  # FA always returns one; without dropout its value does not matter
        rng_state = torch.zeros(2, dtype=torch.int64)
    return out, lse, s_dmask, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None):
    """Backward only: writes dq, dk, dv (allocated when None) and returns ``softmax_d`` (b, h, sq) fp32.

    Pass the ``rng_state`` the forward returned when ``dropout_p > 0``: it replays the same mask.
    ``softmax_d`` is rowsum(dout * out) (FA pads its last dim to a multiple of 128; flashtile does not).
    """
    q, k, v, p = _ag.padded_params(q, k, v, dropout_p, softmax_scale, causal,
                                   (window_size_left, window_size_right), softcap, alibi_slopes, deterministic,
                                   False)
    return _helper_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p, rng_state)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """Varlen backward only: writes dq, dk, dv (allocated when None); returns ``softmax_d`` (h, total_q)."""
    q, k, v, p = _ag.varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, (window_size_left, window_size_right), softcap,
                                   alibi_slopes, deterministic, False)
    return _helper_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p, rng_state)


def _helper_backward(dout, q, k, v, out, lse, dq, dk, dv, p, rng_state):
    if p.dropout_p > 0 and rng_state is None:
        raise ValueError("flashtile: dropout_p > 0 needs the rng_state returned by the forward, to replay its mask")
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    return torch.ops.flashtile.attn_bwd_into(dout, q, k, v, out, lse, dq, dk, dv, p.cu_seqlens_q, p.cu_seqlens_k,
                                             p.seqused_q, p.seqused_k, p.alibi_slopes, rng_state,
                                             *_ag.bwd_op_scalars(p))


# FA 2.8.3 names its torch.library-wrapped helpers like this; some callers import these names.
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
