"""GPU tests of the split decode kernel's tensor-descriptor loads (Route.tma, on by default for small programs on
sm_90; forced here with ``config.override(tma=True)``): against the reference, and
against pointer loads (the same values reach the same MMAs, so the outputs should agree bit for
bit; the assert allows bf16 rounding so a different but correct lowering is not a failure, and the
test prints whether they were bitwise equal)."""

import pytest
import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.backends.triton.decode import split
from test_gpu_kvcache import _check, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.gluon]  # gluon: not in the default GPU runs


@pytest.fixture
def sm90():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90")


@pytest.fixture
def tma_on():
    with config.override(tma=True):
        yield


def _record_tma(monkeypatch):
    seen = []
    real = split.launch

    def launch(kernel, grid, *args, **meta):
        if kernel is split._decode_kernel:
            seen.append(meta.get("USE_TMA", False))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(split, "launch", launch)
    return seen


@pytest.mark.parametrize("b,cap,num_splits,s_new,rotary", [(1, 8192, 0, 0, False), (1, 8192, 1, 1, True),
                                                           (4, 4099, 0, 1, False), (8, 16384, 3, 2, True)])
def test_tma_against_reference_and_pointer_loads(sm90, monkeypatch, b, cap, num_splits, s_new, rotary):
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, cap, torch.bfloat16, rotary=rotary)
    _against_reference_and_pointer_loads(monkeypatch, q, kc, vc, kw, num_splits, "")


def _against_reference_and_pointer_loads(monkeypatch, q, kc, vc, kw, num_splits, label):
    """Descriptor loads against the reference, then against pointer loads on the same inputs: within
    bf16 rounding (printed: whether bit for bit)."""
    seen = _record_tma(monkeypatch)
    with config.override(tma=True):
        _check(q, kc, vc, kw, causal=True, num_splits=num_splits)
    assert seen[-1] is True
    outs = []
    for tma in (False, True):
        with config.override(tma=tma):
            out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), causal=True, num_splits=num_splits,
                                               return_softmax_lse=True, **kw)
        outs.append((out, lse))
    assert seen[-2:] == [False, True]
    (o0, l0), (o1, l1) = outs
    print(f"{label}bitwise equal to pointer loads:", torch.equal(o0, o1) and torch.equal(l0, l1))
    assert (o0.float() - o1.float()).abs().max().item() <= 1e-2
    assert (l0 - l1).abs().max().item() <= 1e-3


@pytest.mark.parametrize("leftpad,batch_idx", [(True, False), (False, True)])
def test_tma_with_leftpad_and_batch_idx(sm90, tma_on, monkeypatch, leftpad, batch_idx):
    seen = _record_tma(monkeypatch)
    b, cap = 3, 5000
    q, kc, vc, kw = _inputs(b, 1, 1, 32, 8, 128, cap, torch.bfloat16)
    if leftpad:
        kw["cache_leftpad"] = (kw["cache_seqlens"] // 3).to(torch.int32)
    if batch_idx:
        big_k = torch.randn(b + 2, cap, 8, 128, device="cuda", dtype=torch.bfloat16)
        big_v = torch.randn_like(big_k)
        idx = torch.tensor([4, 0, 2], device="cuda", dtype=torch.int32)
        big_k[idx.long()], big_v[idx.long()] = kc, vc
        kc, vc = big_k, big_v
        kw["cache_batch_idx"] = idx
    _check(q, kc, vc, kw, causal=True)
    assert seen and all(seen)


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (80, torch.float16), (256, torch.bfloat16),
                                     (128, torch.float32)])
def test_tma_other_head_dims_and_dtypes(sm90, tma_on, monkeypatch, d, dtype):
    """d = 80 (128-wide tiles: the descriptor zero-fills past d), 256 (32-key tiles, 512-byte rows),
    fp32 (64-key tiles), against the reference with an appended key (the separate append kernel)."""
    seen = _record_tma(monkeypatch)
    q, kc, vc, kw = _inputs(2, 1, 1, 16, 4, d, 3000, dtype)
    _check(q, kc, vc, kw, causal=True)
    assert seen and all(seen)


def test_tma_never_reads_past_the_rows(sm90, tma_on, monkeypatch):
    """NaN in every slot past each row's keys: only masked pointer loads may touch them."""
    b, cap = 4, 8192
    q, kc, vc, kw = _inputs(b, 1, 0, 32, 8, 128, cap, torch.bfloat16)
    lens = kw["cache_seqlens"]
    for i in range(b):
        kc[i, int(lens[i]):] = float("nan")
        vc[i, int(lens[i]):] = float("nan")
    out = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("page,b,cap,num_splits,s_new,rotary", [(256, 1, 8192, 0, 0, False), (256, 4, 5000, 0, 1, True),
                                                                (128, 8, 16384, 3, 2, False)])
def test_page_aligned_tma_against_reference_and_pointer_loads(sm90, monkeypatch, page, b, cap, num_splits, s_new,
                                                              rotary):
    # pools of whole 128-key tiles (tma=True forces descriptors there; by default only up
    # to 32 key blocks per program)
    q, kc, vc, kw = _inputs(b, 1, s_new, 32, 8, 128, cap, torch.bfloat16, page=page, rotary=rotary)
    _against_reference_and_pointer_loads(monkeypatch, q, kc, vc, kw, num_splits, "paged: ")


def test_page_aligned_tma_never_reads_outside_the_rows(sm90, tma_on, monkeypatch):
    """NaN in every pool slot that holds no key of its row (past each row's length, unused pages)."""
    q, kc, vc, kw = _inputs(4, 1, 0, 32, 8, 128, 8192, torch.bfloat16, page=256)
    table, lens = kw["block_table"].long(), kw["cache_seqlens"]
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool, device=kc.device)
    for i in range(q.shape[0]):
        pos = torch.arange(int(lens[i]), device=kc.device)
        keep[table[i, pos // 256], pos % 256] = True
    kc[~keep] = float("nan")
    vc[~keep] = float("nan")
    out = flash_attn_with_kvcache(q, kc, vc, causal=True, **kw)
    assert torch.isfinite(out).all()
