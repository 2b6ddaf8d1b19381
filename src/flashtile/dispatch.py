"""One place decides which backend runs a call, and explains a refusal.

Order of preference: the Triton kernels (CUDA tensors, or CPU tensors through Triton's interpreter
when ``FLASHTILE_INTERPRET=1``), then the CPU path (CPU tensors). Each backend module exposes
``NAME`` and ``refusal(op, q, params) -> str | None``; when every backend refuses, the error lists
each one with its reason.
"""

from __future__ import annotations

import importlib
import os

from flashtile.params import AttnParams

# Backends in order of preference; modules are imported lazily so a missing triton does not break
# the CPU path.
_BACKENDS = ("flashtile.backends.triton", "flashtile.backends.cpu")


class NoBackendError(RuntimeError):
    """No backend can run this call; the message names every backend and why it refused."""


def interpret_requested() -> bool:
    """True when ``FLASHTILE_INTERPRET=1``: CPU tensors go through the Triton kernels' interpreter."""
    return os.environ.get("FLASHTILE_INTERPRET", "0") not in ("", "0", "false", "False")


def _load(name: str):
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # an unusable backend must not hide the others
        return None, f"cannot be imported ({type(exc).__name__}: {exc})"


def choose(op: str, q, p: AttnParams):
    """Return the backend module that runs ``op`` ("fwd" or "bwd") for these inputs."""
    reasons = []
    for name in _BACKENDS:
        mod, why = _load(name)
        if mod is not None:
            why = mod.refusal(op, q, p)
            if why is None:
                return mod
        reasons.append(f"  - {name.rsplit('.', 1)[-1]}: {why}")
    raise NoBackendError(
        f"flashtile: no backend can run attention {op} for {q.dtype} tensors on {q.device}:\n"
        + "\n".join(reasons)
    )
