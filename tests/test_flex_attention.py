"""flashtile.flex end to end on the CPU: the standard variants (causal, sliding window, prefix-LM, document
masking with captured ids, ALiBi and softcap as score_mods, a relative-position bias table that learns)
through the Triton kernels in the interpreter (fp32, fp16) and through the CPU path, forward and backward
(dq, dk, dv, and the bias table's gradient), against a float64 reference written from each variant's dense
definition (tests/flex_variants.py). Also GQA, return_lse, ragged lengths, errors, torch.compile."""

import pytest
import torch

from flashtile import config
from flashtile.flex import create_block_mask, flex_attention
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close

B, H, L, S, E = 2, 2, 37, 45, 16
NAMES = ["causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap", "rel_bias"]


def _inputs(dtype, h_kv=H, L_=L, S_=S):
    q = torch.randn(B, H, L_, E, dtype=dtype).requires_grad_()
    k = torch.randn(B, h_kv, S_, E, dtype=dtype).requires_grad_()
    v = torch.randn(B, h_kv, S_, E, dtype=dtype).requires_grad_()
    return q, k, v


def _run(name, dtype, interpret, h_kv=H):
    var = variants(B, H, L, S)
    meta = var["_meta"]
    score_mod, mask_mod, _, _, table = var[name]
    q, k, v = _inputs(dtype, h_kv)
    mask = create_block_mask(mask_mod, B if name == "document" else None, None, L, S, device="cpu",
                             BLOCK_SIZE=16) if mask_mod is not None else None
    with config.override(interpret=interpret):
        out = torch.full((1,), float("nan"))  # poisoned until the call returns
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=h_kv != H,
                                  return_lse=True)
        leaves = [q, k, v] + ([table] if table is not None else [])
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, g)
    ref, ref_lse = dense_reference(q, k, v, var[name], meta)
    pt, _ = dense_reference(q, k, v, var[name], meta, dtype=dtype)
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    pt_grads = torch.autograd.grad(pt, leaves, g)
    assert_fa_close(out, ref, pt)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref_lse[fin]).abs().max() < (2e-2 if dtype == torch.float16 else 1e-4)
    for gname, a, r, p in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, pt_grads):
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=gname)


@pytest.mark.parametrize("name", NAMES)
def test_variants_triton_fp32(name):
    _run(name, torch.float32, interpret=True)


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "rel_bias"])
def test_variants_triton_fp16(name):
    _run(name, torch.float16, interpret=True)


@pytest.mark.parametrize("name", NAMES)
def test_variants_cpu_path(name):
    _run(name, torch.float32, interpret=False)


@pytest.mark.parametrize("interpret", [True, False], ids=["triton", "cpu"])
def test_gqa(interpret):
    _run("alibi", torch.float32, interpret=interpret, h_kv=1)


def test_rows_that_see_nothing_get_zero_and_minus_inf_lse():
    q, k, v = _inputs(torch.float32)
    mask = create_block_mask(lambda b, h, qi, ki: qi < 5, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    for interpret in (True, False):
        with config.override(interpret=interpret):
            out, lse = flex_attention(q, k, v, block_mask=mask, return_lse=True)
        assert (out[:, :, 5:] == 0).all() and (lse[:, :, 5:] == float("-inf")).all()
        assert torch.isfinite(lse[:, :, :5]).all()


def test_no_mask_no_mod_is_plain_attention_and_scale_is_used():
    q, k, v = _inputs(torch.float32)
    with config.override(interpret=True):
        out = flex_attention(q, k, v, scale=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert (out - ref).abs().max() < 1e-5


def test_input_errors_name_the_argument():
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="query must be"):
        flex_attention(q[0], k, v)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L + 1, S, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="Q_LEN, KV_LEN"):
        flex_attention(q, k, v, block_mask=mask)


def test_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) through the custom op (CPU path), forward and backward."""
    var = variants(B, H, L, S, table_requires_grad=False)
    score_mod, mask_mod = var["alibi"][0], var["document"][1]
    mask = create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=16)
    q, k, v = _inputs(torch.float32)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)

    eager = fn(q, k, v)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert (compiled - eager).abs().max() < 1e-5
    g = torch.randn_like(eager)
    ge = torch.autograd.grad(eager, (q, k, v), g)
    gc = torch.autograd.grad(compiled, (q, k, v), g)
    for a, b in zip(ge, gc):
        assert (a - b).abs().max() < 1e-5


GLOBAL_TABLE = torch.randn(2 * S + 1, requires_grad=True)


def _global_bias(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_TABLE[q_idx - kv_idx + S]


class _HeadBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(H))

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[h]


def _learning_mods():
    """score_mods whose captured tensor learns, reached through a closure, a global and a module attribute."""
    var = variants(B, H, L, S)
    module = _HeadBias()
    return [("closure", var["rel_bias"][0], var["_meta"]["table"]), ("global", _global_bias, GLOBAL_TABLE),
            ("module", module.score_mod, module.bias)]


@pytest.mark.parametrize("case", range(3), ids=["closure", "global", "module"])
def test_compile_trains_captured_tensors(case):
    """Under torch.compile(fullgraph=True) a captured tensor that learns is a graph input: its gradient matches
    eager autograd's (the CPU op's backward differentiates the mod through it)."""
    _, score_mod, table = _learning_mods()[case]
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    q, k, v = _inputs(torch.float32)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)

    g = torch.randn(B, H, L, E)
    grads = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True, backend="aot_eager"))):
        table.grad = None
        out = f(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        out.backward(g)
        grads[name] = (out, dq, dk, dv, table.grad.clone())
    for a, b in zip(grads["eager"], grads["compiled"]):
        assert (a - b).abs().max() < 1e-5
    assert grads["compiled"][-1].abs().max() > 0


def test_compile_refuses_captured_tensors_it_cannot_reach():
    tables = [torch.randn(2 * S + 1, requires_grad=True)]  # inside a list: read, but not at a path it follows

    def listed(score, b, h, q_idx, kv_idx):
        return score + tables[0][q_idx - kv_idx + S]

    q, k, v = _inputs(torch.float32)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=listed), fullgraph=True,
                       backend="aot_eager")
    with pytest.raises(Exception, match="closure, its module's globals"):
        fn(q, k, v)


def test_docs_programmable_examples_run():
    """docs/programmable.md's code blocks run as written, in one namespace (later blocks reuse earlier names)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "programmable.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 6
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/programmable.md block {i}", "exec"), namespace)
