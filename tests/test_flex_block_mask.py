"""create_block_mask against a brute-force classification of every block (skipped, partial, full), the
transposed q-side lists, broadcast B / H, helpers (and_masks, or_masks, noop_mask), and repr / sparsity."""

import pytest
import torch

from flashtile.flex import and_masks, create_block_mask, noop_mask, or_masks


def _brute(mask_mod, B, H, L, S, bq, bkv):
    nq, nk = -(-L // bq), -(-S // bkv)
    partial = torch.zeros(B, H, nq, nk, dtype=torch.bool)
    full = torch.zeros_like(partial)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                for j in range(nk):
                    rows, cols = range(i * bq, min(L, (i + 1) * bq)), range(j * bkv, min(S, (j + 1) * bkv))
                    vals = [bool(mask_mod(torch.tensor(b), torch.tensor(h), torch.tensor(qi), torch.tensor(ki)))
                            for qi in rows for ki in cols]
                    full[b, h, i, j] = all(vals)
                    partial[b, h, i, j] = any(vals) and not all(vals)
    return partial, full


def _lists_match(num, idx, want):
    for pos in torch.nonzero(torch.ones(want.shape[:-1])).tolist():
        n = int(num[tuple(pos)])
        assert sorted(idx[tuple(pos)][:n].tolist()) == torch.nonzero(want[tuple(pos)]).flatten().tolist()


@pytest.mark.parametrize("L, S, bs", [(40, 40, 16), (33, 70, (16, 32)), (64, 48, 16)])
def test_blocks_match_brute_force(L, S, bs):
    doc = torch.tensor([0] * 10 + [1] * 25 + [2] * 60)

    def mask(b, h, q, kv):
        return ((q >= kv) & (doc[q] == doc[kv])) | ((kv < 3) & (h == 1)) | (b == 1) & (q - kv < 5)

    B, H = 2, 2
    bq, bkv = (bs, bs) if isinstance(bs, int) else bs
    bm = create_block_mask(mask, B, H, L, S, device="cpu", BLOCK_SIZE=bs)
    partial, full = _brute(mask, B, H, L, S, bq, bkv)
    assert torch.equal(bm.kv_num_blocks, partial.sum(-1, dtype=torch.int32))
    assert torch.equal(bm.full_kv_num_blocks, full.sum(-1, dtype=torch.int32))
    _lists_match(bm.kv_num_blocks, bm.kv_indices, partial)
    _lists_match(bm.full_kv_num_blocks, bm.full_kv_indices, full)
    _lists_match(bm.q_num_blocks, bm.q_indices, partial.transpose(-1, -2))
    _lists_match(bm.full_q_num_blocks, bm.full_q_indices, full.transpose(-1, -2))
    assert bm.shape == (B, H, L, S) and bm.BLOCK_SIZE == (bq, bkv)
    assert torch.equal(bm.to_dense(), partial | full)
    assert abs(bm.sparsity() - 100 * (1 - (partial | full).double().mean().item())) < 1e-9


def test_broadcast_dims_and_helpers():
    def causal(b, h, q, kv):
        return q >= kv

    def window(b, h, q, kv):
        return q - kv < 20

    bm = create_block_mask(and_masks(causal, window), None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    assert bm.shape == (1, 1, 64, 64)
    assert bm.to_string() == "+...\n++..\n+++.\n.+++"  # a window of 20 keys: no block is full
    either = create_block_mask(or_masks(causal, lambda b, h, q, kv: kv < 16), None, None, 64, 64, device="cpu",
                               BLOCK_SIZE=16)
    assert either.to_string() == "#...\n#+..\n##+.\n###+"  # (block 0, 0): every key < 16
    every = create_block_mask(noop_mask, 2, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    assert every.sparsity() == 0.0 and int(every.kv_num_blocks.sum()) == 0
    assert "sparsity=" in repr(bm) and "and_masks(causal, window)" in repr(bm)


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(noop_mask, None, None, 32, 32, device="cpu", BLOCK_SIZE=24)


def test_from_kv_blocks_round_trips_and_takes_padded_lists():
    from flashtile.flex import BlockMask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    made = create_block_mask(causal, 1, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    again = BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                     made.full_kv_indices, BLOCK_SIZE=16, mask_mod=causal)
    assert again.shape == made.shape and again.BLOCK_SIZE == made.BLOCK_SIZE
    for got, want in zip(again.tensors(), made.tensors()):
        assert torch.equal(got, want)
    # FlexAttention-style lists padded with zeros past each row's count (block 0 repeated): query block i sees
    # key blocks 0..i, the diagonal one partly
    nq = 4
    num = torch.arange(nq, dtype=torch.int32).view(1, 1, nq)                 # full blocks: 0 .. i-1
    idx = torch.zeros(1, 1, nq, nq, dtype=torch.int32)
    for i in range(nq):
        idx[0, 0, i, :i] = torch.arange(i)
    diag = torch.arange(nq, dtype=torch.int32).view(1, 1, nq, 1).expand(1, 1, nq, nq).contiguous()
    mask = BlockMask.from_kv_blocks(torch.ones(1, 1, nq, dtype=torch.int32), diag, num, idx, BLOCK_SIZE=16)
    assert mask.shape == (1, 1, 64, 64)
    assert torch.equal(mask.to_dense()[0, 0], torch.ones(nq, nq, dtype=torch.bool).tril())
    assert torch.equal(mask.full_q_num_blocks[0, 0], torch.tensor([3, 2, 1, 0], dtype=torch.int32))
    flat = mask.as_tuple()
    assert flat[:2] == (64, 64) and flat[-3:] == (16, 16, None) and len(flat) == 13
    assert mask.as_tuple(flatten=False)[0] == (64, 64)
    with pytest.raises(ValueError, match="both partly"):
        BlockMask.from_kv_blocks(num.clone().fill_(1), idx, num.clone().fill_(1), idx)
    with pytest.raises(ValueError, match="kv_indices must be"):
        BlockMask.from_kv_blocks(num, idx[0])
