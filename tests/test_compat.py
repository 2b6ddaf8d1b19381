"""Drop-in compatibility: code written for flash_attn runs on flashtile after compat.install().

Also FlashAttention 2.8.3's private helpers (``_flash_attn_forward`` & co.), which libraries call
from their own autograd Functions: signatures, and forward + backward round trips (with dropout
replayed through ``rng_state``) equal to flashtile's autograd.
"""

import inspect
import sys
import types
import warnings

import pytest
import torch

import flashtile
import flashtile.flash_attn_interface as fai
from flashtile import compat
from flashtile.backends.reference import attention_ref


@pytest.fixture
def shim():
    compat.install()
    yield
    compat.uninstall()


def test_readme_style_code_runs_on_flashtile(shim):
    from flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input

    assert flash_attn_func is flashtile.flash_attn_func
    b, s, h, d = 2, 12, 4, 32
    q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1),
                          alibi_slopes=None, deterministic=False)
    ref, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    qkv = torch.stack([q, k, v], dim=2).detach()
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True), ref.detach(), atol=1e-5, rtol=1e-5)

    # the usual unpad -> varlen -> pad round trip of BERT-style code
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 7:] = False
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True)
    out_p = pad_input(out_u, idx, b, s)
    ref_m, _ = attention_ref(q, k, v, causal=True, query_padding_mask=mask, key_padding_mask=mask)
    torch.testing.assert_close(out_p[mask], ref_m[mask], atol=1e-5, rtol=1e-5)


def test_submodules_resolve_to_flashtile_lazily(shim):
    import flash_attn
    import flash_attn.flash_attn_interface as iface

    assert iface is fai and flash_attn.__version__ == compat.FLASH_ATTN_API_VERSION
    assert flash_attn.flashtile_version == flashtile.__version__
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward  # noqa: F401
    from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb  # noqa: F401
    from flash_attn.modules.mha import MHA

    assert sys.modules["flash_attn.layers.rotary"] is sys.modules["flashtile.layers.rotary"]
    assert MHA is sys.modules["flashtile.modules.mha"].MHA
    assert sys.modules["flashtile.flash_attn_interface"].__name__ == "flashtile.flash_attn_interface"
    with pytest.raises(ImportError, match="shim has no 'flash_attn.ops'"):
        import flash_attn.ops.rms_norm  # noqa: F401


def test_uninstall_restores():
    compat.install()
    import flash_attn  # noqa: F401

    compat.uninstall()
    assert not [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]
    assert not compat.installed()
    with pytest.raises(ImportError):
        import flash_attn  # noqa: F401, F811
    assert sys.modules["flashtile"] is flashtile


def test_install_warns_and_displaces_an_imported_real_flash_attn(monkeypatch):
    real = types.ModuleType("flash_attn")
    real.__version__ = "2.8.3-real"
    monkeypatch.setitem(sys.modules, "flash_attn", real)
    with pytest.warns(RuntimeWarning, match="real flash_attn is already imported"):
        compat.install()
    try:
        import flash_attn

        assert flash_attn is not real and flash_attn.flash_attn_func is flashtile.flash_attn_func
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compat.install()  # idempotent, no second warning
    finally:
        compat.uninstall()
    assert sys.modules["flash_attn"] is real


FA_SIGNATURES = {
    "_flash_attn_forward": "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
                           "alibi_slopes return_softmax",
    "_flash_attn_varlen_forward": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                                  "causal window_size_left=-1 window_size_right=-1 softcap=0.0 alibi_slopes=None "
                                  "return_softmax=False block_table=None leftpad_k=None seqused_k=None "
                                  "zero_tensors=False",
    "_flash_attn_backward": "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
                            "window_size_right softcap alibi_slopes deterministic rng_state=None",
    "_flash_attn_varlen_backward": "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                   "max_seqlen_k dropout_p softmax_scale causal window_size_left window_size_right "
                                   "softcap alibi_slopes deterministic rng_state=None zero_tensors=False",
}


@pytest.mark.parametrize("name", sorted(FA_SIGNATURES))
def test_private_helper_signatures(name):
    params = inspect.signature(getattr(fai, name)).parameters.values()
    got = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
    assert got == FA_SIGNATURES[name]


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_helpers_round_trip_equal_autograd(dropout_p, causal):
    q = torch.randn(2, 19, 4, 16, requires_grad=True)
    k = torch.randn(2, 23, 2, 16, requires_grad=True)
    v = torch.randn(2, 23, 2, 16, requires_grad=True)
    scale = 0.3
    torch.manual_seed(7)
    out_a, lse_a, s_a = flashtile.flash_attn_func(q, k, v, dropout_p, scale, causal, return_attn_probs=True)
    g = torch.randn_like(out_a)
    want = torch.autograd.grad(out_a, (q, k, v), g)

    torch.manual_seed(7)  # the same generator state: the helper draws the same dropout seed
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q.detach(), k.detach(), v.detach(), dropout_p, scale,
                                                            causal, -1, -1, 0.0, None, True)
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a) and torch.equal(s_dmask, s_a)
    torch.manual_seed(99)  # the backward must not depend on the generator, only on rng_state
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    softmax_d = fai._flash_attn_backward(g, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, dropout_p,
                                         scale, causal, -1, -1, 0.0, None, False, rng_state)
    for a, b in zip((dq, dk, dv), want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(softmax_d, (g * out).sum(-1).transpose(1, 2))


def test_varlen_helpers_round_trip_with_dropout():
    cu_q = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 13, 24], dtype=torch.int32)
    q = torch.randn(19, 4, 16, requires_grad=True)
    k = torch.randn(24, 2, 16, requires_grad=True)
    v = torch.randn(24, 2, 16, requires_grad=True)
    torch.manual_seed(3)
    out_a = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 11, dropout_p=0.2, causal=True)
    g = torch.randn_like(out_a)
    want = torch.autograd.grad(out_a, (q, k, v), g)
    torch.manual_seed(3)
    out, lse, _, rng_state = fai._flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 12, 11,
                                                             0.2, 0.25, True)
    assert torch.equal(out, out_a) and lse.shape == (4, 19)
    dq, dk, dv = None, None, None  # FA allows None: allocated inside (returned values are then lost, as in FA)
    fai._flash_attn_varlen_backward(g, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, cu_q, cu_k, 12,
                                    11, 0.2, 0.25, True, -1, -1, 0.0, None, False, rng_state)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = fai._flash_attn_varlen_backward(g, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, cu_q,
                                                cu_k, 12, 11, 0.2, 0.25, True, -1, -1, 0.0, None, False, rng_state)
    assert softmax_d.shape == (4, 19)
    for a, b in zip((dq, dk, dv), want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="rng_state"):
        fai._flash_attn_varlen_backward(g, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, cu_q, cu_k,
                                        12, 11, 0.2, 0.25, True, -1, -1, 0.0, None, False)


class _ThirdPartyKVPacked(torch.autograd.Function):
    """How libraries use the helpers: their own Function, gradients written into views of a packed buffer."""

    @staticmethod
    def forward(ctx, q, kv, dropout_p, causal):
        out, lse, _, rng_state = fai._flash_attn_forward(q, kv[:, :, 0], kv[:, :, 1], dropout_p, q.shape[-1] ** -0.5,
                                                         causal, -1, -1, 0.0, None, False)
        ctx.save_for_backward(q, kv, out, lse, rng_state)
        ctx.dropout_p, ctx.causal = dropout_p, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, rng_state = ctx.saved_tensors
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        fai._flash_attn_backward(dout, q, kv[:, :, 0], kv[:, :, 1], out, lse, dq, dkv[:, :, 0], dkv[:, :, 1],
                                 ctx.dropout_p, q.shape[-1] ** -0.5, ctx.causal, -1, -1, 0.0, None, False, rng_state)
        return dq, dkv, None, None


@pytest.mark.parametrize("compiled", [False, True])
def test_third_party_function_on_helpers(compiled):
    q = torch.randn(2, 10, 4, 16, requires_grad=True)
    kv = torch.randn(2, 14, 2, 2, 16, requires_grad=True)
    fn = lambda q, kv: _ThirdPartyKVPacked.apply(q, kv, 0.0, True)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(q, kv)
    g = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), g)
    out_r = flashtile.flash_attn_kvpacked_func(q, kv, causal=True)
    want_q, want_kv = torch.autograd.grad(out_r, (q, kv), g)
    torch.testing.assert_close(out, out_r, atol=0, rtol=0)
    torch.testing.assert_close(dq, want_q, atol=0, rtol=0)
    torch.testing.assert_close(dkv, want_kv, atol=0, rtol=0)


def test_function_classes_keep_flash_attn_apply_signatures():
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    out = fai.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False, True)
    out2, lse, s = fai.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, True, True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 8) and s.numel() == 0 and not lse.requires_grad
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qkv = torch.randn(8, 3, 2, 16, requires_grad=True)
    out = fai.FlashAttnVarlenQKVPackedFunc.apply(qkv, cu, 5, 0.0, None, False, (-1, -1), 0.0, None, False, False,
                                                 True)
    (dqkv,) = torch.autograd.grad(out.sum(), (qkv,))
    (want,) = torch.autograd.grad(flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 5).sum(), (qkv,))
    torch.testing.assert_close(dqkv, want, atol=0, rtol=0)
