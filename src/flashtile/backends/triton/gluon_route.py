"""Which forward calls take the Gluon Hopper kernel instead of the Triton one.

The Gluon kernel (kernels/gluon_fwd.py, docs/gluon.md) overlaps the softmax with the tensor cores,
which Triton 3.6 cannot express. It covers a narrow slice of the API, and within that slice it is
used only where the H200 measured it faster than the Triton kernel
(benchmarks/results/gluon_h200_2026-11-30.json: bf16 d = 128, 1.06x-1.12x except causal s = 1024
at 0.98x; d = 64 0.87x-0.92x, so d = 64 stays on Triton; e4m3: see FP8_HEAD_DIMS). Everything
else, and any GPU but sm_90, goes to Triton.

``FLASHTILE_GLUON=0`` turns the route off; tests pin it with ``OVERRIDE``.
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton.attn_fwd import _tma_ok
from flashtile.backends.triton.host import capability
from flashtile.params import AttnParams

# None: the rule below; True / False: always / never where the kernel can run at all (tests).
OVERRIDE: bool | None = None

# where the measured win is (see the module docstring); the kernels also run d = 64 (and 256)
HEAD_DIMS = (128,)
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
# e4m3, d = 128 / 256 from 4096 tokens: with its swept tiles (tune_gluon_fp8_s4096_h200_2026-11-30.json)
# the Gluon fp8 kernel leads the Triton one by 1%-12% causal and is within about 2% non-causal, through
# the public call with no V copy (benchmarks/results/probe_fp8_route_h200_2026-11-30.json)
FP8_HEAD_DIMS = (128, 256)
FP8_MIN_SEQLEN = 4096
# the shortest sequences measured faster (s = 1024 non-causal 1.08x; causal 0.98x there, 1.08x at
# 4096): below them the Triton kernel's short-sequence tiles keep the call
MIN_SEQLEN = {False: 1024, True: 2048}


def _aligned(x: torch.Tensor) -> bool:
    # the Triton forward's TMA test (empty tensors were refused above), plus the unit last stride
    # the Gluon descriptors also need
    return x.stride(-1) == 1 and _tma_ok(x)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> str | None:
    """Why the Gluon kernel cannot compute this call exactly (None: it can), device aside."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (takes {DTYPES})"
    dims = (64, 128, 256) if q.dtype == torch.float8_e4m3fn else (64, 128)
    return coverage_refusal(q, k, v, p, dims)


def coverage_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, dims) -> str | None:
    """The Gluon kernels' shared coverage, dtype aside (the backward's route reuses it)."""
    if q.dim() != 4 or p.varlen:
        return "varlen (packed) calls"
    if k.shape != v.shape or q.shape[-1] not in dims:
        return f"head_dim other than {dims}, or k and v of different shapes"
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
    # e4m3 V is read transposed (fp8.v_keys_major: a view of quantize_qkv's layout, else a copy)
    loaded = (q, k) if q.dtype == torch.float8_e4m3fn else (q, k, v)
    if not all(_aligned(x) for x in loaded):
        return "strides that TMA cannot read (16-byte aligned base and strides, unit last stride)"
    return None


def preferred(q: torch.Tensor, p: AttnParams) -> bool:
    """Where the H200 measured the Gluon kernel faster than the Triton one."""
    if q.dtype == torch.float8_e4m3fn:
        return q.shape[-1] in FP8_HEAD_DIMS and q.shape[1] >= FP8_MIN_SEQLEN
    return q.shape[-1] in HEAD_DIMS and q.shape[1] >= MIN_SEQLEN[p.window_right == 0]


def use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> bool:
    """Route this forward call to the Gluon kernel? (an sm_90 GPU, supported, and measured faster
    or forced by OVERRIDE)."""
    if OVERRIDE is False or env.get("FLASHTILE_GLUON", "1") == "0":
        return False
    # the cheap tests first: refusal() reads strides and pointers, on every forward call
    if not OVERRIDE and not preferred(q, p):
        return False
    return q.device.type == "cuda" and capability(q.device) == (9, 0) and refusal(q, k, v, p) is None


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams):
    """(out, lse, None) from the Gluon kernel, in the Triton launchers' return convention."""
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd, gluon_attn_fwd_fp8

    # causal is the window (-1, 0): p.causal may be False for an explicit window of that shape
    causal = p.window_right == 0
    if q.dtype == torch.float8_e4m3fn:
        from flashtile.fp8 import v_keys_major

        out, lse = gluon_attn_fwd_fp8(q, k, v_keys_major(v, varlen=False), p.q_descale, p.k_descale, p.v_descale,
                                      softmax_scale=p.softmax_scale, causal=causal)
    else:
        out, lse = gluon_attn_fwd(q, k, v, softmax_scale=p.softmax_scale, causal=causal)
    return out, lse, None
