"""Transformer block with the conventions of FlashAttention's ``flash_attn.modules.block.Block``.

Shapes: hidden states ``(b, s, e)`` (or ``(total, e)`` when the mixer gets ``cu_seqlens``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from flashtile.modules.mha import MHA
from flashtile.modules.mlp import Mlp

__all__ = ["Block"]


def _norm(norm, x):
    # the norm runs in its parameters' dtype: an fp32 residual must not upcast the rest of the block
    weight = getattr(norm, "weight", None)
    return norm(x.to(weight.dtype) if weight is not None else x)


class Block(nn.Module):
    """Attention ("mixer") + MLP with residual connections, pre-norm or post-norm.

    Pre-norm (``prenorm=True``, GPT-2/LLaMA style) keeps the residual stream outside the norms and
    passes it between blocks, so each block does one "dropout + add + norm" per sub-layer::

        residual = dropout1(hidden) + residual;  hidden = mixer(norm1(residual))
        residual = dropout2(hidden) + residual;  hidden = mlp(norm2(residual))
        return hidden, residual          # the caller applies the final dropout + add + norm

    Post-norm (``prenorm=False``, original Transformer/BERT)::

        hidden = norm1(dropout1(mixer(hidden)) + hidden)
        hidden = norm2(dropout2(mlp(hidden)) + hidden)
        return hidden

    Args:
        dim: e, model width.
        mixer_cls: builds the attention layer from ``dim`` (default ``MHA`` with 64-wide heads).
        mlp_cls: builds the MLP from ``dim`` (default ``Mlp`` with 4x hidden width).
        norm_cls: builds a norm from ``dim`` (default ``nn.LayerNorm``; ``nn.RMSNorm`` works too).
        dropout_cls: builds a dropout from a probability (default ``nn.Dropout``).
        prenorm: pre-norm (True) or post-norm (False).
        resid_dropout1, resid_dropout2: dropout on the mixer / MLP outputs before each residual add.
        residual_in_fp32: keep the residual stream in fp32 (pre-norm only) so low-precision models do
            not lose the small updates each block adds to it.
        mixer_cls / mlp_cls / norm_cls receive ``device`` / ``dtype`` when given here.

    ``forward(hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None)``: pre-norm returns
    ``(hidden_states, residual)``; post-norm returns ``hidden_states``. ``mixer_kwargs`` (e.g.
    ``key_padding_mask``, ``inference_params``, ``cu_seqlens``) go to the mixer. ``mixer_subset`` is not
    supported (FlashAttention uses it only for the last layer of BERT pretraining).
    """

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, residual_in_fp32=False, device=None,
                 dtype=None):
        super().__init__()
        factory = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if residual_in_fp32 and not prenorm:
            raise ValueError("flashtile: residual_in_fp32 only applies to pre-norm blocks")
        self.prenorm = prenorm
        self.residual_in_fp32 = residual_in_fp32
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=max(1, dim // 64))
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim, **factory)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim, **factory)
        self.mlp = mlp_cls(dim, **factory)
        self.dropout2 = dropout_cls(resid_dropout2)
        self.norm2 = norm_cls(dim, **factory)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """The mixer's KV cache (see ``MHA.allocate_inference_cache``)."""
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _add_norm(self, norm, hidden, residual):
        """residual' = hidden + residual (fp32 if asked); returns (norm(residual'), residual')."""
        residual = hidden if residual is None else hidden + residual
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return _norm(norm, residual), residual

    def forward(self, hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None):
        """See the class docstring; hidden_states (b, s, e), residual (b, s, e) or None."""
        if mixer_subset is not None:
            raise NotImplementedError("flashtile: Block(mixer_subset=...) is not supported")
        mixer_kwargs = mixer_kwargs or {}
        if self.prenorm:
            hidden, residual = self._add_norm(self.norm1, self.dropout1(hidden_states), residual)
            hidden = self.mixer(hidden, **mixer_kwargs)
            hidden, residual = self._add_norm(self.norm2, self.dropout2(hidden), residual)
            hidden = self.mlp(hidden)
            return hidden, residual
        mixed = self.mixer(hidden_states, **mixer_kwargs)
        hidden = _norm(self.norm1, self.dropout1(mixed) + hidden_states)
        out = self.mlp(hidden)
        return _norm(self.norm2, self.dropout2(out) + hidden)
