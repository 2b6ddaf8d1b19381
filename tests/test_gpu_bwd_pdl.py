"""GPU tests of the backward with programmatic dependent launch (FLASHTILE_BWD_PDL, attn_bwd.use_bwd_pdl).

The dQ kernel starts while the dK/dV kernel drains and waits for it only at its end. Gradients must
be bitwise those of ordinary launches, eager and inside a CUDA graph, on the Triton and the Gluon
dK/dV routes, and work queued after the backward must see dK and dV complete.
"""

import pytest
import torch

import flashtile
from flashtile.backends.triton import attn_bwd, gluon_bwd

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (b, s, h, h_k, d, causal, gluon dK/dV): the Triton route (d = 64, GQA), the Gluon route at d = 128 / 256
CASES = [(2, 1000, 4, 2, 64, False, False), (2, 1000, 4, 2, 64, True, False),
         (2, 2048, 8, 8, 128, True, True), (4, 1024, 8, 8, 128, False, True), (2, 1024, 4, 4, 256, True, True)]


def _inputs(b, s, h, h_k, d):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s, h_k, d, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_(True) for t in (q, k, v)], do


def _grads(monkeypatch, pdl, case, deterministic=False):
    b, s, h, h_k, d, causal, gluon = case
    monkeypatch.setattr(attn_bwd, "BWD_PDL_OVERRIDE", pdl)
    monkeypatch.setattr(gluon_bwd, "OVERRIDE", gluon)
    (q, k, v), do = _inputs(b, s, h, h_k, d)
    out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    return torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("case", CASES)
def test_pdl_gradients_are_bitwise_the_ordinary_ones(monkeypatch, case):
    want = _grads(monkeypatch, False, case)
    got = _grads(monkeypatch, True, case)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_later_work_sees_dk_dv_complete(monkeypatch):
    # dK / dV come from the kernel the dQ kernel overlaps: a reduction queued right after the
    # backward must read their final values (the dQ programs wait for that kernel at their end)
    case = CASES[2]
    want = [g.float().sum() for g in _grads(monkeypatch, False, case)]
    for _ in range(5):
        got = [g.float().sum() for g in _grads(monkeypatch, True, case)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("case", [CASES[1], CASES[2]])
def test_pdl_inside_a_cuda_graph(monkeypatch, case):
    b, s, h, h_k, d, causal, gluon = case
    want = _grads(monkeypatch, False, case)
    monkeypatch.setattr(attn_bwd, "BWD_PDL_OVERRIDE", True)
    (q, k, v), do = _inputs(b, s, h, h_k, d)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def test_deterministic_runs_repeat(monkeypatch):
    runs = [_grads(monkeypatch, True, CASES[2], deterministic=True) for _ in range(10)]
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))
