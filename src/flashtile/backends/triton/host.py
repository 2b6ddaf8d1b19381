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
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.errors import OutOfResources

from flashtile import env

# Causal forward and dQ programs start with their longest row blocks (kernels/attn_fwd.py
# _heavy_rows_first; results are bitwise the same either way, tests/test_gpu_heavy_first.py). On by
# default: the H200 A/B (gpu_check.sh bench-heavy-first, alternated 0 1 0 1 in one call;
# benchmarks/results/heavy_first_ab_h200_2026-11-30.json) measured it 0.6%-7% faster at s = 8192 and
# 16384 (the d = 256 causal forward +7% at 16384) and even, within the spread, below.
# FLASHTILE_HEAVY_FIRST=0 turns it off; read at import (tests flip the attribute).
# Triton kernels only: the Gluon forward always starts its longest blocks first; the one-launch and
# Gluon dQ variants do not.
HEAVY_FIRST = os.environ.get("FLASHTILE_HEAVY_FIRST", "1") not in ("", "0")


# An sm_90 (H100 / H200) SM's shared memory for thread blocks: how many programs of a given ring fit one SM.
SM90_SHARED_PER_SM = 227 * 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


_NO_GUARD = contextlib.nullcontext()


def device_guard(x: torch.Tensor):
    """Triton launches on the *current* CUDA device and stream: make that the tensors' device
    (a no-op context when it already is, the common case: switching costs two driver calls)."""
    device = x.device
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


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


# The launch cache (FLASHTILE_FAST_LAUNCH=0 turns it off): after a kernel's first launch with a given
# argument key, later launches call the compiled kernel's launcher directly, skipping
# JITFunction.run's binder, its string cache key, its global-value check and the stream lookup
# through the driver object. On the H200 machine's CPU a kernel[grid](...) launch of an empty
# kernel with 30 arguments takes 31-34 us and the compiled launcher 10-16 us
# (benchmarks/results/host_breakdown_h200_2026-11-30.json), and a training step makes 4-5 launches.
# Not followed once a kernel is cached: changes to a kernel's globals (ours never change), and
# compile settings changed at run time (TRITON_INSTRUMENTATION_MODE, TRITON_OVERRIDE_ARCH,
# knobs.language.default_fp_fusion, the libdevice path); launch hooks and pre-run hooks send every
# launch the normal way. Constexprs compare by ==, so 0.0 and -0.0 share a key (ours are ints,
# bools and strings). Keys hold the kernel's id(); an entry is used only for that very object.
FAST_LAUNCH = os.environ.get("FLASHTILE_FAST_LAUNCH", "1") not in ("", "0")
# (kernel id, debug, keywords, their types, argument key, device) -> (CompiledKernel, keyword/default
# param values, device, the kernel itself)
_COMPILED: dict = {}
# a bound on the cache (constexprs such as tile sizes and head dims multiply the keys)
_COMPILED_MAX = 4096


_I32 = (-(1 << 31), (1 << 31) - 1)
_I64_MAX = (1 << 63) - 1


def _int_class(a: int) -> int:
    """What Triton compiles a non-constexpr int argument on: 1 becomes a constant; otherwise its
    type (i32, i64 or u64 by range) and whether 16 divides it. Per-call values (dropout seeds,
    lengths) of the same class share one kernel, as in Triton."""
    if a == 1:
        return -1
    width = 0 if _I32[0] <= a <= _I32[1] else 1 if a <= _I64_MAX else 2
    return 2 * width + (a % 16 == 0)


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what Triton takes at all (it raises past it)


def _arg_key(args, n_plain: int | None = None, require_cuda: bool = True) -> tuple | None:
    """A key at least as fine as Triton's specialisation of these positional arguments.

    Of the first ``n_plain`` (the parameters before the kernel's first constexpr), Triton
    specialises an int on its class (``_int_class``), a float and a bool on their type only, a
    tensor on its dtype and 16-byte alignment, None as itself, and anything else (tensor
    descriptors) its own way, which is used as it is. Arguments past ``n_plain`` fill constexpr
    parameters, which Triton compiles on their exact value: they are keyed on type and value.
    None: an argument that cannot be keyed, or no CUDA tensor among them (the interpreter).
    """
    key = []
    add = key.append
    cuda = False
    for i, a in enumerate(args):
        t = type(a)
        if n_plain is not None and i >= n_plain:
            add((t, a))  # a constexpr by position
        elif t is int:
            if not _INT_RANGE[0] <= a <= _INT_RANGE[1]:
                return None  # the normal path raises Triton's own error
            add(_int_class(a))
        elif t is float:
            add(float)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            if not cuda:
                if a.device.type != "cuda" and require_cuda:  # the interpreter: no compiled kernels
                    return None
                cuda = True
            add((a.dtype, not a.data_ptr() & 15))
        elif a is None:
            add(None)
        elif t is bool:
            add(bool)
        else:
            try:
                spec = native_specialize_impl(BaseBackend, a, False, True, True)
                hash(spec)
            except Exception:  # noqa: BLE001 - whatever Triton cannot key takes the normal path
                return None
            add((t, spec))
    if not cuda and require_cuda:
        return None
    return tuple(key)


def _n_plain(kernel) -> int | None:
    """The number of the kernel's parameters before its first constexpr one (kept on the kernel)."""
    n = getattr(kernel, "_flashtile_n_plain", None)
    if n is None:
        params = getattr(kernel, "params", None)
        if params is None:
            return None
        n = next((i for i, p in enumerate(params) if getattr(p, "is_constexpr", False)), len(params))
        try:
            kernel._flashtile_n_plain = n
        except AttributeError:  # a kernel object that takes no attributes: counted each launch
            pass
    return n


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


def launch_hooks_set() -> bool:
    """Has a profiler (e.g. Proton) added a launch hook? Triton 3.6 keeps them in HookChain
    objects that are never None: an empty chain means none."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)


def _fast_key(kernel, args, meta, options: tuple = (), require_cuda: bool = True):
    if launch_hooks_set() or getattr(kernel, "pre_run_hooks", None):
        return None  # hooks get their metadata / calls from the normal path
    n_plain = _n_plain(kernel)
    if n_plain is None:  # not a JIT kernel: positional constexprs could not be told apart
        return None
    arg_key = _arg_key(args, n_plain, require_cuda)
    if arg_key is None:
        return None
    try:
        # keywords are constexprs and compile options: keyed on type and value (True, 1 and 1.0
        # are equal in Python but compile apart in Triton); the current device last, which is the
        # one Triton compiles for and whose stream it launches on
        key = (id(kernel), knobs.runtime.debug, tuple(meta.items()), tuple(map(type, meta.values())), options,
               arg_key, torch.cuda.current_device())
        hash(key)
    except TypeError:  # an unhashable keyword: the normal path
        return None
    return key


def _stream(device: int):
    # the current stream's handle, as Triton's own launch path reads it
    return torch._C._cuda_getCurrentRawStream(device)


def _cached(key, kernel):
    """The cache's entry for key, if it was made for this very kernel object (keys hold its id)."""
    hit = _COMPILED.get(key)
    return hit if hit is not None and hit[3] is kernel else None


def _launch_cached(hit, grid, args) -> None:
    compiled, tail, device, _ = hit
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(g0, g1, g2, _stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)


def _remember(key, kernel, result, n_args: int, meta: dict) -> None:
    if not hasattr(result, "packed_metadata"):
        return
    # compile options among the keywords (num_warps, launch_pdl) live in the compiled kernel
    tail = launch_tail(kernel, n_args, {k: v for k, v in meta.items() if k in kernel.arg_names})
    if tail is not None:
        if len(_COMPILED) >= _COMPILED_MAX:  # evict the oldest entry (dicts keep insertion order)
            del _COMPILED[next(iter(_COMPILED))]
        _COMPILED[key] = (result, tail, key[-1], kernel)


def run_kernel(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)`` (a Triton or Gluon kernel), through the launch cache."""
    key = _fast_key(kernel, args, meta) if FAST_LAUNCH and not callable(grid) else None
    if key is not None:
        hit = _cached(key, kernel)
        if hit is not None:
            _launch_cached(hit, grid, args)
            return hit[0]
    result = kernel[grid](*args, **meta)
    if key is not None:
        _remember(key, kernel, result, len(args), meta)
    return result


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
    # num_warps / num_stages are compile options: keyed beside the keywords, without copying them
    fast_key = (_fast_key(kernel, args, meta, (num_warps, stages))
                if FAST_LAUNCH and not callable(grid) else None)
    if fast_key is not None:
        hit = _cached(fast_key, kernel)
        if hit is not None:
            _launch_cached(hit, grid, args)
            return hit[0]
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
        if fast_key is not None and stages == key_stages:
            _remember(fast_key, kernel, result, len(args), meta)
        return result


def edge_flags(var: str, direct_by_default: bool) -> dict:
    """The PIPELINE_EDGES launch keyword of the forward and backward Triton kernels (whose default is
    pipelined masked ranges): {} or {"PIPELINE_EDGES": False}. The 0 / 1 switch ``var`` forces direct
    loads / the pipeline in every launch; unset, the caller's measured rule (``direct_by_default``) decides."""
    pipelined = env.switch(var)
    if pipelined is None:
        pipelined = not direct_by_default
    return {} if pipelined else {"PIPELINE_EDGES": False}
