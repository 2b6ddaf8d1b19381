"""``attention_ref``: every semantic rule of the contract in plain PyTorch (any device, exact).

It materialises the full score matrix, so it is for checking, not for long sequences. Tests,
benchmarks and users compare the fast paths against it.
"""

from __future__ import annotations

import math

import torch

from flashtile.backends.masking import alibi_bias, normalize_window, visible


def _window_tuple(window_size) -> tuple[int, int]:
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.tolist()
    return int(window_size[0]), int(window_size[1])


def _pad_varlen(x: torch.Tensor, cu: list[int], max_len: int) -> torch.Tensor:
    """(total, h, d) + cu_seqlens -> (b, max_len, h, d), zero padded."""
    out = x.new_zeros(len(cu) - 1, max_len, *x.shape[1:])
    for i in range(len(cu) - 1):
        out[i, : cu[i + 1] - cu[i]] = x[cu[i] : cu[i + 1]]
    return out


def _unpad_varlen(x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """(b, max_len, ...) -> (total, ...), the inverse of :func:`_pad_varlen`."""
    return torch.cat([x[i, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)], dim=0)


def attention_ref(
    q,
    k,
    v,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_mask=None,
    softmax_scale=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_k=None,
    query_padding_mask=None,
    key_padding_mask=None,
    upcast=True,
    reorder_ops=False,
    probs_hook=None,
    qv=None,
    learnable_sink=None,
    attention_chunk=0,
):
    """Reference attention. Returns ``(out, lse)``.

    Padded: q ``(b, sq, h, d)``, k/v ``(b, sk, h_k, d)`` -> out ``(b, sq, h, d)``, lse ``(b, h, sq)``.
    Varlen (``cu_seqlens_q/k`` int32 ``(b+1,)`` given): q ``(total_q, h, d)``, k/v ``(total_k, h_k, d)``
    -> out ``(total_q, h, d)``, lse ``(h, total_q)``.

    ``query_padding_mask``/``key_padding_mask`` (b, s) bool (True = valid, valid tokens first) and
    ``seqused_k`` (b,) shorten the rows for the bottom-right alignment, as varlen does.
    ``dropout_mask`` (b, h, sq, sk) bool keep-mask (varlen: padded to the max lengths) applies
    dropout with ``dropout_p``; without it no dropout is applied. Rows that see no key give out 0
    and lse +inf. ``upcast=False`` computes in the input dtype (the "same precision PyTorch" run of
    the tolerance rule); ``reorder_ops`` scales k instead of q before the product. ``probs_hook``, a
    function of the (b, h, sq, sk) probabilities, runs just before ``P @ V`` (the fp8 reference uses it
    to round P the way the fp8 kernel does).

    Beyond FlashAttention 2.8.3 (FlashAttention-3 / its CuTe successor's semantics):
    - v may have its own head dim ``dv`` (``k``'s stays ``d``): out is ``(..., h, dv)``.
    - ``qv`` ``(b, sq, h, dv)`` (varlen ``(total_q, h, dv)``), MLA's absorbed form: scores gain
      ``qv . v``; the default scale is then ``1 / sqrt(d + dv)``.
    - ``learnable_sink`` ``(h,)``: one logit per query head (in score units, after the scale) that joins
      every row's softmax denominator; lse includes it (a row that sees no key gets lse = the sink and
      out 0). Gradients flow to it.
    - ``attention_chunk`` > 0: a query sees only the keys of its diagonal's chunk of that many tokens
      (``masking.visible``), on top of causal / window.
    """
    varlen = cu_seqlens_q is not None
    dtype = q.dtype
    d = q.shape[-1]
    dv = v.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d if qv is None else d + dv)
    if varlen:
        cu_q = [int(x) for x in cu_seqlens_q.tolist()]
        cu_k = [int(x) for x in cu_seqlens_k.tolist()]
        lens_q = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
        lens_k = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
        sq, sk = max(lens_q, default=0), max(lens_k, default=0)
        q = _pad_varlen(q, cu_q, sq)
        qv = _pad_varlen(qv, cu_q, sq) if qv is not None else None
        k = _pad_varlen(k, cu_k, sk)
        v = _pad_varlen(v, cu_k, sk)
    b, sq, h, _ = q.shape
    sk, h_k = k.shape[1], k.shape[2]
    if not varlen:
        lens_q = [sq] * b
        lens_k = [sk] * b
    if query_padding_mask is not None:
        lens_q = [int(x) for x in query_padding_mask.sum(-1).tolist()]
    if key_padding_mask is not None:
        lens_k = [int(x) for x in key_padding_mask.sum(-1).tolist()]
    if seqused_k is not None:
        lens_k = [int(x) for x in seqused_k.tolist()]
    left, right = normalize_window(_window_tuple(window_size), causal, sk)

    if upcast:  # to fp32, never down from fp64 (the brute-force tests run in fp64)
        wide = torch.promote_types(q.dtype, torch.float32)
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
        qv = qv.to(wide) if qv is not None else None
    if h_k != h:
        k = k.repeat_interleave(h // h_k, dim=2)
        v = v.repeat_interleave(h // h_k, dim=2)
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if qv is not None:
        scores = scores + torch.einsum("bthd,bshd->bhts", qv * scale, v)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap

    dev = q.device
    rows = torch.arange(sq, device=dev).view(1, 1, sq, 1)
    cols = torch.arange(sk, device=dev).view(1, 1, 1, sk)
    len_q = torch.tensor(lens_q, device=dev).view(b, 1, 1, 1)
    len_k = torch.tensor(lens_k, device=dev).view(b, 1, 1, 1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dev, torch.promote_types(scores.dtype, torch.float32))
        slopes = slopes.view(1, h, 1, 1) if slopes.dim() == 1 else slopes.view(b, h, 1, 1)
        scores = scores + alibi_bias(slopes, rows, cols, len_q, len_k).to(scores.dtype)
    ok = visible(rows, cols, len_q, len_k, left, right, int(attention_chunk))
    scores = scores.masked_fill(~ok, float("-inf"))

    wide_scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    empty = ~ok.any(dim=-1)  # rows that see no key (or do not exist)
    if learnable_sink is None:
        lse = torch.logsumexp(wide_scores, dim=-1).masked_fill(empty, float("inf"))
        probs = torch.softmax(scores, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    else:  # the sink's logit joins every row's denominator, as a key no value belongs to
        sink = learnable_sink.to(wide_scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        lse = torch.logsumexp(torch.cat([wide_scores, sink], dim=-1), dim=-1)
        lse = lse.masked_fill((rows >= len_q).squeeze(-1), float("inf"))  # rows that do not exist
        probs = torch.exp(wide_scores - lse.unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0).to(scores.dtype)
    if dropout_mask is not None and dropout_p > 0:
        probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    if probs_hook is not None:
        probs = probs_hook(probs)
    out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
    out = out.masked_fill(empty.permute(0, 2, 1).unsqueeze(-1), 0.0)

    if varlen:
        out = _unpad_varlen(out, cu_q)
        lse = _unpad_varlen(lse.permute(0, 2, 1), cu_q).permute(1, 0).contiguous()
    return out.to(dtype), lse
