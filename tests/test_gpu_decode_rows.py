"""The row-stream decode experiment on the H200 (FLASHTILE_DECODE_ROWS=H: programs of H adjacent kv heads over a
key split): every call routed there must match the PyTorch reference as the default kernels do (FlashAttention's
tolerance rule) and append its new keys exactly."""

import pytest
import torch

from flashtile.backends.triton import decode_rows
from test_gpu_kvcache import _check, _inputs

pytestmark = pytest.mark.gpu

# (b, h, h_k, d, cap, s_new): GQA 4:1 and 8:1, ragged lengths, appended keys, caches off the tile grid, and one
# the Gluon rule would take (b = 32, 16k; MHA keeps the reference small): the experiment comes first
SHAPES = [(32, 8, 8, 128, 16384, 0), (32, 32, 8, 128, 4133, 1), (4, 64, 8, 128, 3000, 3), (8, 32, 8, 64, 2049, 1)]


@pytest.mark.parametrize("heads,pdl,fused", [(1, 0, 0), (2, 0, 0), (4, 0, 0), (8, 0, 0), (8, 1, 0), (8, 0, 1),
                                             (8, 1, 1), (4, 0, 1)])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}hk{s[2]}d{s[3]}c{s[4]}n{s[5]}" for s in SHAPES])
def test_matches_reference(monkeypatch, heads, pdl, fused, shape):
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS", str(heads))
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_PDL", str(pdl))
    monkeypatch.setenv("FLASHTILE_DECODE_ROWS_FUSED", str(fused))
    calls = []
    real = decode_rows.rows_decode
    monkeypatch.setattr(decode_rows, "rows_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    b, h, h_k, d, cap, s_new = shape
    q, kc, vc, kw = _inputs(b, 1, s_new, h, h_k, d, cap, torch.bfloat16, seed=cap)
    _check(q, kc, vc, kw, causal=True)
    assert calls, "the row-stream kernel did not run"
