"""MHA against plain-PyTorch attention with the same weights; KV-cache decoding equals a full forward."""

import math

import pytest
import torch

from flashtile.layers.rotary import apply_rotary_emb
from flashtile.modules.mha import MHA, InferenceParams, get_alibi_slopes


def torch_mha(m: MHA, x, x_kv=None, key_padding_mask=None):
    """The layer's math spelled out: projections, rotary, GQA repeat, masks, softmax, out_proj."""
    b, sq, _ = x.shape
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    if m.cross_attn:
        q = m.Wq(x).view(b, sq, h, d)
        k, v = m.Wkv(x_kv).view(b, x_kv.shape[1], 2, hk, d).unbind(2)
    else:
        q, k, v = m.Wqkv(x).view(b, sq, h + 2 * hk, d).split((h, hk, hk), dim=2)
    if m.rotary_emb_dim > 0:
        re = m.rotary_emb
        re._update_cos_sin_cache(sq, x.device, x.dtype)
        q = apply_rotary_emb(q, re._cos_cached, re._sin_cached, re.interleaved)
        k = apply_rotary_emb(k, re._cos_cached, re._sin_cached, re.interleaved)
    sk = k.shape[1]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / math.sqrt(d)
    dev = x.device
    i = torch.arange(sq, device=dev).view(sq, 1) + sk - sq
    j = torch.arange(sk, device=dev).view(1, sk)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=dev)
    left, right = m.window_size
    if m.causal:
        right = 0
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if m.use_alibi:
        slopes = torch.tensor(get_alibi_slopes(h), dtype=torch.float64, device=dev).view(1, h, 1, 1)
        scores = scores - slopes * (i - j).abs()
    ok = ok.expand(b, 1, sq, sk)
    if key_padding_mask is not None:
        ok = ok & key_padding_mask.view(b, 1, 1, sk)
    scores = scores.masked_fill(~ok, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("bhst,bthd->bshd", probs, v.double()).to(x.dtype)
    if key_padding_mask is not None and not m.cross_attn:
        out = out * key_padding_mask.view(b, sq, 1, 1)
    return m.out_proj(out.reshape(b, sq, h * d))


CASES = {
    "mha": dict(num_heads=4),
    "gqa-causal": dict(num_heads=4, num_heads_kv=2, causal=True),
    "mqa-rotary": dict(num_heads=4, num_heads_kv=1, causal=True, rotary_emb_dim=8),
    "rotary-interleaved": dict(num_heads=2, causal=True, rotary_emb_dim=16, rotary_emb_interleaved=True),
    "alibi-window": dict(num_heads=4, causal=True, use_alibi=True, window_size=(3, -1)),
    "window-noncausal": dict(num_heads=4, window_size=(2, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("padded", [False, True])
def test_self_attention(case, padded):
    m = MHA(32, **CASES[case]).eval()
    x = torch.randn(3, 11, 32)
    mask = None
    if padded:
        mask = torch.ones(3, 11, dtype=torch.bool)
        mask[1, 7:] = False
        mask[2, 1:] = False
    with torch.no_grad():
        out = m(x, key_padding_mask=mask)
        ref = torch_mha(m, x, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_grad_matches_torch():
    m = MHA(32, 4, num_heads_kv=2, causal=True, rotary_emb_dim=8)
    x = torch.randn(2, 9, 32, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 5:] = False
    m(x, key_padding_mask=mask).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    torch_mha(m, x, key_padding_mask=mask).sum().backward()
    for got, want in zip(grads, [p.grad for p in m.parameters()] + [x.grad]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention(padded):
    m = MHA(32, 4, num_heads_kv=2, cross_attn=True).eval()
    x, x_kv = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    mask = None
    if padded:
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[1, 4:] = False
    with torch.no_grad():
        torch.testing.assert_close(m(x, x_kv, key_padding_mask=mask), torch_mha(m, x, x_kv, mask),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rotary", [0, 8])
def test_varlen_equals_padded(rotary):
    m = MHA(32, 4, num_heads_kv=2, causal=True, rotary_emb_dim=rotary).eval()
    lens = [6, 2, 9]
    x = torch.randn(3, 9, 32)
    mask = torch.arange(9).view(1, 9) < torch.tensor(lens).view(3, 1)
    cu = torch.tensor([0, 6, 8, 17], dtype=torch.int32)
    with torch.no_grad():
        out = m(x[mask], cu_seqlens=cu, max_seqlen=9)
        ref = m(x, key_padding_mask=mask)[mask]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dropout_only_in_training():
    m = MHA(32, 4, dropout=0.5, causal=True)
    x = torch.randn(2, 7, 32)
    m.eval()
    with torch.no_grad():
        a, b = m(x), m(x)
        torch.testing.assert_close(a, b)
        m.train()
        c = m(x)
    assert not torch.allclose(a, c)


KV_CASES = {
    "plain": dict(num_heads=4),
    "gqa-rotary": dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=8),
    "rotary-interleaved-alibi": dict(num_heads=2, rotary_emb_dim=16, rotary_emb_interleaved=True, use_alibi=True),
    "xpos-window": dict(num_heads=4, rotary_emb_dim=8, rotary_emb_scale_base=32.0, window_size=(4, -1)),
}


@pytest.mark.parametrize("case", list(KV_CASES))
def test_prefill_then_decode_equals_full_forward(case):
    """Prompt through the cache, then one token at a time: every output equals the full causal forward."""
    pytest.importorskip("flashtile.kvcache", reason="flash_attn_with_kvcache has not landed")
    m = MHA(32, causal=True, layer_idx=0, **KV_CASES[case]).eval()
    b, prompt, total = 2, 5, 12
    x = torch.randn(b, total, 32)
    params = InferenceParams(max_seqlen=16, max_batch_size=b)
    with torch.no_grad():
        full = m(x)
        outs = [m(x[:, :prompt], inference_params=params)]
        params.seqlen_offset = prompt
        for t in range(prompt, total):
            outs.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5, rtol=1e-4)
    cache = params.key_value_memory_dict[0]
    assert cache.shape == (b, 16, 2, m.num_heads_kv, m.head_dim)


def test_decode_lengths_per_sample():
    """Ragged batch: each row continues from its own cache length."""
    pytest.importorskip("flashtile.kvcache", reason="flash_attn_with_kvcache has not landed")
    m = MHA(32, 4, num_heads_kv=2, causal=True, layer_idx=3, rotary_emb_dim=8).eval()
    x = torch.randn(2, 8, 32)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    params = InferenceParams(max_seqlen=10, max_batch_size=2, lengths_per_sample=lens.clone())
    params.key_value_memory_dict[3] = m.allocate_inference_cache(2, 10)
    with torch.no_grad():
        for i in range(2):  # fill each row's prefix with a one-row prefill
            p = InferenceParams(max_seqlen=10, max_batch_size=2, batch_size_offset=i,
                                key_value_memory_dict=params.key_value_memory_dict)
            m(x[i:i + 1, :int(lens[i])], inference_params=p)
        step = torch.stack([x[0, 3], x[1, 6]]).unsqueeze(1)
        out = m(step, inference_params=params)
        ref0 = m(torch.cat([x[0:1, :3], step[0:1]], 1))[:, -1]
        ref1 = m(x[1:2, :7].clone().index_copy_(1, torch.tensor([6]), step[1:2]))[:, -1]
    torch.testing.assert_close(out[:, 0], torch.cat([ref0, ref1]), atol=2e-5, rtol=1e-4)


def test_errors():
    with pytest.raises(ValueError, match="divisible"):
        MHA(30, 4)
    with pytest.raises(ValueError, match="num_heads_kv"):
        MHA(32, 4, num_heads_kv=3)
    m = MHA(32, 4, causal=True)
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(1, 3, 32), inference_params=InferenceParams(max_seqlen=4, max_batch_size=1))
