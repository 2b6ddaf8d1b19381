"""Rotary position embeddings (RoPE) with the API of FlashAttention 2.8.3's ``flash_attn.layers.rotary``.

Shapes: ``b`` batch, ``s`` sequence length, ``h`` heads, ``d`` head dim, ``rotary_dim`` the number of
leading channels that are rotated (even, ``<= d``), ``seqlen_ro`` the length of the cos/sin tables.

Channel pairs: ``interleaved=False`` (GPT-NeoX) pairs channel ``i`` with ``i + rotary_dim/2``;
``interleaved=True`` (GPT-J) pairs ``2i`` with ``2i+1``. A token at position ``p`` has its pair
``(x0, x1)`` replaced by ``(x0*cos[p] - x1*sin[p], x0*sin[p] + x1*cos[p])``. Positions are the
token's index in its sequence plus ``seqlen_offsets`` (an int, or an int32 ``(b,)`` tensor giving
one offset per sequence, as in decoding with a KV cache). A position ``>= seqlen_ro`` is left
unrotated, as FlashAttention's kernel does.

Backends: CUDA tensors run the Triton kernel (``flashtile.kernels.rotary``); CPU tensors run the
same math in PyTorch (``flashtile.backends.reference_rotary``), or the Triton kernel in Triton's
interpreter when ``FLASHTILE_INTERPRET=1``.
The backward of a rotation is the rotation by the opposite angle, so gradients reuse the forward.
"""

from __future__ import annotations

import torch

from flashtile.backends.reference_rotary import rotary_torch as _rotary_torch
from flashtile.dispatch import interpret_requested
from flashtile.first_order import first_order

__all__ = [
    "ApplyRotaryEmb",
    "ApplyRotaryEmbKV_",
    "ApplyRotaryEmbQKV_",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


def _use_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or (x.device.type == "cpu" and interpret_requested())


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen) -> None:
    """Argument checks that need no host-device sync; errors name the argument."""
    varlen = cu_seqlens is not None
    if x.dim() != (3 if varlen else 4):
        want = "(total, h, d) with cu_seqlens" if varlen else "(b, s, h, d)"
        raise ValueError(f"flashtile: x must be {want}, got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"flashtile: cos and sin must both be (seqlen_ro, rotary_dim / 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"flashtile: cos/sin must be on x's device {x.device}, got {cos.device}/{sin.device}")
    if not cos.is_floating_point() or cos.dtype != sin.dtype:
        raise TypeError(f"flashtile: cos and sin must be floating point tensors of one dtype, got cos {cos.dtype} "
                        f"and sin {sin.dtype}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"flashtile: rotary_dim (2 * cos.shape[1] = {rotary_dim}) must be <= head dim "
                         f"{x.shape[-1]}")
    if varlen:
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise TypeError(f"flashtile: cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} "
                            f"{tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != x.device:
            raise ValueError(f"flashtile: cu_seqlens must be on x's device {x.device}, got {cu_seqlens.device}")
        if max_seqlen is None:
            raise ValueError("flashtile: max_seqlen is required with cu_seqlens")
        batch = cu_seqlens.numel() - 1
    else:
        batch = x.shape[0]
        if isinstance(seqlen_offsets, int) and x.shape[1] + seqlen_offsets > cos.shape[0]:
            raise ValueError(f"flashtile: seqlen ({x.shape[1]}) + seqlen_offsets ({seqlen_offsets}) exceeds the "
                             f"cos/sin table length {cos.shape[0]}")
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64) or seqlen_offsets.shape != (batch,):
            raise TypeError(f"flashtile: seqlen_offsets must be an int or an int32 ({batch},) tensor, got "
                            f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ValueError(f"flashtile: seqlen_offsets must be on x's device {x.device}, got "
                             f"{seqlen_offsets.device}")


def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False,
                 inplace=False, conjugate=False):
    """Rotate x without autograd; picks the Triton kernel or the PyTorch path (module docstring)."""
    if x.numel() == 0 or cos.shape[1] == 0:
        return x if inplace else x.clone()
    if _use_triton(x):
        from flashtile.backends.triton.rotary import rotary_fwd

        if x.stride(-1) != 1:
            if inplace:
                raise ValueError("flashtile: inplace rotary needs x with a contiguous last dim")
            x = x.contiguous()
        return rotary_fwd(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate)
    return _rotary_torch(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, inplace, conjugate)


class ApplyRotaryEmb(torch.autograd.Function):
    """Autograd for :func:`apply_rotary_emb` (no gradient for cos/sin, as in FlashAttention)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
        if isinstance(seqlen_offsets, torch.Tensor):
            ctx.save_for_backward(cos, sin, cu_seqlens, seqlen_offsets)
            ctx.seqlen_offsets = None
        else:
            ctx.save_for_backward(cos, sin, cu_seqlens)
            ctx.seqlen_offsets = seqlen_offsets
        ctx.interleaved, ctx.inplace, ctx.max_seqlen = interleaved, inplace, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, do):
        if ctx.seqlen_offsets is None:
            cos, sin, cu_seqlens, seqlen_offsets = ctx.saved_tensors
        else:
            cos, sin, cu_seqlens = ctx.saved_tensors
            seqlen_offsets = ctx.seqlen_offsets
        # rotating back is rotating by -angle; never write into the incoming gradient (autograd may
        # share it with other consumers), so the in-place variant only reuses a private copy
        (dx,) = first_order(lambda: (apply_rotary(do, cos, sin, seqlen_offsets, cu_seqlens, ctx.max_seqlen,
                                                  ctx.interleaved, inplace=False, conjugate=True),), do,
                            what="rotary")
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Apply rotary embeddings to the first ``rotary_dim`` channels of x.

    Args:
        x: (b, s, h, d), or (total, h, d) when ``cu_seqlens`` is given.
        cos, sin: (seqlen_ro, rotary_dim / 2); rotary_dim <= d.
        interleaved: pair channels (2i, 2i+1) (GPT-J) instead of (i, i + rotary_dim/2) (GPT-NeoX).
        inplace: write the result into x (x is returned); the autograd graph records the change.
        seqlen_offsets: int, or int32 (b,) tensor: each sequence's first position (KV-cache decoding).
        cu_seqlens: int32 (b + 1,) for varlen x; positions restart at 0 for each sequence.
        max_seqlen: the longest sequence of a varlen batch (Python int).

    Returns:
        (b, s, h, d) or (total, h, d), x's dtype; channels past rotary_dim are copied unchanged.
    """
    _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


# FlashAttention exports the same function under this name too
apply_rotary_emb_func = apply_rotary_emb


def _qk_view(qkv: torch.Tensor, num_heads_q: int | None):
    """(q, k) views of a packed qkv: (b, s, 3, h, d) or (b, s, h_q + 2*h_k, d) with num_heads_q."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"flashtile: qkv must be (b, s, 3, h, d), got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError("flashtile: qkv must be (b, s, 3, h, d), or (b, s, h_q + 2*h_k, d) with num_heads_q")
    h_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q + 2 * h_k != qkv.shape[2]:
        raise ValueError(f"flashtile: qkv has {qkv.shape[2]} heads, not num_heads_q ({num_heads_q}) + 2 * h_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + h_k]


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """In-place rotation of the q and k parts of a packed qkv (v untouched)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                num_heads_q=None):
        cos_k = cos if cos_k is None else cos_k
        sin_k = sin if sin_k is None else sin_k
        q, k = _qk_view(qkv, num_heads_q)
        for part, c, s in ((q, cos, sin), (k, cos_k, sin_k)):
            _check(part, c, s, seqlen_offsets, None, None)
            apply_rotary(part, c, s, seqlen_offsets, interleaved=interleaved, inplace=True)
        tensors = (cos, sin, cos_k, sin_k)
        if isinstance(seqlen_offsets, torch.Tensor):
            tensors = (*tensors, seqlen_offsets)
            ctx.seqlen_offsets = None
        else:
            ctx.seqlen_offsets = seqlen_offsets
        ctx.save_for_backward(*tensors)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        saved = ctx.saved_tensors
        cos, sin, cos_k, sin_k = saved[:4]
        offsets = saved[4] if ctx.seqlen_offsets is None else ctx.seqlen_offsets
        def compute():
            # a private copy: the incoming gradient may be shared, and the rotation is done in place
            grad = dqkv.clone(memory_format=torch.contiguous_format)
            dq, dk = _qk_view(grad, ctx.num_heads_q)
            apply_rotary(dq, cos, sin, offsets, interleaved=ctx.interleaved, inplace=True, conjugate=True)
            apply_rotary(dk, cos_k, sin_k, offsets, interleaved=ctx.interleaved, inplace=True, conjugate=True)
            return (grad,)

        (grad,) = first_order(compute, dqkv, what="rotary")
        return grad, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """Rotate q and k of a packed qkv in place and return it.

    Args:
        qkv: (b, s, 3, h, d), or (b, s, h_q + 2*h_k, d) with ``num_heads_q = h_q`` (GQA layout).
        cos, sin: (seqlen_ro, rotary_dim / 2) for q; ``cos_k, sin_k`` for k (default: the same; XPos
            uses different tables).
        interleaved, seqlen_offsets: as in :func:`apply_rotary_emb`.
    """
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """In-place rotation of the k part of a packed kv."""

    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"flashtile: kv must be (b, s, 2, h_k, d), got {tuple(kv.shape)}")
        k = kv[:, :, 0]
        _check(k, cos, sin, seqlen_offsets, None, None)
        apply_rotary(k, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True)
        if isinstance(seqlen_offsets, torch.Tensor):
            ctx.save_for_backward(cos, sin, seqlen_offsets)
            ctx.seqlen_offsets = None
        else:
            ctx.save_for_backward(cos, sin)
            ctx.seqlen_offsets = seqlen_offsets
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        saved = ctx.saved_tensors
        cos, sin = saved[:2]
        offsets = saved[2] if ctx.seqlen_offsets is None else ctx.seqlen_offsets
        def compute():
            grad = dkv.clone(memory_format=torch.contiguous_format)
            apply_rotary(grad[:, :, 0], cos, sin, offsets, interleaved=ctx.interleaved, inplace=True, conjugate=True)
            return (grad,)

        (grad,) = first_order(compute, dkv, what="rotary")
        return grad, None, None, None, None


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotate k of a packed kv (b, s, 2, h_k, d) in place and return kv (v untouched)."""
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding layer with a cos/sin cache grown on demand (FlashAttention's ``RotaryEmbedding``).

    Args:
        dim: rotary_dim, the number of leading channels of each head that are rotated (even).
        base: frequency base; pair ``i`` turns at ``base ** (-2i / dim)`` radians per position.
        interleaved: GPT-J pairing (2i, 2i+1) instead of GPT-NeoX (i, i + dim/2).
        scale_base: when set, XPos (https://arxiv.org/abs/2212.10554): q is scaled up and k down by
            ``scale ** ((pos - seqlen/2) / scale_base)``, so q.k decays with distance.
        pos_idx_in_fp32: compute positions in fp32 (bf16 cannot count past 256 exactly).
        device: where the inverse-frequency buffer lives.

    ``forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None)``:
        qkv (b, s, 3, h, d) (or (b, s, h_q + 2*h_k, d) with num_heads_q) is rotated in place and
        returned; with ``kv`` given, ``qkv`` is q (b, s, h, d) and kv (b, s, 2, h_k, d): both are
        rotated in place and ``(q, kv)`` returned. ``seqlen_offset`` is an int or an int32 (b,)
        tensor; with a tensor, pass ``max_seqlen`` so the cache covers every position (without it
        the existing cache is used, and positions past it are left unrotated).
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 pos_idx_in_fp32: bool = True, device=None):
        super().__init__()
        if dim % 2 != 0 or dim <= 0:
            raise ValueError(f"flashtile: RotaryEmbedding dim must be a positive even number, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = None
        if scale_base is not None:
            scale = (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None
        self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Rebuild the tables when they are too short, on another device/dtype, or unusable for autograd.

        Without XPos the table grows geometrically (row p only depends on p, so a longer table is the
        same table). With XPos every row depends on the table length (``seqlen // 2`` centres the
        scale), so it is rebuilt at exactly the needed length, as FlashAttention does. A table built
        under ``torch.inference_mode()`` cannot be saved for backward: it is rebuilt when used
        outside inference mode with autograd on (FlashAttention rebuilds it when training).
        """
        cached = self._cos_cached
        stale_inference = (cached is not None and cached.is_inference() and not torch.is_inference_mode_enabled()
                           and (self.training or torch.is_grad_enabled()))
        if (cached is not None and seqlen <= self._seq_len_cached and cached.device == device
                and cached.dtype == dtype and not stale_inference):
            return
        if self.scale is None and cached is not None:
            # grow geometrically so step-by-step decoding does not rebuild the table at every token
            seqlen = max(seqlen, 2 * self._seq_len_cached)
        self._seq_len_cached = seqlen
        if self.pos_idx_in_fp32:
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            # recomputed rather than read: model.to(bf16) also casts the buffer, and bf16
            # frequencies would put the angles of long positions visibly off
            inv_freq = self._compute_inv_freq(device)
        else:
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq.to(device)
        freqs = torch.outer(t, inv_freq)  # (seqlen, dim / 2), angles in fp32
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
            self._cos_k_cached = self._sin_k_cached = None
        else:
            power = (torch.arange(seqlen, device=device, dtype=torch.float32) - seqlen // 2) / self.scale_base
            # recomputed in fp32 rather than read: model.half() also casts the ``scale`` buffer
            base = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
            base = (base + 0.4 * self.dim) / (1.4 * self.dim)
            scale = base.unsqueeze(0) ** power.unsqueeze(1)
            self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
            self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
            self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
            self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        else:
            # a tensor offset without max_seqlen uses the existing table (FlashAttention's rule), built
            # to at least seqlen; positions past it are left unrotated
            self._update_cos_sin_cache(max(seqlen, self._seq_len_cached), device=qkv.device, dtype=qkv.dtype)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, self._cos_k_cached,
                                         self._sin_k_cached, interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved,
                             inplace=True, seqlen_offsets=seqlen_offset)
        cos_k = self._cos_cached if self.scale is None else self._cos_k_cached
        sin_k = self._sin_cached if self.scale is None else self._sin_k_cached
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, scale_base={self.scale_base}"
