"""A FlashAttention-style GPU grid: padded, varlen and kvcache calls crossed with head dims, uneven
sequence pairs, dropout, masks, ALiBi, softcap, GQA / MQA and both 2-byte dtypes, forward and backward,
each against the fp32 reference with FlashAttention's rule (2x PyTorch's own error for outputs, 3x for
gradients).

The full cross product is tens of thousands of cases; the grid below takes every (head dim, sequence
pair) once per call kind and spreads the other factors over those cases with a fixed seed, so every
value of every factor occurs, in a few hundred cases that fit one device call. Run it with pytest-xdist
(``-n 8``): a kernel fault poisons its process's CUDA context, and conftest's teardown check then ends
that worker, so the fault is charged to its own case and a fresh worker runs the rest.
"""

import itertools
import os
import random

import pytest
import torch

import flashtile
from attn_cases import keep_mask_from_probs, make_alibi
from flashtile.backends.reference import attention_ref
from flashtile.backends.reference_kvcache import kvcache_ref
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu
DEV = "cuda"

HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLENS = [(1, 147), (113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (2048, 2048)]
MASKS = ["none", "causal", "local", "local-causal"]
EXTRAS = ["none", "alibi", "softcap", "deterministic"]
HEADS = [(6, 6), (6, 2), (6, 1)]  # MHA, GQA, MQA
DTYPES = [torch.float16, torch.bfloat16]


def _grid(kind: str, dropouts: tuple, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i, (d, (sq, sk)) in enumerate(itertools.product(HEAD_DIMS, SEQLENS)):
        cases.append(dict(kind=kind, d=d, sq=sq, sk=sk, mask=MASKS[i % 4], extra=EXTRAS[(i // 4) % 4],
                          heads=HEADS[i % 3], dtype=DTYPES[(i // 2) % 2], dropout=dropouts[(i // 3) % len(dropouts)],
                          batch=rng.choice([1, 2, 3])))
    return cases


def _id(c: dict) -> str:
    return (f"{c['kind']}-d{c['d']}-{c['sq']}x{c['sk']}-{c['mask']}-{c['extra']}-h{c['heads'][0]}k{c['heads'][1]}"
            f"-{str(c['dtype'])[6:]}-p{c['dropout']}-b{c['batch']}")


# The call that crashed with a misaligned address (issue 53) and its neighbours, pinned.
PINNED = [dict(kind="varlen", d=128, sq=128, sk=217, mask="causal", extra="none", heads=(6, 6), dtype=torch.bfloat16,
               dropout=0.17, batch=2),
          dict(kind="varlen", d=128, sq=256, sk=512, mask="causal", extra="none", heads=(6, 6), dtype=torch.bfloat16,
               dropout=0.17, batch=4),
          dict(kind="varlen", d=128, sq=128, sk=217, mask="causal", extra="none", heads=(6, 6), dtype=torch.float16,
               dropout=0.17, batch=4)]
# call kinds interleaved, so that a run cut short by its time limit has covered all three alike
CASES = PINNED + [c for trio in zip(_grid("varlen", (0.0, 0.17), 2), _grid("padded", (0.0, 0.17), 1),
                                    _grid("kvcache", (0.0,), 3)) for c in trio]


def _window(mask: str, sk: int):
    if mask == "local":
        return dict(window_size=(max(sk // 3, 1), max(sk // 7, 0)))
    if mask == "local-causal":
        return dict(window_size=(max(sk // 4, 1), 0))
    return dict(causal=mask == "causal")


def _lengths(rng: random.Random, batch: int, sq: int, sk: int):
    """Per-sequence lengths: the first sequence the full pair, the others shorter (uneven on purpose)."""
    lens_q = [sq] + [rng.randint(max(sq // 2, 1), sq) for _ in range(batch - 1)]
    lens_k = [sk] + [rng.randint(max(sk // 2, 1), sk) for _ in range(batch - 1)]
    return lens_q, lens_k


def _grads_close(got, ref, pt):
    for name, x, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_fa_grid(case):
    try:
        (_check_kvcache if case["kind"] == "kvcache" else _check_train)(case)
    except BaseException as exc:
        log = os.environ.get("FA_GRID_LOG")  # a line per failure as it happens: a run cut short still tells
        if log:
            with open(log, "a") as f:
                f.write(f"{_id(case)}: {type(exc).__name__}: {str(exc)[:300]}\n")
        raise


def _check_train(c):
    rng = random.Random(_id(c))
    h, h_k = c["heads"]
    d, dtype, p = c["d"], c["dtype"], c["dropout"]
    kw = _window(c["mask"], c["sk"])
    if c["extra"] == "softcap":  # FlashAttention refuses softcap with dropout: the case runs without dropout
        kw["softcap"], p = 15.0, 0.0
    slopes = make_alibi("bh" if c["batch"] > 1 else "h", c["batch"], h, DEV) if c["extra"] == "alibi" else None
    deterministic = c["extra"] == "deterministic"
    if c["kind"] == "varlen":
        lens_q, lens_k = _lengths(rng, c["batch"], c["sq"], c["sk"])
        cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
        shape_q, shape_k = (sum(lens_q), h, d), (sum(lens_k), h_k, d)
        ref_kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

        def call(q, k, v, probs):
            return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p,
                                                    alibi_slopes=slopes, deterministic=deterministic,
                                                    return_attn_probs=probs, **kw)
    else:
        shape_q, shape_k = (c["batch"], c["sq"], h, d), (c["batch"], c["sk"], h_k, d)
        ref_kw = {}

        def call(q, k, v, probs):
            return flashtile.flash_attn_func(q, k, v, dropout_p=p, alibi_slopes=slopes, deterministic=deterministic,
                                             return_attn_probs=probs, **kw)

    q = torch.randn(shape_q, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_k, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_k, device=DEV, dtype=dtype, requires_grad=True)
    g = torch.randn(shape_q, device=DEV, dtype=dtype)
    keep = None
    if p > 0:  # the keep-mask comes back through the probabilities; the same seed draws it again below
        torch.manual_seed(1234)
        _, _, s_dmask = call(q, k, v, True)
        keep = keep_mask_from_probs(s_dmask)
        torch.manual_seed(1234)
    out = call(q, k, v, False)  # the user's call: no probabilities returned
    got = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = attention_ref(q, k, v, alibi_slopes=slopes, dropout_p=p, dropout_mask=keep, **ref_kw, **kw)
    pt, _ = attention_ref(q, k, v, alibi_slopes=slopes, dropout_p=p, dropout_mask=keep, upcast=False, **ref_kw, **kw)
    assert_fa_close(out, ref, pt)
    _grads_close(got, torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(pt, (q, k, v), g))
    if deterministic:
        if p > 0:
            torch.manual_seed(1234)  # the same dropout mask as the checked run: only the schedule may differ
        again = torch.autograd.grad(call(q, k, v, False), (q, k, v), g)
        assert all(torch.equal(a, b) for a, b in zip(got, again)), "deterministic=True: gradients differ run to run"


def _check_kvcache(c):
    gen = torch.Generator(device=DEV).manual_seed(len(_id(c)) * 7919 + c["d"])
    h, h_k = c["heads"]
    d, dtype, b = c["d"], c["dtype"], c["batch"]
    sq, cap = min(c["sq"], 256), c["sk"] + 16  # a decode / chunked-prefill query against a cache with spare room
    s_new = 1 if c["extra"] == "deterministic" else 0  # one appended token a row in a quarter of the cases
    q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype, generator=gen)
    k_cache = torch.randn(b, cap, h_k, d, device=DEV, dtype=dtype, generator=gen)
    v_cache = torch.randn(b, cap, h_k, d, device=DEV, dtype=dtype, generator=gen)
    lens = torch.randint(0, c["sk"] + 1, (b,), device=DEV, dtype=torch.int32, generator=gen)
    lens[0] = c["sk"]
    kw = dict(cache_seqlens=lens, **_window(c["mask"], c["sk"]))
    if c["extra"] == "softcap":
        kw["softcap"] = 15.0
    if c["extra"] == "alibi":
        kw["alibi_slopes"] = make_alibi("bh", b, h, DEV)
    if s_new:
        kw["k"] = torch.randn(b, s_new, h_k, d, device=DEV, dtype=dtype, generator=gen)
        kw["v"] = torch.randn(b, s_new, h_k, d, device=DEV, dtype=dtype, generator=gen)
    rk, rv = k_cache.clone(), v_cache.clone()
    pk, pv = k_cache.clone(), v_cache.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    ref, ref_lse = kvcache_ref(q, rk, rv, **kw)
    pt, _ = kvcache_ref(q, pk, pv, upcast=False, **kw)
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse: +inf rows differ"
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    assert torch.equal(v_cache, rv), "the appended values differ from the reference's"
