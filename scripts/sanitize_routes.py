"""One small call down every kernel route, forward and backward, for ``compute-sanitizer --tool memcheck``.

Run as ``compute-sanitizer --tool memcheck --error-exitcode 9 python scripts/sanitize_routes.py`` (gpu_check.sh's
``sanitize`` step): the sanitizer reports any out-of-bounds or misaligned access a kernel makes; this script
only drives the calls and checks each result is finite. Shapes are small (memcheck slows kernels a hundredfold)
but long enough to reach each route: Triton and Gluon forward and backward, varlen with dropout, fp8, the
decode routes, the cache append, the split combine and rotary.
"""

from __future__ import annotations

import sys
import time

import torch

import flashtile

DEV = "cuda"
BF16 = torch.bfloat16


def _rand(*shape, dtype=BF16, grad=False):
    return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=grad)


def _train(name, q, k, v, varlen=None, **kw):
    if varlen is None:
        out = flashtile.flash_attn_func(q, k, v, **kw)
    else:
        cu_q, cu_k, mq, mk = varlen
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out)) if q.requires_grad else ()
    torch.cuda.synchronize()
    assert all(torch.isfinite(x.float()).all() for x in (out, *grads)), name


def _cu(lens):
    return torch.tensor([0, *lens], device=DEV).cumsum(0).to(torch.int32)


def cases():
    """(name, thunk) for each route."""
    yield "triton-fwd-bwd d64", lambda: _train("", *(_rand(2, 300, 4, 64, grad=True) for _ in range(3)), causal=True)
    yield "triton-fwd-bwd d59 gqa window alibi", lambda: _train(
        "", _rand(2, 133, 6, 59, grad=True), _rand(2, 211, 2, 59, grad=True), _rand(2, 211, 2, 59, grad=True),
        window_size=(40, 7), alibi_slopes=torch.rand(6, device=DEV))
    for d in (64, 128, 256):
        yield f"triton-varlen-dropout-causal d{d}", lambda d=d: _train(
            "", _rand(192, 6, d, grad=True), _rand(325, 6, d, grad=True), _rand(325, 6, d, grad=True),
            varlen=(_cu([128, 64]), _cu([217, 108]), 128, 217), dropout_p=0.17, causal=True)
    yield "triton-fwd-bwd softcap fp16", lambda: _train(
        "", *(_rand(1, 257, 4, 96, dtype=torch.float16, grad=True) for _ in range(3)), softcap=20.0, causal=True)
    for d in (64, 128, 256):  # the Gluon forward and dK/dV kernels' routes (bf16, padded, equal lengths)
        yield f"gluon-fwd-bwd d{d}", lambda d=d: _train("", *(_rand(1, 1024, 2, d, grad=True) for _ in range(3)),
                                                        causal=True)
    yield "gluon-fwd d128 plain", lambda: _train("", *(_rand(1, 2048, 2, 128) for _ in range(3)))
    yield "fp8-fwd d128", lambda: _fp8(1, 1024, 2, 128)
    yield "fp8-fwd d64 varlen-free short", lambda: _fp8(2, 200, 2, 64)
    # decode routes on Hopper (backends/triton/decode/route.py): split, Gluon split 4 ways, Gluon unsplit, half rows,
    # whole rows on 16- and 256-key pages, the paged split kernel
    for b, cap, page in ((1, 8192, None), (8, 32768, None), (32, 8192, None), (64, 8192, None), (16, 8192, 16),
                         (32, 8192, 256), (4, 2048, 16), (4, 2048, 256)):
        yield f"decode b{b} cache{cap} page{page}", lambda b=b, cap=cap, page=page: _decode(b, cap, page)
    yield "decode prefill + append + rotary", lambda: _decode(2, 1024, None, sq=17, s_new=17, rotary=True)
    yield "combine", _combine


def _fp8(b, s, h, d):
    from flashtile.fp8 import quantize_qkv

    q, k, v = (_rand(b, s, h, d) for _ in range(3))
    q8, k8, v8, q_ds, k_ds, v_ds = quantize_qkv(q, k, v)
    out = flashtile.flash_attn_func(q8, k8, v8, q_descale=q_ds, k_descale=k_ds, v_descale=v_ds, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def _decode(b, cap, page, sq=1, s_new=0, rotary=False):
    h, h_k, d = 32, 8, 128
    kw = {}
    if page is None:
        k_cache, v_cache = _rand(b, cap, h_k, d), _rand(b, cap, h_k, d)
    else:
        per = cap // page
        kw["block_table"] = torch.randperm(b * per, device=DEV).view(b, per).to(torch.int32)
        k_cache, v_cache = _rand(b * per, page, h_k, d), _rand(b * per, page, h_k, d)
    lens = torch.randint(1, cap - s_new, (b,), device=DEV, dtype=torch.int32)
    lens[0] = cap - s_new
    if s_new:
        kw.update(k=_rand(b, s_new, h_k, d), v=_rand(b, s_new, h_k, d))
    if rotary:
        angle = torch.rand(cap, d // 4, device=DEV) * 6.3
        kw.update(rotary_cos=angle.cos().to(BF16), rotary_sin=angle.sin().to(BF16))
    from flashtile.backends.triton.decode import route

    props = route.device_props(torch.device(DEV))
    shape = route.DecodeShape(b, sq, h, h_k, d, cap, new_tokens=s_new, plain=not rotary)
    chosen = route.select_route(shape, BF16, page is not None, page or 0, props)
    print(f"      route {chosen.kernel}, {chosen.splits} split(s), {chosen.heads or 1} head(s) a program", flush=True)
    out = flashtile.flash_attn_with_kvcache(_rand(b, sq, h, d), k_cache, v_cache, cache_seqlens=lens, causal=True, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def _combine():
    out_partial = torch.randn(4, 2, 3, 8, 64, device=DEV)
    lse_partial = torch.randn(4, 2, 3, 8, device=DEV)
    out, lse = flashtile.flash_attn_combine(out_partial, lse_partial)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def main() -> int:
    failed = 0
    for name, thunk in cases():
        t0 = time.perf_counter()
        try:
            thunk()
            print(f"ok    {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every route, then fail
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            if "CUDA" in str(exc):  # a poisoned context fails every later call: stop here
                break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
