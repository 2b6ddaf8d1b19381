"""The flex forward's tensor-descriptor path (config.tma: K and V tiles through descriptors over (b, h_k, s, d))
under the interpreter against the float64 reference: ragged key counts (the copy engine's zero fill stands in for
the row masks), a head dim that is not a power of two (zero-filled columns), GQA, score and mask mods."""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import host
from flashtile.flex import create_block_mask, flex_attention
from flashtile.kernels.flex_fwd import _flex_fwd_kernel
from flex_variants import dense_reference, variants
from tolerance import assert_fa_close


@pytest.mark.parametrize("name", ["causal", "document", "softcap", "rel_bias"])
@pytest.mark.parametrize("L,S,E,h_kv", [(100, 77, 16, 2), (64, 130, 40, 1)])
def test_tma_path_matches_reference(monkeypatch, name, L, S, E, h_kv):
    seen = []
    real = host.launch

    def record(kernel, grid, *args, **meta):
        if kernel is _flex_fwd_kernel:
            seen.append(meta.get("USE_TMA", False))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(host, "launch", record)
    B, H = 2, 2
    var = variants(B, H, L, S, window=20, prefix=L // 4, docs=(0, L // 3, L // 2))
    score_mod, mask_mod = var[name][:2]
    mask = create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    q = torch.randn(B, H, L, E)
    k, v = (torch.randn(B, h_kv, S, E) for _ in range(2))
    with config.override(interpret=True, tma=True, fwd_tiles=(16, 16, 4, 1)):
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=h_kv != H)
    assert seen == [True]
    kr, vr = (x.repeat_interleave(H // h_kv, dim=1) for x in (k, v))
    ref, _ = dense_reference(q, kr, vr, var[name], var["_meta"])
    pt, _ = dense_reference(q, kr, vr, var[name], var["_meta"], dtype=torch.float32)
    assert_fa_close(out, ref, pt)
