"""Token generation with a paged KV cache: a tiny decoder on ``flashtile.flash_attn_with_kvcache``.

The model is random (this is about the cache, not the text): a few pre-norm blocks of GQA
attention with rotary embeddings and a gated MLP. The prompt is prefilled in one call per layer
(``causal=True``, all prompt tokens appended at once); then each step appends one token per layer.
The caches are pools of fixed-size pages shared by all sequences; a small host-side allocator
hands a sequence a new page when it crosses a page boundary, and ``block_table`` tells the kernel
where each sequence's pages are. Rotary is applied inside the call (``rotary_cos``/``rotary_sin``).

    python examples/generate.py --device cpu          # seconds, PyTorch path
    python examples/generate.py --device cuda --check # Triton kernels; --check recomputes the
                                                       # last logits without a cache and compares
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import flashtile


class PagePool:
    """Pages of ``page_size`` tokens handed out to sequences as they grow (a free list on the host)."""

    def __init__(self, num_pages: int, page_size: int, batch: int, max_pages_per_seq: int, device):
        self.page_size = page_size
        self.free = list(range(num_pages - 1, -1, -1))
        # unused entries point at page 0; the kernel never reads past a sequence's length
        self.block_table = torch.zeros(batch, max_pages_per_seq, dtype=torch.int32, device=device)
        self.pages_of = [[] for _ in range(batch)]

    def reserve(self, row: int, length: int):
        """Make sure sequence ``row`` owns pages for ``length`` tokens."""
        while len(self.pages_of[row]) * self.page_size < length:
            if not self.free:
                raise RuntimeError("page pool exhausted: raise --pages")
            page = self.free.pop()
            self.block_table[row, len(self.pages_of[row])] = page
            self.pages_of[row].append(page)


def rotary_tables(max_len: int, rotary_dim: int, device, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate_half_style(x, cos, sin, positions):
    """Non-interleaved rotary in plain PyTorch (used only by --check's cache-free recomputation)."""
    rd = 2 * cos.shape[1]
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]
    x1, x2 = x[..., : rd // 2].float(), x[..., rd // 2: rd].float()
    rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)
    return torch.cat((rot, x[..., rd:]), dim=-1)


class TinyDecoder(torch.nn.Module):
    def __init__(self, vocab=512, dim=256, layers=4, heads=8, kv_heads=2, rotary_dim=16, mlp=512):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = heads, kv_heads, dim // heads, rotary_dim
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            blk = torch.nn.Module()
            blk.norm1 = torch.nn.RMSNorm(dim)
            blk.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
            blk.proj = torch.nn.Linear(dim, dim, bias=False)
            blk.norm2 = torch.nn.RMSNorm(dim)
            blk.up = torch.nn.Linear(dim, 2 * mlp, bias=False)
            blk.down = torch.nn.Linear(mlp, dim, bias=False)
            self.blocks.append(blk)
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def _split(self, blk, x):
        b, s, _ = x.shape
        q, k, v = blk.qkv(blk.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        return (q.view(b, s, self.heads, self.head_dim), k.view(b, s, self.kv_heads, self.head_dim),
                v.view(b, s, self.kv_heads, self.head_dim))

    def _mlp(self, blk, x):
        gate, up = blk.up(blk.norm2(x)).chunk(2, dim=-1)
        return x + blk.down(F.silu(gate) * up)

    def forward_cached(self, tokens, caches, pool: PagePool, lengths: torch.Tensor, cos, sin):
        """New tokens (b, s) at positions lengths .. lengths + s; appends to every layer's cache."""
        x = self.embed(tokens)
        b, s, _ = x.shape
        for blk, (k_cache, v_cache) in zip(self.blocks, caches):
            q, k, v = self._split(blk, x)
            attn = flashtile.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                block_table=pool.block_table, causal=True, rotary_interleaved=False)
            x = self._mlp(blk, x + blk.proj(attn.reshape(b, s, -1)))
        return self.head(self.norm(x))

    def forward_full(self, tokens, cos, sin):
        """No cache: the whole sequence at once with flash_attn_func (what --check compares against)."""
        x = self.embed(tokens)
        b, s, _ = x.shape
        pos = torch.arange(s, device=tokens.device).expand(b, s)
        for blk in self.blocks:
            q, k, v = self._split(blk, x)
            q, k = rotate_half_style(q, cos, sin, pos), rotate_half_style(k, cos, sin, pos)
            attn = flashtile.flash_attn_func(q, k, v, causal=True)
            x = self._mlp(blk, x + blk.proj(attn.reshape(b, s, -1)))
        return self.head(self.norm(x))


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (any size works)")
    p.add_argument("--pages", type=int, default=0, help="pages in the pool (default: just enough)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare the last logits with a cache-free recomputation")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TinyDecoder(layers=args.layers).to(device, dtype).eval()
    max_len = args.prompt_len + args.new_tokens
    per_seq = -(-max_len // args.page_size)
    num_pages = args.pages or args.batch * per_seq
    pool = PagePool(num_pages, args.page_size, args.batch, per_seq, device)
    caches = [(torch.zeros(num_pages, args.page_size, model.kv_heads, model.head_dim, device=device, dtype=dtype),
               torch.zeros(num_pages, args.page_size, model.kv_heads, model.head_dim, device=device, dtype=dtype))
              for _ in model.blocks]
    cos, sin = rotary_tables(per_seq * args.page_size, model.rotary_dim, device)
    cos, sin = cos.to(dtype), sin.to(dtype)

    tokens = torch.randint(0, model.embed.num_embeddings, (args.batch, args.prompt_len), device=device)
    lengths = torch.zeros(args.batch, dtype=torch.int32, device=device)
    host_len = 0  # every sequence has the same length here; the allocator runs on the host
    t0 = time.perf_counter()
    step_in = tokens
    for _ in range(args.new_tokens):
        for row in range(args.batch):
            pool.reserve(row, host_len + step_in.shape[1])
        logits = model.forward_cached(step_in, caches, pool, lengths, cos, sin)
        lengths += step_in.shape[1]
        host_len += step_in.shape[1]
        step_in = logits[:, -1:].float().argmax(-1)  # greedy
        tokens = torch.cat((tokens, step_in), dim=1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"generated {args.new_tokens} tokens x {args.batch} sequences in {dt * 1e3:.0f} ms "
          f"({args.layers} layers, pages of {args.page_size}, {len(pool.free)} pages left)")
    for row in range(args.batch):
        prompt, new = tokens[row, :args.prompt_len].tolist(), tokens[row, args.prompt_len:].tolist()
        print(f"  seq {row}: {prompt[:8]}... -> {new}")
    if args.check:
        full = model.forward_full(tokens[:, :-1], cos, sin)[:, -1].float()
        err = (full - logits[:, -1].float()).abs().max().item()
        scale = full.abs().max().item()
        tol = 0.05 * scale if dtype == torch.bfloat16 else 1e-3 * max(scale, 1.0)
        print(f"check: last logits, cached vs cache-free max err {err:.2e} (logits up to {scale:.2f})")
        if not err <= tol:
            raise SystemExit(f"check failed: {err:.3e} > {tol:.3e}")
    return tokens


if __name__ == "__main__":
    main()
