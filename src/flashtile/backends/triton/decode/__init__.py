"""KV-cache decode on the Triton backend: ``kvcache_fwd`` runs a checked ``flash_attn_with_kvcache`` call.

``route.select_route`` decides which kernel runs a call (its module docstring tabulates the routes); each kernel has
one launcher here, and each is the default for some calls:

- ``split.py``, the Triton split-KV kernel (kernels/decode.py) + the merge (``common.combine``): every call no other
  route takes: small batches, short caches, every feature (rotary, windows, softcap, ALiBi, batch index, left padding,
  several query tokens, learnable sinks, chunks), fp8 and fp32 caches, paged caches of any page size, every GPU but
  Hopper's special cases, Triton's interpreter. E.g. b = 1 at 8k-128k keys.
- ``rows.py``, the whole-row Triton kernel (kernels/decode_rows.py): long caches on large batches on Hopper, 8 kv heads
  of d = 128: e.g. b = 64 from 8k keys, b = 32 from 64k (half rows), paged b = 32 from 8k keys (no chunks).
- ``gluon.py``, the Gluon warps-along-keys kernel (kernels/gluon_decode_warp_keys.py): one-token calls on contiguous
  bf16 / fp16 caches on Hopper with about two programs an SM: b = 32 at 8k-32k keys unsplit, b = 4-16 from 32k split
  (no chunks; learnable sinks split only).
- ``mla.py``, the MLA kernel (kernels/decode_mla.py): every call with ``qv`` (multi-head latent attention) or a
  value head dim of its own, and only those; one program covers all query heads of a latent head (up to 64 rows).
- ``append.py``, the append kernel (kernels/kv_append.py; kernels/decode_mla.py's where v has its own head dim): a
  call's new keys (rotated) and values into the cache, first, wherever the decode kernel does not write them itself
  (the unsplit Gluon kernel does).

Nothing here reads a tensor's values: lengths stay on the device and the grids depend on shapes only, so a decode
step can be captured in a CUDA graph.
"""

from __future__ import annotations

from flashtile import config
from flashtile.backends.triton.decode import gluon, mla, rows, split
from flashtile.backends.triton.decode.append import kv_append
from flashtile.backends.triton.decode.common import aligned, capacity_of, combine
from flashtile.backends.triton.decode.route import DecodeShape, device_props, launch_config, select_route
from flashtile.backends.triton.tma import tma_ok

__all__ = ["combine", "kvcache_fwd", "launch_config", "select_route"]


def _aliases_cache(new: tuple, caches: tuple) -> bool:
    """Whether any new k/v tensor lives in a cache's storage (a host-side pointer compare)."""
    cache_ptrs = {c.untyped_storage().data_ptr() for c in caches}
    return any(x.untyped_storage().data_ptr() in cache_ptrs for x in new)


def kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
                cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                rotary_interleaved, alibi_slopes, num_splits, descales=(None, None, None), qv=None, learnable_sink=None,
                attention_chunk=0):
    """The whole call on the Triton kernels: append (+ rotary on k), then attention (+ rotary on q), on the route
    ``select_route`` picks. ``qv`` (b, sq, h, dv) or None: MLA's absorbed form, the scores gain qv . v.
    ``learnable_sink`` (h,) or None and ``attention_chunk`` (0: none): as in flash_attn_func. Returns out
    (b, sq, h, dv) (dv = v_cache's head dim), lse (b, h, sq)."""
    b, sq, h, d = q.shape
    s_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    plain = (cache_batch_idx is None and cache_leftpad is None and window_left < 0 and softcap <= 0
             and alibi_slopes is None and rotary_cos is None)
    settings = config.get()
    props = device_props(q.device)
    # the caches' alignment matters only to routes that can use it (the Gluon kernel on Hopper, descriptors from
    # sm_90 or when a test forces them): elsewhere the pointer and stride checks (several us) are skipped, and so
    # they are for calls with qv or a value head dim of their own (the MLA route, which uses neither)
    dv = v_cache.shape[3]
    mla_call = qv is not None or dv != d
    hopper = props.capability >= (9, 0) and not mla_call
    shape = DecodeShape(b, sq, h, k_cache.shape[2], d, capacity_of(k_cache, block_table), s_new, num_splits, plain,
                        cache_leftpad is not None, hopper and aligned(k_cache, v_cache),
                        (hopper or (bool(settings.tma) and not mla_call)) and tma_ok(k_cache) and tma_ok(v_cache), dv,
                        qv is not None, learnable_sink is not None, attention_chunk > 0)
    route = select_route(shape, q.dtype, paged, k_cache.shape[1] if paged else 0, props,
                         forced=settings.decode_route, tiles=settings.decode_tiles, pdl=settings.decode_pdl,
                         tma=settings.tma)
    if route.kernel == "gluon":
        # the unsplit kernel appends the new keys itself, unless they share the caches' storage (then one program's
        # writes could land in slots another reads as new keys: the append kernel reads and writes each slot once)
        own = route.append_in_kernel and not _aliases_cache((k, v), (k_cache, v_cache))
        if s_new > 0 and not own:
            kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, None, None, None, None, False,
                      pdl=route.append_pdl)
        return gluon.decode(q, k_cache, v_cache, route, cache_seqlens=cache_seqlens, cache_len_const=cache_len_const,
                            s_new=s_new, softmax_scale=softmax_scale, k_new=k if own else None,
                            v_new=v if own else None, learnable_sink=learnable_sink)
    if s_new > 0:
        kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_len_const, cache_batch_idx, block_table, rotary_cos,
                  rotary_sin, rotary_interleaved, pdl=route.append_pdl)
    if route.kernel == "mla":
        return mla.decode(q, qv, k_cache, v_cache, route, s_new=s_new, cache_seqlens=cache_seqlens,
                          cache_len_const=cache_len_const, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                          block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                          rotary_interleaved=rotary_interleaved,
                          rotary_per_token=causal or window_left >= 0 or window_right >= 0,
                          softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
                          softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                          attention_chunk=attention_chunk)
    if route.kernel == "rows":
        return rows.decode(q, k_cache, v_cache, route, cache_seqlens=cache_seqlens, cache_len_const=cache_len_const,
                           s_new=s_new, softmax_scale=softmax_scale, block_table=block_table,
                           learnable_sink=learnable_sink)
    return split.decode(q, k_cache, v_cache, route, s_new=s_new, cache_seqlens=cache_seqlens,
                        cache_len_const=cache_len_const, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                        block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                        rotary_interleaved=rotary_interleaved,
                        rotary_per_token=causal or window_left >= 0 or window_right >= 0,
                        softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
                        softcap=softcap, alibi_slopes=alibi_slopes, descales=descales, learnable_sink=learnable_sink,
                        attention_chunk=attention_chunk)
