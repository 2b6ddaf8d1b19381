"""torch.compile on the CPU: fullgraph (no graph breaks) forward + backward, compiled == eager.

Most tests use the "aot_eager" backend: it runs dynamo and AOT autograd (the parts that must see
flashtile's ops, their fake impls and autograd formula) without inductor's C++ codegen, which
takes ~20 s per graph on a small CPU box. One test runs inductor end to end.
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import flashtile
from attn_cases import keep_mask_from_probs
from flashtile.backends.reference import attention_ref


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


# Each case: (build inputs, function of those inputs). Inputs that need grads are the tensors.
_SLOPES = torch.rand(4) * 0.3


def _padded(b=2, sq=9, sk=11, h=4, h_k=2, d=16):
    return [torch.randn(b, sq, h, d), torch.randn(b, sk, h_k, d), torch.randn(b, sk, h_k, d)]


CASES = {
    "func": (lambda: _padded(),
             lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(5, -1))),
    "qkvpacked": (lambda: [torch.randn(2, 10, 3, 4, 16)],
                  lambda qkv: flashtile.flash_attn_qkvpacked_func(qkv, causal=True, softcap=3.0)),
    "kvpacked": (lambda: [torch.randn(2, 7, 4, 16), torch.randn(2, 12, 2, 2, 16)],
                 lambda q, kv: flashtile.flash_attn_kvpacked_func(q, kv, alibi_slopes=_SLOPES)),
    "varlen": (lambda: [torch.randn(12, 4, 16), torch.randn(15, 2, 16), torch.randn(15, 2, 16)],
               lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, _cu([5, 7]), _cu([9, 6]), 7, 9,
                                                                causal=True)),
    "varlen_qkvpacked": (lambda: [torch.randn(12, 3, 4, 16)],
                         lambda qkv: flashtile.flash_attn_varlen_qkvpacked_func(qkv, _cu([5, 7]), 7)),
    "varlen_kvpacked": (lambda: [torch.randn(12, 4, 16), torch.randn(15, 2, 2, 16)],
                        lambda q, kv: flashtile.flash_attn_varlen_kvpacked_func(q, kv, _cu([5, 7]), _cu([9, 6]),
                                                                                7, 9, window_size=(3, 3))),
    # FlashAttention-3 / CuTe features: v's own head dim, a learnable sink (a differentiable input) and a chunk
    "sink_chunk_dv": (lambda: [*_padded()[:2], torch.randn(2, 11, 2, 24), torch.randn(4)],
                      lambda q, k, v, sink: flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=4,
                                                                      learnable_sink=sink)),
    "varlen_sink": (lambda: [torch.randn(12, 4, 16), torch.randn(15, 2, 16), torch.randn(15, 2, 16), torch.randn(4)],
                    lambda q, k, v, sink: flashtile.flash_attn_varlen_func(q, k, v, _cu([5, 7]), _cu([9, 6]), 7, 9,
                                                                           learnable_sink=sink, attention_chunk=3)),
}


def _fwd_bwd(fn, inputs, g=None, dynamic_dim=None):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    if dynamic_dim is not None:
        for x in xs:
            torch._dynamo.mark_dynamic(x, dynamic_dim)
    out = fn(*xs)
    g = torch.randn_like(out) if g is None else g
    out.backward(g)
    return out.detach(), [x.grad for x in xs], g


@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_forward_backward_equals_eager(name):
    make, fn = CASES[name]
    inputs = make()
    want, want_grads, g = _fwd_bwd(fn, inputs)
    got, got_grads, _ = _fwd_bwd(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, g)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same op runs: bit-identical
    for a, b in zip(got_grads, want_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_explain_reports_no_graph_breaks():
    make, fn = CASES["func"]
    q, k, v = (x.requires_grad_() for x in make())

    def step(q, k, v):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out.float().square().mean() + lse.mean().detach()

    explanation = torch._dynamo.explain(step)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def _ops_in(graph_module):
    return {str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"}


def test_packed_backward_graph_has_no_concatenation():
    """The packed gradient comes straight out of flashtile::attn_bwd: no stack/cat/copy in the graph."""
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    qkv = torch.randn(2, 9, 3, 4, 16, requires_grad=True)
    fn = torch.compile(lambda x: flashtile.flash_attn_qkvpacked_func(x, causal=True), backend=backend,
                       fullgraph=True)
    fn(qkv).sum().backward()
    assert qkv.grad.shape == qkv.shape
    fw, bw = _ops_in(graphs["fw"]), _ops_in(graphs["bw"])
    assert "flashtile.attn_fwd.default" in fw and "flashtile.attn_bwd.default" in bw
    assert not [op for op in fw | bw if any(w in op for w in ("cat", "stack", "copy", "unbind"))], (fw, bw)


def test_dynamic_seqlen_mark_dynamic_no_recompile():
    cnt = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    for i, s in enumerate((9, 16, 23)):
        inputs = _padded(sq=s, sk=s + 3)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, got_grads, g = _fwd_bwd(cfn, inputs, dynamic_dim=1)
        want, want_grads, _ = _fwd_bwd(fn, inputs, g)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_varlen_dynamic_true_total_batch_and_max_seqlen_vary():
    def fn(q, k, v, cu, max_s):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, causal=True)

    cfn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, lens in enumerate(([3, 6], [5, 7, 2], [8, 9, 10, 4])):
        t = sum(lens)
        inputs = [torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)]
        extra = (_cu(lens), max(lens))
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, got_grads, g = _fwd_bwd(lambda q, k, v, e=extra: cfn(q, k, v, *e), inputs)
        want, want_grads, _ = _fwd_bwd(lambda q, k, v, e=extra: fn(q, k, v, *e), inputs, g)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_dropout_under_compile_draws_fresh_masks_and_backward_replays_them():
    cnt = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, dropout_p=0.25, return_attn_probs=True)

    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    q, k, v = (x.requires_grad_() for x in _padded(sq=20, sk=24))
    out, lse, s_dmask = cfn(q, k, v)
    _, _, s_dmask2 = cfn(q, k, v)
    assert cnt.frame_count == 1
    # the seed is drawn inside the graph (a traced randint), not burnt in as a constant
    assert any("randint" in str(n.target) for n in cnt.graphs[0].graph.nodes)
    keep, keep2 = keep_mask_from_probs(s_dmask), keep_mask_from_probs(s_dmask2)
    assert not torch.equal(keep, keep2)
    assert abs(keep.float().mean().item() - 0.75) < 0.05
    assert not lse.requires_grad and not s_dmask.requires_grad
    ref, _ = attention_ref(q, k, v, dropout_p=0.25, dropout_mask=keep)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_autograd_function_apply_traces_fullgraph():
    """Third-party code calling FlashAttention's Function classes directly also compiles."""
    from flashtile.flash_attn_interface import FlashAttnFunc, FlashAttnQKVPackedFunc

    def fn(q, k, v):
        a = FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False, True)
        qkv = torch.stack([q, k, v], dim=2)
        b = FlashAttnQKVPackedFunc.apply(qkv, 0.0, 0.5, False, (-1, -1), 0.0, None, False, False, True)
        return a + b

    inputs = _padded(sk=9, h_k=4)
    want, want_grads, g = _fwd_bwd(fn, inputs)
    got, got_grads, _ = _fwd_bwd(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, g)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_opcheck_fake_impls_and_autograd_registration():
    """torch.library.opcheck: schema, fake (meta) shapes/dtypes vs the real op, autograd, AOT dispatch."""
    ops = torch.ops.flashtile
    q, k, v = (x.requires_grad_() for x in _padded())
    cu_q, cu_k = _cu([4, 5]), _cu([6, 5])
    qv, kv_, vv = torch.randn(9, 4, 16), torch.randn(11, 2, 16), torch.randn(11, 2, 16)
    rng = torch.tensor([1234, 5], dtype=torch.int64)
    tail = (0.0, 0.25, True, -1, 0, 0.0, False)  # dropout_p, scale, causal, left, right, softcap, deterministic
    fwd_cases = [
        (q, k, v, None, None, None, None, None, None, 9, 11, *tail, False, 0),
        (q, k, v, None, None, None, None, None, rng, 9, 11, 0.2, 0.25, False, -1, -1, 0.0, False, True, 0),
        (qv, kv_, vv, cu_q, cu_k, None, None, None, rng, 5, 6, 0.2, 0.25, False, 2, -1, 0.0, False, True, 0),
        (torch.randn(2, 9, 3, 4, 16, requires_grad=True), None, None, None, None, None, None, None, None, 9, 9,
         *tail, True, 2),
    ]
    for args in fwd_cases:
        torch.library.opcheck(ops.attn_fwd.default, args)
    out, lse, _ = ops.attn_fwd(*fwd_cases[0])
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.attn_bwd.default, (dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                                 lse, None, None, None, None, None, None, 9, 11, *tail, 0))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(ops.attn_bwd_into.default, (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                      dq, dk, dv, None, None, None, None, None, None, 9, 11, *tail))


class _Block(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads)
        y = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
        return x + self.out(y.reshape(b, s, dim))


def test_inductor_model_forward_backward_matches_eager():
    model = _Block()
    x = torch.randn(2, 13, 32)
    compiled = torch.compile(model, fullgraph=True)  # inductor
    y = compiled(x)
    y.square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().mean().backward()
    torch.testing.assert_close(y, y_eager, atol=1e-5, rtol=1e-5)
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-5)
