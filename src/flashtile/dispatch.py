"""One place decides which backend runs a call, and explains a refusal.

Order of preference: the Triton kernels (CUDA tensors, or CPU tensors through Triton's interpreter
when ``FLASHTILE_INTERPRET=1``), then the CPU path (CPU tensors). Each backend module exposes
``NAME`` and ``refusal(op, q, params) -> str | None``; when every backend refuses, the error lists
each one with its reason. A refusal may depend only on the op, q's device and dtype, and
``config.get().interpret``: the choice is remembered under those, since it is made on every call.

Ops: "fwd" and "bwd" (attention, ``params`` an AttnParams) and "kvcache" (``flash_attn_with_kvcache``,
no params), whose CPU path is the PyTorch reference (``backends/reference_kvcache.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from flashtile import chunk_batch, config
from flashtile.params import AttnParams

# Backends in order of preference, by op; modules are imported lazily so a missing triton does not
# break the CPU path.
_BACKENDS = ("flashtile.backends.triton", "flashtile.backends.cpu")
_OP_BACKENDS = {"kvcache": ("flashtile.backends.triton", "flashtile.backends.reference_kvcache")}


class NoBackendError(RuntimeError):
    """No backend can run this call; the message names every backend and why it refused."""


def interpret_requested() -> bool:
    """True when ``FLASHTILE_INTERPRET=1``: CPU tensors go through the Triton kernels' interpreter."""
    return config.get().interpret


# (module, None) or (None, why it cannot be imported), per backend: import_module's own lookup costs
# microseconds a call, and a failing import (no triton on a CPU-only install) would be retried each time
_LOADED: dict = {}


def _load(name: str):
    hit = _LOADED.get(name)
    if hit is not None:
        return hit
    try:
        hit = importlib.import_module(name), None
    except Exception as exc:  # an unusable backend must not hide the others
        hit = None, f"cannot be imported ({type(exc).__name__}: {exc})"
    _LOADED[name] = hit
    return hit


_WHAT = {"kvcache": "flash_attn_with_kvcache"}
# (op, device, dtype, interpret) -> the backend module chosen for it
_CHOSEN: dict = {}


def choose(op: str, q, p: AttnParams | None):
    """Return the backend module that runs ``op`` ("fwd", "bwd" or "kvcache") for these inputs."""
    key = (op, q.device, q.dtype, config.get().interpret)
    mod = _CHOSEN.get(key)
    if mod is not None:
        return mod
    reasons = []
    for name in _OP_BACKENDS.get(op, _BACKENDS):
        mod, why = _load(name)
        if mod is not None:
            why = mod.refusal(op, q, p)
            if why is None:
                _CHOSEN[key] = mod
                return mod
        reasons.append(f"  - {name.rsplit('.', 1)[-1]}: {why}")
    raise NoBackendError(
        f"flashtile: no backend can run {_WHAT.get(op, 'attention ' + op)} for {q.dtype} tensors on {q.device}:\n"
        + "\n".join(reasons)
    )


def forward(q, k, v, p: AttnParams):
    """Run the forward on the chosen backend: ``(out, lse, probs-or-None)``.

    fp8 (e4m3) inputs go to backends that declare ``FP8_FWD = True`` (the Triton kernels) as they
    are. Any other backend (the CPU path) gets them dequantised to fp32 here, with the descales
    applied, so it needs no fp8 code of its own; the output is cast to bf16, FlashAttention-3's fp8
    output dtype.
    """
    n = chunk_batch.plan(q, p, k, v)
    if n == 1:  # the chunk spans the whole sequence
        p = replace(p, attention_chunk=0)
    elif n > 1:
        b = q.shape[0]
        fq, fk, fv = (chunk_batch.fold(x, n) for x in (q, k, v))
        out, lse, probs = forward(fq, fk, fv, chunk_batch.params_for(p, n, b))
        return out.view(b, q.shape[1], *out.shape[2:]), chunk_batch.unfold_lse(lse, n), probs
    mod = choose("fwd", q, p)
    if q.dtype != torch.float8_e4m3fn or getattr(mod, "FP8_FWD", False):
        return mod.fwd(q, k, v, p)
    from flashtile.fp8 import dequantize

    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    q = dequantize(q, p.q_descale, cu_seqlens=cu_q)
    k = dequantize(k, p.k_descale, cu_seqlens=cu_k)
    v = dequantize(v, p.v_descale, cu_seqlens=cu_k)
    out, lse, probs = mod.fwd(q, k, v, replace(p, q_descale=None, k_descale=None, v_descale=None))
    return out.to(torch.bfloat16), lse, probs


def backward(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv) -> None:
    """Write dq, dk, dv on the chosen backend (chunked calls that are a batch of shorter sequences run
    folded, as their forward did: chunk_batch.py)."""
    n = chunk_batch.plan(q, p, k, v, out, dout, dq, dk, dv)
    if n == 1:
        p = replace(p, attention_chunk=0)
    elif n > 1:
        fold = [chunk_batch.fold(x, n) for x in (dout, q, k, v, out)]
        grads = [chunk_batch.fold(x, n) for x in (dq, dk, dv)]
        p = chunk_batch.params_for(p, n, q.shape[0])
        choose("bwd", q, p).bwd(*fold, chunk_batch.fold_lse(lse, n), p, *grads)
        return
    choose("bwd", q, p).bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


def kvcache(q, *args, **kwargs):
    """Run a checked ``flash_attn_with_kvcache`` call on the chosen backend: ``(out, lse)``. The arguments are
    ``backends.triton.decode.kvcache_fwd``'s (every backend's ``kvcache`` takes them)."""
    return choose("kvcache", q, None).kvcache(q, *args, **kwargs)
