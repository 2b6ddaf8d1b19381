"""The Gluon dK/dV kernel (kernels/gluon_bwd.py) in the backward: which calls take it, and its launch.

Experimental and off by default (``FLASHTILE_GLUON_BWD=1`` turns it on; tests pin ``OVERRIDE``).
The dQ half stays the Triton kernel. On the H200 (session 5) its first version was 1.05x-1.12x of
the Triton backward at d = 128 with plain-attention gradients bitwise equal to Triton's, but causal
gradients were wrong for some shapes: a register hazard, now removed (P^T / dS^T go through shared
memory; tests/test_gluon_bwd_compile.py checks the SASS). That version has not run on a GPU: until
it passes tests/test_gpu_gluon_bwd.py, every call is refused here (``GPU_VERIFIED``), so the switch
changes nothing yet.
"""

from __future__ import annotations

import os

import torch

from flashtile.backends.triton import gluon_route
from flashtile.backends.triton.gluon_fwd import LOG2E, _descriptor
from flashtile.backends.triton.host import capability, cdiv
from flashtile.params import AttnParams

# None: FLASHTILE_GLUON_BWD decides; True / False: always / never where the kernel can run (tests).
OVERRIDE: bool | None = None
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
# True once the current kernel (shared-memory P^T / dS^T) has passed tests/test_gpu_gluon_bwd.py on
# the H200; those tests, the probe and the bench set it to examine the kernel
GPU_VERIFIED = False


def refusal(q, k, v, dout, dk, dv, p: AttnParams) -> str | None:
    """Why the Gluon dK/dV kernel cannot compute this backward exactly (None: it can)."""
    if q.dtype not in DTYPES or any(x.dtype != q.dtype for x in (k, v, dout, dk, dv)):
        return f"dtype {q.dtype} (takes {DTYPES})"
    # the forward's coverage: padded, seqlen_q == seqlen_k, plain or causal, no softcap / ALiBi /
    # dropout / seqused, TMA-readable q, k, v
    why = gluon_route.coverage_refusal(q, k, v, p, HEAD_DIMS)
    if why:
        return why
    if not GPU_VERIFIED:
        return "not yet verified on a GPU (the fixed kernel has not passed tests/test_gpu_gluon_bwd.py)"
    if not all(gluon_route._aligned(x) for x in (dout, dk, dv)):
        return "dout, dk or dv with strides that TMA cannot read or write"
    return None


def use_gluon_bwd(q, k, v, dout, dk, dv, p: AttnParams) -> bool:
    enabled = OVERRIDE if OVERRIDE is not None else os.environ.get("FLASHTILE_GLUON_BWD", "0") not in ("", "0")
    if not enabled or q.device.type != "cuda" or capability(q.device) != (9, 0):
        return False
    return refusal(q, k, v, dout, dk, dv, p) is None


def gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, softmax_scale: float, causal: bool,
                        config: dict | None = None) -> None:
    """Write dk, dv (b, s, h_k, d) for q, dout (b, s, h, d), k, v (b, s, h_k, d), lse and delta
    (b, h, s) fp32 (lse natural log, delta = rowsum(dO * O)). The caller checked ``refusal``."""
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, CONFIG_KEYS, _gluon_attn_bwd_dkdv_kernel

    b, s, h, d = q.shape
    h_k = k.shape[2]
    cfg = dict(BWD_DKDV_CONFIGS[d])
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"gluon bwd: unknown config keys {sorted(unknown)} (known: {CONFIG_KEYS})")
        cfg.update({key: int(val) for key, val in config.items()})
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if lse.stride(-1) != 1 or delta.stride() != lse.stride():
        raise ValueError("gluon bwd: lse and delta must share (b, h, s) strides with a unit last stride")
    _gluon_attn_bwd_dkdv_kernel[(cdiv(s, bn), b * h_k)](
        _descriptor(q, [1, bm, 1, d]), _descriptor(k, [1, bn, 1, d]), _descriptor(v, [1, bn, 1, d]),
        _descriptor(dout, [1, bm, 1, d]), _descriptor(dk, [1, bn, 1, d]), _descriptor(dv, [1, bn, 1, d]),
        lse, delta, lse.stride(0), lse.stride(1), s, h_k, h // h_k, softmax_scale * LOG2E, softmax_scale,
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
        num_warps=cfg["num_warps"])
