"""Programmable attention with FlexAttention's API: ``from flashtile.flex import flex_attention,
create_block_mask`` where FlexAttention users write ``from torch.nn.attention.flex_attention import ...``.

Mods are plain Python functions of tensors, compiled into flashtile's Triton kernels (forward and
backward) without torch.compile; CPU tensors run a materialised PyTorch path. docs/programmable.md.
"""

from flashtile.backends.triton.flex.trace import ModCompileError
from flashtile.flex.api import flex_attention
from flashtile.flex.block_mask import BlockMask, and_masks, create_block_mask, full_block_mask, noop_mask, or_masks

__all__ = ["BlockMask", "ModCompileError", "and_masks", "create_block_mask", "flex_attention", "full_block_mask",
           "noop_mask", "or_masks"]
