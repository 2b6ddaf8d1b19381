"""flash_attn_with_kvcache / flash_attn_combine on CPU: the PyTorch path and the Triton kernels in the interpreter.

Every case is checked against ``dense_oracle``, written here independently of flashtile: a float64
loop over batch rows that keeps the cache as a list of positions, rotates with complex numbers and
masks with explicit index comparisons. The updated caches must match too (k close: it is rotated
in fp32 by the kernels; v exact: it is only copied).
"""

import math

import pytest
import torch

import flashtile
from flashtile import config
from flashtile.backends.triton.decode import append, common, route, split
from flashtile.kvcache import flash_attn_combine, flash_attn_with_kvcache

# ---------------------------------------------------------------------------------------------
# the independent oracle


def _rotate(x, c, s, interleaved):
    """x (..., d) float64 rotated by (c, s) (rd/2,) on its first rd channels, as complex products."""
    rd = 2 * c.shape[-1]
    out = x.clone()
    if interleaved:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
    else:
        a, b = x[..., : rd // 2], x[..., rd // 2: rd]
    z = torch.complex(a, b) * torch.complex(c, s)
    if interleaved:
        out[..., 0:rd:2], out[..., 1:rd:2] = z.real, z.imag
    else:
        out[..., : rd // 2], out[..., rd // 2: rd] = z.real, z.imag
    return out


def dense_oracle(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                 window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, **_):
    """Returns (out, lse, new_k_cache, new_v_cache); inputs are not modified."""
    dtype = q.dtype
    kc, vc = k_cache.clone(), v_cache.clone()
    b, sq, h, d = q.shape
    h_k = kc.shape[2]
    g = h // h_k
    page = kc.shape[1]
    cap = block_table.shape[1] * page if block_table is not None else kc.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    left, right = window_size
    left = -1 if left >= cap else left
    right = -1 if right >= cap else right
    if causal:
        right = 0
    local = causal or left >= 0 or right >= 0
    s_new = 0 if k is None else k.shape[1]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), math.inf, dtype=torch.float64)
    for i in range(b):
        if cache_seqlens is None:
            n = cap
        elif isinstance(cache_seqlens, int):
            n = cache_seqlens
        else:
            n = int(cache_seqlens[i])
        lp = 0 if cache_leftpad is None else int(cache_leftpad[i])
        row = i if cache_batch_idx is None else int(cache_batch_idx[i])

        def slot(p, i=i, row=row):
            if block_table is not None:
                return int(block_table[i, p // page]), p % page
            return row, p

        for t in range(s_new):
            kt = k[i, t].double()
            if rotary_cos is not None:
                kt = _rotate(kt, rotary_cos[n + t].double(), rotary_sin[n + t].double(), rotary_interleaved)
            kc[slot(n + t)] = kt.to(dtype)
            vc[slot(n + t)] = v[i, t]
        keys = torch.stack([kc[slot(p)] for p in range(lp, n + s_new)]).double() if n + s_new > lp else None
        vals = torch.stack([vc[slot(p)] for p in range(lp, n + s_new)]).double() if n + s_new > lp else None
        sk = n + s_new - lp
        for t in range(sq):
            qt = q[i, t].double()
            if rotary_cos is not None:
                pos = n + t if local else n
                qt = _rotate(qt, rotary_cos[pos].double(), rotary_sin[pos].double(), rotary_interleaved)
                qt = qt.to(dtype).double()  # the kernels round the rotated q to the input dtype
            diag = t + sk - sq
            for hh in range(h):
                if sk <= 0:
                    continue
                sc = (keys[:, hh // g] @ qt[hh]) * scale
                if softcap > 0:
                    sc = softcap * torch.tanh(sc / softcap)
                j = torch.arange(sk)
                if alibi_slopes is not None:
                    slope = alibi_slopes[hh] if alibi_slopes.dim() == 1 else alibi_slopes[i, hh]
                    sc = sc - float(slope) * (diag - j).abs().double()
                ok = torch.ones(sk, dtype=torch.bool)
                if left >= 0:
                    ok &= j >= diag - left
                if right >= 0:
                    ok &= j <= diag + right
                if not ok.any():
                    continue
                sc = sc.masked_fill(~ok, -math.inf)
                m = torch.logsumexp(sc, 0)
                lse[i, hh, t] = m
                out[i, t, hh] = torch.exp(sc - m) @ vals[:, hh // g]
    return out, lse, kc, vc


# ---------------------------------------------------------------------------------------------
# building cases


def make_case(dtype=torch.float32, b=3, sq=1, s_new=1, h=6, h_k=2, d=16, cap=37, seqlens="rows", page=None,
              batch_idx=False, leftpad=False, rotary=None, rotary_dim=None, alibi=None, extra_rows=0, **kw):
    """Inputs of one call. ``seqlens``: "rows" (int32 per row), an int, or None (full cache).

    ``extra_rows``: the cache has that many rows more than the batch (without cache_batch_idx,
    FlashAttention uses rows 0..b-1 and leaves the rest alone)."""
    q = torch.randn(b, sq, h, d, dtype=dtype)
    args = dict(kw)
    lens = None
    if seqlens == "rows":
        lens = torch.randint(0, cap - s_new + 1, (b,), dtype=torch.int32)
        lens[0] = cap - s_new  # one row filled to the brim
        if b > 2:
            lens[2] = 0  # one row empty before the append
        args["cache_seqlens"] = lens
    elif isinstance(seqlens, int):
        args["cache_seqlens"] = seqlens
    if page is not None:
        nblk = -(-cap // page)
        pool = b * nblk + 3
        perm = torch.randperm(pool)[: b * nblk].to(torch.int32)
        args["block_table"] = perm.view(b, nblk)
        cap = nblk * page
        k_cache = torch.randn(pool, page, h_k, d, dtype=dtype)
    else:
        rows = b + 2 if batch_idx else b + extra_rows
        k_cache = torch.randn(rows, cap, h_k, d, dtype=dtype)
        if batch_idx:
            args["cache_batch_idx"] = torch.randperm(rows)[:b].to(torch.int32)
    v_cache = torch.randn_like(k_cache)
    if s_new:
        args["k"] = torch.randn(b, s_new, h_k, d, dtype=dtype)
        args["v"] = torch.randn(b, s_new, h_k, d, dtype=dtype)
    if leftpad:
        base = lens if lens is not None else torch.full((b,), args.get("cache_seqlens", cap), dtype=torch.int32)
        args["cache_leftpad"] = (torch.rand(b) * (base.float() + 1)).floor().to(torch.int32).clamp(max=base)
    if rotary is not None:
        rd = rotary_dim or d
        angle = torch.rand(cap, rd // 2) * 6.3
        args["rotary_cos"], args["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
        args["rotary_interleaved"] = rotary == "interleaved"
    if alibi == "h":
        args["alibi_slopes"] = torch.rand(h) * 0.3
    elif alibi == "bh":
        args["alibi_slopes"] = torch.rand(b, h) * 0.3
    return q, k_cache, v_cache, args


CASES = {
    "read_only_int_len": dict(s_new=0, seqlens=20),
    "read_only_full_cache": dict(s_new=0, seqlens=None),
    "append_int_len": dict(s_new=2, seqlens=11),
    "append_rows": dict(s_new=3),
    "batch_idx": dict(s_new=2, batch_idx=True),
    "leftpad": dict(s_new=2, leftpad=True, causal=True, sq=2),
    "rotary_interleaved_partial": dict(s_new=2, sq=2, rotary="interleaved", rotary_dim=8, causal=True),
    "rotary_half_partial_noncausal": dict(s_new=3, sq=3, rotary="half", rotary_dim=12),
    "rotary_half_full_local": dict(s_new=2, sq=2, rotary="half", window_size=(5, 1)),
    "paged_1": dict(page=1, s_new=2, rotary="interleaved", rotary_dim=8),
    "paged_3": dict(page=3, s_new=3, sq=3, causal=True),
    "paged_16": dict(page=16, s_new=2, rotary="half", rotary_dim=8, causal=True, sq=2),
    "paged_16_leftpad": dict(page=16, s_new=1, leftpad=True),
    "causal_prefill": dict(s_new=5, sq=5, causal=True),
    "window": dict(s_new=1, sq=3, window_size=(6, 0)),
    "softcap": dict(s_new=1, softcap=2.0, sq=2, causal=True),
    "alibi_h": dict(s_new=1, sq=2, alibi="h", causal=True),
    "alibi_bh_window": dict(s_new=2, sq=2, alibi="bh", window_size=(4, 4)),
    "gqa_8_to_1": dict(h=8, h_k=1, s_new=1),
    "mha_odd_d": dict(h=2, h_k=2, d=24, s_new=1, scale=0.3),
    "empty_rows": dict(s_new=0, seqlens=0, causal=True),
    "larger_cache_than_batch": dict(s_new=2, sq=2, extra_rows=3, rotary="half", rotary_dim=8, causal=True),
    "larger_cache_read_only": dict(s_new=0, seqlens=None, extra_rows=2),
}


def _run_and_check(q, k_cache, v_cache, args, num_splits=0, atol=None):
    args = dict(args)
    if "scale" in args:
        args["softmax_scale"] = args.pop("scale")
    ref_out, ref_lse, ref_kc, ref_vc = dense_oracle(q, k_cache, v_cache, **args)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    fp16 = q.dtype == torch.float16
    atol = atol or (5e-3 if fp16 else 2e-5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() <= atol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows that see no key must have lse +inf"
    assert (lse[~fin] == math.inf).all()
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= (5e-3 if fp16 else 1e-4)
    assert torch.equal(vc, ref_vc), "v cache must be an exact copy of the new values"
    assert (kc.double() - ref_kc.double()).abs().max().item() <= (1e-3 if fp16 else 1e-6)
    return out, lse, kc


TINY = dict(interpret=True, decode_tiles=(16, 16, 4, 1))  # 16-key tiles; several query-row blocks past 16 rows


@pytest.fixture(params=["cpu", "interp"])
def path(request, monkeypatch):
    """Run through the PyTorch path or through the Triton kernels in the interpreter (spied)."""
    used = []
    real = split.decode
    monkeypatch.setattr(split, "decode", lambda *a, **k: used.append(a[3].splits) or real(*a, **k))
    with config.override(**(TINY if request.param == "interp" else dict(interpret=False))):
        yield request.param
    assert (request.param != "cpu") == bool(used), "the expected backend did not run"


@pytest.mark.parametrize("name", list(CASES))
def test_semantics_fp32(path, name):
    q, kc, vc, args = make_case(**CASES[name])
    _run_and_check(q, kc, vc, args)


@pytest.mark.parametrize("name", ["append_rows", "rotary_interleaved_partial", "paged_3", "alibi_bh_window",
                                  "leftpad", "causal_prefill"])
def test_semantics_fp16_kernels(name):
    q, kc, vc, args = make_case(dtype=torch.float16, **CASES[name])
    with config.override(interpret=True, decode_tiles=(64, 16, 4, 1)):
        _run_and_check(q, kc, vc, args)


@pytest.mark.parametrize("name", ["append_rows", "paged_3", "window", "rotary_half_full_local", "leftpad"])
def test_num_splits_agree(name):
    """Splitting the keys 1 or 3 ways (or by the heuristic) gives the same result (up to fp32 rounding)."""
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    with config.override(interpret=True, decode_tiles=(64, 16, 4, 1)):
        results = [_run_and_check(q, kc, vc, args, num_splits=n) for n in (1, 3, 0)]
    for out, lse, kcache in results[1:]:
        assert (out - results[0][0]).abs().max().item() <= 1e-5
        fin = torch.isfinite(lse)
        assert torch.equal(fin, torch.isfinite(results[0][1]))
        assert (lse[fin] - results[0][1][fin]).abs().max().item() <= 1e-5
        assert torch.equal(kcache, results[0][2])


def test_return_value_forms():
    q, kc, vc, args = make_case(s_new=1)
    out = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **args)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    res = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **args, return_softmax_lse=True)
    assert isinstance(res, tuple) and len(res) == 2


def test_decode_loop_matches_one_prefill(path):
    """Appending tokens one call at a time builds the same cache as appending them all at once."""
    b, h, h_k, d, cap, steps = 2, 4, 2, 16, 24, 5
    angle = torch.rand(cap, d // 2) * 6
    cos, sin = angle.cos(), angle.sin()
    k = torch.randn(b, steps, h_k, d)
    v = torch.randn(b, steps, h_k, d)
    q = torch.randn(b, steps, h, d)
    start = torch.tensor([3, 7], dtype=torch.int32)
    kc0, vc0 = torch.randn(b, cap, h_k, d), torch.randn(b, cap, h_k, d)
    kc1, vc1 = kc0.clone(), vc0.clone()
    full = flash_attn_with_kvcache(q, kc1, vc1, k, v, cos, sin, cache_seqlens=start, causal=True)
    kc2, vc2 = kc0.clone(), vc0.clone()
    for t in range(steps):
        o = flash_attn_with_kvcache(q[:, t:t + 1], kc2, vc2, k[:, t:t + 1], v[:, t:t + 1], cos, sin,
                                    cache_seqlens=start + t, causal=True)
        assert (o[:, 0] - full[:, t]).abs().max().item() < 1e-5
    assert torch.allclose(kc1, kc2, atol=1e-6) and torch.equal(vc1, vc2)


# ---------------------------------------------------------------------------------------------
# flash_attn_combine


@pytest.mark.parametrize("kernels", [False, True])
def test_combine(kernels):
    with config.override(interpret=kernels):
        _check_combine()


def _check_combine():
    ns, b, sq, h, d = 3, 2, 2, 3, 20
    o_part = torch.randn(ns, b, sq, h, d)
    # FlashAttention-3's layout: lse_partial (ns, b, sq, h), made as FA3 makes it (a transposed view)
    lse_part = torch.randn(ns, b, h, sq).transpose(2, 3)
    lse_part[1, 0, 0, 1] = -math.inf  # an empty split
    lse_part[:, 1, 1, 2] = -math.inf  # a row no split saw
    out, lse = flash_attn_combine(o_part, lse_part, out_dtype=torch.float16)
    w = torch.softmax(lse_part.double(), 0).nan_to_num(0.0)  # (ns, b, sq, h)
    ref = (o_part.double() * w.unsqueeze(-1)).sum(0)
    assert out.dtype == torch.float16 and out.shape == (b, sq, h, d)
    assert (out.double() - ref).abs().max().item() < 2e-3
    ref_lse = torch.logsumexp(lse_part.double(), 0)  # (b, sq, h)
    assert lse.shape == (b, sq, h)
    assert lse[1, 1, 2] == math.inf and (out[1, 1, 2] == 0).all()
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-5
    buf = torch.empty(b, sq, h, d)
    res, _ = flash_attn_combine(o_part, lse_part, out=buf)
    assert res.data_ptr() == buf.data_ptr()


def test_combine_warps_rule():
    # one warp while a program's partials are at most 1024 values, otherwise 4 (d >= 128) or 2
    assert [common.combine_warps(ns, 128) for ns in (1, 2, 4, 8, 16, 132)] == [1, 1, 1, 1, 4, 4]
    assert [common.combine_warps(ns, 64) for ns in (16, 32)] == [1, 2]
    assert common.combine_warps(4, 256) == 1 and common.combine_warps(8, 256) == 4


def test_combine_errors():
    with pytest.raises(ValueError, match="lse_partial"):
        flash_attn_combine(torch.randn(2, 1, 1, 2, 8), torch.randn(2, 1, 1, 1))
    with pytest.raises(TypeError, match="out_partial must be float32"):
        flash_attn_combine(torch.randn(2, 1, 1, 2, 8).half(), torch.randn(2, 1, 1, 2))
    with pytest.raises(TypeError, match="lse_partial must be float32"):
        flash_attn_combine(torch.randn(2, 1, 1, 2, 8), torch.randn(2, 1, 1, 2).half())
    with pytest.raises(ValueError, match="out must be on out_partial's device"):
        flash_attn_combine(torch.randn(2, 1, 1, 2, 8), torch.randn(2, 1, 1, 2),
                           out=torch.empty(1, 1, 2, 8, device="meta"))


def test_kernel_grids_are_flat(monkeypatch):
    """Batch (x kv heads) goes on grid axis 0 in every launch: CUDA caps axes 1 and 2 at 65535."""
    grids = {}
    for module, name in ((split, "_decode_kernel"), (append, "_kv_append_kernel"), (common, "_combine_kernel")):
        real = getattr(module, name)

        class Spy:
            def __getitem__(self, grid, real=real, name=name):
                grids[name] = grid
                return real[grid]

        monkeypatch.setattr(module, name, Spy())
    # b=3, h_k=2, sq * group = 3 * 6 = 18 rows -> 2 row blocks of 16, 3 splits, 2 new tokens
    q, kc, vc, args = make_case(b=3, sq=3, s_new=2, h=12, h_k=2, cap=70, causal=True)
    with config.override(**TINY):
        _run_and_check(q, kc, vc, args, num_splits=3)
    assert grids == {"_decode_kernel": (3 * 2 * 3 * 2,), "_combine_kernel": (3 * 3 * 12,),
                     "_kv_append_kernel": (2 * 3,)}


# ---------------------------------------------------------------------------------------------
# errors


def _base():
    q = torch.randn(2, 1, 4, 16)
    kc = torch.randn(2, 10, 2, 16)
    return q, kc, kc.clone()


ERRORS = [
    ("v_cache", lambda q, kc, vc: dict(v_cache=torch.randn(2, 11, 2, 16))),
    ("k_cache batch", lambda q, kc, vc: dict(k_cache=torch.randn(1, 10, 2, 16), v_cache=torch.randn(1, 10, 2, 16))),
    ("head dim", lambda q, kc, vc: dict(k_cache=torch.randn(2, 10, 2, 8), v_cache=torch.randn(2, 10, 2, 8))),
    ("multiple", lambda q, kc, vc: dict(k_cache=torch.randn(2, 10, 3, 16), v_cache=torch.randn(2, 10, 3, 16))),
    ("k and v", lambda q, kc, vc: dict(k=torch.randn(2, 1, 2, 16), cache_seqlens=1)),
    ("shape", lambda q, kc, vc: dict(k=torch.randn(2, 1, 4, 16), v=torch.randn(2, 1, 4, 16), cache_seqlens=1)),
    ("cache_seqlens must be given", lambda q, kc, vc: dict(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16))),
    ("cache_seqlens must be int32", lambda q, kc, vc: dict(cache_seqlens=torch.tensor([1, 2]))),
    ("cache_seqlens must have shape", lambda q, kc, vc: dict(cache_seqlens=torch.tensor([1], dtype=torch.int32))),
    ("capacity", lambda q, kc, vc: dict(cache_seqlens=torch.tensor([1, 10], dtype=torch.int32),
                                        k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16))),
    ("capacity", lambda q, kc, vc: dict(cache_seqlens=10, k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16))),
    ("cache_batch_idx must be int32", lambda q, kc, vc: dict(cache_batch_idx=torch.tensor([0, 1]))),
    ("cache_batch_idx values", lambda q, kc, vc: dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32))),
    ("cache_leftpad must be int32", lambda q, kc, vc: dict(cache_leftpad=torch.tensor([0, 1]))),
    ("block_table and cache_batch_idx", lambda q, kc, vc: dict(
        block_table=torch.zeros(2, 1, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32))),
    ("block_table must be int32", lambda q, kc, vc: dict(block_table=torch.zeros(2, 1, dtype=torch.int64))),
    ("block_table must have shape", lambda q, kc, vc: dict(block_table=torch.zeros(3, 1, dtype=torch.int32))),
    ("block_table entries", lambda q, kc, vc: dict(block_table=torch.full((2, 1), 7, dtype=torch.int32))),
    ("rotary_dim", lambda q, kc, vc: dict(rotary_cos=torch.randn(10, 9), rotary_sin=torch.randn(10, 9),
                                          k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=1)),
    ("together", lambda q, kc, vc: dict(rotary_cos=torch.randn(10, 4), k=torch.randn(2, 1, 2, 16),
                                        v=torch.randn(2, 1, 2, 16), cache_seqlens=1)),
    ("need the new k", lambda q, kc, vc: dict(rotary_cos=torch.randn(10, 4), rotary_sin=torch.randn(10, 4))),
    ("positions", lambda q, kc, vc: dict(rotary_cos=torch.randn(5, 4), rotary_sin=torch.randn(5, 4),
                                         k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=1)),
    ("dtype", lambda q, kc, vc: dict(q=q.half())),
    ("alibi_slopes", lambda q, kc, vc: dict(alibi_slopes=torch.rand(3))),
    ("num_splits", lambda q, kc, vc: dict(num_splits=-1)),
    ("softcap", lambda q, kc, vc: dict(softcap=-1.0)),
    ("4 dims", lambda q, kc, vc: dict(q=q[0])),
    ("softmax_scale", lambda q, kc, vc: dict(softmax_scale=float("nan"))),
    ("softmax_scale", lambda q, kc, vc: dict(softmax_scale="0.1")),
]


@pytest.mark.parametrize("match,make", ERRORS, ids=[f"{i}-{e[0]}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(match, make):
    q, kc, vc = _base()
    kw = dict(q=q, k_cache=kc, v_cache=vc)
    kw.update(make(q, kc, vc))
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_with_kvcache(**kw)


@pytest.mark.parametrize("leftpad", [False, True])
def test_block_table_padding_past_the_pages_in_use(path, leftpad):
    # entries past a row's pages in use (and before its left padding's page) are never read: tables
    # padded with -1 work on CPU as on the GPU, while an invalid page in use is refused on CPU
    torch.manual_seed(5)
    q, kc, vc, args = make_case(page=4, s_new=2, cap=30, leftpad=leftpad, causal=True)
    table, lens = args["block_table"], args["cache_seqlens"]
    start = args["cache_leftpad"] if leftpad else torch.zeros_like(lens)
    for i in range(q.shape[0]):
        first, end = int(start[i]) // 4, -(-(int(lens[i]) + 2) // 4)
        table[i, :first] = -1
        table[i, end:] = -1
    _run_and_check(q, kc, vc, args, num_splits=2)
    busy = int(lens[0]) // 4  # row 0 is full: this page is in use
    table[0, busy] = kc.shape[0]
    with pytest.raises(ValueError, match="block_table entries of the pages in use"):
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **args)


# ---------------------------------------------------------------------------------------------
# torch.compile, the split heuristic, the benchmark's plumbing, the example


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, kc, vc, args = make_case(s_new=1, page=4, rotary="half", causal=True)

    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lens,
                                           block_table=table, causal=True, rotary_interleaved=False,
                                           return_softmax_lse=True)
        return out * 2, lse

    inputs = (args["k"], args["v"], args["rotary_cos"], args["rotary_sin"], args["cache_seqlens"],
              args["block_table"])
    kc1, vc1 = kc.clone(), vc.clone()
    ref_out, ref_lse = step(q, kc1, vc1, *inputs)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = torch.compile(step, fullgraph=True, backend="eager")(q, kc2, vc2, *inputs)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), "the compiled call must update the caches in place"
    torch.library.opcheck(torch.ops.flashtile.kvcache_fwd,
                          (q, kc.clone(), vc.clone(), None, None, None, None, args["cache_seqlens"], -1, None,
                           None, args["block_table"], 0.25, True, -1, 0, 0.0, True, None, 1, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_inductor():
    torch._dynamo.reset()
    q, kc, vc, args = make_case(s_new=1, batch_idx=True)
    fn = lambda q, kc, vc, k, v, lens, idx: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                                     cache_batch_idx=idx) + 1
    kc1, vc1 = kc.clone(), vc.clone()
    ref = fn(q, kc1, vc1, args["k"], args["v"], args["cache_seqlens"], args["cache_batch_idx"])
    kc2, vc2 = kc.clone(), vc.clone()
    out = torch.compile(fn, fullgraph=True)(q, kc2, vc2, args["k"], args["v"], args["cache_seqlens"],
                                           args["cache_batch_idx"])
    assert torch.allclose(out, ref, atol=1e-6) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


def test_num_splits_heuristic():
    h = route.num_splits_heuristic
    assert h(256, 2048, 132) == 1  # a grid that fills the GPU is not split
    # b=1, h_k=8 on 132 SMs: 16 splits give every program an equal share in one wave (15 left the
    # slowest program 5 of 64 blocks, 16 gives 4)
    assert h(8, 64, 132) == 16 and h(8, 1024, 132) == 16
    assert h(8, 3, 132) == 1  # too few key blocks to split
    assert h(64, 2048, 132) == 2
    assert h(16, 64, 132) == 8  # b=2: 128 programs, one wave
    # start-up per program (START_BLOCKS) makes a second wave cost more: b=3 keeps one wave of 5 splits
    # (without it, 11 splits in two waves would model 8% faster)
    assert h(24, 64, 132) == 5
    assert h(8, 2048, 132) == 16  # 33 splits (two waves) model 1% faster: not worth the merge
    # the choice is within the slack of the model's minimum, and no fewer splits are
    def cost(s, programs, blocks):
        return -(-programs * s // 132) * (-(-blocks // s) + route.START_BLOCKS)

    for programs, blocks in [(8, 64), (8, 2048), (24, 64), (40, 300), (64, 2048)]:
        best = h(programs, blocks, 132)
        least = min(cost(s, programs, blocks) for s in range(1, min(128, blocks // 2) + 1))
        assert cost(best, programs, blocks) <= least * (1 + route.SPLIT_SLACK)
        assert all(cost(s, programs, blocks) > least * (1 + route.SPLIT_SLACK) for s in range(1, best))


def test_bench_decode_cpu_smoke(tmp_path):
    from flashtile.bench import main

    out = tmp_path / "decode.json"
    png = tmp_path / "decode.png"
    rc = main(["decode", "--device", "cpu", "--quick", "--warmup", "1", "--rep", "3", "--out", str(out),
               "--plot", str(png)])
    assert rc == 0
    try:
        import matplotlib  # noqa: F401  (an optional extra: without it the run still succeeds, unplotted)
    except ImportError:
        assert not png.exists()
    else:
        assert png.stat().st_size > 10_000  # a real image, one panel per batch size
    import json

    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "decode" and data["rows"]
    # the device properties the decode routes were chosen on (a CPU run: the interpreter's stand-in)
    assert data["meta"]["device_props"]["capability"] == [0, 0]
    for r in data["rows"]:
        assert r["us"]["flashtile"] is not None, r["errors"]
        assert not r["mismatch"]


def test_bench_decode_new_tokens_append_and_match_the_peers(tmp_path, monkeypatch):
    # --new-tokens N: every flashtile call appends N keys (the cache's own last N, written back in place), so it
    # still attends over the peers' keys: the outputs must match SDPA's, paged too; N past a row is refused
    import json

    from flashtile.bench import decode as bench_decode
    from flashtile.bench import main

    seen = []
    real = bench_decode._flashtile_calls

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(bench_decode, "_flashtile_calls", spy)
    out = tmp_path / "decode.json"
    rc = main(["decode", "--device", "cpu", "--quick", "--new-tokens", "3", "--warmup", "1", "--rep", "3",
               "--out", str(out)])
    assert rc == 0 and seen and set(seen) == {3}
    data = json.loads(out.read_text())
    assert data["meta"]["new_tokens"] == 3
    for r in data["rows"]:
        assert r["us"]["flashtile"] is not None and r["us"]["flashtile-p16"] is not None, r["errors"]
        assert r["max_rel_err"] is not None and not r["mismatch"]
    assert main(["decode", "--device", "cpu", "--quick", "--new-tokens", "65", "--out", str(out)]) == 2


def test_bench_decode_layers_per_call(tmp_path, monkeypatch):
    # --layers N: N calls on N distinct caches per measurement, time reported per call; a row whose
    # N caches would pass the byte budget gets fewer layers
    import json

    from flashtile.bench import decode as bench_decode
    from flashtile.bench import main

    calls = []
    real = bench_decode._time

    def counting_time(fn, device, args):
        calls.append(len(fn()))  # the measured function runs one call per layer
        return real(fn, device, args)

    monkeypatch.setattr(bench_decode, "_time", counting_time)
    kv_bytes_200 = 2 * 1 * 200 * 2 * 32 * 2  # k and v, b=1, s=200, h_k=2, d=32, 2-byte fp16
    monkeypatch.setattr(bench_decode, "LAYER_BYTES_BUDGET", 2 * kv_bytes_200)
    out = tmp_path / "decode.json"
    rc = main(["decode", "--device", "cpu", "--quick", "--batch", "1", "--seqlens", "64", "200", "--pages",
               "--peers", "flash", "--layers", "3", "--dtype", "fp16", "--warmup", "1", "--rep", "3",
               "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layers"] for r in rows] == [3, 2]  # s=64 fits 3 caches in the budget, s=200 only 2
    assert calls == [3, 3, 2, 2]  # (flash, flashtile) per row
    assert all(r["us"]["flashtile"] > 0 and not r["mismatch"] for r in rows)


def test_bench_decode_rounds_alternate_order(tmp_path, monkeypatch):
    # --rounds R: the peers and contiguous flashtile are timed R times each, the first of each round
    # rotating, and each reports its median; paged variants are timed once after the rounds. The fake
    # timer returns 1, 2, 3, ... in call order, so the recorded times show the order of measurement.
    import json

    from flashtile.bench import decode as bench_decode
    from flashtile.bench import main

    ticks = iter(range(1, 100))

    def fake_time(fn, device, args):
        fn()
        return float(next(ticks))

    monkeypatch.setattr(bench_decode, "_time", fake_time)
    out = tmp_path / "decode.json"
    rc = main(["decode", "--device", "cpu", "--quick", "--batch", "1", "--seqlens", "64", "--pages", "16",
               "--peers", "flash", "--rounds", "3", "--dtype", "fp16", "--out", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["rows"][0]
    # rounds: flash, flashtile | flashtile, flash | flash, flashtile -> 1, 2 | 3, 4 | 5, 6
    assert row["rounds_us"] == {"flash": [1.0, 4.0, 5.0], "flashtile": [2.0, 3.0, 6.0]}
    assert row["us"]["flash"] == 4.0 and row["us"]["flashtile"] == 3.0  # medians
    assert row["us"]["flashtile-p16"] == 7.0  # once, after the rounds
    assert row["ratios"]["flash"] == 4.0 / 3.0
    assert not row["mismatch"]


def test_bench_decode_frees_peer_copies_before_paging(monkeypatch):
    # the peers' head-major copies (b, h_k, s, d) must be gone when the paged caches are built: at
    # b = 32, 128k each copy is 8.6 GB
    import gc
    import warnings

    from flashtile.bench import decode as bench_decode
    from flashtile.bench import main

    alive = []
    real = bench_decode._paged

    def counting_paged(k_cache, v_cache, page, order):
        b, s, h_k, d = k_cache.shape
        gc.collect()
        with warnings.catch_warnings():  # isinstance on some of torch's deprecated objects warns
            warnings.simplefilter("ignore")
            alive.append(sum(1 for o in gc.get_objects()
                             if isinstance(o, torch.Tensor) and tuple(o.shape) == (b, h_k, s, d)))
        return real(k_cache, v_cache, page, order)

    monkeypatch.setattr(bench_decode, "_paged", counting_paged)
    for rounds in ("1", "2"):
        assert main(["decode", "--device", "cpu", "--quick", "--batch", "1", "--seqlens", "64", "--pages", "16",
                     "--peers", "flash", "--rounds", rounds, "--dtype", "fp16", "--warmup", "1", "--rep", "3",
                     "--no-check", "--out", "/dev/null"]) == 0
    assert alive == [0, 0]


def test_bench_decode_layers_share_one_block_table(monkeypatch):
    # a model's layers keep one block table per sequence: the benchmark's paged layers must too, each
    # with its own pool holding its own cache in that page order
    import flashtile
    from flashtile.bench import decode as bench_decode

    seen = []

    def recording(q, k_cache, v_cache, **kw):
        seen.append((k_cache, v_cache, kw["block_table"]))

    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache", recording)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(2, 40, 2, 8), torch.randn(2, 40, 2, 8)) for _ in range(3)]
    calls = bench_decode._flashtile_calls(torch.randn(2, 1, 4, 8), caches, torch.full((2,), 40), 16, 0, gen)
    for call in calls:
        call()
    tables = [t for _, _, t in seen]
    assert all(t is tables[0] for t in tables) and tables[0].dtype == torch.int32
    assert sorted(tables[0].flatten().tolist()) == list(range(6))  # 2 rows x 3 pages, each used once
    for (kc, vc), (pk, pv, table) in zip(caches, seen):
        for b in range(2):
            rows_k = pk[table[b].long()].reshape(-1, 2, 8)[:40]
            rows_v = pv[table[b].long()].reshape(-1, 2, 8)[:40]
            assert torch.equal(rows_k, kc[b]) and torch.equal(rows_v, vc[b])


def test_generate_example_runs():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tokens = mod.main(["--device", "cpu", "--new-tokens", "4", "--prompt-len", "5", "--layers", "2", "--check"])
    assert tokens.shape[-1] == 9


def test_new_kv_aliasing_the_cache(interpret):
    """k/v passed as views of the very cache slots they are appended to (with rotary): the result
    must equal the same call on separate copies."""
    g = torch.Generator().manual_seed(3)
    b, cap, h, h_k, d, n, s_new = 2, 40, 4, 2, 16, 21, 3
    q = torch.randn(b, s_new, h, d, generator=g)
    kc, vc = torch.randn(b, cap, h_k, d, generator=g), torch.randn(b, cap, h_k, d, generator=g)
    angle = torch.rand(cap, 4, generator=g) * 6.3
    kw = dict(cache_seqlens=n, rotary_cos=angle.cos(), rotary_sin=angle.sin(), causal=True, return_softmax_lse=True)
    kc2, vc2 = kc.clone(), vc.clone()
    ref_out, ref_lse = flash_attn_with_kvcache(q, kc2, vc2, kc[:, n:n + s_new].clone(), vc[:, n:n + s_new].clone(),
                                               **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kc[:, n:n + s_new], vc[:, n:n + s_new], **kw)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
