"""Shared drivers for numerical tests: run flashtile and the reference on the same inputs.

Used by the CPU-path tests and the Triton (interpreter and GPU) tests, so every backend is held to
the same bar: FlashAttention's 2x rule for outputs and 3x for gradients.
"""

import torch

import flashtile
from flashtile.backends.reference import attention_ref
from tolerance import assert_fa_close


def make_alibi(kind, b, h, device="cpu"):
    if kind == "h":
        return torch.rand(h, device=device) * 0.3
    if kind == "bh":
        return torch.rand(b, h, device=device) * 0.3
    return None


def keep_mask_from_probs(s_dmask):
    """FlashAttention's convention: S_dmask entries of dropped probabilities are negative."""
    return s_dmask >= 0


def check_padded(b, sq, sk, h, h_k, d, dtype, *, device="cpu", grads=True, alibi=None, dropout_p=0.0,
                 grad_factor=3.0, dv=None, **kw):
    """flash_attn_func vs attention_ref (fp32 upcast and same-dtype runs), out, lse and grads; v's head dim
    is ``dv`` (default d)."""
    q = torch.randn(b, sq, h, d, device=device, dtype=dtype, requires_grad=grads)
    k = torch.randn(b, sk, h_k, d, device=device, dtype=dtype, requires_grad=grads)
    v = torch.randn(b, sk, h_k, dv or d, device=device, dtype=dtype, requires_grad=grads)
    slopes = make_alibi(alibi, b, h, device)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=dropout_p, alibi_slopes=slopes,
                                                  return_attn_probs=True, **kw)
    keep = keep_mask_from_probs(s_dmask) if dropout_p > 0 else None
    ref, ref_lse = attention_ref(q, k, v, alibi_slopes=slopes, dropout_p=dropout_p, dropout_mask=keep, **kw)
    pt, _ = attention_ref(q, k, v, alibi_slopes=slopes, dropout_p=dropout_p, dropout_mask=keep, upcast=False,
                          **kw)
    assert out.dtype == dtype and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse: +inf rows differ"
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 if fin.any() else True
    if not grads:
        return out
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g)
    pq, pk, pv = torch.autograd.grad(pt, (q, k, v), g)
    for name, x, r, p in (("dq", dq, rq, pq), ("dk", dk, rk, pk), ("dv", dv, rv, pv)):
        assert_fa_close(x, r, p, factor=grad_factor, atol=1e-4, name=name)
    return out


def varlen_inputs(lens_q, lens_k, h, h_k, d, dtype, device="cpu", grads=True):
    cu_q = torch.tensor([0] + list(lens_q), device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(lens_k), device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, d, device=device, dtype=dtype, requires_grad=grads)
    k = torch.randn(sum(lens_k), h_k, d, device=device, dtype=dtype, requires_grad=grads)
    v = torch.randn(sum(lens_k), h_k, d, device=device, dtype=dtype, requires_grad=grads)
    return q, k, v, cu_q, cu_k


def check_varlen(lens_q, lens_k, h, h_k, d, dtype, *, device="cpu", grads=True, alibi=None, **kw):
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, h, h_k, d, dtype, device, grads)
    slopes = make_alibi(alibi, len(lens_q), h, device)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   alibi_slopes=slopes, return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes, **kw)
    pt, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes, upcast=False,
                          **kw)
    assert lse.shape == (h, sum(lens_q))
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3
    if grads:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, (q, k, v), g)
        same = torch.autograd.grad(pt, (q, k, v), g)
        for name, x, r, p in zip(("dq", "dk", "dv"), got, want, same):
            assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)
    return out


def repeated_grads(runs, shape=(2, 1024, 8, 128), device="cuda", **kw):
    """dq, dk, dv of ``runs`` forward + backward calls of flash_attn_func(**kw) on the same bf16
    inputs and output gradient: what race and determinism tests compare run to run."""
    q, k, v = (torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    return [torch.autograd.grad(flashtile.flash_attn_func(q, k, v, **kw), (q, k, v), g) for _ in range(runs)]


def record_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` (a kernel launcher) so each call appends its first argument's shape to the
    returned list: a test routed to a kernel asserts that the kernel really ran."""
    calls = []
    real = getattr(owner, name)

    def recording(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, recording)
    return calls


def grads_switched(setting: str, calls: list, shape=(2, 2048, 8, 128), device="cuda"):
    """dq, dk, dv of one causal bf16 forward, first as routed (the test pinned ``config.<setting>`` on;
    ``calls``, from record_calls, must show its kernel ran), then with ``config.<setting>`` = False:
    (got, want) for a test comparing a kernel with the one it replaces."""
    from flashtile import config

    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    got = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    assert calls, f"{setting}: the kernel did not run"
    with config.override(**{setting: False}):
        return got, torch.autograd.grad(out, (q, k, v), g)
