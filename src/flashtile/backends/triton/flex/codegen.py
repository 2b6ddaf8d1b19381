"""Triton source of a traced mod (trace.ModGraph): a forward helper and, for score mods, its gradient.

Each graph node becomes one line ``t<i> = <expression>`` of a ``@triton.jit`` helper that the flex
kernels call on a whole tile (score ``[M, N]`` fp32, ``q_idx`` / ``kv_idx`` broadcastable index tiles,
``b`` / ``h`` scalars). Types follow torch's: an arithmetic node casts its operands to its own dtype,
a comparison casts them to their common dtype, so the kernel computes what the traced ops computed.

The gradient helper is reverse-mode differentiation of the same graph: the forward lines, then one
adjoint per floating node that lies between an input being differentiated (the score, a captured
tensor that requires grad) and the output. A captured tensor's adjoint is added into its fp32 gradient
buffer with ``tl.atomic_add`` (summed over the tile first when its index depends on b and h only).
"""

from __future__ import annotations

import torch

from flashtile.backends.triton.flex.trace import ModCompileError, ModGraph, Node

_TL = {
    torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "and": "&", "or": "|", "xor": "^", "fmod": "%"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_CALL = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sigmoid": "tl.sigmoid",
         "sqrt": "tl.sqrt", "rsqrt": "tl.rsqrt", "floor": "tl.floor", "ceil": "tl.ceil", "sin": "tl.sin",
         "cos": "tl.cos", "abs": "tl.abs", "tanh": "_tanh"}
HEADER = ("import triton\nimport triton.language as tl\n\n"
          "from flashtile.kernels.attn_fwd import _tanh  # noqa: F401  (tanh through exp2)\n\n")


def _tl(dtype: torch.dtype) -> str:
    if dtype not in _TL:
        raise ModCompileError(f"dtype {dtype} cannot be computed in a flex kernel")
    return _TL[dtype]


def _literal(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


class _Emitter:
    """Expressions of a graph's nodes, with buffers numbered from ``buffer_base`` in the kernel's tuple."""

    def __init__(self, graph: ModGraph, buffer_base: int):
        self.g, self.base = graph, buffer_base

    def ref(self, i: int, dtype: torch.dtype | None = None) -> str:
        """Node i as an operand, cast to ``dtype`` (literals stay literals: Triton types them weakly)."""
        n = self.g.nodes[i]
        if n.op == "const":
            v = n.consts[0]
            if dtype is not None and dtype.is_floating_point and isinstance(v, (bool, int)):
                v = float(v)
            return _literal(v)
        if dtype is None or dtype == n.dtype:
            return f"t{i}"
        return self.cast(f"t{i}", n.dtype, dtype)

    @staticmethod
    def cast(x: str, src: torch.dtype, dst: torch.dtype) -> str:
        if dst == torch.bool:
            return f"({x} != 0)"
        return f"{x}.to({_tl(dst)})"

    def offset(self, n: Node) -> str:
        buf = self.g.buffers[n.args[0]]
        terms = [f"{self.ref(i)} * {s}" for i, s in zip(n.args[1:], buf.stride())]
        return " + ".join(terms) if terms else "0"

    def expr(self, i: int) -> str:
        n = self.g.nodes[i]
        op, a, d = n.op, n.args, n.dtype
        if op == "input":
            return a[0]
        if op == "const":
            return self.ref(i)
        if op == "load":
            return f"tl.load(BUFS[{self.base + a[0]}] + ({self.offset(n)}))"
        if op == "cast":
            return self.cast(self.ref(a[0]), self.g.nodes[a[0]].dtype, d)
        if op in _COMPARE:
            common = torch.promote_types(*(self.g.nodes[j].dtype for j in a))
            return f"({self.ref(a[0], common)} {_COMPARE[op]} {self.ref(a[1], common)})"
        if op in _INFIX:
            return f"({self.ref(a[0], d)} {_INFIX[op]} {self.ref(a[1], d)})"
        if op == "rsub":
            return f"({self.ref(a[1], d)} - {self.ref(a[0], d)})"
        if op == "neg":
            return f"(-{self.ref(a[0], d)})"
        if op == "not":
            return f"({self.ref(a[0])} == 0)" if d == torch.bool else f"(~{self.ref(a[0])})"
        if op in _CALL:
            return f"{_CALL[op]}({self.ref(a[0], d)})"
        if op == "reciprocal":
            return f"(1.0 / {self.ref(a[0], d)})"
        if op == "relu":
            return f"tl.maximum({self.ref(a[0], d)}, 0)"
        if op == "sign":
            x = self.ref(a[0], d)
            return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({_tl(d)})"
        if op == "trunc":
            x = self.ref(a[0], d)
            return f"tl.where({x} >= 0, tl.floor({x}), tl.ceil({x}))"
        if op in ("minimum", "maximum"):
            return f"tl.{op}({self.ref(a[0], d)}, {self.ref(a[1], d)})"
        if op == "where":
            return f"tl.where({self.ref(a[0])}, {self.ref(a[1], d)}, {self.ref(a[2], d)})"
        if op == "clamp":
            x = self.ref(a[0], d)
            lo, hi = n.consts
            if lo is not None:
                x = f"tl.maximum({x}, {_literal(lo)})"
            if hi is not None:
                x = f"tl.minimum({x}, {_literal(hi)})"
            return x
        if op in ("remainder", "floor_divide", "trunc_divide"):
            x, y = self.ref(a[0], d), self.ref(a[1], d)
            if d.is_floating_point:
                q = f"tl.floor({x} / {y})" if op != "trunc_divide" else f"({x} / {y})"
                if op == "trunc_divide":
                    return f"tl.where({q} >= 0, tl.floor({q}), tl.ceil({q}))"
                return q if op == "floor_divide" else f"({x} - {y} * {q})"
            if op == "trunc_divide":
                return f"({x} // {y})"
            # Triton's integer // and % truncate toward zero (C); torch's floor: correct by the signs
            wrong = f"((({x} % {y}) != 0) & ((({x} % {y}) < 0) != ({y} < 0)))"
            if op == "remainder":
                return f"tl.where({wrong}, ({x} % {y}) + {y}, {x} % {y})"
            return f"(({x} // {y}) - {wrong}.to({_tl(d)}))"
        if op == "pow":
            e = self.g.nodes[a[1]]
            x = self.ref(a[0], d)
            if e.op == "const" and float(e.consts[0]) == 2.0:
                return f"({x} * {x})"
            if e.op == "const" and float(e.consts[0]) == 0.5:
                return f"tl.sqrt({x})"
            if d.is_floating_point:  # x > 0 (as torch's for a non-integer exponent)
                return f"tl.exp2({self.ref(a[1], d)} * tl.log2({x}))"
        raise ModCompileError(f"operation {op} on {d} cannot be compiled into a flex kernel")

    def forward_lines(self) -> list[str]:
        lines = []
        for i, n in enumerate(self.g.nodes):
            if n.op != "const":
                lines.append(f"    t{i} = {self.expr(i)}")
        return lines


def _depends(graph: ModGraph, roots) -> list[bool]:
    dep = [False] * len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        if i in roots:
            dep[i] = True
        elif n.op not in ("input", "const") and n.op != "load":
            dep[i] = any(dep[j] for j in n.args if isinstance(j, int))
        elif n.op == "load":
            dep[i] = any(dep[j] for j in n.args[1:])
    return dep


def _out_ref(em: _Emitter, graph: ModGraph, dtype: torch.dtype) -> str:
    out = graph.out
    if graph.nodes[out].op == "const":  # a constant mod: shaped like the tile
        return f"({em.ref(out, dtype)} + 0 * q_idx + 0 * kv_idx)"
    return em.ref(out, dtype)


def mask_source(graph: ModGraph, name: str, buffer_base: int) -> str:
    """``name(b, h, q_idx, kv_idx, BUFS) -> bool tile``."""
    em = _Emitter(graph, buffer_base)
    body = em.forward_lines() + [f"    return {_out_ref(em, graph, torch.bool)}"]
    return f"@triton.jit\ndef {name}(b, h, q_idx, kv_idx, BUFS):\n" + "\n".join(body) + "\n"


def score_source(graph: ModGraph, name: str, buffer_base: int) -> str:
    """``name(score, b, h, q_idx, kv_idx, BUFS) -> fp32 tile``."""
    em = _Emitter(graph, buffer_base)
    body = em.forward_lines() + [f"    return {_out_ref(em, graph, torch.float32)}"]
    return f"@triton.jit\ndef {name}(score, b, h, q_idx, kv_idx, BUFS):\n" + "\n".join(body) + "\n"


def _adjoints(graph: ModGraph, em: _Emitter, i: int, g: str) -> list[tuple[int, str]]:
    """(operand, contribution) pairs of node i's adjoint ``g`` (a name) to its floating operands."""
    n = graph.nodes[i]
    op, a, d = n.op, n.args, n.dtype
    t = f"t{i}"
    x = em.ref(a[0], d) if a and isinstance(a[0], int) and op not in ("input", "load") else None
    if op in ("add",):
        return [(a[0], g), (a[1], g)]
    if op == "sub":
        return [(a[0], g), (a[1], f"(-{g})")]
    if op == "rsub":
        return [(a[0], f"(-{g})"), (a[1], g)]
    if op == "mul":
        return [(a[0], f"{g} * {em.ref(a[1], d)}"), (a[1], f"{g} * {x}")]
    if op == "div":
        y = em.ref(a[1], d)
        return [(a[0], f"{g} / {y}"), (a[1], f"(-{g} * {t} / {y})")]
    if op == "neg":
        return [(a[0], f"(-{g})")]
    if op == "abs":
        return [(a[0], f"tl.where({x} > 0, {g}, tl.where({x} < 0, -{g}, 0.0))")]
    if op in ("exp",):
        return [(a[0], f"{g} * {t}")]
    if op == "exp2":
        return [(a[0], f"{g} * {t} * 0.6931471805599453")]
    if op == "log":
        return [(a[0], f"{g} / {x}")]
    if op == "log2":
        return [(a[0], f"{g} / ({x} * 0.6931471805599453)")]
    if op == "tanh":
        return [(a[0], f"{g} * (1.0 - {t} * {t})")]
    if op == "sigmoid":
        return [(a[0], f"{g} * {t} * (1.0 - {t})")]
    if op == "sqrt":
        return [(a[0], f"{g} * 0.5 / {t}")]
    if op == "rsqrt":
        return [(a[0], f"{g} * -0.5 * {t} * {t} * {t}")]
    if op == "reciprocal":
        return [(a[0], f"(-{g} * {t} * {t})")]
    if op == "sin":
        return [(a[0], f"{g} * tl.cos({x})")]
    if op == "cos":
        return [(a[0], f"(-{g} * tl.sin({x}))")]
    if op == "relu":
        return [(a[0], f"tl.where({x} > 0, {g}, 0.0)")]
    if op in ("floor", "ceil", "sign", "trunc", "floor_divide", "trunc_divide"):
        return []
    if op == "remainder":  # x - y * floor(x / y)
        return [(a[0], g), (a[1], f"(-{g} * tl.floor({x} / {em.ref(a[1], d)}))")]
    if op == "where":
        c = em.ref(a[0])
        return [(a[1], f"tl.where({c}, {g}, 0.0)"), (a[2], f"tl.where({c}, 0.0, {g})")]
    if op in ("minimum", "maximum"):  # ties split the gradient evenly, as torch's
        y = em.ref(a[1], d)
        win = ">" if op == "maximum" else "<"
        return [(a[0], f"tl.where({x} {win} {y}, {g}, tl.where({x} == {y}, 0.5 * {g}, 0.0))"),
                (a[1], f"tl.where({y} {win} {x}, {g}, tl.where({x} == {y}, 0.5 * {g}, 0.0))")]
    if op == "clamp":
        lo, hi = n.consts
        ok = " & ".join(c for c in ((f"({x} >= {_literal(lo)})" if lo is not None else ""),
                                    (f"({x} <= {_literal(hi)})" if hi is not None else "")) if c) or "True"
        return [(a[0], f"tl.where({ok}, {g}, 0.0)")]
    if op == "cast":
        return [(a[0], g)]
    if op == "pow":
        e = graph.nodes[a[1]]
        if e.op == "const":
            c = float(e.consts[0])
            if c == 2.0:
                return [(a[0], f"{g} * 2.0 * {x}")]
            return [(a[0], f"{g} * {_literal(c)} * tl.exp2({_literal(c - 1.0)} * tl.log2({x}))")]
    raise ModCompileError(f"the gradient of {op} cannot be compiled into a flex kernel")


def score_grad_source(graph: ModGraph, name: str, buffer_base: int, grad_slots: dict[int, int]) -> str:
    """``name(score, b, h, q_idx, kv_idx, grad, valid, BUFS, GRADS, ACCUMULATE) -> dscore``: the score's
    gradient given the output's (``grad``), zero where ``valid`` is False; with ACCUMULATE, captured
    tensors in ``grad_slots`` (buffer number -> position in GRADS) get theirs added atomically."""
    em = _Emitter(graph, buffer_base)
    nodes = graph.nodes
    score = next(i for i, n in enumerate(nodes) if n.op == "input" and n.args[0] == "score")
    trainable = {i for i, n in enumerate(nodes) if n.op == "load" and n.args[0] in grad_slots}
    reach = _depends(graph, {score} | trainable)
    # live: the output depends on it through floating nodes
    live = [False] * len(nodes)
    live[graph.out] = True
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if live[i] and n.dtype.is_floating_point and n.op not in ("input", "const", "load"):
            for j in n.args:
                if isinstance(j, int) and nodes[j].dtype.is_floating_point:
                    live[j] = True
    q_dep = _depends(graph, {i for i, n in enumerate(nodes) if n.op == "input" and n.args[0] in ("q_idx", "kv_idx")})
    lines = em.forward_lines()
    contrib: dict[int, list[str]] = {graph.out: ["grad"]}
    atomics = []
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if not (reach[i] and live[i]) or i not in contrib:
            continue
        lines.append(f"    g{i} = " + " + ".join(contrib[i]))
        if n.op == "load":
            off = em.offset(n)
            ptr = f"GRADS[{grad_slots[n.args[0]]}]"
            if any(q_dep[j] for j in n.args[1:]):
                atomics.append(f"        tl.atomic_add({ptr} + ({off}) + tile0, g{i}, mask=valid, sem='relaxed')")
            else:  # one address for the whole tile: sum first
                total = f"tl.sum(tl.sum(tl.where(valid, g{i}, 0.0), 1), 0)"
                atomics.append(f"        tl.atomic_add({ptr} + ({off}), {total}, sem='relaxed')")
            continue
        if n.op == "input":
            continue
        for j, c in _adjoints(graph, em, i, f"g{i}"):
            if reach[j] and live[j] and nodes[j].dtype.is_floating_point:
                contrib.setdefault(j, []).append(f"({c})")
    if atomics:
        lines.append("    if ACCUMULATE:")
        lines.append("        tile0 = q_idx * 0 + kv_idx * 0")
        lines += atomics
    dscore = f"g{score}" if score in contrib and reach[score] and live[score] else "0.0 * grad"
    lines.append(f"    return tl.where(valid, {dscore}, 0.0)")
    return (f"@triton.jit\ndef {name}(score, b, h, q_idx, kv_idx, grad, valid, BUFS, GRADS, "
            "ACCUMULATE: tl.constexpr):\n" + "\n".join(lines) + "\n")
