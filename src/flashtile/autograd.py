"""The autograd layer: argument checks, the dropout draw, and the call into the custom ops.

The public functions call :func:`attention`, which runs the checks (Python errors, so outside any
op), draws the dropout ``rng_state`` and calls ``torch.ops.flashtile.attn_fwd``. That op carries
its own autograd formula (``torch.library.register_autograd`` in ``ops.py``), so
``torch.compile(fullgraph=True)`` sees one op. Eager calls skip the op's dispatcher, whose host
time short calls feel: inference calls the backend directly, training calls go through
``ops.EagerAttention``, the same formula as a plain autograd.Function.

FlashAttention 2.8.3's autograd Function classes (``FlashAttnFunc`` & friends) stay, with its
``apply`` signatures, because third-party code calls them directly. They are thin wrappers over the
same checks and ops. Packed inputs (``qkv``, ``kv``) go into the ops whole, so the gradient comes
back as one packed tensor the backend wrote into through views: no concatenation copy, as in FA.
"""

from __future__ import annotations

import torch

from flashtile import dispatch
from flashtile.first_order import first_order
from flashtile.ops import (
    PACK_KV,
    PACK_NONE,
    PACK_QKV,
    EagerAttention,  # noqa: F401 - re-exported: tests and docs name it here
    attn_bwd_impl,
    attn_fwd_impl,
    bwd_op_scalars,
    draw_rng_state,
    eager_attention,
    traced,
    unpack,
)
from flashtile.paged import paged_to_varlen
from flashtile.params import AttnParams
from flashtile.rng import next_seed_offset
from flashtile.validation import (
    check_cu_seqlens,
    check_fp8,
    check_max_seqlen,
    check_qkv,
    check_seqused,
    last_dim_contiguous,
    make_params,
)


def padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_softmax, descales=None, learnable_sink=None, attention_chunk=0):
    """Check a padded call; return last-dim-contiguous q, k, v and its params (no rng drawn).

    ``descales`` (fp8 entry points only): ``(q_descale, k_descale, v_descale)``; its presence is
    what lets e4m3 q/k/v through (other functions refuse fp8 with a message saying which take it).
    ``learnable_sink`` / ``attention_chunk``: FlashAttention-3 / CuTe's sink and chunk (params.py).
    """
    q, k, v = check_qkv(q, k, v, varlen=False, allow_fp8=descales is not None)
    fp8 = check_fp8(q, k, v, q.shape[0], dropout_p, *(descales or (None,) * 3), extra=[("alibi_slopes", alibi_slopes)])
    p = make_params(q, batch=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], dropout_p=dropout_p,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                    return_probs=return_softmax, draw_rng=False, learnable_sink=learnable_sink,
                    attention_chunk=attention_chunk, **fp8)
    return q, k, v, p


def varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_softmax, block_table=None, seqused_q=None, seqused_k=None, descales=None,
                  learnable_sink=None, attention_chunk=0):
    """Check a varlen call; return last-dim-contiguous q, k, v and its params (no rng drawn)."""
    if block_table is not None:  # paged KV: gathered into the varlen layout (flashtile/paged.py)
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
        k, v, cu_seqlens_k, seqused_k = paged_to_varlen(k, v, block_table, cu_seqlens_k, max_seqlen_k, seqused_k)
    q, k, v = check_qkv(q, k, v, varlen=True, allow_fp8=descales is not None)
    b = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=b)
    check_seqused("seqused_q", seqused_q, q.device, b)
    check_seqused("seqused_k", seqused_k, q.device, b)
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    fp8 = check_fp8(q, k, v, b, dropout_p, *(descales or (None,) * 3), extra=[("alibi_slopes", alibi_slopes)])
    p = make_params(q, batch=b, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                    return_probs=return_softmax, draw_rng=False, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                    learnable_sink=learnable_sink, attention_chunk=attention_chunk, **fp8)
    return q, k, v, p


def rng_state_for(p: AttnParams, device) -> torch.Tensor | None:
    """The dropout ``[seed, offset]`` of one call, drawn here (outside the ops); None without dropout."""
    return draw_rng_state(device) if p.dropout_p > 0 else None


def fwd_op_args(q, k, v, p: AttnParams, rng_state, packing: int) -> tuple:
    """The argument list of ``flashtile::attn_fwd`` for a checked call."""
    return (q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, p.alibi_slopes, rng_state,
            p.max_seqlen_q, p.max_seqlen_k, p.dropout_p, p.softmax_scale, p.causal, p.window_left,
            p.window_right, p.softcap, p.deterministic, p.return_probs, packing,
            p.q_descale, p.k_descale, p.v_descale, p.learnable_sink, p.attention_chunk)


def _packed_views(q, kv_or_none, qkv_or_none, varlen: bool):
    """Last-dim-contiguous packed tensors and their q, k, v views (pack dim 2, varlen 1)."""
    dim = 1 if varlen else 2
    if qkv_or_none is not None:
        qkv = last_dim_contiguous(qkv_or_none)
        return qkv, None, None, qkv.unbind(dim)
    kv = last_dim_contiguous(kv_or_none)
    return q, kv, None, (q, *kv.unbind(dim))


def _result(out, lse, probs, return_probs: bool):
    return (out, lse, probs) if return_probs else out


def attention(q, k, v, p: AttnParams, packing: int = PACK_NONE):
    """Run a checked call through ``flashtile::attn_fwd`` (autograd via the op's registered formula).

    For ``PACK_QKV`` ``q`` is the packed qkv and k, v are None; for ``PACK_KV`` ``k`` is the packed kv.
    """
    if _eager_inference(q, k, v, p.learnable_sink):
        return _direct_forward(q, k, v, p, packing)
    rng_state = rng_state_for(p, q.device)
    if traced(q):
        out, lse, probs = torch.ops.flashtile.attn_fwd(*fwd_op_args(q, k, v, p, rng_state, packing))
    else:  # eager training: the op's autograd formula without its dispatcher (host time)
        out, lse, probs = eager_attention(q, k, v, p, packing, rng_state)
    return _result(out, lse, probs, p.return_probs)


def _eager_inference(*tensors) -> bool:
    """An eager call that needs no gradient: the custom-op dispatcher (tens of microseconds of host
    time, which short sequences feel) buys nothing there, so the backend is called directly."""
    if traced(tensors[0]):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _direct_forward(q, k, v, p: AttnParams, packing: int):
    """What ``flashtile::attn_fwd`` computes, without the dispatcher (same backends, same results)."""
    q, k, v = unpack(q, k, v, packing)
    if p.dropout_p > 0:
        p.seed, p.offset = next_seed_offset(q.device)
    out, lse, probs = dispatch.forward(q, k, v, p)
    if probs is None:
        probs = q.new_empty(0)
    return _result(out, lse, probs, p.return_probs)


# The public functions' bodies: check, then one op call. ``learnable_sink`` / ``attention_chunk`` are
# FlashAttention-3 / CuTe's (params.py); FlashAttention 2.8.3's callers never pass them.

def flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_probs, q_descale=None, k_descale=None, v_descale=None, learnable_sink=None,
               attention_chunk=0):
    q, k, v, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_probs, (q_descale, k_descale, v_descale), learnable_sink,
                               attention_chunk)
    return attention(q, k, v, p)


def flash_attn_qkvpacked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_probs, q_descale=None, k_descale=None, v_descale=None,
                         learnable_sink=None, attention_chunk=0):
    qkv, _, _, (q, k, v) = _packed_views(None, None, qkv, varlen=False)
    _, _, _, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_probs, (q_descale, k_descale, v_descale), learnable_sink,
                               attention_chunk)
    return attention(qkv, None, None, p, PACK_QKV)


def flash_attn_kvpacked(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_probs, q_descale=None, k_descale=None, v_descale=None,
                        learnable_sink=None, attention_chunk=0):
    _, kv, _, (_, k, v) = _packed_views(q, kv, None, varlen=False)
    q, _, _, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_probs, (q_descale, k_descale, v_descale), learnable_sink,
                               attention_chunk)
    return attention(q, kv, None, p, PACK_KV)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_probs, block_table=None,
                      seqused_q=None, seqused_k=None, q_descale=None, k_descale=None, v_descale=None,
                      learnable_sink=None, attention_chunk=0):
    q, k, v, p = varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_probs, block_table, seqused_q, seqused_k,
                               (q_descale, k_descale, v_descale), learnable_sink, attention_chunk)
    return attention(q, k, v, p)


def flash_attn_varlen_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                                softcap, alibi_slopes, deterministic, return_probs, q_descale=None, k_descale=None,
                                v_descale=None, learnable_sink=None, attention_chunk=0):
    qkv, _, _, (q, k, v) = _packed_views(None, None, qkv, varlen=True)
    _, _, _, p = varlen_params(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                               causal, window_size, softcap, alibi_slopes, deterministic, return_probs,
                               descales=(q_descale, k_descale, v_descale), learnable_sink=learnable_sink,
                               attention_chunk=attention_chunk)
    return attention(qkv, None, None, p, PACK_QKV)


def flash_attn_varlen_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_probs, q_descale=None, k_descale=None, v_descale=None, learnable_sink=None,
                               attention_chunk=0):
    _, kv, _, (_, k, v) = _packed_views(q, kv, None, varlen=True)
    q, _, _, p = varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_probs, descales=(q_descale, k_descale, v_descale),
                               learnable_sink=learnable_sink, attention_chunk=attention_chunk)
    return attention(q, kv, None, p, PACK_KV)


# ------------------------------------------------------------------------------------------------------
# FlashAttention 2.8.3's autograd Functions, kept for code that calls ``FlashAttnFunc.apply(...)``.
# forward runs the op with autograd off (we are inside a Function) and saves what the backward op needs.

def _fn_forward(ctx, q, k, v, p: AttnParams, packing: int, is_grad_enabled: bool):
    rng_state = rng_state_for(p, q.device)
    args = fwd_op_args(q, k, v, p, rng_state, packing)
    out, lse, probs = (torch.ops.flashtile.attn_fwd if traced(q) else attn_fwd_impl)(*args)
    if is_grad_enabled:
        ctx.save_for_backward(q, k, v, out, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k,
                              p.alibi_slopes, rng_state)
        ctx.scalars = bwd_op_scalars(p)
        ctx.packing = packing
    if not p.return_probs:
        return out
    ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


def _fn_backward(ctx, dout):
    q, k, v, out, lse, cu_q, cu_k, su_q, su_k, alibi, rng = ctx.saved_tensors
    args = (dout, q, k, v, out, lse, cu_q, cu_k, su_q, su_k, alibi, rng, *ctx.scalars, ctx.packing)
    if traced(dout):  # tracers need the op's fake implementation (its backward op has no derivative: it raises)
        return torch.ops.flashtile.attn_bwd(*args)
    # eager calls skip the op's dispatcher (host time); no second derivative: it raises, never a silent zero
    return first_order(lambda: attn_bwd_impl(*args), dout, q, k, v, out, lse)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        q, k, v, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_softmax)
        return _fn_forward(ctx, q, k, v, p, PACK_NONE, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dq, dk, dv = _fn_backward(ctx, dout)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        qkv, _, _, (q, k, v) = _packed_views(None, None, qkv, varlen=False)
        _, _, _, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_softmax)
        return _fn_forward(ctx, qkv, None, None, p, PACK_QKV, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dqkv = _fn_backward(ctx, dout)[0]
        return (dqkv,) + (None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        _, kv, _, (_, k, v) = _packed_views(q, kv, None, varlen=False)
        q, _, _, p = padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_softmax)
        return _fn_forward(ctx, q, kv, None, p, PACK_KV, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dq, dkv, _ = _fn_backward(ctx, dout)
        return (dq, dkv) + (None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, block_table=None, is_grad_enabled=True, seqused_q=None, seqused_k=None):
        q, k, v, p = varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_softmax, block_table,
                                   seqused_q, seqused_k)
        return _fn_forward(ctx, q, k, v, p, PACK_NONE, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dq, dk, dv = _fn_backward(ctx, dout)
        return (dq, dk, dv) + (None,) * 16


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        qkv, _, _, (q, k, v) = _packed_views(None, None, qkv, varlen=True)
        _, _, _, p = varlen_params(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                   softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   deterministic, return_softmax)
        return _fn_forward(ctx, qkv, None, None, p, PACK_QKV, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dqkv = _fn_backward(ctx, dout)[0]
        return (dqkv,) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        _, kv, _, (_, k, v) = _packed_views(q, kv, None, varlen=True)
        q, _, _, p = varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes, deterministic, return_softmax)
        return _fn_forward(ctx, q, kv, None, p, PACK_KV, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        dq, dkv, _ = _fn_backward(ctx, dout)
        return (dq, dkv) + (None,) * 13
