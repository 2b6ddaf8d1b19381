"""The block ranges of the Triton forward and backward (kernels/attn_fwd.py ``_key_block_ranges``,
kernels/attn_bwd.py ``_query_block_ranges``) against a brute-force mask (``masking.visible``), for every
combination of sliding window bounds, attention_chunk, sequence lengths and block sizes on a grid.

The range functions themselves run (through a small kernel, in the interpreter on CPU), vectorised over
every case of a constexpr combination. For each program's block the test asserts:

- coverage: every visible (row, col) pair lies in a visited block ([lo, hi));
- the unmasked range ([full_lo, full_hi)) holds only blocks every real row sees whole;
- tightness: lo and hi are the first and last block that some row of the block sees, and the unmasked
  range is exactly the blocks all its rows see whole, so the cost follows the visible keys. Here the
  block's rows include those past seqlen_q (forward) and the key block's columns those past seqlen_k
  (backward): the kernels bound a block by its first and last index, whether those exist or not.
"""

import itertools
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashtile.backends.masking import visible
from flashtile.kernels.attn_bwd import _query_block_ranges
from flashtile.kernels.attn_fwd import _chunk_start, _key_block_ranges

pytestmark = pytest.mark.interpret

SEQLENS = [0, 1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 23]
BOUNDS = [0, 1, 3, 6]  # each window bound takes these when present (else -1, unbounded)
CHUNKS = [1, 2, 3, 4, 5, 7, 8, 16, 40]
# (BLOCK_M, BLOCK_N): the range arithmetic does not need powers of two, so odd sizes stress it too
BLOCKS = [(4, 4), (8, 4), (4, 8), (3, 5)]
PAIRS = torch.tensor(list(itertools.product(SEQLENS, SEQLENS)))
LANES = 1 << 16  # the interpreter pays per operation, not per lane: few wide programs
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@triton.jit
def _load_case(ptr, offs, m, n):
    return tl.load(ptr + offs, mask=m, other=0), tl.load(ptr + n + offs, mask=m, other=0), \
        tl.load(ptr + 2 * n + offs, mask=m, other=0), tl.load(ptr + 3 * n + offs, mask=m, other=0), \
        tl.load(ptr + 4 * n + offs, mask=m, other=1), tl.load(ptr + 5 * n + offs, mask=m, other=0)


@triton.jit
def _store_ranges(out, offs, m, lo, full_lo, full_hi, hi):
    z = offs * 0  # a range that is a constant (no bound of that side) still fills every lane
    tl.store(out + offs * 4, lo + z, mask=m)
    tl.store(out + offs * 4 + 1, full_lo + z, mask=m)
    tl.store(out + offs * 4 + 2, full_hi + z, mask=m)
    tl.store(out + offs * 4 + 3, hi + z, mask=m)


@triton.jit
def _ranges_kernel(CASES, OUT, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, FORWARD: tl.constexpr, LANES: tl.constexpr):
    """One lane per (case, block): CASES holds six int32 rows (seqlen_q, seqlen_k, left, right, chunk, block
    index); OUT gets (lo, full_lo, full_hi, hi) per lane."""
    offs = tl.program_id(0) * LANES + tl.arange(0, LANES)
    m = offs < n
    sq, sk, left, right, chunk, blk = _load_case(CASES, offs, m, n)
    if FORWARD:
        lo, full_lo, full_hi, hi = _key_block_ranges(blk * BLOCK_M, blk * BLOCK_M + BLOCK_M - 1, sq, sk, left, right,
                                                     BLOCK_N, HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)
    else:
        lo, full_lo, full_hi, hi = _query_block_ranges(blk * BLOCK_N, sq, sk, left, right, BLOCK_M, BLOCK_N,
                                                       HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)
    _store_ranges(OUT, offs, m, lo, full_lo, full_hi, hi)


def _groups(has_left, has_right, has_chunk):
    return list(itertools.product(BOUNDS if has_left else [-1], BOUNDS if has_right else [-1],
                                  CHUNKS if has_chunk else [0]))


def _kernel_ranges(groups, n_blocks, forward, bm, bn, flags) -> torch.Tensor:
    """(groups, pairs, n_blocks, 4) ranges from the kernel, every (sq, sk) pair and block index."""
    g, p = len(groups), len(PAIRS)
    win = torch.tensor(groups).view(g, 1, 1, 3).expand(g, p, n_blocks, 3)
    seq = PAIRS.view(1, p, 1, 2).expand(g, p, n_blocks, 2)
    blk = torch.arange(n_blocks).view(1, 1, n_blocks, 1).expand(g, p, n_blocks, 1)
    cases = torch.cat([seq, win, blk], -1).reshape(-1, 6).t().contiguous().to(torch.int32).to(DEVICE)
    n = cases.shape[1]
    out = torch.empty(n * 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(triton.cdiv(n, LANES),)](cases, out, n, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=flags[0],
                                             HAS_RIGHT=flags[1], HAS_CHUNK=flags[2], FORWARD=forward, LANES=LANES)
    return out.cpu().view(g, len(PAIRS), n_blocks, 4).long()


def _span(hit: torch.Tensor):
    """(first, last + 1) of the True entries along the last dim, (0, 0) where there are none, and their count."""
    n = hit.shape[-1]
    idx = torch.arange(n)
    first = torch.where(hit, idx, n).min(-1).values
    last = torch.where(hit, idx, -1).max(-1).values + 1
    count = hit.sum(-1)
    return torch.where(count > 0, first, 0), torch.where(count > 0, last, 0), count


def _check(forward, ranges, seen, ext_seen, real_full, ext_full, valid, label):
    """ranges (P, B, 4) for B programs; the others (P, B, blocks) booleans over the blocks a program may
    visit (valid: (P, B), the programs that exist)."""
    lo, full_lo, full_hi, hi = ranges.unbind(-1)
    n = seen.shape[-1]
    idx = torch.arange(n)
    visited = (idx >= lo[..., None]) & (idx < hi[..., None])
    unmasked = (idx >= full_lo[..., None]) & (idx < full_hi[..., None])
    first, last, count = _span(ext_seen)
    ffirst, flast, fcount = _span(ext_full)
    checks = {
        "ordered": (lo <= full_lo) & (full_lo <= full_hi) & (full_hi <= hi),
        "covers every visible pair": ~(seen & ~visited).any(-1),
        "unmasked blocks are fully visible": ~(unmasked & ~real_full).any(-1),
        "lo/hi tight": torch.where(count > 0, (lo == first) & (hi == last), lo == hi),
        "unmasked range tight": torch.where(fcount > 0, (full_lo == ffirst) & (full_hi == flast), full_lo == full_hi),
        "fully visible blocks contiguous": fcount == flast - ffirst,
    }
    for name, ok in checks.items():
        bad = valid & ~ok
        if bad.any():
            p, b = (int(x) for x in bad.nonzero()[0])
            sq, sk = PAIRS[p].tolist()
            blocks = seen[p, b].nonzero().flatten().tolist()
            pytest.fail(f"{'forward' if forward else 'backward'} {label}: {name} fails at sq={sq} sk={sk} "
                        f"block {b}: ranges {ranges[p, b].tolist()}, visible blocks {blocks}")


@pytest.mark.parametrize("bm,bn", BLOCKS)
def test_block_ranges_against_brute_force(interpret, bm, bn):
    sq = PAIRS[:, 0].view(-1, 1, 1)
    sk = PAIRS[:, 1].view(-1, 1, 1)
    nq, nk = -(-max(SEQLENS) // bm), -(-max(SEQLENS) // bn)
    rows = torch.arange(nq * bm).view(1, -1, 1)
    cols = torch.arange(nk * bn).view(1, 1, -1)
    p = len(PAIRS)
    row_real = (rows < sq).view(p, nq, bm, 1, 1)
    col_real = (cols < sk).view(p, 1, 1, nk, bn)
    cols_whole = ((torch.arange(nk) + 1) * bn <= PAIRS[:, 1].view(-1, 1)).view(p, 1, nk)
    rows_exist = (torch.arange(nq) * bm < PAIRS[:, 0].view(-1, 1))  # (p, nq): the programs of each pair
    cols_exist = (torch.arange(nk) * bn < PAIRS[:, 1].view(-1, 1))
    # the brute force on numpy arrays (masking.visible broadcasts either): int32 numpy is ten times faster
    # than torch here, on these small tensors
    np_rows, np_cols, np_sq, np_sk = (x.numpy().astype(np.int32) for x in (rows, cols, sq, sk))
    for flags in itertools.product([False, True], repeat=3):
        groups = _groups(*flags)
        fwd = _kernel_ranges(groups, nq, True, bm, bn, flags)
        bwd = _kernel_ranges(groups, nk, False, bm, bn, flags)
        for gi, (left, right, chunk) in enumerate(groups):
            vis = torch.from_numpy(visible(np_rows, np_cols, np_sq, np_sk, left, right, chunk))
            vis = vis.view(p, nq, bm, nk, bn)
            # the same diagonals with neither the rows nor the columns cut off by the lengths
            free = torch.from_numpy(visible(np_rows, np_cols, np_sq + 10**6, np_sk + 10**6, left, right, chunk))
            free = free.view(p, nq, bm, nk, bn)
            label = f"BLOCK_M={bm} BLOCK_N={bn} window=({left}, {right}) chunk={chunk}"
            # forward: a program per query block, over key blocks
            ext = free & col_real
            _check(True, fwd[gi], vis.any(4).any(2), ext.any(4).any(2),
                   (vis | ~row_real).all(4).all(2) & cols_whole, ext.all(4).all(2) & cols_whole, rows_exist, label)
            # backward dK/dV: a program per key block, over query blocks
            ext = free & row_real
            whole = cols_whole.view(p, nk, 1)
            real_full = ((vis | ~row_real).all(4).all(2).transpose(1, 2) & whole)
            ext_full = free.all(4).all(2).transpose(1, 2) & whole & rows_exist.view(p, 1, nq)
            _check(False, bwd[gi], vis.any(4).any(2).transpose(1, 2), ext.any(4).any(2).transpose(1, 2),
                   real_full, ext_full, cols_exist, label)


@triton.jit
def _chunk_starts_kernel(DIAG, OUT, chunk, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, _chunk_start(tl.load(DIAG + offs), chunk))


def test_chunk_start_floors_negative_diagonals(interpret):
    """A query above the first key (diagonal < 0, seqlen_q > seqlen_k) belongs to the chunk below 0 and sees
    nothing; Triton's % truncates toward zero, so the kernels' chunk start corrects it to a floor."""
    diag = torch.arange(-32, 32, dtype=torch.int32, device=DEVICE)
    for chunk in (1, 3, 7, 16, 64):
        out = torch.empty_like(diag)
        _chunk_starts_kernel[(1,)](diag, out, chunk, N=diag.numel())
        want = diag - torch.remainder(diag, chunk)  # torch's remainder floors
        assert torch.equal(out.cpu(), want.cpu()), chunk
