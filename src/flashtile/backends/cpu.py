"""The CPU path: the kernels' tiled algorithm written with PyTorch tensor ops.

Queries are processed in tiles of ``BLOCK_Q`` rows and keys in tiles of ``BLOCK_K`` columns with
an online softmax, so memory stays O(BLOCK_Q * BLOCK_K) per (batch, head) whatever the sequence
length (a 32k x 32k causal call never builds a 32k x 32k matrix). Key tiles outside the causal /
window band are skipped, as the kernels do. Products run in fp32 (fp64 for fp64 inputs, which gradcheck uses).
Dispatch sends CPU tensors here, and CUDA backward passes the Triton kernels refuse (float64) too
(the math is device-agnostic: factory calls take the inputs' device from a context).
"""

from __future__ import annotations

import torch

from flashtile.backends.masking import alibi_bias, visible
from flashtile.params import AttnParams
from flashtile.rng import dropout_keep

NAME = "cpu"
BLOCK_Q = 128
BLOCK_K = 512


def refusal(op: str, q: torch.Tensor, p: AttnParams) -> str | None:
    """Why this backend cannot run the call, or None if it can."""
    if q.device.type == "cpu" or (q.device.type == "cuda" and op == "bwd"):
        return None
    return f"runs CPU tensors (and CUDA backward passes) only, got {op} on {q.device.type}"


def _key_range(q0: int, q1: int, sq: int, sk: int, p: AttnParams) -> tuple[int, int]:
    """Columns [lo, hi) that rows [q0, q1) can see: the band outside it is skipped entirely. A row's
    bounds grow with the row (window and chunk alike), so the first row gives lo and the last gives hi."""
    lo = max(0, q0 + sk - sq - p.window_left) if p.window_left >= 0 else 0
    hi = min(sk, q1 - 1 + sk - sq + p.window_right + 1) if p.window_right >= 0 else sk
    if p.attention_chunk > 0:
        first, last = q0 + sk - sq, q1 - 1 + sk - sq
        lo = max(lo, first - first % p.attention_chunk)
        hi = min(hi, last - last % p.attention_chunk + p.attention_chunk)
    return lo, max(lo, hi)


class _Seq:
    """One dense problem: q (b, hk, g, sq, d), k/v (b, hk, 1, sk, d) views plus per-call context."""

    def __init__(self, q, k, v, p: AttnParams, batch_index, alibi):
        b, sq, h, d = q.shape
        hk = k.shape[2]
        self.g = h // hk
        self.sq, self.sk, self.h = sq, k.shape[1], h
        self.q = q.reshape(b, sq, hk, self.g, d).permute(0, 2, 3, 1, 4)
        self.k = k.permute(0, 2, 1, 3).unsqueeze(2)
        self.v = v.permute(0, 2, 1, 3).unsqueeze(2)
        self.p = p
        self.acc = torch.promote_types(q.dtype, torch.float32)  # accumulation dtype
        # dropout stream index of (batch, head): the batch index of the whole call, not the slice
        heads = torch.arange(h).view(1, hk, self.g, 1, 1)
        self.bh = batch_index.view(-1, 1, 1, 1, 1) * h + heads
        self.alibi = None if alibi is None else alibi.view(-1, hk, self.g, 1, 1).to(self.acc)
        # the sink is a logit every row starts from: running max = sink, running sum = exp(0) = 1
        self.sink = None if p.learnable_sink is None else p.learnable_sink.to(self.acc).view(1, hk, self.g, 1)

    def scores(self, q0, q1, k0, k1):
        """Scaled, softcapped, biased and masked fp32 scores of a tile, and the pre-mask softcap value."""
        p = self.p
        s = torch.matmul(self.q[..., q0:q1, :].to(self.acc), self.k[..., k0:k1, :].to(self.acc).transpose(-1, -2))
        s = s * p.softmax_scale
        capped = None
        if p.softcap > 0:
            s = torch.tanh(s / p.softcap) * p.softcap
            capped = s
        rows = torch.arange(q0, q1).view(-1, 1)
        cols = torch.arange(k0, k1).view(1, -1)
        if self.alibi is not None:
            s = s + alibi_bias(self.alibi, rows, cols, self.sq, self.sk)
        ok = visible(rows, cols, self.sq, self.sk, p.window_left, p.window_right, p.attention_chunk)
        return s.masked_fill(~ok, float("-inf")), capped

    def keep(self, q0, q1, k0, k1):
        rows = torch.arange(q0, q1).view(-1, 1)
        cols = torch.arange(k0, k1).view(1, -1)
        return dropout_keep(self.p.seed, self.p.offset, self.bh, rows, cols, self.p.dropout_p)


def _forward_dense(seq: _Seq, out, lse, probs):
    """Fill ``out`` (b, sq, h, d), ``lse`` (b, h, sq) and optionally ``probs`` (b, h, sq, sk)."""
    p = seq.p
    b, hk, g = seq.q.shape[:3]
    d_v = seq.v.shape[-1]
    for q0 in range(0, seq.sq, BLOCK_Q):
        q1 = min(seq.sq, q0 + BLOCK_Q)
        m = torch.full((b, hk, g, q1 - q0), float("-inf"), dtype=seq.acc)
        l_sum = torch.zeros_like(m)
        if seq.sink is not None:
            m = seq.sink.expand_as(m).clone()
            l_sum = torch.ones_like(m)
        acc = torch.zeros(b, hk, g, q1 - q0, d_v, dtype=seq.acc)
        lo, hi = _key_range(q0, q1, seq.sq, seq.sk, p)
        for k0 in range(lo, hi, BLOCK_K):
            k1 = min(hi, k0 + BLOCK_K)
            s, _ = seq.scores(q0, q1, k0, k1)
            m_new = torch.maximum(m, s.amax(-1))
            # a row with no visible key yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            e = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + e.sum(-1)
            if p.dropout_p > 0:
                e = e * seq.keep(q0, q1, k0, k1) * (1.0 / (1.0 - p.dropout_p))
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(e, seq.v[..., k0:k1, :].to(seq.acc))
            m = m_new
        empty = l_sum == 0
        o = acc / torch.where(empty, torch.ones_like(l_sum), l_sum).unsqueeze(-1)
        row_lse = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log(l_sum))
        out[:, q0:q1] = o.permute(0, 3, 1, 2, 4).reshape(b, q1 - q0, seq.h, d_v).to(out.dtype)
        lse[:, :, q0:q1] = row_lse.reshape(b, seq.h, q1 - q0).to(lse.dtype)
        if probs is not None:
            for k0 in range(0, seq.sk, BLOCK_K):
                k1 = min(seq.sk, k0 + BLOCK_K)
                s, _ = seq.scores(q0, q1, k0, k1)
                pr = torch.exp(s - row_lse.unsqueeze(-1))
                if p.dropout_p > 0:  # FlashAttention's convention: dropped entries are negative
                    pr = torch.where(seq.keep(q0, q1, k0, k1), pr, -pr)
                probs[:, :, q0:q1, k0:k1] = pr.reshape(b, seq.h, q1 - q0, k1 - k0)


def _backward_dense(seq: _Seq, dout, out, lse, dq, dk, dv):
    """Write dq (b, sq, h, d), dk/dv (b, sk, hk, d) from dout/out (b, sq, h, d) and lse (b, h, sq)."""
    p = seq.p
    b, hk, g = seq.q.shape[:3]
    d = seq.q.shape[-1]
    acc = seq.acc
    do = dout.reshape(b, seq.sq, hk, g, dout.shape[-1]).permute(0, 2, 3, 1, 4).to(acc)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, seq.sq, hk, g).permute(0, 2, 3, 1)
    lse = lse.reshape(b, hk, g, seq.sq).to(acc)
    dq_acc = torch.zeros(b, hk, g, seq.sq, d, dtype=acc)
    dk_acc = torch.zeros(b, hk, seq.sk, d, dtype=acc)
    dv_acc = torch.zeros(b, hk, seq.sk, do.shape[-1], dtype=acc)
    scale = p.softmax_scale
    for q0 in range(0, seq.sq, BLOCK_Q):
        q1 = min(seq.sq, q0 + BLOCK_Q)
        lo, hi = _key_range(q0, q1, seq.sq, seq.sk, p)
        qt = seq.q[..., q0:q1, :].to(acc)
        dot = do[..., q0:q1, :]
        for k0 in range(lo, hi, BLOCK_K):
            k1 = min(hi, k0 + BLOCK_K)
            s, capped = seq.scores(q0, q1, k0, k1)
            pr = torch.exp(s - lse[..., q0:q1].unsqueeze(-1))
            vt = seq.v[..., k0:k1, :].to(acc)
            dp = torch.matmul(dot, vt.transpose(-1, -2))
            if p.dropout_p > 0:
                z = seq.keep(q0, q1, k0, k1) * (1.0 / (1.0 - p.dropout_p))
                dv_acc[:, :, k0:k1] += torch.matmul((pr * z).transpose(-1, -2), dot).sum(2)
                dp = dp * z
            else:
                dv_acc[:, :, k0:k1] += torch.matmul(pr.transpose(-1, -2), dot).sum(2)
            ds = pr * (dp - delta[..., q0:q1].unsqueeze(-1))
            if capped is not None:  # d/dx [c*tanh(x/c)] = 1 - tanh^2
                ds = ds * (1.0 - (capped / p.softcap) ** 2)
            ds = ds * scale
            dq_acc[..., q0:q1, :] += torch.matmul(ds, seq.k[..., k0:k1, :].to(acc))
            dk_acc[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt).sum(2)
    dq.copy_(dq_acc.permute(0, 3, 1, 2, 4).reshape(dq.shape))
    dk.copy_(dk_acc.permute(0, 2, 1, 3))
    dv.copy_(dv_acc.permute(0, 2, 1, 3))


def _sequences(q, p: AttnParams):
    """Yield (batch index, q rows slice, k rows slice) of each varlen sequence, honouring seqused."""
    cu_q = p.cu_seqlens_q.tolist()  # a host sync on CUDA: acceptable on this interim path only
    cu_k = p.cu_seqlens_k.tolist()
    used_q = p.seqused_q.tolist() if p.seqused_q is not None else None
    used_k = p.seqused_k.tolist() if p.seqused_k is not None else None
    for i in range(len(cu_q) - 1):
        lq = cu_q[i + 1] - cu_q[i] if used_q is None else min(used_q[i], cu_q[i + 1] - cu_q[i])
        lk = cu_k[i + 1] - cu_k[i] if used_k is None else min(used_k[i], cu_k[i + 1] - cu_k[i])
        yield i, slice(cu_q[i], cu_q[i] + lq), slice(cu_k[i], cu_k[i] + lk)


def _alibi_rows(p: AttnParams, batch: torch.Tensor, h: int):
    if p.alibi_slopes is None:
        return None
    s = p.alibi_slopes.float()
    return s.expand(len(batch), h) if s.dim() == 1 else s[batch]


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fwd(q, k, v, p: AttnParams):
    """Forward. Returns (out, lse, probs-or-None) with the contract's shapes."""
    with torch.device(q.device):
        return _fwd(q, k, v, p)


def bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    """Backward: writes into dq, dk, dv (which may be views into a packed gradient buffer)."""
    with torch.device(q.device):
        _bwd(dout, q, k, v, out, lse, p, dq, dk, dv)


def _fwd(q, k, v, p: AttnParams):
    h = q.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    want_probs = p.return_probs and p.dropout_p > 0
    if not p.varlen:
        b, sq = q.shape[:2]
        lse = torch.empty(b, h, sq, dtype=_lse_dtype(q))
        probs = torch.zeros(b, h, sq, k.shape[1]) if want_probs else None
        batch = torch.arange(b)
        _forward_dense(_Seq(q, k, v, p, batch, _alibi_rows(p, batch, h)), out, lse, probs)
        return out, lse, probs
    nb = p.cu_seqlens_q.numel() - 1
    lse = torch.full((h, q.shape[0]), float("inf"), dtype=_lse_dtype(q))
    probs = torch.zeros(nb, h, p.max_seqlen_q, p.max_seqlen_k) if want_probs else None
    for i, rq, rk in _sequences(q, p):
        if rq.stop == rq.start:
            continue
        batch = torch.tensor([i])
        seq = _Seq(q[rq].unsqueeze(0), k[rk].unsqueeze(0), v[rk].unsqueeze(0), p, batch,
                   _alibi_rows(p, batch, h))
        o = out[rq].unsqueeze(0)
        seq_lse = torch.empty(1, h, seq.sq, dtype=lse.dtype)
        pr = None if probs is None else probs[i : i + 1, :, : seq.sq, : seq.sk]
        _forward_dense(seq, o, seq_lse, pr)
        lse[:, rq] = seq_lse[0]
    return out, lse, probs


def _bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    h = q.shape[-2]
    if not p.varlen:
        batch = torch.arange(q.shape[0])
        seq = _Seq(q, k, v, p, batch, _alibi_rows(p, batch, h))
        _backward_dense(seq, dout, out, lse, dq, dk, dv)
        return
    dq.zero_()
    dk.zero_()
    dv.zero_()
    for i, rq, rk in _sequences(q, p):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue  # nothing attends: the zeroed gradients stand
        batch = torch.tensor([i])
        seq = _Seq(q[rq].unsqueeze(0), k[rk].unsqueeze(0), v[rk].unsqueeze(0), p, batch,
                   _alibi_rows(p, batch, h))
        seq_lse = lse[:, rq].unsqueeze(0)
        _backward_dense(seq, dout[rq].unsqueeze(0), out[rq].unsqueeze(0), seq_lse,
                        dq[rq].unsqueeze(0), dk[rk].unsqueeze(0), dv[rk].unsqueeze(0))
