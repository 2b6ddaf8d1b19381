"""Padding helpers with the behaviour of FlashAttention 2.8.3's ``flash_attn.bert_padding``.

The varlen kernels take every sequence of a batch packed end to end along one "total tokens" axis,
described by ``cu_seqlens``. These helpers move between that packed layout and the padded
``(batch, seqlen, ...)`` layout, with autograd on both directions.

Shapes used below: ``b`` batch, ``s`` padded sequence length, ``total`` number of kept tokens,
``...`` any trailing dims (e.g. ``(h, d)`` or ``(d,)``).
"""

from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def _row_index(indices: torch.Tensor, width: int) -> torch.Tensor:
    # An expanded view gives gather/scatter the 2-D index they need without materialising
    # ``total * width`` int64s, which for (h, d) trailing dims would dwarf the data itself.
    return indices.to(torch.long).unsqueeze(1).expand(-1, width)


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along dim 0; backward scatters into zeros of the input's size."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        other_shape = input.shape[1:]
        width = other_shape.numel()
        flat = input.reshape(input.shape[0], width)
        out = torch.gather(flat, 0, _row_index(indices, width))
        return out.reshape(indices.shape[0], *other_shape)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        width = other_shape.numel()
        grad_flat = grad_output.reshape(grad_output.shape[0], width)
        grad_input = grad_output.new_zeros(ctx.first_axis_dim, width)
        # scatter_add rather than scatter: identical for the unique indices unpad_input produces, and
        # still the correct (accumulated) gradient if a caller repeats an index.
        grad_input.scatter_add_(0, _row_index(indices, width), grad_flat)
        return grad_input.reshape(ctx.first_axis_dim, *other_shape), None


class IndexPutFirstAxis(torch.autograd.Function):
    """Zeros of ``(first_axis_dim, ...)`` with ``values`` written at ``indices``; backward gathers."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        output = values.new_zeros(first_axis_dim, *values.shape[1:])
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        width = other_shape.numel()
        grad_flat = grad_output.reshape(grad_output.shape[0], width)
        grad_values = torch.gather(grad_flat, 0, _row_index(indices, width))
        return grad_values.reshape(indices.shape[0], *other_shape), None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input)``: the gathered rows plus the whole input as a residual output.

    Both outputs are differentiable; the input's gradient is the residual's gradient plus the gathered
    rows' gradient scattered back (a fused-MLP helper in FlashAttention uses this shape of op).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad_input = grad_residual.clone()
        grad_input.index_add_(0, indices.to(torch.long), grad_output)
        return grad_input, None


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor):
    """Returns ``(input[indices], input)`` with gradients flowing into ``input`` from both outputs.

    input: (n, ...); indices: (total,) -> ((total, ...), (n, ...)).
    """
    return IndexFirstAxisResidual.apply(input, indices)


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather rows of ``input`` along dim 0.

    Args:
        input: ``(n, ...)``.
        indices: ``(total,)`` integer indices into ``[0, n)``.

    Returns:
        ``(total, ...)`` equal to ``input[indices]``. The gradient w.r.t. ``input`` is ``(n, ...)``,
        zero at rows that were not gathered.
    """
    return IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Scatter rows of ``values`` into a fresh zero tensor.

    Args:
        values: ``(total, ...)``.
        indices: ``(total,)`` integer indices into ``[0, first_axis_dim)``, expected unique.
        first_axis_dim: size ``n`` of the output's first dim.

    Returns:
        ``(n, ...)`` with ``out[indices] = values`` and zeros elsewhere, same dtype/device as ``values``.
    """
    return IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the valid tokens of a padded batch along one axis.

    Args:
        hidden_states: ``(b, s, ...)``.
        attention_mask: ``(b, s)`` bool or int, nonzero = valid token.
        unused_mask: optional ``(b, s)`` bool or int, nonzero = token that is allocated but unused.
            Such tokens are kept in the packed output and counted in ``cu_seqlens`` /
            ``max_seqlen_in_batch`` but not in ``seqused``.

    Returns:
        A 5-tuple:

        - ``hidden_states_unpad``: ``(total, ...)``, the kept tokens (``attention_mask | unused_mask``)
          in row-major (batch, then position) order.
        - ``indices``: ``(total,)`` int64, positions of those tokens in the ``(b * s)`` flattening.
        - ``cu_seqlens``: ``(b + 1,)`` int32, ``0`` followed by the cumulative kept-token count per row.
        - ``max_seqlen_in_batch``: Python int, the largest kept-token count of a row.
        - ``seqused``: ``(b,)`` int32, the number of ``attention_mask`` tokens per row.
    """
    batch, seqlen = attention_mask.shape[:2]
    used = attention_mask.bool()
    kept = used if unused_mask is None else used | unused_mask.bool()
    seqlens_in_batch = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    # nonzero must sync to size its output; the .item() below is the only other host sync.
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if batch > 0 else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: scatter packed tokens back into a padded batch.

    Args:
        hidden_states: ``(total, ...)``.
        indices: ``(total,)`` positions in the ``(batch * seqlen)`` flattening, as from ``unpad_input``.
        batch: ``b``.
        seqlen: ``s``.

    Returns:
        ``(b, s, ...)`` with zeros at positions not listed in ``indices``.
    """
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Unpad rows that each hold several samples packed end to end.

    hidden_states: (b, s, ...); attention_mask_in_length: (b, s) int, row i listing the lengths of
    the samples packed into row i, then zeros (e.g. ``[2, 3, 0, 0, 0, 0]``: tokens 0-1 are one
    sample, 2-4 another, 5 is padding). Every sample becomes its own varlen sequence.
    Returns ``(hidden_states_unpad (total, ...), indices (total,), cu_seqlens int32 (n_samples + 1,),
    max_seqlen_in_batch int)``.
    """
    b, s = attention_mask_in_length.shape
    used = attention_mask_in_length.sum(-1)  # tokens in use per row
    keep = torch.arange(s, device=used.device).unsqueeze(0) < used.unsqueeze(1)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    flat_lengths = attention_mask_in_length.flatten()
    seqlens = flat_lengths[flat_lengths > 0].to(torch.int32)  # samples in row-major order
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(b * s, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen

