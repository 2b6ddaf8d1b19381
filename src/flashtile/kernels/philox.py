"""Triton twin of ``flashtile.rng.philox_uniform``: Philox-4x32-10 with counter (col, row, bh, offset)."""

import triton
import triton.language as tl


@triton.jit
def philox_uniform(seed_lo, seed_hi, offset, bh, rows, cols):
    """Uniform fp32 in [0, 1) for a tile; ``rows``/``cols`` broadcast ([M, 1] and [1, N])."""
    c0 = (cols + rows * 0).to(tl.uint32)
    c1 = (rows + cols * 0).to(tl.uint32)
    c2 = c0 * 0 + bh.to(tl.uint32)
    c3 = c0 * 0 + offset.to(tl.uint32)
    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    # 24 random bits: exactly representable in fp32, so the keep test matches the PyTorch twin
    return (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)
