"""The launch cache's bookkeeping (backends/triton/fast_launch.py, used by host.py), on CPU.

The launch cache (config.fast_launch, on by default; FLASHTILE_FAST_LAUNCH=0 turns it off) reuses a
compiled kernel for later launches with the same argument key. The key must separate every launch Triton
would compile differently, and the argument tail must be the signature order; without Triton's private
launch API every launch must still work through the public path. The cached launch itself is GPU-tested
(tests/test_gpu_fast_launch.py).
"""

import importlib.util
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import fast_launch, host


def _param(name, default=None, has_default=False):
    return SimpleNamespace(name=name, default=default, has_default=has_default)


def test_tail_takes_keywords_then_defaults_in_signature_order():
    kernel = SimpleNamespace(params=[_param("X"), _param("n"), _param("A"), _param("B", 7, True), _param("C")],
                             arg_names=["X", "n", "A", "B", "C"])
    assert fast_launch.launch_tail(kernel, 2, dict(C=3, A=1)) == [1, 7, 3]
    assert fast_launch.launch_tail(kernel, 2, dict(A=1)) is None  # C has no value: the normal path raises
    assert fast_launch.launch_tail(kernel, 2, dict(A=1, C=3, Z=0)) is None  # an unknown keyword


def _key(args, n_plain=None):
    return fast_launch._arg_key(args, n_plain, require_cuda=False)


def test_key_separates_what_triton_compiles_differently():
    buf = torch.empty(64, dtype=torch.float16)
    aligned, offset = buf[:32], buf[1:33]
    assert _key([aligned]) != _key([offset])  # 16-byte alignment of a pointer
    assert _key([aligned]) == _key([buf[8:40]])  # another aligned pointer: the same kernel
    assert _key([aligned]) != _key([aligned.float()])  # dtype
    assert len({_key([16]), _key([17]), _key([1])}) == 3  # divisibility by 16, and 1 as a constant
    assert _key([2**31]) != _key([16]) and _key([2**31 + 1]) != _key([17])  # i64 against i32
    assert _key([2**63]) != _key([2**62])  # u64 against i64
    assert _key([1]) != _key([True]) and _key([0]) != _key([False])  # bools are i1, not ints
    assert _key([None]) != _key([0])
    assert _key([0.5]) != _key([1])


def test_key_shares_what_triton_compiles_alike():
    # per-call values (dropout seeds, cache lengths) must not miss the cache on every call
    assert _key([17]) == _key([33]) == _key([12345])
    assert _key([16]) == _key([-32]) == _key([4096])
    assert _key([0.5]) == _key([2.0])  # floats are not specialised on their value
    assert _key([True]) == _key([False])  # nor bools


def test_constexpr_positions_are_keyed_on_their_value():
    assert _key([17, 5], n_plain=1) != _key([17, 6], n_plain=1)
    assert _key([17, 1], n_plain=1) != _key([17, True], n_plain=1)
    assert _key([17, 0.5], n_plain=1) != _key([17, 2.0], n_plain=1)
    assert _key([17, 33], n_plain=2) == _key([33, 17], n_plain=2)


def test_n_plain_counts_the_parameters_before_the_first_constexpr():
    kernel = SimpleNamespace(params=[SimpleNamespace(is_constexpr=c) for c in (False, False, True, False)])
    assert fast_launch._n_plain(kernel) == 2
    assert fast_launch._n_plain(SimpleNamespace(params=[SimpleNamespace(is_constexpr=False)])) == 1


def test_key_needs_a_cuda_tensor():
    # CPU tensors run under the interpreter, which compiles nothing to keep
    assert fast_launch._arg_key([torch.empty(4), 3]) is None
    assert fast_launch._arg_key([3, 4.0]) is None


def _keyable(monkeypatch):
    monkeypatch.setattr(fast_launch, "_arg_key", lambda args, n_plain=None, require_cuda=True: tuple(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return SimpleNamespace(params=[], pre_run_hooks=[])


def test_keywords_are_keyed_on_type_and_value(monkeypatch):
    kernel = _keyable(monkeypatch)
    assert fast_launch._fast_key(kernel, (3,), dict(R=0)) == fast_launch._fast_key(kernel, (3,), dict(R=0))
    assert fast_launch._fast_key(kernel, (3,), dict(R=0)) != fast_launch._fast_key(kernel, (3,), dict(R=False))
    assert fast_launch._fast_key(kernel, (3,), dict(N=16)) != fast_launch._fast_key(kernel, (3,), dict(N=16.0))


def test_launch_hooks_turn_the_cache_off(monkeypatch):
    # Triton 3.6's hook slots are HookChain objects, never None: the first GPU run of the cache
    # tested "is not None", so nothing was ever cached
    from triton import knobs

    kernel = _keyable(monkeypatch)
    assert not fast_launch.launch_hooks_set()
    assert fast_launch._fast_key(kernel, (1,), {}) is not None

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fast_launch.launch_hooks_set()
        assert fast_launch._fast_key(kernel, (1,), {}) is None
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not fast_launch.launch_hooks_set()
    kernel.pre_run_hooks.append(hook)
    assert fast_launch._fast_key(kernel, (1,), {}) is None


def test_a_full_cache_evicts_its_oldest_entry(monkeypatch):
    compiled = _Compiled()
    kernel = SimpleNamespace(params=[], arg_names=[])
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    monkeypatch.setattr(fast_launch, "_COMPILED_MAX", 2)
    for i in range(3):
        fast_launch.remember(("key", i, 0), kernel, compiled, 0, {})
    assert list(fast_launch._COMPILED) == [("key", 1, 0), ("key", 2, 0)]


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
    compiled, kernel = _Compiled(), object()
    monkeypatch.setattr(fast_launch, "_fast_key", lambda *a: "key")
    monkeypatch.setattr(fast_launch, "_stream", lambda device: f"stream{device}")
    monkeypatch.setitem(fast_launch._COMPILED, "key", (compiled, [5], 0, kernel))
    assert host.launch(kernel, (4, 2), 1, 2, num_warps=4, num_stages=2) is compiled
    assert host.run_kernel(kernel, (3,), 1, num_warps=4) is compiled
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
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    monkeypatch.setattr(fast_launch, "_fast_key", lambda k, args, meta, options=(): (k, tuple(meta.items()), args, 0))
    monkeypatch.setattr(fast_launch, "_stream", lambda device: "s")
    assert host.run_kernel(kernel, (2,), "x", 7, C=3, num_warps=4) is compiled
    assert seen == [((2,), ("x", 7), dict(C=3, num_warps=4))]
    assert list(fast_launch._COMPILED.values()) == [(compiled, [3], 0, kernel)]  # num_warps is an option, not a param
    host.run_kernel(kernel, (2,), "x", 7, C=3, num_warps=4)
    assert len(seen) == 1 and compiled.calls == [(2, 1, 1, "s", "fn", "meta", None, None, None, "x", 7, 3)]


def test_callable_grid_takes_the_normal_path(monkeypatch):
    monkeypatch.setattr(fast_launch, "_fast_key", lambda *a: (_ for _ in ()).throw(AssertionError("keyed")))
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, args))

    host.launch(Kernel(), len, 1, num_warps=4, num_stages=2)
    assert seen == [(len, (1,))]


def test_an_entry_serves_only_the_kernel_it_was_made_for(monkeypatch):
    # keys hold id(kernel): a new object that reuses a freed kernel's id must not get its entry
    compiled = _Compiled()
    seen = []

    class Kernel:
        params, arg_names = [], []

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(grid) or compiled

    monkeypatch.setattr(fast_launch, "_fast_key", lambda *a: "same key")
    monkeypatch.setitem(fast_launch._COMPILED, "same key", (compiled, [], 0, object()))
    host.run_kernel(Kernel(), (1,))
    assert seen == [(1,)] and not compiled.calls  # launched the normal way


_BOUNDARIES = [0, 1, 2, 15, 16, 17, 32, -1, -15, -16, -17, 2**31 - 17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
               -2**31, -2**31 - 1, -2**31 - 16, 2**32, 2**62, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16,
               2**64 - 16, 2**64 - 1, -2**63, -2**63 + 16]


def test_int_classes_never_merge_what_triton_compiles_apart():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def triton_spec(a):
        return native_specialize_impl(BaseBackend, a, False, True, True)

    for a in _BOUNDARIES:
        for b in _BOUNDARIES:
            if fast_launch._int_class(a) == fast_launch._int_class(b):
                assert triton_spec(a) == triton_spec(b), (a, b)


def test_inline_int_keys_equal_int_class():
    # _arg_key computes an i32's class inline (the launch path's common case): the same value _int_class gives,
    # at every boundary and in the constexpr tail as its exact value
    for a in _BOUNDARIES + list(range(-40, 40)):
        if -2**63 <= a < 2**64:
            assert _key([a]) == (fast_launch._int_class(a),), a
            assert _key([a, a], n_plain=1) == (fast_launch._int_class(a), (int, a)), a


def test_ints_triton_refuses_take_the_normal_path():
    assert _key([2**64]) is None and _key([-2**63 - 1]) is None
    assert _key([2**64 - 1]) is not None and _key([-2**63]) is not None


def _jit_like(n_plain):
    return SimpleNamespace(params=[SimpleNamespace(is_constexpr=i >= n_plain) for i in range(n_plain + 2)],
                           pre_run_hooks=[])


def test_fast_key_parts(monkeypatch):
    from triton import knobs

    kernel = _jit_like(1)
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])

    def key(args, meta=None):
        return fast_launch._fast_key(kernel, args, meta or {}, require_cuda=False)

    assert key((17, 64)) != key((17, 128))  # a constexpr by position: its value
    assert key((17, 64)) == key((33, 64))  # the plain int: its class
    base = key((17, 64))
    device[0] = 1
    assert key((17, 64)) != base  # the current device
    device[0] = 0
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    assert key((17, 64)) != base  # Triton's debug knob
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    # launch()'s compile options (num_warps, num_stages)
    assert fast_launch._fast_key(kernel, (17, 64), {}, (4, 2), require_cuda=False) != \
        fast_launch._fast_key(kernel, (17, 64), {}, (8, 2), require_cuda=False)
    not_jit = SimpleNamespace(pre_run_hooks=[])
    assert fast_launch._fast_key(not_jit, (17,), {}, require_cuda=False) is None  # not a JIT kernel


# ------------------------------------------------------------------ without Triton's private launch API

def _load_copy(monkeypatch, blocked: str):
    """A fresh copy of fast_launch.py imported while ``blocked`` cannot be imported."""
    monkeypatch.setitem(sys.modules, blocked, None)  # "import blocked" then raises ImportError
    spec = importlib.util.spec_from_file_location("fast_launch_copy", fast_launch.__file__)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
    return module, caught


class _RecordingKernel:
    """Stands in for a JIT kernel: records launches through kernel[grid](...)."""

    params, arg_names, pre_run_hooks = [], [], []

    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launched.append((grid, args)) or "normal"


@pytest.mark.parametrize("blocked", ["triton._C.libtriton", "triton.backends.compiler"])
def test_a_missing_private_api_turns_the_cache_off_at_import(monkeypatch, blocked):
    module, caught = _load_copy(monkeypatch, blocked)
    assert not module.AVAILABLE
    assert any("launch cache is off" in str(w.message) for w in caught)
    monkeypatch.setattr(host, "fast_launch", module)
    monkeypatch.setattr(module, "_arg_key", lambda *a, **kw: ("keyable",))  # would be cached if it could
    kernel = _RecordingKernel()
    assert module.key_for(kernel, (1,), (1,), {}) is None
    assert host.run_kernel(kernel, (2,), 1) == "normal"
    assert host.launch(kernel, (3,), 1, num_warps=4, num_stages=2) == "normal"
    assert kernel.launched == [((2,), (1,)), ((3,), (1,))] and not module._COMPILED


def _broken_at_first_use(monkeypatch):
    monkeypatch.setattr(fast_launch, "AVAILABLE", True)
    monkeypatch.setattr(fast_launch, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_arg_key", lambda *a, **kw: ("keyable",))


def test_a_private_api_that_raises_at_first_use_turns_the_cache_off(monkeypatch):
    _broken_at_first_use(monkeypatch)
    monkeypatch.setattr(fast_launch, "knobs", SimpleNamespace())  # no knobs.runtime: another Triton
    kernel = _RecordingKernel()
    with pytest.warns(RuntimeWarning, match="launch cache is off"):
        assert host.run_kernel(kernel, (2,), 1) == "normal"
    assert not fast_launch.AVAILABLE
    assert host.launch(kernel, (3,), 1, num_warps=4, num_stages=2) == "normal"
    assert len(kernel.launched) == 2 and not fast_launch._COMPILED


def test_a_compiled_launcher_without_the_expected_fields_falls_back(monkeypatch):
    _broken_at_first_use(monkeypatch)
    kernel = _RecordingKernel()
    monkeypatch.setattr(fast_launch, "_fast_key", lambda *a: "key")
    # an entry whose compiled kernel lacks run / function / packed_metadata (a changed CompiledKernel)
    fast_launch._COMPILED["key"] = (object(), [], 0, kernel)
    with pytest.warns(RuntimeWarning, match="launch cache is off"):
        assert host.run_kernel(kernel, (2,), 1) == "normal"
    assert kernel.launched == [((2,), (1,))] and not fast_launch.AVAILABLE


def test_the_cache_can_be_turned_off_by_the_setting(monkeypatch):
    _broken_at_first_use(monkeypatch)
    monkeypatch.setattr(fast_launch, "_fast_key", lambda *a: (_ for _ in ()).throw(AssertionError("keyed")))
    kernel = _RecordingKernel()
    with config.override(fast_launch=False):
        assert host.run_kernel(kernel, (2,), 1) == "normal"
        assert host.launch(kernel, (2,), 1, num_warps=4, num_stages=1) == "normal"
    assert len(kernel.launched) == 2


def test_real_kernels_launch_without_the_private_api(monkeypatch):
    """A Triton kernel (under the interpreter on CPU) launched through host with the cache broken."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)

    module, _ = _load_copy(monkeypatch, "triton._C.libtriton")
    monkeypatch.setattr(host, "fast_launch", module)
    x = torch.arange(37, dtype=torch.float32)
    y = torch.empty_like(x)
    host.run_kernel(add_one, (3,), x, y, 37, BLOCK=16)
    assert torch.equal(y, x + 1)
    y.zero_()
    host.launch(add_one, (3,), x, y, 37, BLOCK=16, num_warps=1, num_stages=1)
    assert torch.equal(y, x + 1)
