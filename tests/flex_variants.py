"""The standard flex variants, each as (score_mod, mask_mod) and as its dense definition (a bias and a bool
mask over the (b, h, q, kv) grid, written directly from the formula, not through the mods): the float64
reference the tests hold flashtile.flex to."""

import math

import torch


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def variants(B, H, L, S, device="cpu", window=9, prefix=7, docs=(0, 3, 11), table_requires_grad=True):
    """name -> (score_mod, mask_mod, dense_bias (B, H, L, S) float64 or None, dense_keep (B, H, L, S) bool or
    None, captured trainable tensor or None)."""
    q = torch.arange(L, device=device)[:, None]
    kv = torch.arange(S, device=device)[None, :]
    out = {}
    out["causal"] = (None, causal, None, (q >= kv).expand(B, H, L, S), None)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    out["sliding_window"] = (None, sliding, None, ((q >= kv) & (q - kv <= window)).expand(B, H, L, S), None)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    out["prefix_lm"] = (None, prefix_lm, None, ((kv < prefix) | (q >= kv)).expand(B, H, L, S), None)
    # document ids of a packed batch, per batch entry (documents start at `docs`, shifted per entry)
    doc = torch.zeros(B, max(L, S), dtype=torch.int32, device=device)
    for bi in range(B):
        for start in docs:
            doc[bi, start + bi:] += 1

    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    keep = (doc[:, :L, None] == doc[:, None, :S])[:, None] & (q >= kv)
    out["document"] = (None, document, None, keep.expand(B, H, L, S), None)
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    bias = -(slopes.double()[:, None, None] * (q - kv).abs().double())
    out["alibi"] = (alibi, causal, bias.expand(B, H, L, S), (q >= kv).expand(B, H, L, S), None)
    cap = 2.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    out["softcap"] = (softcap, None, "softcap", None, None)
    table = (torch.randn(L + S, device=device) * 0.5).requires_grad_(table_requires_grad)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + S]

    out["rel_bias"] = (rel_bias, causal, "table", (q >= kv).expand(B, H, L, S), table)
    out["_meta"] = dict(cap=cap, table=table, S=S, q=q, kv=kv)
    return out


def dense_reference(q, k, v, variant, meta, scale=None, dtype=torch.float64):
    """Attention from the dense definition computed in ``dtype`` (float64: the reference; the inputs' dtype:
    PyTorch's own error, FlashAttention's bar); returns (out, lse) with lse -inf on empty rows (out 0 there),
    both differentiable."""
    _, _, bias, keep, table = variant
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if isinstance(bias, str) and bias == "softcap":
        s = meta["cap"] * torch.tanh(s / meta["cap"])
    elif isinstance(bias, str) and bias == "table":
        s = s + table.to(dtype)[(meta["q"] - meta["kv"] + meta["S"])]
    elif bias is not None:
        s = s + bias.to(dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = logsumexp(s.to(torch.float64 if dtype == torch.float64 else torch.float32)).to(dtype)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # 0 on a row that sees no key
    return p.to(dtype) @ v, lse


def logsumexp(s):
    """Natural-log logsumexp over the last dim, -inf on a row of -inf only; differentiable, with a zero (not
    NaN) gradient on such a row, so a loss on the lse can be checked there too."""
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0.0)
    z = torch.exp(s - m).sum(-1)
    return torch.where(z > 0, m.squeeze(-1) + torch.log(torch.where(z > 0, z, 1.0)), float("-inf"))
