"""flash_attn_with_kvcache with ``learnable_sink`` and ``attention_chunk`` on CPU: the PyTorch path and the split / MLA
Triton kernels in the interpreter, unsplit (the sink in the kernel) and split (the sink in the merge).

Every case is checked against ``oracle``: the cache update written out slot by slot here, then tests/brute_force.py
(float64, one query row at a time, written from the contract) on each row's keys from its ``cache_leftpad``. Also:
which decode route takes such calls, plain calls keeping their plain kernel build, the refusals, and FlashAttention-3's
signature (``flashtile.hopper``).
"""

import math

import pytest
import torch

import flashtile.hopper as hopper
from brute_force import brute_force
from flashtile import config
from flashtile.backends.triton import decode
from flashtile.backends.triton.decode import mla, route, split
from flashtile.kvcache import flash_attn_with_kvcache

H200 = route.DeviceProps((9, 0), 132, 139.8)


def oracle(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_leftpad=None, block_table=None,
           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, qv=None, learnable_sink=None,
           attention_chunk=0):
    """(out, lse, new_k_cache, new_v_cache) in float64; inputs are not modified."""
    kc, vc = k_cache.clone(), v_cache.clone()
    b, sq, h, d = q.shape
    page = kc.shape[1]
    cap = block_table.shape[1] * page if block_table is not None else kc.shape[1]
    s_new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = cap if cache_seqlens is None else cache_seqlens if isinstance(cache_seqlens, int) else int(cache_seqlens[i])
        lp = 0 if cache_leftpad is None else int(cache_leftpad[i])

        def slot(p, i=i):
            return (int(block_table[i, p // page]), p % page) if block_table is not None else (i, p)

        for t in range(s_new):
            kc[slot(n + t)], vc[slot(n + t)] = k[i, t], v[i, t]
        positions = range(lp, n + s_new)
        keys = torch.stack([kc[slot(p)] for p in positions]) if len(positions) else kc[0, :0]
        vals = torch.stack([vc[slot(p)] for p in positions]) if len(positions) else vc[0, :0]
        out, lse = brute_force(q[i:i + 1], keys[None], vals[None], [sq], [len(positions)], causal=causal,
                               window=window_size, softcap=softcap, scale=softmax_scale, chunk=attention_chunk,
                               sink=learnable_sink, qv=None if qv is None else qv[i:i + 1])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), kc, vc


def make_case(b=3, sq=1, s_new=1, h=4, h_k=2, d=16, dv=None, cap=37, page=None, lens=None, leftpad=None,
              sink=True, qv=False, **kw):
    """Inputs of one fp32 call. ``lens``: cache_seqlens per row (default: one row full, one empty before the append,
    one random); ``leftpad``: cache_leftpad per row or None."""
    dv = dv or d
    args = dict(kw)
    if lens is None:
        lens = [cap - s_new, int(torch.randint(0, cap - s_new + 1, ())), 0][:b]
    args["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32)
    if leftpad is not None:
        args["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32)
    rows = b
    if page is not None:
        per = -(-cap // page)
        rows = b * per + 2
        args["block_table"] = torch.randperm(rows)[: b * per].to(torch.int32).view(b, per)
        cap = page
    k_cache, v_cache = torch.randn(rows, cap, h_k, d), torch.randn(rows, cap, h_k, dv)
    if s_new:
        args["k"], args["v"] = torch.randn(b, s_new, h_k, d), torch.randn(b, s_new, h_k, dv)
    if sink:
        args["learnable_sink"] = torch.randn(h) * 2
    if qv:
        args["qv"] = torch.randn(b, sq, h, dv)
    return torch.randn(b, sq, h, d), k_cache, v_cache, args


CASES = {
    "sink_gqa_append": dict(s_new=2),
    "chunk_causal_sq3": dict(sq=3, s_new=3, causal=True, attention_chunk=5, sink=False),
    "both_paged_causal": dict(sq=2, s_new=2, page=4, causal=True, attention_chunk=7),
    "both_window_softcap": dict(sq=3, s_new=1, window_size=(6, 0), attention_chunk=4, softcap=3.0, h=8, h_k=1),
    # leftpad == cache_seqlens without new keys: rows 1 and 2 see no key (out 0, lse = the sink)
    "no_key_rows": dict(s_new=0, lens=[20, 9, 0], leftpad=[3, 9, 0], causal=True, attention_chunk=6),
    # a chunk counts from the row's first valid key, the left padding
    "chunk_leftpad": dict(s_new=1, lens=[30, 17, 5], leftpad=[2, 17, 1], attention_chunk=8, sq=2, causal=True),
    "mla_qv": dict(qv=True, dv=32, h=4, h_k=1, sq=2, s_new=2, causal=True, attention_chunk=9),
}
TINY = dict(interpret=True, decode_tiles=(16, 16, 4, 1))  # 16-key tiles: a row's keys cross several blocks


def _check(q, k_cache, v_cache, args, num_splits):
    ref_out, ref_lse, ref_kc, ref_vc = oracle(q, k_cache, v_cache, **args)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    assert out.shape == q.shape[:3] + (v_cache.shape[-1],) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4
    assert (lse[~fin] == math.inf).all()
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    return out, lse


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("where", ["cpu", "unsplit", "split"])
def test_matches_the_oracle(name, where, monkeypatch):
    q, kc, vc, args = make_case(**CASES[name])
    launched = []
    for mod in (split, mla):
        real = mod.decode
        monkeypatch.setattr(mod, "decode", lambda *a, real=real, **k: launched.append(a[-1].splits) or real(*a, **k))
    with config.override(**(TINY if where != "cpu" else dict(interpret=False))):
        out, lse = _check(q, kc, vc, args, num_splits={"cpu": 0, "unsplit": 1, "split": 3}[where])
    assert launched == ([] if where == "cpu" else [1 if where == "unsplit" else 3])
    if name == "no_key_rows":
        sink = args["learnable_sink"]
        assert (out[1:] == 0).all()
        torch.testing.assert_close(lse[1:], sink.view(1, -1, 1).expand(2, -1, q.shape[1]), atol=1e-6, rtol=1e-6)


def test_sink_and_chunk_change_the_answer():
    # the oracle's own sanity: each argument moves the result (a kernel that ignored it would fail the cases above)
    q, kc, vc, args = make_case(sq=2, s_new=2, causal=True, attention_chunk=5)
    base, base_lse, _, _ = oracle(q, kc, vc, **{k: v for k, v in args.items()
                                                 if k not in ("learnable_sink", "attention_chunk")})
    for drop in ("learnable_sink", "attention_chunk"):
        out, lse, _, _ = oracle(q, kc, vc, **{k: v for k, v in args.items() if k != drop})
        assert (out - base).abs().max() > 1e-3 and (lse - base_lse).abs().max() > 1e-3


def test_plain_calls_keep_the_plain_build(decode_interp):
    # the features' constexprs appear only when on: a plain call launches the build it always did
    q, kc, vc, args = make_case(sink=False, s_new=0)
    for extra, split_count, want in (({}, 1, {}), ({"attention_chunk": 4}, 1, {"HAS_CHUNK": True}),
                                     ({"learnable_sink": torch.randn(4)}, 1, {"HAS_SINK": True}),
                                     ({"learnable_sink": torch.randn(4)}, 2, {})):  # split: the merge's
        flash_attn_with_kvcache(q, kc, vc, num_splits=split_count, **args, **extra)
        got = {key: decode_interp[-1][key] for key in ("HAS_SINK", "HAS_CHUNK") if key in decode_interp[-1]}
        assert got == want, extra


# ---------------------------------------------------------------------------------------------------------------
# routes


def _shape(b, cap, **kw):
    return route.DecodeShape(b, 1, 32, 8, 128, cap, **kw)


@pytest.mark.parametrize("b,cap,plain_route", [(32, 16384, "gluon"), (4, 65536, "gluon"), (64, 16384, "rows")])
def test_routes_of_sink_and_chunk_calls(b, cap, plain_route):
    """The merge adds a sink: rows and split Gluon launches keep sink calls, the unsplit Gluon kernel does not; no
    route but split and MLA applies a chunk."""
    plain = route.select_route(_shape(b, cap), torch.bfloat16, False, 0, H200)
    assert plain.kernel == plain_route
    with_sink = route.select_route(_shape(b, cap, sink=True), torch.bfloat16, False, 0, H200)
    keeps = plain_route == "rows" or plain.splits > 1
    assert with_sink.kernel == (plain_route if keeps else "split")
    assert route.select_route(_shape(b, cap, chunk=True), torch.bfloat16, False, 0, H200).kernel == "split"


def test_mla_route_takes_sink_and_chunk():
    s = route.DecodeShape(4, 1, 16, 1, 64, 4096, head_dim_v=512, qv=True, sink=True, chunk=True)
    assert route.select_route(s, torch.bfloat16, False, 0, H200).kernel == "mla"


def test_forced_routes_that_cannot_take_the_call_say_so():
    with pytest.raises(ValueError, match="'gluon' cannot take this call; routes for this call: split, rows"):
        route.select_route(_shape(64, 16384, sink=True), torch.bfloat16, False, 0, H200, forced="gluon")
    with pytest.raises(ValueError, match=r"'rows' cannot take this call; routes for this call: split \("):
        route.select_route(_shape(64, 16384, chunk=True), torch.bfloat16, False, 0, H200, forced="rows")
    forced = route.select_route(_shape(4, 65536, sink=True), torch.bfloat16, False, 0, H200, forced="gluon")
    assert forced.kernel == "gluon" and forced.splits > 1


def test_the_call_tells_the_route(monkeypatch):
    seen = []
    real = decode.select_route
    monkeypatch.setattr(decode, "select_route", lambda s, *a, **k: seen.append(s) or real(s, *a, **k))
    q, kc, vc, args = make_case(s_new=0, attention_chunk=3)
    with config.override(**TINY):
        flash_attn_with_kvcache(q, kc, vc, **args)
        args.pop("learnable_sink")
        args.pop("attention_chunk")
        flash_attn_with_kvcache(q, kc, vc, **args, attention_chunk=0)
    assert [(s.sink, s.chunk) for s in seen] == [(True, True), (False, False)]


# ---------------------------------------------------------------------------------------------------------------
# refusals and FlashAttention-3's signature


def test_refusals_name_the_argument():
    q, kc, vc, args = make_case(s_new=0, sink=False)
    for bad, match in ((dict(learnable_sink=torch.randn(3)), r"learnable_sink must have shape \(h,\)"),
                       (dict(learnable_sink=torch.randn(4).half()), "learnable_sink must be float32"),
                       (dict(attention_chunk=-1), "attention_chunk must be an int >= 0"),
                       (dict(attention_chunk=2.0), "attention_chunk must be an int >= 0")):
        with pytest.raises((TypeError, ValueError), match=match):
            flash_attn_with_kvcache(q, kc, vc, **args, **bad)
    f8 = torch.float8_e4m3fn
    for bad, match in ((dict(learnable_sink=torch.randn(4)), "learnable_sink is not supported with fp8"),
                       (dict(attention_chunk=4), "attention_chunk is not supported with fp8")):
        with pytest.raises(TypeError, match=match):
            flash_attn_with_kvcache(q.to(f8), kc.to(f8), vc.to(f8), **args, **bad)


def test_hopper_signature_passes_sink_and_chunk():
    q, kc, vc, args = make_case(s_new=1, sq=2, causal=True, attention_chunk=6)
    ref_out, ref_lse, _, _ = oracle(q, kc, vc, **args)
    out, lse = hopper.flash_attn_with_kvcache(q, kc, vc, args["k"], args["v"], cache_seqlens=args["cache_seqlens"],
                                              causal=True, attention_chunk=6, return_softmax_lse=True,
                                              learnable_sink=args["learnable_sink"])
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------------------------
# sm_90 builds through ptxas (tests/aot_sm90.py): the GPU-only compile errors the interpreter misses


def test_sink_and_chunk_builds_compile_for_sm90(tmp_path):
    from test_mla_compile import TYPES
    from test_sm90_compile import DECODE_INTS, _compile

    d = 128
    cx = dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=128, BLOCK_D=d, NUM_SPLITS=1, PAGED=False, PAGE_ALIGNED=False,
              PAGE_SHIFT=-1, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=True, HAS_LEFT=True, HAS_RIGHT=True,
              HAS_SOFTCAP=False, HAS_ALIBI=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False, ROTARY_PER_TOKEN=True,
              DOT_PRECISION="tf32", IS_FP8=False, USE_PDL=True, HAS_SINK=True, HAS_CHUNK=True)
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", cx, DECODE_INTS, 4, 3)
    _compile(tmp_path, "_decode_kernel", "flashtile.kernels.decode", dict(cx, NUM_SPLITS=4, HAS_SINK=False),
             DECODE_INTS, 4, 3)
    _compile(tmp_path, "_combine_kernel", "flashtile.kernels.decode", dict(HEAD_DIM=d, BLOCK_S=4, BLOCK_D=d,
             USE_PDL=True, HAS_SINK=True), {"O_PART": "*fp32", "LSE_PART": "*fp32"}, 1, 1)
    cx = dict(cx, HEAD_DIM=64, HEAD_DIM_V=512, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=512, HAS_QV=True)
    del cx["IS_FP8"]
    _compile(tmp_path, "_mla_decode_kernel", "flashtile.kernels.decode_mla", cx, TYPES, 8, 2)
