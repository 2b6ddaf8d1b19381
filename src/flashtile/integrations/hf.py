"""Hugging Face transformers integration: flashtile as an attention implementation.

Importing this module registers the name ``"flashtile"`` in transformers' ``AttentionInterface``
(the attention function) and ``AttentionMaskInterface`` (which mask the model builds for it), so::

    import flashtile.integrations.hf  # noqa: F401  (registers "flashtile")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")

runs every attention layer through flashtile. Like transformers' FlashAttention-2 integration, the
model then hands the attention a 2-D padding mask ``(b, kv_len)`` (True = real token) instead of a
dense 4-D mask; padded batches are unpadded into flashtile's varlen layout and padded back.
Handled: padding (left or right), GQA/MQA, causal (bottom-right aligned, so decoding with a KV
cache works), sliding windows (``sliding_window=w``: each token sees itself and ``w - 1`` before),
logit softcapping, dropout, and packed sequences (several documents in one row), either passed as
``cu_seq_lens_q/k`` + ``max_length_q/k`` keywords or, as transformers' FlashAttention-2 path does
for ``DataCollatorWithFlattening``, read from ``position_ids`` that restart inside a row when there
is no padding mask. A dense 4-D mask (a caller's own) is accepted when it is a padding +
causal/window pattern shared by all heads; anything else raises.

Shapes (transformers' convention): query ``(b, h, sq, d)``, key/value ``(b, h_k, sk, d)``; the
function returns ``(out (b, sq, h, d), None)``.
"""

from __future__ import annotations

import torch

from flashtile.bert_padding import index_first_axis, pad_input, unpad_input
from flashtile.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["NAME", "flashtile_attention_forward", "flashtile_attention_mask", "register"]

NAME = "flashtile"


def flashtile_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                             attention_mask=None, **kwargs):
    """Mask builder transformers calls for "flashtile": the 2-D padding mask, or None if nothing is padded.

    ``attention_mask`` (b, seen + q_length) bool; it is cut to the last ``kv_length`` columns (a
    sliding-window cache keeps only the most recent keys). Causality and windows are not encoded here:
    the attention function gets them from the layer (``is_causal``, ``sliding_window``).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    # one host sync per forward (not per layer): lets unpadded batches take the dense fast path
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _window(causal: bool, sliding_window) -> tuple[int, int]:
    if sliding_window is None or sliding_window <= 0:
        return (-1, 0) if causal else (-1, -1)
    # transformers' sliding window of w: key j visible from query i iff i - w < j (<= i if causal)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _mask_from_4d(mask: torch.Tensor, sq: int, sk: int, causal: bool, window) -> torch.Tensor:
    """A dense (b, 1|h, sq, sk) mask -> the (b, sk) key padding it encodes; raises if it encodes more."""
    allowed_all = mask if mask.dtype == torch.bool else mask == 0  # (b, 1|h, sq, sk)
    allowed = allowed_all[:, 0]
    keys = allowed.any(dim=1)  # (b, sk): a key is real if some query may see it
    rows = torch.arange(sq, device=mask.device).view(sq, 1) + (sk - sq)
    cols = torch.arange(sk, device=mask.device).view(1, sk)
    band = torch.ones(sq, sk, dtype=torch.bool, device=mask.device)
    if window[0] >= 0:
        band &= cols >= rows - window[0]
    if window[1] >= 0:
        band &= cols <= rows + window[1]
    expect = band.unsqueeze(0) & keys.unsqueeze(1)
    # compare on rows of real queries only: transformers un-masks fully padded query rows
    real_q = keys[:, -sq:] if sq <= sk else torch.ones(mask.shape[0], sq, dtype=torch.bool, device=mask.device)
    per_head = (allowed_all != allowed_all[:, :1]).any()  # every head must see the same mask
    not_padding = ((expect != allowed) & real_q.unsqueeze(-1)).any()
    per_head, not_padding = torch.stack((per_head, not_padding)).tolist()  # one host sync for both checks
    if per_head:
        raise ValueError(f"flashtile: per-head 4-D attention masks are not supported (the mask of shape "
                         f"{tuple(mask.shape)} differs between heads); pass one mask for all heads (b, 1, sq, sk)")
    if not_padding:
        raise ValueError("flashtile: this 4-D attention mask is not a padding + causal/window pattern; the "
                         "flashtile attention takes 2-D padding masks (transformers builds one when the model "
                         "is loaded with attn_implementation='flashtile')")
    return keys


def _packed_cu_seqlens(position_ids, b: int, s: int):
    """(cu_seqlens int32 (n + 1,), max_seqlen) of the documents packed in (b, s) rows, or None if none are.

    A document starts where the position equals the smallest position id (0, or e.g. RoBERTa's
    ``padding_idx + 1``) and at the start of every row. Uses transformers'
    ``prepare_fa_kwargs_from_position_ids`` for a single flattened row when it exists.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != s or s < 2:
        return None
    if position_ids.shape[0] != b:
        if position_ids.shape[0] != 1:
            return None
        position_ids = position_ids.expand(b, s)
    starts = position_ids == position_ids.min()
    # one host sync for both: documents starting inside a row, and whether every row starts one
    inner, rows_start = torch.stack((starts[:, 1:].sum(), starts[:, 0].all().long())).tolist()
    if inner == 0:  # one document per row: not packed
        return None
    if b == 1 and rows_start:
        try:
            from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
        except ImportError:
            prepare_fa_kwargs_from_position_ids = None
        if prepare_fa_kwargs_from_position_ids is not None:
            (cu, _), (max_len, _) = prepare_fa_kwargs_from_position_ids(position_ids)
            return cu.to(torch.int32), int(max_len)
    starts[:, 0] = True  # a row never continues the previous row's document
    idx = starts.reshape(-1).nonzero().view(-1)
    cu = torch.cat((idx.to(torch.int32), torch.full((1,), b * s, dtype=torch.int32, device=idx.device)))
    return cu, int(cu.diff().max())


def flashtile_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers attention function backed by flashtile.

    Args:
        module: the attention layer (read for ``is_causal`` when not given).
        query: (b, h, sq, d); key, value: (b, h_k, sk, d) (h_k divides h: GQA/MQA).
        attention_mask: None, (b, sk) bool padding mask (True = real), or a dense 4-D mask (see module doc).
        dropout: attention dropout probability (transformers passes 0.0 in eval mode).
        scaling: softmax scale (default d ** -0.5).
        sliding_window: w > 0 restricts each query to the w most recent keys (itself included).
        softcap: logit softcapping (Gemma-2 style), None or 0 = off.
        is_causal: default ``module.is_causal`` (True when absent).

    Returns:
        (out (b, sq, h, d) in query's dtype, None): transformers reshapes it to (b, sq, h * d).
    """
    if kwargs.get("output_attentions", False):
        raise ValueError("flashtile: output_attentions=True needs attn_implementation='eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, h, sq, d = query.shape
    sk = key.shape[2]
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    dv = v.shape[-1]
    if dv != d:  # flashtile's kernels share one head dim; pad v (MLA-style models) and crop after
        v = torch.nn.functional.pad(v, (0, d - dv))
    # a single query row with bottom-right alignment sees every key: drop causal so it is not special-cased
    window = _window(causal and sq > 1, sliding_window)
    kw = dict(dropout_p=dropout, softmax_scale=scaling, causal=False, window_size=window,
              softcap=float(softcap) if softcap else 0.0)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and (cu_q is None or cu_k is None) and sq == sk:
        # transformers' FlashAttention-2 rule: without a padding mask, position_ids that restart inside
        # a row mark packed documents (DataCollatorWithFlattening); attend within each document only
        packed = _packed_cu_seqlens(kwargs.get("position_ids"), b, sq)
        if packed is not None:
            cu_q = cu_k = packed[0]
            kwargs = dict(kwargs, max_length_q=packed[1], max_length_k=packed[1])
    if attention_mask is None and cu_q is not None and cu_k is not None:
        # packed sequences (one row holding several documents): varlen over the flattened row
        out = flash_attn_varlen_func(q.reshape(-1, h, d), k.reshape(-1, k.shape[2], d), v.reshape(-1, v.shape[2], d),
                                     cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                                     int(kwargs["max_length_k"]), **kw)
        out = out.view(b, sq, h, d)
    elif attention_mask is None:
        out = flash_attn_func(q, k, v, **kw)
    else:
        if attention_mask.dim() == 4:
            attention_mask = _mask_from_4d(attention_mask, sq, sk, causal and sq > 1, window)
        key_mask = attention_mask[:, -sk:].bool()
        # the key mask is unpadded once (its host syncs: indices and max length); v and, for a
        # prefill, q reuse its indices
        k_unpad, k_idx, cu_k, max_k, _ = unpad_input(k, key_mask)
        v_unpad = index_first_axis(v.reshape(b * sk, *v.shape[2:]), k_idx)
        if sq == sk:
            q_unpad, q_idx, cu_q, max_q = index_first_axis(q.reshape(b * sq, h, d), k_idx), k_idx, cu_k, max_k
        elif sq == 1:  # decoding: every new token is real
            q_unpad, q_idx = q.reshape(b, h, d), None
            cu_q, max_q = torch.arange(b + 1, dtype=torch.int32, device=q.device), 1
        else:  # several new tokens over a cache: the last sq mask columns are theirs
            q_unpad, q_idx, cu_q, max_q, _ = unpad_input(q, key_mask[:, -sq:])
        out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **kw)
        out = out.view(b, sq, h, d) if q_idx is None else pad_input(out, q_idx, b, sq)
    if dv != d:
        out = out[..., :dv]
    return out, None


_REGISTERED: set[str] = set()


def _teach_flash_loader(name: str) -> None:
    """Let transformers' FlashAttention loader resolve ``name`` to flashtile's functions.

    transformers treats every attention name containing "flash" as a FlashAttention build and, when a
    model is created, imports that build's functions (``_lazy_imports``), falling back to downloading
    a Hub kernel named like the implementation; for "flashtile" that lookup fails. We answer the
    lookup for our names only and hand every other name to the original loader.
    """
    try:
        from transformers import modeling_flash_attention_utils as mfau
    except ImportError:
        return
    original = getattr(mfau, "_lazy_imports", None)
    if original is None or getattr(original, "_flashtile_names", None) is not None:
        if original is not None:
            original._flashtile_names.add(name)
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _lazy_imports._flashtile_names:
            try:
                from flashtile.kvcache import flash_attn_with_kvcache
            except ImportError:
                flash_attn_with_kvcache = None
            return (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, mfau._pad_input,
                    mfau._unpad_input)
        return original(implementation, *args, **kwargs)

    _lazy_imports._flashtile_names = {name}
    mfau._lazy_imports = _lazy_imports


def register(name: str = NAME) -> None:
    """Register flashtile under ``name`` in transformers' attention (and mask) interfaces. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, flashtile_attention_forward)
    if "flash" in name:
        _teach_flash_loader(name)
    _REGISTERED.add(name)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 builds a dense 4-D mask, which _mask_from_4d reads
        return
    AttentionMaskInterface.register(name, flashtile_attention_mask)


try:
    register()
except ImportError:  # transformers absent: importing the module must still work (docs, tests that skip)
    pass
