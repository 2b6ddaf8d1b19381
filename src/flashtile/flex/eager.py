"""Eager kernel calls of ``flex_attention``: the Triton launchers under a plain autograd.Function.

The custom ops (flex/ops.py, their backward in flex/autograd.py) are what torch.compile traces. Called eagerly,
their dispatch (argument defaults, pytree flattening, the aliasing check, autograd's wrapper) cost about 250 us
of host time a call with gradients on an H100 machine, next to forward kernels of 0.4-0.6 ms at the shortest
benchmark rows, so eager calls take this path instead: the same launchers, the same gradients (buffer gradients
included), none of the dispatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile.first_order import first_order
from flashtile.flex import registry


def _launch_fwd(q, k, v, tensors, key, scale, block_size, tiles):
    from flashtile.backends.triton.flex.launch import flex_fwd

    return flex_fwd(q, k, v, tensors[:4], registry.get(key).kernels(), scale, tuple(block_size), tuple(tiles[:4]))


def buffer_grads(entry, bufs, dbufs, want: bool) -> list:
    """The gradients of the captured tensors, in ``bufs``' order and dtypes (None where one does not learn)."""
    grads = [None] * len(bufs)
    for i, g in zip(entry.grad_buffers if want else (), dbufs):
        grads[i] = g.to(bufs[i].dtype)
    return grads


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tensors, key, scale, block_size, tiles, *bufs):
        out, lse = _launch_fwd(q, k, v, tensors, key, scale, block_size, tiles)
        # the block mask's tensors and the captured ones are saved too: changed in place before the backward, they
        # fail the saved-tensor check as on the op path (the kernels would read the new values)
        ctx.save_for_backward(q, k, v, out, lse, *tensors, *bufs)
        ctx.args = (len(tensors), key, scale, block_size, tiles)
        # an output the loss does not use gets None: no lse term then, and no dO kernel work wasted
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flashtile.backends.triton.flex.launch import flex_bwd as launch_bwd

        n_tensors, key, scale, block_size, tiles = ctx.args
        q, k, v, out, lse, *rest = ctx.saved_tensors
        tensors, bufs = rest[:n_tensors], rest[n_tensors:]
        entry = registry.get(key)
        want = bool(entry.grad_buffers)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()

        def compute():
            dq, dk, dv, dbufs = launch_bwd(dout, dlse, q, k, v, out, lse, tensors, entry.kernels(), scale,
                                           block_size, want, tuple(tiles[4:]))
            return dq, dk, dv, *buffer_grads(entry, bufs, dbufs, want)

        # the kernels' gradients have no derivative: a second derivative raises (first_order.py), as on the op path
        dq, dk, dv, *grads = first_order(compute, dout, dlse, q, k, v, out, lse, *bufs)
        return dq, dk, dv, None, None, None, None, None, *grads


def flex_attention_eager(q: Tensor, k: Tensor, v: Tensor, tensors: tuple, bufs: list, scale: float, key: str,
                         block_size: tuple, tiles: list) -> tuple[Tensor, Tensor]:
    """(out, lse) of an eager kernel call: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) with unit last
    strides; ``tensors``: the block mask's eight tensors; ``bufs``: the mods' captured tensors; lse +inf on a
    row that sees no key (the kernels' convention)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v, *bufs)):
        return _launch_fwd(q, k, v, tensors, key, scale, block_size, tiles)
    return _FlexAttention.apply(q, k, v, tuple(tensors), key, scale, tuple(block_size), tuple(tiles), *bufs)
