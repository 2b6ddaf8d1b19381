"""flash_attn_with_kvcache with ``qv`` (multi-head latent attention in absorbed form) and a value head dim of its own,
on CPU: the PyTorch path (backends/reference_kvcache.py) and the MLA Triton kernel in the interpreter.

Every case is checked against ``mla_oracle``: the cache update written out slot by slot here, then tests/brute_force.py
(float64, one query row at a time, written from the contract) on each batch row's keys. The updated caches must match
too (k close: the kernels rotate it in fp32; v exact: it is only copied). Shapes are small analogues of DeepSeek's
(d = 64 rope dims, dv = 512 latent dims, one latent kv head for all query heads): d = 16, dv = 64.
"""

import math

import pytest
import torch

from brute_force import brute_force
from flashtile import config
from flashtile.backends.triton.decode import append, mla, split
from flashtile.kvcache import flash_attn_with_kvcache
from test_kvcache import _rotate


def mla_oracle(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
               cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, qv=None):
    """(out, lse, new_k_cache, new_v_cache) in float64; inputs are not modified."""
    kc, vc = k_cache.clone(), v_cache.clone()
    b, sq, h, _ = q.shape
    page = kc.shape[1]
    cap = block_table.shape[1] * page if block_table is not None else kc.shape[1]
    local = causal or window_size[0] >= 0 or window_size[1] >= 0
    s_new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = cap if cache_seqlens is None else cache_seqlens if isinstance(cache_seqlens, int) else int(cache_seqlens[i])
        lp = 0 if cache_leftpad is None else int(cache_leftpad[i])
        row = i if cache_batch_idx is None else int(cache_batch_idx[i])

        def slot(p, i=i, row=row):
            return (int(block_table[i, p // page]), p % page) if block_table is not None else (row, p)

        for t in range(s_new):
            kt = k[i, t].double()
            if rotary_cos is not None:
                kt = _rotate(kt, rotary_cos[n + t].double(), rotary_sin[n + t].double(), rotary_interleaved)
            kc[slot(n + t)] = kt.to(kc.dtype)
            vc[slot(n + t)] = v[i, t]
        positions = range(lp, n + s_new)
        keys = torch.stack([kc[slot(p)] for p in positions]) if len(positions) else kc[0, :0]
        vals = torch.stack([vc[slot(p)] for p in positions]) if len(positions) else vc[0, :0]
        qi = q[i].double()
        if rotary_cos is not None:
            for t in range(sq):
                pos = n + t if local else n
                qi[t] = _rotate(qi[t], rotary_cos[pos].double(), rotary_sin[pos].double(), rotary_interleaved)
            qi = qi.to(q.dtype).double()  # the kernels round the rotated q to the input dtype
        alibi = None if alibi_slopes is None else alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
        out, lse = brute_force(qi[None], keys[None].double(), vals[None].double(), [sq], [len(positions)],
                               causal=causal, window=window_size, softcap=softcap, alibi=alibi, scale=softmax_scale,
                               qv=None if qv is None else qv[i:i + 1].double())
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), kc, vc


def make_case(dtype=torch.float32, b=3, sq=1, s_new=1, h=4, h_k=1, d=16, dv=64, cap=45, seqlens="rows", page=None,
              qv=True, batch_idx=False, leftpad=False, rotary=None, alibi=False, **kw):
    """Inputs of one call; ``seqlens``: "rows" (int32 per row: one row full, one empty before the append), an int,
    or None (the full cache)."""
    q = torch.randn(b, sq, h, d, dtype=dtype)
    args = dict(kw)
    if qv:
        args["qv"] = torch.randn(b, sq, h, dv, dtype=dtype)
    lens = None
    if seqlens == "rows":
        lens = torch.randint(0, cap - s_new + 1, (b,), dtype=torch.int32)
        lens[0] = cap - s_new
        if b > 2:
            lens[2] = 0
        args["cache_seqlens"] = lens
    elif seqlens is not None:
        args["cache_seqlens"] = seqlens
    if page is not None:
        nblk = -(-cap // page)
        pool = b * nblk + 2
        args["block_table"] = torch.randperm(pool)[: b * nblk].to(torch.int32).view(b, nblk)
        cap = nblk * page
        rows = pool
    else:
        rows = b + 2 if batch_idx else b
        if batch_idx:
            args["cache_batch_idx"] = torch.randperm(rows)[:b].to(torch.int32)
    k_cache = torch.randn(rows, page or cap, h_k, d, dtype=dtype)
    v_cache = torch.randn(rows, page or cap, h_k, dv, dtype=dtype)
    if s_new:
        args["k"] = torch.randn(b, s_new, h_k, d, dtype=dtype)
        args["v"] = torch.randn(b, s_new, h_k, dv, dtype=dtype)
    if leftpad:
        base = lens if lens is not None else torch.full((b,), args.get("cache_seqlens", cap), dtype=torch.int32)
        args["cache_leftpad"] = (torch.rand(b) * (base.float() + 1)).floor().to(torch.int32).clamp(max=base)
    if rotary is not None:
        angle = torch.rand(cap, rotary // 2) * 6.3
        args["rotary_cos"], args["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
        args["rotary_interleaved"] = False
    if alibi:
        args["alibi_slopes"] = torch.rand(b, h) * 0.3
    return q, k_cache, v_cache, args


# b in {1, 3}, h in {4, 16} with one latent kv head, lengths per row, paged and not, causal with sq > 1
CASES = {
    "decode_b1_h16": dict(b=1, h=16),
    "decode_b3_h16": dict(b=3, h=16),
    "decode_b3_h4_read_only_int_len": dict(h=4, s_new=0, seqlens=30),
    "decode_b1_h4_full_cache": dict(b=1, h=4, s_new=0, seqlens=None),
    "paged_16_b3_h16": dict(h=16, page=16),  # pages of whole 16-key tiles
    "paged_5_b3_h4": dict(h=4, page=5, s_new=2),  # every key looks its page up
    "paged_4_b3_h16": dict(h=16, page=4, s_new=2, cap=70),  # 4 pages a 16-key tile: one table read a page
    "paged_64_b1_h16_causal": dict(b=1, h=16, page=64, cap=150, sq=2, s_new=2, causal=True),
    "causal_b3_h4_sq3": dict(h=4, sq=3, s_new=3, causal=True),
    "causal_b3_h16_sq2": dict(h=16, sq=2, s_new=2, causal=True),  # 32 rows: two row blocks of 16
    "two_latent_heads_b3": dict(h=8, h_k=2, sq=2, s_new=1, causal=True),
    "features": dict(h=4, sq=2, s_new=2, leftpad=True, rotary=8, window_size=(9, 0), softcap=3.0, alibi=True),
    "batch_idx_scale": dict(h=4, s_new=2, batch_idx=True, softmax_scale=0.2),
    "paged_leftpad_rotary": dict(h=4, page=4, s_new=2, sq=2, leftpad=True, rotary=16, causal=True),
    "dv_only_wider_v": dict(h=4, h_k=2, d=16, dv=48, qv=False, s_new=2, sq=2, causal=True),
    "dv_only_narrower_v": dict(h=4, h_k=2, d=32, dv=16, qv=False, s_new=1, rotary=8),
    "qv_same_head_dims": dict(h=4, d=16, dv=16, page=8),
}


def _run_and_check(q, k_cache, v_cache, args, num_splits=0, atol=None):
    ref_out, ref_lse, ref_kc, ref_vc = mla_oracle(q, k_cache, v_cache, **args)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    fp16 = q.dtype == torch.float16
    b, sq, h, _ = q.shape
    assert out.shape == (b, sq, h, v_cache.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() <= (atol or (5e-3 if fp16 else 2e-5))
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows that see no key must have lse +inf"
    assert (lse[~fin] == math.inf).all()
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= (5e-3 if fp16 else 1e-4)
    assert torch.equal(vc, ref_vc), "v cache must be an exact copy of the new values"
    assert (kc.double() - ref_kc.double()).abs().max().item() <= (1e-3 if fp16 else 1e-6)
    return out, lse


TINY = dict(interpret=True, decode_tiles=(16, 16, 4, 1))  # 16-key tiles, row blocks of 16


@pytest.fixture(params=["cpu", "interp"])
def path(request, monkeypatch):
    """The PyTorch path, or the Triton kernels in the interpreter; on the latter, the MLA kernel must run the
    attention and the split kernel must not."""
    used = {"mla": [], "split": []}
    for name, module in (("mla", mla), ("split", split)):
        real = module.decode
        monkeypatch.setattr(module, "decode", lambda *a, _r=real, _n=name, **k: used[_n].append(1) or _r(*a, **k))
    with config.override(**(TINY if request.param == "interp" else dict(interpret=False))):
        yield request.param
    assert bool(used["mla"]) == (request.param == "interp") and not used["split"]


@pytest.mark.parametrize("name", list(CASES))
def test_semantics_fp32(path, name):
    q, kc, vc, args = make_case(**CASES[name])
    _run_and_check(q, kc, vc, args)


@pytest.mark.parametrize("name", ["decode_b3_h16", "paged_5_b3_h4", "causal_b3_h16_sq2", "features"])
def test_semantics_fp16_kernel(name):
    q, kc, vc, args = make_case(dtype=torch.float16, **CASES[name])
    with config.override(**TINY):
        _run_and_check(q, kc, vc, args)


@pytest.mark.parametrize("name", ["decode_b3_h16", "paged_16_b3_h16", "features"])
def test_num_splits_agree(name, monkeypatch):
    """num_splits 1, 3 and the heuristic give the same result up to fp32 rounding, with the launches split as
    asked (split partials merged by the combine kernel)."""
    q, kc, vc, args = make_case(**dict(CASES[name], cap=70))
    seen = []
    real = mla.decode
    monkeypatch.setattr(mla, "decode", lambda *a, **k: seen.append(a[4].splits) or real(*a, **k))
    with config.override(**TINY):
        results = [_run_and_check(q, kc, vc, args, num_splits=n) for n in (1, 3, 0)]
    assert seen[:2] == [1, 3] and seen[2] > 1  # 70 keys of 16-key tiles on the interpreter's 132 SMs: split
    for out, lse in results[1:]:
        assert (out - results[0][0]).abs().max().item() <= 1e-5
        fin = torch.isfinite(lse)
        assert torch.equal(fin, torch.isfinite(results[0][1]))
        assert (lse[fin] - results[0][1][fin]).abs().max().item() <= 1e-5


def test_one_packed_latent_cache(path):
    """DeepSeek's serving layout: one (pages, page_size, 1, dv + d) buffer holding each key's latent part and then
    its rope part, passed as two views (v_cache = [..., :dv], k_cache = [..., dv:]): appends land in the one buffer
    and attention reads both parts from it."""
    b, h, d, dv, page = 3, 16, 16, 64, 8
    q, _, _, args = make_case(b=b, h=h, d=d, dv=dv, page=page, s_new=2, sq=2, causal=True)
    pool = args["block_table"].numel() + 2
    packed = torch.randn(pool, page, 1, dv + d)
    ref_out, ref_lse, ref_kc, ref_vc = mla_oracle(q, packed[..., dv:].clone(), packed[..., :dv].clone(), **args)
    out, lse = flash_attn_with_kvcache(q, packed[..., dv:], packed[..., :dv], return_softmax_lse=True, **args)
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4  # every row sees keys
    assert torch.equal(packed[..., :dv], ref_vc) and (packed[..., dv:] - ref_kc).abs().max().item() <= 1e-6


def test_default_scale():
    """softmax_scale defaults to 1 / sqrt(d + dv) with qv (FlashAttention-3's rule), 1 / sqrt(d) without, whatever
    v's head dim."""
    q, kc, vc, args = make_case(b=1, s_new=0, seqlens=None)
    out = flash_attn_with_kvcache(q, kc, vc, qv=args["qv"])
    assert torch.allclose(out, flash_attn_with_kvcache(q, kc, vc, qv=args["qv"], softmax_scale=80 ** -0.5),
                          atol=1e-6)
    assert not torch.allclose(out, flash_attn_with_kvcache(q, kc, vc, qv=args["qv"], softmax_scale=0.25), atol=1e-3)
    plain = flash_attn_with_kvcache(q, kc, vc)
    assert torch.allclose(plain, flash_attn_with_kvcache(q, kc, vc, softmax_scale=0.25), atol=1e-6)


def test_append_kernel_with_a_value_head_dim_of_its_own(monkeypatch):
    """New keys (rotated) and values of different head dims land in the paged cache through the dv append kernel,
    and only through it."""
    seen = []
    real = append._kv_append_dv_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]

    monkeypatch.setattr(append, "_kv_append_dv_kernel", Spy())
    q, kc, vc, args = make_case(h=4, h_k=2, page=3, s_new=3, sq=3, rotary=8, causal=True)
    with config.override(**TINY):
        _run_and_check(q, kc, vc, args)
    assert seen == [(3 * 3,)]  # one program a (new token, batch row)


def test_kernel_grid_puts_the_row_blocks_side_by_side(monkeypatch):
    """One program per (batch row, kv head, split, row block), the row block fastest, so the programs reading the
    same keys for different query heads launch next to each other."""
    launches = []
    monkeypatch.setattr(mla, "launch", lambda kernel, grid, *a, **meta: launches.append((grid, meta)))
    monkeypatch.setattr(mla, "combine", lambda *a, **k: None)
    q, kc, vc, args = make_case(b=3, h=16, h_k=2, sq=3, s_new=0)  # 24 rows a kv head: 2 row blocks of 16
    with config.override(**TINY):
        flash_attn_with_kvcache(q, kc, vc, num_splits=2, **args)
    (grid, meta), = launches
    assert grid == (3 * 2 * 2 * 2,)
    assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["NUM_SPLITS"], meta["HEAD_DIM"], meta["HEAD_DIM_V"],
            meta["HAS_QV"]) == (16, 16, 2, 16, 64, True)


def test_torch_compile_fullgraph_with_qv():
    torch._dynamo.reset()
    q, kc, vc, args = make_case(s_new=1, page=4, rotary=8, causal=True)

    def step(q, k_cache, v_cache, k, v, qv, cos, sin, lens, table):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lens, block_table=table,
                                           causal=True, rotary_interleaved=False, qv=qv, return_softmax_lse=True)
        return out * 2, lse

    inputs = (args["k"], args["v"], args["qv"], args["rotary_cos"], args["rotary_sin"], args["cache_seqlens"],
              args["block_table"])
    kc1, vc1 = kc.clone(), vc.clone()
    ref_out, ref_lse = step(q, kc1, vc1, *inputs)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = torch.compile(step, fullgraph=True, backend="eager")(q, kc2, vc2, *inputs)
    assert out.shape == (3, 1, 4, 64)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), "the compiled call must update the caches in place"
    torch.library.opcheck(torch.ops.flashtile.kvcache_fwd,
                          (q, kc.clone(), vc.clone(), None, None, None, None, args["cache_seqlens"], -1, None, None,
                           args["block_table"], 0.25, True, -1, 0, 0.0, True, None, 1, None, None, None, args["qv"]),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# errors name the argument


def _base():
    q = torch.randn(2, 1, 4, 16)
    return q, torch.randn(2, 10, 1, 16), torch.randn(2, 10, 1, 64)


ERRORS = [
    ("qv must have shape", lambda q: dict(qv=torch.randn(2, 1, 4, 16))),  # dv of k, not v
    ("qv must have shape", lambda q: dict(qv=torch.randn(2, 1, 2, 64))),
    ("qv must have q's dtype", lambda q: dict(qv=torch.randn(2, 1, 4, 64, dtype=torch.float64))),
    ("qv must be on q's device", lambda q: dict(qv=torch.randn(2, 1, 4, 64, device="meta"))),
    ("qv must be a torch.Tensor", lambda q: dict(qv=[1.0])),
    ("v_cache must have k_cache's shape but for its head dim", lambda q: dict(v_cache=torch.randn(2, 10, 2, 64))),
    ("v_cache head dim dv=600", lambda q: dict(v_cache=torch.randn(2, 10, 1, 600))),
    ("v must have shape .* dv", lambda q: dict(k=torch.randn(2, 1, 1, 16), v=torch.randn(2, 1, 1, 16),
                                               cache_seqlens=1)),
    ("k must have shape .* d\\)", lambda q: dict(k=torch.randn(2, 1, 1, 64), v=torch.randn(2, 1, 1, 64),
                                                 cache_seqlens=1)),
    ("v must have k's s_new", lambda q: dict(k=torch.randn(2, 1, 1, 16), v=torch.randn(2, 2, 1, 64),
                                             cache_seqlens=1)),
]


@pytest.mark.parametrize("match,make", ERRORS, ids=[f"{i}-{e[0][:24]}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(match, make):
    q, kc, vc = _base()
    kw = dict(q=q, k_cache=kc, v_cache=vc)
    kw.update(make(q))
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_with_kvcache(**kw)


def test_fp8_refuses_qv_and_a_value_head_dim_of_its_own():
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(2, 1, 4, 16).to(e4m3)
    kc = torch.randn(2, 10, 1, 16).to(e4m3)
    with pytest.raises(TypeError, match="qv is not supported with fp8"):
        flash_attn_with_kvcache(q, kc, kc.clone(), qv=torch.randn(2, 1, 4, 16).to(e4m3))
    with pytest.raises(ValueError, match="dv=64 must equal d=16 with fp8"):
        flash_attn_with_kvcache(q, kc, torch.randn(2, 10, 1, 64).to(e4m3))



def test_bench_decode_mla_cpu_smoke(tmp_path, monkeypatch):
    """python -m flashtile.bench decode --mla: every flashtile call passes qv over the latent cache (contiguous and
    paged), its outputs match the float64 check, and the floors count the latent cache's bytes and the call's FLOPs;
    --peers is refused (no SDPA backend takes qv)."""
    import json

    import flashtile
    from flashtile.bench import main

    seen = []
    real = flashtile.flash_attn_with_kvcache

    def spy(q, k_cache, v_cache, **kw):
        seen.append((q.shape, k_cache.shape[-1], v_cache.shape[-1], kw["qv"].shape, kw["block_table"] is not None))
        return real(q, k_cache, v_cache, **kw)

    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache", spy)
    out = tmp_path / "mla.json"
    rc = main(["decode", "--mla", "--device", "cpu", "--quick", "--batch", "2", "--seqlens", "64", "--warmup", "1",
               "--rep", "3", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "decode-mla" and data["meta"]["dv"] == 64
    (row,) = data["rows"]
    assert (row["b"], row["seqlen_k"], row["h"], row["h_k"], row["d"], row["dv"]) == (2, 64, 4, 1, 16, 64)
    assert row["kv_bytes"] == 2 * 64 * 1 * (16 + 64) * 2 and row["flops"] == 2 * 2 * 4 * 64 * (16 + 2 * 64)
    assert row["us"]["flashtile"] > 0 and row["us"]["flashtile-p16"] > 0, row["errors"]
    assert not row["mismatch"] and row["max_rel_err"] < 0.02
    assert row["x_floor"]["flashtile"] == row["us"]["flashtile"] / row["floor_us"]
    assert {s[-1] for s in seen} == {False, True}
    assert all(s[:4] == ((2, 1, 4, 16), 16, 64, (2, 1, 4, 64)) for s in seen)
    assert main(["decode", "--mla", "--device", "cpu", "--quick", "--peers", "flash", "--out", str(out)]) == 2
