"""The Gluon dK/dV kernel (kernels/gluon_bwd.py) in the backward: which calls take it, and its launch.

The backward with this kernel for dK/dV (dQ stays the Triton kernel) measured 1.08x-1.17x of the
all-Triton backward at d = 128 and 1.43x-1.64x at d = 256 from s = 1024, bf16 and fp16; at d = 64 it was
0.95x-1.05x, so d = 64 stays on Triton (docs/gluon.md, "The backward's dK/dV kernel"). q / k 192 with v 128:
1.31x-1.41x of the all-Triton backward at s = 1024 / 4096 / 16384, causal and not (H100; docs/models.md,
"Measured"). s = 512 keeps the Triton kernel's short-sequence tiles.

``config.gluon`` (FLASHTILE_GLUON=0) turns every Gluon route off; ``config.gluon_bwd`` forces this one on
(wherever the kernel can run, d = 64 too) or off.
"""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton import gluon_route
from flashtile.backends.triton.gluon_fwd import (
    LOG2E,
    _check_alibi,
    _descriptor,
    head_dim_split,
    key_counts,
    own_k_sequences,
)
from flashtile.backends.triton.host import MAX_GRID_Y, capability, cdiv, run_kernel
from flashtile.params import AttnParams

HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))  # (q / k head dim, v head dim)
V_HEAD_DIM = dict(HEAD_DIMS)
DTYPES = (torch.bfloat16, torch.float16)
# (head_dim, plain causal mask) -> the shortest sequence whose dK/dV the Gluon kernel takes (bf16 and fp16)
ROUTE_TABLE = {(128, False): 1024, (128, True): 1024, (192, False): 1024, (192, True): 1024, (256, False): 1024,
               (256, True): 1024}
# head dims whose dK/dV stays on the Triton kernel for a softcap inside a causal sliding window: at d = 128 the
# Gluon kernel measured 0.95x-0.98x of the all-Triton backward there (windows 256 / 1024, s 2048 / 8192, 64k
# tokens; its softcap build spills), at d = 192 1.36x-1.46x (H100)
TRITON_WINDOWED_SOFTCAP = frozenset({128})


def refusal(q, k, v, dout, dk, dv, p: AttnParams) -> str | None:
    """Why the Gluon dK/dV kernel cannot compute this backward exactly (None: it can)."""
    if q.dtype not in DTYPES or any(x.dtype != q.dtype for x in (k, v, dout, dk, dv)):
        return f"dtype {q.dtype} (takes {DTYPES})"
    # the forward's coverage: padded (q and k of any lengths, causal with k the longer) or varlen (k with its
    # own cu_seqlens_k / seqused_k: plain, causal or softcap), plain, causal or a causal window, softcap, causal
    # ALiBi, no dropout / seqused_q, TMA-readable q, k, v
    why = gluon_route.coverage_refusal(q, k, v, p, HEAD_DIMS, causal_window=True, varlen=True, softcap=True,
                                       alibi=True, unequal_lengths=True, varlen_k=True)
    if why:
        return why
    plain_order_only = [name for name, used in (("softcap", p.softcap > 0), ("varlen", p.varlen),
                                                ("ALiBi", p.alibi_slopes is not None)) if used]
    if plain_order_only:
        from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS

        # the rotated schedule (d = 64's table entry) has none of them; the fused build runs the plain order
        if BWD_DKDV_CONFIGS[q.shape[-1]].get("ROTATED", 1) and not use_fused_dq(q, v, p):
            return (f"{' / '.join(plain_order_only)} at head_dim {q.shape[-1]} (its config runs the rotated "
                    "schedule)")
    if not all(gluon_route._aligned(x) for x in (dout, dk, dv)):
        return "dout, dk or dv with strides that TMA cannot read or write"
    batch = p.cu_seqlens_q.numel() - 1 if p.varlen else q.shape[0]
    if batch * k.shape[-2] > MAX_GRID_Y:
        return f"batch x kv heads = {batch * k.shape[-2]} > {MAX_GRID_Y} (the grid's second axis)"
    return None


def preferred(q, causal: bool, seqlen: int | None = None, windowed_softcap: bool = False) -> bool:
    """Does ROUTE_TABLE take the Gluon kernel for this backward's dK/dV? (``seqlen``: a varlen call's longest
    sequence, default q's sequence dim; ``windowed_softcap``: a softcap inside a sliding window)"""
    if windowed_softcap and q.shape[-1] in TRITON_WINDOWED_SOFTCAP:
        return False
    start = ROUTE_TABLE.get((q.shape[-1], causal))
    seqlen = q.shape[1] if seqlen is None else seqlen
    return start is not None and q.dtype in DTYPES and seqlen >= start


def use_gluon_bwd(q, k, v, dout, dk, dv, p: AttnParams) -> bool:
    """Compute dK, dV of this backward with the Gluon kernel? (an sm_90 GPU, a call it covers, and the
    route table's choice or config.gluon_bwd's)."""
    settings = config.get()
    forced = settings.gluon_bwd
    if not settings.gluon or forced is False or q.device.type != "cuda":
        return False
    if capability(q.device) not in gluon_route.CAPABILITIES:
        return False
    # the cheap test first: refusal() reads strides and pointers; a row of either table takes the kernel (the
    # fused build's, where the split's has none, as at d = 64)
    if not forced and not (preferred(q, p.window_right == 0, p.max_seqlen_q if p.varlen else None,
                                     p.softcap > 0 and p.window_left >= 0) or use_fused_dq(q, v, p)):
        return False
    return refusal(q, k, v, dout, dk, dv, p) is None


# (head_dim, plain causal mask) -> the shortest sequence whose backward takes the Gluon dK/dV kernel's fused dQ
# build when deterministic=False (sliding windows: no row). Empty until the build is timed against the split
# (scripts/ab_fused_dq.py); config.gluon_fused_dq=True takes it wherever it can run.
FUSED_ROUTE_TABLE: dict[tuple[int, bool], int] = {}


def use_fused_dq(q, v, p: AttnParams) -> bool:
    """Does the Gluon dK/dV kernel, where it runs (use_gluon_bwd), compute dQ too (its FUSED_DQ build: dQ added
    by TMA reduce-add into an fp32 buffer, no dQ kernel)? Never for ``deterministic=True`` (the adds land in a
    varying order), only at the head dims of BWD_FUSED_CONFIGS with v's head dim the kernel's (V_HEAD_DIM); there
    FUSED_ROUTE_TABLE decides, and ``config.gluon_fused_dq`` True / False forces it on / off."""
    forced = config.get().gluon_fused_dq
    if forced is False or p.deterministic:
        return False
    d = q.shape[-1]
    if not forced:  # the table first: every backward asks, and an empty table answers with one lookup
        if p.window_left >= 0:  # the table's rows are full and plain causal attention: a window is neither
            return False
        start = FUSED_ROUTE_TABLE.get((d, p.window_right == 0))
        seqlen = p.max_seqlen_q if p.varlen else q.shape[1]
        if start is None or q.dtype not in DTYPES or seqlen < start:
            return False
    from flashtile.kernels.gluon_bwd import BWD_FUSED_CONFIGS

    return d in BWD_FUSED_CONFIGS and v.shape[-1] == V_HEAD_DIM.get(d)


def _config(table: dict, d: int, tiles: dict | None) -> dict:
    from flashtile.kernels.gluon_bwd import CONFIG_KEYS

    cfg = dict(table[d])
    if tiles:
        unknown = set(tiles) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"gluon bwd: unknown config keys {sorted(unknown)} (known: {CONFIG_KEYS})")
        cfg.update({key: int(val) for key, val in tiles.items()})
    return cfg


def _check_stats(lse, delta) -> None:
    if lse.stride(-1) != 1 or delta.stride() != lse.stride():
        raise ValueError("gluon bwd: lse and delta must share (b, h, s) strides with a unit last stride")


def gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, softmax_scale: float, causal: bool,
                        config: dict | None = None, launch_dependents: bool = False, window_left: int = -1,
                        cu_seqlens=None, max_seqlen: int = 0, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, cu_seqlens_k=None, max_seqlen_k: int = 0,
                        seqused_k: torch.Tensor | None = None, dq_accum: torch.Tensor | None = None) -> None:
    """Write dk (b, s, h_k, d), dv (b, s, h_k, dv) for q (b, s, h, d), dout (b, s, h, dv), k, v, lse and delta
    (b, h, s) fp32 (lse natural log, delta = rowsum(dO * O)). (d, dv) is one of HEAD_DIMS; q / k / dk of 192
    columns reach the kernel as 128 + 64 (head_dim_split). The caller checked ``refusal``;
    ``config`` overrides the table's (tuning); ``launch_dependents``: the next kernel (the dQ kernel)
    is launched with programmatic dependent launch (attn_bwd.use_bwd_pdl); ``window_left`` >= 0 (with
    ``causal``): a causal sliding window. Varlen: (total, h, d) tensors packed by ``cu_seqlens`` (b + 1,) int32,
    shared by q and k, ``max_seqlen`` their longest, lse and delta (h, total). ``softcap`` > 0: capped scores.
    ``alibi_slopes`` (with ``causal``): CUDA fp32 (h,) or (b, h) slopes (b: sequences when varlen), unit last
    stride, each score biased by ``-slope * |row - key|`` (after the softcap), as the forward that gave lse.
    ``cu_seqlens_k`` / ``seqused_k`` (varlen): k, v, dk, dv packed by sequences of their own (``max_seqlen_k`` the
    longest), aligned bottom-right with q's per sequence; no window or ALiBi then. ``dq_accum``: an fp32 tensor of
    zeros shaped as q ((d, dv) of BWD_FUSED_CONFIGS and V_HEAD_DIM) that the kernel adds softmax_scale * dS K into: dQ
    in fp32 (the FUSED_DQ build, its own config table; the caller casts it into dq); no dependent launch then."""
    from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, BWD_FUSED_CONFIGS, _gluon_attn_bwd_dkdv_kernel

    fused = dq_accum is not None
    if fused:
        fused_dims = [(d, V_HEAD_DIM[d]) for d in BWD_FUSED_CONFIGS]
        if (q.shape[-1], v.shape[-1]) not in fused_dims:
            raise ValueError(f"gluon bwd: dq_accum needs (d, dv) in {fused_dims}, got ({q.shape[-1]}, {v.shape[-1]})")
        if dq_accum.dtype != torch.float32 or dq_accum.shape != q.shape or not dq_accum.is_contiguous():
            raise ValueError(f"gluon bwd: dq_accum must be contiguous fp32 of q's shape {tuple(q.shape)}, got "
                             f"{dq_accum.dtype} {tuple(dq_accum.shape)}")
        if launch_dependents:
            raise ValueError("gluon bwd: dq_accum leaves no dQ kernel to launch as a dependent")

    varlen = cu_seqlens is not None
    varlen_k = own_k_sequences(cu_seqlens, cu_seqlens_k, seqused_k)
    if varlen_k:
        if window_left >= 0 or alibi_slopes is not None:
            raise ValueError("gluon bwd: k's own cu_seqlens / seqused_k take no window or alibi_slopes")
        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        kv_lens = key_counts(cu_seqlens_k, seqused_k)
    dk_out, dv_out = dk, dv
    if varlen:  # one sequence of all the tokens to the descriptors; the kernel finds each in cu_seqlens
        q, k, v, dout, dk, dv = (x[None] for x in (q, k, v, dout, dk, dv))
        lse, delta = lse[None], delta[None]
        if fused:
            dq_accum = dq_accum[None]
    b, s, h, d = q.shape
    s_k = k.shape[1]
    if varlen:
        b, s = cu_seqlens.numel() - 1, max_seqlen
        s_k = max_seqlen_k if varlen_k else s
    if causal and s_k < s and not varlen_k:
        raise ValueError(f"gluon bwd: causal needs seqlen_k >= seqlen_q, got {s} and {s_k}")
    h_k, dv_dim = k.shape[2], v.shape[-1]
    if alibi_slopes is not None:
        if not causal:
            raise ValueError("gluon bwd: alibi_slopes needs causal=True (the kernel's ALiBi is causal)")
        _check_alibi(alibi_slopes, b, h, "gluon bwd")
    cfg = _config(BWD_FUSED_CONFIGS if fused else BWD_DKDV_CONFIGS, d, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    _check_stats(lse, delta)
    lead, tail = head_dim_split(d)
    meta = dict(HEAD_DIM=lead, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
                num_warps=cfg["num_warps"])
    if tail or dv_dim != d:  # absent, the kernel's defaults (no tail, v's head dim = d) apply
        meta.update(HEAD_DIM_TAIL=tail, HEAD_DIM_V=dv_dim)
    if window_left >= 0:
        if not causal:
            raise ValueError("gluon bwd: window_left needs causal=True (the kernel's windows are causal ones)")
        meta["LOCAL"] = True
    # WARPS_N (d = 256: two warpgroups side by side) and ROTATED (0: the plain order, the d = 128 / 256
    # table's choice) only when given: absent, the kernel's defaults (1, rotated) apply
    meta.update({key: cfg[key] for key in ("WARPS_N", "ROTATED") if key in cfg})
    if launch_dependents:
        meta["LAUNCH_DEPENDENTS"] = True
    if varlen:
        meta["VARLEN"] = True
    if softcap > 0:
        meta["SOFTCAP"] = True
    if alibi_slopes is not None:
        meta["ALIBI"] = True
    if varlen_k:
        meta["VARLEN_K"] = True
    elif s_k != s:
        meta["UNEQUAL"] = True
    if fused:
        meta["FUSED_DQ"] = True
    # a split head dim reads two column ranges (views); unsplit, the tensors themselves (no per-call slicing)
    desc_q = _descriptor(q[..., :lead] if tail else q, [1, bm, 1, lead])
    desc_k = _descriptor(k[..., :lead] if tail else k, [1, bn, 1, lead])
    desc_dk = _descriptor(dk[..., :lead] if tail else dk, [1, bn, 1, lead])
    # with no tail the kernel never reads its tail descriptors: it gets the leading ones again
    tails = ((_descriptor(q[..., lead:], [1, bm, 1, tail]), _descriptor(k[..., lead:], [1, bn, 1, tail]),
              _descriptor(dk[..., lead:], [1, bn, 1, tail])) if tail else (desc_q, desc_k, desc_dk))
    run_kernel(_gluon_attn_bwd_dkdv_kernel, (cdiv(s_k, bn), b * h_k),
        desc_q, desc_k, _descriptor(v, [1, bn, 1, dv_dim]), _descriptor(dout, [1, bm, 1, dv_dim]), desc_dk,
        _descriptor(dv, [1, bn, 1, dv_dim]), *tails, lse, delta, 0 if varlen else lse.stride(0), lse.stride(1), s,
        h_k, h // h_k, softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E, softmax_scale,
        max(window_left, 0),
        # packed sequences' ragged last key blocks are stored row by row: dk / dv (total, h_k, d) and strides
        cu_seqlens if varlen else lse, dk_out, dv_out, dk_out.stride(-3), dk_out.stride(-2), dv_out.stride(-3),
        dv_out.stride(-2), softcap * LOG2E,
        # ALiBi: the slopes and their batch stride (0 for (h,): every batch reads the one row)
        lse if alibi_slopes is None else alibi_slopes,
        alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0, s_k,
        cu_seqlens_k if varlen_k else lse, kv_lens if varlen_k else lse,
        # dQ's buffer in the leading and tail column ranges (without a tail the second repeats the first); without
        # dq_accum the kernel never reads them: dK's descriptor stands in
        *(_dq_descriptors(dq_accum, bm, lead, tail) if fused else (desc_dk, desc_dk)), **meta)


def _dq_descriptors(dq_accum: torch.Tensor, bm: int, lead: int, tail: int) -> tuple:
    """The fused build's dQ buffer as (leading columns, tail columns) descriptors of ``bm``-row boxes."""
    if not tail:
        desc = _descriptor(dq_accum, [1, bm, 1, lead])
        return desc, desc
    return _descriptor(dq_accum[..., :lead], [1, bm, 1, lead]), _descriptor(dq_accum[..., lead:], [1, bm, 1, tail])
