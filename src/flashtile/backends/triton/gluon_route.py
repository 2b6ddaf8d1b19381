"""Which forward calls take the Gluon Hopper kernel instead of the Triton one.

The Gluon kernel (kernels/gluon_fwd.py, docs/gluon.md) overlaps the softmax with the tensor cores,
which Triton 3.6 cannot express. It covers a narrow slice of the API (``refusal``), and within that
slice it is taken where ``ROUTE_TABLE`` says it measured faster than the Triton kernel on sm_90
(docs/forward.md, "Routes"). Everything else, and any GPU but sm_90, goes to Triton.

``config.gluon`` (FLASHTILE_GLUON=0) turns every Gluon route off; ``config.gluon_fwd`` forces this one on
(wherever the kernel can run) or off.
"""

from __future__ import annotations

import torch

from flashtile import config
from flashtile.backends.triton.host import MAX_GRID_Y, capability
from flashtile.backends.triton.tma import tma_ok
from flashtile.params import AttnParams

# The compute capabilities the kernel runs on (wgmma: sm_90 only).
CAPABILITIES = ((9, 0),)
DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# (dtype, head_dim) -> {plain causal mask: the shortest sequence that takes the Gluon kernel}; fp16 reads bf16's
# entries (the tensor cores run both at one rate, and the kernel differs only in its element type). bf16 d = 128:
# 1.06x-1.12x of the Triton kernel from s = 1024 (causal 0.98x at 1024, faster from 2048); d = 64 measured
# 0.87x-0.92x and stays on Triton. e4m3 d = 128 / 256: within 2% non-causal and 1%-12% ahead causal from
# 4096 tokens. bf16 q / k 192 with v 128 (the only pair with d != dv the kernel takes): 1.14x-1.36x of the
# Triton kernel from s = 1024, causal and not (H100; docs/models.md, "Measured"). Below these lengths the
# Triton kernel's short-sequence tiles keep the call.
# head dims whose padded plain / causal calls alone take the Gluon kernel: at d = 256 a softcap of 30 or a causal
# window of 1024 measured 0.63x-1.17x of the Triton kernel (slower at 2k tokens, faster at 8k; H100,
# scripts/ab_routes.py --d 256), plain causal 1.07x-1.11x; packed sequences there are neither timed nor GPU-tested
PLAIN_ONLY = (256,)
ROUTE_TABLE = {
    (torch.bfloat16, 128): {False: 1024, True: 2048},
    (torch.bfloat16, 192): {False: 1024, True: 1024},
    (torch.bfloat16, 256): {False: 1024, True: 2048},
    (torch.float8_e4m3fn, 128): {False: 4096, True: 4096},
    (torch.float8_e4m3fn, 256): {False: 4096, True: 4096},
}


def _aligned(x: torch.Tensor) -> bool:
    # the Triton forward's TMA test (empty tensors were refused above), plus the unit last stride
    # the Gluon descriptors also need
    return x.stride(-1) == 1 and tma_ok(x)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> str | None:
    """Why the Gluon kernel cannot compute this call exactly (None: it can), device aside."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (takes {DTYPES})"
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 and p.learnable_sink is not None:
        return "learnable_sink with fp8 inputs (the fp8 kernel has none)"
    if not p.softmax_scale > 0:
        # the kernel hides a masked score as -inf before scaling it: a zero or negative scale makes that NaN / +inf
        return f"softmax_scale {p.softmax_scale} (takes > 0)"
    batch = p.cu_seqlens_q.numel() - 1 if p.varlen else q.shape[0]
    if batch * q.shape[-2] > MAX_GRID_Y:
        return f"batch x heads = {batch * q.shape[-2]} > {MAX_GRID_Y} (the grid's second axis)"
    return coverage_refusal(q, k, v, p, FP8_HEAD_DIMS if fp8 else HEAD_DIMS, causal_window=not fp8, softcap=not fp8,
                            varlen=not fp8, alibi=not fp8, unequal_lengths=not fp8, varlen_k=not fp8)


# (q / k head dim, v head dim) pairs of the forward kernels: the 16-bit one splits 192 into 128 + 64 columns
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
FP8_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))


def _shared_cu_seqlens(p: AttnParams) -> bool:
    """q and k of a packed call share one cu_seqlens: the same tensor, or the same storage and length."""
    return p.cu_seqlens_q is p.cu_seqlens_k or (p.cu_seqlens_q.data_ptr() == p.cu_seqlens_k.data_ptr()
                                                and p.cu_seqlens_q.shape == p.cu_seqlens_k.shape)


def coverage_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams, dims,
                     causal_window: bool = False, softcap: bool = False, varlen: bool = False,
                     alibi: bool = False, unequal_lengths: bool = False, varlen_k: bool = False) -> str | None:
    """The Gluon kernels' shared coverage, dtype aside (the backward's route reuses it). ``dims``: the
    (q / k head dim, v head dim) pairs the kernel takes; ``causal_window``: it takes a causal sliding
    window (window_left >= 0, window_right == 0) too; ``softcap``: a softcap too; ``varlen``: packed
    sequences whose q and k share one cu_seqlens tensor (self-attention over packed documents); ``alibi``: ALiBi
    slopes too; ``unequal_lengths``: padded calls whose q and k differ in length (causal: k the longer);
    ``varlen_k``: packed k with sequences of its own (cu_seqlens_k, seqused_k), without a window, ALiBi or sink."""
    own_k = p.varlen and p.seqused_k is not None
    if p.varlen:
        if not varlen:
            return "varlen (packed) calls"
        # one cu_seqlens tensor for both: the sequences are q's (max_seqlen_k only bounds them), as own_k() says
        if not _shared_cu_seqlens(p):
            if not varlen_k:
                return "varlen calls whose q and k have different cu_seqlens"
            own_k = True
    elif q.dim() != 4:
        return "tensors that are neither (b, s, h, d) nor packed"
    if own_k and (p.window_left >= 0 or p.alibi_slopes is not None or p.learnable_sink is not None):
        return "a window, ALiBi or a learnable sink with k's own cu_seqlens / seqused_k"
    # attention_chunk is the Triton kernels' only (kernels/attn_fwd.py, kernels/attn_bwd.py; a chunk that
    # divides the sequence arrives here as a batch of chunks, chunk_batch.py). A learnable sink is covered:
    # the bf16 forward folds it into the denominator after its key loop, and the backward needs nothing
    # since the lse includes it (the fp8 forward has none: refusal() keeps such calls off it).
    if p.attention_chunk > 0:
        return "attention_chunk"
    if k.shape[:-1] != v.shape[:-1] or (q.shape[-1], v.shape[-1]) not in dims:
        return (f"head_dim and v's head_dim (d, dv) = {(q.shape[-1], v.shape[-1])}, not one of {dims}, or k and v of "
                "different shapes")
    if not p.varlen and q.shape[1] != k.shape[1]:
        if not unequal_lengths:
            return "seqlen_q != seqlen_k"
        # bottom-right causal with fewer keys than queries leaves rows with no key: the Triton kernel's case
        if p.window_right == 0 and k.shape[1] < q.shape[1]:
            return "causal with seqlen_k < seqlen_q"
    # plain or causal attention: causal arrives as the window (-1, 0), the bottom-right-aligned diagonal
    if p.window_right > 0 or (p.window_left >= 0 and not (causal_window and p.window_right == 0)):
        return "sliding windows" + (" other than causal ones (window_right = 0)" if causal_window else "")
    # return_probs without dropout returns no probabilities (as FlashAttention): nothing to refuse
    if p.softcap > 0 and not softcap:
        return "softcap"
    if p.alibi_slopes is not None and (not alibi or p.window_right != 0 or p.alibi_slopes.stride(-1) != 1):
        return ("ALiBi" if not alibi else "ALiBi without a causal mask" if p.window_right != 0
                else "ALiBi slopes with a non-unit last stride")
    if p.dropout_p > 0:
        return "dropout"
    if p.seqused_q is not None or (p.seqused_k is not None and not (varlen_k and p.varlen)):
        return "seqused_q / seqused_k"
    if q.numel() == 0 or k.numel() == 0:
        return "empty tensors"
    # e4m3 V is read transposed (fp8.v_keys_major: a view of quantize_qkv's layout, else a copy)
    loaded = (q, k) if q.dtype == torch.float8_e4m3fn else (q, k, v)
    if not all(_aligned(x) for x in loaded):
        return "strides that TMA cannot read (16-byte aligned base and strides, unit last stride)"
    return None


def preferred(q: torch.Tensor, p: AttnParams) -> bool:
    """Does ROUTE_TABLE take the Gluon kernel for this call? (causal: the window (-1, 0); varlen: its longest
    sequence). k with sequences of its own takes it with a softcap only: the Triton kernel was 1.02x-1.05x faster
    on plain / causal such calls, the Gluon one 1.04x-1.06x with a softcap of 30 (H100, d = 128, causal, 2k / 8k
    queries after as many cached keys; scripts/ab_routes.py --varlen --own-k)."""
    dtype = torch.bfloat16 if q.dtype == torch.float16 else q.dtype
    start = ROUTE_TABLE.get((dtype, q.shape[-1]))
    seqlen = p.max_seqlen_q if p.varlen else q.shape[1]
    if start is None or seqlen < start[p.window_right == 0]:
        return False
    if q.shape[-1] in PLAIN_ONLY and (p.softcap > 0 or p.window_left >= 0 or p.alibi_slopes is not None
                                      or p.varlen):
        return False
    return p.softcap > 0 or not own_k(p)


def use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams) -> bool:
    """Route this forward call to the Gluon kernel? (an sm_90 GPU, a call it covers, and the route
    table's choice or config.gluon_fwd's)."""
    settings = config.get()
    forced = settings.gluon_fwd
    if not settings.gluon or forced is False:
        return False
    # the cheap tests first: refusal() reads strides and pointers, on every forward call
    if not forced and not preferred(q, p):
        return False
    return q.device.type == "cuda" and capability(q.device) in CAPABILITIES and refusal(q, k, v, p) is None


def own_k(p: AttnParams) -> dict:
    """k's own sequences for the launcher, where the call has them (refusal() let them through)."""
    if not p.varlen:
        return {}
    kw = {} if _shared_cu_seqlens(p) else dict(cu_seqlens_k=p.cu_seqlens_k, max_seqlen_k=p.max_seqlen_k)
    return kw | ({"seqused_k": p.seqused_k} if p.seqused_k is not None else {})


def gluon_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams):
    """(out, lse, None) from the Gluon kernel, in the Triton launchers' return convention."""
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd, gluon_attn_fwd_fp8

    # causal is the window (-1, 0): p.causal may be False for an explicit window of that shape
    causal = p.window_right == 0
    if q.dtype == torch.float8_e4m3fn:
        from flashtile.fp8 import v_keys_major

        out, lse = gluon_attn_fwd_fp8(q, k, v_keys_major(v, varlen=False), p.q_descale, p.k_descale, p.v_descale,
                                      softmax_scale=p.softmax_scale, causal=causal)
    else:
        out, lse = gluon_attn_fwd(q, k, v, softmax_scale=p.softmax_scale, causal=causal,
                                  learnable_sink=p.learnable_sink, window_left=p.window_left, softcap=p.softcap,
                                  cu_seqlens=p.cu_seqlens_q, max_seqlen=p.max_seqlen_q, alibi_slopes=p.alibi_slopes,
                                  **own_k(p))
    return out, lse, None
