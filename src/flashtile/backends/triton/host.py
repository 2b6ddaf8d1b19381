"""Host-side helpers shared by the launchers.

Plain-Python integer helpers on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions whose wrapper costs microseconds per call, which adds up on the launch path of
short sequences and decode steps (a split heuristic calling cdiv in a loop cost ~150 us per
decode call).
"""

from __future__ import annotations

import contextlib
import functools

import torch


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
