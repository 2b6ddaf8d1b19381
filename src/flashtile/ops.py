"""flashtile's attention as ``torch.library`` custom ops, so torch.compile and CUDA graphs see it.

Three ops, all in the ``flashtile`` namespace:

``flashtile::attn_fwd(q, k?, v?, cu_seqlens_q?, cu_seqlens_k?, seqused_q?, seqused_k?, alibi_slopes?,
rng_state?, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
softcap, deterministic, return_probs, packing, q_descale?, k_descale?, v_descale?, learnable_sink?,
attention_chunk) -> (out, lse, S_dmask)``
    ``packing`` says how q/k/v arrive: ``PACK_NONE`` (three tensors), ``PACK_KV`` (``k`` is the
    packed ``kv``, ``v`` is None) or ``PACK_QKV`` (``q`` is the packed ``qkv``). Taking the packed
    tensor itself, rather than views of it, is what lets the backward return one packed gradient:
    autograd then has nothing to concatenate. ``lse`` is fp32 ``(b, h, sq)`` or ``(h, total_q)``
    (fp64 for fp64 inputs); ``S_dmask`` is fp32 ``(b, h, max_sq, max_sk)`` when ``dropout_p > 0``
    and ``return_probs``, else an empty tensor of q's dtype. fp8 (e4m3) q/k/v take the optional
    fp32 ``(b, h_k)`` descales (last, with defaults, so older positional calls still bind) and give
    a bf16 ``out``; the fp8 forward has no backward (the public functions refuse grad up front).
    ``learnable_sink`` ``(h,)`` and ``attention_chunk`` (FlashAttention-3 / CuTe features, params.py)
    come last; the sink's gradient is computed here from lse (:func:`sink_grad`), not by a backend.

``flashtile::attn_bwd(dout, q, k?, v?, out, lse, ...same tensors and scalars..., attention_chunk) -> (dq, dk, dv)``
    Functional: returns gradients shaped like the forward's tensor inputs (``dqkv`` / ``dkv`` for
    packed inputs, an empty tensor in the slots whose input was None). The packed gradient is
    allocated once and the backend writes into views of it.

``flashtile::attn_bwd_into(dout, q, k, v, out, lse, dq, dk, dv, ...) -> softmax_d``
    Writes into caller-given ``dq, dk, dv`` (FlashAttention's ``_flash_attn_backward`` contract);
    returns ``softmax_d`` = rowsum(dout * out), fp32, shaped like ``lse``.

Arguments are only what an op schema can carry (tensors, optional tensors, ints, floats, bools);
the ops rebuild :class:`AttnParams` from them and call ``dispatch.choose(op, q, params)``, so any
backend that plugs into dispatch runs under compile unchanged. Validation is *not* done here: it
raises Python errors, and the public functions run it before calling the op.

Dropout randomness: ``rng_state`` is an int64 ``(2,)`` tensor ``[seed, offset]`` drawn by the
caller (see :func:`draw_rng_state`), never inside an op: an op that drew its own seed would look
pure to the compiler (it could be deduplicated, or re-run with a new seed when the partitioner
recomputes it for the backward), and a seed read once at trace/capture time would be frozen into
every replay. The op only reads the two numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile import dispatch
from flashtile.first_order import first_order
from flashtile.params import AttnParams
from flashtile.rng import next_seed_offset

PACK_NONE, PACK_KV, PACK_QKV = 0, 1, 2
_U64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    """An unsigned 64-bit seed as the int64 with the same bits (op ints and int64 tensors are signed)."""
    x &= _U64
    return x - (1 << 64) if x >= (1 << 63) else x


def draw_rng_state(device: torch.device) -> Tensor:
    """Draw one dropout call's ``[seed, offset]`` as an int64 ``(2,)`` CPU tensor.

    Eager: from torch's generator of ``device`` through :func:`flashtile.rng.next_seed_offset` (on
    CUDA the device's Philox generator, so ``torch.manual_seed`` reproduces the mask, as in
    FlashAttention). Under torch.compile the draw is a ``torch.randint`` *in the graph*: each run
    of the compiled code draws fresh numbers (a Python int would be burnt into the graph as a
    constant), and the compiler knows ``randint`` is random, so it never merges two draws nor
    recomputes one for the backward. The tensor lives on the CPU so the op reads it without a
    device sync; it is tiny and drawn once per call.
    """
    if torch.compiler.is_compiling():
        return torch.randint(0, 1 << 62, (2,), dtype=torch.int64)
    seed, offset = next_seed_offset(device)
    return torch.tensor([_signed64(seed), offset], dtype=torch.int64)


def _seed_offset(rng_state: Tensor | None, dropout_p: float) -> tuple[int, int]:
    if dropout_p <= 0:
        return 0, 0
    if rng_state is None:
        raise ValueError("flashtile: dropout_p > 0 needs rng_state (the [seed, offset] of the forward)")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # The kernels take the seed by value: one read now would be frozen into every replay, giving
        # the same dropout mask each step. Refuse rather than train on a silently fixed mask.
        raise RuntimeError("flashtile: dropout_p > 0 is not supported inside CUDA graph capture yet (the seed "
                           "would be fixed at capture time); use dropout_p=0 in captured code")
    seed, offset = rng_state.tolist()  # CPU tensor: no device sync
    return seed & _U64, offset


def unpack(q: Tensor, k: Tensor | None, v: Tensor | None, packing: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views ``q, k, v`` of packed inputs: the pack dim is 2 for ``(b, s, n, h, d)``, 1 for varlen."""
    if packing == PACK_QKV:
        return q.unbind(q.dim() - 3)
    if packing == PACK_KV:
        k, v = k.unbind(k.dim() - 3)
    return q, k, v


def params_from_args(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, deterministic, return_probs, q_descale=None, k_descale=None,
                     v_descale=None, learnable_sink=None, attention_chunk=0) -> AttnParams:
    seed, offset = _seed_offset(rng_state, dropout_p)
    return AttnParams(softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                      window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      seqused_q=seqused_q, seqused_k=seqused_k, deterministic=deterministic,
                      return_probs=return_probs, q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale, learnable_sink=learnable_sink, attention_chunk=attention_chunk)


def _out_dtype(q: Tensor) -> torch.dtype:
    # FlashAttention-3: fp8 inputs give a bf16 output
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q: Tensor, varlen: bool) -> tuple:
    # q here is unpacked: (b, sq, h, d) or (total_q, h, d)
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _probs_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> tuple:
    if cu_seqlens_q is not None:
        return (cu_seqlens_q.shape[0] - 1, q.shape[-2], max_seqlen_q, max_seqlen_k)
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


# ---------------------------------------------------------------------------------------------- fwd

@torch.library.custom_op("flashtile::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor | None, v: Tensor | None, cu_seqlens_q: Tensor | None,
             cu_seqlens_k: Tensor | None, seqused_q: Tensor | None, seqused_k: Tensor | None,
             alibi_slopes: Tensor | None, rng_state: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
             dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
             softcap: float, deterministic: bool, return_probs: bool,
             packing: int, q_descale: Tensor | None = None, k_descale: Tensor | None = None,
             v_descale: Tensor | None = None, learnable_sink: Tensor | None = None,
             attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return attn_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                         max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                         softcap, deterministic, return_probs, packing, q_descale, k_descale, v_descale,
                         learnable_sink, attention_chunk)


def attn_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                  softcap, deterministic, return_probs, packing, q_descale=None, k_descale=None, v_descale=None,
                  learnable_sink=None, attention_chunk=0):
    """The body of ``flashtile::attn_fwd`` as a plain function (eager calls skip the op dispatcher)."""
    q, k, v = unpack(q, k, v, packing)
    p = params_from_args(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                         max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic, return_probs, q_descale, k_descale, v_descale,
                         learnable_sink, attention_chunk)
    out, lse, probs = dispatch.forward(q, k, v, p)
    # pin dtypes to what the fake impl promises, whatever a backend chose
    lse = lse.to(_lse_dtype(q))
    if probs is None:
        probs = q.new_empty(0)
    else:
        probs = probs.to(torch.float32)
    return out, lse, probs


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                   softcap, deterministic, return_probs, packing, q_descale=None, k_descale=None,
                   v_descale=None, learnable_sink=None, attention_chunk=0):
    q, k, v = unpack(q, k, v, packing)
    out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=_out_dtype(q))
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=_lse_dtype(q))
    if return_probs and dropout_p > 0:
        probs = q.new_empty(_probs_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k), dtype=torch.float32)
    else:
        probs = q.new_empty(0)
    return out, lse, probs


# ---------------------------------------------------------------------------------------------- bwd

def _bwd_params(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
                max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                deterministic, attention_chunk=0) -> AttnParams:
    # no learnable_sink: the backends' backward needs only lse, which already includes it
    return params_from_args(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state,
                            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                            window_right, softcap, deterministic, False, attention_chunk=attention_chunk)


def _backend_bwd(dout, q, k, v, out, lse, p: AttnParams, dq, dk, dv):
    """Write dq, dk, dv (unpacked views) on the chosen backend."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dispatch.backward(dout, q, k, v, out, lse, p, dq, dk, dv)


def _packed_bwd(dout, q, k, v, out, lse, p: AttnParams, packing: int):
    """Gradients shaped like the op's tensor inputs (packed ones whole) for one backward."""
    grads, views = _grad_buffers(q, k, v, packing)
    _backend_bwd(dout, *unpack(q, k, v, packing), out, lse, p, *views)
    return grads


def _grad_buffers(q, k, v, packing):
    """Gradient tensors shaped like the op's tensor inputs, and the unpacked views to write into."""
    if packing == PACK_QKV:
        dqkv = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return (dqkv, q.new_empty(0), q.new_empty(0)), dqkv.unbind(q.dim() - 3)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if packing == PACK_KV:
        dkv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        return (dq, dkv, q.new_empty(0)), (dq, *dkv.unbind(k.dim() - 3))
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return (dq, dk, dv), (dq, dk, dv)


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, q: Tensor, k: Tensor | None, v: Tensor | None, out: Tensor, lse: Tensor,
             cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, seqused_q: Tensor | None,
             seqused_k: Tensor | None, alibi_slopes: Tensor | None, rng_state: Tensor | None,
             max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
             window_left: int, window_right: int, softcap: float, deterministic: bool,
             packing: int, attention_chunk: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return attn_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                         rng_state, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic, packing, attention_chunk)


def attn_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                  rng_state, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                  window_right, softcap, deterministic, packing, attention_chunk=0):
    """The body of ``flashtile::attn_bwd`` as a plain function (eager calls skip the op dispatcher)."""
    p = _bwd_params(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                    deterministic, attention_chunk)
    return _packed_bwd(dout, q, k, v, out, lse, p, packing)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                   rng_state, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                   window_right, softcap, deterministic, packing, attention_chunk=0):
    return _grad_buffers(q, k, v, packing)[0]


@torch.library.custom_op("flashtile::attn_bwd_into", mutates_args=("dq", "dk", "dv"))
def attn_bwd_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor,
                  dk: Tensor, dv: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                  seqused_q: Tensor | None, seqused_k: Tensor | None, alibi_slopes: Tensor | None,
                  rng_state: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                  softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                  deterministic: bool, attention_chunk: int = 0) -> Tensor:
    p = _bwd_params(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                    deterministic, attention_chunk)
    _backend_bwd(dout, q, k, v, out, lse, p, dq, dk, dv)
    return _softmax_d(dout, out, cu_seqlens_q is not None)


def _softmax_d(dout, out, varlen):
    """rowsum(dout * out) laid out like lse: FlashAttention's backward returns it as ``softmax_d``."""
    d = (dout.float() * out.float()).sum(-1)  # (b, sq, h) or (total, h)
    return d.t().contiguous() if varlen else d.transpose(1, 2).contiguous()


@attn_bwd_into.register_fake
def _attn_bwd_into_fake(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                        alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                        window_left, window_right, softcap, deterministic, attention_chunk=0):
    return q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


def sink_grad(learnable_sink, lse, dout, out, varlen: bool):
    """The gradient of ``learnable_sink`` ``(h,)``: out = sum_j P_j v_j with the sink in the denominator, so
    d out / d sink = -P_sink * out and d loss / d sink = -sum over rows of exp(sink - lse) * rowsum(dout * out).
    Rows that saw nothing have lse = +inf (no sink) or out = 0, and add 0. Where the Triton backend runs
    the backward, one kernel pass computes it (kernels/sink_grad.py); else PyTorch does."""
    if out.dtype != torch.float64 and dispatch.choose("bwd", out, None).NAME == "triton":
        from flashtile.backends.triton.sink_grad import sink_grad_triton

        return sink_grad_triton(learnable_sink, lse, dout, out, varlen)
    acc = torch.promote_types(lse.dtype, torch.float32)  # fp64 for gradcheck's fp64 inputs
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (b, sq, h) or (total_q, h)
    delta = delta.t() if varlen else delta.transpose(1, 2)
    sink = learnable_sink.to(acc)
    if varlen:  # lse (h, total_q)
        return (-(torch.exp(sink[:, None] - lse.to(acc)) * delta).sum(1)).to(learnable_sink.dtype)
    # lse (b, h, sq)
    return (-(torch.exp(sink[None, :, None] - lse.to(acc)) * delta).sum((0, 2))).to(learnable_sink.dtype)


# ----------------------------------------------------------------------------------------- autograd

_FWD_TENSORS = 9  # q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, rng_state
_FWD_SCALARS = 9  # max_seqlen_q .. deterministic; then return_probs (forward-only), packing, descales
_SINK = _FWD_TENSORS + _FWD_SCALARS + 5  # learnable_sink's position, attention_chunk's after it


def _setup_context(ctx, inputs, output):
    out, lse, probs = output
    ctx.save_for_backward(*inputs[:_FWD_TENSORS], out, lse)
    # max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
    # deterministic (return_probs is forward-only), packing; the fp8 descales are not saved: fp8 has no
    # backward and the public functions refuse to record a graph for it
    ctx.scalars = inputs[_FWD_TENSORS:_FWD_TENSORS + _FWD_SCALARS]
    ctx.packing = inputs[_FWD_TENSORS + _FWD_SCALARS + 1]
    extras = inputs[_SINK:]  # learnable_sink, attention_chunk (absent when a caller left the defaults)
    ctx.sink = extras[0] if extras else None
    ctx.chunk = extras[1] if len(extras) > 1 else 0
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse, probs)


def _input_grads(ctx, dout, bwd):
    q, k, v, cu_q, cu_k, su_q, su_k, alibi, rng, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, su_q, su_k, alibi, rng, *ctx.scalars, ctx.packing,
                     ctx.chunk)
    # inputs that were None (packed slots) get None; past the tensors only the sink is differentiable
    grads = [dq, dk if k is not None else None, dv if v is not None else None] + [None] * (ctx.n_inputs - 3)
    if ctx.sink is not None:
        grads[_SINK] = sink_grad(ctx.sink, lse, dout, out, cu_q is not None)
    return tuple(grads)


def _backward(ctx, dout, _dlse, _dprobs):
    return _input_grads(ctx, dout, torch.ops.flashtile.attn_bwd)


torch.library.register_autograd("flashtile::attn_fwd", _backward, setup_context=_setup_context)


def traced(x: Tensor) -> bool:
    """True when the op itself must be called: torch.compile, or a tracer / tensor subclass that
    needs its fake implementation (FakeTensor, meta tensors, make_fx and other dispatch modes)."""
    return (torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_meta
            or torch._C._len_torch_dispatch_stack() > 0)


def bwd_op_scalars(p: AttnParams) -> tuple:
    """The trailing scalars of ``flashtile::attn_bwd`` / ``attn_bwd_into`` (after the tensors)."""
    return (p.max_seqlen_q, p.max_seqlen_k, p.dropout_p, p.softmax_scale, p.causal, p.window_left,
            p.window_right, p.softcap, p.deterministic)


class EagerAttention(torch.autograd.Function):
    """``flashtile::attn_fwd`` with its registered autograd formula, without the op dispatcher.

    Eager training calls take this (through :func:`eager_attention`); torch.compile traces the op
    instead (``attention`` in autograd.py picks). Same backend calls with the same parameters, so
    the results are the op's bit for bit (tests/test_eager_autograd.py). What it saves is host time,
    which short training steps are bound by (docs/backward.md): the op carries a call's parameters
    as 23 separate arguments, fills their defaults and rebuilds its AttnParams on both sides, while
    this Function takes the checked call's AttnParams as they are and keeps them for the backward.
    The tensors inside them (cu_seqlens, seqused, ALiBi slopes) are saved too, so an in-place change
    between forward and backward fails as it does on the op path.
    """

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, p: AttnParams, packing: int, rng_state):
        # p is this call's own (autograd.padded_params / varlen_params built it): the dropout draw
        # goes into it as attn_fwd_impl's params_from_args would put it. learnable_sink is p's own,
        # passed again so autograd sees it as an input with a gradient.
        p.seed, p.offset = _seed_offset(rng_state, p.dropout_p)
        qu, ku, vu = unpack(q, k, v, packing)
        out, lse, probs = dispatch.forward(qu, ku, vu, p)
        if lse.dtype != _lse_dtype(qu):
            lse = lse.to(_lse_dtype(qu))
        if not p.return_probs:
            probs = None  # never returned to the caller: no allocation (the op returns an empty tensor)
        elif probs is None:
            probs = qu.new_empty(0)
        else:
            probs = probs.to(torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k,
                              p.alibi_slopes, learnable_sink)
        ctx.p, ctx.packing, ctx.rng_state = p, packing, rng_state
        ctx.mark_non_differentiable(*(x for x in (lse, probs) if x is not None))
        # lse and probs are not differentiable: their gradients are never read, so the engine need
        # not allocate and zero-fill them on every backward
        ctx.set_materialize_grads(False)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout, _dlse, _dprobs):
        # (unpacking the saved tensors checks none was modified in place since the forward)
        q, k, v, out, lse, *_, sink = ctx.saved_tensors
        p, packing = ctx.p, ctx.packing
        if dout is None:  # not materialised: a zero gradient reached the output, as the op path sees it
            dout = torch.zeros_like(out)
        if traced(dout):  # a tracer in the backward: the op, for its fake implementation
            dq, dk, dv = torch.ops.flashtile.attn_bwd(
                dout, q, k, v, out, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k, p.alibi_slopes,
                ctx.rng_state, *bwd_op_scalars(p), packing, p.attention_chunk)
            dsink = None if sink is None else sink_grad(sink, lse, dout, out, p.varlen)
        else:
            # what attn_bwd_impl runs, with the forward's parameters; the kernels' gradients have no derivative, so a
            # second derivative raises (first_order.py), as the op path does, never comes back as zero
            def compute():
                grads = _packed_bwd(dout, q, k, v, out, lse, p, packing)
                return (*grads, None if sink is None else sink_grad(sink, lse, dout, out, p.varlen))

            dq, dk, dv, dsink = first_order(compute, dout, q, k, v, out, lse, sink)
        return dq, dk if k is not None else None, dv if v is not None else None, dsink, None, None, None


# Function.apply's own preamble (a signature check, and a generator over every argument to unwrap
# dead functorch wrappers) costs microseconds per call; eager_attention does the same work for the
# three tensors it has and calls the C++ apply directly.
_FUNCTION_APPLY = super(torch.autograd.Function, EagerAttention).apply


def eager_attention(q, k, v, p: AttnParams, packing: int, rng_state):
    """``EagerAttention.apply(q, k, v, p.learnable_sink, p, packing, rng_state)``: ``(out, lse, probs-or-None)``."""
    sink = p.learnable_sink
    if torch._C._are_functorch_transforms_active():
        # Function.apply's own path, which raises its error: this Function has no setup_context,
        # so torch.func transforms are not supported (the op path refuses them the same way)
        return EagerAttention.apply(q, k, v, sink, p, packing, rng_state)
    unwrap = torch._C._functorch.unwrap_if_dead
    return _FUNCTION_APPLY(unwrap(q), k if k is None else unwrap(k), v if v is None else unwrap(v),
                           sink if sink is None else unwrap(sink), p, packing, rng_state)
