"""FlashAttention-3's Python API on flashtile: ``from flashtile.hopper import flash_attn_func`` takes FlashAttention-3's
signatures (hopper/flash_attn_interface.py there); see :mod:`flashtile.hopper.flash_attn_interface`."""

from flashtile.hopper.flash_attn_interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]
