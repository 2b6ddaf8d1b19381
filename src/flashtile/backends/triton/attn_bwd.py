"""Launcher of the backward: the delta preprocess, then the dK/dV kernel and the dQ kernel.

dK/dV comes from the Triton kernel (kernels/attn_bwd.py) or, on sm_90 where the Gluon route table says so,
from the Gluon kernel (gluon_bwd.py); dQ from the Triton kernel, launched with programmatic dependent launch
behind dK/dV where PDL_TABLE says so (docs/backward.md, "Kernel split"), or, under config.gluon_fused_dq, from
the Gluon kernel's fused build (gluon_bwd.use_fused_dq)."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton import config_files, gluon_bwd, gluon_route
from flashtile.backends.triton.attn_fwd import LOG2E
from flashtile.backends.triton.host import arch_of, capability, cdiv, device_guard, launch, next_pow2, run_kernel
from flashtile.kernels.attn_bwd import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
    bwd_config_keys,
    bwd_configs,
    split_dq_stages,
)
from flashtile.params import AttnParams

# Masked ranges load directly instead of through the software pipeline (as the forward's, attn_fwd.edge_setting)
# on sm_90 for 2-byte inputs at these BLOCK_D when no band (causal mask or local window) masks the scores: 1%-4%
# faster there; with a band, whose diagonal range holds several blocks a program, direct loads lost 10%-16%
# (docs/backward.md, "Edge ranges").
EDGES_DIRECT_BLOCK_D = (32, 64, 128)


def edge_setting(arch: str, block_d: int, banded: bool, elem_bytes: int, dropout: bool = False) -> dict:
    """The Triton backward launches' PIPELINE_EDGES: {} (pipelined, the kernels' default) or
    {"PIPELINE_EDGES": False} (direct); ``config.pipeline_edges`` forces either for every launch.

    With dropout the masked ranges always load directly: Triton 3.6's software pipeline of those ranges
    faults with "misaligned address" on sm_90 (varlen + dropout + causal at d = 128; direct loads run the
    same calls clean; docs/backward.md, "Edge ranges")."""
    pipelined = config.get().pipeline_edges
    if pipelined is None:
        pipelined = not (dropout or (arch == "sm90" and elem_bytes == 2 and block_d in EDGES_DIRECT_BLOCK_D
                                     and not banded))
    return {} if pipelined else {"PIPELINE_EDGES": False}


# Programmatic dependent launch of the dQ kernel behind the dK/dV kernel (sm_90+). The two read the same
# inputs and write different outputs, so dQ needs nothing from dK/dV: every dK/dV program signals at its
# start, the dQ grid is then scheduled onto the SMs the dK/dV grid's last wave leaves idle, and the dQ grid's
# last program waits for the dK/dV grid at its end (so the stream's later work sees both done).
# Where it measured faster (1%-4%; docs/backward.md, "The dQ launch behind dK/dV"), per (head-dim bucket,
# plain causal mask): the shortest and longest sequence (max of sq, sk) that take it. Other head dims take
# their bucket's row; banded windows count as not causal.
PDL_TABLE = {
    (64, False): (0, None),
    (64, True): (0, None),
    (128, False): (0, 1024),
    (128, True): (2048, 4096),
    (256, False): (0, None),
    (256, True): (2048, None),
}
# the compute capabilities the table was measured on (NVIDIA only: a ROCm MI300 also reports 9.x)
PDL_CAPABILITIES = ((9, 0),)


def pdl_preferred(d: int, causal: bool, seqlen: int) -> bool:
    """Does PDL_TABLE take the dQ kernel's programmatic dependent launch for this call?"""
    bucket = 64 if d <= 64 else 128 if d <= 128 else 256
    lo, hi = PDL_TABLE[(bucket, causal)]
    return seqlen >= lo and (hi is None or seqlen <= hi)


def use_bwd_pdl(q: torch.Tensor, causal: bool, seqlen: int) -> bool:
    """Launch the dQ kernel behind the dK/dV kernel? (``seqlen``: the longer of the query and key
    lengths; ``causal``: the mask is plain causal). ``config.bwd_pdl`` forces it on (any sm_90+
    NVIDIA GPU) or off."""
    if q.device.type != "cuda" or torch.version.hip is not None:
        return False
    cap = capability(q.device)
    forced = config.get().bwd_pdl
    if forced is not None:
        return forced and cap[0] >= 9
    return cap in PDL_CAPABILITIES and pdl_preferred(q.shape[-1], causal, seqlen)




def _parse_row(key: str, cfgs) -> tuple:
    parts = key.split(",")
    ok = (2 <= len(parts) <= 4 and parts[1].isdigit()
          and (len(parts) < 3 or parts[2] in ("True", "False"))
          and (len(parts) < 4 or parts[3] == "short"))
    if not ok:
        raise ValueError(f"FLASHTILE_BWD_CONFIGS: bad key {key!r}; expected "
                         f"'arch,bucket[,True|False[,short]]', e.g. 'sm90,128,True,short'")
    kv_cfg, q_cfg = cfgs
    parsed = (parts[0], int(parts[1]), *([parts[2] == "True"] if len(parts) > 2 else []), *parts[3:])
    return parsed, (tuple(kv_cfg), tuple(q_cfg))


def config_overrides() -> dict:
    """BWD_CONFIGS rows from the JSON file named by ``config.bwd_configs`` (FLASHTILE_BWD_CONFIGS), if any.

    The file maps "arch,bucket[,causal[,short]]" (e.g. "sm90,128" or "sm90,128,True,short") to
    [[dkdv BM, BN, warps, stages], [dq ...]]. Read once per file name.
    """
    return config_files.load(config.get().bwd_configs, _parse_row)


def _strides3(x: torch.Tensor, varlen: bool):
    """(batch, row, head) strides; varlen tensors have no batch dim (the kernels add cu_seqlens)."""
    st = x.stride()  # one call: each stride(i) call costs host time on the launch path
    return (0, st[0], st[1]) if varlen else st[:3]


def dq_head_dims(d: int, dv: int) -> dict:
    """The dQ kernel's head-dim constexprs: past 128, a q / k head dim that is not a power of two (DeepSeek-V3's
    192) runs as a power-of-two tile and a tail tile (128 + 64) rather than one tile padded to the next power of
    two (256, a quarter zeros in QK^T and dS K). v's head dim is then always named (it defaults to HEAD_DIM)."""
    if d <= 128 or d & (d - 1) == 0:
        return dict(HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)))
    lead = 1 << (d.bit_length() - 1)
    return dict(HEAD_DIM=lead, BLOCK_D=lead, HEAD_DIM_TAIL=d - lead, BLOCK_DT=max(16, next_pow2(d - lead)),
                HEAD_DIM_V=dv, BLOCK_DV=max(16, next_pow2(dv)))


def attn_bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    """Write dq, dk, dv (possibly strided views into packed buffers) for saved q, k, v, out, lse."""
    with device_guard(q):
        _attn_bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


def _attn_bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    varlen = p.varlen  # a property: read once
    d, dv_dim = q.shape[-1], v.shape[-1]
    h, h_k = q.shape[-2], k.shape[-2]
    block_d = max(16, next_pow2(d))
    block_dv = max(16, next_pow2(dv_dim))
    # the tables are keyed by one head-dim bucket: the wider of q/k's and v's tiles sets the shared memory
    block_wide = max(block_d, block_dv)
    max_seqlen = max(p.max_seqlen_q, p.max_seqlen_k) if varlen else max(q.shape[1], k.shape[1])
    arch = arch_of(q.device)
    settings = config.get()
    overrides = config_overrides()
    (bm_kv, bn_kv, w_kv, s_kv), (bm_q, bn_q, w_q, s_q) = settings.bwd_tiles or bwd_configs(
        arch, block_wide, overrides, p.causal, max_seqlen)
    dq_dims = dq_head_dims(d, dv_dim)
    # the split dQ tile has room for a deeper pipeline than the padded 256-column row's (kernels/attn_bwd.py); a row
    # the caller set (config.bwd_tiles, FLASHTILE_BWD_CONFIGS) is taken as it is
    if "HEAD_DIM_TAIL" in dq_dims and not (settings.bwd_tiles or any(
            key in overrides for key in bwd_config_keys(arch, block_wide, p.causal, max_seqlen))):
        s_q = split_dq_stages(arch, block_dv, s_q, q.element_size())
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
    # delta = rowsum(dO * O) runs over v's head dim
    run_kernel(_attn_bwd_preprocess_kernel, (cdiv(max(seqlen_q, 1), pre_m) * b * h,),
        out, dout, delta, cu_q, used_q, seqlen_q, h, *so, *sdo, lse_b, lse_h,
        HEAD_DIM=dv_dim, BLOCK_M=pre_m, BLOCK_D=block_dv, IS_VARLEN=varlen, HAS_SEQUSED_Q=p.seqused_q is not None)

    qk_scale = p.softmax_scale / p.softcap if p.softcap > 0 else p.softmax_scale * LOG2E
    # the learnable sink needs nothing here: lse includes it (kernels/attn_bwd.py). attention_chunk is None
    # without a chunk: a None argument is a constexpr, so such calls compile to the plain kernels
    chunk = p.attention_chunk if p.attention_chunk > 0 else None
    common = (qk_scale, p.softcap, p.dropout_p, p.seed & 0xFFFFFFFF, (p.seed >> 32) & 0xFFFFFFFF,
              p.offset & 0xFFFFFFFF, p.window_left, p.window_right, chunk, p.softmax_scale)
    sq_, sk_, sv_ = _strides3(q, varlen), _strides3(k, varlen), _strides3(v, varlen)
    feature_flags = dict(HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, HAS_SOFTCAP=p.softcap > 0,
                         HAS_ALIBI=p.alibi_slopes is not None, HAS_DROPOUT=p.dropout_p > 0,
                         DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if dv_dim != d:
        feature_flags.update(HEAD_DIM_V=dv_dim, BLOCK_DV=block_dv)
    if chunk is not None:
        feature_flags["HAS_CHUNK"] = True
    # a chunk bands the scores as a window does
    feature_flags.update(edge_setting(arch, block_wide, p.window_left >= 0 or p.window_right >= 0 or chunk is not None,
                                      q.element_size(), p.dropout_p > 0))
    # the Gluon dK/dV kernel where its route table takes the call (gluon_bwd.py), else the Triton one
    gluon_dkdv = gluon_bwd.use_gluon_bwd(q, k, v, dout, dk, dv, p)
    # the rule's "causal" is the plain causal mask, as the Gluon route's (a banded window is not)
    pdl = use_bwd_pdl(q, p.window_right == 0 and p.window_left < 0, max_seqlen)
    if gluon_dkdv:
        # the fused build adds dQ into an fp32 buffer (no dQ kernel follows): gluon_bwd.use_fused_dq
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if gluon_bwd.use_fused_dq(
            q, v, p) else None
        gluon_bwd.gluon_attn_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, p.softmax_scale, p.window_right == 0,
                                      launch_dependents=pdl and dq_accum is None, window_left=p.window_left,
                                      cu_seqlens=p.cu_seqlens_q if varlen else None, max_seqlen=p.max_seqlen_q,
                                      softcap=p.softcap, alibi_slopes=p.alibi_slopes, **gluon_route.own_k(p),
                                      dq_accum=dq_accum)
        if dq_accum is not None:
            dq.copy_(dq_accum)  # scaled by the kernel: one cast pass
            return
    else:
        launch(
            _attn_bwd_dkdv_kernel, (cdiv(max(seqlen_k, 1), bn_kv) * b * h_k,),
            q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, used_q, used_k, alibi,
            *common, seqlen_q, seqlen_k, h, h_k, h // h_k, *sq_, *sk_, *sv_, *sdo,
            *_strides3(dk, varlen), *_strides3(dv, varlen), lse_b, lse_h, alibi_b,
            HEAD_DIM=d, BLOCK_M=bm_kv, BLOCK_N=bn_kv, BLOCK_D=block_d, **flags, **feature_flags,
            num_warps=w_kv, num_stages=s_kv, **({"LAUNCH_DEPENDENTS": True} if pdl else {}))
    launch(
        _attn_bwd_dq_kernel, (cdiv(max(seqlen_q, 1), bm_q) * b * h,),
        q, k, v, dout, lse, delta, dq, cu_q, cu_k, used_q, used_k, alibi, *common,
        seqlen_q, seqlen_k, h, h // h_k, *sq_, *sk_, *sv_, *sdo, *_strides3(dq, varlen), lse_b, lse_h, alibi_b,
        BLOCK_M=bm_q, BLOCK_N=bn_q, **flags, **{**feature_flags, **dq_dims},
        HEAVY_FIRST=settings.heavy_first, num_warps=w_q, num_stages=s_q,
        **({"WAIT_AT_END": True, "launch_pdl": True} if pdl else {}))
