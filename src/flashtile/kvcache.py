"""KV-cache inference: ``flash_attn_with_kvcache`` (FlashAttention 2.8.3) and ``flash_attn_combine`` (FA3).

``flash_attn_with_kvcache`` appends the new keys/values to the cache *in place*, applies the
rotary embedding to them and to q, and attends q to the updated cache, with paged caches of any
page size and split-KV decoding. ``dispatch`` picks the backend: CUDA tensors run the Triton kernels
(``backends/triton/decode``); CPU tensors run the PyTorch reference (``backends/reference_kvcache.py``),
or the kernels in Triton's interpreter when ``FLASHTILE_INTERPRET=1``.

The call is also the custom op ``torch.ops.flashtile.kvcache_fwd`` (mutating ``k_cache`` and
``v_cache``) with a fake implementation, so ``torch.compile(fullgraph=True)`` keeps it in the
graph. Argument checks read shapes, dtypes and devices only, never a CUDA tensor's values: a decode
step can be captured in a CUDA graph.
"""

import math

import torch

from flashtile import config, dispatch
from flashtile.backends.masking import normalize_window
from flashtile.fp8 import FP8_DTYPE
from flashtile.validation import (
    MAX_HEAD_DIM,
    bad_pages_in_use,
    check_alibi,
    check_chunk,
    check_descale,
    check_sink,
    last_dim_contiguous,
    window_tuple,
)

# v_cache's head dim may differ from k_cache's (FlashAttention-3): up to 512, the latent width of DeepSeek's MLA
MAX_V_HEAD_DIM = 512
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE)
_DTYPES = _KERNEL_DTYPES + (torch.float64,)  # float64 only on the CPU path


def _fail(msg: str, exc=ValueError):
    raise exc(f"flashtile.flash_attn_with_kvcache: {msg}")


def _use_kernels(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and config.get().interpret)


def _check_index(name: str, x, device, batch: int, what: str, rank: int = 1):
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be an int32 torch.Tensor {what}, got {type(x).__name__}", TypeError)
    if x.dtype != torch.int32:
        _fail(f"{name} must be int32, got {x.dtype}", TypeError)
    if x.dim() != rank or x.shape[0] != batch:
        _fail(f"{name} must have shape {what}, got {tuple(x.shape)}")
    if x.device != device:
        _fail(f"{name} must be on the same device as q ({device}), got {x.device}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_host_values(q, k_cache, cache_seqlens, cache_len_const, s_new, capacity, cache_batch_idx, cache_leftpad,
                       block_table):
    """Value checks that are free on CPU tensors (on CUDA they would be host syncs, so they are skipped)."""
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return
    lens = cache_seqlens.long() if cache_seqlens is not None else torch.tensor([cache_len_const])
    if (lens < 0).any():
        _fail(f"cache_seqlens must be >= 0, got {lens.tolist()}")
    if (lens + s_new > capacity).any():
        _fail(f"cache_seqlens + s_new exceeds the cache capacity {capacity}: cache_seqlens {lens.tolist()}, "
              f"s_new {s_new}")
    if cache_leftpad is not None and ((cache_leftpad < 0).any() or (cache_leftpad.long() > lens).any()):
        _fail(f"cache_leftpad must be in [0, cache_seqlens], got {cache_leftpad.tolist()}")
    if cache_batch_idx is not None and ((cache_batch_idx < 0).any() or (cache_batch_idx >= k_cache.shape[0]).any()):
        _fail(f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {cache_batch_idx.tolist()}")
    # only the pages a row uses, [leftpad, cache_seqlens + s_new): entries past them are never read
    # (the kernels mask them), so tables padded with -1 work as on the GPU
    if block_table is not None and block_table.numel() and bad_pages_in_use(
            block_table, cache_leftpad if cache_leftpad is not None else 0, lens + s_new, k_cache.shape[1],
            k_cache.shape[0]):
        _fail(f"block_table entries of the pages in use must be in [0, num_blocks={k_cache.shape[0]})")


def _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
         cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
         alibi_slopes, num_splits, q_descale=None, k_descale=None, v_descale=None, qv=None, learnable_sink=None,
         attention_chunk=0):
    """The checked call on the backend dispatch picks; returns (out (b, sq, h, dv), lse (b, h, sq))."""
    if q.device.type != "cpu" and q.dtype not in _KERNEL_DTYPES:
        _fail(f"no backend runs {q.dtype} tensors on {q.device} (the Triton kernels take fp16, bf16, fp32 and "
              "float8_e4m3fn on CUDA; the PyTorch path takes CPU tensors)", TypeError)
    # qv, the sink and the chunk only when given: every backend's kvcache takes them, and a call without them passes
    # exactly what it did before they existed
    extra = {} if qv is None else {"qv": qv}
    if learnable_sink is not None:
        extra["learnable_sink"] = learnable_sink
    if attention_chunk:
        extra["attention_chunk"] = attention_chunk
    return dispatch.kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const,
                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
                            window_right, softcap, rotary_interleaved, alibi_slopes, num_splits,
                            descales=(q_descale, k_descale, v_descale), **extra)


# The custom op: torch.compile sees one opaque node that mutates the caches; eager calls skip the
# op's dispatch overhead (microseconds matter in a decode step) and call _run directly.
@torch.library.custom_op("flashtile::kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def _kvcache_fwd_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                    v: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                    cache_seqlens: torch.Tensor | None, cache_len_const: int,
                    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
                    block_table: torch.Tensor | None, softmax_scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float, rotary_interleaved: bool,
                    alibi_slopes: torch.Tensor | None, num_splits: int, q_descale: torch.Tensor | None,
                    k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, qv: torch.Tensor | None = None,
                    learnable_sink: torch.Tensor | None = None, attention_chunk: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                    softcap, rotary_interleaved, alibi_slopes, num_splits, q_descale, k_descale, v_descale, qv,
                    learnable_sink, attention_chunk)
    return out.contiguous(), lse.contiguous()


@_kvcache_fwd_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
      cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      alibi_slopes, num_splits, q_descale, k_descale, v_descale, qv=None, learnable_sink=None, attention_chunk=0):
    b, sq, h, _ = q.shape
    dtype = torch.bfloat16 if q.dtype == FP8_DTYPE else q.dtype
    return q.new_empty((b, sq, h, v_cache.shape[-1]), dtype=dtype), q.new_empty((b, h, sq), dtype=torch.float32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            q_descale=None, k_descale=None, v_descale=None, qv=None, learnable_sink=None,
                            attention_chunk=0):
    """Attention of q to a KV cache, after appending new keys/values to it in place.

    Shapes (b = batch, sq = new query tokens, h / h_k = query / kv heads, h % h_k == 0, d <= 256,
    dv = v_cache's head dim <= 512, d unless given otherwise):
        q: (b, sq, h, d).
        k_cache: (b_cache, s_cache, h_k, d), v_cache: (b_cache, s_cache, h_k, dv); paged
            (``block_table`` given): (num_blocks, page_size, h_k, d / dv), any page size. Updated in place.
        k: (b, s_new, h_k, d), v: (b, s_new, h_k, dv), or None: written at ``cache_seqlens ..
            cache_seqlens + s_new``.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), rotary_dim <= d, seqlen_ro >= cache
            capacity. Rotate the new k at positions ``cache_seqlens + t`` and q at ``cache_seqlens + t``
            when causal or local, else all of q at ``cache_seqlens``. Need k and v.
        cache_seqlens: int or int32 (b,): tokens already in each row (absolute end index, counting
            any left padding). None: every row holds the full cache.
        cache_batch_idx: int32 (b,): cache row of each batch row (not with ``block_table``). Without
            it, batch row i uses cache row i (``b_cache >= b``; rows past b are left untouched).
        cache_leftpad: int32 (b,): first valid cache index of each row.
        block_table: int32 (b, max_blocks): pages of each row, in order. Entries past a row's pages
            in use are never read (they may be padding such as -1).
        causal / window_size / softcap / alibi_slopes ((h,) or (b, h) fp32): as in flash_attn_func,
            aligned bottom-right with key length ``cache_seqlens + s_new - cache_leftpad``.
        num_splits: 0 = heuristic, 1 = no split, n = n splits of the keys (split-KV decoding).
        q_descale, k_descale, v_descale: keyword-only, FlashAttention-3's fp8 extension: with
            ``torch.float8_e4m3fn`` q, caches and new k/v, fp32 (b, h_k) descales (None = 1.0);
            attention runs on ``x.float() * x_descale[batch row, kv head]`` and out is bf16. The
            new k/v are appended as they are (quantise them with the cache row's scale). No
            rotary, ``qv`` or dv != d with fp8.
        qv: keyword-only, FlashAttention-3's multi-head latent attention (MLA) in absorbed form:
            (b, sq, h, dv) in q's dtype, or None. The scores are ``(q . k + qv . v) * softmax_scale``
            (v serves as the latent half of the key and as the value; qv is not rotated), and
            softmax_scale defaults to ``1 / sqrt(d + dv)``. DeepSeek's layout: one kv head (the
            latent cache) shared by all query heads, d = 64 rope dims, dv = 512 latent dims.
        learnable_sink: keyword-only, attention sinks (gpt-oss; FlashAttention-CuTe's argument): (h,)
            float32 or q's dtype, or None. One logit per query head, in score units (after
            softmax_scale and softcap), that joins every row's softmax denominator with no value: out
            shrinks by the sink's share and lse includes it. Not with fp8.
        attention_chunk: keyword-only, Llama 4's chunked attention: an int >= 0 (0 = none). A query
            sees only the keys of its diagonal's chunk ``[c, c + attention_chunk)``, ``c = diag - diag
            mod attention_chunk`` (floored mod; positions counted from ``cache_leftpad`` as every mask
            here), on top of causal / window_size. Not with fp8.
    Returns out (b, sq, h, dv), or (out, softmax_lse) with lse fp32 (b, h, sq) when
    ``return_softmax_lse``; a row that sees no key gives out 0 and lse +inf (lse = the sink with
    ``learnable_sink``).

    Values inside index tensors (cache_seqlens + s_new <= capacity, cache_leftpad <= cache_seqlens,
    cache_batch_idx and the block_table pages in use within range) are checked on CPU. On CUDA that
    check would be a host sync, so it is skipped: values out of range there are undefined behaviour
    (wrong results or out-of-bounds reads), as in FlashAttention.
    """
    # -- tensors ---------------------------------------------------------------------------
    for name, x, layout in (("q", q, "(b, sq, h, d)"), ("k_cache", k_cache, "(b_cache, s_cache, h_k, d)"),
                            ("v_cache", v_cache, "(b_cache, s_cache, h_k, d)")):
        if not isinstance(x, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
        if x.dim() != 4:
            _fail(f"{name} must have 4 dims {layout}, got shape {tuple(x.shape)}")
    if q.dtype not in _DTYPES:
        _fail(f"q has unsupported dtype {q.dtype}; supported: float16, bfloat16, float32, float8_e4m3fn "
              "(float64 on CPU)", TypeError)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            _fail(f"{name} must have q's dtype {q.dtype}, got {x.dtype}", TypeError)
        if x.device != q.device:
            _fail(f"{name} must be on q's device {q.device}, got {x.device}")
        if x.stride(-1) != 1:
            # the cache is written in place, so a copy would lose the update
            _fail(f"{name} must have a contiguous last dim (stride 1), got strides {tuple(x.stride())}")
    b, sq, h, d = q.shape
    if v_cache.shape[:3] != k_cache.shape[:3]:
        _fail(f"v_cache must have k_cache's shape but for its head dim, {tuple(k_cache.shape[:3])} + (dv,), got "
              f"{tuple(v_cache.shape)}")
    h_k = k_cache.shape[2]
    dv = v_cache.shape[3]
    if k_cache.shape[3] != d:
        _fail(f"k_cache head dim {k_cache.shape[3]} does not match q head dim {d}")
    if d < 1 or d > MAX_HEAD_DIM:
        _fail(f"head dim d={d} is not supported; flashtile supports 1 <= d <= {MAX_HEAD_DIM}")
    if dv < 1 or dv > MAX_V_HEAD_DIM:
        _fail(f"v_cache head dim dv={dv} is not supported; flashtile supports 1 <= dv <= {MAX_V_HEAD_DIM}")
    if dv != d and q.dtype == FP8_DTYPE:
        _fail(f"v_cache head dim dv={dv} must equal d={d} with fp8 (e4m3) caches")
    if h_k < 1 or h % h_k != 0:
        _fail(f"number of query heads h={h} must be a multiple of the cache's kv heads h_k={h_k}")
    q = last_dim_contiguous(q)

    # -- paging / cache rows -----------------------------------------------------------------
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            _fail("block_table and cache_batch_idx cannot be used together (a paged cache maps rows "
                  "through block_table)")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            _fail("block_table must be an int32 tensor of shape (b, max_blocks_per_seq)", TypeError)
        block_table = _check_index("block_table", block_table, q.device, b, f"(b, max_blocks_per_seq) with b = {b}",
                                   rank=2)
        page_size = k_cache.shape[1]
        if page_size < 1:
            _fail(f"paged k_cache must have page_size >= 1, got shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]
        cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, q.device, b, f"(b,) = ({b},)")
        if cache_batch_idx is None and k_cache.shape[0] < b:
            # FlashAttention accepts a larger cache and uses its rows 0..b-1
            _fail(f"k_cache batch size {k_cache.shape[0]} is smaller than q batch size {b} (pass cache_batch_idx "
                  "to map batch rows to cache rows)")
    cache_leftpad = _check_index("cache_leftpad", cache_leftpad, q.device, b, f"(b,) = ({b},)")

    # -- new keys / values ---------------------------------------------------------------------
    if (k is None) != (v is None):
        _fail("k and v must be given together (or both None)")
    s_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}", TypeError)
            if x.dtype != q.dtype:
                _fail(f"{name} must have q's dtype {q.dtype}, got {x.dtype}", TypeError)
            if x.device != q.device:
                _fail(f"{name} must be on q's device {q.device}, got {x.device}")
            width, dim = ("d", d) if name == "k" else ("dv", dv)
            if x.dim() != 4 or x.shape[0] != b or x.shape[2] != h_k or x.shape[3] != dim:
                _fail(f"{name} must have shape (b, s_new, h_k, {width}) = ({b}, s_new, {h_k}, {dim}) to match q "
                      f"and the cache, got {tuple(x.shape)}")
        if v.shape[1] != k.shape[1]:
            _fail(f"v must have k's s_new = {k.shape[1]} new tokens, got shape {tuple(v.shape)}")
        if cache_seqlens is None:
            _fail("cache_seqlens must be given with new k/v (it says where to append them)")
        k, v = last_dim_contiguous(k), last_dim_contiguous(v)
        s_new = k.shape[1]

    # -- lengths --------------------------------------------------------------------------------
    cache_len_const = -1
    if isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, q.device, b, f"(b,) = ({b},)")
    elif cache_seqlens is None:
        cache_len_const = capacity  # every row holds the whole cache
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0 or cache_seqlens + s_new > capacity:
            _fail(f"cache_seqlens={cache_seqlens} plus s_new={s_new} must lie in [0, capacity={capacity}]")
        cache_len_const, cache_seqlens = cache_seqlens, None
    else:
        _fail(f"cache_seqlens must be an int or an int32 tensor of shape (b,), got {type(cache_seqlens).__name__}",
              TypeError)

    # -- fp8 ------------------------------------------------------------------------------------
    q_descale, k_descale, v_descale = (
        check_descale(name, x, q, b, h_k)
        for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    if q.dtype == FP8_DTYPE and q.device.type == "cuda":
        from flashtile.backends.triton.host import capability

        if capability(q.device) < (8, 9):
            _fail(f"fp8 (e4m3) caches need compute capability >= 8.9 (Ada / Hopper); {q.device} is "
                  f"{capability(q.device)}", TypeError)
    if q.dtype == FP8_DTYPE and rotary_cos is not None:
        _fail("rotary_cos/rotary_sin are not supported with fp8 (e4m3) inputs yet: rotate q and the new k "
              "before quantising them")

    # -- qv (multi-head latent attention) ---------------------------------------------------------
    if qv is not None:
        if not isinstance(qv, torch.Tensor):
            _fail(f"qv must be a torch.Tensor or None, got {type(qv).__name__}", TypeError)
        if q.dtype == FP8_DTYPE:
            _fail("qv is not supported with fp8 (e4m3) inputs", TypeError)
        if qv.dtype != q.dtype:
            _fail(f"qv must have q's dtype {q.dtype}, got {qv.dtype}", TypeError)
        if qv.device != q.device:
            _fail(f"qv must be on q's device {q.device}, got {qv.device}")
        if tuple(qv.shape) != (b, sq, h, dv):
            _fail(f"qv must have shape (b, sq, h, dv) = ({b}, {sq}, {h}, {dv}) (dv: v_cache's head dim), got "
                  f"{tuple(qv.shape)}")
        qv = last_dim_contiguous(qv)

    # -- rotary -----------------------------------------------------------------------------------
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            _fail("rotary_cos/rotary_sin need the new k and v to rotate (pass k and v)")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                _fail(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2)", TypeError)
            if not x.is_floating_point():
                _fail(f"{name} must be floating point, got {x.dtype}", TypeError)
            if x.device != q.device:
                _fail(f"{name} must be on q's device {q.device}, got {x.device}")
        if rotary_sin.shape != rotary_cos.shape:
            _fail(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim < 2 or rotary_dim > d:
            _fail(f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be even and in [2, d={d}]")
        if rotary_cos.shape[0] < capacity:
            _fail(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions; they need at least the cache "
                  f"capacity {capacity}")
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()

    # -- scalars ----------------------------------------------------------------------------------
    if softmax_scale is None:
        softmax_scale = (d if qv is None else d + dv) ** -0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        _fail(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        _fail(f"softcap must be a float >= 0, got {softcap!r}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        _fail(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
    window_left, window_right = normalize_window(window_tuple(window_size), bool(causal), capacity)
    alibi_slopes = check_alibi(alibi_slopes, q.device, b, h)
    learnable_sink = check_sink(learnable_sink, q)  # both refuse fp8, as flash_attn_func does
    attention_chunk = check_chunk(attention_chunk, q)

    _check_host_values(q, k_cache, cache_seqlens, cache_len_const, s_new, capacity, cache_batch_idx, cache_leftpad,
                       block_table)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_len_const, cache_batch_idx,
            cache_leftpad, block_table, float(softmax_scale), bool(causal), window_left, window_right, float(softcap),
            bool(rotary_interleaved), alibi_slopes, num_splits, q_descale, k_descale, v_descale, qv, learnable_sink,
            attention_chunk)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.flashtile.kvcache_fwd(*args)
    else:
        out, lse = _run(*args)
    return (out, lse) if return_softmax_lse else out


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge split attention results by their log-sum-exp (FlashAttention-3's ``flash_attn_combine``).

    out_partial: fp32 (num_splits, b, sq, h, d); lse_partial: fp32 (num_splits, b, sq, h) as in
    FlashAttention-3 (any strides; FA3's own kernels produce it as a transposed view), natural log,
    -inf for a split that saw no key. Returns ``(out, lse)``: out (b, sq, h, d) in ``out_dtype``
    (default out_partial's dtype), written into ``out`` when given, and lse fp32 (b, sq, h) (a
    transposed view of (b, h, sq) storage, as FA3 returns it), +inf where no split saw a key (out 0
    there).
    """
    if not isinstance(out_partial, torch.Tensor) or out_partial.dim() != 5:
        raise ValueError("flashtile.flash_attn_combine: out_partial must have shape (num_splits, b, sq, h, d)")
    ns, b, sq, h, d = out_partial.shape
    if not isinstance(lse_partial, torch.Tensor) or tuple(lse_partial.shape) != (ns, b, sq, h):
        raise ValueError(f"flashtile.flash_attn_combine: lse_partial must have shape (num_splits, b, sq, h) = "
                         f"({ns}, {b}, {sq}, {h}), got {tuple(getattr(lse_partial, 'shape', ()))}")
    if lse_partial.device != out_partial.device:
        raise ValueError("flashtile.flash_attn_combine: lse_partial must be on out_partial's device")
    for name, x in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if x.dtype != torch.float32:
            raise TypeError(f"flashtile.flash_attn_combine: {name} must be float32, got {x.dtype}")
    if ns < 1:
        raise ValueError("flashtile.flash_attn_combine: need at least one split")
    dtype = out_dtype or (out.dtype if out is not None else out_partial.dtype)
    if out is None:
        out = torch.empty(b, sq, h, d, device=out_partial.device, dtype=dtype)
    elif tuple(out.shape) != (b, sq, h, d) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"flashtile.flash_attn_combine: out must be a ({b}, {sq}, {h}, {d}) {dtype} tensor with a "
                         f"contiguous last dim")
    elif out.device != out_partial.device:
        raise ValueError(f"flashtile.flash_attn_combine: out must be on out_partial's device {out_partial.device}, "
                         f"got {out.device}")
    lse = torch.empty(b, h, sq, device=out_partial.device, dtype=torch.float32)
    out_partial = last_dim_contiguous(out_partial)
    lse_partial = lse_partial.permute(0, 1, 3, 2)  # the kernels' (ns, b, h, sq) view
    if _use_kernels(out_partial.device):
        from flashtile.backends.triton.decode import combine

        out, lse = combine(out_partial, lse_partial, out, lse)
        return out, lse.transpose(1, 2)
    lse_max = lse_partial.amax(0)
    empty = lse_max == float("-inf")
    w = torch.exp(lse_partial - torch.where(empty, 0.0, lse_max))  # (ns, b, h, sq)
    w_sum = w.sum(0)
    merged = (out_partial * w.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
    merged = merged / torch.where(empty, 1.0, w_sum).permute(0, 2, 1).unsqueeze(-1)
    out.copy_(merged.to(dtype))
    lse.copy_(torch.where(empty, float("inf"), lse_max + torch.log(torch.where(empty, 1.0, w_sum))))
    return out, lse.transpose(1, 2)
