"""The launch cache: the one module that uses Triton's (and torch's) private launch APIs.

After a kernel's first launch with a given argument key, later launches with the same key call the
compiled kernel's launcher directly (``CompiledKernel.run`` with its packed metadata), skipping
``JITFunction.run``'s binder, its string cache key, its global-value check and the stream lookup through
the driver object: a ``kernel[grid](...)`` launch of an empty kernel with 30 arguments costs about 30 us of
host time, the compiled launcher 10-16 us, and a training step makes 4-5 launches (docs/architecture.md,
"Launch path").

The private pieces are ``triton._C.libtriton.native_specialize_impl`` (how Triton keys an argument it
cannot be told apart by type), ``triton.knobs`` (debug mode, launch hooks), ``CompiledKernel.run`` /
``packed_metadata`` / ``function`` and ``torch._C._cuda_getCurrentRawStream``. If any of them is missing at
import, or raises AttributeError / TypeError at first use (another Triton or torch version), the cache turns
itself off with one warning and every launch takes Triton's public ``kernel[grid](...)`` path
(tests/test_fast_launch.py simulates both).

Not followed once a kernel is cached: changes to a kernel's globals (ours never change) and compile settings
changed at run time (TRITON_INSTRUMENTATION_MODE, TRITON_OVERRIDE_ARCH, knobs.language.default_fp_fusion,
the libdevice path); launch hooks and pre-run hooks send every launch the normal way. Constexprs compare by
==, so 0.0 and -0.0 share a key (ours are ints, bools and strings). Keys hold the kernel's id(); an entry is
used only for that very object.
"""

from __future__ import annotations

import warnings

import torch

try:
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except Exception as exc:  # noqa: BLE001 - any failure means: no private path, the public one works
    knobs = native_specialize_impl = BaseBackend = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

# False once the private API was found missing or broken: every launch then takes the public path
AVAILABLE = _IMPORT_ERROR is None
# the errors a changed private API raises (a missing attribute, a changed signature)
_API_ERRORS = (AttributeError, TypeError)

# (kernel id, debug, keywords, their types, options, argument key, device) -> (CompiledKernel, keyword /
# default param values, device, the kernel itself)
_COMPILED: dict = {}
# a bound on the cache (constexprs such as tile sizes and head dims multiply the keys)
_COMPILED_MAX = 4096


def disable(reason) -> None:
    """Turn the cache off for the process (a private API is missing or changed), with one warning."""
    global AVAILABLE
    if AVAILABLE:
        warnings.warn(f"flashtile: the launch cache is off, every launch takes Triton's kernel[grid](...) path "
                      f"(Triton's private launch API is not as expected: {reason!r})", RuntimeWarning, stacklevel=3)
    AVAILABLE = False
    _COMPILED.clear()


if _IMPORT_ERROR is not None:
    warnings.warn(f"flashtile: the launch cache is off ({_IMPORT_ERROR!r}); launches take Triton's public path",
                  RuntimeWarning, stacklevel=2)


_I32 = (-(1 << 31), (1 << 31) - 1)
_I64_MAX = (1 << 63) - 1
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what Triton takes at all (it raises past it)


def _int_class(a: int) -> int:
    """What Triton compiles a non-constexpr int argument on: 1 becomes a constant; otherwise its
    type (i32, i64 or u64 by range) and whether 16 divides it. Per-call values (dropout seeds,
    lengths) of the same class share one kernel, as in Triton. (Finer than Triton for parameters in a
    kernel's ``do_not_specialize`` list, which Triton keys on their type only: never coarser.)"""
    if a == 1:
        return -1
    width = 0 if _I32[0] <= a <= _I32[1] else 1 if a <= _I64_MAX else 2
    return 2 * width + (a % 16 == 0)


def _arg_key(args, n_plain: int | None = None, require_cuda: bool = True) -> tuple | None:
    """A key at least as fine as Triton's specialisation of these positional arguments.

    Of the first ``n_plain`` (the parameters before the kernel's first constexpr), Triton
    specialises an int on its class (``_int_class``), a float and a bool on their type only, a
    tensor on its dtype and 16-byte alignment, None as itself, and anything else (tensor
    descriptors) its own way, which is used as it is. Arguments past ``n_plain`` fill constexpr
    parameters, which Triton compiles on their exact value: they are keyed on type and value.
    None: an argument that cannot be keyed, or no CUDA tensor among them (the interpreter).

    It runs on every launch (4-5 a training step), so the common cases are inline: an int in i32's range
    gets ``_int_class``'s value without the call, a tensor's device is read as ``is_cuda``.
    """
    plain = args if n_plain is None else args[:n_plain]
    key = []
    add = key.append
    cuda = False
    for a in plain:
        t = type(a)
        if t is int:
            if -2147483648 <= a <= 2147483647:
                add(-1 if a == 1 else int(not a & 15))  # _int_class of an i32
            elif not _INT_RANGE[0] <= a <= _INT_RANGE[1]:
                return None  # the normal path raises Triton's own error
            else:
                add(_int_class(a))
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            if a.is_cuda:
                cuda = True
            elif require_cuda:  # the interpreter (no compiled kernels), or a CPU tensor where a GPU one belongs
                return None
            add((a.dtype, not a.data_ptr() & 15))
        elif t is float:
            add(float)
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
    if n_plain is not None:
        tail = args[n_plain:]
        key.extend(zip(map(type, tail), tail))  # constexprs by position
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


def key_for(kernel, grid, args, meta, options: tuple = ()):
    """The cache key of this launch, or None where it takes the normal path (the cache off or broken, a
    callable grid, launch hooks, an argument that cannot be keyed, CPU tensors)."""
    if not AVAILABLE or callable(grid):
        return None
    try:
        return _fast_key(kernel, args, meta, options)
    except _API_ERRORS as exc:
        disable(exc)
        return None


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


def try_launch(key, kernel, grid, args):
    """Launch through the cache's compiled kernel for key; returns it, or None on a miss (or when the
    private launcher turned out to be missing: the caller then launches the normal way)."""
    if key is None:
        return None
    hit = _cached(key, kernel)
    if hit is None:
        return None
    try:
        _launch_cached(hit, grid, args)
    except _API_ERRORS as exc:
        disable(exc)
        return None
    return hit[0]


def remember(key, kernel, result, n_args: int, meta: dict) -> None:
    """Keep the compiled kernel a normal launch returned, for later launches with the same key."""
    if key is None or not AVAILABLE or not hasattr(result, "packed_metadata"):
        return
    # compile options among the keywords (num_warps, launch_pdl) live in the compiled kernel
    tail = launch_tail(kernel, n_args, {k: v for k, v in meta.items() if k in kernel.arg_names})
    if tail is not None:
        if len(_COMPILED) >= _COMPILED_MAX:  # evict the oldest entry (dicts keep insertion order)
            del _COMPILED[next(iter(_COMPILED))]
        _COMPILED[key] = (result, tail, key[-1], kernel)
