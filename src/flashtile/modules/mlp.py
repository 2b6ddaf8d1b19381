"""Feed-forward layers with the constructor conventions of FlashAttention's ``flash_attn.modules.mlp``.

Shapes: inputs ``(..., in_features)`` -> outputs ``(..., out_features)``; any leading dims.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GatedMlp", "Mlp"]


class Mlp(nn.Module):
    """``fc2(activation(fc1(x)))``.

    Args:
        in_features: input width.
        hidden_features: inner width (default ``4 * in_features``).
        out_features: output width (default ``in_features``).
        activation: callable applied elementwise (default exact GELU).
        bias1, bias2: biases of fc1 and fc2.
        return_residual: also return the input (lets a Block fuse the residual add the way
            FlashAttention's fused kernels do); forward then returns ``(y, x)``.
        device, dtype: of the parameters.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu, bias1=True,
                 bias2=True, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else 4 * in_features
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x: torch.Tensor):
        y = self.fc2(self.activation(self.fc1(x)))
        return (y, x) if self.return_residual else y


class GatedMlp(nn.Module):
    """Gated feed-forward (GLU family): ``fc2(activation(gate) * value)`` with ``fc1(x) = [value, gate]``.

    The default activation is SiLU, i.e. SwiGLU (LLaMA's MLP); ``F.sigmoid`` gives the original GLU
    and ``F.gelu`` GeGLU.

    Args:
        in_features: input width.
        hidden_features: inner width (default ``8 * in_features / 3``, which keeps the parameter count
            of a 4x Mlp), rounded up to a multiple of ``multiple_of`` (matmul-friendly sizes).
        out_features: output width (default ``in_features``).
        activation: gate activation (default SiLU).
        bias1, bias2: biases of fc1 and fc2.
        multiple_of: rounding of hidden_features.
        return_residual: also return the input; forward then returns ``(y, x)``.
        device, dtype: of the parameters.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.silu, bias1=True,
                 bias2=True, multiple_of=128, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden_features = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.return_residual = return_residual
        self.activation = activation
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory)

    def forward(self, x: torch.Tensor):
        value, gate = self.fc1(x).chunk(2, dim=-1)
        y = self.fc2(self.activation(gate) * value)
        return (y, x) if self.return_residual else y
