"""Launcher of the backward kernels: delta preprocess, then the dK/dV and dQ kernels (default), or
one of the measured alternatives behind flags: both in one grid (FLASHTILE_BWD_ONE_LAUNCH), dQ fused
into the dK/dV kernel (FLASHTILE_BWD_FUSED_DQ), or the Gluon dK/dV kernel (the default at d = 128 / 256
from s = 1024, where backends/triton/gluon_bwd.py measured it faster; FLASHTILE_GLUON_BWD). Where
measured faster the dQ kernel starts while the dK/dV kernel drains (use_bwd_pdl, FLASHTILE_BWD_PDL)."""

from __future__ import annotations

import json

import torch

from flashtile import env
from flashtile.backends.triton import gluon_bwd, host
from flashtile.backends.triton.attn_fwd import LOG2E, _descriptor, _tma_ok, arch_of
from flashtile.backends.triton.host import capability, cdiv, device_guard, launch, next_pow2, run_kernel
from flashtile.kernels.attn_bwd import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_one_launch_kernel,
    _attn_bwd_preprocess_kernel,
    bwd_configs,
)
from flashtile.params import AttnParams

# Tests pin a config pair here: ((dkdv BM, BN, warps, stages), (dq BM, BN, warps, stages)).
CONFIG_OVERRIDE = None
# Tensor-descriptor (TMA) loads of the streamed tiles: off by default until measured on the H200
# (FLASHTILE_BWD_TMA=1 turns them on where the strides allow); tests force either path.
TMA_OVERRIDE: bool | None = None


# dQ fused into the dK/dV kernel (fp32 TMA reduce-adds on sm_90, atomics elsewhere), instead of its own
# kernel: saves recomputing QK^T and dO V^T, costs the adds and run-to-run bit differences (never used
# with deterministic=True). Off: measured 8%-10% slower than the split on the H200 (docs/backward.md;
# FLASHTILE_BWD_FUSED_DQ=1 turns it on); tests force it.
FUSED_OVERRIDE: bool | None = None


def use_fused_dq(p: AttnParams) -> bool:
    if p.deterministic:
        return False
    if FUSED_OVERRIDE is not None:
        return FUSED_OVERRIDE
    return env.get("FLASHTILE_BWD_FUSED_DQ", "0") not in ("", "0")


# How the fused variant adds dQ: True = one bulk tensor reduce-add (TMA) per tile, False = an fp32
# atomic per element. None: TMA where the GPU has it (sm_90+) and not under the interpreter, which
# cannot run descriptor reduces. Tests and tune_bwd.py force either.
FUSED_DQ_TMA_OVERRIDE: bool | None = None


def fused_dq_mode(q: torch.Tensor) -> int:
    """The dK/dV kernel's FUSED_DQ constexpr for a fused call: 2 = TMA reduce-add, 1 = atomics."""
    if FUSED_DQ_TMA_OVERRIDE is not None:
        return 2 if FUSED_DQ_TMA_OVERRIDE else 1
    return 2 if q.device.type == "cuda" and capability(q.device)[0] >= 9 else 1


def use_tma(*tensors) -> bool:
    if TMA_OVERRIDE is not None:  # tests force a path, but an empty tensor has no descriptor
        return TMA_OVERRIDE and all(x.numel() > 0 for x in tensors)
    if env.get("FLASHTILE_BWD_TMA", "0") in ("", "0"):
        return False
    q = tensors[0]
    if q.device.type != "cuda" or capability(q.device)[0] < 9:
        return False
    return all(_tma_ok(x) for x in tensors)


# dK/dV and dQ programs in one grid (kernels/attn_bwd.py::_attn_bwd_one_launch_kernel), both with
# the dK/dV config's warps and stages: one launch fewer and no tail between the two kernels.
# Off by default until measured on the H200 (FLASHTILE_BWD_ONE_LAUNCH=1); tests force it.
ONE_LAUNCH_OVERRIDE: bool | None = None


# Masked ranges loaded directly instead of through the software pipeline, whose prologue runs even when a
# range is empty (as the forward's, attn_fwd._edge_setting). Measured on the H200 (bf16, CUDA-graph replays,
# every launch pipelined / direct alternated twice; bwd_edges_ab_h200_2026-11-30_session16.json), TFLOP/s:
# non-causal, where the only masked range is a ragged key / query end (empty at these lengths), d = 64
# s = 512 246 / 243 -> 255 / 253, 1024 290 / 293 -> 298 / 300, 2048 315 / 317 -> 327 / 322; d = 128 s = 512
# 253 / 254 -> 256 / 257 (from 1024 the Gluon dK/dV kernel runs and only dQ changes: even). Causal, whose
# diagonal range holds several blocks a program, lost 10%-13% at d = 64 (512 157 -> 141, 2048 270 -> 236)
# and at d = 128 s = 512 (172 -> 153). A second lease, the rule against every launch pipelined
# (bwd_edges_rule_ab_h200_2026-11-30_session16.json): d = 64 512 251-256 against 245-248, 1024 299-301 against
# 287-288, 2048 326-329 against 317-319; d = 128 even to +2%. d = 32 (session 17, one lease,
# bwd_edges_d32_ab_h200_2026-11-30_session17.json, twice each): non-causal s = 512 176-177 -> 181, 1024 205 ->
# 207, 2048 223-224 -> 225; causal lost 11%-16% (2048 197 -> 166); a second lease, the rule against every
# launch pipelined (bwd_edges_d32_rule_ab_...): 512 176-177 -> 180-181, 1024 205 -> 208, 2048 224 -> 226,
# causal unchanged. So by default on sm_90 for 2-byte inputs
# at BLOCK_D 32 / 64 / 128 when no band (causal or local window) masks the scores.


def edge_setting(arch: str, block_d: int, banded: bool, elem_bytes: int, dropout: bool = False) -> dict:
    """The Triton backward launches' PIPELINE_EDGES: {} (pipelined, the kernels' default) or
    {"PIPELINE_EDGES": False} (direct). FLASHTILE_BWD_PIPELINE_EDGES=0 / 1 forces direct loads / the
    pipeline for every launch.

    With dropout the masked ranges always load directly: Triton 3.6's software pipeline of those
    ranges faults with "misaligned address" on sm_90 (varlen + dropout + causal at d = 128, issue 53;
    the direct loads run clean under the same inputs, tests/test_gpu_fa_grid.py)."""
    return host.edge_flags("FLASHTILE_BWD_PIPELINE_EDGES",
                           dropout or (arch == "sm90" and block_d in (32, 64, 128) and not banded and elem_bytes == 2))


def use_one_launch(p: AttnParams) -> bool:
    if ONE_LAUNCH_OVERRIDE is not None:
        return ONE_LAUNCH_OVERRIDE
    return env.get("FLASHTILE_BWD_ONE_LAUNCH", "0") not in ("", "0")


# Programmatic dependent launch of the dQ kernel behind the dK/dV kernel (sm_90+). The two read the
# same inputs and write different outputs, so dQ needs nothing from dK/dV: every dK/dV program
# signals at its start, the dQ grid is then scheduled onto the SMs the dK/dV grid's last wave leaves
# idle, and the dQ grid's last program waits for the dK/dV grid at its end (so the stream's later
# work sees both done; the other dQ programs free their SMs when done). NVIDIA only. The split path
# only (not the fused, one-launch or Gluon-dQ variants).
# On where the H200 measured it faster (bwd_pdl_ab_h200_2026-11-30_session9.json, off/on alternated
# twice in one call, fixed 16k-token batches): d = 64 1.5%-3.8% at every s from 1024 to 16384 but
# non-causal 16384 (0.8%); d = 256 1.2%-3.9% from s = 2048 (neutral at non-causal 16384) and 2.2% at
# non-causal 1024; d = 128 causal 1.5%-1.6% at s = 2048 / 4096 and non-causal 2% at 1024. Off where
# it was not: d = 128 non-causal from 2048 (0.99x-1.00x) and causal 16384 (0.98x), and causal
# s = 1024 at d = 128 / 256, whose eager times vary by host time more than PDL can win. Other head
# dims take the nearest measured row, varlen calls their longest sequence; "causal" is the plain
# causal mask (window (-1, 0)), banded windows count as not causal. The rule is the default on the
# H200's sm_90 only; FLASHTILE_BWD_PDL=0 / 1 forces it off / on everywhere (on: any sm_90+ NVIDIA
# GPU); tests pin BWD_PDL_OVERRIDE.
BWD_PDL_OVERRIDE: bool | None = None


def pdl_preferred(d: int, causal: bool, seqlen: int) -> bool:
    """Where the H200 measured the dQ kernel's programmatic dependent launch faster (see above)."""
    if d <= 64:
        return True
    if causal and seqlen < 2048:
        return False
    if d <= 128:
        return seqlen <= 4096 if causal else seqlen <= 1024
    return True


def use_bwd_pdl(q: torch.Tensor, causal: bool, seqlen: int) -> bool:
    """Launch the dQ kernel behind the dK/dV kernel? (``seqlen``: the longer of the query and key
    lengths; ``causal``: the mask is plain causal)."""
    # griddepcontrol is NVIDIA's (a ROCm MI300 also reports capability 9.x)
    if q.device.type != "cuda" or torch.version.hip is not None:
        return False
    cap = capability(q.device)
    if BWD_PDL_OVERRIDE is not None:
        return BWD_PDL_OVERRIDE and cap[0] >= 9
    forced = env.get("FLASHTILE_BWD_PDL", "")
    if forced:
        return forced != "0" and cap[0] >= 9
    return cap == (9, 0) and pdl_preferred(q.shape[-1], causal, seqlen)


_TABLE_OVERRIDES: dict | None = None


def config_overrides() -> dict:
    """BWD_CONFIGS rows from the JSON file named by FLASHTILE_BWD_CONFIGS (tuning runs), if any.

    The file maps "arch,bucket[,causal[,short]]" (e.g. "sm90,128" or "sm90,128,True,short") to
    [[dkdv BM, BN, warps, stages], [dq ...]].
    """
    global _TABLE_OVERRIDES
    if _TABLE_OVERRIDES is None:
        table = {}
        path = env.get("FLASHTILE_BWD_CONFIGS")
        if path:
            with open(path) as f:
                for key, (kv_cfg, q_cfg) in json.load(f).items():
                    parts = key.split(",")
                    ok = (2 <= len(parts) <= 4 and parts[1].isdigit()
                          and (len(parts) < 3 or parts[2] in ("True", "False"))
                          and (len(parts) < 4 or parts[3] == "short"))
                    if not ok:
                        raise ValueError(f"FLASHTILE_BWD_CONFIGS ({path}): bad key {key!r}; expected "
                                         f"'arch,bucket[,True|False[,short]]', e.g. 'sm90,128,True,short'")
                    parsed = (parts[0], int(parts[1]), *([parts[2] == "True"] if len(parts) > 2 else []),
                              *parts[3:])
                    table[parsed] = (tuple(kv_cfg), tuple(q_cfg))
        _TABLE_OVERRIDES = table
    return _TABLE_OVERRIDES


def _strides3(x: torch.Tensor, varlen: bool):
    """(batch, row, head) strides; varlen tensors have no batch dim (the kernels add cu_seqlens)."""
    st = x.stride()  # one call: each stride(i) call costs host time on the launch path
    return (0, st[0], st[1]) if varlen else st[:3]


def attn_bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    """Write dq, dk, dv (possibly strided views into packed buffers) for saved q, k, v, out, lse."""
    with device_guard(q):
        _attn_bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


def _attn_bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    varlen = p.varlen  # a property: read once
    d = q.shape[-1]
    h, h_k = q.shape[-2], k.shape[-2]
    block_d = max(16, next_pow2(d))
    max_seqlen = max(p.max_seqlen_q, p.max_seqlen_k) if varlen else max(q.shape[1], k.shape[1])
    arch = arch_of(q.device)
    (bm_kv, bn_kv, w_kv, s_kv), (bm_q, bn_q, w_q, s_q) = CONFIG_OVERRIDE or bwd_configs(
        arch, block_d, config_overrides(), p.causal, max_seqlen)
    if varlen:
        b = p.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = p.max_seqlen_q, p.max_seqlen_k
        lse_b, lse_h = 0, lse.stride(0)
    else:
        b, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        lse_b, lse_h = lse.stride(0), lse.stride(1)
    # keys/rows cut off by seqused_* (and whole empty sequences) are never visited: pre-zero them
    if varlen:
        dk.zero_()
        dv.zero_()
        if p.seqused_q is not None:
            dq.zero_()
    if b * h == 0 or q.shape[0] == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    delta = torch.empty_like(lse)
    dummy = lse
    cu_q = p.cu_seqlens_q if varlen else dummy
    cu_k = p.cu_seqlens_k if varlen else dummy
    used_q = p.seqused_q if p.seqused_q is not None else dummy
    used_k = p.seqused_k if p.seqused_k is not None else dummy
    alibi = p.alibi_slopes if p.alibi_slopes is not None else dummy
    alibi_b = 0 if p.alibi_slopes is None or p.alibi_slopes.dim() == 1 else p.alibi_slopes.stride(0)
    flags = dict(IS_VARLEN=varlen, HAS_SEQUSED_Q=p.seqused_q is not None, HAS_SEQUSED_K=p.seqused_k is not None)
    so = _strides3(out, varlen)
    sdo = _strides3(dout, varlen)
    pre_m = 64
    run_kernel(_attn_bwd_preprocess_kernel, (cdiv(max(seqlen_q, 1), pre_m) * b * h,),
        out, dout, delta, cu_q, used_q, seqlen_q, h, *so, *sdo, lse_b, lse_h,
        HEAD_DIM=d, BLOCK_M=pre_m, BLOCK_D=block_d, IS_VARLEN=varlen, HAS_SEQUSED_Q=p.seqused_q is not None)

    qk_scale = p.softmax_scale / p.softcap if p.softcap > 0 else p.softmax_scale * LOG2E
    common = (qk_scale, p.softcap, p.dropout_p, p.seed & 0xFFFFFFFF, (p.seed >> 32) & 0xFFFFFFFF,
              p.offset & 0xFFFFFFFF, p.window_left, p.window_right, p.softmax_scale)
    sq_, sk_, sv_ = _strides3(q, varlen), _strides3(k, varlen), _strides3(v, varlen)
    feature_flags = dict(HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, HAS_SOFTCAP=p.softcap > 0,
                         HAS_ALIBI=p.alibi_slopes is not None, HAS_DROPOUT=p.dropout_p > 0,
                         DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    tma = use_tma(q, k, v, dout)
    feature_flags["USE_TMA"] = tma
    feature_flags.update(edge_setting(arch, block_d, p.window_left >= 0 or p.window_right >= 0, q.element_size(),
                                       p.dropout_p > 0))
    fused = use_fused_dq(p)
    one_launch = not fused and use_one_launch(p)
    # the Gluon dK/dV kernel (d = 128 / 256 by default, backends/triton/gluon_bwd.py), then the Triton
    # dQ kernel below; the experimental Triton variants, when switched on, keep the whole backward
    dkdv_done = not fused and not one_launch and gluon_bwd.use_gluon_bwd(q, k, v, dout, dk, dv, p)
    gluon_dq = not fused and not one_launch and gluon_bwd.use_gluon_bwd_dq(q, k, v, dout, dq, p)
    # the rule's "causal" is the plain causal mask, as the Gluon route's (a banded window is not)
    pdl = (not fused and not one_launch and not gluon_dq
           and use_bwd_pdl(q, p.window_right == 0 and p.window_left < 0, max_seqlen))
    # q and dout by descriptor for the Triton dK/dV programs only (the Gluon kernel builds its own)
    desc_q, desc_do = ((_descriptor(q, bm_kv, block_d), _descriptor(dout, bm_kv, block_d)) if tma and not dkdv_done
                       else (q, dout))
    # Triton 3.6's ptxas segfaults on the dQ kernel's descriptor loads when they are software
    # pipelined (num_stages >= 2; tests/test_sm90_compile.py), so dQ takes them only unpipelined;
    # in one launch the dQ programs run at the dK/dV programs' stages
    tma_dq = tma and (s_kv if one_launch else s_q) == 1
    desc_k, desc_v = (_descriptor(k, bn_q, block_d), _descriptor(v, bn_q, block_d)) if tma_dq else (k, v)
    if dkdv_done:
        gluon_bwd.gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, p.softmax_scale, p.window_right == 0,
                                      launch_dependents=pdl)
    if one_launch:
        # one grid: warps/stages from dK/dV
        n_dkdv = cdiv(max(seqlen_k, 1), bn_kv) * b * h_k
        n_dq = cdiv(max(seqlen_q, 1), bm_q) * b * h
        del feature_flags["USE_TMA"]
        launch(
            _attn_bwd_one_launch_kernel, (n_dkdv + n_dq,),
            q, k, v, dout, lse, delta, dk, dv, dq, desc_q, desc_do, desc_k, desc_v, cu_q, cu_k, used_q, used_k,
            alibi, *common, seqlen_q, seqlen_k, h, h_k, h // h_k, n_dkdv, *sq_, *sk_, *sv_, *sdo,
            *_strides3(dk, varlen), *_strides3(dv, varlen), *_strides3(dq, varlen), lse_b, lse_h, alibi_b,
            HEAD_DIM=d, BLOCK_M1=bm_kv, BLOCK_N1=bn_kv, BLOCK_M2=bm_q, BLOCK_N2=bn_q, BLOCK_D=block_d, **flags,
            **feature_flags, USE_TMA_DKDV=tma, USE_TMA_DQ=tma_dq, num_warps=w_kv, num_stages=s_kv)
        return
    # the fused variant accumulates dQ in an fp32 buffer (zeroed first) by TMA reduce-adds or atomics,
    # then scales and casts once
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if fused else delta
    fused_mode = fused_dq_mode(q) if fused else 0
    if fused_mode == 2 and not _tma_ok(dq_acc):  # e.g. d not a multiple of 4: no fp32 TMA stride
        fused_mode = 1
    dq_acc_arg = _descriptor(dq_acc, bm_kv, block_d) if fused_mode == 2 else dq_acc
    if not dkdv_done:
        launch(
            _attn_bwd_dkdv_kernel, (cdiv(max(seqlen_k, 1), bn_kv) * b * h_k,),
            q, k, v, dout, lse, delta, dk, dv, dq_acc_arg, desc_q, desc_do, cu_q, cu_k, used_q, used_k, alibi,
            *common, seqlen_q, seqlen_k, h, h_k, h // h_k, *sq_, *sk_, *sv_, *sdo,
            *_strides3(dk, varlen), *_strides3(dv, varlen), lse_b, lse_h, alibi_b,
            *(_strides3(dq_acc, varlen) if fused else (0, 0, 0)),
            HEAD_DIM=d, BLOCK_M=bm_kv, BLOCK_N=bn_kv, BLOCK_D=block_d, **flags, **feature_flags,
            FUSED_DQ=fused_mode, num_warps=w_kv, num_stages=s_kv, **({"LAUNCH_DEPENDENTS": True} if pdl else {}))
    if fused:
        dq.copy_(dq_acc.mul_(p.softmax_scale))
        return
    if gluon_dq:  # experimental: FLASHTILE_GLUON_BWD_DQ=1
        gluon_bwd.gluon_attn_bwd_dq(q, k, v, dout, lse, delta, dq, p.softmax_scale, p.window_right == 0)
        return
    feature_flags["USE_TMA"] = tma_dq
    launch(
        _attn_bwd_dq_kernel, (cdiv(max(seqlen_q, 1), bm_q) * b * h,),
        q, k, v, dout, lse, delta, dq, desc_k, desc_v, cu_q, cu_k, used_q, used_k, alibi, *common,
        seqlen_q, seqlen_k, h, h // h_k, *sq_, *sk_, *sv_, *sdo, *_strides3(dq, varlen), lse_b, lse_h, alibi_b,
        HEAD_DIM=d, BLOCK_M=bm_q, BLOCK_N=bn_q, BLOCK_D=block_d, **flags, **feature_flags,
        HEAVY_FIRST=host.HEAVY_FIRST, num_warps=w_q, num_stages=s_q,
        **({"WAIT_AT_END": True, "launch_pdl": True} if pdl else {}))
