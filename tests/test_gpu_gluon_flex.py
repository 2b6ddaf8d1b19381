"""The Gluon flex forward (kernels/gluon_flex_fwd.py) on a Hopper GPU: every standard variant against the float64
dense reference (FlashAttention's 2x-error rule) and against the Triton flex forward, with ragged lengths, GQA,
fp16, query blocks and rows that see no key; and that the route takes exactly the calls it claims."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton.flex import gluon_launch
from flashtile.flex import create_block_mask, flex_attention
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close

pytestmark = pytest.mark.gpu

DEV = "cuda"
NAMES = ["causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap", "rel_bias"]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon flex forward runs on sm_90")


def _count(monkeypatch, launcher: str) -> list:
    """A list that grows by one on every call of gluon_launch's ``launcher``."""
    seen = []
    real = getattr(gluon_launch, launcher)

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_launch, launcher, counted)
    return seen


@pytest.fixture
def calls(monkeypatch):
    """How many launches went to the Gluon forward."""
    return _count(monkeypatch, "gluon_flex_fwd")


def _check(var, meta, B, H, L, S, d, h_kv, dtype, block, calls):
    score_mod, mask_mod = var[:2]
    q = torch.randn(B, H, L, d, device=DEV, dtype=dtype)
    k, v = (torch.randn(B, h_kv, S, d, device=DEV, dtype=dtype) for _ in range(2))
    mask = create_block_mask(mask_mod, B, None, L, S, device=DEV, BLOCK_SIZE=block) if mask_mod else None
    args = dict(score_mod=score_mod, block_mask=mask, enable_gqa=h_kv != H, return_lse=True)
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, **args)
        assert len(calls) == 1, "the call did not take the Gluon route"
        with config.override(gluon_flex=False):
            t_out, t_lse = flex_attention(q, k, v, **args)
        assert len(calls) == 1
        ref, ref_lse = dense_reference(q, k, v, var, meta)
        pt, _ = dense_reference(q, k, v, var, meta, dtype=dtype)
    assert_fa_close(out, ref, pt)
    empty = torch.isinf(ref_lse)
    # FlexAttention's convention, which flashtile.flex returns: -inf on a row that sees no key
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all(), "rows that see no key: lse -inf"
    assert (out[empty] == 0).all(), "rows that see no key: out 0"
    err = (lse - ref_lse.float())[~empty].abs().max().item() if (~empty).any() else 0.0
    assert err <= 2e-3, f"lse: max err {err:.3e}"
    # the Triton kernel's result to the rounding of the summation order
    assert (out.float() - t_out.float()).abs().max().item() <= 2 * (t_out.double() - ref).abs().max().item() + 1e-3
    assert torch.equal(torch.isinf(t_lse), torch.isinf(lse))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("L, S, d", [(1024, 1024, 128), (1000, 1000, 128), (512, 777, 128), (2048, 2048, 128)])
def test_variants(name, L, S, d, calls):
    var = variants(2, 4, L, S, device=DEV, window=256, prefix=L // 4, docs=(0, L // 3, L // 2))
    _check(var[name], var["_meta"], 2, 4, L, S, d, 4, torch.bfloat16, 128, calls)


@pytest.mark.parametrize("name", ["causal", "alibi", "document", "softcap"])
def test_gqa_and_fp16(name, calls):
    var = variants(1, 8, 1024, 1024, device=DEV, window=256, prefix=256, docs=(0, 300, 700))
    _check(var[name], var["_meta"], 1, 8, 1024, 1024, 128, 2, torch.float16, 128, calls)


def test_blocks_and_rows_that_see_no_key(calls):
    # rows below 300 see nothing: query blocks 0 and 1 list no key block (the early exit), block 2 has empty rows
    L = S = 1024
    q_pos, kv_pos = torch.arange(L, device=DEV)[:, None], torch.arange(S, device=DEV)[None, :]

    def late(b, h, q_idx, kv_idx):
        return (q_idx >= 300) & (kv_idx <= q_idx)

    keep = ((q_pos >= 300) & (kv_pos <= q_pos)).expand(1, 4, L, S)
    var = (None, late, None, keep, None)
    _check(var, dict(q=q_pos, kv=kv_pos, S=S), 1, 4, L, S, 128, 4, torch.bfloat16, 128, calls)


def test_sparse_blocks_of_256_keys(calls):
    # 256-key sparse blocks walk as several 64-key tiles each, across both lists
    var = variants(1, 4, 2048, 2048, device=DEV, window=300, prefix=512, docs=(0, 700, 1500))
    for name in ("sliding_window", "prefix_lm"):
        calls.clear()
        _check(var[name], var["_meta"], 1, 4, 2048, 2048, 128, 4, torch.bfloat16, 256, calls)


def test_route_refusals():
    q = torch.randn(1, 2, 256, 128, device=DEV, dtype=torch.bfloat16)
    assert gluon_launch.wanted(q, q, q, (128, 128), (0, 0, 0, 0), 0.1)
    assert not gluon_launch.wanted(q, q, q, (128, 128), (64, 64, 4, 2), 0.1), "the call's own tiles are Triton's"
    assert not gluon_launch.wanted(q, q, q, (64, 128), (0, 0, 0, 0), 0.1), "a sparse block smaller than the tile"
    assert not gluon_launch.wanted(q.float(), q.float(), q.float(), (128, 128), (0, 0, 0, 0), 0.1)
    q96 = torch.randn(1, 2, 256, 96, device=DEV, dtype=torch.bfloat16)
    assert not gluon_launch.wanted(q96, q96, q96, (128, 128), (0, 0, 0, 0), 0.1)
    with config.override(gluon=False):
        assert not gluon_launch.wanted(q, q, q, (128, 128), (0, 0, 0, 0), 0.1)
    with config.override(gluon_flex=False):
        assert not gluon_launch.wanted(q, q, q, (128, 128), (0, 0, 0, 0), 0.1)


@pytest.fixture
def dkdv_calls(monkeypatch):
    """How many backwards ran their dK/dV half on the Gluon kernel (forced on: it is not a default route yet)."""
    seen = _count(monkeypatch, "gluon_flex_dkdv")
    with config.override(gluon_flex_bwd=True):
        yield seen


def _check_grads(var, meta, B, H, L, S, h_kv, dtype, dkdv_calls, block=128):
    score_mod, mask_mod, _, _, table = var
    q = torch.randn(B, H, L, 128, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, h_kv, S, 128, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    leaves = [q, k, v] + ([table] if table is not None else [])
    g = torch.randn(B, H, L, 128, device=DEV, dtype=dtype)
    mask = create_block_mask(mask_mod, B, None, L, S, device=DEV, BLOCK_SIZE=block) if mask_mod else None
    args = dict(score_mod=score_mod, block_mask=mask, enable_gqa=h_kv != H)
    grads = torch.autograd.grad(flex_attention(q, k, v, **args), leaves, g)
    assert len(dkdv_calls) == 1, "the backward did not take the Gluon dK/dV kernel"
    with config.override(gluon_flex_bwd=False):
        t_grads = torch.autograd.grad(flex_attention(q, k, v, **args), leaves, g)
    assert len(dkdv_calls) == 1
    ref, _ = dense_reference(q, k, v, var, meta)
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    pt, _ = dense_reference(q, k, v, var, meta, dtype=dtype)
    pt_grads = torch.autograd.grad(pt, leaves, g)
    for n, a, r, p, t in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, pt_grads, t_grads):
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=n)
        err_t = (t.double() - r).abs().max().item()
        assert (a.double() - t.double()).abs().max().item() <= 2 * err_t + 1e-3, f"{n}: far from the Triton kernel's"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("L, S", [(1024, 1024), (1000, 1000), (512, 777)])
def test_dkdv_variants(name, L, S, dkdv_calls):
    var = variants(2, 4, L, S, device=DEV, window=256, prefix=L // 4, docs=(0, L // 3, L // 2))
    _check_grads(var[name], var["_meta"], 2, 4, L, S, 4, torch.bfloat16, dkdv_calls)


@pytest.mark.parametrize("name", ["causal", "alibi", "document", "rel_bias"])
def test_dkdv_gqa_fp16_and_wide_blocks(name, dkdv_calls):
    var = variants(1, 8, 1024, 1024, device=DEV, window=256, prefix=256, docs=(0, 300, 700))
    _check_grads(var[name], var["_meta"], 1, 8, 1024, 1024, 2, torch.float16, dkdv_calls)
    dkdv_calls.clear()
    _check_grads(var[name], var["_meta"], 1, 8, 1024, 1024, 8, torch.bfloat16, dkdv_calls, block=256)


def test_dkdv_head_dependent_masks_and_small_blocks(dkdv_calls):
    # per-head lists: under GQA one head of a group has no step on some key blocks and another fewer steps than the
    # ring has slots, so the ring's phases carry across heads unevenly; 32 x 64 sparse blocks (one step a block)
    L = S = 512
    q_pos, kv_pos = torch.arange(L, device=DEV)[:, None], torch.arange(S, device=DEV)[None, :]

    def by_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((h % 4 == 0) | (kv_idx >= 192)) & ((h % 4 != 3) | (q_idx - kv_idx < 40))

    heads = torch.arange(8, device=DEV)[:, None, None]
    keep = ((kv_pos <= q_pos) & ((heads % 4 == 0) | (kv_pos >= 192)) & ((heads % 4 != 3) | (q_pos - kv_pos < 40)))
    var = (None, by_head, None, keep[None].expand(1, 8, L, S), None)
    meta = dict(q=q_pos, kv=kv_pos, S=S)
    for block in ((32, 64), 128):
        dkdv_calls.clear()
        _check_grads_h(var, meta, L, S, block, dkdv_calls)


def _check_grads_h(var, meta, L, S, block, dkdv_calls):
    # a block mask with its heads given (H = 8), q with 8 heads over k / v with 2
    q = torch.randn(1, 8, L, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 8, L, 128, device=DEV, dtype=torch.bfloat16)
    mask = create_block_mask(var[1], 1, 8, L, S, device=DEV, BLOCK_SIZE=block)
    grads = torch.autograd.grad(flex_attention(q, k, v, block_mask=mask, enable_gqa=True), (q, k, v), g)
    assert len(dkdv_calls) == 1, "the backward did not take the Gluon dK/dV kernel"
    ref, _ = dense_reference(q, k, v, var, meta)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
    pt, _ = dense_reference(q, k, v, var, meta, dtype=torch.bfloat16)
    pt_grads = torch.autograd.grad(pt, (q, k, v), g)
    for n, a, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=n)


@pytest.fixture
def fused_calls(monkeypatch):
    """Like dkdv_calls, with the fused dQ build pinned on too: counts only launches that got a dq_accum."""
    seen, real = [], gluon_launch.gluon_flex_dkdv

    def counted(*args, **kwargs):
        if kwargs.get("dq_accum") is not None:
            seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_launch, "gluon_flex_dkdv", counted)
    with config.override(gluon_flex_bwd=True, gluon_fused_dq=True):
        yield seen


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("L, S", [(1024, 1024), (1000, 1000), (512, 777)])
def test_fused_dq_variants(name, L, S, fused_calls):
    # dQ added by TMA reduce-add from the dK/dV kernel (no dQ kernel); _check_grads compares with the all-Triton
    # backward too (gluon_flex_bwd off)
    var = variants(2, 4, L, S, device=DEV, window=256, prefix=L // 4, docs=(0, L // 3, L // 2))
    _check_grads(var[name], var["_meta"], 2, 4, L, S, 4, torch.bfloat16, fused_calls)


@pytest.mark.parametrize("name", ["causal", "document", "rel_bias"])
def test_fused_dq_gqa_fp16(name, fused_calls):
    var = variants(1, 8, 1024, 1024, device=DEV, window=256, prefix=256, docs=(0, 300, 700))
    _check_grads(var[name], var["_meta"], 1, 8, 1024, 1024, 2, torch.float16, fused_calls)


@pytest.mark.parametrize("name", ["causal", "document"])
def test_fused_dq_with_the_lse_in_the_loss(name, fused_calls):
    # a loss that reads the lse folds its gradient into delta (flex/launch.py), which the fused dQ reads too
    var = variants(1, 4, 1000, 1000, device=DEV, window=256, prefix=250, docs=(0, 300, 700))
    score_mod, mask_mod = var[name][:2]
    mask = create_block_mask(mask_mod, 1, None, 1000, 1000, device=DEV) if mask_mod else None
    q, k, v = (torch.randn(1, 4, 1000, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g, g_lse = torch.randn_like(q), torch.randn(1, 4, 1000, device=DEV)

    def grads():
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True)
        return torch.autograd.grad((out.float() * g).sum() + (lse * g_lse).sum(), (q, k, v))

    got = grads()
    assert len(fused_calls) == 1, "the fused dQ build did not run"
    with config.override(gluon_flex_bwd=False):
        want = grads()
    for a, b in zip(got, want):
        # two fp32 summation orders, one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()
