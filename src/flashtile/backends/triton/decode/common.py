"""What the decode launchers share: output and split buffers, the split merge's launch, cache facts."""

from __future__ import annotations

import torch

from flashtile.backends.triton.host import device_guard, next_pow2, run_kernel
from flashtile.kernels.decode import _combine_kernel

LOG2E = 1.4426950408889634
# The merge runs on one warp while a program's partials are at most this many values (at d = 128: up to 8 splits):
# with more warps its reduction crosses warps through shared memory, which took twice as long at b = 32 with 4 splits
# (docs/inference.md, 'Kernels'). Larger merges (b = 1's many splits) keep more warps.
COMBINE_ONE_WARP_VALUES = 1024


def capacity_of(k_cache: torch.Tensor, block_table) -> int:
    """Keys a row can hold: the cache's second dimension, or a paged row's pages x the page size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def aligned(*tensors: torch.Tensor) -> bool:
    """16-byte copies need 16-byte aligned bases and rows. The JIT marks an integer argument aligned only when it
    is a multiple of 16, so every outer stride must be one (in elements)."""
    return all(x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1]) and x.stride(-1) == 1
               for x in tensors)


def one_token_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token decode call's outputs, unfilled: out like q (b, 1, h, d) and lse (b, h, 1), fp32."""
    return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], 1, device=q.device, dtype=torch.float32)


def split_partials(num_splits: int, b: int, sq: int, h: int, d: int, device: torch.device):
    """Unfilled fp32 partial results of a split launch, as ``combine`` merges them: out_partial
    (num_splits, b, sq, h, d) and lse_partial (num_splits, b, h, sq)."""
    return (torch.empty(num_splits, b, sq, h, d, device=device, dtype=torch.float32),
            torch.empty(num_splits, b, h, sq, device=device, dtype=torch.float32))


def features(sink_in_kernel: bool, attention_chunk: int) -> dict:
    """The split and MLA kernels' HAS_SINK / HAS_CHUNK constexprs, given only when on: a call without them
    launches the very build (and launch-cache key) it did before they existed."""
    return {**({"HAS_SINK": True} if sink_in_kernel else {}), **({"HAS_CHUNK": True} if attention_chunk else {})}


def combine(out_partial, lse_partial, out, lse, pdl: bool = False, sink=None):
    """Merge splits: out_partial (ns, b, sq, h, d), lse_partial (ns, b, h, sq) -> out (b, sq, h, d), lse (b, h, sq).

    ``pdl``: launch it as a programmatic dependent of the split kernel just launched (Route.merge_pdl).
    ``sink``: a learnable sink (h,) (any float dtype) the partials leave out, added to every row's lse here."""
    ns, b, sq, h, d = out_partial.shape
    if b * sq * h == 0:
        return out, lse
    extra = dict(USE_PDL=True, launch_pdl=True) if pdl else {}
    with device_guard(out):
        run_kernel(_combine_kernel, (b * sq * h,),  # flat grid: the batch on axis 1 would be capped at 65535
            out_partial, lse_partial, out, lse, sink,
            ns, sq, h,
            *out_partial.stride()[:4],
            *lse_partial.stride()[:4],
            *out.stride()[:3],
            *lse.stride(),
            HEAD_DIM=d, BLOCK_S=max(2, next_pow2(ns)), BLOCK_D=max(16, next_pow2(d)),
            num_warps=combine_warps(ns, d), **extra, **({"HAS_SINK": True} if sink is not None else {}),
        )
    return out, lse


def combine_warps(num_splits: int, d: int) -> int:
    """The merge kernel's warps for ``num_splits`` partials of head dim ``d``."""
    if max(2, next_pow2(num_splits)) * max(16, next_pow2(d)) <= COMBINE_ONE_WARP_VALUES:
        return 1
    return 4 if d >= 128 else 2
