"""Launchers of the Gluon Hopper forward kernels (the route that picks them: gluon_route.py).

``gluon_attn_fwd(q, k, v, softmax_scale, causal) -> (out, lse)`` with FlashAttention's layout:
q, k (batch, seqlen, heads, head_dim), v (batch, seqlen, heads, head_dim_v) bf16 or fp16, out
(batch, seqlen, heads, head_dim_v), lse (batch, heads, seqlen) fp32 in natural log. ``V_HEAD_DIMS``
lists the head-dim pairs; a q / k head dim that is not a power of two (192) reaches the kernel as two
column ranges (``head_dim_split``).

``gluon_attn_fwd_fp8(q, k, v_t, q_descale, k_descale, v_descale, softmax_scale, causal)`` takes
e4m3 q, k and V^T as ``transpose_v`` (backends/triton/attn_fwd_fp8.py) makes it, and returns bf16
out and the lse, with the Triton fp8 kernel's semantics. See docs/gluon.md for what the kernels do
and do not cover.

Both take ``config=`` (a dict with any of BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps) to override
the table entry ``fwd_config(head_dim, causal, dtype)``; tests and scripts/tune_gluon.py use it.
"""

from __future__ import annotations

import functools
import math

import torch

from flashtile.backends.triton.host import capability, cdiv, device_guard, run_kernel

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)  # the fp8 kernel's
# bf16 / fp16: q / k's head dim -> the v head dims the kernel takes with it (shared memory is sized per
# q / k head dim in FWD_CONFIGS, for the v head dim listed)
V_HEAD_DIMS = {64: (64,), 128: (128,), 192: (128,), 256: (256,)}
DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn


def _check_tma(fn: str, name: str, x: torch.Tensor) -> None:
    """TMA reads through a descriptor: unit last stride, 16-byte aligned base and other strides."""
    es = x.element_size()
    if x.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} needs a unit stride in its last dimension")
    if x.data_ptr() % 16 or any((s * es) % 16 for s in x.stride()[:-1]):
        raise ValueError(f"{fn}: {name} needs a 16-byte aligned base and strides (TMA), got strides "
                         f"{tuple(x.stride())}")


def head_dim_split(d: int) -> tuple[int, int]:
    """(leading, tail) column ranges of a q / k head dim: Gluon tiles are powers of two, so 192 is 128 + 64
    (tail 0: d itself is a power of two)."""
    lead = 1 << (d.bit_length() - 1)
    return lead, d - lead


def _check_shapes(fn: str, q: torch.Tensor, k: torch.Tensor, dims=HEAD_DIMS,
                  equal_lengths: bool = True) -> tuple[int, int, int, int, int]:
    b, sq, h, d = q.shape
    bk, sk, h_k, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch or head_dim")
    if equal_lengths and sq != sk:
        raise ValueError(f"{fn}: needs seqlen_q == seqlen_k, got {sq} and {sk}")
    if d not in dims:
        raise ValueError(f"{fn}: head_dim must be one of {tuple(dims)}, got {d}")
    if h_k == 0 or h % h_k:
        raise ValueError(f"{fn}: heads of q ({h}) must be a multiple of heads of k/v ({h_k})")
    return b, sq, h, h_k, d


def _check_device(fn: str, tensors: dict) -> None:
    dev = next(iter(tensors.values())).device
    for name, x in tensors.items():
        if x.device.type != "cuda":
            raise ValueError(f"{fn}: CUDA tensors only, {name} is on {x.device}")
        if x.device != dev:
            raise ValueError(f"{fn}: all tensors must be on one device ({name} is on {x.device}, not {dev})")
    major_minor = capability(dev)
    if major_minor != (9, 0):
        # wgmma exists on sm_90(a) only: Blackwell dropped it for tcgen05, Ampere never had it
        raise ValueError(f"{fn}: needs a Hopper GPU (sm_90), got sm_{major_minor[0]}{major_minor[1]}")


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    fn = "gluon_attn_fwd"
    # what the inputs are first, where they live second: the former is checkable without a GPU
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor")
        if x.dtype not in DTYPES:
            raise ValueError(f"{fn}: bf16 or fp16 only, {name} is {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{fn}: {name} must be (batch, seqlen, heads, head_dim), got {tuple(x.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_shapes(fn, q, k, V_HEAD_DIMS, equal_lengths=False)
    if k.shape[:-1] != v.shape[:-1] or v.shape[-1] not in V_HEAD_DIMS[q.shape[-1]]:
        raise ValueError(f"{fn}: v {tuple(v.shape)} must match k {tuple(k.shape)} but in its head dim, one of "
                         f"{V_HEAD_DIMS[q.shape[-1]]} with q / k's {q.shape[-1]}")
    _check_device(fn, dict(q=q, k=k, v=v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tma(fn, name, x)


def _check_alibi(slopes, b: int, h: int, fn: str = "gluon_attn_fwd") -> None:
    if (not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or slopes.shape not in ((h,), (b, h))
            or slopes.stride(-1) != 1 or slopes.device.type != "cuda"):
        got = (f"{slopes.dtype} {tuple(slopes.shape)} on {slopes.device}" if isinstance(slopes, torch.Tensor)
               else type(slopes).__name__)
        raise ValueError(f"{fn}: alibi_slopes must be a CUDA fp32 ({h},) or ({b}, {h}) tensor with a unit "
                         f"last stride, got {got}")


def _validate_fp8(q, k, v_t, descales) -> None:
    fn = "gluon_attn_fwd_fp8"
    for name, x in (("q", q), ("k", k), ("v_t", v_t)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor")
        if x.dtype != FP8_DTYPE:
            raise ValueError(f"{fn}: {name} must be float8_e4m3fn, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D, got {tuple(x.shape)}")
    b, s, h, h_k, d = _check_shapes(fn, q, k)
    if tuple(v_t.shape) != (b, h_k, d, s):
        raise ValueError(f"{fn}: v_t must be V transposed, (b, h_k, d, seqlen) = {(b, h_k, d, s)}, got "
                         f"{tuple(v_t.shape)} (make it with attn_fwd_fp8.transpose_v(v, varlen=False))")
    for name, x in descales.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != (b, h_k):
            raise ValueError(f"{fn}: {name} must be fp32 of shape (batch, kv heads) = {(b, h_k)}, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    _check_device(fn, dict(q=q, k=k, v_t=v_t, **{n: x for n, x in descales.items() if x is not None}))
    for name, x in (("q", q), ("k", k), ("v_t", v_t)):
        _check_tma(fn, name, x)


def _gl_dtype(dtype: torch.dtype):
    import triton.experimental.gluon.language as gl

    # fp32: the fused backward's dQ buffer (gluon_bwd.py)
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8_DTYPE: gl.float8e4nv,
            torch.float32: gl.float32}[dtype]


@functools.lru_cache(maxsize=64)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    # a pure function of (block, dtype), and building it costs tens of microseconds of Python per
    # call (four descriptors per forward call)
    import triton.experimental.gluon.language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(x: torch.Tensor, block: list[int]):
    """A Gluon tensor descriptor of ``x`` with boxes ``block``. Its constructor's checks (alignment, strides, box
    shape) are skipped: every caller has made them already (``_check_tma`` / ``tma_ok``, the config checks, no
    empty tensor), and at four descriptors a call they cost tens of microseconds of host time."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape = x, list(x.shape), list(x.stride()), block
    desc.layout, desc.padding = _smem_layout(tuple(block), x.dtype), "zero"
    return desc


def _resolve_config(d: int, causal: bool, dtype: torch.dtype, config: dict | None) -> dict:
    from flashtile.kernels.gluon_fwd import CONFIG_KEYS, fwd_config

    cfg = fwd_config(d, causal, dtype)
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"gluon fwd: unknown config keys {sorted(unknown)} (known: {CONFIG_KEYS})")
        cfg.update({key: int(val) for key, val in config.items()})
    bm, bn, nb, nw = (cfg[key] for key in CONFIG_KEYS)
    # one warpgroup per 64 query rows; power-of-two tiles (Gluon tensors); rings of >= 2 slots
    if bm % 64 or nw != 4 * (bm // 64) or bn & (bn - 1) or not 32 <= bn <= 256 or bm & (bm - 1) or nb < 2:
        raise ValueError(f"gluon fwd: invalid config {cfg} (BLOCK_M a power of two multiple of 64 with "
                         "num_warps = BLOCK_M / 16, BLOCK_N a power of two in [32, 256], NUM_BUFFERS >= 2)")
    return cfg


def _sizes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    b, s, h, d = q.shape
    return b, s, h, k.shape[2], d


def _prepare(q: torch.Tensor, softmax_scale: float | None, causal: bool, config: dict | None,
             out_dtype: torch.dtype, dv: int):
    """What both launchers set up after validation: the scale (default 1/sqrt(d)), the config,
    out (b, s, h, dv) in out_dtype and lse (b, h, s) fp32."""
    b, s, h, d = q.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    cfg = _resolve_config(d, causal, q.dtype, config)
    out = torch.empty((b, s, h, dv), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    return softmax_scale, cfg, out, lse


def own_k_sequences(cu_seqlens, cu_seqlens_k, seqused_k) -> bool:
    """Does a packed call's k have sequences of its own (a different cu_seqlens_k, or keys cut by seqused_k)?"""
    return cu_seqlens is not None and ((cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens)
                                       or seqused_k is not None)


def key_counts(cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's key count (b,) int32: cu_seqlens_k's differences, at most seqused_k (as the Triton kernels
    read it). The kernels read it where they need it rather than keep it in a register."""
    counts = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return counts if seqused_k is None else torch.minimum(counts, seqused_k)


def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                   causal: bool = False, config: dict | None = None, learnable_sink: torch.Tensor | None = None,
                   window_left: int = -1, softcap: float = 0.0, cu_seqlens: torch.Tensor | None = None,
                   max_seqlen: int = 0, alibi_slopes: torch.Tensor | None = None,
                   cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int = 0,
                   seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on Hopper through the Gluon kernel; returns (out, lse).

    Padded: q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv); sq != sk aligns causal masks and windows
    bottom-right (FlashAttention's rule: row r's diagonal key is r + sk - sq), causal needing sk >= sq.
    Varlen: q, k (total, h, d), v (total, h_k, dv) packed sequences with ``cu_seqlens`` (b + 1,) int32, the
    same for q and k, and ``max_seqlen`` their longest; out (total, h, dv), lse (h, total). With
    ``cu_seqlens_k`` (b + 1,) int32 k and v (total_k, h_k, ...) have sequences of their own (``max_seqlen_k`` the
    longest), optionally cut to ``seqused_k`` (b,) int32 keys each; masks align bottom-right per sequence and a
    row that sees no key gets out 0 and lse +inf (no window, ALiBi or sink there).

    ``learnable_sink``: (h,) fp32 or q's dtype, one logit per query head joining every row's
    denominator (lse includes it). ``window_left`` >= 0 (with ``causal``): a causal sliding window, each
    row seeing its own key and the ``window_left`` keys before it. ``softcap`` > 0: scores capped to
    ``softcap * tanh(score / softcap)`` (FlashAttention's softcap, applied before the mask). ``alibi_slopes``:
    fp32 (h,) or (b, h) with ``causal``, each score biased by ``-slope * |row - key|`` (after the softcap).

    Raises ValueError for what the kernel does not cover: non-CUDA tensors, dtypes other than
    bf16 / fp16, head dims other than ``V_HEAD_DIMS``' pairs, causal with seqlen_k < seqlen_q, a GPU other than
    sm_90, TMA-unfriendly strides.
    """
    varlen = cu_seqlens is not None
    varlen_k = own_k_sequences(cu_seqlens, cu_seqlens_k, seqused_k)
    if varlen_k:
        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        for name, x, n in (("cu_seqlens_k", cu_seqlens_k, cu_seqlens.numel()),
                           ("seqused_k", seqused_k, cu_seqlens.numel() - 1)):
            if x is not None and (x.dtype != torch.int32 or x.dim() != 1 or x.numel() != n or x.stride(0) != 1):
                raise ValueError(f"gluon_attn_fwd: {name} must be a contiguous int32 ({n},) tensor, got {x.dtype} "
                                 f"{tuple(x.shape)}")
        if window_left >= 0 or alibi_slopes is not None or learnable_sink is not None:
            raise ValueError("gluon_attn_fwd: k's own cu_seqlens / seqused_k take no window, alibi_slopes or "
                             "learnable_sink (the Triton kernel's)")
    if varlen:
        if q.dim() != 3 or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or max_seqlen <= 0:
            raise ValueError("gluon_attn_fwd: varlen takes (total, heads, head_dim) q / k / v, cu_seqlens (b + 1,) "
                             f"int32 and max_seqlen > 0; got q {tuple(q.shape)}, cu_seqlens "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}, max_seqlen {max_seqlen}")
        # one sequence of all the tokens to the descriptors; the kernel finds each sequence in cu_seqlens
        q, k, v = q[None], k[None], v[None]
    _validate(q, k, v)
    if window_left >= 0 and not causal:
        raise ValueError("gluon_attn_fwd: window_left needs causal=True (the kernel's windows are causal ones)")
    if causal and not varlen_k and k.shape[1] < q.shape[1]:
        raise ValueError(f"gluon_attn_fwd: causal needs seqlen_k >= seqlen_q (bottom-right alignment leaves the first "
                         f"{q.shape[1] - k.shape[1]} rows no key), got {q.shape[1]} and {k.shape[1]}")
    b, s, h, h_k, d = _sizes(q, k)
    if varlen:
        b = cu_seqlens.numel() - 1
    if alibi_slopes is not None:
        if not causal:
            raise ValueError("gluon_attn_fwd: alibi_slopes needs causal=True (the kernel's ALiBi is causal)")
        _check_alibi(alibi_slopes, b, h)
    dv = v.shape[-1]
    softmax_scale, cfg, out, lse = _prepare(q, softmax_scale, causal, config, q.dtype, dv)
    if varlen:
        b, s = cu_seqlens.numel() - 1, max_seqlen
    if out.numel() == 0 or b == 0:
        return (out[0], lse[0]) if varlen else (out, lse)
    if varlen_k and k.shape[1] == 0:  # no key in any sequence: every row sees nothing (no descriptor over 0 rows)
        return out[0].zero_(), lse[0].fill_(float("inf"))

    from flashtile.kernels.gluon_fwd import _gluon_attn_fwd_kernel

    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    lead, tail = head_dim_split(d)
    kv_lens = key_counts(cu_seqlens_k, seqused_k) if varlen_k else None
    # a split head dim reads two column ranges (views); unsplit, the tensors themselves (no per-call slicing),
    # and the kernel, which never reads its tail descriptors, gets the first ones again
    desc_q = _descriptor(q[..., :lead] if tail else q, [1, bm, 1, lead])
    desc_k = _descriptor(k[..., :lead] if tail else k, [1, bn, 1, lead])
    desc_q2 = _descriptor(q[..., lead:], [1, bm, 1, tail]) if tail else desc_q
    desc_k2 = _descriptor(k[..., lead:], [1, bn, 1, tail]) if tail else desc_k
    grid = (cdiv(s, bm), b * h)
    with device_guard(q):
        run_kernel(_gluon_attn_fwd_kernel, grid,
            desc_q, desc_q2, desc_k, desc_k2, _descriptor(v, [1, bn, 1, dv]), _descriptor(out, [1, bm, 1, dv]),
            # varlen: the lse is (1, h, total), indexed by head and packed row (no batch stride)
            lse, lse if learnable_sink is None else learnable_sink, 0 if varlen else lse.stride(0), lse.stride(1),
            s, h, h // h_k, softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E, max(window_left, 0),
            softcap * LOG2E, cu_seqlens if varlen else lse, out, out.stride(1), out.stride(2),
            lse if alibi_slopes is None else alibi_slopes,
            alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
            max_seqlen_k if varlen_k else s if varlen else k.shape[1], cu_seqlens_k if varlen_k else lse,
            kv_lens if varlen_k else lse,
            HEAD_DIM=lead, HEAD_DIM_TAIL=tail, HEAD_DIM_V=dv, BLOCK_M=bm, BLOCK_N=bn,
            NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal), HAS_SINK=learnable_sink is not None,
            num_warps=cfg["num_warps"], **({"LOCAL": True} if window_left >= 0 else {}),
            **({"SOFTCAP": True} if softcap > 0 else {}), **({"VARLEN": True} if varlen else {}),
            **({"ALIBI": True} if alibi_slopes is not None else {}),
            **({"UNEQUAL": True} if not varlen and k.shape[1] != q.shape[1] else {}),
            **({"VARLEN_K": True} if varlen_k else {}))
    return (out[0], lse[0]) if varlen else (out, lse)


def gluon_attn_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, q_descale: torch.Tensor | None = None,
                       k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                       softmax_scale: float | None = None, causal: bool = False,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 (e4m3) attention forward on Hopper through the Gluon kernel; returns (out bf16, lse fp32).

    q (b, s, h, d), k (b, s, h_k, d) float8_e4m3fn; v_t = ``transpose_v(v, varlen=False)``, shape
    (b, h_k, d, s) with the keys contiguous (a view into a buffer padded to 16 keys); descales fp32
    (b, h_k) or None (= 1). Computes attention over ``x.float() * x_descale[b, kv_head]`` exactly as
    the Triton fp8 kernel does (P rounded to e4m3 with the row max at 256, v_descale at the end).
    Raises ValueError for anything else (dtypes, shapes, head_dim not 64 / 128 / 256, non-sm_90, TMA
    strides).
    """
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _validate_fp8(q, k, v_t, descales)
    b, s, h, h_k, d = _sizes(q, k)
    softmax_scale, cfg, out, lse = _prepare(q, softmax_scale, causal, config, torch.bfloat16, d)
    if out.numel() == 0:
        return out, lse

    from flashtile.kernels.gluon_fwd_fp8 import _gluon_attn_fwd_fp8_kernel

    # the kernel indexes descales as b * h_k + kv_head
    ds = [x.contiguous() if x is not None else None for x in (q_descale, k_descale, v_descale)]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (cdiv(s, bm), b * h)
    with device_guard(q):
        run_kernel(_gluon_attn_fwd_fp8_kernel, grid,
            _descriptor(q, [1, bm, 1, d]), _descriptor(k, [1, bn, 1, d]), _descriptor(v_t, [1, 1, d, bn]),
            _descriptor(out, [1, bm, 1, d]), lse, *(x if x is not None else lse for x in ds),
            lse.stride(0), lse.stride(1), s, h, h // h_k, softmax_scale * LOG2E,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=cfg["NUM_BUFFERS"], CAUSAL=bool(causal),
            HAS_Q_DESCALE=ds[0] is not None, HAS_K_DESCALE=ds[1] is not None, HAS_V_DESCALE=ds[2] is not None,
            num_warps=cfg["num_warps"])
    return out, lse
