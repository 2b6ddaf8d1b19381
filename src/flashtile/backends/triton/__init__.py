"""Launchers of flashtile's Triton kernels (grid, strides, allocation, config choice)."""

from __future__ import annotations

import torch

from flashtile.dispatch import interpret_requested
from flashtile.params import AttnParams

NAME = "triton"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refusal(op: str, q: torch.Tensor, p: AttnParams) -> str | None:
    """Why the Triton kernels cannot run this call, or None."""
    if q.device.type == "cpu" and not interpret_requested():
        return "CPU tensors need FLASHTILE_INTERPRET=1 (and TRITON_INTERPRET=1) to run the kernels"
    if q.device.type not in ("cpu", "cuda"):
        return f"runs CUDA tensors only (got {q.device.type})"
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernels take fp16, bf16 and fp32, not {q.dtype}"
    return None


def fwd(q, k, v, p: AttnParams):
    from flashtile.backends.triton.attn_fwd import attn_fwd

    return attn_fwd(q, k, v, p)


def bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    from flashtile.backends.triton.attn_bwd import attn_bwd

    attn_bwd(dout, q, k, v, out, lse, p, dq, dk, dv)
