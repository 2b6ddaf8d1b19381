"""The split decode kernel's tensor-descriptor loads (Route.tma; by default on sm_90 where a program reads few key
blocks, as measured on the H200), on CPU through the interpreter (``config.override(tma=True)``), and the rule
(backends/triton/decode/route.py) on fake devices.

With TMA forced, a contiguous cache's unmasked key blocks are read by descriptor; the masked blocks
(a row's last partial block, window edges, the new keys) keep pointer loads. Results must equal the
pointer path's bit for bit (same data, same arithmetic; to rounding where the head dim is padded)
and the independent oracle of
test_kvcache.py, also when the cache holds NaN past every row's length: a descriptor does not mask
those keys, so they must never be read by one.
"""

import pytest
import torch

from flashtile import config
from flashtile.backends.triton.decode import route as R
from flashtile.backends.triton.decode.split import cache_descriptor
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
def test_tma_matches_pointer_loads_and_oracle(decode_interp, name, dtype):
    torch.manual_seed(0)
    q, kc, vc, args = make_case(dtype=dtype, cap=70, **CASES[name])
    for splits in (1, 3):
        with config.override(tma=False):
            ref = _call(q, kc, vc, args, splits)
        assert "USE_TMA" not in decode_interp[-1]
        with config.override(tma=True):
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
def test_unaligned_pages_keep_pointer_loads(decode_interp, name):
    # pages smaller than a tile, or shifted by left padding: a tile spans pages, no descriptor box fits
    q, kc, vc, args = make_case(cap=70, **CASES[name])
    with config.override(tma=True):
        _run_and_check(q, kc, vc, args, num_splits=2)
    assert "USE_TMA" not in decode_interp[-1]


def test_nan_outside_the_rows_pages_is_never_read(decode_interp):
    """Paged: NaN in every pool slot that holds no key of its row (past each row's length, and the
    pages no row uses); descriptors read only whole unmasked tiles, so the result stays finite."""
    torch.manual_seed(3)
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
    with config.override(tma=True):
        out, lse, kc2, vc2 = _call(q, kc, vc, args, 3)
    assert decode_interp[-1].get("USE_TMA") is True
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4
    return kc2, vc2, ref_vc


@pytest.mark.parametrize("name", ["append_rows", "leftpad", "wide_window", "read_only_int_len", "read_only_leftpad"])
def test_nan_past_the_rows_is_never_read(decode_interp, name):
    """NaN in every cache slot past a row's keys (and the append's): the masked tail block reads
    them only through masked pointer loads, so the output stays finite and equals the oracle's."""
    torch.manual_seed(1)
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


def _tma(props, blocks=1, paged=False, page=0, dtype=torch.float16, d=128, tma=None, tma_ok=True, leftpad=False):
    """Route.tma of a one-row call whose programs read ``blocks`` key blocks (128-key tiles on sm_90)."""
    capacity = blocks * (16 if props is R.INTERPRETER else 128) * 16  # one row of 8 kv heads: 16 splits
    shape = R.DecodeShape(1, 1, 32, 8, d, capacity, leftpad=leftpad, plain=not leftpad, tma_ok=tma_ok)
    return R.select_route(shape, dtype, paged, page if paged else 0, props, tma=tma).tma


def test_rule_in_the_interpreter():
    assert not _tma(R.INTERPRETER)  # never by default
    assert _tma(R.INTERPRETER, tma=True)  # the tests' setting runs it there
    assert not _tma(R.INTERPRETER, paged=True, page=8, tma=True)  # a tile spans pages: pointer loads
    assert _tma(R.INTERPRETER, paged=True, page=32, tma=True)  # pages of whole tiles
    assert not _tma(R.INTERPRETER, paged=True, page=32, tma=True, leftpad=True)  # shifted off the pages
    assert not _tma(R.INTERPRETER, tma=True, tma_ok=False)  # a base or stride TMA cannot address
    assert not _tma(R.INTERPRETER, tma=True, dtype=torch.float8_e4m3fn)  # fp8 caches: not tested with descriptors


@pytest.mark.parametrize("setting", [None, True, False])
@pytest.mark.parametrize("major", [8, 9, 10])
def test_default_rule_on_gpus(setting, major):
    # the default follows the H200 measurement: sm_90, few key blocks per program, a head dim that fills its tile;
    # True forces it on any sm_90+ GPU whatever the blocks, False off
    props = R.DeviceProps((major, 0), 132, 80.0)
    few, many = R.TMA_MAX_BLOCKS_PER_PROGRAM, R.TMA_MAX_BLOCKS_PER_PROGRAM + 1
    want_few = {None: major == 9, True: major >= 9, False: False}[setting]
    want_forced = setting is True and major >= 9
    assert _tma(props, few, tma=setting) is want_few
    assert _tma(props, many, tma=setting) is want_forced
    assert _tma(props, few, d=96, tma=setting) is want_forced  # d = 96 in a 128-wide tile
    # page-aligned paged caches: by default up to the lower paged limit; smaller pages never
    paged_few, paged_many = R.PAGED_TMA_MAX_BLOCKS_PER_PROGRAM, R.PAGED_TMA_MAX_BLOCKS_PER_PROGRAM + 1
    assert paged_many <= few
    assert _tma(props, paged_few, paged=True, page=256, tma=setting) is want_few
    assert _tma(props, paged_many, paged=True, page=256, tma=setting) is want_forced
    assert _tma(props, few, paged=True, page=16, tma=setting) is False
    # paged pools of 4-byte caches: not measured, so only when forced (fp32 tiles are 64 keys: twice the blocks)
    assert _tma(props, paged_few // 2, paged=True, page=256, dtype=torch.float32, tma=setting) is want_forced
    rocm = R.DeviceProps((9, 4), 304, 192.0, nvidia=False)  # an MI300 reports 9.x too
    assert not _tma(rocm, few, tma=setting)


def test_unchecked_descriptor_equals_the_checked_one():
    # cache_descriptor skips TensorDescriptor's validation (the route's tma_ok did it): same fields
    from triton.tools.tensor_descriptor import TensorDescriptor

    kc = torch.zeros(3, 40, 2, 64, dtype=torch.float16)[:, :33]  # a sliced capacity: strides of the full one
    fast = cache_descriptor(kc, 16, 64)
    checked = TensorDescriptor(kc, list(kc.shape), list(kc.stride()), [1, 16, 1, 64])
    assert fast.base is kc and fast == checked
