"""flash_attn_varlen_func with block_table (paged KV prefill) equals the contiguous varlen call."""

import pytest
import torch

import flashtile
from flashtile import config


def _paged(k, v, lens, page_size, extra_pages=3):
    """Scatter packed keys/values (total, h_k, d) into shuffled pages; return the caches and block table."""
    b, (h_k, d) = len(lens), k.shape[1:]
    max_blocks = max(1, max(-(-n // page_size) for n in lens))
    num_blocks = b * max_blocks + extra_pages
    caches = [torch.randn(num_blocks, page_size, h_k, d, dtype=k.dtype) for _ in range(2)]  # junk elsewhere
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)  # unused slots hold invalid ids
    start = 0
    for i, n in enumerate(lens):
        for j in range(n):
            if j % page_size == 0:
                table[i, j // page_size] = order.pop()
            for cache, src in zip(caches, (k, v)):
                cache[table[i, j // page_size], j % page_size] = src[start + j]
        start += n
    return caches[0], caches[1], table


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kernels", [False, True], ids=["cpu", "interpret"])
def test_paged_equals_contiguous(page_size, kernels):
    with config.override(interpret=kernels, fwd_tiles=(16, 16, 4, 1) if kernels else None):
        _check_paged_equals_contiguous(page_size)


def _check_paged_equals_contiguous(page_size):
    lens_q, lens_k = [5, 1, 9], [12, 0, 30]
    h, h_k, d = 4, 2, 16
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, d)
    k, v = torch.randn(sum(lens_k), h_k, d), torch.randn(sum(lens_k), h_k, d)
    kc, vc, table = _paged(k, v, lens_k, page_size)
    want = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    got = flashtile.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                           block_table=table)
    assert (got - want).abs().max().item() < 1e-5


def test_paged_errors():
    q = torch.randn(4, 2, 8)
    kc = torch.randn(3, 4, 2, 8)
    cu_q = torch.tensor([0, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 6], dtype=torch.int32)
    f = flashtile.flash_attn_varlen_func
    with pytest.raises(TypeError, match="block_table must be an int32"):
        f(q, kc, kc, cu_q, cu_k, 4, 6, block_table=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="paged cache"):
        f(q, kc[0], kc[0], cu_q, cu_k, 4, 6, block_table=torch.zeros(1, 2, dtype=torch.int32))
    # the index tensors as in the dense varlen call
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        f(q, kc, kc, cu_q, cu_k.long(), 4, 6, block_table=torch.zeros(1, 2, dtype=torch.int32))
    # values checked on CPU (free there; on CUDA they would be host syncs, and are clamped instead)
    with pytest.raises(ValueError, match="max_seqlen_k=5 is below the longest key length 6"):
        f(q, kc, kc, cu_q, cu_k, 4, 5, block_table=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="exceeds block_table's capacity"):
        f(q, kc, kc, cu_q, torch.tensor([0, 9], dtype=torch.int32), 4, 9,
          block_table=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"pages in use must be in \[0, num_blocks=3\)"):
        f(q, kc, kc, cu_q, cu_k, 4, 6, block_table=torch.tensor([[0, 3]], dtype=torch.int32))


def test_max_seqlen_k_past_the_table_and_padded_entries():
    # max_seqlen_k is an upper bound: above the table's capacity it is fine while every length fits;
    # entries past a sequence's pages are padding (-1) and never read
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cu_q = torch.tensor([0, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 6], dtype=torch.int32)
    kc, vc, table = _paged(k, v, [6], 4)
    table = torch.cat([table, torch.full((1, 1), -1, dtype=torch.int32)], 1)  # one padding entry more
    want = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6)
    got = flashtile.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 4, 100, block_table=table)
    assert (got - want).abs().max().item() < 1e-5


def test_gathered_slots_past_a_sequence_hold_zero_values():
    # pages a slot past its sequence names may be unwritten (NaN here): P = 0 times NaN would be NaN in kernels that
    # read V by TMA without a row mask, so the gather zeroes those values
    from flashtile.paged import paged_to_varlen

    kc = torch.full((6, 4, 1, 8), float("nan"))
    vc = torch.full((6, 4, 1, 8), float("nan"))
    kc[:3], vc[:3] = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    table = torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    k, v, cu_dense, lens = paged_to_varlen(kc, vc, table, cu, 8)
    assert lens.tolist() == [7, 3] and cu_dense.tolist() == [0, 8, 16]
    assert torch.isfinite(v).all() and torch.equal(v[7], torch.zeros_like(v[7]))
    assert torch.equal(v[11:16], torch.zeros(5, 1, 8))
    assert torch.equal(v[:7], vc[:2].flatten(0, 1)[:7]) and torch.equal(v[8:11], vc[2, :3])
