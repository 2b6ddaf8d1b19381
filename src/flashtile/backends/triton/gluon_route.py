"""Which forward calls take the Gluon Hopper kernel instead of the Triton one.

The Gluon kernel (kernels/gluon_fwd.py, docs/gluon.md) overlaps the softmax with the tensor cores,
which Triton 3.6 cannot express. It covers a narrow slice of the API, and within that slice it is
used only where the H200 measured it faster than the Triton kernel
(benchmarks/results/gluon_h200_2026-11-30.json: d = 128, 1.06x-1.12x except causal s = 1024 at
0.98x; d = 64 0.87x-0.92x, so d = 64 stays on Triton). Everything else, and any GPU but sm_90,
goes to Triton.

``FLASHTILE_GLUON=0`` turns the route off; tests pin it with ``OVERRIDE``.
"""

from __future__ import annotations

import os

import torch

from flashtile.backends.triton.host import capability
from flashtile.params import AttnParams

# None: the rule below; True / False: always / never where the kernel can run at all (tests).
OVERRIDE: bool | None = None

# where the measured win is (see the module docstring); the kernel itself also runs d = 64
HEAD_DIMS = (128,)
DTYPES = (torch.bfloat16,)
# the shortest sequences measured faster (s = 1024 non-causal 1.08x; causal 0.98x there, 1.08x at
# 4096): below them the Triton kernel's short-sequence tiles keep the call
MIN_SEQLEN = {False: 1024, True: 2048}


def _aligned(x: torch.Tensor) -> bool:
    es = x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all((s * es) % 16 == 0 for s in x.stride()[:-1]))


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> str | None:
    """Why the Gluon kernel cannot compute this call exactly (None: it can), device aside."""
    if q.dim() != 4 or p.varlen:
        return "varlen (packed) calls"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (takes {DTYPES})"
    if k.shape != v.shape or q.shape[-1] not in (64, 128):
        return "head_dim other than 64 / 128, or k and v of different shapes"
    if q.shape[1] != k.shape[1]:
        return "seqlen_q != seqlen_k"
    # plain or causal attention: causal arrives as the window (-1, 0), and with seqlen_q ==
    # seqlen_k top-left and bottom-right causal are the same mask
    if p.window_left >= 0 or p.window_right > 0:
        return "sliding windows"
    # return_probs without dropout returns no probabilities (as FlashAttention): nothing to refuse
    if p.softcap > 0 or p.alibi_slopes is not None or p.dropout_p > 0:
        return "softcap, ALiBi or dropout"
    if p.seqused_q is not None or p.seqused_k is not None:
        return "seqused_q / seqused_k"
    if q.numel() == 0 or k.numel() == 0:
        return "empty tensors"
    if not all(_aligned(x) for x in (q, k, v)):
        return "strides that TMA cannot read (16-byte aligned base and strides, unit last stride)"
    return None


def preferred(q: torch.Tensor, p: AttnParams) -> bool:
    """Where the H200 measured the Gluon kernel faster than the Triton one."""
    return q.shape[-1] in HEAD_DIMS and q.shape[1] >= MIN_SEQLEN[p.window_right == 0]


def use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> bool:
    """Route this forward call to the Gluon kernel? (an sm_90 GPU, supported, and measured faster
    or forced by OVERRIDE)."""
    if OVERRIDE is False or os.environ.get("FLASHTILE_GLUON", "1") == "0":
        return False
    if q.device.type != "cuda" or capability(q.device) != (9, 0) or refusal(q, k, v, p) is not None:
        return False
    return bool(OVERRIDE) or preferred(q, p)


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams):
    """(out, lse, None) from the Gluon kernel, in the Triton launcher's return convention."""
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    # causal is the window (-1, 0): p.causal may be False for an explicit window of that shape
    out, lse = gluon_attn_fwd(q, k, v, softmax_scale=p.softmax_scale, causal=p.window_right == 0)
    return out, lse, None
