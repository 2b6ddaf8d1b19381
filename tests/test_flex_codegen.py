"""Codegen of flashtile.flex mods: every supported operation, forward and gradient, run through Triton's
interpreter on a 16 x 16 tile and compared with the mod itself evaluated by PyTorch (gradients by autograd);
unsupported operations are refused with errors that name them; generated sources are cached."""

import math

import pytest
import torch
import triton
import triton.language as tl

from flashtile.backends.triton.flex import modules
from flashtile.backends.triton.flex.trace import ModCompileError, trace
from flashtile.flex import registry

N = 16


@triton.jit
def _apply_kernel(SCORE, OUT, DSCORE, BUFS, GRADS, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                  N: tl.constexpr):
    # b = 1, h = 2; q_idx / kv_idx = the tile's row / column; grad of the output = 1 everywhere
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    s = tl.load(SCORE + rows * N + cols)
    tl.store(OUT + rows * N + cols, SCORE_MOD(s, 1, 2, rows, cols, BUFS))
    valid = (rows >= 0) & (cols >= 0)
    tl.store(DSCORE + rows * N + cols, SCORE_GRAD(s, 1, 2, rows, cols, s * 0.0 + 1.0, valid, BUFS, GRADS, True))


def _check(mod, bufs=(), grad_bufs=(), score=None, atol=1e-5):
    """Run mod's generated helpers on a tile; compare value, d/dscore and the captured tensors' gradients."""
    score = torch.randn(N, N) if score is None else score
    graph = trace(mod, "score")
    grad_idx = tuple(i for i, b in enumerate(graph.buffers) if any(b is t for t in grad_bufs))
    _, module = modules.load(modules.source_of(graph, None, grad_idx))
    out, dscore = torch.empty(N, N), torch.empty(N, N)
    grads = tuple(torch.zeros(graph.buffers[i].shape) for i in grad_idx)
    kb = tuple(graph.buffers) or (torch.empty(1),)
    _apply_kernel[(1,)](score, out, dscore, kb, grads or kb, module.score_mod, module.score_grad, N)
    s = score.clone().requires_grad_()
    q = torch.arange(N, dtype=torch.int32)[:, None]
    kv = torch.arange(N, dtype=torch.int32)[None, :]
    ref = mod(s, torch.tensor(1, dtype=torch.int32), torch.tensor(2, dtype=torch.int32), q, kv).expand(N, N)
    traced_grad_bufs = [graph.buffers[i] for i in grad_idx]  # in the kernel's order
    ref_grads = torch.autograd.grad(ref.sum(), [s, *traced_grad_bufs], allow_unused=True)
    torch.testing.assert_close(out, ref.detach().float(), atol=atol, rtol=1e-5)
    gs = ref_grads[0] if ref_grads[0] is not None else torch.zeros(N, N)
    torch.testing.assert_close(dscore, gs, atol=atol, rtol=1e-5)
    for got, want in zip(grads, ref_grads[1:]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


POS = torch.rand(N, N) + 0.5  # a positive score for log / sqrt / pow

UNARY = {
    "neg": lambda s: -s, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos, "relu": torch.relu,
    "floor": torch.floor, "ceil": torch.ceil, "sign": torch.sign, "trunc": torch.trunc,
}
POSITIVE = {"log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
            "reciprocal": torch.reciprocal, "pow_2": lambda s: s ** 2, "pow_1.5": lambda s: s ** 1.5,
            "pow_0.5": lambda s: s ** 0.5}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name):
    fn = UNARY[name]
    _check(lambda s, b, h, q, kv: fn(s))


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_unary_on_positive_scores(name):
    fn = POSITIVE[name]
    _check(lambda s, b, h, q, kv: fn(s), score=POS.clone())


BINARY = {
    "add": lambda s, q, kv: s + q - 2 * kv, "sub": lambda s, q, kv: s - (q - kv), "mul": lambda s, q, kv: s * s * q,
    "div": lambda s, q, kv: s / (kv + 1) + q / (kv + 2), "rsub": lambda s, q, kv: 1.5 - s,
    "minimum": lambda s, q, kv: torch.minimum(s, s.new_zeros(()) + 0.1) + torch.minimum(q, kv),
    "maximum": lambda s, q, kv: torch.maximum(s, (q - kv).float() * 0.1),
    "clamp": lambda s, q, kv: s.clamp(-0.5, 0.7) + s.clamp(min=0.1) + s.clamp(max=-0.2),
    "where": lambda s, q, kv: torch.where(q > kv, s * 2, -s),
    "remainder_int": lambda s, q, kv: s + ((q - kv) % 5).float() + torch.remainder(q - 9, 4),
    "floor_divide_int": lambda s, q, kv: s + ((q - kv - 3) // 4).float(),
    "div_floor_float": lambda s, q, kv: s + torch.div(s, 0.3, rounding_mode="floor"),
    "div_trunc_int": lambda s, q, kv: s + torch.div(q - kv, 3, rounding_mode="trunc"),
    "remainder_float": lambda s, q, kv: torch.remainder(s, 0.7),
    "compare_logic": lambda s, q, kv: torch.where(((q >= kv) & (q != 3)) | ((kv < 2) ^ (q <= 1)) & ~(q == kv + 5),
                                                  s, s - 1.0),
    "logical": lambda s, q, kv: torch.where(torch.logical_and(q > 2, torch.logical_not(kv > 9))
                                            | torch.logical_or(q == 0, kv == 0), s, 0.0),
    "casts": lambda s, q, kv: s + (q * kv).to(torch.float16).float() + (s > 0).float() + (s * 3).int().float(),
    "int64": lambda s, q, kv: s + (q.long() * 3 - kv.long()).float(),
    "constant": lambda s, q, kv: s * 0 + torch.full_like(s, 2.0) + torch.ones_like(s),
    "scalar_tensor": lambda s, q, kv: torch.where(q >= kv, s, torch.tensor(float("-inf"))),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_and_logic(name):
    fn = BINARY[name]
    _check(lambda s, b, h, q, kv: fn(s, q, kv))


def test_b_and_h_reach_the_mod():
    _check(lambda s, b, h, q, kv: s * (b + 1) + h * 0.5)


def test_captured_tables_load_and_get_gradients():
    bias = torch.randn(2 * N, requires_grad=True)
    per_head = torch.randn(4, requires_grad=True)
    grid = torch.randn(3, N, N, requires_grad=True)
    scale0 = torch.tensor(0.7, requires_grad=True)
    ids = torch.randint(0, 3, (N,), dtype=torch.int64)

    def mod(s, b, h, q, kv):
        same = ids[q] == ids[kv]
        return (s * per_head[h] + bias[q - kv + N] * scale0 + grid[h, q, kv] * torch.tanh(s)
                + torch.where(same, 1.0, 0.0))

    _check(mod, grad_bufs=(bias, per_head, grid, scale0), atol=2e-5)


def test_bool_and_half_tables():
    allowed = torch.rand(N, N) > 0.5
    half = torch.randn(N).half()
    _check(lambda s, b, h, q, kv: torch.where(allowed[q, kv], s, -s) + half[kv].float())


@pytest.mark.parametrize("mod, op", [
    (lambda s, b, h, q, kv: torch.erf(s), "erf"),
    (lambda s, b, h, q, kv: s.sum() + s, "sum"),
    (lambda s, b, h, q, kv: s.cumsum(0), "cumsum"),
    (lambda s, b, h, q, kv: s if s[0] > 0 else -s, "cannot be traced"),
    (lambda s, b, h, q, kv: q >= kv, "floating-point"),
])
def test_unsupported_operations_are_named(mod, op):
    with pytest.raises(ModCompileError, match=op):
        trace(mod, "score")


def test_mask_must_be_bool_and_tables_must_be_indexed():
    with pytest.raises(ModCompileError, match="bool"):
        trace(lambda b, h, q, kv: q - kv, "mask")
    table = torch.randn(1)  # broadcasts, so tracing runs; the kernel still refuses a tensor used whole
    with pytest.raises(ModCompileError, match="used whole"):
        trace(lambda s, b, h, q, kv: s + table, "score")
    grid = torch.randn(4, 4)
    with pytest.raises(ModCompileError, match="shape"):
        trace(lambda s, b, h, q, kv: s + grid[:, q].sum(0), "score")


def test_second_call_with_the_same_mod_does_not_regenerate():
    slope = math.pi / 10

    def alibi_like(s, b, h, q, kv):
        return s - slope * (q - kv).abs()

    before_traced = registry.stats["traced"]
    e1 = registry.entry_for(alibi_like, None)
    k1 = e1.kernels()
    gen = modules.stats["generated"]
    e2 = registry.entry_for(alibi_like, None)
    assert e2 is e1 and e2.kernels() is k1
    assert registry.stats["traced"] == before_traced + 1 and modules.stats["generated"] == gen
    # a new function object with the same graph shares the generated module
    e3 = registry.entry_for(lambda s, b, h, q, kv: s - slope * (q - kv).abs(), None)
    assert e3.kernels().module is k1.module and modules.stats["generated"] == gen


def test_mods_trace_on_the_device_of_their_captured_tensors():
    # a CUDA call's mod indexes a CUDA table; "meta" stands in for it on CPU: traced with indices on the
    # call's device the graph builds, with CPU indices tracing fails (as it did on the GPU before)

    table = torch.zeros(16, device="meta")

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + 8]

    assert len(trace(bias, "score", device="meta").buffers) == 1
    with pytest.raises(ModCompileError, match="device"):
        trace(bias, "score")
