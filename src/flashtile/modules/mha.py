"""Multi-head attention layer with the constructor and forward of FlashAttention 2.8.3's ``MHA``.

Shapes: ``b`` batch, ``s`` sequence length, ``e`` embed_dim, ``h`` query heads, ``h_k`` key/value
heads (GQA/MQA when ``h_k < h``), ``d = e // h`` head dim. Inputs are ``(b, s, e)``, or packed
``(total, e)`` with ``cu_seqlens`` int32 ``(b + 1,)`` and ``max_seqlen``.

Attention runs through flashtile's public functions (so through whichever backend dispatch picks).
Generation keeps a KV cache per layer in :class:`InferenceParams`: the prompt (``seqlen_offset == 0``)
is written into the cache and attended with ``flash_attn_func``; later tokens go through
``flash_attn_with_kvcache``, which appends them to the cache and applies rotary in the same call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from flashtile.bert_padding import pad_input, unpad_input
from flashtile.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.layers.rotary import RotaryEmbedding, apply_rotary_emb
from flashtile.modules.mha_cp import CP_SCHEMES, check_cp_args, cp_forward, refuse

__all__ = ["CP_SCHEMES", "MHA", "InferenceParams", "get_alibi_slopes"]

@dataclass
class InferenceParams:
    """State shared by every layer during generation (FlashAttention's ``InferenceParams``).

    Attributes:
        max_seqlen: cache length (prompt + generated tokens).
        max_batch_size: cache batch size.
        seqlen_offset: number of tokens already in the cache; the caller advances it after each step.
        batch_size_offset: first cache row this call's batch uses.
        key_value_memory_dict: ``layer_idx -> (max_batch_size, max_seqlen, 2, h_k, d)`` caches,
            filled lazily by each MHA (or up front with ``MHA.allocate_inference_cache``).
        lengths_per_sample: optional int32 ``(b,)``: per-row cache lengths (ragged batches); when set
            it replaces ``seqlen_offset`` as the position of each row's next token.
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation reusing the allocated caches."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi slopes of https://arxiv.org/abs/2108.12409: a geometric sequence starting at 2**(-8/n).

    For a head count that is not a power of two, the slopes of the closest lower power of two are
    followed by every other slope of the next power of two (the paper's recipe).
    """

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(nheads).is_integer():
        return power_of_2(nheads)
    closest = 2 ** math.floor(math.log2(nheads))
    return power_of_2(closest) + get_alibi_slopes(2 * closest)[0::2][: nheads - closest]


class MHA(nn.Module):
    """Multi-head self- or cross-attention with optional GQA, rotary, ALiBi, sliding window and KV cache.

    Args:
        embed_dim: e, model width; must be divisible by num_heads.
        num_heads: h, query heads.
        num_heads_kv: h_k, key/value heads (default h); h must be divisible by h_k.
        cross_attn: keys/values come from ``x_kv`` (projection ``Wkv``) instead of ``x``.
        qkv_proj_bias / out_proj_bias: biases of the input and output projections.
        dropout: attention-probability dropout, applied only in training mode.
        softmax_scale: default ``d ** -0.5``.
        causal: bottom-right aligned causal mask (see the API contract).
        layer_idx: key of this layer's cache in ``InferenceParams.key_value_memory_dict``
            (required for generation).
        rotary_emb_dim: channels of each head rotated by RoPE (0 = no rotary).
        rotary_emb_base, rotary_emb_interleaved, rotary_emb_scale_base: see ``RotaryEmbedding``.
        use_alibi: add ALiBi biases with the standard slopes (``get_alibi_slopes``).
        window_size: (left, right) sliding window, -1 = unbounded.
        device, dtype: of the parameters.
        cp_group: context parallelism (docs/distributed.md): x is then this rank's sequence shard
            (b, n, e) and attention runs through ``flashtile.distributed``; a process group or 1-D
            DeviceMesh, or ``(ulysses_group, ring_group)`` for the hybrid scheme.
        cp_scheme: ``"ring"``, ``"zigzag"``, ``"ulysses"``, ``"ulysses_zigzag"``, ``"allgather"`` (K/V
            all-gathered, contiguous shards), ``"allgather_zigzag"``, ``"hybrid"`` or ``"hybrid_zigzag"``;
            shards must be cut to match (``flashtile.distributed.shard`` / ``shard_hybrid``). Rotary turns
            each token by its global position, ALiBi measures global distances; cross-attention,
            key_padding_mask and generation are refused with it (``mha_cp.py`` says why).

    The projection weights are ``Wqkv`` (e -> (h + 2*h_k) * d) for self-attention, ``Wq`` and ``Wkv``
    for cross-attention, and ``out_proj`` (h * d -> e), laid out as FlashAttention's MHA.
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_interleaved=False, use_alibi=False,
                 window_size=(-1, -1), rotary_emb_scale_base=None, device=None, dtype=None, cp_group=None,
                 cp_scheme="ring"):
        super().__init__()
        check_cp_args(cp_group, cp_scheme, cross_attn)
        self.cp_group, self.cp_scheme = cp_group, cp_scheme
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"flashtile: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if self.num_heads % self.num_heads_kv != 0:
            raise ValueError(f"flashtile: num_heads ({num_heads}) must be divisible by num_heads_kv "
                             f"({self.num_heads_kv})")
        self.head_dim = embed_dim // num_heads
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dropout = dropout
        self.softmax_scale = softmax_scale
        self.window_size = tuple(int(w) for w in window_size)
        self.rotary_emb_dim = rotary_emb_dim
        if rotary_emb_dim > 0:
            if cross_attn:
                raise NotImplementedError("flashtile: rotary embeddings with cross-attention are not supported")
            if rotary_emb_dim > self.head_dim:
                raise ValueError(f"flashtile: rotary_emb_dim ({rotary_emb_dim}) exceeds head dim {self.head_dim}")
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base,
                                              interleaved=rotary_emb_interleaved,
                                              scale_base=rotary_emb_scale_base, device=device)
        self.use_alibi = use_alibi
        if use_alibi:
            self.register_buffer("alibi_slopes", torch.tensor(get_alibi_slopes(num_heads), device=device,
                                                              dtype=torch.float32), persistent=False)
        else:
            self.alibi_slopes = None
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    # ---------------------------------------------------------------- helpers
    def _attn_kwargs(self) -> dict:
        slopes = self.alibi_slopes
        return dict(dropout_p=self.dropout if self.training else 0.0, softmax_scale=self.softmax_scale,
                    causal=self.causal, window_size=self.window_size, alibi_slopes=slopes)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """A zeroed KV cache (batch_size, max_seqlen, 2, h_k, d) on the weights' device."""
        weight = self.out_proj.weight
        dtype = weight.dtype if dtype is None else dtype
        return torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype,
                           device=weight.device)

    def _cache(self, kv: torch.Tensor, inference_params: InferenceParams) -> torch.Tensor:
        if self.layer_idx is None:
            raise ValueError("flashtile: MHA needs layer_idx to use inference_params")
        caches = inference_params.key_value_memory_dict
        if self.layer_idx not in caches:
            caches[self.layer_idx] = self.allocate_inference_cache(
                inference_params.max_batch_size, inference_params.max_seqlen, dtype=kv.dtype)
        cache = caches[self.layer_idx]
        if isinstance(cache, tuple):  # (k_cache, v_cache) as some callers store it
            raise TypeError("flashtile: MHA expects one (b, s, 2, h_k, d) tensor per layer in key_value_memory_dict")
        return cache

    def _prefill(self, q, kv, inference_params: InferenceParams):
        """Write kv (b, s, 2, h_k, d) into the cache at seqlen_offset, attend q over the cache so far."""
        cache = self._cache(kv, inference_params)
        b0 = inference_params.batch_size_offset
        b1 = b0 + kv.shape[0]
        s0 = inference_params.seqlen_offset
        s1 = s0 + kv.shape[1]
        if b1 > cache.shape[0] or s1 > cache.shape[1]:
            raise ValueError(f"flashtile: KV cache {tuple(cache.shape[:2])} too small for rows [{b0}, {b1}) and "
                             f"positions [{s0}, {s1})")
        cache[b0:b1, s0:s1] = kv
        kv_all = cache[b0:b1, :s1]
        kw = self._attn_kwargs()
        kw["dropout_p"] = 0.0
        return flash_attn_kvpacked_func(q, kv_all, **kw)

    def _decode(self, q, kv, inference_params: InferenceParams, fuse_rotary: bool):
        """Append kv to the cache and attend through flash_attn_with_kvcache (rotary fused there)."""
        from flashtile.kvcache import flash_attn_with_kvcache  # lands separately; imported on first decode

        cache = self._cache(kv, inference_params)
        b0 = inference_params.batch_size_offset
        b1 = b0 + q.shape[0]
        k_cache, v_cache = cache[b0:b1, :, 0], cache[b0:b1, :, 1]
        if inference_params.lengths_per_sample is not None:
            cache_seqlens = inference_params.lengths_per_sample[b0:b1]
        else:
            cache_seqlens = inference_params.seqlen_offset
        rotary_cos = rotary_sin = None
        if fuse_rotary:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            rotary_cos, rotary_sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, kv[:, :, 0], kv[:, :, 1], rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, softmax_scale=self.softmax_scale, causal=self.causal,
            window_size=self.window_size,
            rotary_interleaved=self.rotary_emb.interleaved if fuse_rotary else False,
            alibi_slopes=self.alibi_slopes)

    # ---------------------------------------------------------------- forward
    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, inference_params=None,
                **kwargs):
        """Attention block (projections included).

        Args:
            x: (b, s, e), or (total, e) with ``cu_seqlens`` (int32 (b + 1,)) and ``max_seqlen``.
            x_kv: (b, s_kv, e) keys/values source for cross-attention (default: x).
            key_padding_mask: (b, s) bool, True = real token (self-attention: also masks queries;
                cross-attention: masks x_kv). The attention output is 0 at padded
                positions (out_proj then adds its bias there).
            inference_params: :class:`InferenceParams` for generation (padded x only).

        Returns:
            (b, s, e), or (total, e) for varlen input.
        """
        if self.cp_group is not None:
            refuse(x_kv, key_padding_mask, inference_params)
            return cp_forward(self, x, cu_seqlens, max_seqlen)
        varlen = cu_seqlens is not None
        if varlen and (key_padding_mask is not None or inference_params is not None):
            raise ValueError("flashtile: cu_seqlens cannot be combined with key_padding_mask or inference_params")
        if varlen and max_seqlen is None:
            raise ValueError("flashtile: max_seqlen is required with cu_seqlens")
        if inference_params is not None and (key_padding_mask is not None or self.cross_attn):
            raise NotImplementedError("flashtile: generation with key_padding_mask or cross-attention is not "
                                      "supported; use InferenceParams.lengths_per_sample for ragged batches")
        h, h_k, d = self.num_heads, self.num_heads_kv, self.head_dim
        if self.cross_attn:
            out = self._cross(x, x if x_kv is None else x_kv, key_padding_mask, h, h_k, d)
            return self.out_proj(out.reshape(*x.shape[:-1], h * d))

        qkv = self.Wqkv(x)
        lead = qkv.shape[:-1]
        # (…, h + 2*h_k, d): the GQA layout; the same buffer viewed as (…, 3, h, d) when h == h_k
        qkv = qkv.view(*lead, h + 2 * h_k, d)
        if inference_params is not None:
            out = self._forward_cached(qkv, inference_params, h, h_k)
        elif varlen:
            out = self._varlen_self(qkv, cu_seqlens, max_seqlen, h, h_k)
        else:
            if self.rotary_emb_dim > 0:
                qkv = self.rotary_emb(qkv, num_heads_q=h)
            out = self._padded_self(qkv, key_padding_mask, h, h_k, d)
        return self.out_proj(out.reshape(*lead, h * d))

    def _padded_self(self, qkv, key_padding_mask, h, h_k, d):
        b, s = qkv.shape[:2]
        kw = self._attn_kwargs()
        if key_padding_mask is not None:
            qkv_unpad, indices, cu, max_s, _ = unpad_input(qkv, key_padding_mask)
            out = self._varlen_attn(qkv_unpad, cu, max_s, h, h_k, kw)
            return pad_input(out, indices, b, s)
        if h == h_k:
            return flash_attn_qkvpacked_func(qkv.view(b, s, 3, h, d), **kw)
        q, k, v = qkv.split((h, h_k, h_k), dim=2)
        return flash_attn_func(q, k, v, **kw)

    def _varlen_attn(self, qkv, cu, max_s, h, h_k, kw):
        total, d = qkv.shape[0], qkv.shape[-1]
        if h == h_k:
            return flash_attn_varlen_qkvpacked_func(qkv.view(total, 3, h, d), cu, max_s, **kw)
        q, k, v = qkv.split((h, h_k, h_k), dim=1)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, **kw)

    def _varlen_self(self, qkv, cu_seqlens, max_seqlen, h, h_k):
        if self.rotary_emb_dim > 0:
            # packed sequences: each restarts at position 0 (rotary with cu_seqlens); out of place
            # because q and k are views of one projection that autograd still needs intact
            re = self.rotary_emb
            re._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
            q, k, v = qkv.split((h, h_k, h_k), dim=1)
            cos_k = re._cos_cached if re._cos_k_cached is None else re._cos_k_cached
            sin_k = re._sin_cached if re._sin_k_cached is None else re._sin_k_cached
            q = apply_rotary_emb(q, re._cos_cached, re._sin_cached, re.interleaved, cu_seqlens=cu_seqlens,
                                 max_seqlen=max_seqlen)
            k = apply_rotary_emb(k, cos_k, sin_k, re.interleaved, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            kw = self._attn_kwargs()
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)
        return self._varlen_attn(qkv, cu_seqlens, max_seqlen, h, h_k, self._attn_kwargs())

    def _forward_cached(self, qkv, inference_params: InferenceParams, h, h_k):
        b, s = qkv.shape[:2]
        q, kv = qkv.split((h, 2 * h_k), dim=2)
        kv = kv.reshape(b, s, 2, h_k, self.head_dim)
        lengths = inference_params.lengths_per_sample
        offset = lengths if lengths is not None else inference_params.seqlen_offset
        fuse_rotary = self.rotary_emb_dim > 0 and self.rotary_emb.scale is None
        if inference_params.seqlen_offset == 0 or not fuse_rotary:
            if self.rotary_emb_dim > 0:
                q = q.contiguous()
                q, kv = self.rotary_emb(q, kv, seqlen_offset=offset, max_seqlen=inference_params.max_seqlen)
            if inference_params.seqlen_offset == 0 and lengths is None:
                return self._prefill(q, kv, inference_params)
            return self._decode(q, kv, inference_params, fuse_rotary=False)  # already rotated above
        return self._decode(q, kv, inference_params, fuse_rotary=True)

    def _cross(self, x, x_kv, key_padding_mask, h, h_k, d):
        q = self.Wq(x)
        kv = self.Wkv(x_kv)
        kw = self._attn_kwargs()
        if x.dim() == 2:
            raise NotImplementedError("flashtile: varlen cross-attention through MHA is not supported; call "
                                      "flash_attn_varlen_kvpacked_func directly")
        b, sq = x.shape[:2]
        sk = x_kv.shape[1]
        q = q.view(b, sq, h, d)
        kv = kv.view(b, sk, 2, h_k, d)
        if key_padding_mask is None:
            return flash_attn_kvpacked_func(q, kv, **kw)
        # only keys are padded: every query is kept, one sequence per batch row
        kv_unpad, _, cu_k, max_k, _ = unpad_input(kv, key_padding_mask)
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_kvpacked_func(q.reshape(b * sq, h, d), kv_unpad, cu_q, cu_k, sq, max_k, **kw)
        return out.view(b, sq, h, d)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_heads_kv={self.num_heads_kv}, "
                f"causal={self.causal}, cross_attn={self.cross_attn}, rotary_emb_dim={self.rotary_emb_dim}, "
                f"use_alibi={self.use_alibi}, window_size={self.window_size}")
