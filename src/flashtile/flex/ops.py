"""flashtile.flex's custom ops, so torch.compile(fullgraph=True) and CUDA graphs see one opaque call.

``flashtile::flex_fwd(q, k, v, <block mask's eight tensors>, bufs, scale, key, block_q, block_kv, tiles)
-> (out, lse)`` and ``flashtile::flex_bwd(dout, dlse, q, k, v, out, lse, <eight>, bufs, scale, key, block_q,
block_kv, buffer_grads, tiles) -> (dq, dk, dv, dbufs)``. The mods are functions, which an op schema
cannot carry: ``key`` names their registry entry (flex/registry.py) and ``bufs`` are the tensors they
captured, passed so the compiler orders the call after whatever wrote them. ``dbufs`` holds one fp32
gradient per captured tensor that gets one (``Entry.grad_buffers``), else an empty list. ``dlse``, the
lse output's gradient, is None when the caller's loss does not use lse; ``tiles`` are the 12 tile
choices of ``kernel_options`` (flex/options.py; 0: the kernels' table decides).

Which backend runs: CUDA tensors (or CPU tensors under ``FLASHTILE_INTERPRET=1``) the Triton kernels,
other CPU tensors the materialised PyTorch path (backends/flex_cpu.py), which honours the block mask
exactly as the kernels do (skipped blocks hidden, full blocks without mask_mod).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtile import config
from flashtile.backends.flex_cpu import evaluate_mask, flex_attention_dense
from flashtile.flex import registry


def use_triton(q: Tensor) -> bool:
    return q.is_cuda or config.get().interpret


def _block_visibility(block: tuple, entry, B: int, H: int, L: int, S: int, block_size) -> Tensor:
    """Bool (B, H, L, S): what the kernels let through for this block mask and mask_mod."""
    num, idx, fnum, fidx = block[:4]
    bq, bkv = block_size
    nk = idx.shape[-1]
    ar = torch.arange(nk, device=idx.device)

    def dense(n, i):
        listed = (ar < n.unsqueeze(-1))
        d = torch.zeros(i.shape, dtype=torch.bool, device=i.device).scatter(-1, i.long(), listed)
        d = d.expand(B, H, *d.shape[2:])
        return d.repeat_interleave(bq, 2)[:, :, :L].repeat_interleave(bkv, 3)[..., :S]

    full, partial = dense(fnum, fidx), dense(num, idx)
    if entry.mask_mod is not None:
        partial = partial & evaluate_mask(entry.mask_mod, B, H, L, S, idx.device)
    return full | partial


def cpu_forward(q, k, v, block, entry, scale, block_size):
    B, H, L, _ = q.shape
    visible = _block_visibility(block, entry, B, H, L, k.shape[2], block_size)
    out, lse = flex_attention_dense(q, k, v, entry.score_mod, visible, scale)
    return out.to(q.dtype), lse.to(torch.float32 if q.dtype != torch.float64 else torch.float64)


@torch.library.custom_op("flashtile::flex_fwd", mutates_args=())
def flex_fwd(q: Tensor, k: Tensor, v: Tensor, kv_num: Tensor, kv_idx: Tensor, full_num: Tensor, full_idx: Tensor,
             q_num: Tensor, q_idx: Tensor, full_q_num: Tensor, full_q_idx: Tensor, bufs: list[Tensor],
             scale: float, key: str, block_q: int, block_kv: int, tiles: list[int]) -> tuple[Tensor, Tensor]:
    entry = registry.get(key)
    block = (kv_num, kv_idx, full_num, full_idx)
    if use_triton(q):
        from flashtile.backends.triton.flex.launch import flex_fwd as launch_fwd

        return launch_fwd(q, k, v, block, entry.kernels(), scale, (block_q, block_kv), tuple(tiles[:4]))
    return cpu_forward(q, k, v, block, entry, scale, (block_q, block_kv))


@flex_fwd.register_fake
def _(q, k, v, kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx, bufs, scale, key,
      block_q, block_kv, tiles):
    B, H, L, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 and not use_triton(q) else torch.float32
    return q.new_empty(B, H, L, v.shape[3]), q.new_empty(B, H, L, dtype=lse_dtype)


@torch.library.custom_op("flashtile::flex_bwd", mutates_args=())
def flex_bwd(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             kv_num: Tensor, kv_idx: Tensor, full_num: Tensor, full_idx: Tensor, q_num: Tensor, q_idx: Tensor,
             full_q_num: Tensor, full_q_idx: Tensor, bufs: list[Tensor], scale: float, key: str, block_q: int,
             block_kv: int, buffer_grads: bool, tiles: list[int]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    entry = registry.get(key)
    block = (kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx)
    if use_triton(q):
        from flashtile.backends.triton.flex.launch import flex_bwd as launch_bwd

        return launch_bwd(dout, dlse, q, k, v, out, lse, block, entry.kernels(), scale, (block_q, block_kv),
                          buffer_grads, tuple(tiles[4:]))
    # CPU path (compiled graphs only: eager CPU calls differentiate cpu_forward with autograd directly).
    # torch.func.vjp, not torch.autograd: an op's implementation runs below the autograd dispatch key. The
    # captured tensors that learn join the primals, swapped in where the mod reads them.
    learn = list(entry.grad_buffers) if buffer_grads else []
    paths = dict(entry.grad_paths)
    if any(paths.get(i) is None for i in learn):
        raise NotImplementedError("flashtile.flex: a captured tensor that learns is reached by the score_mod "
                                  "through neither its closure, its globals nor their attributes")

    def forward(qq, kk, vv, *learning):
        with registry.substituted(entry.score_mod, [(paths[i], t) for i, t in zip(learn, learning)]):
            return cpu_forward(qq, kk, vv, block[:4], entry, scale, (block_q, block_kv))

    (o, lse_cpu), vjp = torch.func.vjp(forward, q, k, v, *(bufs[i] for i in learn))
    dq, dk, dv, *dbufs = vjp((dout.to(o.dtype), torch.zeros_like(lse_cpu) if dlse is None else dlse.to(lse_cpu.dtype)))
    return dq, dk, dv, [g.float() for g in dbufs]


@flex_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx,
      bufs, scale, key, block_q, block_kv, buffer_grads, tiles):
    entry = registry.get(key)
    dbufs = [q.new_empty(entry.buffers[i].shape, dtype=torch.float32) for i in entry.grad_buffers] \
        if buffer_grads else []
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbufs
