"""torch.compile and CUDA graphs on the GPU: a training step (forward + backward) captured or
compiled gives the eager step's results.
"""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import flashtile
from attn_cases import keep_mask_from_probs
from flashtile.backends.reference import attention_ref

pytestmark = pytest.mark.gpu


class _Block(torch.nn.Module):
    """Pre-norm attention block over packed qkv (the shape of most training code)."""

    def __init__(self, dim=256, heads=4, dropout_p=0.0):
        super().__init__()
        self.heads, self.dropout_p = heads, dropout_p
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, 3, self.heads, dim // self.heads)
        y = flashtile.flash_attn_qkvpacked_func(qkv, dropout_p=self.dropout_p, causal=True)
        return x + self.out(y.reshape(b, s, dim))


def _model(dtype, **kw):
    torch.manual_seed(0)
    return _Block(**kw).to("cuda", dtype)


def _step(model, x):
    """One training step's numbers: the loss and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _assert_same_step(got, want, tol):
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_training_step_matches_eager(dtype):
    torch._dynamo.reset()
    model = _model(dtype)
    compiled = torch.compile(model, fullgraph=True)
    for s in (128, 200):  # two lengths: the second may recompile (dynamic), never graph-break
        x = torch.randn(2, s, 256, device="cuda", dtype=dtype)
        _assert_same_step(_step(compiled, x), _step(model, x), tol=2e-2)


def test_reduce_overhead_cudagraph_trees_training_step():
    torch._dynamo.reset()
    model = _model(torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, then replays
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        loss, grads = _step(compiled, x)
        got = (loss.clone(), grads)  # cudagraph outputs are overwritten by the next replay
        _assert_same_step(got, _step(model, x), tol=2e-2)


def test_manual_cuda_graph_capture_of_training_step():
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)  # eager twin: the captured model's grads must stay untouched
    static_x = torch.randn(2, 160, 256, device="cuda", dtype=torch.bfloat16)
    # warm up on a side stream (kernel compilation, allocator) before capture, as torch's docs do
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _step(model, static_x)
    torch.cuda.current_stream().wait_stream(side)

    model.zero_grad(set_to_none=True)  # the captured backward allocates the grads in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = model(static_x).float().square().mean()
        static_loss.backward()
    static_grads = [p.grad for p in model.parameters()]

    for _ in range(3):  # replay on fresh data: results must follow the data, as eager does
        x = torch.randn_like(static_x)
        static_x.copy_(x)
        graph.replay()
        got = (static_loss.detach().clone(), [g.detach().clone() for g in static_grads])
        _assert_same_step(got, _step(ref_model, x), tol=1e-2)


def test_compiled_dropout_on_cuda_masks_fresh_and_backward_consistent():
    torch._dynamo.reset()

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)

    cfn = torch.compile(fn, fullgraph=True)
    q, k, v = (torch.randn(2, 96, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out, _, s_dmask = cfn(q, k, v)
    _, _, s_dmask2 = cfn(q, k, v)
    keep = keep_mask_from_probs(s_dmask)
    assert not torch.equal(keep, keep_mask_from_probs(s_dmask2))
    ref, _ = attention_ref(q, k, v, dropout_p=0.2, dropout_mask=keep, causal=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


def test_dropout_inside_manual_capture_is_refused():
    # in a subprocess: a failed capture can leave the CUDA context unusable for later tests
    code = textwrap.dedent("""
        import torch, flashtile
        q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        flashtile.flash_attn_func(q, k, v, dropout_p=0.1)  # warm-up
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            flashtile.flash_attn_func(q, k, v, dropout_p=0.1)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "CUDA graph capture" in res.stderr or "capturing" in res.stderr.lower(), res.stderr[-2000:]
