"""The implementations a benchmark row times: flashtile and its peers, in one registry.

Each implementation is an ``attn(q, k, v) -> out`` built once per shape (so per-shape setup such
as FlexAttention's block mask stays outside timing), in its own layout: flashtile takes
(b, s, h, d), torch's SDPA and FlexAttention take (b, h, s, d).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtile.bench.shapes import Shape

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    """An attention implementation: how to check it can run here and how to build it per shape."""

    name: str
    layout: str  # "bshd" (flashtile, flash_attn) or "bhsd" (torch SDPA, FlexAttention)
    description: str
    unavailable: Callable[[str], str | None]  # device -> reason it cannot run, or None
    build: Callable[[Shape, str], AttnFn]
    # Entered once around a row's check and timing, so a backend switch is not timed per call.
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


# -- flashtile ---------------------------------------------------------------------------------

def _flashtile_unavailable(device: str) -> str | None:
    try:  # lazy: a broken flashtile must not break --help or the peers' numbers
        from flashtile import flash_attn_func  # noqa: F401
    except Exception as e:  # any import failure is a reason to report
        return f"import flashtile failed: {type(e).__name__}: {e}"
    return None


def _flashtile_build(shape: Shape, device: str) -> AttnFn:
    from flashtile import flash_attn_func

    causal = shape.causal
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)


def _flashtile_fp8_build(shape: Shape, device: str) -> AttnFn:
    """flashtile on e4m3 inputs: the row's bf16 q, k, v are quantised once (untimed, cached by
    storage) with per-(batch, kv-head) scales, then every call runs the fp8 kernel."""
    from flashtile import flash_attn_func
    from flashtile.fp8 import quantize_qkv

    causal = shape.causal
    cache: dict = {}

    def attn(q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in cache:
            cache.clear()
            cache[key] = quantize_qkv(q.detach(), k.detach(), v.detach())
        q8, k8, v8, qd, kd, vd = cache[key]
        return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    return attn


# -- torch SDPA backends ----------------------------------------------------------------------

def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def _sdpa_unavailable(backend: str, cuda_only: bool) -> Callable[[str], str | None]:
    def check(device: str) -> str | None:
        try:
            _sdpa_backend(backend)
        except (ImportError, AttributeError):
            return f"torch {torch.__version__} has no SDPBackend.{backend}"
        if cuda_only and torch.device(device).type != "cuda":
            return f"SDPA's {backend} backend needs a CUDA device"
        return None

    return check


def _sdpa_context(backend: str) -> Callable[[], contextlib.AbstractContextManager]:
    def ctx():
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(_sdpa_backend(backend))

    return ctx


def _sdpa_build(shape: Shape, device: str) -> AttnFn:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal = shape.causal
    return lambda q, k, v: sdpa(q, k, v, is_causal=causal)


# -- FlexAttention ----------------------------------------------------------------------------

_compiled_flex = None


def _flex_unavailable(device: str) -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    return None


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def raise_recompile_limits() -> None:
    """Every shape and mod is a recompile of FlexAttention (dynamic=False gives the fastest kernels); past
    dynamo's default limit of 8 it would silently run unfused, which is not the peer we mean."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))


def _flex_build(shape: Shape, device: str) -> AttnFn:
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:
        raise_recompile_limits()
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    flex = _compiled_flex
    block_mask = None
    if shape.causal:
        block_mask = create_block_mask(_causal_mask, B=None, H=None, Q_LEN=shape.s, KV_LEN=shape.s,
                                       device=device)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


FLASHTILE = Impl("flashtile", "bshd", "flashtile.flash_attn_func", _flashtile_unavailable,
                 _flashtile_build)

# --dtype fp8: flashtile's fp8 kernel is the row's subject; its own bf16 forward becomes a peer
# (the ratio "flashtile-bf16" is the fp8 speed-up) beside the bf16 peers.
FLASHTILE_FP8 = Impl("flashtile", "bshd", "flashtile.flash_attn_func on e4m3 q/k/v (flashtile.fp8.quantize_qkv, "
                     "untimed) with descales, bf16 output", _flashtile_unavailable, _flashtile_fp8_build)
FLASHTILE_BF16 = Impl("flashtile-bf16", "bshd", "flashtile.flash_attn_func, bf16", _flashtile_unavailable,
                      _flashtile_build)

# Order here is the column order of tables and plots.
PEERS: dict[str, Impl] = {
    "flash": Impl("flash", "bhsd", "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2 kernels on CUDA)",
                  _sdpa_unavailable("FLASH_ATTENTION", cuda_only=False), _sdpa_build,
                  _sdpa_context("FLASH_ATTENTION")),
    "cudnn": Impl("cudnn", "bhsd", "torch SDPA, CUDNN_ATTENTION backend",
                  _sdpa_unavailable("CUDNN_ATTENTION", cuda_only=True), _sdpa_build,
                  _sdpa_context("CUDNN_ATTENTION")),
    "flex": Impl("flex", "bhsd", "FlexAttention under torch.compile (causal via a block mask)",
                 _flex_unavailable, _flex_build),
}


# SDPA with no backend forced, as a model calls it: not in PEERS (the dense modes' columns are fixed
# backends); the models mode times it beside cuDNN where v's head dim differs from q/k's.
SDPA_DEFAULT = Impl("sdpa", "bhsd", "torch SDPA, backend of torch's choice", lambda device: None, _sdpa_build)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA with torch's own backend choice (math where nothing fused fits); (b, h, s, d) layout."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
