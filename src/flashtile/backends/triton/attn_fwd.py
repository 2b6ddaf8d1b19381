"""Launcher of the forward kernel: allocation, strides, descriptors, grid and config choice."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton import config_files
from flashtile.backends.triton.host import arch_of, capability, cdiv, device_guard, launch, next_pow2
from flashtile.backends.triton.tma import row_descriptor as _descriptor
from flashtile.backends.triton.tma import tma_ok as _tma_ok
from flashtile.kernels.attn_fwd import _attn_fwd_kernel, fwd_config
from flashtile.params import AttnParams

LOG2E = 1.4426950408889634



def _parse_row(key: str, cfg) -> tuple:
    arch, bucket, causal, *rest = key.split(",")
    return (arch, int(bucket), causal == "True", *rest), tuple(cfg)


def config_overrides() -> dict:
    """Config-table rows from the JSON file named by ``config.fwd_configs`` (FLASHTILE_FWD_CONFIGS), if any.

    The file maps "arch,bucket,causal[,short]" (e.g. "sm90,128,False,short") to
    [BLOCK_M, BLOCK_N, num_warps, num_stages]. Read once per file name.
    """
    return config_files.load(config.get().fwd_configs, _parse_row)


def use_tma(q, k, v) -> bool:
    """Tensor-descriptor loads on sm_90+ where every tensor allows them; ``config.tma`` forces either way
    (an empty tensor still has no descriptor)."""
    forced = config.get().tma
    if forced is not None:
        return forced and all(x.numel() > 0 for x in (q, k, v))
    if q.device.type != "cuda" or capability(q.device)[0] < 9:
        return False
    return all(_tma_ok(x) for x in (q, k, v))


def attn_fwd(q, k, v, p: AttnParams):
    """Forward on q (b, sq, h, d) / (total_q, h, d); returns (out, lse, probs-or-None)."""
    with device_guard(q):
        return _attn_fwd(q, k, v, p)


def _attn_fwd(q, k, v, p: AttnParams):
    varlen = p.varlen  # a property: read once
    d, dv = q.shape[-1], v.shape[-1]
    h, h_k = q.shape[-2], k.shape[-2]
    block_d = max(16, next_pow2(d))
    block_dv = max(16, next_pow2(dv))
    # the tables are keyed by one head-dim bucket: the wider of q/k's and v's tiles sets the shared memory
    block_wide = max(block_d, block_dv)
    arch = arch_of(q.device)
    max_k = p.max_seqlen_k if varlen else k.shape[1]
    settings = config.get()
    block_m, block_n, num_warps, num_stages = settings.fwd_tiles or fwd_config(
        arch, block_wide, p.causal, max_k, config_overrides())
    tma = use_tma(q, k, v)
    if tma and (min(block_d, block_dv) * q.element_size()) < 16:
        tma = False

    out = torch.empty(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)
    want_probs = p.return_probs and p.dropout_p > 0
    if varlen:
        b = p.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = p.max_seqlen_q, p.max_seqlen_k
        total_q = q.shape[0]
        # rows cut off by seqused_q are never visited by the kernel: they keep out 0 / lse +inf
        lse = (torch.full if p.seqused_q is not None else torch.empty)(
            (h, total_q), *(() if p.seqused_q is None else (float("inf"),)), device=q.device,
            dtype=torch.float32)
        if p.seqused_q is not None:
            out.zero_()
        sq_b, sk_b, so_b = 0, 0, 0
        sq_m, sq_h = q.stride(0), q.stride(1)
        sk_n, sk_h = k.stride(0), k.stride(1)
        sv_n, sv_h = v.stride(0), v.stride(1)
        so_m, so_h = out.stride(0), out.stride(1)
        lse_b, lse_h = 0, lse.stride(0)
        sv_b = 0
    else:
        b, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        lse = torch.empty(b, h, seqlen_q, device=q.device, dtype=torch.float32)
        # one stride() call per tensor: each stride(i) call costs host time on the launch path
        sq_b, sq_m, sq_h = q.stride()[:3]
        sk_b, sk_n, sk_h = k.stride()[:3]
        sv_b, sv_n, sv_h = v.stride()[:3]
        so_b, so_m, so_h = out.stride()[:3]
        lse_b, lse_h = lse.stride()[:2]
    probs = None
    if want_probs:
        probs = torch.zeros(b, h, seqlen_q, seqlen_k, device=q.device, dtype=torch.float32)
    probs_arg = probs if probs is not None else lse
    pb, ph, pm = (probs.stride(0), probs.stride(1), probs.stride(2)) if probs is not None else (0, 0, 0)

    if tma:
        desc_q = _descriptor(q, block_m, block_d)
        desc_k = _descriptor(k, block_n, block_d)
        desc_v = _descriptor(v, block_n, block_dv)
    else:
        desc_q, desc_k, desc_v = q, k, v

    if p.softcap > 0:
        qk_scale = p.softmax_scale / p.softcap
    else:
        qk_scale = p.softmax_scale * LOG2E
    alibi = p.alibi_slopes
    alibi_stride_b = 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0)
    dummy = lse
    grid = (cdiv(max(seqlen_q, 1), block_m) * b * h,)  # flat: the kernel splits it
    if b * h == 0 or seqlen_q == 0:
        return out, lse, probs
    # calls without v's own head dim, a sink or a chunk pass exactly the plain kernel's constexprs (None
    # arguments are constexprs too), so they compile to the plain kernel
    extra = {}
    if dv != d:
        extra.update(HEAD_DIM_V=dv, BLOCK_DV=block_dv)
    sink = p.learnable_sink
    if sink is not None:
        sink = sink.contiguous()  # (h,): indexed by the query head
        extra["HAS_SINK"] = True
    chunk = p.attention_chunk if p.attention_chunk > 0 else None
    if chunk is not None:
        extra["HAS_CHUNK"] = True
    launch(
        _attn_fwd_kernel, grid,
        q, k, v, out, lse, probs_arg, desc_q, desc_k, desc_v,
        p.cu_seqlens_q if varlen else dummy, p.cu_seqlens_k if varlen else dummy,
        p.seqused_q if p.seqused_q is not None else dummy,
        p.seqused_k if p.seqused_k is not None else dummy,
        alibi if alibi is not None else dummy, sink,
        qk_scale, p.softcap, p.dropout_p, p.seed & 0xFFFFFFFF, (p.seed >> 32) & 0xFFFFFFFF,
        p.offset & 0xFFFFFFFF, p.window_left, p.window_right, chunk,
        seqlen_q, seqlen_k, h, h // h_k,
        sq_b, sq_m, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, so_b, so_m, so_h,
        lse_b, lse_h, alibi_stride_b, pb, ph, pm,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IS_VARLEN=varlen, HAS_SEQUSED_Q=p.seqused_q is not None, HAS_SEQUSED_K=p.seqused_k is not None,
        HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, HAS_SOFTCAP=p.softcap > 0,
        HAS_ALIBI=alibi is not None, HAS_DROPOUT=p.dropout_p > 0, RETURN_PROBS=want_probs, USE_TMA=tma,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEAVY_FIRST=settings.heavy_first,
        num_warps=num_warps, num_stages=num_stages, **edge_setting(arch, block_wide, max_k, q.element_size()),
        **extra,
    )
    return out, lse, probs


# Masked edge ranges (window start, causal diagonal, ragged key end) load directly instead of through the
# software pipeline, whose prologue runs even when a range is empty: on sm_90 for 2-byte inputs, per BLOCK_D,
# up to this many keys. Measured 3%-15% faster there and even or slower beyond (docs/forward.md,
# "Edge ranges load directly at short lengths").
EDGES_MAX_SEQLEN_K = {32: 2048, 64: 1024}


def edge_setting(arch: str, block_d: int, max_k: int, elem_bytes: int = 2) -> dict:
    """The launch's PIPELINE_EDGES: {} (pipelined, the kernel's default) or {"PIPELINE_EDGES": False}
    (direct); ``config.pipeline_edges`` forces either for every launch."""
    pipelined = config.get().pipeline_edges
    if pipelined is None:
        pipelined = not (arch == "sm90" and elem_bytes == 2 and max_k <= EDGES_MAX_SEQLEN_K.get(block_d, 0))
    return {} if pipelined else {"PIPELINE_EDGES": False}


def flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs as the benchmarks count them (halved for causal)."""
    return 4.0 * b * h * sq * sk * d / (2 if causal else 1)


