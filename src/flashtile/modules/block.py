"""Transformer block with the conventions of FlashAttention's ``flash_attn.modules.block.Block``.

Shapes: hidden states ``(b, s, e)`` (or ``(total, e)`` when the mixer gets ``cu_seqlens``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from flashtile.modules.mha import MHA
from flashtile.modules.mlp import Mlp

__all__ = ["Block", "StochasticDepth"]


def _norm(norm, x):
    # the norm runs in its parameters' dtype: an fp32 residual must not upcast the rest of the block
    weight = getattr(norm, "weight", None)
    return norm(x.to(weight.dtype) if weight is not None else x)


class StochasticDepth(nn.Module):
    """Drop whole samples (rows of dim 0) with probability ``p`` in training, scaling survivors by 1/(1-p).

    torchvision's ``StochasticDepth(p, mode="row")``, which FlashAttention's Block uses; identity in eval
    mode or when ``p == 0``.
    """

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"flashtile: drop path probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        noise = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)
        noise.bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Attention ("mixer") + MLP with residual connections, pre-norm or post-norm.

    Pre-norm (``prenorm=True``, GPT-2/LLaMA style) keeps the residual stream outside the norms and
    passes it between blocks, so each block does one "dropout + add + norm" per sub-layer::

        residual = drop_path1(dropout1(hidden)) + residual;  hidden = mixer(norm1(residual))
        residual = drop_path2(dropout2(hidden)) + residual;  hidden = mlp(norm2(residual))
        return hidden, residual          # the caller applies the final dropout + add + norm

    Post-norm (``prenorm=False``, original Transformer/BERT)::

        hidden = norm1(drop_path1(dropout1(mixer(hidden))) + hidden)
        hidden = norm2(drop_path2(dropout2(mlp(hidden))) + hidden)
        return hidden

    With ``mlp_cls=nn.Identity`` the second sub-layer is skipped entirely (no dropout2, drop_path2,
    residual add or norm2; those modules are not created), as in FlashAttention: pre-norm then
    returns ``(mixer output, residual)`` and post-norm ``norm1(...)``.

    Args (FlashAttention 2.8.3's order; ``device`` / ``dtype`` are keyword-only):
        dim: e, model width.
        mixer_cls: builds the attention layer from ``dim`` (default ``MHA`` with 64-wide heads).
        mlp_cls: builds the MLP from ``dim`` (default ``Mlp`` with 4x hidden width).
        norm_cls: builds a norm from ``dim`` (default ``nn.LayerNorm``; ``nn.RMSNorm`` works too).
        dropout_cls: builds a dropout from a probability (default ``nn.Dropout``).
        prenorm: pre-norm (True) or post-norm (False).
        resid_dropout1, resid_dropout2: dropout on the mixer / MLP outputs before each residual add.
        drop_path1, drop_path2: stochastic depth (drop the whole sub-layer output of a sample, training
            only) on the mixer / MLP outputs.
        fused_dropout_add_ln: False only (flashtile has no fused dropout + add + LayerNorm kernel).
        return_residual: the mixer and MLP return ``(out, input)`` pairs (post-norm only), as
            FlashAttention's ``MHA(return_residual=True)`` / ``Mlp(return_residual=True)`` do.
        residual_in_fp32: keep the residual stream in fp32 (pre-norm only) so low-precision models do
            not lose the small updates each block adds to it.
        sequence_parallel: False only (no tensor parallelism in flashtile).
        mark_shared_params: tag the norm parameters with ``_shared_params = True``.
        device, dtype: passed to mixer_cls / mlp_cls / norm_cls when given.

    ``forward(hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None)``: pre-norm returns
    ``(hidden_states, residual)``; post-norm returns ``hidden_states``. ``mixer_kwargs`` (e.g.
    ``key_padding_mask``, ``inference_params``, ``cu_seqlens``) go to the mixer. ``mixer_subset`` is not
    supported (FlashAttention uses it only for the last layer of BERT pretraining).
    """

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, drop_path1=0.0, drop_path2=0.0,
                 fused_dropout_add_ln=False, return_residual=False, residual_in_fp32=False,
                 sequence_parallel=False, mark_shared_params=False, *, device=None, dtype=None):
        super().__init__()
        factory = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if residual_in_fp32 and not prenorm:
            raise ValueError("flashtile: residual_in_fp32 only applies to pre-norm blocks")
        if fused_dropout_add_ln:
            raise NotImplementedError("flashtile: Block(fused_dropout_add_ln=True) is not supported (no fused "
                                      "dropout + add + LayerNorm kernel); pass fused_dropout_add_ln=False")
        if sequence_parallel:
            raise NotImplementedError("flashtile: Block(sequence_parallel=True) is not supported (no tensor "
                                      "parallelism); pass sequence_parallel=False")
        if return_residual and prenorm:
            raise ValueError("flashtile: Block(return_residual=True) only applies to post-norm blocks")
        self.prenorm = prenorm
        self.fused_dropout_add_ln = False
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=max(1, dim // 64))
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim, **factory)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = StochasticDepth(drop_path1)
        self.norm1 = norm_cls(dim, **factory)
        self.mlp = mlp_cls(dim, **factory)
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = StochasticDepth(drop_path2)
            self.norm2 = norm_cls(dim, **factory)
        if mark_shared_params:
            for norm in (self.norm1, getattr(self, "norm2", None)):
                if norm is not None:
                    for p in norm.parameters():
                        p._shared_params = True

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
        has_mlp = not isinstance(self.mlp, nn.Identity)
        if self.prenorm:
            hidden, residual = self._add_norm(self.norm1, self.drop_path1(self.dropout1(hidden_states)), residual)
            hidden = self.mixer(hidden, **mixer_kwargs)
            if has_mlp:
                hidden, residual = self._add_norm(self.norm2, self.drop_path2(self.dropout2(hidden)), residual)
                hidden = self.mlp(hidden)
            return hidden, residual
        if residual is not None:
            raise ValueError("flashtile: a post-norm Block takes no residual")
        mixed = self.mixer(hidden_states, **mixer_kwargs)
        if self.return_residual:  # the mixer returns (out, its input)
            mixed, hidden_states = mixed
        hidden = _norm(self.norm1, self.drop_path1(self.dropout1(mixed)) + hidden_states)
        if not has_mlp:
            return hidden
        out = self.mlp(hidden)
        if self.return_residual:
            out, hidden = out
        return _norm(self.norm2, self.drop_path2(self.dropout2(out)) + hidden)
