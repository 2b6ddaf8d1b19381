"""The package's import graph: no cycles, and no lower layer importing a higher one (DESIGN.md, 'Layers').

Every ``import`` / ``from ... import`` of a flashtile module counts, at module level or inside a function
(a lazy import is still a dependency). Layers, lowest first; a module may import its own layer and below.
"""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# (module-name prefix, layer): the longest matching prefix wins
LAYERS = [
    ("flashtile.kernels", 0),
    ("flashtile.config", 0),
    ("flashtile.params", 0),
    ("flashtile.rng", 0),
    ("flashtile.rotary_math", 0),
    ("flashtile.first_order", 0),  # backwards whose gradients have no derivative: pure torch
    ("flashtile.backends", 1),
    ("flashtile.fp8", 1),
    ("flashtile.chunk_batch", 1),  # chunked calls as a batch of chunks: a rewrite the dispatcher applies
    ("flashtile.dispatch", 2),
    ("flashtile.validation", 2),
    ("flashtile.paged", 2),
    ("flashtile.ops", 3),
    ("flashtile.autograd", 4),
    ("flashtile.kvcache", 4),
    ("flashtile.bert_padding", 4),
    ("flashtile.flash_attn_interface", 5),
    ("flashtile.compat", 5),
    ("flashtile.hopper", 5),  # FlashAttention-3's API, beside FlashAttention 2's
    ("flashtile.flex.registry", 2),  # mods by key: the bridge from functions to op schemas
    ("flashtile.flex.ops", 3),
    ("flashtile.flex.autograd", 4),
    ("flashtile.flex.eager", 4),  # eager calls of the op's launchers, beside its autograd
    ("flashtile.flex", 5),  # FlexAttention's API
    ("flashtile", 5),  # the package's __init__
    ("flashtile.layers", 6),
    ("flashtile.distributed", 6),  # context parallelism: on the public API, under the modules
    ("flashtile.modules", 7),
    ("flashtile.integrations", 8),
    ("flashtile.bench", 9),
]


def _layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in (SRC / "flashtile").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The flashtile modules ``name`` imports (``from pkg import mod`` counts as importing pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("flashtile"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("flashtile"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    out.discard(name)
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_lower_layer_imports_a_higher_one():
    bad = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
           for m, deps in _graph().items() for d in sorted(deps)
           if _layer(d) > _layer(m) and not d.startswith(m + ".")]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if d.startswith(m + "."):  # a package importing its own submodules is not a cycle
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
