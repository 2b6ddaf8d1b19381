"""Launchers of flashtile's Triton kernels (grid, strides, allocation, config choice)."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.host import capability
from flashtile.params import AttnParams

NAME = "triton"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_FWD = True  # e4m3 inputs go to the fp8 kernel as they are (dispatch.forward dequantises for others)


def refusal(op: str, q: torch.Tensor, p: AttnParams | None) -> str | None:
    """Why the Triton kernels cannot run this call ("fwd", "bwd" or "kvcache"), or None."""
    if q.device.type == "cpu" and not config.get().interpret:
        return "CPU tensors need FLASHTILE_INTERPRET=1 (and TRITON_INTERPRET=1) to run the kernels"
    if q.device.type not in ("cpu", "cuda"):
        return f"runs CUDA tensors only (got {q.device.type})"
    if q.dtype == torch.float8_e4m3fn:
        if op == "bwd":
            return "fp8 has forward and KV-cache kernels only"
        if q.device.type == "cuda" and capability(q.device) < (8, 9):
            return "the fp8 kernel needs compute capability >= 8.9 (Ada / Hopper) for e4m3 tensor-core dots"
        return None
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernels take fp16, bf16 and fp32 (and e4m3 forward and KV-cache), not {q.dtype}"
    return None


def fwd(q, k, v, p: AttnParams):
    from flashtile.backends.triton import gluon_route

    if gluon_route.use_gluon(q, k, v, p):
        return gluon_route.gluon_fwd(q, k, v, p)
    if q.dtype == torch.float8_e4m3fn:
        from flashtile.backends.triton.attn_fwd_fp8 import attn_fwd_fp8

        return attn_fwd_fp8(q, k, v, p)
    from flashtile.backends.triton.attn_fwd import attn_fwd

    return attn_fwd(q, k, v, p)


def bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    from flashtile.backends.triton.attn_bwd import attn_bwd

    attn_bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


def kvcache(*args, **kwargs):
    """``flash_attn_with_kvcache`` on the decode kernels (backends/triton/decode: the append, then the route's
    kernel)."""
    from flashtile.backends.triton.decode import kvcache_fwd

    return kvcache_fwd(*args, **kwargs)
