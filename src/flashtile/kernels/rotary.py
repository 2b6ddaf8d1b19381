"""Rotary position embedding kernel: one program rotates BLOCK_M rows of one (batch, head).

The grid is flat (axis 0 only): ``cdiv(seqlen, BLOCK_M) * heads * batch`` programs.

The first ``ROTARY_DIM`` channels of each row are split into pairs ``(x0, x1)`` -- channels
``(2i, 2i+1)`` when ``INTERLEAVED`` (GPT-J style), else ``(i, i + ROTARY_DIM/2)`` (GPT-NeoX style) --
and each pair is rotated by the angle of its position: ``x0*cos - x1*sin, x0*sin + x1*cos``.
``CONJUGATE`` rotates by the opposite angle (the backward pass). Both halves of a pair are loaded
before either is stored, so the kernel may write in place (``X is OUT``). Channels past
``ROTARY_DIM`` are not touched here; the launcher copies them when the output is a new tensor.
"""

import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    X, OUT, COS, SIN, CU_SEQLENS, SEQLEN_OFFSETS,
    seqlen, seqlen_ro, offset_scalar, num_heads, num_m_blocks,
    stride_xb, stride_xm, stride_xh,
    stride_ob, stride_om, stride_oh,
    stride_cos_m, stride_sin_m,
    ROTARY_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_OFFSET_TENSOR: tl.constexpr,
):
    # one flat grid axis (CUDA allows 2^31 - 1 programs there but only 65535 on axes 1 and 2, which
    # batch * heads can exceed): program = (b * num_heads + head) * num_m_blocks + pid_m
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    bh = pid // num_m_blocks
    head = bh % num_heads
    b = bh // num_heads

    if IS_VARLEN:
        # varlen rows are packed: batch b owns rows [cu[b], cu[b+1]) and positions restart at 0
        row0 = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - row0
        x_base = X + row0.to(tl.int64) * stride_xm + head * stride_xh
        o_base = OUT + row0.to(tl.int64) * stride_om + head * stride_oh
    else:
        x_base = X + b.to(tl.int64) * stride_xb + head * stride_xh
        o_base = OUT + b.to(tl.int64) * stride_ob + head * stride_oh

    start_m = pid_m * BLOCK_M
    if start_m < seqlen:
        if HAS_OFFSET_TENSOR:
            offset = tl.load(SEQLEN_OFFSETS + b)
        else:
            offset = offset_scalar
        rows = start_m + tl.arange(0, BLOCK_M)
        half = tl.arange(0, BLOCK_K)  # index of the pair inside the rotary channels
        row_ok = rows < seqlen
        col_ok = half < ROTARY_DIM // 2
        pos = rows + offset
        # a position past the cos/sin table is left unrotated (cos 1, sin 0), as FlashAttention does
        ro_ok = row_ok[:, None] & col_ok[None, :] & (pos < seqlen_ro)[:, None]
        cos = tl.load(COS + pos[:, None] * stride_cos_m + half[None, :], mask=ro_ok, other=1.0).to(tl.float32)
        sin = tl.load(SIN + pos[:, None] * stride_sin_m + half[None, :], mask=ro_ok, other=0.0).to(tl.float32)
        if CONJUGATE:
            sin = -sin
        if INTERLEAVED:
            c0 = 2 * half
            c1 = 2 * half + 1
        else:
            c0 = half
            c1 = half + ROTARY_DIM // 2
        mask = row_ok[:, None] & col_ok[None, :]
        x_rows = x_base + rows[:, None].to(tl.int64) * stride_xm
        o_rows = o_base + rows[:, None].to(tl.int64) * stride_om
        x0 = tl.load(x_rows + c0[None, :], mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(x_rows + c1[None, :], mask=mask, other=0.0).to(tl.float32)
        o0 = x0 * cos - x1 * sin
        o1 = x0 * sin + x1 * cos
        tl.store(o_rows + c0[None, :], o0.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_rows + c1[None, :], o1.to(OUT.dtype.element_ty), mask=mask)


def rotary_config(rotary_dim: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps): wide heads get fewer rows per program so a tile stays ~4K elements."""
    half = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_m = max(4, min(64, 4096 // half))
    return block_m, 4 if half * block_m >= 2048 else 2
