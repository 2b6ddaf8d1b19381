"""Host-side helpers shared by the launchers.

Plain-Python integer helpers on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions whose wrapper costs microseconds per call, which adds up on the launch path of
short sequences and decode steps (a split heuristic calling cdiv in a loop cost ~150 us per
decode call).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
from triton.runtime.errors import OutOfResources

# FLASHTILE_HEAVY_FIRST=1: causal forward and dQ programs start with their longest row blocks
# (kernels/attn_fwd.py _heavy_rows_first; results are bitwise the same either way). Off by default:
# the compiled kernels with it have not run on a GPU yet (gpu_check.sh bench-heavy-first decides).
# Read at import (tests flip the attribute). Triton kernels only: the Gluon forward always starts
# its longest blocks first; the one-launch and Gluon dQ variants do not.
HEAVY_FIRST = os.environ.get("FLASHTILE_HEAVY_FIRST", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def device_guard(x: torch.Tensor):
    """Triton launches on the *current* CUDA device and stream: make that the tensors' device."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, asked of the driver once per device: it is on every launch
    path, and torch's lookup costs about a microsecond each time."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# Launch configs that had to drop pipeline stages on this machine: (kernel, device, dtypes, warps,
# stages, constexprs) -> the stages that fit. Empty on GPUs the tables were tuned for, so the
# common launch path pays one dict truthiness test.
_REDUCED_STAGES: dict = {}
# Config sweeps turn this off: a config that does not fit must fail, not run as another config.
REDUCE_STAGES_ON_OOR = True


def _launch_key(kernel, args, num_warps, num_stages, meta) -> tuple:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else None
    return (kernel, device, tuple(t.dtype for t in tensors), num_warps, num_stages, tuple(sorted(meta.items())))


# Experimental, off by default until measured on the GPU (FLASHTILE_FAST_LAUNCH=1): after a kernel's
# first launch with a given argument specialisation, later launches call the compiled kernel
# directly and skip JITFunction.run's binder, cache-key string and bookkeeping. On the H200
# machine's CPU a Triton launch costs about 110 us under cProfile
# (benchmarks/results/host_profile_h200_2026-11-30.txt), which bounds short training steps.
FAST_LAUNCH = os.environ.get("FLASHTILE_FAST_LAUNCH", "0") not in ("", "0")
# (kernel, device, warps, stages, constexprs, per-argument specialisation) -> CompiledKernel
_COMPILED: dict = {}


def _specialisation(args) -> tuple:
    """What Triton specialises a launch on, per positional argument: type, and 16-byte alignment
    of pointers / divisibility of integers (an integer equal to 1 becomes a constant). Computed
    with every specialisation on, so the key is at least as fine as Triton's own (arguments
    marked do_not_specialize only add entries that share one compiled kernel)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)


def launch_tail(kernel, n_args: int, meta: dict) -> list | None:
    """The values of the parameters after the positional ones, in signature order (keywords, else
    defaults), as a compiled kernel takes them; None when one has neither (the normal path then
    raises Triton's own error)."""
    tail = []
    for param in kernel.params[n_args:]:
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None
    if len(tail) + n_args != len(kernel.params) or set(meta) - set(kernel.arg_names[n_args:]):
        return None
    return tail


def _fast_key(kernel, args, num_warps, num_stages, meta):
    try:
        spec = _specialisation(args)
        key = (kernel, torch.cuda.current_device(), num_warps, num_stages, tuple(meta.items()), spec)
        hash(key)
        return key
    except TypeError:  # an argument Triton cannot specialise (or an unhashable keyword): normal path
        return None


def launch(kernel, grid, *args, num_warps: int, num_stages: int, **meta):
    """``kernel[grid](*args, num_warps=, num_stages=, **meta)``, with fewer pipeline stages if needed.

    The config tables are tuned on Hopper (227 KiB of shared memory per block). A GPU with less
    (about 99 KiB on Ada and consumer Ampere, 163 KiB on the A100) can refuse a config at its
    first launch with Triton's ``OutOfResources``; fewer stages need less shared memory and
    compute the same result, so the launch is retried one stage shallower at a time, with a
    warning once per config, and the stages that fit are remembered under the table's value.
    (Triton's alignment specialisations are not in the key: if one needs fewer stages than
    another, the memo keeps the smaller count, which is slower for the other but still correct.)
    """
    key = None
    stages = num_stages
    if _REDUCED_STAGES and REDUCE_STAGES_ON_OOR:
        key = _launch_key(kernel, args, num_warps, num_stages, meta)
        stages = _REDUCED_STAGES.get(key, num_stages)
    key_stages = stages
    # a compiled kernel takes exactly three grid dimensions (JITFunction pads them itself)
    fast_grid = None if callable(grid) else tuple(grid) + (1,) * (3 - len(grid))
    fast_key = _fast_key(kernel, args, num_warps, stages, meta) if FAST_LAUNCH and fast_grid else None
    if fast_key is not None:
        hit = _COMPILED.get(fast_key)
        if hit is not None:
            compiled, tail = hit
            compiled[fast_grid](*args, *tail)
            return compiled
    while True:
        try:
            result = kernel[grid](*args, num_warps=num_warps, num_stages=stages, **meta)
        except OutOfResources as exc:
            if not REDUCE_STAGES_ON_OOR or getattr(exc, "name", "") != "shared memory" or stages <= 1:
                raise
            stages -= 1
            reason = exc
            continue
        if stages != num_stages:
            key = key or _launch_key(kernel, args, num_warps, num_stages, meta)
            if key not in _REDUCED_STAGES:
                warnings.warn(f"flashtile: {getattr(kernel, '__name__', kernel)} with {num_stages} pipeline stages "
                              f"needs more shared memory than this GPU has ({reason}); it runs with {stages}. "
                              "A tuned table for this GPU avoids the retry (docs/architecture.md).",
                              RuntimeWarning, stacklevel=2)
            _REDUCED_STAGES[key] = stages
        # cache only what was compiled for the key's own stage count (a retry may have lowered it)
        if fast_key is not None and stages == key_stages and hasattr(result, "packed_metadata"):
            # compile options among the keywords (launch_pdl) live in the compiled kernel's metadata
            tail = launch_tail(kernel, len(args), {k: v for k, v in meta.items() if k in kernel.arg_names})
            if tail is not None:
                _COMPILED[fast_key] = (result, tail)
        return result
