"""FP8 (e4m3) attention inputs: quantisation with per-(batch, kv head) scales, and dequantisation.

flashtile's fp8 forward (FlashAttention-3's API) takes ``torch.float8_e4m3fn`` q, k, v and fp32
``q_descale, k_descale, v_descale`` of shape ``(b, h_k)``: the attention is computed on
``x.float() * x_descale[batch, kv_head]``, where the descale of query head ``h`` is the entry of
its kv head ``h // (h / h_k)`` (as in FA3). :func:`quantize_qkv` produces all six tensors from
bf16/fp16/fp32 inputs in one call::

    q8, k8, v8, qd, kd, vd = flashtile.fp8.quantize_qkv(q, k, v)
    out = flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

Incoherent processing (``incoherent=True``, after QuIP# / FA3's paper) multiplies q and k by the
same random orthogonal matrix ``R`` before quantising. ``(q R)(k R)^T = q k^T`` exactly, but the
rotation spreads an outlier channel (one head-dim coordinate much larger than the rest, common in
real activations) over all coordinates, so the per-head amax shrinks relative to the typical
value and e4m3's 3 mantissa bits lose less. ``v`` is *not* rotated: a rotated ``v`` would rotate
the output (``out R``), which the caller would have to undo.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value; amax is mapped onto it

__all__ = ["E4M3_MAX", "FP8_DTYPE", "dequantize", "is_fp8", "quantize", "quantize_qkv", "random_rotation",
           "transpose_v", "v_keys_major"]


def is_fp8(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == FP8_DTYPE


def _batch_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Row -> sequence index of a varlen (total, ...) tensor (rows past cu_seqlens[-1] get the last)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)
    if ids.numel() < total:  # trailing rows outside every sequence: never read, but keep shapes valid
        ids = torch.cat([ids, ids.new_full((total - ids.numel(),), max(lens.numel() - 1, 0))])
    return ids[:total]


def _per_kv_head_amax(x: torch.Tensor, h_k: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """amax of |x| over everything but (batch, kv head): fp32 (b, h_k)."""
    h = x.shape[-2]
    a = x.detach().abs().float()
    if cu_seqlens is None:  # (b, s, h, d) -> (b, h_k)
        b, s = x.shape[:2]
        if s == 0:
            return a.new_zeros(b, h_k)
        return a.reshape(b, s, h_k, h // h_k, -1).amax(dim=(1, 3, 4))
    # varlen (total, h, d): per-row amax, then a segment max over each sequence's rows
    b = cu_seqlens.numel() - 1
    rows = a.reshape(a.shape[0], h_k, -1).amax(-1)  # (total, h_k)
    out = rows.new_zeros(b, h_k)
    ids = _batch_ids(cu_seqlens, rows.shape[0]).view(-1, 1).expand(-1, h_k)
    return out.scatter_reduce(0, ids, rows, reduce="amax", include_self=True)


def _expand(descale: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """(b, h_k) scales broadcast to x's (b, s, h, 1) / (total, h, 1) layout; query head h uses its kv head."""
    h, h_k = x.shape[-2], descale.shape[-1]
    per_head = descale.float().repeat_interleave(h // h_k, dim=-1)  # (b, h)
    if cu_seqlens is None:
        return per_head[:, None, :, None]
    return per_head[_batch_ids(cu_seqlens, x.shape[0])][:, :, None]


def quantize(x: torch.Tensor, h_k: int, *, cu_seqlens: torch.Tensor | None = None):
    """One tensor to e4m3 with per-(batch, kv head) amax scaling: returns ``(x8, descale (b, h_k))``.

    ``x`` is ``(b, s, h, d)`` (or varlen ``(total, h, d)`` with ``cu_seqlens``); ``h`` is a multiple of
    ``h_k``. ``descale = amax / 448`` (1 where the slice is all zeros), so ``x8.float() * descale``
    approximates ``x`` with e4m3's relative error (about 2**-4 per element).
    """
    amax = _per_kv_head_amax(x, h_k, cu_seqlens)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = x.float() / _expand(descale, x, cu_seqlens)
    # torch's cast does not saturate (out-of-range becomes NaN); rounding of amax/descale can land a
    # hair above 448, so clamp first
    x8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return x8, descale.contiguous()


def dequantize(x8: torch.Tensor, descale: torch.Tensor | None, *, cu_seqlens: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8.float() * descale[batch, kv_head_of(head)]`` in ``dtype``; ``descale=None`` means 1."""
    x = x8.to(torch.float32)
    if descale is not None:
        x = x * _expand(descale, x, cu_seqlens)
    return x.to(dtype)


def _hadamard(n: int, device) -> torch.Tensor:
    """Sylvester Hadamard matrix (n a power of two), entries +-1."""
    hmat = torch.ones(1, 1, device=device)
    while hmat.shape[0] < n:
        hmat = torch.cat([torch.cat([hmat, hmat], 1), torch.cat([hmat, -hmat], 1)], 0)
    return hmat


def random_rotation(d: int, *, seed: int = 0, device="cpu") -> torch.Tensor:
    """A random orthogonal fp32 ``(d, d)`` matrix: a Hadamard matrix with random column signs when
    ``d`` is a power of two (every coordinate mixes with every other one at equal weight), else the
    Q factor of a Gaussian matrix (Haar-distributed after the sign fix)."""
    gen = torch.Generator().manual_seed(seed)
    if d & (d - 1) == 0:
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        rot = signs[:, None] * _hadamard(d, "cpu") / d**0.5
    else:
        qmat, rmat = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        rot = (qmat * torch.sign(torch.diagonal(rmat))).float()
    return rot.to(device)


def transpose_v(v: torch.Tensor, varlen: bool) -> torch.Tensor:
    """V^T with the key index contiguous, copied: (b, h_k, d, sk) padded, (h_k, d, total_k) varlen.

    The fp8 wgmma takes its B operand K-major only; in ``P @ V`` the reduction runs over keys. The
    key dim is allocated rounded up to 16 elements so every stride is a 16-byte multiple (TMA); the
    returned view has the true length, so descriptors zero-fill past it and never read the padding.
    """
    n = v.shape[0] if varlen else v.shape[1]
    n_pad = (n + 15) // 16 * 16
    if varlen:
        vt = torch.empty(v.shape[1], v.shape[2], n_pad, device=v.device, dtype=v.dtype)[..., :n]
        vt.copy_(v.permute(1, 2, 0))
    else:
        vt = torch.empty(v.shape[0], v.shape[2], v.shape[3], n_pad, device=v.device, dtype=v.dtype)[..., :n]
        vt.copy_(v.permute(0, 2, 3, 1))
    return vt


def v_keys_major(v: torch.Tensor, varlen: bool) -> torch.Tensor:
    """V^T as the fp8 kernels read it: a free view when ``v`` already stores its keys contiguously with
    16-byte strides (the layout :func:`quantize_qkv` returns), else :func:`transpose_v`'s copy (a full
    read and write of V, about a quarter of the kernel's time at s = 4096; docs/fp8.md, "How it runs")."""
    vt = v.permute(1, 2, 0) if varlen else v.permute(0, 2, 3, 1)
    es = v.element_size()
    if vt.stride(-1) == 1 and vt.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in vt.stride()[:-1]):
        return vt
    return transpose_v(v, varlen)


def _keys_contiguous(v: torch.Tensor, varlen: bool) -> torch.Tensor:
    """``v`` (same shape, same values) stored with its keys contiguous: the fp8 kernels then read
    V^T as a view (:func:`v_keys_major`) instead of copying it on every call."""
    vt = transpose_v(v, varlen)
    return vt.permute(2, 0, 1) if varlen else vt.permute(0, 3, 1, 2)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, incoherent: bool = False, seed: int = 0,
                 cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None):
    """Quantise q, k, v to e4m3 for ``flash_attn_func`` / ``flash_attn_varlen_func``.

    q: ``(b, sq, h, d)``, k/v: ``(b, sk, h_k, d)`` (bf16, fp16 or fp32); varlen ``(total, h, d)``
    with ``cu_seqlens_q/k`` (int32 ``(b+1,)``, needed for the per-sequence scales). Returns
    ``(q8, k8, v8, q_descale, k_descale, v_descale)``: e4m3 tensors shaped like the inputs and fp32
    ``(b, h_k)`` descales. Each (batch, kv head) slice is scaled so its amax maps to 448; the query
    heads sharing a kv head share one scale (FA3's descale layout).

    ``incoherent=True`` rotates q and k by one random orthogonal matrix (``seed`` picks it) first:
    ``q k^T`` is unchanged in exact arithmetic and outlier channels stop dominating the scale. ``v`` is
    never rotated (the output would come back rotated).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or is_fp8(x):
            raise TypeError(f"flashtile.fp8.quantize_qkv: {name} must be a bf16/fp16/fp32 tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    if (cu_seqlens_q is None) != (q.dim() == 4) or (cu_seqlens_k is None) != (k.dim() == 4):
        raise ValueError("flashtile.fp8.quantize_qkv: 4-D (b, s, h, d) inputs take no cu_seqlens; 3-D varlen "
                         "(total, h, d) inputs need cu_seqlens_q and cu_seqlens_k")
    h_k = k.shape[-2]
    if q.shape[-2] % h_k != 0 or v.shape[-2] != h_k:
        raise ValueError(f"flashtile.fp8.quantize_qkv: q heads ({q.shape[-2]}) must be a multiple of k/v heads "
                         f"({h_k}, {v.shape[-2]})")
    if incoherent:
        if k.shape[-1] != q.shape[-1]:
            raise ValueError("flashtile.fp8.quantize_qkv: incoherent processing needs equal q/k head dims")
        rot = random_rotation(q.shape[-1], seed=seed, device=q.device)
        q = q.float() @ rot
        k = k.float() @ rot
    q8, qd = quantize(q, h_k, cu_seqlens=cu_seqlens_q)
    k8, kd = quantize(k, h_k, cu_seqlens=cu_seqlens_k)
    v8, vd = quantize(v, h_k, cu_seqlens=cu_seqlens_k)
    # v8 keeps its shape but stores the keys contiguously: the layout the fp8 matrix instruction
    # reads V in, so the attention call needs no transposing copy (it makes one for other layouts)
    return q8, k8, _keys_contiguous(v8, varlen=v.dim() == 3), qd, kd, vd
