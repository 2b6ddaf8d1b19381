"""Issue 48's features in the Triton forward and backward kernels, through the interpreter on CPU (fp16/fp32):
v's own head dim (dv != d), the learnable sink and attention_chunk, against ``attention_ref`` in float64.

The launchers are called directly with an AttnParams (the API layer that fills it is not under test here),
on 16 x 16 tiles, so small shapes cross several masked and unmasked blocks. Outputs are held to
FlashAttention's 2x rule and gradients to its 3x rule (tests/tolerance.py). With a sink only dq, dk and dv
are compared: the sink's own gradient is the autograd layer's.
"""

import math

import pytest
import torch

from flashtile import config
from flashtile.backends.masking import normalize_window
from flashtile.backends.reference import attention_ref
from flashtile.backends.triton import attn_bwd as bwd_launcher
from flashtile.backends.triton import attn_fwd as fwd_launcher
from flashtile.params import AttnParams
from tolerance import assert_fa_close

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("tiny_triton_tiles")]


def _inputs(lens_q, lens_k, h, h_k, d, dv, dtype, varlen):
    """q, k, v padded (b, s, h, d) or packed (total, h, d), and cu_seqlens (None when padded)."""
    if varlen:
        cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
        shapes_q, shapes_k = (sum(lens_q),), (sum(lens_k),)
    else:
        cu_q = cu_k = None
        shapes_q, shapes_k = (len(lens_q), lens_q[0]), (len(lens_k), lens_k[0])
    q = torch.randn(*shapes_q, h, d, dtype=dtype)
    k = torch.randn(*shapes_k, h_k, d, dtype=dtype)
    v = torch.randn(*shapes_k, h_k, dv, dtype=dtype)
    return q, k, v, cu_q, cu_k


def _params(q, lens_q, lens_k, cu_q, cu_k, *, causal=False, window=(-1, -1), sink=None, chunk=0):
    left, right = normalize_window(window, causal, max(lens_k))
    kw = {}
    if cu_q is not None:
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return AttnParams(softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal, window_left=left,
                      window_right=right, learnable_sink=sink, attention_chunk=chunk, **kw)


def run_case(lens_q, lens_k, h, h_k, d, dv, dtype=torch.float32, *, varlen=False, causal=False, window=(-1, -1),
             sink=False, sink_dtype=torch.float32, chunk=0, grads=True):
    """Forward (and backward) through the launchers against the reference; returns (out, lse, sink, p)."""
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, h, h_k, d, dv, dtype, varlen)
    sink_t = torch.randn(h).to(sink_dtype) if sink else None
    p = _params(q, lens_q, lens_k, cu_q, cu_k, causal=causal, window=window, sink=sink_t, chunk=chunk)
    out, lse, _ = fwd_launcher.attn_fwd(q, k, v, p)

    ref_kw = dict(causal=causal, window_size=window, attention_chunk=chunk, softmax_scale=p.softmax_scale,
                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, learnable_sink=None if sink_t is None else sink_t.double(), **ref_kw)
    same = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    pt, _ = attention_ref(*same, learnable_sink=sink_t, upcast=False, **ref_kw)

    assert out.shape == (*q.shape[:-1], dv) and out.dtype == dtype
    assert_fa_close(out, ref, pt)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse: +inf rows differ"
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3
    if grads:
        g = torch.randn_like(out)
        dq, dk, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd_launcher.attn_bwd(g, q, k, v, out, lse, p, dq, dk, dv_)
        want = torch.autograd.grad(ref, leaves, g.double())
        same_grads = torch.autograd.grad(pt, same, g)
        for name, x, r, s in zip(("dq", "dk", "dv"), (dq, dk, dv_), want, same_grads):
            assert_fa_close(x, r, s, factor=3.0, atol=1e-4, name=name)
    return out, lse, sink_t, p


@pytest.mark.parametrize("d,dv,dtype", [(16, 32, torch.float16), (40, 24, torch.float32), (48, 32, torch.float16)],
                         ids=["16-32", "40-24", "48-32"])
def test_head_dim_of_v(d, dv, dtype):
    # (48, 32): DeepSeek-V3's (192, 128) in small, q/k padded to 64 lanes, v to 32
    run_case([29, 29], [37, 37], 4, 2, d, dv, dtype, causal=True)


def test_chunk_below_the_block_with_a_sink_and_rows_that_see_no_key():
    # sq > sk with causal: the first 8 rows see no key (out 0, lse = the sink); chunk 5 < the 16-key block, not a
    # divisor of it; GQA; the sink in the inputs' dtype
    out, lse, sink, _ = run_case([37], [29], 4, 2, 16, 32, torch.float16, causal=True, chunk=5, sink=True,
                                 sink_dtype=torch.float16)
    assert (out[:, :8] == 0).all()
    assert torch.allclose(lse[:, :, :8], sink.float().view(1, 4, 1).expand(1, 4, 8), atol=1e-5)


def test_chunk_above_the_block_with_a_window():
    # sq < sk, a two-sided window inside 24-key chunks (above the 16-key block, not a multiple of it)
    run_case([21, 21], [47, 47], 2, 1, 40, 24, torch.float16, window=(6, 3), chunk=24)


@pytest.mark.parametrize("chunk,kw", [(16, dict()), (7, dict(window=(-1, 2))), (40, dict(causal=True))],
                         ids=["block", "right-window", "above-sk"])
def test_chunk_with_masks_fp32(chunk, kw):
    run_case([47, 47], [21, 21], 2, 2, 16, 16, chunk=chunk, **kw)


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_rows_above_the_first_key_see_nothing(sink):
    # sq > sk without causal: rows with a negative diagonal belong to the chunk below 0 and see no key
    out, lse, s, _ = run_case([40], [20], 2, 1, 16, 16, chunk=8, sink=sink)
    assert (out[:, :20] == 0).all() and (out[:, 20:] != 0).any()
    if sink:
        assert torch.allclose(lse[:, :, :20], s.view(1, 2, 1).expand(1, 2, 20), atol=1e-5)
    else:
        assert torch.isinf(lse[:, :, :20]).all() and torch.isfinite(lse[:, :, 20:]).all()


def test_varlen_chunk_sink_and_head_dim_of_v():
    # packed sequences of unequal lengths, one without queries and one without keys (its rows: out 0, lse = sink)
    lens_q, lens_k = [17, 0, 33, 5], [20, 5, 0, 30]
    out, lse, sink, _ = run_case(lens_q, lens_k, 2, 1, 48, 32, varlen=True, causal=True, chunk=8, sink=True)
    rows = slice(17, 50)  # the sequence with no keys
    assert (out[rows] == 0).all()
    assert torch.allclose(lse[:, rows], sink.view(2, 1).expand(2, 33), atol=1e-5)


def test_sink_without_other_features_fp16():
    run_case([33, 33], [33, 33], 2, 2, 32, 32, torch.float16, sink=True)


def test_forward_tensor_descriptors_with_head_dim_of_v():
    # the TMA path (emulated by the interpreter): v's descriptor has its own box width
    with config.override(tma=True):
        run_case([33], [40], 2, 1, 16, 32, torch.float16, causal=True, chunk=7, sink=True, grads=False)


def test_calls_without_the_features_launch_the_plain_kernels(monkeypatch):
    """No dv != d, sink or chunk: the launches carry no new constexpr and None in the sink and chunk slots
    (None arguments are constexprs), so they compile to exactly the plain kernels."""
    launched = []

    def record(kernel, grid, *args, **meta):
        launched.append((kernel, args, meta))

    monkeypatch.setattr(fwd_launcher, "launch", record)
    monkeypatch.setattr(bwd_launcher, "launch", record)
    q, k, v, _, _ = _inputs([21], [21], 2, 1, 16, 16, torch.float16, False)
    p = _params(q, [21], [21], None, None, causal=True)
    fwd_launcher.attn_fwd(q, k, v, p)
    with config.override(bwd_tiles=((16, 16, 4, 1), (16, 16, 4, 1))):
        bwd_launcher.attn_bwd(q, q, k, v, q, torch.zeros(1, 2, 21), p, *(torch.empty_like(x) for x in (q, k, v)))
    assert len(launched) == 3
    new = {"HEAD_DIM_V", "BLOCK_DV", "HAS_SINK", "HAS_CHUNK"}
    for kernel, args, meta in launched:
        assert not new & set(meta), (kernel, meta)
        names = kernel.arg_names
        for slot in ("SINK", "attention_chunk"):
            if slot in names:
                assert args[names.index(slot)] is None, (kernel, slot)
    # and with the features, each one's constexpr
    launched.clear()
    q, k, v, _, _ = _inputs([21], [21], 2, 1, 16, 32, torch.float16, False)
    p = _params(q, [21], [21], None, None, sink=torch.zeros(2), chunk=8)
    fwd_launcher.attn_fwd(q, k, v, p)
    (_, args, meta), = launched
    assert meta["HEAD_DIM_V"] == 32 and meta["BLOCK_DV"] == 32 and meta["HAS_SINK"] and meta["HAS_CHUNK"]
    assert args[fwd_launcher._attn_fwd_kernel.arg_names.index("attention_chunk")] == 8
