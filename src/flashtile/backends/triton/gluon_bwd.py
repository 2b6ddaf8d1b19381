"""The Gluon dK/dV kernel (kernels/gluon_bwd.py) in the backward: which calls take it, and its launch.

On the H200 the backward with this kernel for dK/dV (dQ stays the Triton kernel), against the
all-Triton backward in one process:
- d = 128, session 7 (plain-order config): 1.08x-1.17x from s = 1024 plain and s = 4096 causal, but
  0.78x causal at s = 1024 (benchmarks/results/gluon_bwd_h200_2026-11-30_session7.json); session 6's
  rotated schedule had measured 1.00x-1.11x bf16 and 1.02x-1.12x fp16;
- d = 256, session 7: 1.43x-1.64x at s = 1024 to 16384, plain and causal, bf16 (the same file);
  fp16 1.43x-1.59x in session 8 (gluon_bwd_fp16_d256_h200_2026-11-30.json);
- causal d = 128 at s = 1024, session 8: 1.16x timed directly
  (tune_gluon_bwd_h200_2026-11-30_session8.json; session 7's 0.78x was that process's noise).
So bf16 / fp16 calls at d = 128 / 256 take it by default from s = 1024 (MIN_SEQLEN). s = 512 keeps
the Triton kernel's short-sequence tiles: faster as CUDA graphs, slower eager when last measured.
At d = 64 it was 0.95x-1.05x (slower from s = 4096), so d = 64 stays on Triton unless forced.
tests/test_gpu_gluon_bwd.py passed on the H200 for d = 64, 128, 256
(gpu_tests_gluon_bwd_h200_2026-11-30_session7.log).

``FLASHTILE_GLUON_BWD=0`` turns the route off, ``=1`` forces it on wherever the kernel can run
(d = 64 too); tests pin ``OVERRIDE``. The Gluon dQ kernel (kernels/gluon_bwd_dq.py) is launched from
here too, only when forced (``FLASHTILE_GLUON_BWD_DQ=1``): it measured slower than the Triton one.
"""

from __future__ import annotations

import torch

from flashtile import env
from flashtile.backends.triton import gluon_route
from flashtile.backends.triton.gluon_fwd import LOG2E, _descriptor
from flashtile.backends.triton.host import capability, cdiv, run_kernel
from flashtile.params import AttnParams

# None: FLASHTILE_GLUON_BWD decides; True / False: always / never where the kernel can run (tests).
OVERRIDE: bool | None = None
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
# where the H200 measured the win (module docstring): the default route takes only these, from the
# sequence length given per (head_dim, causal). Causal d = 128 at s = 1024 measured 0.78x in session
# 7, but session 8 timed that backward directly at 1.16x (tune_gluon_bwd_h200_2026-11-30_session8.json)
# and as CUDA graphs at 1.14x (bwd_s1024_route_h200_2026-11-30_session8.json): the 0.78x was the
# eager timing's host noise, so it starts at s = 1024 like the others
MIN_SEQLEN = {(128, False): 1024, (128, True): 1024, (256, False): 1024, (256, True): 1024}
# fp16 d = 256: 1.43x-1.59x of the Triton dK/dV at s = 1024-16384 (gluon_bwd_fp16_d256_h200_2026-11-30.json)
PREFERRED_DTYPES = {128: (torch.bfloat16, torch.float16), 256: (torch.bfloat16, torch.float16)}
# CUDA caps a grid's second axis at 65535: (batch x heads) beyond it stays on the Triton kernels
MAX_GRID_Y = 65535
# The kernel version in this file passed tests/test_gpu_gluon_bwd.py on the H200. A change to the
# kernel that has not run there sets this to False (the route then refuses every call).
GPU_VERIFIED = True
# head dims whose kernel build passed tests/test_gpu_gluon_bwd.py on the H200 (all three: session 7)
GPU_VERIFIED_HEAD_DIMS = (64, 128, 256)


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
    if q.shape[-1] not in GPU_VERIFIED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} not yet verified on a GPU"
    if not all(gluon_route._aligned(x) for x in (dout, dk, dv)):
        return "dout, dk or dv with strides that TMA cannot read or write"
    if q.shape[0] * k.shape[2] > MAX_GRID_Y:
        return f"batch x kv heads = {q.shape[0] * k.shape[2]} > {MAX_GRID_Y} (the grid's second axis)"
    return None


def preferred(q, causal: bool) -> bool:
    """Where the H200 measured the backward faster with this kernel than with the Triton dK/dV."""
    start = MIN_SEQLEN.get((q.shape[-1], causal))
    return start is not None and q.dtype in PREFERRED_DTYPES[q.shape[-1]] and q.shape[1] >= start


def use_gluon_bwd(q, k, v, dout, dk, dv, p: AttnParams) -> bool:
    """Compute dK, dV of this backward with the Gluon kernel? (an sm_90 GPU, a call it covers, and
    measured faster, or forced by FLASHTILE_GLUON_BWD=1 / OVERRIDE)."""
    setting = env.get("FLASHTILE_GLUON_BWD", "")
    forced = OVERRIDE if OVERRIDE is not None else (None if setting == "" else setting != "0")
    if forced is False or q.device.type != "cuda" or capability(q.device) != (9, 0):
        return False
    # the cheap test first: refusal() reads strides and pointers
    if not forced and not preferred(q, p.window_right == 0):
        return False
    return refusal(q, k, v, dout, dk, dv, p) is None


# The Gluon dQ kernel (kernels/gluon_bwd_dq.py): its own switch (FLASHTILE_GLUON_BWD_DQ=1, off by
# default: measured slower than the Triton dQ kernel) and its own verified flag, so the dK/dV route
# stands on its own.
DQ_OVERRIDE: bool | None = None
DQ_HEAD_DIMS = (64, 128)
# The kernel version in kernels/gluon_bwd_dq.py passed tests/test_gpu_gluon_bwd_dq.py on the H200
# (gpu_tests_gluon_bwd_dq_h200_2026-11-30_session6.log); a change not yet run there sets this False.
DQ_GPU_VERIFIED = True


def use_gluon_bwd_dq(q, k, v, dout, dq, p: AttnParams) -> bool:
    """Compute dQ of this backward with the Gluon dQ kernel? (forced on only, for now)."""
    setting = env.get("FLASHTILE_GLUON_BWD_DQ", "")
    forced = DQ_OVERRIDE if DQ_OVERRIDE is not None else setting not in ("", "0")
    if not forced or q.device.type != "cuda" or capability(q.device) != (9, 0) or not DQ_GPU_VERIFIED:
        return False
    return dq_refusal(q, k, v, dout, dq, p) is None


def dq_refusal(q, k, v, dout, dq, p: AttnParams) -> str | None:
    """Why the Gluon dQ kernel cannot compute this backward's dQ exactly (None: it can)."""
    if q.dtype not in DTYPES or any(x.dtype != q.dtype for x in (k, v, dout, dq)):
        return f"dtype {q.dtype} (takes {DTYPES})"
    why = gluon_route.coverage_refusal(q, k, v, p, DQ_HEAD_DIMS)
    if why:
        return why
    if not all(gluon_route._aligned(x) for x in (dout, dq)):
        return "dout or dq with strides that TMA cannot read or write"
    if q.shape[0] * q.shape[2] > MAX_GRID_Y:
        return f"batch x heads = {q.shape[0] * q.shape[2]} > {MAX_GRID_Y} (the grid's second axis)"
    return None


DQ_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps", "ROTATED")


def _config(table: dict, d: int, config: dict | None, keys: tuple | None = None) -> dict:
    from flashtile.kernels.gluon_bwd import CONFIG_KEYS

    keys = keys or CONFIG_KEYS
    cfg = dict(table[d])
    if config:
        unknown = set(config) - set(keys)
        if unknown:
            raise ValueError(f"gluon bwd: unknown config keys {sorted(unknown)} (known: {keys})")
        cfg.update({key: int(val) for key, val in config.items()})
    return cfg


def _check_stats(lse, delta) -> None:
    if lse.stride(-1) != 1 or delta.stride() != lse.stride():
        raise ValueError("gluon bwd: lse and delta must share (b, h, s) strides with a unit last stride")


def gluon_attn_bwd_dq(q, k, v, dout, lse, delta, dq, softmax_scale: float, causal: bool,
                      config: dict | None = None) -> None:
    """Write dq (b, s, h, d) for q, dout (b, s, h, d), k, v (b, s, h_k, d), lse and delta (b, h, s)
    fp32 (lse natural log, delta = rowsum(dO * O)). The caller checked ``dq_refusal``."""
    from flashtile.kernels.gluon_bwd_dq import BWD_DQ_CONFIGS, _gluon_attn_bwd_dq_kernel

    b, s, h, d = q.shape
    h_k = k.shape[2]
    cfg = _config(BWD_DQ_CONFIGS, d, config, keys=DQ_CONFIG_KEYS)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _check_stats(lse, delta)
    # ROTATED (0: the plain order, a tuning candidate) only when given: absent, the kernel's default
    order = {"ROTATED": cfg["ROTATED"]} if "ROTATED" in cfg else {}
    run_kernel(_gluon_attn_bwd_dq_kernel, (cdiv(s, bm), b * h),
        _descriptor(q, [1, bm, 1, d]), _descriptor(k, [1, bn, 1, d]), _descriptor(v, [1, bn, 1, d]),
        _descriptor(dout, [1, bm, 1, d]), _descriptor(dq, [1, bm, 1, d]),
        lse, delta, lse.stride(0), lse.stride(1), s, h, h // h_k, softmax_scale * LOG2E, softmax_scale,
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
        num_warps=cfg["num_warps"], **order)


def gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, softmax_scale: float, causal: bool,
                        config: dict | None = None, launch_dependents: bool = False) -> None:
    """Write dk, dv (b, s, h_k, d) for q, dout (b, s, h, d), k, v (b, s, h_k, d), lse and delta
    (b, h, s) fp32 (lse natural log, delta = rowsum(dO * O)). The caller checked ``refusal``;
    ``config`` overrides the table's (tuning); ``launch_dependents``: the next kernel (the dQ kernel)
    is launched with programmatic dependent launch (attn_bwd.use_bwd_pdl)."""
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, _gluon_attn_bwd_dkdv_kernel

    b, s, h, d = q.shape
    h_k = k.shape[2]
    cfg = _config(BWD_DKDV_CONFIGS, d, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _check_stats(lse, delta)
    meta = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
                num_warps=cfg["num_warps"])
    # WARPS_N (d = 256: two warpgroups side by side) and ROTATED (0: the plain order, the d = 128 / 256
    # table's choice) only when given: absent, the kernel's defaults (1, rotated) apply
    meta.update({key: cfg[key] for key in ("WARPS_N", "ROTATED") if key in cfg})
    if launch_dependents:
        meta["LAUNCH_DEPENDENTS"] = True
    run_kernel(_gluon_attn_bwd_dkdv_kernel, (cdiv(s, bn), b * h_k),
        _descriptor(q, [1, bm, 1, d]), _descriptor(k, [1, bn, 1, d]), _descriptor(v, [1, bn, 1, d]),
        _descriptor(dout, [1, bm, 1, d]), _descriptor(dk, [1, bn, 1, d]), _descriptor(dv, [1, bn, 1, d]),
        lse, delta, lse.stride(0), lse.stride(1), s, h_k, h // h_k, softmax_scale * LOG2E, softmax_scale, **meta)
