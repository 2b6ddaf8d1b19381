"""The Gluon launchers' host side on CPU (backends/triton/gluon_fwd.py): what they allocate and pass.

The kernels need an sm_90 GPU, so here validation and descriptors are stubbed and the kernels
replaced by spies: the test checks grids, outputs and the arguments both launchers build.
"""

import math

import pytest
import torch

from flashtile.backends.triton import gluon_fwd as launcher
from flashtile.kernels import gluon_fwd as kernels
from flashtile.kernels import gluon_fwd_fp8 as kernels_fp8
from spies import spy_launches


@pytest.fixture(autouse=True)
def no_gpu_checks(monkeypatch):
    monkeypatch.setattr(launcher, "_validate", lambda *a: None)
    monkeypatch.setattr(launcher, "_validate_fp8", lambda *a: None)
    monkeypatch.setattr(launcher, "_descriptor", lambda x, block: (x, tuple(block)))


def _same(view, x) -> bool:
    return view.data_ptr() == x.data_ptr() and view.shape == x.shape and view.stride() == x.stride()


def test_bf16_launcher_grid_outputs_and_arguments(monkeypatch):
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    q = torch.empty(2, 300, 8, 128, dtype=torch.float16)
    k = v = torch.empty(2, 300, 2, 128, dtype=torch.float16)
    out, lse = launcher.gluon_attn_fwd(q, k, v, causal=True)
    assert out.shape == q.shape and out.dtype == torch.float16
    assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32
    (args, kw), = spy.calls
    bm = kw["BLOCK_M"]
    assert spy.grids == [(math.ceil(300 / bm), 2 * 8)]
    # desc_q, desc_q2, desc_k, desc_k2, desc_v, desc_o: no tail, so the tail descriptors repeat q's and k's
    assert _same(args[0][0], q) and args[0][1] == (1, bm, 1, 128) and args[1] is args[0] and args[3] is args[2]
    assert args[5][0] is out and args[6] is lse
    assert args[7] is lse and kw["HAS_SINK"] is False  # no sink: a dummy pointer
    # seqlen, heads, heads per kv head, scale in base 2
    assert args[10:14] == (300, 8, 4, pytest.approx(128 ** -0.5 * launcher.LOG2E))
    assert kw["CAUSAL"] is True and (kw["HEAD_DIM"], kw["HEAD_DIM_TAIL"], kw["HEAD_DIM_V"]) == (128, 0, 128)


def test_bf16_launcher_splits_a_head_dim_of_192(monkeypatch):
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    q = torch.empty(1, 256, 4, 192, dtype=torch.bfloat16)
    k = torch.empty(1, 256, 2, 192, dtype=torch.bfloat16)
    v = torch.empty(1, 256, 2, 128, dtype=torch.bfloat16)
    out, _ = launcher.gluon_attn_fwd(q, k, v)
    assert out.shape == (1, 256, 4, 128)
    (args, kw), = spy.calls
    bm, bn = kw["BLOCK_M"], kw["BLOCK_N"]
    # two descriptors per q / k: the first 128 columns and the 64 after them, over the same storage
    assert _same(args[0][0], q[..., :128]) and args[0][1] == (1, bm, 1, 128)
    assert _same(args[1][0], q[..., 128:]) and args[1][1] == (1, bm, 1, 64)
    assert _same(args[2][0], k[..., :128]) and _same(args[3][0], k[..., 128:]) and args[3][1] == (1, bn, 1, 64)
    assert args[4] == (v, (1, bn, 1, 128)) and args[5][1] == (1, bm, 1, 128)
    assert (kw["HEAD_DIM"], kw["HEAD_DIM_TAIL"], kw["HEAD_DIM_V"]) == (128, 64, 128)
    assert launcher.head_dim_split(192) == (128, 64) and launcher.head_dim_split(256) == (256, 0)


def test_bf16_launcher_passes_the_sink(monkeypatch):
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    q = k = v = torch.empty(1, 128, 4, 128, dtype=torch.bfloat16)
    sink = torch.zeros(4)
    launcher.gluon_attn_fwd(q, k, v, learnable_sink=sink)
    (args, kw), = spy.calls
    assert args[7] is sink and kw["HAS_SINK"] is True


def test_fp8_launcher_outputs_descales_and_scale(monkeypatch):
    spy = spy_launches(monkeypatch, kernels_fp8, "_gluon_attn_fwd_fp8_kernel", forward=False)
    q = torch.empty(1, 64, 4, 64, dtype=torch.float8_e4m3fn)
    k = torch.empty(1, 64, 4, 64, dtype=torch.float8_e4m3fn)
    v_t = torch.empty(1, 4, 64, 64, dtype=torch.float8_e4m3fn)
    kd = torch.ones(1, 4)
    out, lse = launcher.gluon_attn_fwd_fp8(q, k, v_t, k_descale=kd, softmax_scale=0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (1, 4, 64)
    (args, kw), = spy.calls
    assert args[5] is lse and torch.equal(args[6], kd) and args[7] is lse  # absent descales: a dummy
    assert args[-1] == pytest.approx(0.5 * launcher.LOG2E)
    assert (kw["HAS_Q_DESCALE"], kw["HAS_K_DESCALE"], kw["HAS_V_DESCALE"]) == (False, True, False)


def test_empty_inputs_launch_nothing(monkeypatch):
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    q = k = v = torch.empty(0, 16, 2, 64, dtype=torch.bfloat16)
    out, lse = launcher.gluon_attn_fwd(q, k, v)
    assert out.shape == q.shape and lse.shape == (0, 2, 16) and not spy.grids


def test_bf16_launcher_passes_k_sequences_of_their_own(monkeypatch):
    # packed k with its own cu_seqlens (and seqused_k): the VARLEN_K build; the grid follows q's longest sequence
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    monkeypatch.setattr(launcher, "_check_device", lambda *a: None)
    q = torch.empty(1024, 8, 128, dtype=torch.bfloat16)
    k = v = torch.empty(2048, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 300, 1024], dtype=torch.int32), torch.tensor([0, 500, 2048], dtype=torch.int32)
    used = torch.tensor([400, 1500], dtype=torch.int32)
    out, lse = launcher.gluon_attn_fwd(q, k, v, causal=True, cu_seqlens=cu_q, max_seqlen=724, cu_seqlens_k=cu_k,
                                       max_seqlen_k=1548, seqused_k=used)
    assert out.shape == (1024, 8, 128) and lse.shape == (8, 1024)
    (args, kw), = spy.calls
    assert spy.grids == [(math.ceil(724 / kw["BLOCK_M"]), 2 * 8)]
    assert kw["VARLEN"] and kw["VARLEN_K"] and "UNEQUAL" not in kw
    # seqused_k at most each sequence's slots (the Triton kernel's reading)
    assert args[-3] == 1548 and args[-2] is cu_k and args[-1].tolist() == [400, 1500]
    # without seqused_k, each sequence's key count from cu_seqlens_k
    spy.calls.clear()
    launcher.gluon_attn_fwd(q, k, v, cu_seqlens=cu_q, max_seqlen=724, cu_seqlens_k=cu_k, max_seqlen_k=1548)
    (args, kw), = spy.calls
    assert args[-1].tolist() == [500, 1548] and args[-1].dtype == torch.int32
    # seqused_k alone: k's sequences are q's, cut
    spy.calls.clear()
    launcher.gluon_attn_fwd(q, q[:, :2], q[:, :2], cu_seqlens=cu_q, max_seqlen=724, seqused_k=used)
    (args, kw), = spy.calls
    assert kw["VARLEN_K"] and args[-2] is cu_q and args[-1].tolist() == [300, 724]
    # shared cu_seqlens: the plain VARLEN build, dummies in k's slots
    spy.calls.clear()
    launcher.gluon_attn_fwd(q, q[:, :2], q[:, :2], cu_seqlens=cu_q, max_seqlen=724, cu_seqlens_k=cu_q)
    (args, kw), = spy.calls
    assert "VARLEN_K" not in kw


@pytest.mark.parametrize("kw, match", [
    (dict(cu_seqlens_k=torch.tensor([0, 500, 2048], dtype=torch.int64)), "cu_seqlens_k must be a contiguous int32"),
    (dict(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)), "seqused_k must be a contiguous int32 \\(2,\\)"),
    (dict(seqused_k=torch.tensor([1, 2], dtype=torch.int32), window_left=64, causal=True), "no window"),
    (dict(seqused_k=torch.tensor([1, 2], dtype=torch.int32), learnable_sink=torch.zeros(8)), "learnable_sink"),
])
def test_bf16_launcher_names_what_k_sequences_cannot_take(kw, match):
    q = torch.empty(1024, 8, 128, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 300, 1024], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        launcher.gluon_attn_fwd(q, q[:, :2], q[:, :2], cu_seqlens=cu_q, max_seqlen=724, **kw)


def test_bf16_launcher_without_any_key(monkeypatch):
    # k's own sequences, all empty: zeros and lse +inf, nothing launched
    spy = spy_launches(monkeypatch, kernels, "_gluon_attn_fwd_kernel", forward=False)
    q = torch.randn(100, 4, 128, dtype=torch.bfloat16)
    k = torch.empty(0, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    out, lse = launcher.gluon_attn_fwd(q, k, k, cu_seqlens=cu_q, max_seqlen=60, cu_seqlens_k=cu_k, max_seqlen_k=0)
    assert not spy.calls and torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
