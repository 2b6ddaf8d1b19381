"""flashtile.flex in PyTorch: the mods evaluated on index grids, attention materialised.

This is the CPU path of ``flashtile.flex`` (any device, float32 accumulation, float64 for float64
inputs) and the way block masks are built. A mod is called once on index tensors shaped to broadcast
over (B, H, L, S) (b as (B, 1, 1, 1), q_idx as (1, 1, L, 1), ...): the elementwise ops and indexing that
tracing accepts broadcast the same way, and no torch.vmap is needed, which a custom op's implementation
could not always run. Autograd flows through the mods, captured tensors included.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _grid(B: int, H: int, L: int, S: int, device) -> tuple[Tensor, ...]:
    """b, h, q_idx, kv_idx as int32 index tensors shaped to broadcast over (B, H, L, S)."""
    return tuple(torch.arange(n, device=device, dtype=torch.int32).view([n if i == d else 1 for i in range(4)])
                 for d, n in enumerate((B, H, L, S)))


def evaluate_mask(mask_mod, B: int, H: int, L: int, S: int, device, q_start: int = 0, q_stop: int | None = None
                  ) -> Tensor:
    """mask_mod on rows [q_start, q_stop) of the (B, H, L, S) grid, as bool (B, H, rows, S)."""
    b, h, q, kv = _grid(B, H, L, S, device)
    q = q[:, :, q_start:q_stop]
    return torch.as_tensor(mask_mod(b, h, q, kv), device=device).to(torch.bool).expand(B, H, q.numel(), S)


def apply_score_mod(score_mod, scores: Tensor) -> Tensor:
    """score_mod on a (B, H, L, S) score tensor."""
    B, H, L, S = scores.shape
    b, h, q, kv = _grid(B, H, L, S, scores.device)
    return score_mod(scores, b, h, q, kv).expand(B, H, L, S)


def flex_attention_dense(q: Tensor, k: Tensor, v: Tensor, score_mod, mask_mod, scale: float,
                         upcast: bool = True) -> tuple[Tensor, Tensor]:
    """(out, lse) of q (B, Hq, L, E) against k (B, Hkv, S, E), v (B, Hkv, S, Ev), with the mods applied
    (either may be None; mask_mod may also be a bool tensor broadcastable to (B, Hq, L, S)). GQA when Hkv
    divides Hq. lse is natural-log, fp32 (fp64 for fp64 inputs), +inf on rows that see no key (output 0)."""
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    group = Hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if upcast:
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if score_mod is not None:
        scores = apply_score_mod(score_mod, scores).to(acc)
    if isinstance(mask_mod, Tensor):
        scores = scores.masked_fill(~mask_mod, float("-inf"))
    elif mask_mod is not None:
        keep = evaluate_mask(mask_mod, B, Hq, L, S, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    # the row max only shifts the exponent (out and lse do not depend on it): detached, autograd gives lse's
    # gradient as exactly P, and skips amax's backward
    m = scores.amax(-1, keepdim=True).detach()
    empty = m == float("-inf")
    p = torch.exp(scores - torch.where(empty, torch.zeros_like(m), m))
    denom = p.sum(-1, keepdim=True)
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.matmul((p / safe).to(v.dtype), v)
    lse = torch.where(denom == 0, torch.full_like(denom, float("inf")), (m + torch.log(safe)))
    return out.to(q.dtype if not upcast else out.dtype), lse.squeeze(-1).to(acc)
