"""A float64, one-row-at-a-time attention written straight from the contract's text.

Deliberately shares no code with flashtile: it is the oracle the reference is checked against.
"""

import math

import torch


def brute_force(q, k, v, lens_q, lens_k, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                scale=None, keep=None, dropout_p=0.0, chunk=0, sink=None, qv=None):
    """q (b, sq, h, d), k (b, sk, h_k, d), v (b, sk, h_k, dv); lens_* per-batch valid lengths. Returns out
    (b, sq, h, dv), lse (b, h, sq). ``chunk``: a row sees only keys j with floor(j / chunk) equal to its
    diagonal's; ``sink`` (h,): a logit added to every row's denominator (and to lse); ``qv`` (b, sq, h, dv):
    scores gain qv . v, default scale 1 / sqrt(d + dv)."""
    b, sq, h, d = q.shape
    sk, h_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d if qv is None else d + dv)
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("inf"), dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    # FlashAttention's convention: a bound >= the (padded) key length means unbounded
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    for bi in range(b):
        lq, lk = lens_q[bi], lens_k[bi]
        for hi in range(h):
            kh = hi // (h // h_k)
            for i in range(lq):
                scores, idx = [], []
                for j in range(lk):
                    if left >= 0 and j < i + lk - lq - left:
                        continue
                    if right >= 0 and j > i + lk - lq + right:
                        continue
                    if chunk > 0 and math.floor(j / chunk) != math.floor((i + lk - lq) / chunk):
                        continue
                    s = float(q[bi, i, hi] @ k[bi, j, kh]) * scale
                    if qv is not None:
                        s += float(qv[bi, i, hi].double() @ v[bi, j, kh]) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        slope = float(alibi[hi] if alibi.dim() == 1 else alibi[bi, hi])
                        s -= slope * abs(i + lk - lq - j)
                    scores.append(s)
                    idx.append(j)
                extra = [] if sink is None else [float(sink[hi])]
                if not scores:
                    if extra:
                        lse[bi, hi, i] = extra[0]
                    continue
                mx = max(scores + extra)
                total = sum(math.exp(s - mx) for s in scores + extra)
                lse[bi, hi, i] = mx + math.log(total)
                for s, j in zip(scores, idx):
                    w = math.exp(s - mx) / total
                    if keep is not None:
                        w = w / (1 - dropout_p) if keep[bi, hi, i, j] else 0.0
                    out[bi, i, hi] += w * v[bi, j, kh]
    return out, lse
