"""Counter-based dropout randomness shared by every backend.

Each attention probability (batch*head ``bh``, query row ``i``, key column ``j``) gets its own
uniform number from Philox-4x32-10 keyed by a 64-bit seed, with counter ``(j, i, bh, offset)``.
Being counter based, the forward and backward passes (and the Triton kernels and the PyTorch
paths) regenerate exactly the same mask from ``(seed, offset)`` without storing it. The kernels
hold a Triton twin of :func:`philox_uniform` (``kernels/philox.py``); tests pin the two together.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10


def _mul_hi_lo(a: int, b: torch.Tensor):
    # int64 products of two 32-bit values wrap, but the wrapped bit pattern is the unsigned one.
    prod = b * a
    return (prod >> 32) & MASK32, prod & MASK32


def philox_uniform(seed: int, offset: int, bh, rows, cols) -> torch.Tensor:
    """Uniform fp32 numbers in [0, 1) for broadcastable int64 index tensors ``bh, rows, cols``."""
    c0 = cols.to(torch.int64) & MASK32
    c1 = rows.to(torch.int64) & MASK32
    c2 = bh.to(torch.int64) & MASK32
    c0, c1, c2 = torch.broadcast_tensors(c0, c1, c2)
    c3 = torch.full_like(c0, offset & MASK32)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    # 24 random bits map exactly onto fp32's mantissa, so the threshold test is exact everywhere.
    return (c0 >> 8).to(torch.float32) * (1.0 / (1 << 24))


def dropout_keep(seed: int, offset: int, bh, rows, cols, p: float) -> torch.Tensor:
    """Boolean keep-mask: an element is kept when its uniform number is >= ``p``."""
    return philox_uniform(seed, offset, bh, rows, cols) >= p


def next_seed_offset(device: torch.device) -> tuple[int, int]:
    """Draw ``(seed, offset)`` for one dropout call from torch's generator for ``device``.

    CUDA: the device's default Philox generator (its seed and an offset we advance), so
    ``torch.manual_seed`` reproduces the mask and no host-device sync happens. CPU: 63 bits drawn
    from the CPU default generator.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # CUDA Philox offsets advance in multiples of 4
        return gen.initial_seed() & ((1 << 64) - 1), offset // 4
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    return seed, 0
