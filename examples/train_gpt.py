"""Train a tiny character-level GPT built from flashtile's layers, then generate with the KV cache.

    python examples/train_gpt.py --steps 200 --device cpu

The model is pre-norm GPT: token embedding -> N x Block(MHA with rotary + causal, SwiGLU GatedMlp)
-> LayerNorm -> tied output projection. Training samples random windows of examples/data/lighthouse.txt;
generation prefills the prompt once and then decodes one token at a time through
``InferenceParams`` (each MHA keeps its keys/values and calls ``flash_attn_with_kvcache``).
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashtile.modules.block import Block
from flashtile.modules.mha import MHA, InferenceParams
from flashtile.modules.mlp import GatedMlp

DATA = Path(__file__).resolve().parent / "data" / "lighthouse.txt"


class CharTokenizer:
    """Every distinct character of the text is one token."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, s: str) -> list[int]:
        return [self.index[c] for c in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class GPT(nn.Module):
    """Decoder-only transformer from flashtile blocks. forward: ids (b, s) -> logits (b, s, vocab)."""

    def __init__(self, vocab: int, dim: int = 128, n_layers: int = 4, n_heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        head_dim = dim // n_heads
        self.blocks = nn.ModuleList(
            Block(dim,
                  mixer_cls=partial(MHA, num_heads=n_heads, causal=True, layer_idx=i, rotary_emb_dim=head_dim,
                                    dropout=dropout),
                  mlp_cls=partial(GatedMlp, hidden_features=3 * dim, multiple_of=32),
                  prenorm=True, resid_dropout1=dropout, resid_dropout2=dropout)
            for i in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied embeddings: fewer parameters, trains faster here
        nn.init.normal_(self.embed.weight, std=0.02)  # N(0, 1) rows would start the tied logits huge
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("fc2.weight"):
                # scale residual-branch outputs down with depth so the residual stream starts near identity
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, ids: torch.Tensor, inference_params: InferenceParams | None = None) -> torch.Tensor:
        hidden, residual = self.embed(ids), None
        kwargs = {"inference_params": inference_params} if inference_params is not None else None
        for block in self.blocks:
            hidden, residual = block(hidden, residual, mixer_kwargs=kwargs)
        return self.head(self.norm(hidden + residual))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 20) -> torch.Tensor:
        """prompt (b, s) -> (b, s + max_new_tokens): one prefill, then one cached step per token."""
        b, s = prompt.shape
        params = InferenceParams(max_seqlen=s + max_new_tokens, max_batch_size=b)
        logits = self(prompt, inference_params=params)[:, -1]
        params.seqlen_offset = s
        out = [prompt]
        for _ in range(max_new_tokens):
            logits = logits / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
            out.append(nxt)
            logits = self(nxt, inference_params=params)[:, -1]
            params.seqlen_offset += 1
        return torch.cat(out, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tokens", type=int, default=200, help="characters to generate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    # bf16 on GPU (flashtile's kernels' fast path); fp32 on CPU (the CPU path takes fp32 too)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    text = DATA.read_text()
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text), dtype=torch.long, device=device)
    model = GPT(len(tok.chars), args.dim, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{len(text)} characters, vocab {len(tok.chars)}, model {n_params / 1e3:.0f}K parameters, {device}")

    t0 = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seqlen - 1, (args.batch,), device=device)
        window = torch.stack([data[i:i + args.seqlen + 1] for i in starts.tolist()])
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step == 1 or step % 20 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f}s)", flush=True)

    model.eval()
    prompt = torch.tensor([tok.encode("The keeper ")], device=device)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        sample = model.generate(prompt, args.tokens)
    print("\n--- sample (KV-cache decoding) ---")
    print(tok.decode(sample[0].tolist()))


if __name__ == "__main__":
    main()
