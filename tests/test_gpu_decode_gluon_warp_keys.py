"""The Gluon warps-along-keys decode kernel on Hopper (FLASHTILE_DECODE_ROUTE=gluon sends it every call it covers
and refuses the others by name; unset, its routes take long caches on full grids, and split on smaller ones): every
call routed there must match the PyTorch reference as the Triton kernel does (FlashAttention's tolerance rule),
append its new keys exactly (in the kernel itself unless they alias the cache), and stay capturable in a CUDA
graph."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton import decode
from flashtile.backends.triton.decode import gluon
from flashtile.backends.triton.decode import route as R
from spies import force_gluon
from test_gpu_kvcache import _capture, _check, _inputs

pytestmark = pytest.mark.gpu


def _record_launches(monkeypatch, module, name: str, arg: int) -> list:
    """Wrap module.name so that every call appends the shape of its positional argument ``arg`` to the list
    returned (and still runs)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args[arg].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def gluon_calls(monkeypatch):
    """The route forced to the kernel, and a list that records every launch of the Gluon kernel."""
    calls = _record_launches(monkeypatch, gluon, "decode", 0)
    with config.override(decode_route="gluon"):
        yield calls


@pytest.fixture
def appends(monkeypatch):
    """A list that records every launch of the separate append kernel."""
    return _record_launches(monkeypatch, decode, "kv_append", 2)


# (b, h, h_k, d, cap, s_new): grids that fill the H200's 132 SMs (b * h_k >= 0.8 x SMs, unsplit by the
# heuristic), GQA 4:1 / 8:1 / 16:1 and MHA, ragged lengths (one row full, others random), with and without
# appended keys, caches off the 64-key tile grid
SHAPES = [(32, 32, 8, 128, 8192, 0), (32, 32, 8, 128, 4133, 1), (16, 64, 8, 128, 3000, 3), (128, 8, 1, 128, 700, 1),
          (8, 32, 16, 64, 2049, 1), (112, 16, 1, 64, 555, 0), (32, 16, 16, 128, 1024, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_matches_reference(gluon_calls, dtype, shape):
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, dtype, seed=cap)
    _check(q, kc, vc, kw, causal=True)
    assert gluon_calls, "the Gluon kernel did not run"


def test_int_length_and_empty_rows(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 300, torch.bfloat16)
    kw["cache_seqlens"] = 77  # one length for every row
    _check(q, kc, vc, kw)
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 300, torch.bfloat16, seed=1)
    kw["cache_seqlens"][1::2] = 0  # rows without keys: out 0, lse +inf
    _check(q, kc, vc, kw)
    assert len(gluon_calls) == 2


@pytest.mark.parametrize("kw", [dict(window_size=(100, 0)), dict(softcap=20.0), dict(num_splits=4)])
def test_outside_coverage_is_refused_by_name(gluon_calls, kw):
    q, kc, vc, inputs = _inputs(32, 1, 1, 32, 8, 128, 2000, torch.bfloat16)
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_ROUTE='gluon' cannot take this call"):
        _check(q, kc, vc, inputs, **kw)
    assert not gluon_calls


def graph_steps_match_the_default():
    """A decode step with an append captured in a CUDA graph on the forced route, replayed three times with
    advancing lengths, each replay against an eager call on the Triton split kernel."""
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 1000, torch.bfloat16)
    lens = kw.pop("cache_seqlens")
    lens.clamp_(max=900)
    k_new, v_new = kw.pop("k"), kw.pop("v")

    def step():
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True)

    graph, out = _capture(step)
    for _ in range(3):
        lens += 1
        graph.replay()
        # the split kernel on the appended cache (a replay does not read the setting)
        with config.override(decode_route="split"):
            ref = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=lens + 1, causal=True)
        torch.cuda.synchronize()
        assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_cuda_graph_step(gluon_calls):
    graph_steps_match_the_default()
    assert gluon_calls


@pytest.mark.parametrize("h, h_k", [(24, 8), (48, 4), (96, 8)])  # groups of 3, 12 and 12: not powers of two
def test_groups_that_are_not_powers_of_two(gluon_calls, h, h_k):
    q, kc, vc, kw = _inputs(256 // h_k, 1, 1, h, h_k, 128, 1500, torch.bfloat16)
    _check(q, kc, vc, kw, causal=True)
    assert gluon_calls


@pytest.mark.parametrize("call", [dict(softmax_scale=0.05), dict(softmax_scale=-0.1), dict(window_size=(-1, 7)),
                                  dict(num_splits=1)])
def test_scale_right_window_and_explicit_single_split(gluon_calls, call):
    b = 8 if "num_splits" in call else 32  # 64 programs: a grid the heuristic would split, asked unsplit
    q, kc, vc, kw = _inputs(b, 1, 1, 32, 8, 128, 2100, torch.bfloat16)
    _check(q, kc, vc, kw, **call)
    assert gluon_calls


def test_full_cache_without_lengths_and_noncontiguous_q(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 0, 32, 8, 128, 640, torch.bfloat16)
    del kw["cache_seqlens"]  # every row holds the whole cache
    packed = torch.randn(32, 1, 3, 32, 128, device=q.device, dtype=q.dtype)
    packed[:, :, 0] = q
    _check(packed[:, :, 0], kc, vc, kw, causal=True)  # q a strided slice of a packed qkv buffer
    assert gluon_calls


def test_nan_past_the_lengths_is_never_read(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 1000, torch.bfloat16)
    lens = kw["cache_seqlens"]
    past = torch.arange(kc.shape[1], device=kc.device)[None, :] >= (lens + 1)[:, None].long()  # after the append
    kn, vn = kc.clone(), vc.clone()
    kn[past], vn[past] = float("nan"), float("nan")
    out, lse = flash_attn_with_kvcache(q, kn, vn, return_softmax_lse=True, causal=True, **kw)
    ref, ref_lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), return_softmax_lse=True, causal=True, **kw)
    assert torch.isfinite(out).all() and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert len(gluon_calls) == 2


def test_new_keys_that_alias_the_cache(gluon_calls):
    # k / v views into the caches' own storage: the separate append kernel reads and writes each slot once
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 700, torch.bfloat16)
    kw["cache_seqlens"].clamp_(max=600)
    kw["k"], kw["v"] = kc[:, 650:651].clone(), vc[:, 650:651].clone()
    _check(q, kc, vc, kw, causal=True)
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc2, vc2, kc2[:, 650:651], vc2[:, 650:651], cache_seqlens=kw["cache_seqlens"],
                                  causal=True)
    ref = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kw["k"], kw["v"], cache_seqlens=kw["cache_seqlens"],
                                  causal=True)
    assert torch.equal(out, ref)
    assert gluon_calls


@pytest.mark.parametrize("d, s_new", [(128, 1), (128, 9), (64, 20)])  # 8 / 16 rows a pass: one, two passes
def test_new_keys_are_appended_by_the_kernel(gluon_calls, appends, d, s_new):
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, d, 777, torch.bfloat16, seed=s_new)
    _check(q, kc, vc, kw, causal=True)  # the updated cache equals the reference's (k close, v exact)
    assert gluon_calls and not appends


def test_aliased_new_keys_take_the_separate_append(gluon_calls, appends):
    q, kc, vc, kw = _inputs(32, 1, 1, 32, 8, 128, 700, torch.bfloat16)
    kw["cache_seqlens"].clamp_(max=600)
    flash_attn_with_kvcache(q, kc, vc, kc[:, 650:651], vc[:, 650:651], cache_seqlens=kw["cache_seqlens"])
    assert gluon_calls and appends


# (cap, new keys, taken): the rule's bound, with and without the kernel's own append
RULE_CASES = [(R.GLUON_MIN_CAPACITY, 0, True), (R.GLUON_MIN_CAPACITY - 64, 0, False),
              (R.GLUON_MIN_CAPACITY, 1, True), (R.GLUON_MIN_CAPACITY - 64, 1, False)]


@pytest.mark.parametrize("cap, s_new, taken", RULE_CASES, ids=[f"c{c}n{n}" for c, n, _ in RULE_CASES])
def test_default_rule_takes_long_caches(gluon_calls, cap, s_new, taken):
    if R.device_props(torch.device("cuda")).sm_count * R.GLUON_PROGRAMS_PER_SM > 256:
        pytest.skip("b = 32 with 8 kv heads is below the rule's grid on this GPU")
    # MHA (8 query heads): at 16k keys the reference's GQA copies would need 8 GB a tensor, too much beside the
    # other xdist workers
    q, kc, vc, kw = _inputs(32, 1, s_new, 8, 8, 128, cap, torch.bfloat16, seed=cap)
    with config.override(decode_route=None):  # the rule
        _check(q, kc, vc, kw, causal=True)
        assert bool(gluon_calls) == taken
        gluon_calls.clear()
        _check(q, kc, vc, kw, causal=True, num_splits=3)  # a split launch keeps the Triton kernel
    assert not gluon_calls


def test_split_route_keeps_the_triton_kernel(gluon_calls):
    q, kc, vc, kw = _inputs(32, 1, 1, 8, 8, 128, R.GLUON_MIN_CAPACITY, torch.bfloat16)
    with config.override(decode_route="split"):
        _check(q, kc, vc, kw, causal=True)
    assert not gluon_calls


# the ring's first tile copied before the row's length is read (EARLY_TILES, on in every unsplit launch)
@pytest.mark.parametrize("s_new", [0, 1, 3])
def test_early_tiles_on_short_rows(gluon_calls, monkeypatch, s_new):
    """Rows shorter than the early tile (0-63 keys before the append), at its edge and past it, with NaN in every
    slot past a row's keys (after the append): the early copies are drained and redone masked, so the outputs equal
    the kernel's without them, bit for bit, and the reference's; the appended cache is the reference's."""
    cap = 256
    q, kc, vc, kw = _inputs(32, 1, s_new, 32, 8, 128, cap, torch.bfloat16, seed=31 + s_new)
    lens = torch.tensor([0, 1, 5, 62, 63, 64, 65, 127, 128, 129, 200, cap], device=q.device, dtype=torch.int32)
    kw["cache_seqlens"] = lens.repeat(3)[:32].clamp(max=cap - s_new)
    past = torch.arange(cap, device=q.device)[None, :] >= (kw["cache_seqlens"] + s_new)[:, None].long()
    kn, vn = kc.clone(), vc.clone()
    kn[past], vn[past] = float("nan"), float("nan")
    results = {}
    real = gluon.run_kernel
    for early in (False, True):
        with monkeypatch.context() as m:
            if not early:  # the same launch without the early copies
                m.setattr(gluon, "run_kernel", lambda kernel, grid, *a, **meta: real(kernel, grid, *a,
                                                                                     **dict(meta, EARLY_TILES=False)))
            k2, v2 = kn.clone(), vn.clone()
            results[early] = flash_attn_with_kvcache(q, k2, v2, return_softmax_lse=True, causal=True, **kw), k2, v2
    (out0, lse0), k0, v0 = results[False]
    (out1, lse1), k1, v1 = results[True]
    assert torch.isfinite(out1).all() and torch.equal(out1, out0) and torch.equal(lse1, lse0)
    assert torch.equal(k1.nan_to_num(), k0.nan_to_num()) and torch.equal(v1.nan_to_num(), v0.nan_to_num())
    _check(q, kc, vc, kw, causal=True)  # with the early copies: against the reference
    assert len(gluon_calls) == 3


# the kernel split N ways, merged by the combine kernel; forced onto every call so that small caches take it
@pytest.mark.parametrize("splits", [2, 4, 8, 16])
@pytest.mark.parametrize("shape", [(8, 32, 8, 128, 4133, 0), (8, 32, 8, 128, 3000, 1), (4, 32, 8, 128, 777, 0),
                                   (16, 16, 8, 64, 2049, 1)], ids=["b8c4133", "b8c3000n1", "b4c777", "b16d64"])
def test_split_launch_matches_reference(monkeypatch, splits, shape):
    taken = force_gluon(monkeypatch, splits)
    launched = _record_launches(monkeypatch, gluon, "decode", 0)
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap + splits)
    short = torch.tensor([0, 1, 63, 64, 65], dtype=torch.int32, device=q.device)[: b - 1]
    kw["cache_seqlens"][1:1 + len(short)] = short  # rows without keys, and splits without keys
    _check(q, kc, vc, kw, causal=True)  # with new keys: appended first, and the updated cache is the reference's
    assert len(launched) == 1 and [r.splits for r in taken] == [splits]


# the split rule, nothing forced: b = 8 / 4 from 32k keys take the kernel split 4 / 8 ways, ahead of the whole-row
# kernels' rule; MHA keeps the reference small
@pytest.mark.xdist_group("big_caches")
@pytest.mark.parametrize("b, splits", [(8, 4), (4, 8)])
def test_split_rule_matches_reference(monkeypatch, b, splits):
    launched = []
    real = gluon.decode
    monkeypatch.setattr(gluon, "decode", lambda *a, **k: (launched.append(a[3].splits), real(*a, **k))[1])
    q, kc, vc, kw = _inputs(b, 1, 1, 8, 8, 128, R.GLUON_SPLIT_MIN_CAPACITY, torch.bfloat16, seed=b)
    _check(q, kc, vc, kw, causal=True)
    props = R.device_props(q.device)
    want = R._fewest_gluon_splits(b * 8, props)
    assert want == splits or props.sm_count != 132, want  # an H100 / H200
    assert launched == [want], "the split rule did not take the call"


def test_split_launch_in_a_cuda_graph(monkeypatch):
    force_gluon(monkeypatch, 4)
    q, kc, vc, kw = _inputs(8, 1, 0, 32, 8, 128, 4096, torch.bfloat16, seed=4)
    lens = kw.pop("cache_seqlens")

    def step():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)

    graph, out = _capture(step)
    for grow in (0, 100, 1000):  # the lengths move on the GPU between replays: the splits follow them
        lens.add_(grow).clamp_(max=4096)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())  # the same kernels, eager
