"""API behaviour: FlashAttention 2.8.3 signatures, return tuples, packed gradients, input errors."""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import flashtile
import flashtile.flash_attn_interface as fai
from flashtile.backends.reference import attention_ref

COMMON = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
          "deterministic", "return_attn_probs"]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k"] + COMMON + ["block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                        "max_seqlen_k"] + COMMON,
}
DEFAULTS = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_flash_attn(name):
    fn = getattr(flashtile, name)
    assert fn is getattr(fai, name)
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert [p.name for p in params] == SIGNATURES[name]
    for p in params:
        if p.name in DEFAULTS:
            assert p.default == DEFAULTS[p.name], p.name
    assert fn.__doc__ and "Returns" in fn.__doc__


def _qkv(b=2, sq=9, sk=11, h=4, h_k=2, d=16, dtype=torch.float32, grad=False):
    return (torch.randn(b, sq, h, d, dtype=dtype, requires_grad=grad),
            torch.randn(b, sk, h_k, d, dtype=dtype, requires_grad=grad),
            torch.randn(b, sk, h_k, d, dtype=dtype, requires_grad=grad))


def test_return_tuples_and_shapes():
    q, k, v = _qkv()
    out = flashtile.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out, lse, s = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32 and s.numel() == 0
    out, lse, s = flashtile.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    assert s.shape == (2, 4, 9, 11)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv_, vv = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    out, lse, s = flashtile.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, return_attn_probs=True)
    assert out.shape == (9, 4, 16) and lse.shape == (4, 9)


def test_softmax_scale_default_and_explicit():
    q, k, v = _qkv(d=20)
    ref, _ = attention_ref(q, k, v, softmax_scale=20 ** -0.5)
    assert (flashtile.flash_attn_func(q, k, v) - ref).abs().max() < 1e-5
    ref2, _ = attention_ref(q, k, v, softmax_scale=0.3)
    assert (flashtile.flash_attn_func(q, k, v, softmax_scale=0.3) - ref2).abs().max() < 1e-5


def test_window_size_as_list_and_tensor():
    q, k, v = _qkv()
    a = flashtile.flash_attn_func(q, k, v, window_size=(3, 1))
    b = flashtile.flash_attn_func(q, k, v, window_size=[3, 1])
    c = flashtile.flash_attn_func(q, k, v, window_size=torch.tensor([3, 1]))
    assert torch.equal(a, b) and torch.equal(a, c)


def test_qkvpacked_grads_land_in_packed_buffer():
    qkv = torch.randn(2, 13, 3, 4, 16, requires_grad=True)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref, _ = attention_ref(q, k, v, causal=True)
    ref.backward(g)
    assert qkv.grad.shape == qkv.shape
    want = torch.stack([q.grad, k.grad, v.grad], dim=2)
    assert (qkv.grad - want).abs().max() < 1e-4


def test_kvpacked_and_varlen_packed_grads():
    q = torch.randn(2, 7, 4, 8, requires_grad=True)
    kv = torch.randn(2, 9, 2, 2, 8, requires_grad=True)
    flashtile.flash_attn_kvpacked_func(q, kv).sum().backward()
    assert kv.grad.shape == kv.shape and q.grad.shape == q.shape
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    attention_ref(q2, k, v)[0].sum().backward()
    assert (kv.grad[:, :, 0] - k.grad).abs().max() < 1e-4 and (kv.grad[:, :, 1] - v.grad).abs().max() < 1e-4

    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    qkv = torch.randn(10, 3, 2, 8, requires_grad=True)
    flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True).sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    qv = torch.randn(10, 4, 8, requires_grad=True)
    kvv = torch.randn(10, 2, 2, 8, requires_grad=True)
    flashtile.flash_attn_varlen_kvpacked_func(qv, kvv, cu, cu, 7, 7).sum().backward()
    assert kvv.grad.shape == kvv.shape


def test_non_contiguous_inputs_and_autograd_function_names():
    q = torch.randn(2, 4, 9, 16).transpose(1, 2)  # (b, s, h, d) view of a (b, h, s, d) tensor
    k = torch.randn(2, 9, 16, 2).transpose(-1, -2)  # strided last dim: made contiguous, not refused
    v = torch.randn(2, 9, 2, 16)
    out = flashtile.flash_attn_func(q, k, v)
    ref, _ = attention_ref(q, k, v)
    assert (out - ref).abs().max() < 1e-5
    for name in ("FlashAttnFunc", "FlashAttnQKVPackedFunc", "FlashAttnKVPackedFunc", "FlashAttnVarlenFunc",
                 "FlashAttnVarlenQKVPackedFunc", "FlashAttnVarlenKVPackedFunc"):
        assert issubclass(getattr(fai, name), torch.autograd.Function)


def _err(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match):
        fn(*a, **kw)


def test_errors_name_the_argument():
    f = flashtile.flash_attn_func
    q, k, v = _qkv()
    _err(TypeError, "same dtype", f, q, k.half(), v)
    _err(TypeError, "unsupported dtype", f, q.int(), k, v)
    _err(ValueError, "must have 4 dims", f, q[0], k, v)
    _err(ValueError, "multiple of key/value heads", f, q, *_qkv(h_k=3)[1:])
    _err(ValueError, "head dim", f, *_qkv(d=264))
    _err(ValueError, "v must have k.s shape but for its head dim", f, q, k, v[:, :5])
    _err(ValueError, "dropout_p", f, q, k, v, dropout_p=1.0)
    _err(ValueError, "dropout_p", f, q, k, v, dropout_p=-0.1)
    _err(ValueError, "softcap", f, q, k, v, softcap=1.0, dropout_p=0.1)
    _err(ValueError, "window_size", f, q, k, v, window_size=(-2, 0))
    _err(ValueError, "window_size", f, q, k, v, window_size=(1, 2, 3))
    _err(TypeError, "alibi_slopes must be float32", f, q, k, v, alibi_slopes=torch.rand(4, dtype=torch.float64))
    _err(ValueError, "alibi_slopes must have shape", f, q, k, v, alibi_slopes=torch.rand(3))
    _err(ValueError, "batch size", f, q, *_qkv(b=3)[1:])


def test_device_mismatch_error():
    q, k, v = _qkv()
    meta = torch.empty_like(k, device="meta")
    _err(ValueError, "same device", flashtile.flash_attn_func, q, meta, v)


def test_varlen_errors():
    f = flashtile.flash_attn_varlen_func
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    _err(TypeError, "cu_seqlens_q must be int32", f, q, k, v, cu.long(), cu, 5, 5)
    _err(ValueError, "cu_seqlens_k must have length", f, q, k, v, cu, cu[:2], 5, 5)
    _err(ValueError, "must have 3 dims", f, q[None], k, v, cu, cu, 5, 5)
    _err(TypeError, "max_seqlen_q", f, q, k, v, cu, cu, 5.5, 5)
    _err(TypeError, "seqused_k must be an int32", f, q, k, v, cu, cu, 5, 5, seqused_k=torch.tensor([1, 2]))
    _err(TypeError, "block_table must be an int32", f, q, k, v, cu, cu, 5, 5, block_table=torch.zeros(2, 1))


def test_dispatch_error_lists_every_backend():
    from flashtile import dispatch
    from flashtile.params import AttnParams

    q = torch.empty(1, 1, 1, 8, device="meta")
    with pytest.raises(dispatch.NoBackendError) as info:
        dispatch.choose("fwd", q, AttnParams(softmax_scale=1.0))
    msg = str(info.value)
    assert "triton:" in msg and "cpu:" in msg


def test_long_causal_on_cpu_memory_stays_linear():
    # a 32k x 32k fp32 score matrix alone would be 4 GiB; the chunked path must stay far below that
    code = textwrap.dedent("""
        import resource, time, torch, flashtile
        torch.manual_seed(0)
        s = 32768
        q, k, v = (torch.randn(1, s, 1, 8) for _ in range(3))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.time()
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert torch.isfinite(out).all()
        print((peak - base) / 1024, time.time() - t)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    grown_mb, seconds = map(float, res.stdout.split())
    assert grown_mb < 512, f"peak memory grew by {grown_mb:.0f} MB"
