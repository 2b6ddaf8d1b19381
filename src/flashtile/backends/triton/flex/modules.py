"""Generated helpers as importable modules, cached by the hash of their source.

Triton compiles a ``@triton.jit`` function from its source file, so a mod's helpers are written to a
file under the cache folder (``flex_<sha>.py``) and imported. Two mods that trace to the same graph
share the file and, through Triton's own cache, the compiled kernels; a process that saw a source
once imports it from memory the next time (``stats`` counts both, for tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile

from flashtile.backends.triton.flex import codegen
from flashtile.backends.triton.flex.trace import ModGraph

_LOADED: dict[str, object] = {}
stats = {"generated": 0, "reused": 0}


def cache_dir() -> pathlib.Path:
    """Where generated sources live (beside Triton's cache: $XDG_CACHE_HOME or ~/.cache, /flashtile/flex)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "flashtile" / "flex"


@dataclasses.dataclass(frozen=True)
class ModKernels:
    """The generated helpers of one (score_mod, mask_mod) pair: ``score_mod``, ``score_grad``, ``mask_mod``
    (jit functions the kernels take as constexpr arguments), the captured tensors in kernel order, and
    which of them get gradients (positions in ``buffers``)."""

    key: str
    module: object
    buffers: tuple
    grad_buffers: tuple[int, ...]
    has_score_mod: bool
    has_mask_mod: bool

    @property
    def score_mod(self):
        return self.module.score_mod

    @property
    def score_grad(self):
        return self.module.score_grad

    @property
    def mask_mod(self):
        return self.module.mask_mod


_IDENTITY_SCORE = ("@triton.jit\ndef score_mod(score, b, h, q_idx, kv_idx, BUFS):\n    return score\n\n\n"
                   "@triton.jit\ndef score_grad(score, b, h, q_idx, kv_idx, grad, valid, BUFS, GRADS, "
                   "ACCUMULATE: tl.constexpr):\n    return tl.where(valid, grad, 0.0)\n")
_ALL_VISIBLE = ("@triton.jit\ndef mask_mod(b, h, q_idx, kv_idx, BUFS):\n"
                "    return (q_idx >= 0) & (kv_idx >= 0)\n")


def source_of(score: ModGraph | None, mask: ModGraph | None, grad_buffers: tuple[int, ...]) -> str:
    """The module text for a pair of traced mods (buffers numbered score's first, then mask's)."""
    parts = [codegen.HEADER]
    n_score = len(score.buffers) if score is not None else 0
    if score is None:
        parts.append(_IDENTITY_SCORE)
    else:
        parts.append(codegen.score_source(score, "score_mod", 0))
        slots = {b: k for k, b in enumerate(grad_buffers)}
        parts.append("\n\n" + codegen.score_grad_source(score, "score_grad", 0, slots))
    parts.append("\n\n")
    parts.append(_ALL_VISIBLE if mask is None else codegen.mask_source(mask, "mask_mod", n_score))
    return "".join(parts)


def _import(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton resolves a jit function's globals through its module
    spec.loader.exec_module(module)
    return module


def load(source: str):
    """Import ``source`` (written to the cache folder once per hash); the same object for the same text."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    if digest in _LOADED:
        stats["reused"] += 1
        return digest, _LOADED[digest]
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"flex_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: a concurrent process reads the old or the new file whole
    stats["generated"] += 1
    module = _import(path, f"flashtile_flex_{digest}")
    _LOADED[digest] = module
    return digest, module
