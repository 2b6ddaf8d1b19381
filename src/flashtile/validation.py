"""Argument checks of the public API. Every error names the argument at fault.

Nothing here reads a CUDA tensor's values (that would be a host-device sync); only shapes, dtypes
and devices are checked. ``window_size`` given as a CUDA tensor is the one exception: its two
values have to reach the host.
"""

from __future__ import annotations

import math

import torch

from flashtile.backends.masking import normalize_window
from flashtile.params import AttnParams
from flashtile.rng import next_seed_offset

# float64 is for gradcheck on the CPU path; the kernels refuse it.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# FlashAttention-3's fp8 forward: flash_attn_func and flash_attn_varlen_func only (see fp8.py)
FP8_DTYPE = torch.float8_e4m3fn
MAX_HEAD_DIM = 256


def _fail(msg: str, exc=ValueError):
    raise exc(f"flashtile: {msg}")


def bad_pages_in_use(block_table: torch.Tensor, start, end, page_size: int, num_blocks: int) -> bool:
    """Whether a CPU ``block_table`` (b, max_blocks) names a page outside [0, num_blocks) among the
    pages each row uses, those holding its token positions [start, end) (int tensors broadcastable
    to (b,)). Entries outside them are never read, so they may be padding such as -1."""
    rows = block_table.shape[0]
    first = (torch.as_tensor(start).long() // page_size).expand(rows)[:, None]
    last = ((torch.as_tensor(end).long() + page_size - 1) // page_size).expand(rows)[:, None]
    cols = torch.arange(block_table.shape[1])
    used = (cols >= first) & (cols < last)
    return bool(((block_table < 0) | (block_table >= num_blocks))[used].any())


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride in the head dim; copy only when it is not already so."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_tensor(name: str, x, rank: int, layout: str, allow_fp8: bool = False):
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
    if x.dim() != rank:
        _fail(f"{name} must have {rank} dims {layout}, got shape {tuple(x.shape)}")
    if x.dtype == FP8_DTYPE and not allow_fp8:
        _fail(f"{name} is {x.dtype}: fp8 inputs are supported by flash_attn_func, flash_attn_varlen_func, their "
              f"kvpacked / qkvpacked forms and flash_attn_with_kvcache (forward only), not by this function",
              TypeError)
    if x.dtype not in SUPPORTED_DTYPES and not (allow_fp8 and x.dtype == FP8_DTYPE):
        names = ", ".join(str(t).replace("torch.", "") for t in SUPPORTED_DTYPES)
        _fail(f"{name} has unsupported dtype {x.dtype}; supported: {names}", TypeError)


def check_qkv(q, k, v, varlen: bool, allow_fp8: bool = False):
    """Check q/k/v ranks, dtypes, devices and shapes; return them with a contiguous last dim."""
    rank = 3 if varlen else 4
    check_tensor("q", q, rank, "(total_q, h, d)" if varlen else "(b, sq, h, d)", allow_fp8)
    check_tensor("k", k, rank, "(total_k, h_k, d)" if varlen else "(b, sk, h_k, d)", allow_fp8)
    check_tensor("v", v, rank, "(total_k, h_k, d)" if varlen else "(b, sk, h_k, d)", allow_fp8)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            _fail(f"q and {name} must have the same dtype, got q {q.dtype} and {name} {x.dtype}", TypeError)
        if x.device != q.device:
            _fail(f"q and {name} must be on the same device, got q on {q.device} and {name} on {x.device}")
    if v.shape[:-1] != k.shape[:-1]:
        _fail(f"v must have k's shape but for its head dim, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        _fail(f"k batch size {k.shape[0]} does not match q batch size {q.shape[0]}")
    d, h, h_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != d:
        _fail(f"k head dim {k.shape[-1]} does not match q head dim {d}")
    if d < 1 or d > MAX_HEAD_DIM:
        _fail(f"head dim d={d} is not supported; flashtile supports 1 <= d <= {MAX_HEAD_DIM}")
    dv = v.shape[-1]
    if dv < 1 or dv > MAX_HEAD_DIM:
        _fail(f"v head dim dv={dv} is not supported; flashtile supports 1 <= dv <= {MAX_HEAD_DIM}")
    if dv != d and q.dtype == FP8_DTYPE:
        _fail(f"fp8 inputs need v's head dim to equal k's, got d={d} and dv={dv}")
    if h_k < 1 or h % h_k != 0:
        _fail(f"number of query heads h={h} must be a multiple of key/value heads h_k={h_k}")
    # e4m3 V whose keys are contiguous (flashtile.fp8.quantize_qkv's layout) is kept as it is: the fp8
    # kernels read V transposed, and this layout is that transpose already (fp8.v_keys_major)
    keys_major_v = v.dtype == FP8_DTYPE and v.stride(0 if varlen else 1) == 1
    return last_dim_contiguous(q), last_dim_contiguous(k), v if keys_major_v else last_dim_contiguous(v)


def check_descale(name: str, x, q, batch: int, h_k: int):
    """An fp8 call's ``q/k/v_descale``: fp32 ``(b, h_k)`` on q's device, or None (= 1)."""
    if x is None:
        return None
    if q.dtype != FP8_DTYPE:
        _fail(f"{name} is only for fp8 ({FP8_DTYPE}) q/k/v, but q is {q.dtype}; drop {name} or pass e4m3 "
              f"inputs (flashtile.fp8.quantize_qkv makes both)", TypeError)
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a float32 torch.Tensor of shape (b, h_k), got {type(x).__name__}", TypeError)
    if x.dtype != torch.float32:
        _fail(f"{name} must be float32, got {x.dtype}", TypeError)
    if tuple(x.shape) != (batch, h_k):
        _fail(f"{name} must have shape (b, h_k) = ({batch}, {h_k}), got {tuple(x.shape)}")
    if x.device != q.device:
        _fail(f"{name} must be on the same device as q ({q.device}), got {x.device}")
    return x


def check_fp8(q, k, v, batch: int, dropout_p, q_descale, k_descale, v_descale, extra=()) -> dict:
    """The fp8-only rules; returns the descales as AttnParams fields (all None for other dtypes).

    fp8 is forward only (as in FlashAttention-3): a call that would record a graph for backward is
    refused here, at the forward, rather than failing obscurely later in ``.backward()``.
    """
    h_k = k.shape[-2]
    descales = {name: check_descale(name, x, q, batch, h_k)
                for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))}
    if q.dtype != FP8_DTYPE:
        return descales
    if isinstance(dropout_p, (int, float)) and dropout_p > 0:
        _fail(f"dropout_p must be 0 with fp8 inputs (the fp8 forward has no dropout), got {dropout_p}")
    if torch.is_grad_enabled():
        named = [("q", q), ("k", k), ("v", v), *descales.items(), *extra]
        wanting = [name for name, x in named if isinstance(x, torch.Tensor) and x.requires_grad]
        if wanting:
            _fail(f"fp8 attention is forward only (no backward, as in FlashAttention-3), but "
                  f"{', '.join(wanting)} require grad; call it under torch.no_grad() / torch.inference_mode() "
                  f"or pass detached tensors", RuntimeError)
    return descales


def check_cu_seqlens(name: str, cu, device, batch: int | None = None) -> int:
    """Check an int32 (b+1,) cumulative-length tensor; return b."""
    if not isinstance(cu, torch.Tensor):
        _fail(f"{name} must be an int32 torch.Tensor of shape (b+1,), got {type(cu).__name__}", TypeError)
    if cu.dtype != torch.int32:
        _fail(f"{name} must be int32, got {cu.dtype}", TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(f"{name} must have shape (b+1,), got {tuple(cu.shape)}")
    if cu.device != device:
        _fail(f"{name} must be on the same device as q ({device}), got {cu.device}")
    if batch is not None and cu.numel() != batch + 1:
        _fail(f"{name} must have length b+1 = {batch + 1}, got {cu.numel()}")
    return cu.numel() - 1


def check_seqused(name: str, x, device, batch: int):
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
        _fail(f"{name} must be an int32 tensor of shape (b,)", TypeError)
    if tuple(x.shape) != (batch,):
        _fail(f"{name} must have shape (b,) = ({batch},), got {tuple(x.shape)}")
    if x.device != device:
        _fail(f"{name} must be on the same device as q ({device}), got {x.device}")


def check_max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        _fail(f"{name} must be a non-negative int, got {value!r}", TypeError)
    return value


def window_tuple(window_size) -> tuple[int, int]:
    """Accept a tuple, list or 2-element tensor; check each bound is -1 or >= 0."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2:
            _fail(f"window_size must have 2 elements, got shape {tuple(window_size.shape)}")
        window_size = window_size.tolist()
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        _fail(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if left < -1 or right < -1:
        _fail(f"window_size bounds must be -1 (unbounded) or >= 0, got ({left}, {right})")
    return left, right


def check_alibi(alibi_slopes, device, batch: int, h: int):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        _fail("alibi_slopes must be a torch.Tensor of shape (h,) or (b, h)", TypeError)
    if alibi_slopes.dtype != torch.float32:
        _fail(f"alibi_slopes must be float32, got {alibi_slopes.dtype}", TypeError)
    if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
        _fail(f"alibi_slopes must have shape (h,) = ({h},) or (b, h) = ({batch}, {h}), "
              f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        _fail(f"alibi_slopes must be on the same device as q ({device}), got {alibi_slopes.device}")
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def check_sink(learnable_sink, q):
    """FlashAttention-CuTe's ``learnable_sink``: ``(h,)`` logits on q's device, float32 or q's dtype."""
    if learnable_sink is None:
        return None
    h = q.shape[-2]
    if not isinstance(learnable_sink, torch.Tensor):
        _fail(f"learnable_sink must be a torch.Tensor of shape (h,) = ({h},), got {type(learnable_sink).__name__}",
              TypeError)
    if q.dtype == FP8_DTYPE:
        _fail("learnable_sink is not supported with fp8 inputs (the fp8 forward has no sink)", TypeError)
    if learnable_sink.dtype not in (torch.float32, q.dtype):
        _fail(f"learnable_sink must be float32 or q's dtype {q.dtype}, got {learnable_sink.dtype}", TypeError)
    if tuple(learnable_sink.shape) != (h,):
        _fail(f"learnable_sink must have shape (h,) = ({h},), one logit per query head, "
              f"got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != q.device:
        _fail(f"learnable_sink must be on the same device as q ({q.device}), got {learnable_sink.device}")
    return learnable_sink if learnable_sink.stride(0) == 1 else learnable_sink.contiguous()


def check_chunk(attention_chunk, q) -> int:
    """FlashAttention-3's ``attention_chunk``: an int >= 0 (0 = no chunking)."""
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 0:
        _fail(f"attention_chunk must be an int >= 0 (0 = no chunking), got {attention_chunk!r}", TypeError)
    if attention_chunk and q.dtype == FP8_DTYPE:
        _fail("attention_chunk is not supported with fp8 inputs (the fp8 forward has no chunk mask)", TypeError)
    return attention_chunk


def make_params(
    q,
    *,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_probs,
    draw_rng: bool = True,
    learnable_sink=None,
    attention_chunk: int = 0,
    **varlen,
) -> AttnParams:
    """Check the scalar arguments shared by every function and build the call's AttnParams.

    ``draw_rng=False`` leaves seed/offset at 0: the autograd layer draws them itself, outside the
    custom ops, where torch.compile can trace the draw (see ops.py).
    """
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        _fail(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        _fail(f"softcap must be a float >= 0, got {softcap!r}")
    if softcap > 0 and dropout_p > 0:
        _fail("softcap > 0 cannot be combined with dropout_p > 0 (as in FlashAttention)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        _fail(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    left, right = normalize_window(window_tuple(window_size), bool(causal), max_seqlen_k)
    alibi = check_alibi(alibi_slopes, q.device, batch, q.shape[-2])
    seed, offset = next_seed_offset(q.device) if dropout_p > 0 and draw_rng else (0, 0)
    return AttnParams(
        softmax_scale=float(softmax_scale),
        causal=bool(causal),
        window_left=left,
        window_right=right,
        softcap=float(softcap),
        alibi_slopes=alibi,
        dropout_p=float(dropout_p),
        seed=seed,
        offset=offset,
        deterministic=bool(deterministic),
        return_probs=bool(return_probs),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        learnable_sink=check_sink(learnable_sink, q),
        attention_chunk=check_chunk(attention_chunk, q),
        **varlen,
    )
