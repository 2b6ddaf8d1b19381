"""The decode kernel's tensor-descriptor loads (backends/triton/decode.py use_decode_tma; by default
on sm_90 where a program reads few key blocks, as measured on the H200), on CPU through the
interpreter, and the default rule with a CUDA device standing in.

With TMA forced, a contiguous cache's unmasked key blocks are read by descriptor; the masked blocks
(a row's last partial block, window edges, the new keys) keep pointer loads. Results must equal the
pointer path's bit for bit (same data, same arithmetic; to rounding where the head dim is padded)
and the independent oracle of
test_kvcache.py, also when the cache holds NaN past every row's length: a descriptor does not mask
those keys, so they must never be read by one.
"""

import pytest
import torch

from flashtile.backends.triton import decode as launcher
from flashtile.kvcache import flash_attn_with_kvcache
from test_kvcache import CASES, _run_and_check, dense_oracle, make_case

# cases of test_kvcache.py plus two whose unmasked interior is wide enough for descriptor loads
# with 16-key tiles (its "window" case, 7 keys wide, has none) and whose masked tails are not
# new keys (new-key blocks never consider descriptors)
CASES = dict(CASES, wide_window=dict(s_new=0, sq=1, window_size=(40, 0)),
             read_only_leftpad=dict(s_new=0, leftpad=True, causal=True))
# page-aligned caches (pages of whole 16-key tiles, no left padding) take descriptors too
CASES.update(paged_32_read_only=dict(page=32, s_new=0), paged_16_window=dict(page=16, s_new=1, window_size=(40, 0)))
PAGED = ["paged_16", "paged_32_read_only", "paged_16_window"]
CONTIGUOUS = ["read_only_int_len", "read_only_full_cache", "append_rows", "batch_idx", "leftpad", "wide_window",
              "read_only_leftpad", "causal_prefill", "gqa_8_to_1", "mha_odd_d", "larger_cache_than_batch", "softcap"]


def _call(q, kc, vc, args, num_splits):
    args = dict(args)
    if "scale" in args:
        args["softmax_scale"] = args.pop("scale")
    kc, vc = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits, return_softmax_lse=True, **args)
    return out, lse, kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", CONTIGUOUS + PAGED)
def test_tma_matches_pointer_loads_and_oracle(decode_interp, monkeypatch, name, dtype):
    torch.manual_seed(0)
    q, kc, vc, args = make_case(dtype=dtype, cap=70, **CASES[name])
    for splits in (1, 3):
        monkeypatch.setattr(launcher, "TMA_OVERRIDE", False)
        ref = _call(q, kc, vc, args, splits)
        assert "USE_TMA" not in decode_interp[-1]
        monkeypatch.setattr(launcher, "TMA_OVERRIDE", True)
        got = _run_and_check(q, kc, vc, args, num_splits=splits)  # against the oracle
        assert decode_interp[-1].get("USE_TMA") is True, "the descriptor path did not run"
        assert decode_interp[-1]["PAGED"] is (name in PAGED)
        if q.shape[-1] & (q.shape[-1] - 1) == 0:
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), "TMA and pointer loads differ"
        else:
            # a padded head dim (24 in 32-wide tiles): the interpreter's matmul takes the transposed
            # descriptor tile in another memory order and rounds differently (measured ~2e-7 in fp32)
            tol = 1e-6 if dtype == torch.float32 else 2e-3
            assert (got[0] - ref[0]).abs().max().item() <= tol and (got[1] - ref[1]).abs().max().item() <= tol


@pytest.mark.parametrize("name", ["paged_3", "paged_16_leftpad"])
def test_unaligned_pages_keep_pointer_loads(decode_interp, monkeypatch, name):
    # pages smaller than a tile, or shifted by left padding: a tile spans pages, no descriptor box fits
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", True)
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    _run_and_check(q, kc, vc, args, num_splits=2)
    assert "USE_TMA" not in decode_interp[-1]


def test_nan_outside_the_rows_pages_is_never_read(decode_interp, monkeypatch):
    """Paged: NaN in every pool slot that holds no key of its row (past each row's length, and the
    pages no row uses); descriptors read only whole unmasked tiles, so the result stays finite."""
    torch.manual_seed(3)
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", True)
    q, kc, vc, args = make_case(cap=70, **CASES["paged_32_read_only"])
    table, lens, page = args["block_table"], args["cache_seqlens"], kc.shape[1]
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i in range(q.shape[0]):
        for pos in range(int(lens[i])):
            keep[table[i, pos // page], pos % page] = True
    kc[~keep] = float("nan")
    vc[~keep] = float("nan")
    _finite_and_like_the_oracle(decode_interp, q, kc, vc, args)


def _finite_and_like_the_oracle(decode_interp, q, kc, vc, args):
    """A descriptor-load call (3 splits) on caches holding NaN where no key is: finite and equal to
    the oracle, which reads only each row's keys. Returns the appended caches and the oracle's v."""
    ref_out, ref_lse, _, ref_vc = dense_oracle(q, kc, vc, **args)
    out, lse, kc2, vc2 = _call(q, kc, vc, args, 3)
    assert decode_interp[-1].get("USE_TMA") is True
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4
    return kc2, vc2, ref_vc


@pytest.mark.parametrize("name", ["append_rows", "leftpad", "wide_window", "read_only_int_len", "read_only_leftpad"])
def test_nan_past_the_rows_is_never_read(decode_interp, monkeypatch, name):
    """NaN in every cache slot past a row's keys (and the append's): the masked tail block reads
    them only through masked pointer loads, so the output stays finite and equals the oracle's."""
    torch.manual_seed(1)
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", True)
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    lens = args.get("cache_seqlens")
    b = q.shape[0]
    s_new = args["k"].shape[1] if "k" in args else 0
    for i in range(b):
        n = lens if isinstance(lens, int) else (kc.shape[1] - s_new if lens is None else int(lens[i]))
        kc[i, n + s_new:] = float("nan")
        vc[i, n + s_new:] = float("nan")
    _, vc2, ref_vc = _finite_and_like_the_oracle(decode_interp, q, kc, vc, args)
    torch.testing.assert_close(vc2, ref_vc, rtol=0, atol=0, equal_nan=True)  # the append, NaN left alone


def _use(k, paged=False, blocks=1, fills=True):
    return launcher.use_decode_tma(k, k, paged, blocks_per_program=blocks, d_fills_block=fills)


def test_rule(monkeypatch):
    kc = torch.zeros(2, 64, 2, 16, dtype=torch.float16)
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", None)
    monkeypatch.delenv("FLASHTILE_DECODE_TMA", raising=False)
    assert not _use(kc)  # a CPU tensor: never by default
    monkeypatch.setenv("FLASHTILE_DECODE_TMA", "1")
    assert not _use(kc)  # nor forced: only TMA_OVERRIDE runs the interpreter
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", True)
    assert _use(kc)
    assert not _use(kc, paged=True)  # pages smaller than a tile: pointer loads
    assert launcher.use_decode_tma(kc, kc, True, blocks_per_program=1, d_fills_block=True, page_aligned=True)
    odd = torch.zeros(2, 64, 2, 13, dtype=torch.float16)  # 26-byte rows: no TMA stride
    assert not _use(odd)
    assert not _use(kc[:, :0])  # empty
    f8 = kc.to(torch.float8_e4m3fn)
    assert not _use(f8)  # fp8 caches: not tested with descriptors


class _OnCuda:
    """A CPU tensor that says it lives on a CUDA device (the rule reads device, dtype, strides, pointer)."""

    def __init__(self, t):
        self.t, self.device = t, torch.device("cuda")

    def __getattr__(self, name):
        return getattr(self.t, name)


@pytest.mark.parametrize("setting", ["", "1", "0"])
@pytest.mark.parametrize("major", [8, 9, 10])
def test_default_rule_on_gpus(monkeypatch, setting, major):
    # the default follows the H200 measurement: sm_90, few key blocks per program, a head dim that
    # fills its tile; "1" forces it on any sm_90+ GPU whatever the blocks, "0" off
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", None)
    monkeypatch.setattr(launcher, "capability", lambda device: (major, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("FLASHTILE_DECODE_TMA", setting)
    kc = _OnCuda(torch.zeros(2, 64, 2, 16, dtype=torch.float16))
    few, many = launcher.TMA_MAX_BLOCKS_PER_PROGRAM, launcher.TMA_MAX_BLOCKS_PER_PROGRAM + 1
    want_few = {"": major == 9, "1": major >= 9, "0": False}[setting]
    want_many = {"": False, "1": major >= 9, "0": False}[setting]
    assert _use(kc, blocks=few) is want_few
    assert _use(kc, blocks=many) is want_many
    assert _use(kc, blocks=few, fills=False) is (setting == "1" and major >= 9)
    # page-aligned paged caches: by default up to the lower paged limit; smaller pages never
    paged_few, paged_many = launcher.PAGED_TMA_MAX_BLOCKS_PER_PROGRAM, launcher.PAGED_TMA_MAX_BLOCKS_PER_PROGRAM + 1
    assert paged_many <= few
    assert launcher.use_decode_tma(kc, kc, True, blocks_per_program=paged_few, d_fills_block=True,
                                   page_aligned=True) is want_few
    assert launcher.use_decode_tma(kc, kc, True, blocks_per_program=paged_many, d_fills_block=True,
                                   page_aligned=True) is (setting == "1" and major >= 9)
    assert _use(kc, paged=True, blocks=few) is False
    # paged pools of 4-byte caches: not measured, so only when forced
    k32 = _OnCuda(torch.zeros(2, 64, 2, 16, dtype=torch.float32))
    assert launcher.use_decode_tma(k32, k32, True, blocks_per_program=paged_few, d_fills_block=True,
                                   page_aligned=True) is (setting == "1" and major >= 9)
    monkeypatch.setattr(torch.version, "hip", "6.0")  # an MI300 reports 9.x too
    assert _use(kc, blocks=few) is False


def test_switch_names_a_bad_value(monkeypatch):
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", None)
    monkeypatch.setenv("FLASHTILE_DECODE_TMA", "off")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_TMA"):
        _use(torch.zeros(1, 16, 1, 16, dtype=torch.float16))


def test_unchecked_descriptor_equals_the_checked_one():
    # cache_descriptor skips TensorDescriptor's validation (use_decode_tma did it): same fields
    from triton.tools.tensor_descriptor import TensorDescriptor

    kc = torch.zeros(3, 40, 2, 64, dtype=torch.float16)[:, :33]  # a sliced capacity: strides of the full one
    fast = launcher.cache_descriptor(kc, 16, 64)
    checked = TensorDescriptor(kc, list(kc.shape), list(kc.stride()), [1, 16, 1, 64])
    assert fast.base is kc and fast == checked


@pytest.mark.parametrize("d,splits", [(16, 1), (24, 2)])
def test_launcher_passes_blocks_per_program_and_tile_fill(decode_interp, monkeypatch, d, splits):
    # decode_attn hands the rule the key blocks one program reads at the cache's capacity (after the
    # split count) and whether d fills its power-of-two tile (d = 24 runs in a 32-wide tile)
    seen = []
    real = launcher.use_decode_tma

    def recording(k, v, paged, **kw):
        seen.append(kw)
        return real(k, v, paged, **kw)

    monkeypatch.setattr(launcher, "use_decode_tma", recording)
    monkeypatch.setattr(launcher, "TMA_OVERRIDE", False)
    cap = 100
    q = torch.randn(1, 1, 4, d, dtype=torch.float16)
    kc = torch.randn(1, cap, 2, d, dtype=torch.float16)
    flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([70], dtype=torch.int32), num_splits=splits)
    key_blocks = -(-cap // launcher.CONFIG_OVERRIDE[0])  # the decode_interp fixture's 16-key tiles
    assert seen == [dict(blocks_per_program=-(-key_blocks // splits), d_fills_block=d in (16, 32), page_aligned=False)]
