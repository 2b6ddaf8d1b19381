"""Host-side helpers shared by the launchers: integer helpers, the device guard and capability, and the
two launch functions (``run_kernel``, ``launch``), which go through the launch cache (fast_launch.py).

Plain-Python integer helpers on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions whose wrapper costs microseconds per call, which adds up on the launch path of
short sequences and decode steps.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from triton.runtime.errors import OutOfResources

from flashtile import config
from flashtile.backends.triton import fast_launch

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


# CUDA caps a grid's second axis at 65535: the Gluon kernels' (tiles, batch x heads) grids refuse more, which the
# Triton kernels' flat grids take
MAX_GRID_Y = 65535


def arch_of(device: torch.device) -> str:
    """The config tables' arch key: "sm90" (Hopper), "default" (other GPUs) or "interpret" (CPU tensors)."""
    if device.type != "cuda":
        return "interpret"
    return "sm90" if capability(device)[0] == 9 else "default"


# Launch configs that had to drop pipeline stages on this machine: (kernel, device, dtypes, warps,
# stages, constexprs) -> the stages that fit. Empty on GPUs the tables were tuned for, so the
# common launch path pays one dict truthiness test.
_REDUCED_STAGES: dict = {}


def _launch_key(kernel, args, num_warps, num_stages, meta) -> tuple:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else None
    return (kernel, device, tuple(t.dtype for t in tensors), num_warps, num_stages, tuple(sorted(meta.items())))


def run_kernel(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)`` (a Triton or Gluon kernel), through the launch cache."""
    key = fast_launch.key_for(kernel, grid, args, meta) if config.get().fast_launch else None
    if key is not None:
        hit = fast_launch.try_launch(key, kernel, grid, args)
        if hit is not None:
            return hit
    result = kernel[grid](*args, **meta)
    fast_launch.remember(key, kernel, result, len(args), meta)
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
    settings = config.get()
    reduce_stages = settings.reduce_stages_on_oor
    key = None
    stages = num_stages
    if _REDUCED_STAGES and reduce_stages:
        key = _launch_key(kernel, args, num_warps, num_stages, meta)
        stages = _REDUCED_STAGES.get(key, num_stages)
    key_stages = stages
    # num_warps / num_stages are compile options: keyed beside the keywords, without copying them
    fast_key = (fast_launch.key_for(kernel, grid, args, meta, (num_warps, stages))
                if settings.fast_launch else None)
    if fast_key is not None:
        hit = fast_launch.try_launch(fast_key, kernel, grid, args)
        if hit is not None:
            return hit
    while True:
        try:
            result = kernel[grid](*args, num_warps=num_warps, num_stages=stages, **meta)
        except OutOfResources as exc:
            if not reduce_stages or getattr(exc, "name", "") != "shared memory" or stages <= 1:
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
        if stages == key_stages:
            fast_launch.remember(fast_key, kernel, result, len(args), meta)
        return result
