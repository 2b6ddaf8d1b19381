"""Tensor descriptors (TMA) for the launchers: when a tensor can have one, and building it."""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.host import capability


def tma_ok(x: torch.Tensor) -> bool:
    """TMA needs a non-empty tensor, a 16-byte aligned base and 16-byte multiples for every stride but
    the last (an all-empty varlen key set, total_k = 0, has no valid descriptor)."""
    es = x.element_size()
    return x.numel() > 0 and x.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in x.stride()[:-1])


def descriptors_wanted(*tensors: torch.Tensor) -> bool:
    """Tensor-descriptor loads for these tensors: on sm_90 and later where every one allows them (``tma_ok``);
    ``config.tma`` True / False forces them on / off, still only where the tensors allow them."""
    aligned = all(tma_ok(x) for x in tensors)
    forced = config.get().tma
    if forced is not None:
        return forced and aligned
    x = tensors[0]
    return aligned and x.device.type == "cuda" and capability(x.device)[0] >= 9


def row_descriptor(x: torch.Tensor, block_rows: int, block_d: int):
    """A descriptor of (b, s, h, d) or (total, h, d) ``x`` whose boxes are ``block_rows`` rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if x.dim() == 4:
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_rows, 1, block_d])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_rows, 1, block_d])
