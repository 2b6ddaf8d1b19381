"""Backwards whose gradients have no derivative of their own: a second derivative must raise, never be zero.

The kernels write gradients into plain tensors, so under ``create_graph=True`` those gradients would come back
without a graph, and a gradient penalty mixed with other terms would silently lose its second-order part. The
eager autograd Functions (ops.EagerAttention, the FlashAttention-compatible Functions of autograd.py,
flex/eager.py, the rotary Functions of layers/rotary.py) therefore run their backward's work through
``first_order``: while a graph of the gradients is being built, the gradients hang off the backward's inputs
through a node whose own backward raises, as the custom ops' paths do (their backward ops have no autograd
formula). ``torch.autograd.function.once_differentiable`` is not enough here: its error node sits on the
incoming gradients only, so a second derivative taken with respect to the attention inputs alone passes it by.
"""

from __future__ import annotations

import torch


class _GradientsOfKernels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, what, compute, *inputs):
        ctx.what = what
        return tuple(compute())

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"flashtile: {ctx.what} has no second derivative (its backward's gradients come from "
                           "kernels without a derivative of their own)")


def first_order(compute, *inputs, what: str = "attention") -> tuple:
    """``compute()``'s gradients (a tuple of tensors or None). ``inputs``: every tensor they depend on (the
    incoming gradients, the saved inputs and outputs); with grad mode on they become this node's inputs, so
    differentiating any returned gradient through any of them raises, naming ``what``."""
    if not torch.is_grad_enabled():
        return tuple(compute())
    return _GradientsOfKernels.apply(what, compute, *(x for x in inputs if x is not None))
