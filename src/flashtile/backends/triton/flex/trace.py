"""Trace a score_mod / mask_mod into a small expression graph that codegen turns into Triton.

A mod is a plain Python function of tensors (FlexAttention's convention):
``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``.
``make_fx`` runs it once on 1-d tensors (1-d rather than 0-d: indexing a captured tensor with a 0-d
tensor would read its value, which tracing cannot) and records the aten ops it calls. Each op maps
to one :class:`Node` of a closed vocabulary (``OPS``); anything else is refused with an error that
names the op, so a mod either compiles into the kernel exactly or not at all.

Tensors the mod captures (a bias table, document ids) appear in the trace as constants; they stay
the caller's own tensor objects, so in-place updates are seen and autograd reaches them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten

# the argument names of each kind of mod, in order
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
_TRACE_LEN = 3  # trace length: not 1, so no op can mistake an argument for a broadcast scalar


class ModCompileError(TypeError):
    """A mod uses an operation the flex kernels cannot compile; the message names it."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One value of the graph: ``op`` over ``args`` (ints index earlier nodes; floats, ints and bools in
    ``consts`` are literals), of torch dtype ``dtype``. ``op`` is one of ``OPS``, ``"input"`` (args[0]:
    the argument's name), ``"const"`` (consts[0]) or ``"load"`` (args: the buffer number, then one
    index node per dimension)."""

    op: str
    args: tuple
    dtype: torch.dtype
    consts: tuple = ()


@dataclasses.dataclass
class ModGraph:
    """A traced mod: nodes in execution order, the output node, and the captured tensors (buffers)."""

    kind: str  # "score" or "mask"
    nodes: list[Node]
    out: int
    buffers: list[torch.Tensor]

    def signature(self) -> str:
        """Text that identifies the graph and its buffers' layouts (not their values): the cache key. Every call
        of a mod looks its entry up by it, so the nodes' part, fixed once traced, is written once."""
        bufs = ";".join(f"{b.dtype}{tuple(b.shape)}{tuple(b.stride())}" for b in self.buffers)
        return f"{self.kind}|{bufs}|{self._nodes_text}"

    @functools.cached_property
    def _nodes_text(self) -> str:
        return "|".join(repr(n) for n in self.nodes) + f"|out={self.out}"


# aten op -> graph op. Binary ops take Tensor or Scalar second arguments.
_BINARY = {
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le",
    "gt": "gt", "ge": "ge", "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
    "logical_and": "and", "logical_or": "or", "logical_xor": "xor", "minimum": "minimum",
    "maximum": "maximum", "remainder": "remainder", "floor_divide": "floor_divide", "pow": "pow",
    "rsub": "rsub", "fmod": "fmod",
}
_UNARY = {
    "neg": "neg", "abs": "abs", "exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "tanh": "tanh",
    "sigmoid": "sigmoid", "sqrt": "sqrt", "rsqrt": "rsqrt", "floor": "floor", "ceil": "ceil",
    "sin": "sin", "cos": "cos", "reciprocal": "reciprocal", "bitwise_not": "not", "logical_not": "not",
    "sign": "sign", "trunc": "trunc", "relu": "relu",
}
_IDENTITY = {"clone", "alias", "detach", "lift_fresh_copy", "contiguous"}
OPS = sorted(set(_BINARY.values()) | set(_UNARY.values()) | {"where", "cast", "clamp"})


def _plain_name(target) -> tuple[str, str]:
    """('add', 'Tensor') for aten.add.Tensor."""
    name = getattr(target, "_schema", None)
    if name is None:
        return str(target), ""
    return target._schema.name.split("::")[-1], target._overloadname


def _literal(x, what: str):
    if isinstance(x, (bool, int, float)):
        if isinstance(x, float) and math.isnan(x):
            raise ModCompileError(f"{what}: a NaN constant cannot be compiled")
        return x
    raise ModCompileError(f"{what}: argument {x!r} of type {type(x).__name__} cannot be compiled")


class _Builder:
    def __init__(self, kind: str, gm: torch.fx.GraphModule):
        self.kind, self.gm = kind, gm
        self.nodes: list[Node] = []
        self.ids: dict = {}  # fx node -> graph node index
        self.buffers: list[torch.Tensor] = []
        self.consts: dict = {}  # fx get_attr node -> the captured tensor

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def const(self, value, dtype: torch.dtype) -> int:
        return self.add(Node("const", (), dtype, (value,)))

    def value(self, arg, what: str, dtype: torch.dtype | None = None) -> int:
        """Graph node of an fx argument (a node or a literal)."""
        if isinstance(arg, torch.fx.Node):
            if arg in self.consts and arg not in self.ids:  # a captured tensor used whole: 0-d only
                t = self.consts[arg]
                if t.dim() != 0:
                    raise ModCompileError(f"{what}: a captured tensor of shape {tuple(t.shape)} is used whole; "
                                          "index it with the mod's indices (table[h]) or capture a 0-d tensor")
                self.ids[arg] = self.add(Node("load", (self.buffer(t),), t.dtype))
            if arg not in self.ids:
                raise ModCompileError(f"{what}: uses {arg.name}, which is not a value the kernel can compute")
            return self.ids[arg]
        v = _literal(arg, what)
        if dtype is None:
            dtype = torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else torch.float32
        return self.const(v, dtype)

    def buffer(self, t: torch.Tensor) -> int:
        for i, b in enumerate(self.buffers):
            if b is t:
                return i
        if t.dtype.is_complex:
            raise ModCompileError("a captured complex tensor cannot be read by the kernel")
        self.buffers.append(t)
        return len(self.buffers) - 1


def _dtype_of(n: torch.fx.Node) -> torch.dtype:
    val = n.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def _convert(kind: str, gm: torch.fx.GraphModule, arg_names: tuple) -> ModGraph:
    bld = _Builder(kind, gm)
    consts = bld.consts
    placeholders = iter(arg_names)
    out = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            name = next(placeholders)
            bld.ids[n] = bld.add(Node("input", (name,), torch.float32 if name == "score" else torch.int32))
        elif n.op == "get_attr":
            consts[n] = getattr(gm, n.target)
        elif n.op == "output":
            res = n.args[0]
            if isinstance(res, (tuple, list)):
                if len(res) != 1:
                    raise ModCompileError(f"a {kind}_mod must return one tensor, not {len(res)}")
                res = res[0]
            out = bld.value(res, f"the {kind}_mod's result")
        elif n.op == "call_function":
            _convert_call(bld, n, consts)
        else:
            raise ModCompileError(f"{n.op} {n.target} cannot be compiled")
    return ModGraph(kind, bld.nodes, out, bld.buffers)


def _convert_call(bld: _Builder, n: torch.fx.Node, consts: dict) -> None:
    name, overload = _plain_name(n.target)
    what = f"torch.ops.aten.{name}.{overload}" if overload else str(n.target)
    dtype = _dtype_of(n)
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() > 1 or (isinstance(val, torch.Tensor) and val.dim() == 1
                                                           and val.shape[0] != _TRACE_LEN):
        raise ModCompileError(f"{what} makes a tensor of shape {tuple(val.shape)}: a mod must compute one value "
                              "per (b, h, q_idx, kv_idx), elementwise")
    args = n.args
    if name == "index" and overload == "Tensor":
        src = args[0]
        if src not in consts:
            raise ModCompileError(f"{what}: only captured tensors can be indexed")
        t = consts[src]
        idx = list(args[1])
        if any(i is None for i in idx) or len(idx) != t.dim():
            raise ModCompileError(f"{what}: index every dimension of a captured tensor of shape {tuple(t.shape)} "
                                  "with a tensor (no slices), e.g. table[h, q_idx - kv_idx]")
        ids = [bld.value(i, what) for i in idx]
        bld.ids[n] = bld.add(Node("load", (bld.buffer(t), *ids), t.dtype))
        return
    if name in _IDENTITY:
        if args[0] in consts:
            consts[n] = consts[args[0]]
            return
        bld.ids[n] = bld.value(args[0], what)
        return
    if name in ("scalar_tensor", "full", "full_like", "zeros_like", "ones_like", "new_ones", "new_zeros",
                "new_full"):
        v = {"zeros_like": 0, "ones_like": 1, "new_zeros": 0, "new_ones": 1}.get(name)
        if name == "new_full":
            v = args[2]
        if v is None:
            v = args[0] if name == "scalar_tensor" else args[1]
        bld.ids[n] = bld.const(_literal(v, what), dtype)
        return
    if name in ("_to_copy", "to", "_to_dtype"):
        bld.ids[n] = bld.add(Node("cast", (bld.value(args[0], what),), dtype))
        return
    if name == "where" and overload in ("self", "ScalarSelf", "ScalarOther", "Scalar"):
        c = bld.value(args[0], what)
        a, b = (bld.value(x, what, dtype) for x in args[1:3])
        bld.ids[n] = bld.add(Node("where", (c, a, b), dtype))
        return
    if name == "clamp":
        lo = args[1] if len(args) > 1 else n.kwargs.get("min")
        hi = args[2] if len(args) > 2 else n.kwargs.get("max")
        x = bld.value(args[0], what)
        bld.ids[n] = bld.add(Node("clamp", (x,), dtype, (lo, hi)))
        return
    if name in ("clamp_min", "clamp_max"):
        x = bld.value(args[0], what)
        lim = (args[1], None) if name == "clamp_min" else (None, args[1])
        bld.ids[n] = bld.add(Node("clamp", (x,), dtype, lim))
        return
    if name == "div" and overload in ("Tensor_mode", "Scalar_mode"):
        mode = n.kwargs.get("rounding_mode")
        a, b = bld.value(args[0], what), bld.value(args[1], what)
        op = {"floor": "floor_divide", "trunc": "trunc_divide", None: "div"}[mode]
        bld.ids[n] = bld.add(Node(op, (a, b), dtype))
        return
    if name in _UNARY and len(args) == 1:
        bld.ids[n] = bld.add(Node(_UNARY[name], (bld.value(args[0], what),), dtype))
        return
    if name in _BINARY and len(args) == 2:
        a = bld.value(args[0], what)
        b = bld.value(args[1], what)
        if n.kwargs.get("alpha", 1) != 1:
            raise ModCompileError(f"{what} with alpha cannot be compiled; write x + alpha * y")
        bld.ids[n] = bld.add(Node(_BINARY[name], (a, b), dtype))
        return
    raise ModCompileError(f"{what} cannot be compiled into a flex kernel (supported: {', '.join(OPS)}, "
                          "indexing a captured tensor, casts and constants)")


def trace(fn, kind: str, device="cpu") -> ModGraph:
    """The :class:`ModGraph` of ``fn`` (``kind``: "score" or "mask"); raises :class:`ModCompileError`.
    ``device``: the call's, where the tensors a mod captures live (a mod that indexes a CUDA table with
    CPU indices would not trace); the graph itself does not depend on it."""
    names = SCORE_ARGS if kind == "score" else MASK_ARGS
    args = [torch.zeros(_TRACE_LEN, dtype=torch.float32 if a == "score" else torch.int32, device=device)
            for a in names]
    if inspect.ismethod(fn):  # make_fx counts a bound method's self among the arguments it expects
        method = fn
        fn = ((lambda score, b, h, q_idx, kv_idx: method(score, b, h, q_idx, kv_idx)) if kind == "score"
              else (lambda b, h, q_idx, kv_idx: method(b, h, q_idx, kv_idx)))
    try:
        gm = make_fx(fn)(*args)
    except ModCompileError:
        raise
    except Exception as exc:  # data-dependent Python control flow, .item(), unsupported tensor creation
        raise ModCompileError(f"the {kind}_mod {getattr(fn, '__name__', fn)!r} cannot be traced: {exc}. "
                              "Write it with tensor operations only (torch.where instead of if).") from exc
    graph = _convert(kind, gm, names)
    out_dtype = graph.nodes[graph.out].dtype
    if kind == "mask" and out_dtype != torch.bool:
        raise ModCompileError(f"a mask_mod must return a bool tensor, got {out_dtype}")
    if kind == "score" and not out_dtype.is_floating_point:
        raise ModCompileError(f"a score_mod must return a floating-point tensor, got {out_dtype}")
    return graph
