"""The Triton backward kernels through Triton's interpreter on CPU (fp16/fp32) against the reference.

Gradients are held to FlashAttention's 3x rule; both orientations of the masked/unmasked block
split are crossed by tiny pinned tiles.
"""

import pytest
import torch

import flashtile
from attn_cases import check_padded, check_varlen
from flashtile import config
from flashtile.backends.triton import attn_bwd as bwd_launcher

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("tiny_triton_tiles")]


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (1, 33), (37, 20), (20, 45)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(sq, sk, causal):
    check_padded(2, sq, sk, 2, 1, 16, torch.float16, causal=causal)


@pytest.mark.parametrize("d", [8, 40, 59])
def test_head_dims(d):
    check_padded(1, 19, 23, 2, 2, d, torch.float16, causal=True)


@pytest.mark.parametrize("d,dv", [(192, 128), (192, 192), (160, 160)])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(softcap=2.0, causal=True), dict(alibi="bh")])
def test_dq_tail_tile(d, dv, kw):
    # past 128 a head dim that is not a power of two runs dQ as a lead tile and a tail tile (bwd_launcher.dq_head_dims)
    kw = dict(kw)
    check_padded(1, 21, 37, 2, 1, d, torch.float16, dv=dv, alibi=kw.pop("alibi", None), **kw)


def test_dq_head_dims_split_only_past_128():
    assert bwd_launcher.dq_head_dims(192, 128) == dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_TAIL=64, BLOCK_DT=64,
                                                       HEAD_DIM_V=128, BLOCK_DV=128)
    assert bwd_launcher.dq_head_dims(160, 160) == dict(HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_TAIL=32, BLOCK_DT=32,
                                                       HEAD_DIM_V=160, BLOCK_DV=256)
    assert bwd_launcher.dq_head_dims(136, 136)["BLOCK_DT"] == 16
    for d in (40, 96, 128, 256):
        assert bwd_launcher.dq_head_dims(d, d) == dict(HEAD_DIM=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()))


FEATURES = [
    dict(window_size=(6, 2)),
    dict(window_size=(0, 0)),
    dict(window_size=(11, -1), causal=True),
    dict(softcap=2.5),
    dict(softcap=1.5, causal=True),
    dict(alibi="h", causal=True),
    dict(alibi="bh", window_size=(8, 8)),
    dict(dropout_p=0.2),
    dict(dropout_p=0.3, causal=True),
]


@pytest.mark.parametrize("feature", range(len(FEATURES)))
@pytest.mark.parametrize("sq,sk", [(21, 47), (47, 21)])
def test_features_fp32(feature, sq, sk):
    check_padded(2, sq, sk, 4, 2, 16, torch.float32, **FEATURES[feature])


def test_gqa_mqa_fp16():
    check_padded(1, 29, 31, 8, 2, 32, torch.float16, causal=True)
    check_padded(1, 29, 31, 4, 1, 32, torch.float16)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 2)), dict(alibi="bh")])
def test_varlen_with_empty_sequences(kw):
    check_varlen([17, 0, 40, 1], [20, 5, 0, 13], 2, 1, 16, torch.float32, **kw)


def test_fully_masked_rows_have_zero_gradients():
    q = torch.randn(1, 20, 2, 16, requires_grad=True)
    k = torch.randn(1, 6, 2, 16, requires_grad=True)
    v = torch.randn(1, 6, 2, 16, requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and (q.grad[:, :14] == 0).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_packed_grads_written_into_packed_buffer():
    qkv = torch.randn(2, 23, 3, 2, 16, requires_grad=True)
    g = torch.randn(2, 23, 2, 16)
    flashtile.flash_attn_qkvpacked_func(qkv, causal=True).backward(g)
    from flashtile.backends.reference import attention_ref

    leaf = qkv.detach().clone().requires_grad_()
    ref, _ = attention_ref(*leaf.unbind(2), causal=True)
    ref.backward(g)
    assert (qkv.grad - leaf.grad).abs().max() < 1e-4


def test_deterministic_backward_bitwise():
    q, k, v = (torch.randn(1, 33, 4, 16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 33, 4, 16)
    grads = []
    for _ in range(3):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), g))
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_different_tiles_per_kernel():
    # the dK/dV and dQ kernels take their own tiles, so their grids differ per (batch, head)
    with config.override(bwd_tiles=((16, 32, 4, 1), (32, 16, 4, 1))):
        check_padded(2, 21, 47, 4, 2, 16, torch.float32, causal=True)
        check_padded(1, 47, 21, 4, 1, 16, torch.float32, dropout_p=0.2)
        check_varlen([17, 0, 40, 1], [20, 5, 0, 13], 2, 1, 16, torch.float32, causal=True)


def test_unpipelined_edges():
    # config.pipeline_edges=False: the masked ranges of the dK/dV and dQ programs load directly in every
    # launch; the interpreter ignores pipelining, so this checks the path and the gradients (windowed
    # and causal, so both edges have blocks)
    with config.override(pipeline_edges=False):
        assert bwd_launcher.edge_setting("sm90", 64, True, 2) == {"PIPELINE_EDGES": False}
        check_padded(2, 37, 45, 2, 1, 16, torch.float16, causal=True, window_size=(9, -1))
        check_varlen([17, 0, 40, 1], [20, 5, 0, 13], 2, 1, 16, torch.float16, causal=True)
        check_padded(2, 37, 45, 2, 1, 16, torch.float16, causal=False)
    with config.override(pipeline_edges=True):
        assert bwd_launcher.edge_setting("sm90", 64, False, 2) == {}


def test_edge_rule():
    """Unset: direct loads on sm_90 for 2-byte inputs at BLOCK_D 32 / 64 / 128 without a band (measured); causal
    and windowed launches, other head dims, dtypes and GPUs keep the pipeline."""
    for block_d in (32, 64, 128):
        assert bwd_launcher.edge_setting("sm90", block_d, False, 2) == {"PIPELINE_EDGES": False}
    for args in (("sm90", 64, True, 2), ("sm90", 128, True, 2), ("sm90", 32, True, 2), ("sm90", 256, False, 2),
                 ("sm90", 64, False, 4), ("default", 64, False, 2), ("interpret", 64, False, 2)):
        assert bwd_launcher.edge_setting(*args) == {}, args


def test_the_launch_takes_the_rule(monkeypatch):
    """The launcher hands the kernels what edge_setting says for the call's band (causal or window)."""
    seen = []

    def rule(arch, block_d, banded, elem_bytes, dropout):
        seen.append((banded, dropout))
        return {}

    monkeypatch.setattr(bwd_launcher, "edge_setting", rule)
    for causal, window, p in ((False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (5, -1), 0.0),
                              (True, (-1, -1), 0.2)):
        check_padded(1, 21, 21, 2, 1, 16, torch.float16, causal=causal, window_size=window, dropout_p=p)
    assert seen == [(False, False), (True, False), (True, False), (True, True)]


def test_dropout_loads_masked_ranges_directly():
    """Triton 3.6's pipelined masked ranges fault on sm_90 with dropout (varlen + causal, d = 128): with
    dropout every launch takes direct loads, on any GPU, banded or not."""
    for args in (("sm90", 128, True, 2), ("sm90", 256, False, 2), ("default", 64, True, 2), ("sm90", 64, True, 4)):
        assert bwd_launcher.edge_setting(*args, dropout=True) == {"PIPELINE_EDGES": False}, args
