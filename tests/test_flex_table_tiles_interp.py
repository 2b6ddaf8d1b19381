"""The flex kernels at Hopper's d = 128 table tiles (FLEX_FWD_CONFIGS / FLEX_BWD_CONFIGS, sm90) under the
interpreter: a 128-token block mask over tiles of other sizes (64 keys, 32 or 128 queries) keeps forward and
backward, the captured table's gradient included, on the float64 reference (FlashAttention's bar, fp32)."""

import pytest
import torch

from flashtile import config
from flashtile.flex import create_block_mask, flex_attention
from flashtile.kernels.flex_bwd import FLEX_BWD_CONFIGS
from flashtile.kernels.flex_fwd import FLEX_FWD_CONFIGS
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close

B, H, L, S, E = 1, 2, 300, 300, 16


@pytest.mark.parametrize("name", ["causal", "document", "rel_bias"])
def test_table_tiles_match_reference(name):
    var = variants(B, H, L, S, window=64, prefix=L // 4, docs=(0, L // 3, L // 2))
    score_mod, mask_mod, _, _, table = var[name]
    mask = create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=128)
    q, k, v = (torch.randn(B, H, n, E, requires_grad=True) for n in (L, S, S))
    leaves = [q, k, v] + ([table] if table is not None else [])
    g = torch.randn(B, H, L, E)
    with config.override(interpret=True, fwd_tiles=FLEX_FWD_CONFIGS[("sm90", 128)],
                         bwd_tiles=FLEX_BWD_CONFIGS[("sm90", 128)]):
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
        grads = torch.autograd.grad(out, leaves, g)
    ref, _ = dense_reference(q, k, v, var[name], var["_meta"])
    ref_grads = torch.autograd.grad(ref, leaves, g.double())
    pt, _ = dense_reference(q, k, v, var[name], var["_meta"], dtype=torch.float32)
    pt_grads = torch.autograd.grad(pt, leaves, g)
    assert_fa_close(out, ref, pt)
    for n, a, r, p in zip(("dq", "dk", "dv", "dtable"), grads, ref_grads, pt_grads):
        assert_fa_close(a, r, p, factor=3.0, atol=1e-4, name=n)
