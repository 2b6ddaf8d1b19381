"""flashtile.distributed without processes: the step planner (ALiBi and chunks included), the lse merge,
sharding, argument errors and the simulated ring (the schedule's math in one process) against
flash_attn_func."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashtile.distributed as cp
from distributed_cases import reference
from flashtile.backends.masking import normalize_window, visible
from flashtile.distributed.band import band_pieces
from flashtile.distributed.common import check_call
from flashtile.distributed.merge import merge_all, to_merge_lse
from flashtile.distributed.plan import chunk_docs, plan_calls, plan_pieces, segments
from flashtile.distributed.ring import ring_plan, ring_steps
from flashtile.distributed.sharding import layout_runs


def _band(q_pos, nq, k_pos, nk, left, right):
    i = torch.arange(nq)[:, None] + q_pos
    j = torch.arange(nk)[None, :] + k_pos
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (3, 0), (2, 5), (0, 0), (7, -1), (-1, 4)])
def test_band_piece_reproduces_the_band(left, right):
    """Every rectangle offset: the kernels' mask (their window normalisation included) on the planned
    rectangles equals the global band, and what the rectangles leave out holds no visible pair."""
    for q_pos, k_pos, nq, nk in itertools.product(range(0, 24, 3), range(0, 24, 5), (1, 4, 7, 12), (1, 5, 8)):
        want = _band(q_pos, nq, k_pos, nk, left, right)
        got = torch.zeros_like(want)
        for r0, rows, cols, kl, kr in band_pieces(q_pos, nq, k_pos, nk, left, right):
            kl, kr = normalize_window((kl, kr), False, cols)
            mask = visible(torch.arange(rows)[:, None], torch.arange(cols)[None, :], rows, cols, kl, kr)
            got[r0:r0 + rows, :cols] |= mask
        assert torch.equal(got, want), (q_pos, k_pos, nq, nk)


def _planned(q_runs, k_runs, left, right, docs):
    """What the ALiBi plan computes per (query, key) of the two shards: how many pieces see the pair, and
    the bias a piece's kernel adds (slope 1) corrected by its shift (NaN where no piece sees it)."""
    nq, nk = sum(n for _, n in q_runs), sum(n for _, n in k_runs)
    seen = torch.zeros(nq, nk, dtype=torch.int64)
    bias = torch.full((nq, nk), float("nan"), dtype=torch.float64)
    for p in plan_pieces(segments(q_runs), segments(k_runs), left, right, docs, alibi=True):
        rows, cols = p.q1 - p.q0, p.k1 - p.k0
        kl, kr = normalize_window((p.left, p.right), False, cols)
        i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        mask = visible(i, j, rows, cols, kl, kr)
        seen[p.q0:p.q1, p.k0:p.k1] += mask
        bias[p.q0:p.q1, p.k0:p.k1][mask] = (-p.sign * (i + cols - rows - j).abs() - p.shift).double()[mask]
    return seen, bias


@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (3, 0), (2, 5), (0, 2), (7, -1)])
def test_alibi_plan_gives_global_distances(left, right):
    """Under ALiBi each visible pair of every ring step and gather is seen once, and the kernels' bias with the
    piece's slope sign and shift is ``-|query - key|`` in global positions (what flash_attn_func adds)."""
    total = 24
    for layout, world, docs in itertools.product(("contiguous", "zigzag"), (2, 3), (None, (0, 5, 13, 14, 24))):
        for r, s in itertools.product(range(world), range(world + 1)):
            q_runs = layout_runs(layout, total, world, r)
            k_runs = [(0, total)] if s == world else layout_runs(layout, total, world, s)  # s == world: the gather
            qpos = torch.tensor([p for a, n in q_runs for p in range(a, a + n)])[:, None]
            kpos = torch.tensor([p for a, n in k_runs for p in range(a, a + n)])[None, :]
            want = torch.ones(qpos.shape[0], kpos.shape[1], dtype=torch.bool)
            if left >= 0:
                want &= kpos >= qpos - left
            if right >= 0:
                want &= kpos <= qpos + right
            if docs is not None:
                bounds = torch.tensor(docs)
                want &= torch.searchsorted(bounds, qpos, right=True) == torch.searchsorted(bounds, kpos, right=True)
            seen, bias = _planned(q_runs, k_runs, left, right, docs)
            assert torch.equal(seen, want.long()), (layout, world, r, s, docs)
            assert torch.equal(bias[want], -(qpos - kpos).abs().double().expand_as(want)[want]), (layout, r, s)


def test_alibi_shifts_far_blocks_and_keeps_the_own_block_aligned():
    plan = ring_plan("contiguous", 32, 2, 1, -1, 0, None, True)
    assert [(p.sign, p.shift) for c in plan[0] for p in c.pieces] == [(1, 0)]  # own block: the kernels' bias
    # the block before: keys at or before the kernels' diagonal (slope as is, shifted by the 16 positions
    # between the blocks) and past it (slope negated; its last row sees none, so 15 rows, shifted by 15)
    assert sorted((p.sign, p.shift, p.q1 - p.q0) for c in plan[1] for p in c.pieces) == [(-1, 15, 15), (1, 16, 16)]


def test_chunk_docs_cut_every_document_from_its_start():
    assert chunk_docs(None, 32, 0) is None and chunk_docs(None, 32, 32) is None
    assert chunk_docs(None, 32, 10) == (0, 10, 20, 30, 32)
    assert chunk_docs((0, 5, 13, 32), 32, 6) == (0, 5, 11, 13, 19, 25, 31, 32)
    # a contiguous ring of 2 ranks over chunks of 8: no chunk spans the shard boundary, remote steps vanish
    assert [len(step) for step in ring_plan("contiguous", 32, 2, 0, -1, -1, chunk_docs(None, 32, 8))] == [1, 0]


def test_ring_stops_after_the_last_step_with_work():
    assert ring_steps("contiguous", 32, 4, -1, 0, None) == 4  # causal: rank 3 needs every block
    assert ring_steps("zigzag", 32, 4, -1, 0, None) == 4
    assert ring_steps("contiguous", 32, 4, 5, 0, None) == 2  # a window of 5 reaches one shard of 8 back
    assert ring_steps("contiguous", 32, 4, 9, 0, None) == 3
    assert ring_steps("contiguous", 32, 2, -1, -1, chunk_docs(None, 32, 8)) == 1  # chunks inside the shards


def test_causal_ring_steps_are_full_diagonal_or_skipped():
    plan = ring_plan("contiguous", 64, 4, 2, -1, 0, None)
    kinds = [[(c.left, c.right) for c in step] for step in plan]
    assert kinds == [[(-1, 0)], [(-1, -1)], [(-1, -1)], []]  # own (causal), ranks 1 and 0 (full), rank 3 (none)


def test_zigzag_steps_balance_work():
    """Zigzag causal: every rank's later steps cover the same number of pairs (one chunk squared, twice)."""
    world, total = 4, 64
    c = total // (2 * world)
    for rank in range(world):
        plan = ring_plan("zigzag", total, world, rank, -1, 0, None)
        assert [(p.q0, p.q1, p.k0, p.k1, p.left, p.right) for c in plan[0] for p in c.pieces] == \
            [(0, 2 * c, 0, 2 * c, -1, 0)]  # own step: one causal call over both chunks
        for step in plan[1:]:
            assert len(step) == 1 and step[0].left == step[0].right == -1
            p = step[0].pieces[0]
            assert (p.q1 - p.q0) * (p.k1 - p.k0) == 2 * c * c


def test_varlen_pieces_stay_in_their_documents():
    docs = (0, 5, 13, 14, 27, 32)
    mine = segments([(8, 8)])
    calls = plan_calls(mine, segments([(0, 32)]), -1, 0, docs)
    # docs [5, 13), [13, 14), [14, 27) meet [8, 16): each piece's keys run from its document's start
    got = sorted((p.q0, p.q1, p.k0, p.k1) for c in calls for p in c.pieces)
    assert got == [(0, 5, 5, 13), (5, 6, 13, 14), (6, 8, 14, 16)]
    assert len(calls) == 2  # the two causal pieces share one varlen call; the 1-token one is unmasked
    pieces = plan_pieces(mine, segments([(0, 8)]), -1, -1, docs)
    assert [(p.q0, p.q1, p.k0, p.k1) for p in pieces] == [(0, 5, 5, 8)]  # only doc [5, 13) crosses


def test_merge_matches_softmax_over_the_union():
    torch.manual_seed(0)
    s = torch.randn(3, 2, 10, dtype=torch.float64)
    vals = torch.randn(10, 4, dtype=torch.float64)
    full = torch.softmax(s, -1) @ vals
    parts = [(0, 4), (4, 4), (4, 10)]  # the empty middle part must not disturb anything
    outs, lses = [], []
    for a, b in parts:
        lse = torch.logsumexp(s[..., a:b], -1) if b > a else torch.full(s.shape[:-1], float("inf"), dtype=s.dtype)
        out = torch.softmax(s[..., a:b], -1) @ vals[a:b] if b > a else torch.zeros(3, 2, 4, dtype=s.dtype)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_all(outs, lses)
    assert torch.allclose(out, full) and torch.allclose(lse, torch.logsumexp(s, -1))
    out, lse = merge_all([outs[1]], [lses[1]])  # a row that saw nothing stays empty: out 0, lse -inf
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, to_merge_lse(lses[1]))


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_unshard_round_trip(layout):
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [cp.shard(x, 3, r, layout) for r in range(3)]
    assert torch.equal(cp.unshard(shards, layout), x)
    if layout == "zigzag":
        assert shards[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def test_shard_hybrid_and_varlen_meta():
    x = torch.arange(16)[None]
    # zigzag over 2 ring ranks: ring rank 1 holds chunks 1 and 2 ([4, 8) + [8, 12)); its 2nd Ulysses part is [8, 12)
    assert cp.shard_hybrid(x, 2, 1, 2, 1, "zigzag").tolist() == [[8, 9, 10, 11]]
    cu, pos = cp.varlen_shard_meta([0, 5, 13, 16], 2, 0, "zigzag")  # rank 0: tokens 0-3 and 12-15
    assert cu.tolist() == [0, 4, 5, 8] and pos.tolist() == [0, 1, 2, 3, 7, 0, 1, 2]


def test_errors_name_the_argument():
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    args = (0.0, None, True, (-1, -1), 0.0, None, False)
    with pytest.raises(ValueError, match="dropout_p"):
        check_call(q, k, k, 0.5, *args[1:], 2, "contiguous", None, "f")
    with pytest.raises(ValueError, match="alibi_slopes"):
        check_call(q, k, k, *args[:5], torch.ones(3), False, 2, "contiguous", None, "f")
    with pytest.raises(TypeError, match="attention_chunk"):
        check_call(q, k, k, *args, 2, "contiguous", None, "f", attention_chunk=1.5)
    with pytest.raises(ValueError, match="k's local seqlen"):
        check_call(q, k[:, :4], k[:, :4], *args, 2, "contiguous", None, "f")
    with pytest.raises(ValueError, match="divisible by 2"):
        check_call(q[:, :7], k[:, :7], k[:, :7], *args, 2, "zigzag", None, "f")
    with pytest.raises(ValueError, match="cu_seqlens ends at 12"):
        check_call(q, k, k, *args, 2, "contiguous", [0, 12], "f")
    with pytest.raises(ValueError, match="layout"):
        cp.shard(q, 2, 0, "spiral")
    with pytest.raises(ValueError, match="divisible by 6"):
        cp.shard(torch.randn(1, 8), 3, 0, "zigzag")


@pytest.mark.parametrize("layout,world,kw", [
    ("contiguous", 3, dict(causal=True, window_size=(5, 0))),
    ("zigzag", 2, dict(causal=True, softcap=2.0)),
    ("zigzag", 4, dict(window_size=(3, 6), cu_seqlens=[0, 9, 10, 32])),
    ("contiguous", 4, dict(attention_chunk=5, alibi_slopes=torch.tensor([0.5, 0.25, 0.9, 0.1]))),
    ("zigzag", 2, dict(window_size=(7, 2), softcap=2.0, attention_chunk=11, alibi_slopes=torch.rand(4))),
])
def test_simulated_ring_matches_flash_attn_func(layout, world, kw):
    q, k, v = (torch.randn(1, 24 if world == 3 else 32, h, 16, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = cp.simulated_ring_attention(q, k, v, world, layout, dout=dout, **kw)
    kw = dict(kw)
    docs = kw.pop("cu_seqlens", None)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*full, kw, docs)
    ref_out.backward(dout)
    ref_grads = [x.grad for x in full]
    assert torch.allclose(out, ref_out, atol=1e-10) and torch.allclose(lse, ref_lse, atol=1e-10)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert torch.allclose(got, want, atol=1e-10)


def test_fold_sink_is_a_valueless_part():
    from flashtile.distributed.merge import fold_sink_

    out = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    lse = torch.randn(2, 3, 4, dtype=torch.float64)
    lse[0, 0] = float("-inf")  # a row that saw no key
    out[0, 0] = 0
    sink = torch.randn(4, dtype=torch.float64)
    want_out, want_lse = merge_all([out, torch.zeros_like(out)], [lse, sink.expand_as(lse)])
    got_out, got_lse = out.clone(), lse.clone()
    fold_sink_(got_out, got_lse, sink)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_lse, want_lse)
    assert torch.equal(got_lse[0, 0], sink) and not got_out[0, 0].any()  # empty rows: out 0, lse = sink
    empty = torch.full((1, 1, 4), float("-inf"), dtype=torch.float64)
    fold_sink_(torch.zeros(1, 1, 4, 2, dtype=torch.float64), empty, torch.full((4,), float("-inf"),
                                                                                dtype=torch.float64))
    assert empty.isneginf().all()  # a -inf sink on an empty row: no NaN
