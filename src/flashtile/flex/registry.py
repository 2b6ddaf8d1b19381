"""Mods by key: the bridge between Python functions and ops whose schema can only carry a string.

``entry_for(score_mod, mask_mod)`` traces both mods (once per function and captured tensors), and
returns the :class:`Entry` of the pair, registered under a key. Two functions that trace to the same
graph over the same captured tensors share an entry (a lambda re-created every step costs a trace,
not a kernel build). The entry builds its Triton helpers on first use (backends/triton/flex/modules.py,
cached by the generated source's hash).
"""

from __future__ import annotations

import contextlib
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
    captured tensors in kernel order (score_mod's, then mask_mod's), which of them get gradients, and
    where score_mod reaches each of those (``grad_paths``: (buffer index, path), see :func:`locate`;
    None for one it reaches some other way)."""

    key: str
    score_mod: object
    mask_mod: object
    score_graph: ModGraph | None
    mask_graph: ModGraph | None
    buffers: tuple
    grad_buffers: tuple[int, ...]
    grad_paths: tuple = ()
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


def locate(fn, t: torch.Tensor) -> tuple | None:
    """Where ``fn`` reaches the captured tensor ``t``: ("closure", i), ("closure_attr", i, name), ("global",
    name), ("global_attr", name, attr) or ("self_attr", name) (a bound method's object); None elsewhere.
    Under torch.compile :func:`resolve` reads ``t`` back the same way, so the compiler sees the tensor as a
    graph input (one that can learn) instead of a constant."""
    def attrs(obj):
        if isinstance(obj, torch.nn.Module):
            yield from obj.named_parameters(recurse=False)
            yield from obj.named_buffers(recurse=False)
        yield from (getattr(obj, "__dict__", None) or {}).items()

    for i, c in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            v = c.cell_contents
        except ValueError:  # an empty cell
            continue
        if v is t:
            return ("closure", i)
        if not isinstance(v, torch.Tensor):
            name = next((n for n, a in attrs(v) if a is t), None)
            if name is not None:
                return ("closure_attr", i, name)
    code, globs = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in code.co_names if code else ():
        v = globs.get(name)
        if v is t:
            return ("global", name)
        if v is not None and not isinstance(v, torch.Tensor):
            attr = next((n for n, a in attrs(v) if a is t), None)
            if attr is not None:
                return ("global_attr", name, attr)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        name = next((n for n, a in attrs(owner) if a is t), None)
        if name is not None:
            return ("self_attr", name)
    return None


def resolve(fn, path: tuple) -> torch.Tensor:
    """The tensor at ``path`` (:func:`locate`) as ``fn`` sees it now (plain attribute and item reads, which
    torch.compile traces)."""
    kind = path[0]
    if kind == "closure":
        return fn.__closure__[path[1]].cell_contents
    if kind == "closure_attr":
        return getattr(fn.__closure__[path[1]].cell_contents, path[2])
    if kind == "global":
        return fn.__globals__[path[1]]
    if kind == "global_attr":
        return getattr(fn.__globals__[path[1]], path[2])
    return getattr(fn.__self__, path[1])


@contextlib.contextmanager
def substituted(fn, swaps):
    """Within the block, ``fn`` reads each (path, tensor) of ``swaps`` at its path instead of what is there
    (the CPU op's backward differentiates the mod through them); restored on exit."""
    def put(path, value):
        kind = path[0]
        if kind == "closure":
            fn.__closure__[path[1]].cell_contents = value
        elif kind == "global":
            fn.__globals__[path[1]] = value
        else:
            obj = (fn.__closure__[path[1]].cell_contents if kind == "closure_attr" else
                   fn.__globals__[path[1]] if kind == "global_attr" else fn.__self__)
            name = path[-1]
            # an nn.Module keeps parameters and buffers in dicts its __setattr__ guards: swap the entry there
            for table in ("_parameters", "_buffers"):
                d = getattr(obj, table, None)
                if isinstance(d, dict) and name in d:
                    d[name] = value
                    return
            object.__setattr__(obj, name, value)

    saved = [(path, resolve(fn, path)) for path, _ in swaps]
    try:
        for path, value in swaps:
            put(path, value)
        yield
    finally:
        for path, value in reversed(saved):
            put(path, value)


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
        paths = tuple((i, locate(score_mod, buffers[i])) for i in grads)
        _entries[key] = Entry(key, score_mod, mask_mod, sg, mg, buffers, grads, paths)
        _by_content[content] = key
    return _entries[key]


def get(key: str) -> Entry:
    try:
        return _entries[key]
    except KeyError:
        raise KeyError(f"flashtile.flex: no mods registered under {key!r} in this process") from None
