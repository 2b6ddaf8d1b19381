"""Launcher of the sink-gradient kernel (kernels/sink_grad.py)."""

from __future__ import annotations

import torch
import triton

from flashtile.backends.triton.host import run_kernel
from flashtile.kernels.sink_grad import _sink_grad_kernel

BLOCK_S = 64


def sink_grad_triton(learnable_sink: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                     varlen: bool) -> torch.Tensor:
    """The sink's gradient ``(h,)`` in its dtype. ``out`` / ``dout``: (b, s, h, dv) or varlen (total, h, dv);
    ``lse``: (b, h, s) or (h, total)."""
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if varlen:  # one sequence of all the tokens: the sum runs over every row of a head
        out, dout, lse = out[None], dout[None], lse[None]
    b, s, h, dv = out.shape
    block_d = triton.next_power_of_2(dv)
    n_blocks = triton.cdiv(s, BLOCK_S)
    partial = torch.empty(n_blocks, b, h, dtype=torch.float32, device=out.device)
    if partial.numel():
        run_kernel(_sink_grad_kernel, (n_blocks, h, b), out, dout, lse, learnable_sink, partial, s, h,
                   out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                   lse.stride(0), lse.stride(1), lse.stride(2),
                   HEAD_DIM=dv, BLOCK_D=block_d, BLOCK_S=BLOCK_S, num_warps=4)
    return partial.sum((0, 1)).to(learnable_sink.dtype)
