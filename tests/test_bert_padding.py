"""Tests for flashtile.bert_padding against plain PyTorch indexing and Python loops."""

from __future__ import annotations

import pytest
import torch

from flashtile.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input

TRAILING = [(), (5,), (3, 4)]


def _random_mask(batch: int, seqlen: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(batch, seqlen, generator=gen) > 0.5
    # Edge rows are forced so every mask covers an empty and a full sequence.
    mask[0] = False
    mask[1] = True
    return mask


def _loop_reference(attention_mask, unused_mask=None):
    """Per-token Python loop giving indices, cu_seqlens, max_seqlen and seqused."""
    batch, seqlen = attention_mask.shape
    indices, cu, seqused = [], [0], []
    for b in range(batch):
        kept = used = 0
        for s in range(seqlen):
            is_used = bool(attention_mask[b, s])
            is_unused = unused_mask is not None and bool(unused_mask[b, s])
            if is_used or is_unused:
                indices.append(b * seqlen + s)
                kept += 1
            used += is_used
        cu.append(cu[-1] + kept)
        seqused.append(used)
    max_seqlen = max(cu[i + 1] - cu[i] for i in range(batch))
    return indices, cu, max_seqlen, seqused


@pytest.mark.parametrize("trailing", TRAILING)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64])
def test_unpad_metadata_and_round_trip(trailing, mask_dtype):
    gen = torch.Generator().manual_seed(0)
    batch, seqlen = 5, 7
    x = torch.randn(batch, seqlen, *trailing, generator=gen)
    mask = _random_mask(batch, seqlen, gen)

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask.to(mask_dtype))

    ref_idx, ref_cu, ref_max, ref_used = _loop_reference(mask)
    assert indices.dtype == torch.int64 and indices.tolist() == ref_idx
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == ref_cu
    assert isinstance(max_seqlen, int) and max_seqlen == ref_max == seqlen
    assert seqused.dtype == torch.int32 and seqused.tolist() == ref_used
    assert x_unpad.shape == (len(ref_idx), *trailing)
    torch.testing.assert_close(x_unpad, x[mask], rtol=0, atol=0)

    padded = pad_input(x_unpad, indices, batch, seqlen)
    assert padded.shape == x.shape
    expected = x * mask.reshape(batch, seqlen, *([1] * len(trailing)))
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_random_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(2, 6, (1,), generator=gen))
    seqlen = int(torch.randint(1, 12, (1,), generator=gen))
    x = torch.randn(batch, seqlen, 2, 3, generator=gen, dtype=torch.float64)
    mask = _random_mask(batch, seqlen, gen)
    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    assert cu_seqlens[-1].item() == x_unpad.shape[0] == mask.sum().item()
    assert max_seqlen == int(mask.sum(-1).max())
    torch.testing.assert_close(pad_input(x_unpad, indices, batch, seqlen), x * mask[..., None, None])


def test_all_padding_batch():
    x = torch.randn(3, 4, 2)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert x_unpad.shape == (0, 2) and indices.numel() == 0
    assert cu_seqlens.tolist() == [0, 0, 0, 0] and max_seqlen == 0 and seqused.tolist() == [0, 0, 0]
    torch.testing.assert_close(pad_input(x_unpad, indices, 3, 4), torch.zeros_like(x))


def test_unused_mask_semantics():
    gen = torch.Generator().manual_seed(1)
    batch, seqlen = 4, 6
    x = torch.randn(batch, seqlen, 3, generator=gen)
    # Row 0 empty, row 1 full; rows 2 and 3 have used tokens followed by allocated-but-unused slack,
    # and row 3 also has an unused token overlapping a used one, which must count once.
    attn = torch.tensor(
        [[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool
    )
    unused = torch.tensor(
        [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.bool
    )

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attn, unused)

    ref_idx, ref_cu, ref_max, ref_used = _loop_reference(attn, unused)
    assert indices.tolist() == ref_idx
    assert cu_seqlens.tolist() == ref_cu == [0, 0, 6, 10, 15]
    assert max_seqlen == ref_max == 6
    assert seqused.tolist() == ref_used == [0, 6, 2, 3]
    kept = attn | unused
    torch.testing.assert_close(x_unpad, x[kept], rtol=0, atol=0)
    torch.testing.assert_close(pad_input(x_unpad, indices, batch, seqlen), x * kept[..., None])

    # Without unused tokens the packing must match the plain call exactly.
    plain = unpad_input(x, attn)
    with_empty = unpad_input(x, attn, torch.zeros_like(attn))
    for a, b in zip(plain, with_empty):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert a == b


@pytest.mark.parametrize("trailing", TRAILING)
def test_index_first_axis_grad_matches_fancy_indexing(trailing):
    gen = torch.Generator().manual_seed(2)
    n = 9
    x = torch.randn(n, *trailing, generator=gen)
    indices = torch.tensor([7, 0, 3, 8, 4])
    grad_out = torch.randn(len(indices), *trailing, generator=gen)

    x_ours = x.clone().requires_grad_()
    out = index_first_axis(x_ours, indices)
    out.backward(grad_out)

    x_ref = x.clone().requires_grad_()
    ref = x_ref[indices]
    ref.backward(grad_out)

    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=0)
    assert x_ours.grad.shape == x.shape


def test_index_first_axis_repeated_indices_accumulate():
    x = torch.randn(4, 3, requires_grad=True)
    indices = torch.tensor([1, 1, 2])
    grad_out = torch.randn(3, 3)
    index_first_axis(x, indices).backward(grad_out)
    x_ref = x.detach().clone().requires_grad_()
    x_ref[indices].backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_index_first_axis_int32_indices():
    x = torch.randn(6, 2)
    idx = torch.tensor([5, 1, 2])
    torch.testing.assert_close(index_first_axis(x, idx.int()), x[idx], rtol=0, atol=0)
    torch.testing.assert_close(
        index_put_first_axis(x[idx], idx.int(), 6), index_put_first_axis(x[idx], idx, 6)
    )


@pytest.mark.parametrize("trailing", TRAILING)
def test_index_put_first_axis_matches_plain(trailing):
    gen = torch.Generator().manual_seed(3)
    n = 8
    indices = torch.tensor([6, 2, 5])
    values = torch.randn(len(indices), *trailing, generator=gen)
    grad_out = torch.randn(n, *trailing, generator=gen)

    v_ours = values.clone().requires_grad_()
    out = index_put_first_axis(v_ours, indices, n)
    out.backward(grad_out)

    v_ref = values.clone().requires_grad_()
    ref = torch.zeros(n, *trailing).index_put((indices,), v_ref)
    ref.backward(grad_out)

    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(v_ours.grad, v_ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("trailing", [(3,), (2, 3)])
def test_unpad_pad_grads_match_fancy_indexing(trailing):
    gen = torch.Generator().manual_seed(4)
    batch, seqlen = 4, 5
    x = torch.randn(batch, seqlen, *trailing, generator=gen)
    mask = _random_mask(batch, seqlen, gen)
    indices = mask.flatten().nonzero().flatten()
    w = torch.randn(batch, seqlen, *trailing, generator=gen)

    # Unpad then pad, weighted so each position gets a distinct gradient.
    x_ours = x.clone().requires_grad_()
    x_unpad, idx, *_ = unpad_input(x_ours, mask)
    (pad_input(x_unpad * 2, idx, batch, seqlen) * w).sum().backward()

    x_ref = x.clone().requires_grad_()
    flat = x_ref.reshape(batch * seqlen, *trailing)[indices]
    padded_ref = torch.zeros(batch * seqlen, *trailing).index_put((indices,), flat * 2)
    (padded_ref.reshape_as(x) * w).sum().backward()

    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(x_ours.grad, 2 * w * mask.reshape(batch, seqlen, *([1] * len(trailing))))


@pytest.mark.parametrize("trailing", [(), (2,), (2, 3)])
def test_gradcheck_float64(trailing):
    gen = torch.Generator().manual_seed(5)
    batch, seqlen = 3, 4
    mask = _random_mask(batch, seqlen, gen)
    indices = mask.flatten().nonzero().flatten()
    total = indices.numel()

    x = torch.randn(batch * seqlen, *trailing, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))
    assert torch.autograd.gradgradcheck(lambda t: index_first_axis(t, indices), (x,))

    v = torch.randn(total, *trailing, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, batch * seqlen), (v,))
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, batch, seqlen), (v,))
    assert torch.autograd.gradgradcheck(lambda t: pad_input(t, indices, batch, seqlen), (v,))

    h = torch.randn(batch, seqlen, *trailing, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (h,))


def test_preserves_dtype_and_noncontiguous_input():
    gen = torch.Generator().manual_seed(6)
    batch, seqlen = 3, 5
    base = torch.randn(seqlen, batch, 4, 2, generator=gen).to(torch.bfloat16)
    x = base.transpose(0, 1)  # (b, s, h, d), non-contiguous
    mask = _random_mask(batch, seqlen, gen)
    x_unpad, indices, *_ = unpad_input(x, mask)
    assert x_unpad.dtype == torch.bfloat16
    torch.testing.assert_close(x_unpad, x[mask], rtol=0, atol=0)
    padded = pad_input(x_unpad, indices, batch, seqlen)
    assert padded.dtype == torch.bfloat16
    torch.testing.assert_close(padded, x * mask[..., None, None], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(7)
    batch, seqlen = 4, 9
    x = torch.randn(batch, seqlen, 3, 8, generator=gen)
    mask = _random_mask(batch, seqlen, gen)
    unused = (torch.rand(batch, seqlen, generator=gen) > 0.7) & ~mask
    cpu = unpad_input(x, mask, unused)
    gpu = unpad_input(x.cuda(), mask.cuda(), unused.cuda())
    for a, b in zip(cpu, gpu):
        if isinstance(a, torch.Tensor):
            assert b.device.type == "cuda"
            torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0)
        else:
            assert a == b
    xg = x.cuda().requires_grad_()
    out, idx, *_ = unpad_input(xg, mask.cuda(), unused.cuda())
    pad_input(out, idx, batch, seqlen).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), (mask | unused)[..., None, None].expand_as(x).float())


def test_unpad_input_for_concatenated_sequences():
    from flashtile.bert_padding import unpad_input_for_concatenated_sequences

    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 4)
    out, indices, cu, max_len = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and cu.dtype == torch.int32 and max_len == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(out, x.reshape(18, 4)[indices])


def test_index_first_axis_residual_grads():
    from flashtile.bert_padding import index_first_axis_residual

    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([5, 0, 2])
    assert torch.autograd.gradcheck(lambda t: index_first_axis_residual(t, idx), (x,))
    rows, res = index_first_axis_residual(x, idx)
    assert torch.equal(rows, x[idx]) and torch.equal(res, x)
