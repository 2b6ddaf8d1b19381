"""GPU tests of the backward with programmatic dependent launch (attn_bwd.use_bwd_pdl, config.bwd_pdl).

The dQ kernel starts while the dK/dV kernel drains and waits for it only at its end. Gradients must
be bitwise those of ordinary launches, eager and inside a CUDA graph, on the Triton and the Gluon
dK/dV routes, and work queued after the backward must see dK and dV complete.
"""

import pytest
import torch

import flashtile
from attn_cases import check_padded, check_varlen
from flashtile import config

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


def _grads(pdl, case, deterministic=False):
    b, s, h, h_k, d, causal, gluon = case
    (q, k, v), do = _inputs(b, s, h, h_k, d)
    with config.override(bwd_pdl=pdl, gluon_bwd=gluon):
        out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("case", CASES)
def test_pdl_gradients_are_bitwise_the_ordinary_ones(case):
    want = _grads(False, case)
    got = _grads(True, case)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_later_work_sees_dk_dv_complete():
    # one long dK/dV program (128 keys against 16384 queries, one head) and many short dQ programs:
    # without the dQ grid's end-wait it would finish long before the dK/dV kernel, and a reduction
    # queued right after the backward (no sync in between) would read unfinished dK / dV
    from flashtile.backends.triton import fast_launch

    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(1, 16384, 1, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k, v = (torch.randn(1, 128, 1, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
            for _ in range(2))
    do = torch.randn(1, 16384, 1, 64, device=DEV, dtype=torch.bfloat16, generator=g)

    def sums(pdl):
        with config.override(bwd_pdl=pdl, gluon_bwd=False):
            grads = torch.autograd.grad(flashtile.flash_attn_func(q, k, v), (q, k, v), do)
            return torch.stack([x.float().sum() for x in grads])  # queued behind the backward

    want = sums(False)
    got = [sums(True) for _ in range(20)]
    assert all(torch.equal(x, want) for x in got)
    if config.get().fast_launch and fast_launch.AVAILABLE:  # the dQ kernel really went out with PDL
        pdl_kernels = [hit[0].name for hit in fast_launch._COMPILED.values()
                       if getattr(hit[0].metadata, "launch_pdl", False)]
        assert any("dq" in name for name in pdl_kernels), pdl_kernels


@pytest.mark.parametrize("case", [CASES[1], CASES[2]])
def test_pdl_inside_a_cuda_graph(case):
    b, s, h, h_k, d, causal, gluon = case
    want = _grads(False, case)
    (q, k, v), do = _inputs(b, s, h, h_k, d)
    with config.override(bwd_pdl=True, gluon_bwd=gluon):
        grads = _graph_grads(q, k, v, do, causal)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)


def _graph_grads(q, k, v, do, causal):
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
    return grads


def test_deterministic_runs_repeat():
    runs = [_grads(True, CASES[2], deterministic=True) for _ in range(10)]
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


FEATURES = [dict(dropout_p=0.15), dict(window_size=(100, 20)), dict(softcap=20.0, causal=True), dict(alibi="h")]


@pytest.mark.parametrize("feature", range(len(FEATURES)))
def test_pdl_with_features_against_the_reference(feature):
    # the Triton route's other builds (dropout, windows, softcap, ALiBi) with both flags, checked by
    # FlashAttention's tolerance rule against the reference
    with config.override(bwd_pdl=True, gluon_bwd=False):
        check_padded(2, 300, 500, 4, 2, 64, torch.bfloat16, device=DEV, **FEATURES[feature])


def test_pdl_varlen_against_the_reference():
    with config.override(bwd_pdl=True):
        check_varlen([1, 300, 0, 700, 77], [5, 300, 17, 900, 0], 8, 2, 128, torch.bfloat16, device=DEV, causal=True)
