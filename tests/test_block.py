"""Block (pre-norm / post-norm), Mlp and GatedMlp against the same math written out in PyTorch."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from flashtile.modules.block import Block
from flashtile.modules.mha import MHA
from flashtile.modules.mlp import GatedMlp, Mlp


def test_mlp_and_gated():
    x = torch.randn(2, 5, 16)
    m = Mlp(16, 40, out_features=8)
    torch.testing.assert_close(m(x), m.fc2(F.gelu(m.fc1(x))))
    g = GatedMlp(16)
    assert g.fc2.in_features == 128  # int(8 * 16 / 3) = 42, rounded up to a multiple of 128
    value, gate = g.fc1(x).chunk(2, -1)
    torch.testing.assert_close(g(x), g.fc2(F.silu(gate) * value))
    y, res = Mlp(16, return_residual=True)(x)
    assert res is x and y.shape == x.shape


def _block(prenorm, **kw):
    return Block(32, mixer_cls=partial(MHA, num_heads=4, causal=True, rotary_emb_dim=8),
                 mlp_cls=partial(GatedMlp, hidden_features=64), prenorm=prenorm, **kw).eval()


def test_prenorm():
    blk = _block(True)
    x, res = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        hidden, residual = blk(x, res)
        r1 = x + res
        h1 = blk.mixer(blk.norm1(r1))
        r2 = h1 + r1
        torch.testing.assert_close(residual, r2)
        torch.testing.assert_close(hidden, blk.mlp(blk.norm2(r2)))
        hidden0, residual0 = blk(x)  # first block: no incoming residual
        torch.testing.assert_close(residual0, blk.mixer(blk.norm1(x)) + x)


def test_postnorm():
    blk = _block(False)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        h = blk.norm1(blk.mixer(x) + x)
        torch.testing.assert_close(blk(x), blk.norm2(blk.mlp(h) + h))


def test_residual_in_fp32_and_mixer_kwargs():
    blk = _block(True, residual_in_fp32=True).to(torch.bfloat16)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    with torch.no_grad():
        hidden, residual = blk(x, mixer_kwargs={"key_padding_mask": mask})
    assert residual.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="pre-norm"):
        _block(False, residual_in_fp32=True)


def test_dropout_and_backward():
    blk = _block(True, resid_dropout1=0.1, resid_dropout2=0.1).train()
    x = torch.randn(2, 7, 32, requires_grad=True)
    hidden, residual = blk(x)
    (hidden.sum() + residual.sum()).backward()
    assert x.grad is not None and all(p.grad is not None for p in blk.parameters())


def test_default_constructor():
    blk = Block(128)
    assert blk.mixer.num_heads == 2 and blk.mlp.fc1.out_features == 512
    hidden, _ = blk(torch.randn(1, 3, 128))
    assert hidden.shape == (1, 3, 128)


def test_docs_layers_examples_run():
    """docs/layers.md's code blocks run as written (training + generation share one namespace)."""
    import importlib.util
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "layers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 4
    exec(compile(blocks[0], "layers.md#rotary", "exec"), {})
    ns = {}
    exec(compile(blocks[1], "layers.md#training", "exec"), ns)
    exec(compile(blocks[2], "layers.md#generation", "exec"), ns)
    if importlib.util.find_spec("transformers") is not None:
        exec(compile(blocks[3], "layers.md#transformers", "exec"), {})


class _Linear(torch.nn.Module):
    """A tiny mixer: a linear map (returns (out, input) with return_residual, like FlashAttention's MHA)."""

    def __init__(self, dim, return_residual=False, **kw):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim, **kw)
        self.return_residual = return_residual

    def forward(self, x, **kw):
        y = self.lin(x)
        return (y, x) if self.return_residual else y


def test_identity_mlp_skips_second_sublayer():
    """FlashAttention's Block with mlp_cls=nn.Identity creates no dropout2/norm2 and skips the second add."""
    x, res = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    blk = Block(8, mixer_cls=_Linear, mlp_cls=torch.nn.Identity)
    assert not hasattr(blk, "norm2") and not hasattr(blk, "dropout2") and not hasattr(blk, "drop_path2")
    hidden, residual = blk(x, res)
    torch.testing.assert_close(residual, x + res)
    torch.testing.assert_close(hidden, blk.mixer(blk.norm1(x + res)))
    post = Block(8, mixer_cls=_Linear, mlp_cls=torch.nn.Identity, prenorm=False)
    torch.testing.assert_close(post(x), post.norm1(post.mixer(x) + x))


def test_flash_attn_keywords_and_order():
    """FlashAttention 2.8.3's positional order, drop_path, return_residual, and the unsupported flags."""
    blk = Block(8, _Linear, partial(Mlp, hidden_features=16), torch.nn.LayerNorm, torch.nn.Dropout, True, 0.0, 0.0,
                0.5, 0.5, False, False, False, False, True)
    assert blk.drop_path1.p == 0.5 and blk.drop_path2.p == 0.5
    assert all(getattr(p, "_shared_params", False) for p in (*blk.norm1.parameters(), *blk.norm2.parameters()))
    # stochastic depth: per sample, training only
    sd = Block(8, _Linear, torch.nn.Identity, drop_path1=0.5)  # Identity mlp: residual = drop_path1(x) + res
    x, res = torch.randn(64, 3, 8), torch.randn(64, 3, 8)
    with torch.no_grad():
        sd.eval()
        _, r_eval = sd(x, res)
        torch.testing.assert_close(r_eval, x + res)
        sd.train()
        torch.manual_seed(0)
        _, r_train = sd(x, res)  # residual = drop_path1(x) + res: each sample adds 0 or 2x
    dropped = torch.isclose(r_train, res).flatten(1).all(1)
    kept = torch.isclose(r_train, 2 * x + res, atol=1e-5).flatten(1).all(1)
    assert bool((dropped | kept).all()) and 0 < int(dropped.sum()) < 64
    # post-norm with return_residual: sub-layers return (out, input) pairs
    post = Block(8, partial(_Linear, return_residual=True), partial(Mlp, hidden_features=16, return_residual=True),
                 prenorm=False, return_residual=True)
    h = post.norm1(post.mixer.lin(x) + x)
    torch.testing.assert_close(post(x), post.norm2(post.mlp.fc2(F.gelu(post.mlp.fc1(h))) + h))
    with pytest.raises(NotImplementedError, match="fused_dropout_add_ln"):
        Block(8, _Linear, fused_dropout_add_ln=True)
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        Block(8, _Linear, sequence_parallel=True)
    # device / dtype are keyword-only: they never take FlashAttention's positional slots
    blk64 = Block(8, _Linear, dtype=torch.float64)
    assert blk64.norm1.weight.dtype == torch.float64 and blk64.mixer.lin.weight.dtype == torch.float64
