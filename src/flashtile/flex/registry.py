"""Mods by key: the bridge between Python functions and ops whose schema can only carry a string.

``entry_for(score_mod, mask_mod)`` traces both mods (once per function and captured tensors), and
returns the :class:`Entry` of the pair, registered under a key. Two functions that trace to the same
graph over the same captured tensors share an entry (a lambda re-created every step costs a trace,
not a kernel build). The entry builds its Triton helpers on first use (backends/triton/flex/modules.py,
cached by the generated source's hash).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

import torch

from flashtile.backends.triton.flex import modules
from flashtile.backends.triton.flex.trace import ModGraph, trace

_TRACE_CACHE_SIZE = 256
_traces: OrderedDict = OrderedDict()  # (fn, ids of captured tensors) -> ModGraph
_entries: dict[str, Entry] = {}
_by_content: dict[tuple, str] = {}
stats = {"traced": 0}


@dataclasses.dataclass
class Entry:
    """One (score_mod, mask_mod) pair: the Python functions (the CPU path calls them), their traces, the
    captured tensors in kernel order (score_mod's, then mask_mod's) and which of them get gradients."""

    key: str
    score_mod: object
    mask_mod: object
    score_graph: ModGraph | None
    mask_graph: ModGraph | None
    buffers: tuple
    grad_buffers: tuple[int, ...]
    _kernels: object = None

    def kernels(self) -> modules.ModKernels:
        """The generated Triton helpers (built on first use, then reused)."""
        if self._kernels is None:
            source = modules.source_of(self.score_graph, self.mask_graph, self.grad_buffers)
            digest, module = modules.load(source)
            self._kernels = modules.ModKernels(digest, module, self.buffers, self.grad_buffers,
                                               self.score_graph is not None, self.mask_graph is not None)
        return self._kernels


def _captured_ids(fn) -> tuple:
    """Identities of the tensors a function's closure holds: rebinding one means a new trace."""
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for c in cells:
        try:
            v = c.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, torch.Tensor):
            out.append(id(v))
    return tuple(out)


def traced(fn, kind: str, device="cpu") -> ModGraph:
    cache_key = (fn, _captured_ids(fn), kind)
    graph = _traces.get(cache_key)
    if graph is None:
        graph = trace(fn, kind, device)
        stats["traced"] += 1
        _traces[cache_key] = graph
        if len(_traces) > _TRACE_CACHE_SIZE:
            _traces.popitem(last=False)
    else:
        _traces.move_to_end(cache_key)
    return graph


def entry_for(score_mod, mask_mod, device="cpu") -> Entry:
    """The registered entry of a pair (either may be None); raises ModCompileError for a mod that cannot
    be compiled. ``device``: the call's, where the mods are traced."""
    sg = traced(score_mod, "score", device) if score_mod is not None else None
    mg = traced(mask_mod, "mask", device) if mask_mod is not None else None
    buffers = tuple(sg.buffers if sg else ()) + tuple(mg.buffers if mg else ())
    n_score = len(sg.buffers) if sg else 0
    grads = tuple(i for i in range(n_score) if buffers[i].requires_grad and buffers[i].is_floating_point())
    content = (sg.signature() if sg else "", mg.signature() if mg else "", tuple(id(b) for b in buffers), grads)
    key = _by_content.get(content)
    if key is None:
        digest = hashlib.sha256(repr(content[:2] + content[3:]).encode()).hexdigest()[:12]
        key = f"{digest}-{len(_entries)}"
        _entries[key] = Entry(key, score_mod, mask_mod, sg, mg, buffers, grads)
        _by_content[content] = key
    return _entries[key]


def get(key: str) -> Entry:
    try:
        return _entries[key]
    except KeyError:
        raise KeyError(f"flashtile.flex: no mods registered under {key!r} in this process") from None
