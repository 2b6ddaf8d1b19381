"""The launch fast path's bookkeeping (backends/triton/host.py), on CPU.

The fast path (FLASHTILE_FAST_LAUNCH=1, off by default) reuses a compiled kernel for later launches
with the same argument specialisation. Its key must separate every launch Triton would compile
differently, and its argument tail must be the signature order; the launch itself is GPU-tested
(tests/test_gpu_fast_launch.py).
"""

from types import SimpleNamespace

import torch

from flashtile.backends.triton import host


def _param(name, default=None, has_default=False):
    return SimpleNamespace(name=name, default=default, has_default=has_default)


def test_tail_takes_keywords_then_defaults_in_signature_order():
    kernel = SimpleNamespace(params=[_param("X"), _param("n"), _param("A"), _param("B", 7, True), _param("C")],
                             arg_names=["X", "n", "A", "B", "C"])
    assert host.launch_tail(kernel, 2, dict(C=3, A=1)) == [1, 7, 3]
    assert host.launch_tail(kernel, 2, dict(A=1)) is None  # C has no value: the normal path raises
    assert host.launch_tail(kernel, 2, dict(A=1, C=3, Z=0)) is None  # an unknown keyword


def test_key_separates_what_triton_compiles_differently():
    buf = torch.empty(64, dtype=torch.float16)
    aligned, offset = buf[:32], buf[1:33]
    spec = host._specialisation
    assert spec([aligned]) != spec([offset])  # 16-byte alignment of a pointer
    assert spec([aligned]) != spec([aligned.float()])  # dtype
    assert spec([16]) != spec([17]) != spec([1])  # divisibility by 16, and 1 as a constant
    assert spec([2**31]) != spec([16])  # i64 against i32
    assert spec([0.5]) == spec([2.0])  # floats are not specialised on their value
    assert spec([17]) == spec([33])


def test_fast_key_is_off_without_a_specialisable_argument():
    kernel = SimpleNamespace()
    assert host._fast_key(kernel, ("not a kernel argument",), 4, 2, {}) is None


class _Compiled:
    """Stands in for Triton's CompiledKernel: records the grid it is indexed with."""

    def __init__(self):
        self.grids, self.calls = [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args: self.calls.append(args)


def test_cached_launch_pads_the_grid_to_three_dimensions(monkeypatch):
    # Triton's compiled-kernel runner reads grid[0], grid[1], grid[2]; the first H200 run of the
    # fast path failed with "tuple index out of range" on a 2-D grid.
    compiled = _Compiled()
    monkeypatch.setattr(host, "FAST_LAUNCH", True)
    monkeypatch.setattr(host, "_fast_key", lambda *a: "key")
    monkeypatch.setitem(host._COMPILED, "key", (compiled, [5]))
    assert host.launch(object(), (4, 2), 1, 2, num_warps=4, num_stages=2) is compiled
    assert host.launch(object(), (3,), 1, num_warps=4, num_stages=2) is compiled
    assert compiled.grids == [(4, 2, 1), (3, 1, 1)]
    assert compiled.calls == [(1, 2, 5), (1, 5)]


def test_callable_grid_takes_the_normal_path(monkeypatch):
    monkeypatch.setattr(host, "FAST_LAUNCH", True)
    monkeypatch.setattr(host, "_fast_key", lambda *a: (_ for _ in ()).throw(AssertionError("keyed")))
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args))

    host.launch(Kernel(), len, 1, num_warps=4, num_stages=2)
    assert seen == [(len, (1,))]
