"""The whole-row decode kernel on the H200 (FLASHTILE_DECODE_ROWS=H, or its rule: programs of H adjacent kv heads over a
key split): every call routed there must match the PyTorch reference as the default kernels do (FlashAttention's
tolerance rule) and append its new keys exactly."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.backends.triton import board, decode_gluon, decode_rows
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu

# (b, h, h_k, d, cap, s_new): GQA 4:1 and 8:1, ragged lengths, appended keys, caches off the tile grid, and one
# the Gluon rule would take (b = 32, 16k; MHA keeps the reference small): the experiment comes first
SHAPES = [(32, 8, 8, 128, 16384, 0), (32, 32, 8, 128, 4133, 1), (4, 64, 8, 128, 3000, 3), (8, 32, 8, 64, 2049, 1)]


@pytest.mark.parametrize("heads,pdl,fused", [(1, 0, 0), (2, 0, 0), (4, 0, 0), (8, 0, 0), (8, 1, 0), (8, 0, 1),
                                             (8, 1, 1), (4, 0, 1)])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_matches_reference(monkeypatch, heads, pdl, fused, shape):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", str(heads))
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_PDL", str(pdl))
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_FUSED", str(fused))
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap)
    _check(q, kc, vc, kw, causal=True)
    assert calls, "the row-stream kernel did not run"


@pytest.mark.parametrize("programs", ["", "7"])  # one a slot; or few, each over several rows and row ends
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_stream_k_matches_reference(monkeypatch, programs, shape):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", "8")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", "1")
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_PROGRAMS", programs)
    calls = []
    real = decode_rows._streamk
    monkeypatch.setattr(decode_rows, "_streamk", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap + 1)
    _check(q, kc, vc, kw, causal=True)
    assert calls, "the stream-K kernel did not run"


# (b, h, h_k, d, cap, s_new, page): a tile a page, several tiles a page, GQA 8:1, appends through the table, d = 64
PAGED_SHAPES = [(32, 32, 8, 128, 4133, 1, 16), (8, 64, 8, 128, 3000, 2, 256), (4, 32, 8, 64, 2100, 0, 64),
                (2, 8, 8, 128, 20000, 3, 32)]


@pytest.mark.parametrize("heads", [8, 4])
@pytest.mark.parametrize("shape", PAGED_SHAPES,
                         ids=[f"b{s[0]}h{s[1]}d{s[3]}c{s[4]}n{s[5]}p{s[6]}" for s in PAGED_SHAPES])
def test_paged_matches_reference(monkeypatch, heads, shape):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", str(heads))
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["block_table"]), real(*a, **k))[1])
    b, h, h_k, d, cap, s_new, page = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, page=page, seed=cap + page)
    _check(q, kc, vc, kw, causal=True)
    assert len(calls) == 1 and calls[0] is not None, "the row kernel did not take the paged call"


# the rule's grids (decode_rows.RULE_BOUNDS) at their shortest caches; MHA keeps the reference small
# (an H100's b = 32 bound, H100_WHOLE_FROM, is 96k: there 64k goes to the Gluon kernel; its whole rows from 96k are
# the kernel the paged and forced-heads tests run, and a 12 GiB cache's reference does not fit an 80 GB H100)
RULE_SHAPES = [(32, 8, 8, 128, 65536, 1), (64, 8, 8, 128, 8192, 0), (16, 8, 8, 128, 131072, 1)]


# the tests of 4-32 GiB caches share one xdist worker (--dist loadgroup): side by side they ran the GPU out of memory
@pytest.mark.xdist_group("big_caches")
@pytest.mark.parametrize("shape", RULE_SHAPES, ids=[f"b{s[0]}c{s[4]}n{s[5]}" for s in RULE_SHAPES])
def test_rule_takes_long_caches_on_large_batches(monkeypatch, shape):
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    monkeypatch.setenv("FLASHTILE_DECODE_GLUON_SPLITS", "1")  # b = 16 is the split Gluon rule's since session 32
    calls, gluon = [], []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["heads"]), real(*a, **k))[1])
    real_gluon = decode_gluon.gluon_decode
    monkeypatch.setattr(decode_gluon, "gluon_decode", lambda *a, **k: (gluon.append(1), real_gluon(*a, **k))[1])
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap + b)
    _check(q, kc, vc, kw, causal=True)
    # 4 heads a program: their programs fill the SMs once at b = 32 and 64 (decode_rows.one_wave, since session 28)
    # and b = 16 from 128k (NARROW_RULE_BOUNDS, session 29); an H100 at b = 32: whole rows from 96k, none below
    heads = 0 if b == 32 and cap < decode_rows.H100_WHOLE_FROM and board.h100(q.device) else 4
    want = [heads] if heads else []
    assert calls == want, "the rule did not take the call as its bounds say"
    assert gluon == ([] if heads else [1]), "the Gluon kernel did not take the call the row rule left"
    _check(q, kc, vc, kw, causal=True, num_splits=1)  # an explicit split count keeps the default kernels
    assert calls == want
    _check(q, kc, vc, dict(kw, cache_seqlens=cap // 2 - s_new))  # an int length
    assert calls == want * 2


@pytest.mark.parametrize("b, page, taken", [(32, 16, True), (32, 256, True), (32, 8, False), (16, 16, True),
                                            (16, 256, False)])
def test_rule_takes_paged_calls_on_large_batches(monkeypatch, b, page, taken):
    """decode_rows.PAGED_RULE_BOUNDS / SMALL_PAGE_RULE_BOUNDS: from 8k keys, b = 32 with pages of whole tiles (8-key
    pages keep the per-head paged kernel), b = 16 with 16-key pages only."""
    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["heads"]), real(*a, **k))[1])
    q, kc, vc, kw = _inputs(b, 1, 1, 8, 8, 128, 8192, torch.bfloat16, page=page, seed=page + b)
    _check(q, kc, vc, kw, causal=True)
    assert calls == ([8] if taken else [])


@pytest.mark.xdist_group("big_caches")
@pytest.mark.parametrize("streamk", ["0", "1"])
def test_rule_in_a_graph_of_layers(monkeypatch, streamk):
    """Four layers of one decode step in a CUDA graph (each layer's query the output before it), every launch a
    programmatic dependent: every replay equals the eager calls."""
    from test_gpu_kvcache import _capture

    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_STREAMK", streamk)
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["heads"]), real(*a, **k))[1])
    b, h, h_k, d, cap = 32, 8, 8, 128, 65536
    heads = 4
    if board.h100(torch.device("cuda")):  # its bounds leave 64k to the Gluon kernel: its whole rows from 64k here
        monkeypatch.setattr(decode_rows, "H100_WHOLE_FROM", cap)
        heads = 8
    g = torch.Generator(device="cuda").manual_seed(7)
    q0 = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    caches = [(torch.randn(b, cap, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g),
               torch.randn(b, cap, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(4)]
    lens = torch.randint(1, cap + 1, (b,), device="cuda", dtype=torch.int32, generator=g)

    def step():
        x = q0
        for kc, vc in caches:
            x = flash_attn_with_kvcache(x, kc, vc, cache_seqlens=lens)
        return x

    want = step().clone()
    assert calls == [heads] * 4
    graph, got = _capture(step)
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_paged_rule_in_a_graph_of_layers(monkeypatch):
    """A decode step over 16-token paged caches in a CUDA graph, each layer appending one key through the block
    table (the append kernel, then the row kernel): replays from the same caches equal the eager step."""
    from test_gpu_kvcache import _capture

    monkeypatch.delenv("FLASHTILE_DECODE_ROWS", raising=False)
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(k["heads"]), real(*a, **k))[1])
    b, h, h_k, d, cap, page = 32, 8, 8, 128, 8192, 16
    g = torch.Generator(device="cuda").manual_seed(11)
    q0 = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    per = cap // page
    table = torch.randperm(b * per, device="cuda", generator=g).view(b, per).to(torch.int32)
    pools = [torch.randn(b * per, page, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(8)]
    k_new, v_new = (torch.randn(b, 1, h_k, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    lens = torch.randint(1, cap, (b,), device="cuda", dtype=torch.int32, generator=g)
    start = [p.clone() for p in pools]

    def step():
        x = q0
        for kc, vc in zip(pools[::2], pools[1::2]):
            x = flash_attn_with_kvcache(x, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table)
        return x

    want = step().clone()
    assert calls == [8] * 4  # paged caches keep whole rows
    graph, got = _capture(step, before_capture=lambda: [p.copy_(s) for p, s in zip(pools, start)])
    for _ in range(2):
        for p, s in zip(pools, start):
            p.copy_(s)
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
