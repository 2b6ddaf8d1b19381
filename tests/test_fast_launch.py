"""The launch fast path's bookkeeping (backends/triton/host.py), on CPU.

The launch cache (on by default; FLASHTILE_FAST_LAUNCH=0 turns it off) reuses a compiled kernel for
later launches with the same argument key. The key must separate every launch Triton would compile
differently, and the argument tail must be the signature order; the launch itself is GPU-tested
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


def _key(args):
    return host._arg_key(args, require_cuda=False)


def test_key_separates_what_triton_compiles_differently():
    buf = torch.empty(64, dtype=torch.float16)
    aligned, offset = buf[:32], buf[1:33]
    assert _key([aligned]) != _key([offset])  # 16-byte alignment of a pointer
    assert _key([aligned]) == _key([buf[8:40]])  # another aligned pointer: the same kernel
    assert _key([aligned]) != _key([aligned.float()])  # dtype
    assert _key([16]) != _key([17]) != _key([1])  # divisibility by 16, and 1 as a constant
    assert _key([2**31]) != _key([16])  # i64 against i32
    assert _key([1]) != _key([True]) and _key([0]) != _key([False])  # bools are i1, not ints
    assert _key([None]) != _key([0])
    assert _key([0.5]) == _key([2.0])  # floats are not specialised on their value
    assert _key([0.5]) != _key([1])


def test_key_needs_a_cuda_tensor():
    # CPU tensors run under the interpreter, which compiles nothing to keep
    assert host._arg_key([torch.empty(4), 3]) is None
    assert host._arg_key([3, 4.0]) is None


def test_launch_hooks_turn_the_cache_off():
    # Triton 3.6's hook slots are HookChain objects, never None: the first GPU run of the cache
    # tested "is not None", so nothing was ever cached
    from triton import knobs

    assert not host.launch_hooks_set()

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert host.launch_hooks_set()
        assert host._fast_key(object(), (1,), {}) is None
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not host.launch_hooks_set()


def test_fast_key_is_off_without_a_specialisable_argument():
    kernel = SimpleNamespace()
    assert host._fast_key(kernel, ("not a kernel argument",), {}) is None


class _Compiled:
    """Stands in for Triton's CompiledKernel: records what its launcher is called with."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def test_cached_launch_pads_the_grid_to_three_dimensions(monkeypatch):
    # the compiled launcher takes three grid dimensions, then the stream, function, metadata and
    # hooks, then every parameter's value in signature order
    compiled = _Compiled()
    monkeypatch.setattr(host, "FAST_LAUNCH", True)
    monkeypatch.setattr(host, "_fast_key", lambda *a: "key")
    monkeypatch.setattr(host, "_stream", lambda device: f"stream{device}")
    monkeypatch.setitem(host._COMPILED, "key", (compiled, [5], 0))
    assert host.launch(object(), (4, 2), 1, 2, num_warps=4, num_stages=2) is compiled
    assert host.run_kernel(object(), (3,), 1, num_warps=4) is compiled
    assert compiled.calls == [(4, 2, 1, "stream0", "fn", "meta", None, None, None, 1, 2, 5),
                              (3, 1, 1, "stream0", "fn", "meta", None, None, None, 1, 5)]


def test_a_miss_launches_normally_and_remembers_the_compiled_kernel(monkeypatch):
    compiled = _Compiled()
    compiled.packed_metadata = "meta"
    seen = []

    class Kernel:
        params = [SimpleNamespace(name=n, default=None, has_default=False) for n in ("X", "n", "C")]
        arg_names = ["X", "n", "C"]

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args, kw)) or compiled

    kernel = Kernel()
    monkeypatch.setattr(host, "FAST_LAUNCH", True)
    monkeypatch.setattr(host, "_COMPILED", {})
    monkeypatch.setattr(host, "_fast_key", lambda k, args, meta: (k, tuple(meta.items()), args + (0,)))
    monkeypatch.setattr(host, "_stream", lambda device: "s")
    assert host.run_kernel(kernel, (2,), "x", 7, C=3, num_warps=4) is compiled
    assert seen == [((2,), ("x", 7), dict(C=3, num_warps=4))]
    assert list(host._COMPILED.values()) == [(compiled, [3], 0)]  # num_warps is an option, not a param
    host.run_kernel(kernel, (2,), "x", 7, C=3, num_warps=4)
    assert len(seen) == 1 and compiled.calls == [(2, 1, 1, "s", "fn", "meta", None, None, None, "x", 7, 3)]


def test_callable_grid_takes_the_normal_path(monkeypatch):
    monkeypatch.setattr(host, "FAST_LAUNCH", True)
    monkeypatch.setattr(host, "_fast_key", lambda *a: (_ for _ in ()).throw(AssertionError("keyed")))
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args))

    host.launch(Kernel(), len, 1, num_warps=4, num_stages=2)
    assert seen == [(len, (1,))]
