"""GPU check of the causal launch order (config.heavy_first): the compiled Triton
forward and dQ kernels give bitwise the same output, lse and gradients with the longest row blocks
started first and in launch order (the interpreter test, test_heavy_first_order.py, cannot compile)."""

import pytest
import torch

import flashtile
from flashtile import config

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("b,sq,sk,h,h_k,d", [(2, 1000, 1000, 4, 2, 128), (1, 4096, 4096, 8, 8, 64),
                                               (2, 777, 1500, 4, 4, 256)])
def test_same_in_both_orders(b, sq, sk, h, h_k, d):
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, h_k, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn_like(q)
    results = []
    for heavy_first in (True, False):
        with config.override(heavy_first=heavy_first):
            out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
            results.append((out, lse, *torch.autograd.grad(out, (q, k, v), g)))
    for a, c in zip(*results):
        assert torch.equal(a, c)
