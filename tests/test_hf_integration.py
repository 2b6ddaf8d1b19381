"""transformers models with attn_implementation="flashtile" match eager attention (tiny configs, no download)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile.integrations.hf as hf  # noqa: E402  (registers "flashtile")


def _pair(config):
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flashtile").eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)


@pytest.fixture
def calls():
    """Count calls of the registered flashtile attention (proves the model ran through flashtile)."""
    calls = []
    real = hf.flashtile_attention_forward

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    transformers.AttentionInterface.register("flashtile", spy)
    yield calls
    transformers.AttentionInterface.register("flashtile", real)


def test_llama_logits_match_eager(calls):
    eager, ours = _pair(llama_config())
    assert ours.config._attn_implementation == "flashtile"
    ids = torch.randint(0, 97, (3, 13))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)
        a = ours(ids, attention_mask=mask).logits
        b = eager(ids, attention_mask=mask).logits
    assert len(calls) == 4  # 2 layers x 2 forwards went through flashtile
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=1e-4)


def test_generate_left_padded_matches_eager(calls):
    eager, ours = _pair(llama_config())
    ids = torch.randint(0, 97, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        g_eager = eager.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g_ours = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(g_eager, g_ours)
    assert len(calls) >= 2 * 6  # prefill and every decode step


def test_sliding_window_and_softcap():
    """Mistral-style sliding window and Gemma-2-style softcap go through flashtile's window/softcap."""
    q = torch.randn(2, 4, 10, 16)
    k = torch.randn(2, 2, 10, 16)
    v = torch.randn(2, 2, 10, 16)

    class Layer(torch.nn.Module):
        is_causal = True

    out, _ = hf.flashtile_attention_forward(Layer(), q, k, v, None, scaling=0.25, sliding_window=3, softcap=5.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 5.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / 5.0)
    i, j = torch.arange(10).view(10, 1), torch.arange(10).view(1, 10)
    s = s.masked_fill(~((j <= i) & (j > i - 3)), float("-inf"))
    ref = (s.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the same with a dense 4-D mask carrying left padding
    keys = torch.ones(2, 10, dtype=torch.bool)
    keys[1, :4] = False
    dense = ((j <= i) & (j > i - 3)).view(1, 1, 10, 10) & keys.view(2, 1, 1, 10)
    out4, _ = hf.flashtile_attention_forward(Layer(), q, k, v, dense, scaling=0.25, sliding_window=3, softcap=5.0)
    torch.testing.assert_close(out4[0], ref[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="4-D attention mask"):
        hf.flashtile_attention_forward(Layer(), q, k, v, torch.rand(2, 1, 10, 10) > 0.5, scaling=0.25)


def test_mistral_sliding_window_model():
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, sliding_window=4,
                                     max_position_embeddings=64)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flashtile").eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)


def test_packed_position_ids_match_separate_documents(calls):
    """No mask + position_ids restarting inside the row (DataCollatorWithFlattening): documents stay apart."""
    eager, ours = _pair(llama_config())
    ids_a, ids_b = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([ids_a, ids_b], 1)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).view(1, -1)
    with torch.no_grad():
        alone_a, alone_b = eager(ids_a).logits[0], eager(ids_b).logits[0]
        got = ours(packed, position_ids=pos).logits[0]
    assert len(calls) == 2
    torch.testing.assert_close(got[:5], alone_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[5:], alone_b, atol=1e-4, rtol=1e-4)


def test_packed_position_ids_several_rows():
    """Packing detected per row of a batch; a row's first token always starts a document."""
    class Layer(torch.nn.Module):
        is_causal = True

    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    # row 0: docs of 4 and 5 tokens; row 1: the tail of a document (positions 3..5), then one of 6
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [3, 4, 5, 0, 1, 2, 3, 4, 5]])
    out, _ = hf.flashtile_attention_forward(Layer(), q, k, v, None, position_ids=pos)
    for row, bounds in ((0, [(0, 4), (4, 9)]), (1, [(0, 3), (3, 9)])):
        for lo, hi in bounds:
            alone, _ = hf.flashtile_attention_forward(Layer(), q[row:row + 1, :, lo:hi], k[row:row + 1, :, lo:hi],
                                                      v[row:row + 1, :, lo:hi], None)
            torch.testing.assert_close(out[row:row + 1, lo:hi], alone, atol=1e-5, rtol=1e-5)
    # plain increasing positions: the dense path, same result as without position_ids
    ref, _ = hf.flashtile_attention_forward(Layer(), q, k, v, None)
    same, _ = hf.flashtile_attention_forward(Layer(), q, k, v, None, position_ids=torch.arange(9).expand(2, 9))
    torch.testing.assert_close(same, ref)


def test_per_head_4d_mask_raises():
    class Layer(torch.nn.Module):
        is_causal = True

    q, k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    mask = causal.expand(1, 2, 6, 6).clone()
    out_same, _ = hf.flashtile_attention_forward(Layer(), q, k, v, mask)  # every head alike: accepted
    torch.testing.assert_close(out_same, hf.flashtile_attention_forward(Layer(), q, k, v, None)[0])
    mask[0, 1, :, 0] = False  # head 1 may not see key 0
    with pytest.raises(ValueError, match="per-head"):
        hf.flashtile_attention_forward(Layer(), q, k, v, mask)
