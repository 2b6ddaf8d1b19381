"""FlashAttention's correctness bar, used by every numerical test.

``ref`` is the fp32-upcast reference, ``pt`` the same computation in the input dtype; the tested
result must be within ``factor`` times PyTorch's own error (plus a small absolute slack).
"""

import torch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def assert_fa_close(out, ref, pt, factor: float = 2.0, atol: float = 1e-5, name: str = "out"):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out.float()).all(), f"{name}: non-finite values"
    err, pt_err = max_err(out, ref), max_err(pt, ref)
    assert err <= factor * pt_err + atol, f"{name}: max err {err:.3e} > {factor} x pt err {pt_err:.3e} + {atol}"
