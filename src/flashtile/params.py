"""The normalised parameters of one attention call, as every backend receives them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnParams:
    """Everything about a call except the q/k/v tensors themselves.

    ``window_left``/``window_right`` are normalised (-1 = unbounded, causal already folded into
    right = 0). Varlen calls carry ``cu_seqlens_q/k`` (int32, (b+1,)) and the max lengths; padded
    calls leave them None. ``seed``/``offset`` key the dropout Philox stream (see ``rng.py``).
    ``q_descale/k_descale/v_descale`` (fp32 ``(b, h_k)``, fp8 calls only; None = 1) dequantise
    e4m3 inputs (see ``fp8.py``).

    Beyond FlashAttention 2.8.3 (FlashAttention-3 / its CuTe successor's semantics,
    ``backends/reference.py`` states them exactly): ``learnable_sink`` (fp32 or the inputs' dtype,
    ``(h,)``) is one logit per query head, in score units after the scale, that joins every row's softmax
    denominator (lse includes it; its gradient is ``-sum exp(sink - lse) * delta`` over rows, which the
    autograd layer computes, so backends only need lse to include it). ``attention_chunk`` > 0 limits a
    row to the keys of its diagonal's chunk (``masking.visible``). v's head dim may differ from q/k's:
    backends read it from ``v.shape[-1]``.
    """

    softmax_scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    deterministic: bool = False
    return_probs: bool = False
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    learnable_sink: torch.Tensor | None = None
    attention_chunk: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0
