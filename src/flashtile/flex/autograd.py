"""Autograd of ``flashtile::flex_fwd``: its backward is ``flashtile::flex_bwd``, registered on the op so
eager calls and compiled graphs differentiate alike. Gradients reach q, k, v and the captured tensors
that require grad (``Entry.grad_buffers``), from a loss on ``out``, on the returned lse, or on both:
d lse_i / d s_ij = P_ij (the natural-log logsumexp of the modded scores), which the backward folds into
its delta term."""

from __future__ import annotations

import torch

from flashtile.flex import ops, registry
from flashtile.flex.eager import buffer_grads


def _setup_context(ctx, inputs, output):
    q, k, v, *block8 = inputs[:11]
    bufs, scale, key, block_q, block_kv, tiles = inputs[11:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *block8, *bufs)
    ctx.args = (scale, key, block_q, block_kv, list(tiles))
    # an output the loss does not use gets None, not zeros: no lse term then, and no dO kernel work wasted
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    block8, bufs = rest[:8], rest[8:]
    scale, key, block_q, block_kv, tiles = ctx.args
    entry = registry.get(key)
    want = bool(entry.grad_buffers)
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dq, dk, dv, dbufs = ops.flex_bwd(dout, dlse, q, k, v, out, lse, *block8, list(bufs), scale, key, block_q,
                                     block_kv, want, tiles)
    return dq, dk, dv, *([None] * 8), buffer_grads(entry, bufs, dbufs, want), None, None, None, None, None


torch.library.register_autograd("flashtile::flex_fwd", _backward, setup_context=_setup_context)
