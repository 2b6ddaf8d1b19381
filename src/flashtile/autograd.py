"""Autograd Functions with FlashAttention 2.8.3's ``apply`` signatures.

Each Function checks its arguments, runs the chosen backend's forward, saves q/k/v/out/lse (and the
dropout seed inside the params) and, in backward, lets the backend write gradients straight into
the gradient buffer: for packed inputs that buffer is the packed gradient, so no concatenation copy
is made.
"""

from __future__ import annotations

import torch

from flashtile import dispatch
from flashtile.params import AttnParams
from flashtile.validation import (
    check_cu_seqlens,
    check_max_seqlen,
    check_qkv,
    check_seqused,
    make_params,
)


def _padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_softmax):
    q, k, v = check_qkv(q, k, v, varlen=False)
    p = make_params(q, batch=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], dropout_p=dropout_p,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                    return_probs=return_softmax)
    return q, k, v, p


def _varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_softmax, block_table=None, seqused_q=None, seqused_k=None):
    q, k, v = check_qkv(q, k, v, varlen=True)
    if block_table is not None:
        raise NotImplementedError("flashtile: block_table (paged KV) in flash_attn_varlen_func is not "
                                  "implemented yet")
    b = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch=b)
    check_seqused("seqused_q", seqused_q, q.device, b)
    check_seqused("seqused_k", seqused_k, q.device, b)
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    p = make_params(q, batch=b, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                    return_probs=return_softmax, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    seqused_q=seqused_q,
                    seqused_k=seqused_k)
    return q, k, v, p


def _forward(ctx, q, k, v, p: AttnParams, is_grad_enabled: bool):
    """Run the forward, save what backward needs, return the FA-shaped result."""
    out, lse, probs = dispatch.choose("fwd", q, p).fwd(q, k, v, p)
    if is_grad_enabled and any(x.requires_grad for x in (q, k, v)):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = p
    if not p.return_probs:
        return out
    if probs is None:
        probs = torch.empty(0, device=q.device, dtype=q.dtype)
    ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


def _backward(ctx, dout, dq, dk, dv):
    q, k, v, out, lse = ctx.saved_tensors
    p = ctx.params
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dispatch.choose("bwd", q, p).bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        q, k, v, p = _padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_softmax)
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _backward(ctx, dout, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        q, k, v = qkv.unbind(dim=2)  # views: (b, s, h, d) each
        q, k, v, p = _padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_softmax)
        ctx.packed_shape = qkv.shape
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q = ctx.saved_tensors[0]
        dqkv = torch.empty(ctx.packed_shape, dtype=q.dtype, device=q.device)
        _backward(ctx, dout, *dqkv.unbind(dim=2))
        return (dqkv,) + (None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled=True):
        k, v = kv.unbind(dim=2)
        q, k, v, p = _padded_params(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_softmax)
        ctx.packed_shape = kv.shape
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q = ctx.saved_tensors[0]
        dq = torch.empty_like(q)
        dkv = torch.empty(ctx.packed_shape, dtype=q.dtype, device=q.device)
        _backward(ctx, dout, dq, *dkv.unbind(dim=2))
        return (dq, dkv) + (None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, block_table=None, is_grad_enabled=True, seqused_q=None, seqused_k=None):
        q, k, v, p = _varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_softmax, block_table,
                                    seqused_q, seqused_k)
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _backward(ctx, dout, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 16


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        q, k, v = qkv.unbind(dim=1)  # views: (total, h, d) each
        q, k, v, p = _varlen_params(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                    softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_softmax)
        ctx.packed_shape = qkv.shape
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q = ctx.saved_tensors[0]
        dqkv = torch.empty(ctx.packed_shape, dtype=q.dtype, device=q.device)
        _backward(ctx, dout, *dqkv.unbind(dim=1))
        return (dqkv,) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        k, v = kv.unbind(dim=1)
        q, k, v, p = _varlen_params(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_softmax)
        ctx.packed_shape = kv.shape
        return _forward(ctx, q, k, v, p, is_grad_enabled)

    @staticmethod
    def backward(ctx, dout, *_):
        q = ctx.saved_tensors[0]
        dq = torch.empty_like(q)
        dkv = torch.empty(ctx.packed_shape, dtype=q.dtype, device=q.device)
        _backward(ctx, dout, dq, *dkv.unbind(dim=1))
        return (dq, dkv) + (None,) * 13
