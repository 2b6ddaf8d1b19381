"""GPU tests of the Gluon dK/dV kernel (kernels/gluon_bwd.py) through the public backward, with the
route pinned on (config.gluon_bwd). Each test also checks that the Gluon kernel really ran, so a refused
call cannot pass as a Gluon result. The causal cases caught a register hazard of an earlier version
(kernels/gluon_bwd.py's docstring). The table's configs run through the public backward; both schedules
(rotated and plain order) also run directly against the Triton kernel."""

import pytest
import torch

import flashtile
from attn_cases import check_padded, grads_switched, record_calls, repeated_grads
from flashtile import config
from flashtile.backends.triton import gluon_bwd

# "gluon": run alone (gpu_check.sh tests-gluon-bwd), like the Gluon forward's tests, not in full runs
pytestmark = [pytest.mark.gpu, pytest.mark.gluon]
DEV = "cuda"


@pytest.fixture
def gluon_on(monkeypatch):
    calls = record_calls(monkeypatch, gluon_bwd, "gluon_attn_bwd_dkdv")
    with config.override(gluon_bwd=True):
        yield calls


@pytest.mark.parametrize("d", [64, 128, 256])  # 256: two warpgroups side by side
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (256, 4, 1), (1000, 8, 8)])
def test_gluon_dkdv_grads(gluon_on, d, causal, s, h, h_k):
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=causal)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,h,h_k", [(1, 2, 2), (77, 4, 2), (1000, 8, 8), (2048, 4, 1)])
def test_gluon_dkdv_q_k_192_with_v_128(gluon_on, dtype, causal, s, h, h_k):
    # q / k / dk as 128 + 64 columns (two score products summed, two dK accumulators), v / dv of 128
    check_padded(2, s, s, h, h_k, 192, dtype, device=DEV, causal=causal, dv=128)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("window_left", [0, 5, 64, 200, 1000])
@pytest.mark.parametrize("s,h,h_k", [(77, 4, 2), (1000, 4, 4), (2048, 4, 1)])
def test_gluon_dkdv_causal_sliding_window(gluon_on, d, dv, window_left, s, h, h_k):
    # the LOCAL build: queries past window_left after a key block are never visited, the left edge is masked
    check_padded(2, s, s, h, h_k, d, torch.bfloat16, device=DEV, causal=True, window_size=(window_left, 0), dv=dv)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("d", [128, 256])  # fp16 is routed by default at both
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_dkdv_fp16_and_long(gluon_on, d, causal):
    check_padded(1, 4096, 4096, 4, 4, d, torch.float16, device=DEV, causal=causal)
    assert gluon_on


@pytest.mark.parametrize("shape", [(2, 2048, 8, 128), (2, 2048, 4, 256)])
def test_gluon_dkdv_repeatable(gluon_on, shape):
    # a race or a register hazard shows as run-to-run differences (the kernel has one writer per
    # output); d = 256 adds the two warpgroups' P^T / dS^T exchange through shared memory
    runs = repeated_grads(6, shape=shape, device=DEV, causal=True)
    assert gluon_on
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


def test_gluon_dkdv_matches_triton(gluon_on, monkeypatch):
    got, want = grads_switched("gluon_bwd", gluon_on, device=DEV)
    for a, b in zip(got, want):
        # two fp32 summation orders, one bf16 rounding each
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_refused_calls_take_triton(gluon_on):
    q, k, v = (torch.randn(1, 128, 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, device=DEV, dtype=torch.float32)
    out = flashtile.flash_attn_func(q, k, v, alibi_slopes=slopes, causal=False)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not gluon_on  # ALiBi without causal masking is outside the kernel's scope


# both schedules per head dim, as (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps, WARPS_N): the table
# takes one of them (plain order at d = 128 / 256, rotated at d = 64), scripts/tune_gluon_bwd.py the other
ORDER_CONFIGS = {
    (64, True): (64, 64, 4, 4, 1), (64, False): (64, 64, 2, 4, 1),
    (128, True): (32, 64, 4, 4, 1), (128, False): (64, 64, 2, 4, 1),
    (256, True): (32, 64, 4, 8, 2), (256, False): (64, 64, 2, 8, 2),
}


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotated", [True, False])
def test_both_orders_match_triton(d, causal, rotated):
    # each schedule launched directly, against the Triton dK/dV
    torch.manual_seed(0)
    b, s, h, h_k = 2, 1000, 4, 2
    q = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, h_k, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn_like(q)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    # s = 1000 is below the route table's shortest length: the Triton kernels compute these
    _, want_dk, want_dv = torch.autograd.grad(out, (q, k, v), g)
    delta = (g.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    tiles = dict(zip(("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps", "WARPS_N"), ORDER_CONFIGS[d, rotated]))
    tiles["ROTATED"] = rotated
    gluon_bwd.gluon_attn_bwd_dkdv(q.detach(), k.detach(), v.detach(), g, lse.contiguous(), delta, dk, dv,
                                  d ** -0.5, causal, config=tiles)
    for got, want in ((dk, want_dk), (dv, want_dv)):
        assert (got.float() - want.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_dkdv_packed_sequences(gluon_on, d, dv, causal):
    # one cu_seqlens for q and k (the VARLEN build): key blocks past a sequence exit, a block ending inside the
    # next sequence stores its dK / dV rows one by one
    from flashtile.backends.reference import attention_ref
    from tolerance import assert_fa_close

    lens, h, h_k = [1, 63, 64, 65, 1000, 300], 4, 2
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0).to(torch.int32)
    total = sum(lens)
    q, k = (torch.randn(total, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for n in (h, h_k))
    v = torch.randn(total, h_k, dv, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    ref = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)[0]
    pt = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal, upcast=False)[0]
    g = torch.randn_like(out)
    for name, x, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                             torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(pt, (q, k, v), g)):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_gluon_dkdv_softcap(gluon_on, d, dv, causal, softcap):
    # dS^T carries tanh's derivative; a window on top for the causal rows
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=causal, softcap=softcap, dv=dv)
    if causal:
        check_padded(1, 777, 777, 4, 4, d, torch.bfloat16, device=DEV, causal=True, softcap=softcap, dv=dv,
                     window_size=(200, 0))
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("slopes", ["h", "bh"])
def test_gluon_dkdv_alibi(gluon_on, d, dv, slopes):
    # causal ALiBi (the ALIBI build): P takes the full bias slope * (key - row) against the forward's lse; h 4 over
    # h_k 2, so each CTA walks two query heads with slopes of their own. Alone, inside a window, with a softcap
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=True, alibi=slopes, dv=dv)
    check_padded(1, 777, 777, 4, 4, d, torch.bfloat16, device=DEV, causal=True, alibi=slopes, dv=dv,
                 window_size=(200, 0))
    check_padded(2, 1000, 1000, 4, 2, d, torch.bfloat16, device=DEV, causal=True, alibi=slopes, dv=dv,
                 softcap=30.0)
    assert gluon_on, "the Gluon dK/dV kernel did not run"


def _assert_grads_close(out, ref, pt, inputs):
    from tolerance import assert_fa_close

    g = torch.randn_like(out)
    for name, x, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, inputs, g),
                             torch.autograd.grad(ref, inputs, g), torch.autograd.grad(pt, inputs, g)):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)


def test_gluon_dkdv_alibi_standard_slopes_long(gluon_on):
    # the paper's slopes (the largest 1/2) over 4096 keys: biases of thousands far from the diagonal, where P must
    # come out 0, and the row / key split of the bias must keep its precision near it
    from flashtile.backends.reference import attention_ref
    from flashtile.modules.mha import get_alibi_slopes

    h, h_k = 8, 2
    q = torch.randn(1, 4096, h, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 4096, h_k, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    slopes = torch.tensor(get_alibi_slopes(h), device=DEV, dtype=torch.float32)
    out = flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    ref = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)[0]
    pt = attention_ref(q, k, v, causal=True, alibi_slopes=slopes, upcast=False)[0]
    _assert_grads_close(out, ref, pt, (q, k, v))
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("per_sequence", [False, True], ids=["slopes_h", "slopes_bh"])
def test_gluon_dkdv_alibi_packed_sequences(gluon_on, per_sequence):
    # VARLEN with ALiBi: rows and keys count from each sequence's start, (b, h) slopes are per sequence
    from flashtile.backends.reference import attention_ref

    lens, h, h_k, d = [1, 63, 64, 65, 1000, 300], 4, 2, 128
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0).to(torch.int32)
    total = sum(lens)
    q, k, v = (torch.randn(total, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for n in (h, h_k, h_k))
    slopes = torch.rand(len(lens), h, device=DEV) * 0.3 if per_sequence else torch.rand(h, device=DEV) * 0.3
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, alibi_slopes=slopes)
    ref = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, alibi_slopes=slopes)[0]
    pt = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, alibi_slopes=slopes, upcast=False)[0]
    _assert_grads_close(out, ref, pt, (q, k, v))
    assert gluon_on, "the Gluon dK/dV kernel did not run"


def test_non_causal_alibi_takes_triton(gluon_on):
    q, k, v = (torch.randn(1, 128, 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, alibi_slopes=torch.rand(2, device=DEV) * 0.3)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not gluon_on  # the kernel's ALiBi is causal only


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("sq,sk", [(1000, 3000), (700, 129), (4096, 4100), (77, 1000)])
def test_gluon_dkdv_unequal_lengths(gluon_on, d, dv, sq, sk):
    # the UNEQUAL build: keys compared with query rows through the bottom-right shift sk - sq; causal (with a
    # window too) only where k is the longer, as the route takes it
    check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=False, dv=dv)
    if sk >= sq:
        check_padded(2, sq, sk, 4, 2, d, torch.bfloat16, device=DEV, causal=True, dv=dv)
        check_padded(1, sq, sk, 4, 4, d, torch.bfloat16, device=DEV, causal=True, dv=dv, window_size=(300, 0))
    assert gluon_on, "the Gluon dK/dV kernel did not run"


@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_gluon_dkdv_k_sequences_of_their_own(gluon_on, monkeypatch, d, dv, causal, softcap):
    # k with its own cu_seqlens (the VARLEN_K build): longer, shorter and empty per sequence, aligned bottom-right;
    # queries above k's diagonal see nothing (zero gradients), keys no query sees get zero dK / dV
    from flashtile.backends.reference import attention_ref
    from tolerance import assert_fa_close

    lens_q, lens_k, h, h_k = [1, 63, 300, 1000, 65, 128], [5, 63, 700, 130, 0, 1100], 4, 2
    cu_q = torch.tensor([0, *lens_q], device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), h_k, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), h_k, dv, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(causal=causal, softcap=softcap)
    seen, real = [], gluon_bwd.gluon_attn_bwd_dkdv
    monkeypatch.setattr(gluon_bwd, "gluon_attn_bwd_dkdv", lambda *a, **kws: seen.append(kws) or real(*a, **kws))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    ref = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)[0]
    pt = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, upcast=False, **kw)[0]
    g = torch.randn_like(out)
    for name, x, r, p in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g),
                             torch.autograd.grad(ref, (q, k, v), g), torch.autograd.grad(pt, (q, k, v), g)):
        assert_fa_close(x, r, p, factor=3.0, atol=1e-4, name=name)
    assert gluon_on and seen[-1]["cu_seqlens_k"] is cu_k, "the Gluon VARLEN_K dK/dV build did not run"
