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
