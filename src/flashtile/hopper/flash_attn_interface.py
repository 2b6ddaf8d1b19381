"""FlashAttention-3's Python API (``flash_attn_interface``, from its ``hopper/`` package) on flashtile.

The same function names, argument order, defaults and return values as FlashAttention-3, so code written
for it runs unchanged (``flashtile.compat.install()`` also makes ``import flash_attn_interface`` resolve
here). What differs from FlashAttention 2.8.3's API, which ``flashtile.flash_attn_func`` keeps:

- no ``dropout_p`` and no ``alibi_slopes``; ``window_size`` and ``causal`` as in FlashAttention 2.
- ``return_attn_probs=True`` returns ``(out, softmax_lse)`` (no ``S_dmask``).
- the default ``softmax_scale`` is ``1 / sqrt(d)``, or ``1 / sqrt(d + dv)`` with ``qv``.
- ``attention_chunk`` (Llama 4's chunked attention), v's own head dim, fp8 ``q/k/v_descale`` and, in
  ``flash_attn_with_kvcache``, ``qv`` (MLA decoding) and ``page_table``.
- ``learnable_sink`` (FlashAttention-CuTe's, gpt-oss's attention sinks) is accepted as a keyword by every
  attention function here too.

Hints flashtile accepts and does not need (documented per argument below): ``num_splits`` of the
training functions (FlashAttention-3 splits keys there only for inference), ``pack_gqa`` (flashtile's
kernels read a kv head once per query-head group on their own), ``sm_margin`` (flashtile's grids are
not persistent, so they leave no SMs idle to reserve), ``scheduler_metadata`` (see
:func:`get_scheduler_metadata`). Unlike FlashAttention-3, ``attention_chunk`` has a backward here.
"""

from __future__ import annotations

import torch

from flashtile import autograd as _ag
from flashtile import kvcache as _kv
from flashtile.kvcache import flash_attn_combine

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]

_HINTS_DOC = """
    num_splits, pack_gqa, sm_margin: FlashAttention-3's scheduling hints, accepted and not needed:
        flashtile's training kernels never split keys, pack query heads of a kv head by themselves and
        run non-persistent grids (nothing to leave free for ``sm_margin``)."""


def _check_hint(name: str, value, allowed) -> None:
    if not isinstance(value, allowed) or isinstance(value, bool) and bool not in allowed:
        raise TypeError(f"flashtile.hopper: {name} must be {' or '.join(t.__name__ for t in allowed)}, "
                        f"got {value!r}")


def _hints(num_splits=1, pack_gqa=None, sm_margin=0) -> None:
    _check_hint("num_splits", num_splits, (int,))
    if pack_gqa is not None:
        _check_hint("pack_gqa", pack_gqa, (bool,))
    _check_hint("sm_margin", sm_margin, (int,))


def _no_qv(qv, function: str) -> None:
    if qv is not None:
        raise ValueError(f"flashtile.hopper.{function}: qv (MLA's absorbed form) is supported by "
                         f"flash_attn_with_kvcache only (decoding against a latent cache); pass it there")


def _scale(softmax_scale, q):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def _result(out, lse, return_attn_probs: bool):
    return (out, lse) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False, *,
                              learnable_sink=None):
    """Self-attention with q, k, v packed.

    qkv: (b, s, 3, h, d), or (b, s, h + 2 * h_k, d) with ``num_heads_q = h`` (grouped-query heads packed along
    the head dim, q's first). Returns out (b, s, h, d), or (out, softmax_lse (b, h, s)) with
    ``return_attn_probs``.
    """
    _hints(sm_margin=sm_margin)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    extras = dict(learnable_sink=learnable_sink, attention_chunk=attention_chunk)
    if qkv.dim() == 5:
        res = _ag.flash_attn_qkvpacked(qkv, 0.0, _scale(softmax_scale, qkv), causal, window_size, softcap, None,
                                       deterministic, True, **descales, **extras)
    else:
        if not isinstance(num_heads_q, int) or qkv.dim() != 4 or (qkv.shape[2] - num_heads_q) % 2 != 0 \
                or not 0 < num_heads_q < qkv.shape[2]:
            raise ValueError(f"flashtile.hopper.flash_attn_qkvpacked_func: a 4-dim qkv (b, s, h + 2 * h_k, d) "
                             f"needs num_heads_q = h with an even remainder for k and v, got qkv "
                             f"{tuple(qkv.shape)} and num_heads_q={num_heads_q!r}")
        h_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, h_k, h_k], dim=2)
        res = _ag.flash_attn(q, k, v, 0.0, _scale(softmax_scale, qkv), causal, window_size, softcap, None,
                             deterministic, True, **descales, **extras)
    return _result(res[0], res[1], return_attn_probs)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *,
                    learnable_sink=None):
    """Attention over padded batches, FlashAttention-3's signature.

    q: (b, sq, h, d); k: (b, sk, h_k, d); v: (b, sk, h_k, dv). Returns out (b, sq, h, dv), or
    (out, softmax_lse (b, h, sq)) with ``return_attn_probs``. ``qv`` is refused here (MLA decoding goes
    through :func:`flash_attn_with_kvcache`).
    """
    _hints(num_splits, pack_gqa, sm_margin)
    _no_qv(qv, "flash_attn_func")
    res = _ag.flash_attn(q, k, v, 0.0, _scale(softmax_scale, q), causal, window_size, softcap, None, deterministic,
                         True, q_descale, k_descale, v_descale, learnable_sink, attention_chunk)
    return _result(res[0], res[1], return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False,
                           *, learnable_sink=None):
    """Attention over variable-length sequences packed along the first dim, FlashAttention-3's signature.

    q: (total_q, h, d); k: (total_k, h_k, d); v: (total_k, h_k, dv); cu_seqlens_q/k int32 (b + 1,);
    seqused_q/k int32 (b,) or None. Returns out (total_q, h, dv), or (out, softmax_lse (h, total_q)).
    """
    _hints(num_splits, pack_gqa, sm_margin)
    _no_qv(qv, "flash_attn_varlen_func")
    res = _ag.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                _scale(softmax_scale, q), causal, window_size, softcap, None, deterministic, True,
                                None, seqused_q, seqused_k, q_descale, k_descale, v_descale, learnable_sink,
                                attention_chunk)
    return _result(res[0], res[1], return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, *, learnable_sink=None):
    """Attention of q to a KV cache after appending k / v to it in place, FlashAttention-3's signature.

    q: (b, sq, h, d); k_cache: (b_cache, s_cache, h_k, d), v_cache: (..., h_k, dv), or paged
    (num_blocks, page_size, h_k, d / dv) with ``page_table`` int32 (b, max_blocks); k / v: (b, s_new, h_k,
    d / dv) or None; qv: (b, sq, h, dv) or None (MLA: scores gain qv . v, default scale 1 / sqrt(d + dv)).
    Everything else as :func:`flashtile.flash_attn_with_kvcache`. Returns out (b, sq, h, dv), or
    (out, softmax_lse (b, h, sq)) with ``return_softmax_lse``.

    Not supported yet (a clear error): ``cu_seqlens_q`` / ``cu_seqlens_k_new`` / ``max_seqlen_q`` (varlen
    queries against a cache) and ``rotary_seqlens``. ``scheduler_metadata`` is accepted and ignored:
    flashtile's decode route is chosen per call from the shapes (docs/inference.md, "Routes").
    """
    _hints(pack_gqa=pack_gqa, sm_margin=sm_margin)
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                        ("max_seqlen_q", max_seqlen_q), ("rotary_seqlens", rotary_seqlens)):
        if value is not None:
            raise NotImplementedError(f"flashtile.hopper.flash_attn_with_kvcache: {name} is not supported yet "
                                      f"(pass padded q of shape (b, sq, h, d) and rotate at cache_seqlens)")
    extras = {}  # only what the call uses, so the plain FlashAttention 2 path is the one taken without them
    if qv is not None:
        extras["qv"] = qv
    if attention_chunk:
        extras["attention_chunk"] = attention_chunk
    if learnable_sink is not None:
        extras["learnable_sink"] = learnable_sink
    if softmax_scale is None and qv is not None:
        softmax_scale = (q.shape[-1] + qv.shape[-1]) ** -0.5
    return _kv.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                       cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal, window_size,
                                       softcap, rotary_interleaved, None, num_splits, return_softmax_lse,
                                       q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **extras)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FlashAttention-3 precomputes its decode scheduler's tile counts here, to pass to every
    :func:`flash_attn_with_kvcache` call of a step. flashtile's route needs no precomputation (it is a pure
    function of the call's shapes, cheap on the host and CUDA-graph safe), so this returns an empty int32
    tensor on ``cache_seqlens``' device, which ``flash_attn_with_kvcache`` accepts and ignores."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError("flashtile.hopper.get_scheduler_metadata: cache_seqlens must be an int32 tensor (b,)")
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)


for _fn in (flash_attn_func, flash_attn_varlen_func):
    _fn.__doc__ += "\n    Hints:" + _HINTS_DOC
