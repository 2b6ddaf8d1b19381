"""GPU tests of the Gluon Hopper forward kernels (needs an sm_90 GPU; skipped elsewhere).

They cover bf16 and fp16, d = 64 / 128 / 256, every config of the table and of the tuning
candidates, and the fp8 kernel; a hang means a wrong barrier parity. Correctness bar as everywhere in
flashtile (tests/tolerance.py): the error against the fp32 reference must be within 2x the error of the
same computation done by PyTorch in the input dtype, plus a small absolute slack; lse within 1e-3 of the
reference's. fp8 uses FlashAttention-3's bar (tests/test_gpu_fp8.py) and must also agree closely with
flashtile's Triton fp8 kernel, whose semantics it copies.
"""

import math

import pytest
import torch

from flashtile.backends.reference import attention_ref
from tolerance import assert_fa_close, max_err

# "gluon": kept out of gpu_check.sh's `tests` step until it has run once: a wrong barrier phase
# would hang rather than fail, so `gpu_check.sh tests-gluon` runs it alone under a timeout
pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _hopper():
        pytest.skip("the Gluon kernel is sm_90 only (wgmma)")


def _poison():
    """Fill freed allocator blocks with NaN so an output element the kernel never wrote cannot pass."""
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device=DEV)
    del junk


def _check(q, k, v, causal, scale=None, config=None, window_left=-1, softcap=0.0, alibi_slopes=None,
           learnable_sink=None):
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _poison()
    out, lse = gluon_attn_fwd(q, k, v, scale, causal, config=config, window_left=window_left, softcap=softcap,
                              alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    torch.cuda.synchronize()
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    window = (window_left, 0 if causal else -1)
    extra = dict(alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, window_size=window, softcap=softcap,
                                 **extra)
    pt, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False, window_size=window,
                          softcap=softcap, **extra)
    assert_fa_close(out, ref, pt)
    assert torch.isfinite(lse).all(), "lse: non-finite values"
    err = (lse - ref_lse.float()).abs().max().item()
    assert err <= 1e-3, f"lse: max err {err:.3e}"
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [128, 1000, 4096])
def test_matches_reference(s, d, causal):
    b, h = 2, 4
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal)


@pytest.mark.parametrize("s", [1, 127, 129, 385])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 256])
def test_ragged_lengths(s, causal, d):
    # one partial block, a block boundary either side, and rings that wrap (d = 64: 4 blocks > 3 slots;
    # d = 256 runs 64-key blocks in two-slot rings: 7 blocks, the masked loop over 2 of them)
    q, k, v = (torch.randn(1, s, 2, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp16(d, causal):
    # dtype from the descriptors, P rounded to fp16 before PV; a larger scale exercises fp16's range
    for s in (385, 2048):
        q, k, v = (torch.randn(2, s, 4, d, device=DEV, dtype=torch.float16) for _ in range(3))
        _check(q, k, v, causal)
        _check(q * 2, k * 2, v, causal, scale=0.5 / math.sqrt(d))


def _candidates(cls):
    from flashtile.kernels.gluon_fwd import TUNE_CANDIDATES

    return [(d, c) for (c_cls, d), cands in TUNE_CANDIDATES.items() if c_cls == cls for c in cands]


def _config(c):
    return dict(BLOCK_M=c[0], BLOCK_N=c[1], NUM_BUFFERS=c[2], num_warps=c[3])


@pytest.mark.parametrize("d,cfg", _candidates("16bit"), ids=lambda x: str(x))
def test_every_tuning_candidate(d, cfg):
    # scripts/tune_gluon.py may pick any of these: each must be right on a ragged causal case (masked
    # loop over several blocks when BLOCK_M != BLOCK_N) and a non-causal one
    from flashtile.backends.triton.gluon_fwd import V_HEAD_DIMS

    q, k = (torch.randn(2, 1000, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 1000, 4, V_HEAD_DIMS[d][0], device=DEV, dtype=torch.bfloat16)
    _check(q, k, v, True, config=_config(cfg))
    _check(q, k, v, False, config=_config(cfg))


@pytest.mark.parametrize("d,dv,cfg", [(128, 128, (128, 128, 2, 8)), (192, 128, (128, 64, 2, 8)),
                                       (256, 256, (128, 64, 2, 8))], ids=["d128", "d192", "d256"])
def test_two_slot_rings_with_every_feature(d, dv, cfg):
    # two slots a ring is the fewest the loop allows: K of block j+3 and V of block j+1 load in iteration j into
    # slots just freed, so every refill rule, wrapped phase and masked loop copy runs at its tightest
    q, k = (torch.randn(2, 1000, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 1000, 4, dv, device=DEV, dtype=torch.bfloat16)
    config = _config(cfg)
    for causal in (False, True):
        _check(q, k, v, causal, config=config)
        _check(q, k, v, causal, config=config, softcap=30.0)
    _check(q, k, v, True, config=config, window_left=200)
    _check(q, k, v, True, config=config, alibi_slopes=torch.rand(4, device=DEV, dtype=torch.float32))
    _check(q, k, v, True, config=config, learnable_sink=torch.randn(4, device=DEV, dtype=torch.float32))
    # k longer than q (bottom-right diagonal) and blocks fewer than the ring's slots
    kl, vl = (torch.randn(2, 1300, 4, n, device=DEV, dtype=torch.bfloat16) for n in (d, dv))
    _check(q, kl, vl, True, config=config)
    qs, ks, vs = q[:, :70], k[:, :70], v[:, :70]
    _check(qs, ks, vs, True, config=config)


def test_agrees_with_sdpa():
    # an independent second opinion on the reference used above
    b, s, h, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out, _ = _check(q, k, v, causal=True)
    f32 = [x.float().transpose(1, 2) for x in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention(*f32, is_causal=True).transpose(1, 2)
    sdpa_bf16 = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                 is_causal=True).transpose(1, 2)
    assert max_err(out, sdpa) <= 2 * max_err(sdpa_bf16, sdpa) + 1e-5


@pytest.mark.parametrize("d", [128, 256])
def test_strided_inputs_and_gqa(d):
    # q, k, v as views of one packed qkv tensor (head strides != d), and 2 query heads per kv head
    b, s, h, h_k = 2, 777, 4, 2
    packed = torch.randn(b, s, h + 2 * h_k, d, device=DEV, dtype=torch.bfloat16)
    q, k, v = packed[:, :, :h], packed[:, :, h:h + h_k], packed[:, :, h + h_k:]
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False, scale=0.3)


def test_refuses_misaligned_strides():
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    # 68-element rows: the head stride is 136 bytes, not a multiple of 16, so TMA cannot read it
    q = torch.randn(1, 64, 2, 68, device=DEV, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="16-byte"):
        gluon_attn_fwd(q, q, q, 0.125, False)


# ---------------------------------------------------------------------------------------------
# fp8 (e4m3): gluon_attn_fwd_fp8 against the fp32 reference over the dequantised inputs and against
# flashtile's Triton fp8 kernel (same semantics: descales folded into the score scale, P in e4m3
# with the row max at 256, v_descale at the end).


def _fp8_inputs(b, s, h, h_k, d, head_scales=False):
    from flashtile.fp8 import quantize_qkv

    q = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, s, h_k, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(b, s, h_k, d, device=DEV, dtype=torch.bfloat16)
    if head_scales:
        # very different amax per (batch, kv head): a wrong descale index shows at once
        g = torch.linspace(0.25, 4.0, b * h_k, device=DEV).view(b, 1, h_k, 1)
        q = (q.view(b, s, h_k, h // h_k, d) * g.unsqueeze(-1)).view(b, s, h, d)
        k, v = k * g.flip(2), v * g
    return quantize_qkv(q, k, v)


def _run_fp8(q8, k8, v8, qd, kd, vd, causal, scale=None, config=None):
    from flashtile.backends.triton.attn_fwd_fp8 import transpose_v
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd_fp8

    vt = transpose_v(v8, varlen=False)
    _poison()
    out, lse = gluon_attn_fwd_fp8(q8, k8, vt, qd, kd, vd, softmax_scale=scale, causal=causal, config=config)
    torch.cuda.synchronize()
    b, s, h, d = q8.shape
    assert out.shape == (b, s, h, d) and out.dtype == torch.bfloat16
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    return out, lse


def _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, causal, scale=None):
    """FlashAttention-3's fp8 bar (as tests/test_gpu_fp8.py): within 2x the error of the exact
    attention with P rounded to e4m3 like the kernel, plus the bf16 output rounding."""
    from flashtile.backends.reference_fp8 import attention_ref_fp8

    kw = dict(causal=causal, softmax_scale=scale)
    ref, ref_lse = attention_ref_fp8(q8, k8, v8, qd, kd, vd, **kw)
    pt, _ = attention_ref_fp8(q8, k8, v8, qd, kd, vd, round_probs=True, **kw)
    assert torch.isfinite(out.float()).all(), "out: non-finite values"
    err, pt_err = (out.float() - ref).abs().max().item(), (pt - ref).abs().max().item()
    atol = 2 * (ref.bfloat16().float() - ref).abs().max().item() + 1e-3
    assert err <= 2 * pt_err + atol, f"max err {err:.3e} > 2 x pt err {pt_err:.3e} + {atol:.2e}"
    assert torch.isfinite(lse).all(), "lse: non-finite values"
    # Hopper's fp8 MMA accumulates with fewer mantissa bits than fp32: the bound scales with |lse|
    lse_err = (lse - ref_lse.float()).abs().max().item()
    assert lse_err < 1e-3 + 1e-3 * ref_lse.abs().max().item(), f"lse: max err {lse_err:.3e}"
    return ref, err


def _check_agrees_with_triton_fp8(out, lse, ref, q8, k8, v8, qd, kd, vd, causal, scale=None):
    """The Triton fp8 kernel computes the same quantities in the same order up to FMA contraction
    (a rare different e4m3 rounding of one P element): the two may differ by no more than the
    kernel's own error, and on average by a small fraction of it."""
    from flashtile.backends.triton.attn_fwd_fp8 import attn_fwd_fp8
    from flashtile.params import AttnParams

    d = q8.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    p = AttnParams(softmax_scale=scale, causal=causal, window_right=0 if causal else -1, q_descale=qd,
                   k_descale=kd, v_descale=vd)
    t_out, t_lse, _ = attn_fwd_fp8(q8, k8, v8, p)
    torch.cuda.synchronize()
    diff = (out.float() - t_out.float()).abs()
    t_err = (t_out.float() - ref).abs()
    atol = 2 * (ref.bfloat16().float() - ref).abs().max().item() + 1e-3
    assert diff.max().item() <= t_err.max().item() + atol, \
        f"gluon vs triton fp8: max diff {diff.max().item():.3e} > triton's error {t_err.max().item():.3e}"
    assert diff.mean().item() <= 0.25 * t_err.mean().item() + 1e-4, \
        f"gluon vs triton fp8: mean diff {diff.mean().item():.3e} vs triton's mean error {t_err.mean().item():.3e}"
    lse_diff = (lse - t_lse).abs().max().item()
    assert lse_diff <= 1e-3 + 1e-3 * t_lse.abs().max().item(), f"lse differs from triton fp8 by {lse_diff:.3e}"
    print(f"fp8 gluon vs triton: max {diff.max().item():.2e} mean {diff.mean().item():.2e} "
          f"(triton err max {t_err.max().item():.2e} mean {t_err.mean().item():.2e}), "
          f"bitwise equal {(diff == 0).float().mean().item():.4f}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [128, 1000, 4096])
def test_fp8_matches_reference_and_triton(s, d, causal):
    q8, k8, v8, qd, kd, vd = _fp8_inputs(2, s, 4, 4, d)
    out, lse = _run_fp8(q8, k8, v8, qd, kd, vd, causal)
    ref, _ = _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, causal)
    _check_agrees_with_triton_fp8(out, lse, ref, q8, k8, v8, qd, kd, vd, causal)


@pytest.mark.parametrize("s", [1, 127, 129, 385])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 256])
def test_fp8_ragged_lengths(s, causal, d):
    # V^T's key dim is padded to 16 in memory; the descriptor has the true length and zero-fills
    q8, k8, v8, qd, kd, vd = _fp8_inputs(1, s, 2, 2, d)
    out, lse = _run_fp8(q8, k8, v8, qd, kd, vd, causal)
    _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_gqa_and_per_head_descales(d):
    # 4 query heads per kv head, descales differing 16x across (batch, kv head), a custom scale
    for causal in (False, True):
        q8, k8, v8, qd, kd, vd = _fp8_inputs(2, 777, 8, 2, d, head_scales=True)
        assert qd.shape == (2, 2) and (qd.max() / qd.min()).item() > 4
        out, lse = _run_fp8(q8, k8, v8, qd, kd, vd, causal, scale=0.3 / math.sqrt(d))
        ref, _ = _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, causal, scale=0.3 / math.sqrt(d))
        _check_agrees_with_triton_fp8(out, lse, ref, q8, k8, v8, qd, kd, vd, causal, scale=0.3 / math.sqrt(d))


def test_fp8_without_descales():
    # descales None mean 1: e4m3 straight from randn (values within e4m3's range)
    b, s, h, d = 2, 1000, 4, 128
    e4m3 = torch.float8_e4m3fn
    q8, k8, v8 = (torch.randn(b, s, h, d, device=DEV).to(e4m3) for _ in range(3))
    for causal in (False, True):
        out, lse = _run_fp8(q8, k8, v8, None, None, None, causal)
        ref, _ = _check_fp8(out, lse, q8, k8, v8, None, None, None, causal)
        _check_agrees_with_triton_fp8(out, lse, ref, q8, k8, v8, None, None, None, causal)


@pytest.mark.parametrize("d,cfg", _candidates("fp8"), ids=lambda x: str(x))
def test_every_fp8_tuning_candidate(d, cfg):
    q8, k8, v8, qd, kd, vd = _fp8_inputs(2, 1000, 4, 2, d)
    for causal in (True, False):
        out, lse = _run_fp8(q8, k8, v8, qd, kd, vd, causal, config=_config(cfg))
        _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, causal)


def test_fp8_refuses_bad_v_t_and_descales():
    from flashtile.backends.triton.attn_fwd_fp8 import transpose_v
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd_fp8

    q8, k8, v8, qd, kd, vd = _fp8_inputs(2, 64, 4, 2, 64)
    with pytest.raises(ValueError, match="v_t must be V transposed"):
        gluon_attn_fwd_fp8(q8, k8, v8, qd, kd, vd)
    with pytest.raises(ValueError, match="fp32 of shape"):
        gluon_attn_fwd_fp8(q8, k8, transpose_v(v8, varlen=False), qd.repeat(1, 2), kd, vd)
    # an unpadded V^T whose key stride (63 bytes) TMA cannot use
    vt = v8[:, :63].permute(0, 2, 3, 1).contiguous()
    with pytest.raises(ValueError, match="16-byte"):
        gluon_attn_fwd_fp8(q8[:, :63], k8[:, :63], vt, qd, kd, vd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s", [1, 127, 1000, 4096])
def test_q_k_192_with_v_128(s, causal, dtype):
    # q / k arrive as 128 + 64 columns whose QK^T wgmmas accumulate into one score tile; out has v's 128
    q, k = (torch.randn(2, s, 4, 192, device=DEV, dtype=dtype) for _ in range(2))
    v = torch.randn(2, s, 4, 128, device=DEV, dtype=dtype)
    _check(q, k, v, causal)


def test_q_k_192_strided_with_gqa():
    # views of one packed tensor (the tail columns' descriptor starts 256 bytes into each row), 2 heads per kv head
    b, s, h, h_k = 2, 777, 4, 2
    packed = torch.randn(b, s, h + h_k, 192, device=DEV, dtype=torch.bfloat16)
    q, k = packed[:, :, :h], packed[:, :, h:]
    v = torch.randn(b, s, h_k, 128, device=DEV, dtype=torch.bfloat16)
    _check(q, k, v, causal=True)
    _check(q, k, v, causal=False, scale=0.3)


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("window_left", [0, 1, 63, 128, 200, 1000])
@pytest.mark.parametrize("s", [127, 1000, 4096])
def test_causal_sliding_window(s, window_left, d, dv):
    # the key loop starts at the first block any row of the tile sees (its own block numbering), masks the
    # window's left edge; rows whose first blocks hide every key keep P = 0, not NaN
    q, k = (torch.randn(2, s, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, s, 4, dv, device=DEV, dtype=torch.bfloat16)
    _check(q, k, v, True, window_left=window_left)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv,s", [(128, 128, 1000), (128, 128, 4096), (192, 128, 777)])
def test_softcap(s, d, dv, causal, softcap):
    # scores capped through tanh before the mask; a large scale makes the cap bite
    q, k = (torch.randn(2, s, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, s, 4, dv, device=DEV, dtype=torch.bfloat16)
    _check(q * 3, k, v, causal, softcap=softcap)
    _check(q, k, v, True, window_left=300, softcap=softcap)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("d,dv,s", [(128, 128, 1000), (128, 128, 4096), (192, 128, 777)])
def test_alibi(s, d, dv, per_batch):
    # causal ALiBi: the standard slopes (the largest 1/2), alone, with a window, a softcap and a sink
    from flashtile.modules.mha import get_alibi_slopes

    h = 4
    q, k = (torch.randn(2, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, s, h, dv, device=DEV, dtype=torch.bfloat16)
    slopes = torch.tensor(get_alibi_slopes(h), device=DEV, dtype=torch.float32)
    if per_batch:
        slopes = torch.stack([slopes, slopes.flip(0) / 4])
    _check(q, k, v, True, alibi_slopes=slopes)
    _check(q, k, v, True, alibi_slopes=slopes, window_left=300, softcap=30.0)
    _check(q, k, v, True, alibi_slopes=slopes, learnable_sink=torch.randn(h, device=DEV))


@pytest.mark.parametrize("sq,sk", [(1000, 3000), (4096, 4100), (700, 129), (128, 5000)])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
def test_unequal_lengths(sq, sk, d, dv):
    # q and k of different lengths (padded): the diagonal aligned bottom-right as FlashAttention's, causal
    # only where k is the longer (the route sends the rest to the Triton kernel)
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    q = torch.randn(2, sq, 4, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, sk, 2, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(2, sk, 2, dv, device=DEV, dtype=torch.bfloat16)
    _check(q, k, v, False)
    if sk < sq:
        with pytest.raises(ValueError, match="seqlen_k >= seqlen_q"):
            gluon_attn_fwd(q, k, v, causal=True)
        return
    _check(q, k, v, True)
    _check(q, k, v, True, window_left=300, softcap=30.0)


def test_alibi_needs_causal():
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    q = torch.randn(1, 256, 2, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="alibi_slopes needs causal"):
        gluon_attn_fwd(q, q, q, causal=False, alibi_slopes=torch.ones(2, device=DEV))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
def test_varlen_packed_sequences(causal, d, dv):
    # ragged lengths: tiles past a sequence exit, a last tile ending inside the next sequence stores row by row
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    lens = [1, 127, 128, 129, 1000, 300]
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0).to(torch.int32)
    total, h = sum(lens), 4
    q, k = (torch.randn(total, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(total, h, dv, device=DEV, dtype=torch.bfloat16)
    _poison()
    out, lse = gluon_attn_fwd(q, k, v, d ** -0.5, causal, cu_seqlens=cu, max_seqlen=max(lens))
    torch.cuda.synchronize()
    assert out.shape == (total, h, dv) and lse.shape == (h, total)
    for i in range(len(lens)):
        a, b = cu[i].item(), cu[i + 1].item()
        ref, ref_lse = attention_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)
        pt, _ = attention_ref(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal, upcast=False)
        assert_fa_close(out[None, a:b], ref, pt)
        assert (lse[:, a:b] - ref_lse[0].float()).abs().max().item() <= 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("used", [False, True], ids=["cu_seqlens_k", "seqused_k"])
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["nocap", "softcap"])
def test_varlen_k_sequences_of_their_own(causal, d, dv, used, softcap):
    # k longer, shorter and empty per sequence (the VARLEN_K build): bottom-right masks per sequence; a row
    # above k's diagonal, or in a sequence without keys, gets out 0 and lse +inf (FlashAttention's rule)
    from flashtile.backends.triton.gluon_fwd import gluon_attn_fwd

    lens_q = [1, 127, 300, 1000, 129, 64, 700]
    lens_k = [5, 127, 1500, 200, 0, 64, 2100]
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *(n + 16 * used for n in lens_k)], device=DEV).cumsum(0).to(torch.int32)
    seqused = torch.tensor(lens_k, device=DEV, dtype=torch.int32) if used else None
    h, h_k = 4, 2
    q = torch.randn(cu_q[-1].item(), h, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(cu_k[-1].item(), h_k, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(cu_k[-1].item(), h_k, dv, device=DEV, dtype=torch.bfloat16)
    _poison()
    out, lse = gluon_attn_fwd(q, k, v, d ** -0.5, causal, cu_seqlens=cu_q, max_seqlen=max(lens_q), softcap=softcap,
                              cu_seqlens_k=cu_k, max_seqlen_k=max(lens_k) + 16 * used, seqused_k=seqused)
    torch.cuda.synchronize()
    assert out.shape == (q.shape[0], h, dv) and lse.shape == (h, q.shape[0])
    for i, nk in enumerate(lens_k):
        a, b, c = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item()
        if nk == 0:
            assert torch.equal(out[a:b], torch.zeros_like(out[a:b])) and torch.isinf(lse[:, a:b]).all()
            continue
        kk, vv = k[None, c:c + nk], v[None, c:c + nk]
        ref, ref_lse = attention_ref(q[None, a:b], kk, vv, causal=causal, softcap=softcap)
        pt, _ = attention_ref(q[None, a:b], kk, vv, causal=causal, upcast=False, softcap=softcap)
        assert_fa_close(out[None, a:b], ref, pt)
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isinf(lse[:, a:b]), ~finite)
        assert (lse[:, a:b][finite] - ref_lse[0][finite].float()).abs().max().item() <= 1e-3


def test_varlen_k_through_the_public_api(monkeypatch):
    # flash_attn_varlen_func with k's own cu_seqlens and a softcap reaches the Gluon kernel (the route's VARLEN_K
    # coverage; without a softcap the route keeps such calls on the Triton kernel, measured faster)
    import flashtile
    from flashtile import config
    from flashtile.backends.triton import gluon_fwd as launcher

    calls = []
    real = launcher.gluon_attn_fwd
    monkeypatch.setattr(launcher, "gluon_attn_fwd", lambda *a, **kw: calls.append(kw) or real(*a, **kw))

    lens_q, lens_k = [2048, 1500], [4096, 3000]
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 8, 128, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    flashtile.flash_attn_varlen_func(*args, causal=True)
    assert not calls
    got = flashtile.flash_attn_varlen_func(*args, causal=True, softcap=30.0)
    assert len(calls) == 1 and calls[0]["cu_seqlens_k"] is cu_k
    with config.override(gluon_fwd=False):
        want = flashtile.flash_attn_varlen_func(*args, causal=True, softcap=30.0)
    assert len(calls) == 1 and (got.float() - want.float()).abs().max().item() <= 2e-2
