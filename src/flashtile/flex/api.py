"""``flex_attention``: FlexAttention's function, on flashtile's kernels."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from flashtile.flex import autograd as _autograd  # noqa: F401  (registers the op's backward)
from flashtile.flex import options, registry
from flashtile.flex.block_mask import BlockMask, full_block_mask
from flashtile.flex.eager import flex_attention_eager
from flashtile.flex.ops import cpu_forward, flex_fwd, use_triton
from flashtile.ops import traced


@torch.compiler.assume_constant_result
def _register(score_mod, mask_mod, device: str) -> str:
    """The registry key of a pair; under torch.compile it runs once at trace time and the key is a constant.
    ``device``: the call's device, where the mods are traced (their captured tensors live there)."""
    entry = registry.entry_for(score_mod, mask_mod, device)
    if torch.compiler.is_compiling() and any(path is None for _, path in entry.grad_paths):
        raise NotImplementedError("flashtile.flex: under torch.compile, a tensor that learns must be reached by "
                                  "the score_mod through its closure, its module's globals or an attribute of "
                                  "one of those (or of a bound method's object); this one is reached otherwise "
                                  "and would be read as a constant")
    return entry.key


@torch.compiler.assume_constant_result
def _captured(key: str) -> tuple:
    return registry.get(key).buffers


@torch.compiler.assume_constant_result
def _grad_paths(key: str) -> tuple:
    return registry.get(key).grad_paths


@functools.lru_cache(maxsize=64)
def _full_mask_cached(L: int, S: int, device: torch.device) -> BlockMask:
    return full_block_mask(1, 1, L, S, device)


@torch.compiler.assume_constant_result
def _full_mask_tensors(L: int, S: int, device: torch.device) -> tuple:
    """The all-visible mask's tensors (constants under torch.compile, cached per shape in eager calls)."""
    return _full_mask_cached(L, S, device).tensors()


def _check(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool, block_mask: BlockMask | None) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must be (batch, heads, seq, dim), got shape {tuple(t.shape)}")
        if t.device != query.device:
            raise ValueError(f"flex_attention: {name} is on {t.device}, query on {query.device}")
        if t.dtype != query.dtype:
            raise ValueError(f"flex_attention: {name} is {t.dtype}, query {query.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"flex_attention: query dtype {query.dtype} is not supported (fp16, bf16, fp32, fp64)")
    B, Hq, _, E = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError("flex_attention: query, key and value must have the same batch size")
    if key.shape[2] != value.shape[2] or key.shape[1] != value.shape[1]:
        raise ValueError("flex_attention: key and value must have the same heads and sequence length")
    if key.shape[3] != E:
        raise ValueError(f"flex_attention: key's head dim {key.shape[3]} differs from query's {E}")
    Hk = key.shape[1]
    if Hk != Hq and not (enable_gqa and Hq % Hk == 0):
        raise ValueError(f"flex_attention: query has {Hq} heads and key {Hk}; pass enable_gqa=True when {Hk} "
                         f"divides {Hq}" if Hq % Hk == 0 else f"flex_attention: {Hk} key heads do not divide {Hq}")
    if block_mask is not None:
        mb, mh, ml, ms = block_mask.shape
        if (ml, ms) != (query.shape[2], key.shape[2]):
            raise ValueError(f"flex_attention: block_mask is for (Q_LEN, KV_LEN) = {(ml, ms)}, the inputs are "
                             f"{(query.shape[2], key.shape[2])}")
        if mb not in (1, B) or mh not in (1, Hq):
            raise ValueError(f"flex_attention: block_mask's (B, H) = {(mb, mh)} fits neither (1 or {B}, 1 or {Hq})")
        if block_mask.device != query.device:
            raise ValueError(f"flex_attention: block_mask is on {block_mask.device}, query on {query.device}")


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod=None, block_mask: BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options=None):
    """Attention with a programmable score and block-sparse mask (FlexAttention's signature).

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); Hkv divides Hq with ``enable_gqa``.
    ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites each scaled score (``scale`` default 1/sqrt(E));
    ``block_mask`` (create_block_mask) hides what its mask_mod hides and skips empty blocks. Returns
    ``out`` (B, Hq, L, Ev) and, with ``return_lse``, the natural-log logsumexp (B, Hq, L) fp32 of the scaled,
    modded scores, -inf on a row that sees no key (whose output is 0); a loss may use both, gradients flow
    through each. ``kernel_options`` (a dict, FlexAttention's keys) picks tiles: BLOCK_M / BLOCK_N and
    num_warps / num_stages for the forward, BLOCK_M1 / BLOCK_N1 (dK/dV) and BLOCK_M2 / BLOCK_N2 (dQ) for
    the backward, ``fwd_`` / ``bwd_`` prefixes as FlexAttention's; its other keys are accepted and ignored,
    unknown keys and invalid values raise ValueError (flex/options.py).
    """
    _check(query, key, value, enable_gqa, block_mask)
    B, Hq, L, E = query.shape
    S = key.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    if block_mask is None:
        tensors, block_size, mask_mod = _full_mask_tensors(L, S, query.device), (128, 128), None
    else:
        tensors, block_size = block_mask.tensors(), block_mask.BLOCK_SIZE
        mask_mod = None if block_mask.mask_mod is None or _is_noop(block_mask.mask_mod) else block_mask.mask_mod
    tiles = list(options.tiles(kernel_options, block_size))
    k = _register(score_mod, mask_mod, str(query.device))
    bufs = list(_captured(k))
    if torch.compiler.is_compiling():
        # the captured tensors that learn enter the graph as inputs, read the way the mod reads them, so
        # gradients reach them; the others stay constants
        for i, path in _grad_paths(k):
            bufs[i] = registry.resolve(score_mod, path)
    q, kk, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if traced(q):  # torch.compile, fake / meta tensors, subclasses, dispatch modes: the op and its fake
        out, lse = flex_fwd(q, kk, v, *tensors, bufs, float(scale), k, *block_size, tiles)
    elif use_triton(q):  # eager kernel calls skip the custom op's dispatch (flex/eager.py)
        out, lse = flex_attention_eager(q, kk, v, tensors, bufs, float(scale), k, block_size, tiles)
    else:  # eager CPU: plain autograd through the mods, captured tensors included
        out, lse = cpu_forward(q, kk, v, tensors[:4], registry.get(k), float(scale), block_size)
    if not return_lse:
        return out
    # FlexAttention's convention for a row that sees no key: -inf (the kernels store +inf); where() sends such
    # a row a zero gradient, which it has (its probabilities are all 0)
    return out, torch.where(lse == float("inf"), float("-inf"), lse)


def _is_noop(fn) -> bool:
    from flashtile.flex.block_mask import noop_mask

    return fn is noop_mask
