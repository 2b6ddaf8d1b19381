"""flash_attn_with_kvcache with fp8 (e4m3) q and caches (FlashAttention-3's descale arguments), on CPU.

Both backends (the PyTorch path and the Triton kernels in the interpreter) are checked against the
float64 ``dense_oracle`` of ``test_kvcache.py`` run on the *dequantised* inputs: the fp8 call must
compute attention of ``q8 * q_descale`` over ``cache8 * k_descale`` / ``* v_descale`` (per batch row
and kv head), append the new e4m3 keys/values byte for byte, and return bf16.
"""

import pytest
import torch

import test_kvcache
from flashtile.fp8 import FP8_DTYPE
from flashtile.kvcache import flash_attn_with_kvcache
from test_kvcache import dense_oracle


def _quantize(x, h_k):
    """(b, s, heads, d) -> e4m3 and an fp32 (b, h_k) descale (the heads of one kv head share it)."""
    b, _, heads, d = x.shape
    amax = x.abs().view(b, -1, h_k, heads // h_k, d).amax(dim=(1, 3, 4)).float()
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    per_head = descale.repeat_interleave(heads // h_k, dim=1).view(b, 1, heads, 1)
    return (x.float() / per_head).clamp(-448, 448).to(FP8_DTYPE), descale


def _dequantize(x8, descale):
    heads, h_k = x8.shape[2], descale.shape[1]
    return x8.double() * descale.double().repeat_interleave(heads // h_k, dim=1).view(x8.shape[0], 1, heads, 1)


def _case(b=3, sq=1, s_new=2, h=6, h_k=2, d=32, cap=40, page=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g)
    kc, vc = (torch.randn(b, cap, h_k, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, s_new, h_k, d, generator=g) * 1.5 for _ in range(2))
    lens = torch.randint(0, cap - s_new + 1, (b,), generator=g, dtype=torch.int32)
    q8, qd = _quantize(q, h_k)
    # the new keys/values take their cache row's scale (a serving loop keeps one scale per row)
    kc8, kd = _quantize(torch.cat([kc, k], 1), h_k)
    vc8, vd = _quantize(torch.cat([vc, v], 1), h_k)
    kc8, k8 = kc8[:, :cap].contiguous(), kc8[:, cap:].contiguous()
    vc8, v8 = vc8[:, :cap].contiguous(), vc8[:, cap:].contiguous()
    args = dict(k=k8, v=v8, cache_seqlens=lens, q_descale=qd, k_descale=kd, v_descale=vd)
    if page is not None:  # scatter every row's positions over shuffled pages
        n_pages = cap // page
        perm = torch.randperm(b * n_pages, generator=g)
        table = perm.view(b, n_pages).to(torch.int32)
        pk, pv = (torch.empty(b * n_pages, page, h_k, d, dtype=FP8_DTYPE) for _ in range(2))
        for i in range(b):
            for j in range(n_pages):
                pk[table[i, j]] = kc8[i, j * page:(j + 1) * page]
                pv[table[i, j]] = vc8[i, j * page:(j + 1) * page]
        args["block_table"] = table
        return q8, pk, pv, args
    return q8, kc8, vc8, args


def _oracle(q8, kc8, vc8, args, **kw):
    qd, kd, vd = args["q_descale"], args["k_descale"], args["v_descale"]
    table = args.get("block_table")
    if table is None:
        kcf, vcf = _dequantize(kc8, kd), _dequantize(vc8, vd)
    else:  # page p belongs to the batch row whose table lists it: dequantise with that row's scale
        owner = torch.empty(kc8.shape[0], dtype=torch.long)
        for i in range(table.shape[0]):
            owner[table[i].long()] = i
        kcf = kc8.double() * kd.double()[owner].view(-1, 1, kd.shape[1], 1)
        vcf = vc8.double() * vd.double()[owner].view(-1, 1, vd.shape[1], 1)
    oracle_args = {n: x for n, x in args.items() if not n.endswith("descale")}
    oracle_args.update(k=_dequantize(args["k"], kd), v=_dequantize(args["v"], vd))
    return dense_oracle(_dequantize(q8, qd), kcf, vcf, **oracle_args, **kw)


# the backends of test_kvcache.py: PyTorch path, interpreter kernels with the fused append, and with
# the separate append kernel (spied: the kernels must have run)
path = test_kvcache.path


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(9, 0)), dict(softcap=5.0, causal=True),
                                dict(alibi=True, causal=True), dict(num_splits=3, causal=True), dict()],
                         ids=["causal", "window", "softcap", "alibi", "splits", "full"])
@pytest.mark.parametrize("page", [None, 4], ids=["contiguous", "paged"])
def test_fp8_cache_matches_dequantised_oracle(path, kw, page):
    kw = dict(kw)
    q8, kc8, vc8, args = _case(page=page, sq=2 if "window_size" in kw else 1)
    if kw.pop("alibi", False):
        args["alibi_slopes"] = torch.rand(3, 6) * 0.3
    ref_out, ref_lse, *_ = _oracle(q8, kc8, vc8, args, **{n: x for n, x in kw.items() if n != "num_splits"})
    kc_before = kc8.view(torch.uint8).clone()
    out, lse = flash_attn_with_kvcache(q8, kc8, vc8, **args, **kw, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # bf16 output (8 bits) and fp16 probabilities in the kernels: about 1e-2 on O(1) outputs
    assert (out.double() - ref_out).abs().max().item() < 2e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 2e-3
    # the append copies e4m3 bytes: exactly the new k bytes at each row's positions, nothing else moved
    changed = (kc8.view(torch.uint8) != kc_before).any(-1).any(-1)
    assert changed.sum().item() <= args["k"].shape[0] * args["k"].shape[1]
    lens, k8 = args["cache_seqlens"].long(), args["k"]
    for i in range(k8.shape[0]):
        for t in range(k8.shape[1]):
            p = int(lens[i]) + t
            row, col = (int(args["block_table"][i, p // page]), p % page) if page else (i, p)
            assert torch.equal(kc8[row, col].view(torch.uint8), k8[i, t].view(torch.uint8))


def test_fp8_descale_defaults_to_one(path):
    q8, kc8, vc8, args = _case()
    for name in ("q_descale", "k_descale", "v_descale"):
        args[name] = None
    out = flash_attn_with_kvcache(q8, kc8.clone(), vc8.clone(), **args, causal=True)
    ones = torch.ones(3, 2)
    ref = flash_attn_with_kvcache(q8, kc8.clone(), vc8.clone(), **dict(args, q_descale=ones, k_descale=ones,
                                                                        v_descale=ones), causal=True)
    assert torch.equal(out, ref)


def test_fp8_errors_name_the_argument():
    q8, kc8, vc8, args = _case()
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        flash_attn_with_kvcache(q8, kc8.to(torch.bfloat16), vc8, **args)
    with pytest.raises(TypeError, match="q_descale is only for fp8"):
        flash_attn_with_kvcache(q8.to(torch.bfloat16), kc8.to(torch.bfloat16), vc8.to(torch.bfloat16),
                                q_descale=args["q_descale"])
    with pytest.raises(ValueError, match=r"k_descale must have shape \(b, h_k\)"):
        flash_attn_with_kvcache(q8, kc8, vc8, **dict(args, k_descale=torch.ones(3, 3)))
    cos = torch.ones(40, 8)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin are not supported with fp8"):
        flash_attn_with_kvcache(q8, kc8, vc8, **args, rotary_cos=cos, rotary_sin=cos)


def test_fp8_cache_compiles_fullgraph():
    torch._dynamo.reset()
    q8, kc8, vc8, args = _case(page=4)

    def step(q, kc, vc, **kw):
        return flash_attn_with_kvcache(q, kc, vc, **kw, causal=True, return_softmax_lse=True)

    ref_out, ref_lse = step(q8, kc8.clone(), vc8.clone(), **args)
    out, lse = torch.compile(step, fullgraph=True, backend="eager")(q8, kc8.clone(), vc8.clone(), **args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
