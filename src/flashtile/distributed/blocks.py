"""The math of one step: run a step's kernel calls and fold them into the rank's running result.

Both the process-group functions (ring.py, zigzag.py, allgather.py) and the one-process simulation
(simulate.py) call these, so what a test checks in one process is what a ring of ranks computes.

Forward: each call's ``(out, lse)`` merges into fp32 (fp64 for fp64 inputs) accumulators by lse
(merge.py). Backward: each call runs the kernels' backward with the *merged* ``out`` and ``lse`` of its
rows, which makes its dq, dk, dv that call's exact share of the full gradient (the softmax of the whole
row is what the merged lse normalises); shares add up.

ALiBi: each call runs with its pieces' slope signs and corrects its lse by their shifts (alibi.py): the
forward subtracts ``slope * shift`` from the kernels' lse before merging, the backward hands the kernels
the merged lse plus ``slope * shift``, so both see the scores the kernel itself computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashtile.distributed.merge import merge_
from flashtile.distributed.plan import Call
from flashtile.flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)


@dataclass(frozen=True)
class Options:
    """The per-call kernel options every step shares."""

    softmax_scale: float
    softcap: float = 0.0
    deterministic: bool = False


@dataclass
class Bound:
    """A :class:`Call` bound to a batch size and device: a varlen call's row indices (into the flattened
    ``(b * n)`` rows of q and of the key block) and cumulative lengths, built once per forward; under
    ALiBi the kernels' slopes (``(b, h)``, or ``(b * pieces, h)`` per varlen sequence) and the lse shift
    ``slope * shift`` (``(b, h)``, or ``(rows, h)`` for a varlen call; None when every shift is 0)."""

    call: Call
    q_idx: Tensor | None = None
    k_idx: Tensor | None = None
    cu_q: Tensor | None = None
    cu_k: Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    slopes: Tensor | None = None
    shift: Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.q_idx is None


def bind(calls: list[Call], batch: int, nq: int, nk: int, device, alibi: Tensor | None = None,
         acc: torch.dtype = torch.float32) -> list[Bound]:
    """Bind a step's calls; single-piece calls stay slices, others get their index tensors (one copy to
    the device per call, made before the step loop so none lands between kernels). ``alibi``: checked
    slopes ``(h,)`` or ``(b, h)``; ``acc``: the accumulators' dtype, which the lse shifts take."""
    bound = []
    for call in calls:
        if len(call.pieces) == 1:
            bound.append(Bound(call))
        else:
            pieces = call.pieces
            q_one = torch.cat([torch.arange(p.q0, p.q1) for p in pieces])  # one batch row's rows, piece by piece
            k_one = torch.cat([torch.arange(p.k0, p.k1) for p in pieces])
            rows = torch.arange(batch)[:, None]
            q_idx = (rows * nq + q_one).flatten()
            k_idx = (rows * nk + k_one).flatten()
            lens_q = torch.tensor([p.q1 - p.q0 for p in pieces]).repeat(batch)
            lens_k = torch.tensor([p.k1 - p.k0 for p in pieces]).repeat(batch)
            cu_q = torch.cat([lens_q.new_zeros(1), lens_q.cumsum(0)]).to(torch.int32)
            cu_k = torch.cat([lens_k.new_zeros(1), lens_k.cumsum(0)]).to(torch.int32)
            bound.append(Bound(call, *(x.to(device) for x in (q_idx, k_idx, cu_q, cu_k)),
                               max(p.q1 - p.q0 for p in pieces), max(p.k1 - p.k0 for p in pieces)))
        if alibi is not None:
            bound[-1].slopes, bound[-1].shift = _alibi(call, alibi.expand(batch, alibi.shape[-1]), acc)
    return bound


def _alibi(call: Call, slopes: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The call's kernel slopes and lse shift from the rows' slopes ``(b, h)``."""
    pieces = call.pieces
    sign = torch.tensor([float(p.sign) for p in pieces], device=slopes.device)
    shift = torch.tensor([float(p.shift) for p in pieces], dtype=acc, device=slopes.device)
    if len(pieces) == 1:
        return (slopes * sign).contiguous(), (slopes.to(acc) * shift if pieces[0].shift else None)
    b, h = slopes.shape
    kernel = (slopes[:, None, :] * sign[None, :, None]).reshape(b * len(pieces), h)  # batch-major, as cu_q
    if not any(p.shift for p in pieces):
        return kernel, None
    lens = torch.tensor([p.q1 - p.q0 for p in pieces], device=slopes.device)
    per_row = (slopes.to(acc)[:, None, :] * shift[None, :, None]).repeat_interleave(lens, dim=1)
    return kernel, per_row.reshape(-1, h)


def _causal(call: Call) -> bool:
    return call.left == -1 and call.right == 0


def _rows(x: Tensor) -> Tensor:
    """``(b, n, ...)`` as ``(b * n, ...)``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def forward_step(acc_out: Tensor, acc_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, bound: list[Bound],
                 opt: Options) -> None:
    """Attend local ``q`` ``(b, nq, h, d)`` to the key block ``k, v`` ``(b, nk, h_k, d)`` and fold the
    result into ``acc_out`` ``(b, nq, h, dv)`` and ``acc_lse`` ``(b, nq, h)`` (merge convention)."""
    for bc in bound:
        c = bc.call
        if bc.dense:
            p = c.pieces[0]
            out, lse, _, _ = _flash_attn_forward(q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1], 0.0,
                                                 opt.softmax_scale, _causal(c), c.left, c.right, opt.softcap,
                                                 bc.slopes, False)
            lse = lse.transpose(1, 2)
            if bc.shift is not None:
                lse = lse.to(bc.shift.dtype) - bc.shift[:, None, :]
            merge_(acc_out[:, p.q0:p.q1], acc_lse[:, p.q0:p.q1], out, lse)
            continue
        out, lse, _, _ = _flash_attn_varlen_forward(
            _rows(q).index_select(0, bc.q_idx), _rows(k).index_select(0, bc.k_idx),
            _rows(v).index_select(0, bc.k_idx), bc.cu_q, bc.cu_k, bc.max_q, bc.max_k, 0.0, opt.softmax_scale,
            _causal(c), c.left, c.right, opt.softcap, bc.slopes)
        lse = lse.t()
        if bc.shift is not None:
            lse = lse.to(bc.shift.dtype) - bc.shift
        flat_out, flat_lse = _rows(acc_out), _rows(acc_lse)
        part_out, part_lse = flat_out.index_select(0, bc.q_idx), flat_lse.index_select(0, bc.q_idx)
        merge_(part_out, part_lse, out, lse)
        flat_out.index_copy_(0, bc.q_idx, part_out)
        flat_lse.index_copy_(0, bc.q_idx, part_lse)


def backward_step(dq: Tensor, dk: Tensor, dv: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                  out: Tensor, lse: Tensor, bound: list[Bound], opt: Options) -> None:
    """Add this step's gradient shares into ``dq`` (like q) and ``dk, dv`` (like the key block).

    ``out`` ``(b, nq, h, dv)`` and ``lse`` ``(b, h, nq)`` are the rows' merged results (FlashAttention's
    lse convention); ``dout`` is the gradient of ``out``.
    """
    for bc in bound:
        c = bc.call
        if bc.dense:
            p = c.pieces[0]
            qs, ks, vs = q[:, p.q0:p.q1], k[:, p.k0:p.k1], v[:, p.k0:p.k1]
            gq, gk, gv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
            lse_p = lse[:, :, p.q0:p.q1] if bc.shift is None else lse[:, :, p.q0:p.q1] + bc.shift[:, :, None]
            _flash_attn_backward(dout[:, p.q0:p.q1], qs, ks, vs, out[:, p.q0:p.q1], lse_p.contiguous(), gq, gk, gv,
                                 0.0, opt.softmax_scale, _causal(c), c.left, c.right, opt.softcap, bc.slopes,
                                 opt.deterministic)
            dq[:, p.q0:p.q1] += gq
            dk[:, p.k0:p.k1] += gk
            dv[:, p.k0:p.k1] += gv
            continue
        qs, ks, vs = (_rows(q).index_select(0, bc.q_idx), _rows(k).index_select(0, bc.k_idx),
                      _rows(v).index_select(0, bc.k_idx))
        gq, gk, gv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
        lse_rows = _rows(lse.transpose(1, 2)).index_select(0, bc.q_idx)
        if bc.shift is not None:
            lse_rows = lse_rows + bc.shift
        _flash_attn_varlen_backward(_rows(dout).index_select(0, bc.q_idx), qs, ks, vs,
                                    _rows(out).index_select(0, bc.q_idx), lse_rows.t().contiguous(), gq, gk, gv,
                                    bc.cu_q, bc.cu_k, bc.max_q, bc.max_k, 0.0, opt.softmax_scale, _causal(c), c.left,
                                    c.right, opt.softcap, bc.slopes, opt.deterministic)
        _rows(dq).index_add_(0, bc.q_idx, gq.to(dq.dtype))
        _rows(dk).index_add_(0, bc.k_idx, gk.to(dk.dtype))
        _rows(dv).index_add_(0, bc.k_idx, gv.to(dv.dtype))


def acc_dtype(x: Tensor) -> torch.dtype:
    """The accumulators' dtype for inputs like ``x``: fp64 for fp64, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def accumulators(q: Tensor, dv_dim: int) -> tuple[Tensor, Tensor]:
    """Zero ``out`` ``(b, nq, h, dv)`` and ``-inf`` ``lse`` ``(b, nq, h)`` in the accumulation dtype."""
    b, n, h = q.shape[:3]
    return (torch.zeros(b, n, h, dv_dim, dtype=acc_dtype(q), device=q.device),
            torch.full((b, n, h), float("-inf"), dtype=acc_dtype(q), device=q.device))


def grad_buffer(x: Tensor) -> Tensor:
    """A zero gradient accumulator like ``x`` in fp32 (fp64 for fp64 inputs)."""
    return torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device)
