"""The layer checks on CUDA in bf16: rotary kernel, MHA (padding, GQA, decode), Block, transformers."""

import copy

import pytest
import torch

from flashtile.layers.rotary import apply_rotary_emb
from flashtile.modules.block import Block
from flashtile.modules.mha import MHA, InferenceParams
from test_mha import torch_mha
from test_rotary import rotary_ref, tables

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [128, 64])
def test_rotary_bf16(interleaved, rd):
    x = torch.randn(4, 257, 8, 128, dtype=BF16)
    cos, sin = tables(400, rd, BF16)
    offsets = torch.tensor([0, 3, 100, 143], dtype=torch.int32)
    ref = rotary_ref(x.float(), cos.float(), sin.float(), interleaved, offsets)
    xg = x.to(DEV).requires_grad_()
    out = apply_rotary_emb(xg, cos.to(DEV), sin.to(DEV), interleaved, seqlen_offsets=offsets.to(DEV))
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=2e-2)
    g = torch.randn_like(out)
    out.backward(g)
    dref = rotary_ref(g.float().cpu(), cos.float(), -sin.float(), interleaved, offsets)
    torch.testing.assert_close(xg.grad.float().cpu(), dref, atol=3e-2, rtol=2e-2)
    # varlen, in place
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device=DEV)
    xv = torch.randn(357, 8, 128, dtype=BF16, device=DEV)
    ref0 = rotary_ref(xv[:100].float().cpu().unsqueeze(0), cos.float(), sin.float(), interleaved)[0]
    apply_rotary_emb(xv, cos.to(DEV), sin.to(DEV), interleaved, inplace=True, cu_seqlens=cu, max_seqlen=257)
    torch.testing.assert_close(xv[:100].float().cpu(), ref0, atol=3e-2, rtol=2e-2)


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("num_heads_kv", [8, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_mha_bf16(num_heads_kv, padded):
    m = MHA(512, 8, num_heads_kv=num_heads_kv, causal=True, rotary_emb_dim=32, device=DEV, dtype=BF16).eval()
    x = torch.randn(3, 200, 512, device=DEV, dtype=BF16)
    mask = None
    if padded:
        mask = torch.ones(3, 200, dtype=torch.bool, device=DEV)
        mask[1, 150:] = False
        mask[2, 10:] = False
    with torch.no_grad():
        out = m(x, key_padding_mask=mask)
        m32 = copy.deepcopy(m).float()
        ref = torch_mha(m32, x.float(), key_padding_mask=mask)
        pt = torch_mha(m, x, key_padding_mask=mask)
    keep = slice(None) if mask is None else mask
    assert _err(out[keep], ref[keep]) <= 2 * _err(pt[keep], ref[keep]) + 1e-2


def test_mha_decode_bf16():
    m = MHA(256, 4, num_heads_kv=2, causal=True, layer_idx=0, rotary_emb_dim=64, device=DEV, dtype=BF16).eval()
    x = torch.randn(2, 40, 256, device=DEV, dtype=BF16)
    params = InferenceParams(max_seqlen=64, max_batch_size=2)
    with torch.no_grad():
        full = m(x)
        outs = [m(x[:, :30], inference_params=params)]
        params.seqlen_offset = 30
        for t in range(30, 40):
            outs.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    torch.testing.assert_close(torch.cat(outs, 1).float(), full.float(), atol=3e-2, rtol=3e-2)


def test_block_bf16_backward():
    blk = Block(256, residual_in_fp32=True, device=DEV, dtype=BF16)
    x = torch.randn(2, 64, 256, device=DEV, dtype=BF16, requires_grad=True)
    hidden, residual = blk(x)
    (hidden.float().sum() + residual.sum()).backward()
    assert residual.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_hf_llama_bf16():
    transformers = pytest.importorskip("transformers")
    import flashtile.integrations.hf  # noqa: F401

    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flashtile")
    ours.load_state_dict(eager.state_dict())
    eager, ours = eager.to(DEV, BF16).eval(), ours.to(DEV, BF16).eval()
    ids = torch.randint(0, 211, (2, 77), device=DEV)
    mask = torch.ones(2, 77, dtype=torch.long, device=DEV)
    mask[1, :20] = 0
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = eager(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert _err(a[keep], b[keep]) < 0.1
