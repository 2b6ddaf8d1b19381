"""The whole-row decode kernel on the GPU (programs of H adjacent kv heads over a key split, forced, or by its rule):
every call routed there must match the PyTorch reference as the default kernels do (FlashAttention's tolerance
rule) and append its new keys exactly."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import route as R
from spies import force_rows, record_kernels
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu

# (b, h, h_k, d, cap, s_new): GQA 4:1 and 8:1, ragged lengths, appended keys, caches off the tile grid, and one
# the Gluon rule would take (b = 32, 16k; MHA keeps the reference small)
SHAPES = [(32, 8, 8, 128, 16384, 0), (32, 32, 8, 128, 4133, 1), (4, 64, 8, 128, 3000, 3), (8, 32, 8, 64, 2049, 1)]


def _h100():
    return R.memory_class(R.device_props(torch.device("cuda"))) == "80GB"


@pytest.mark.parametrize("heads,pdl", [(1, False), (2, False), (4, False), (8, False), (8, None), (4, None)])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_matches_reference(monkeypatch, heads, pdl, shape):
    taken = force_rows(monkeypatch, heads)
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap)
    with config.override(decode_pdl=pdl):  # None: programmatic dependent launches on sm_90, as by default
        _check(q, kc, vc, kw, causal=True)
    assert taken, "the row kernel did not run"


# (b, h, h_k, d, cap, s_new, page): a tile a page, several tiles a page, GQA 8:1, appends through the table, d = 64
PAGED_SHAPES = [(32, 32, 8, 128, 4133, 1, 16), (8, 64, 8, 128, 3000, 2, 256), (4, 32, 8, 64, 2100, 0, 64),
                (2, 8, 8, 128, 20000, 3, 32)]


@pytest.mark.parametrize("heads", [8, 4])
@pytest.mark.parametrize("shape", PAGED_SHAPES,
                         ids=[f"b{s[0]}h{s[1]}d{s[3]}c{s[4]}n{s[5]}p{s[6]}" for s in PAGED_SHAPES])
def test_paged_matches_reference(monkeypatch, heads, shape):
    taken = force_rows(monkeypatch, heads)
    b, h, h_k, d, cap, s_new, page = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, page=page, seed=cap + page)
    _check(q, kc, vc, kw, causal=True)
    assert len(taken) == 1 and taken[0].stages == 2 * R._row_config(heads, True)[2] - 1


# the rule's grids (route.ROW_BOUNDS) at their shortest caches; MHA keeps the reference small (an H100's b = 32 band
# starts whole rows at 96k: there 64k goes to the Gluon kernel; a 12 GiB cache's reference does not fit 80 GB)
RULE_SHAPES = [(32, 8, 8, 128, 65536, 1), (64, 8, 8, 128, 8192, 0)]


# the tests of 4-32 GiB caches share one xdist worker (--dist loadgroup): side by side they ran the GPU out of memory
@pytest.mark.xdist_group("big_caches")
@pytest.mark.parametrize("shape", RULE_SHAPES, ids=[f"b{s[0]}c{s[4]}n{s[5]}" for s in RULE_SHAPES])
def test_rule_takes_long_caches_on_large_batches(monkeypatch, shape):
    taken = record_kernels(monkeypatch)
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap + b)
    _check(q, kc, vc, kw, causal=True)
    # 4 heads a program: their programs fill the SMs once at b = 32 and 64; an H100 at b = 32: whole rows from 96k,
    # the Gluon kernel below
    gluon = b == 32 and cap < R.WHOLE_ROW_BAND["80GB"][2] and _h100()
    assert [(r.kernel, r.heads) for r in taken] == ([("gluon", 0)] if gluon else [("rows", 4)])
    _check(q, kc, vc, kw, causal=True, num_splits=1)  # an explicit split count keeps the other kernels
    assert taken[-1].kernel != "rows"
    _check(q, kc, vc, dict(kw, cache_seqlens=cap // 2 - s_new))  # an int length
    assert taken[-1] == taken[0]


@pytest.mark.parametrize("b, page, taken", [(32, 16, True), (32, 256, True), (32, 8, False), (16, 16, True),
                                            (16, 256, False)])
def test_rule_takes_paged_calls_on_large_batches(monkeypatch, b, page, taken):
    """route.ROW_BOUNDS for pages: from 8k keys, b = 32 with pages of whole tiles (8-key pages keep the split
    kernel), b = 16 with 16-key pages only."""
    routes = record_kernels(monkeypatch)
    q, kc, vc, kw = _inputs(b, 1, 1, 8, 8, 128, 8192, torch.bfloat16, page=page, seed=page + b)
    _check(q, kc, vc, kw, causal=True)
    assert [(r.kernel, r.heads) for r in routes] == ([("rows", 8)] if taken else [("split", 0)])


@pytest.mark.xdist_group("big_caches")
def test_rule_in_a_graph_of_layers(monkeypatch):
    """Four layers of one decode step in a CUDA graph (each layer's query the output before it), every launch a
    programmatic dependent: every replay equals the eager calls."""
    from test_gpu_kvcache import _capture

    b, h, h_k, d, cap = 32, 8, 8, 128, 65536
    if _h100():  # its band leaves 64k to the Gluon kernel: whole rows here, as from 96k
        taken = force_rows(monkeypatch, 8)
    else:
        taken = record_kernels(monkeypatch)
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
    assert [r.kernel for r in taken] == ["rows"] * 4
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

    taken = record_kernels(monkeypatch)
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
    assert [(r.kernel, r.heads) for r in taken] == [("rows", 8)] * 4  # paged caches keep whole rows
    graph, got = _capture(step, before_capture=lambda: [p.copy_(s) for p, s in zip(pools, start)])
    for _ in range(2):
        for p, s in zip(pools, start):
            p.copy_(s)
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
