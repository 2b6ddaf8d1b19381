"""The Gluon warps-along-keys decode kernel (kernels/gluon_decode_warp_keys.py) without a GPU: its sm_90 build
(shared memory for two programs an SM, no spills, two CTA barriers in the key loop), which calls it covers and
which of those its routes give it (backends/triton/decode/route.py), and the launcher's append wiring. GPU results:
tests/test_gpu_decode_gluon_warp_keys.py."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtile import config
from flashtile.backends.triton import decode
from flashtile.backends.triton.decode import common, gluon
from flashtile.backends.triton.decode import route as R
from test_kvcache import _run_and_check, make_case

TESTS = pathlib.Path(__file__).resolve().parent
SM90_SMEM_PER_SM = 233472  # 228 KiB: two programs an SM need at most half of it each (less 1 KiB reserved)
H200 = R.DeviceProps((9, 0), 132, 139.8)
BLOCK_N = 64  # the route's Gluon tile


def _compile(*args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHTILE_INTERPRET")}
    env["PYTHONPATH"] = str(TESTS.parent / "src")
    res = subprocess.run([sys.executable, str(TESTS / "aot_gluon_decode.py"), *map(str, args)], capture_output=True,
                         text=True, env=env, cwd=TESTS, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    f = res.stdout.split()
    return {key: int(val) for key, val in zip(f[::2], f[1::2])}


@pytest.mark.parametrize("d, has_seqlens, fused_new, group, early, splits", [
    (128, True, False, 4, False, 1), (64, False, False, 16, False, 1), (128, True, True, 8, False, 1),
    (128, True, False, 4, True, 1), (128, True, True, 8, True, 1), (128, True, False, 4, False, 4),
    (128, False, False, 8, False, 2)])
def test_builds_for_sm90_two_programs_an_sm(d, has_seqlens, fused_new, group, early, splits):
    got = _compile(d, BLOCK_N, gluon.NUM_BUFFERS, int(has_seqlens), int(fused_new), gluon.merge_rows(group),
                   int(early), splits)
    assert 2 * (got["SHARED"] + 1024) <= SM90_SMEM_PER_SM, got
    assert got["SPILL_STORES"] == 0 and 0 < got["REGISTERS"] <= 255, got
    assert 2 * 128 * got["REGISTERS"] <= 65536, got  # two 128-thread programs in one SM's register file
    assert got["LDGSTS"] > 0 and got["HMMA"] > 0, got  # 16-byte cp.async copies, mma.sync
    assert got["LOOP_BARRIERS"] <= 2, got  # the Triton build has 9 a tile
    # the warps' merge through shared memory: its one barrier (and one the compiler adds), not the 9 that
    # reductions across the warp axis took
    assert got["TAIL_BARRIERS"] <= 2, got
    # no griddepcontrol but, in a split build, the merge's early launch (MERGE_EARLY): launched as an ordinary kernel
    assert got["GDC"] == (1 if splits > 1 else 0), got


def _shape(b=32, capacity=8192, **kw):
    base = dict(batch=b, seqlen_q=1, heads=32, kv_heads=8, head_dim=128, capacity=capacity)
    return R.DecodeShape(**dict(base, **kw))


def test_covers_the_measured_shape():
    assert R._gluon_covers(_shape(), torch.bfloat16, False, H200)
    assert R._gluon_covers(_shape(head_dim=64, heads=128, num_splits=1), torch.float16, False, H200)


@pytest.mark.parametrize("change", [
    dict(props=R.DeviceProps((8, 0), 132, 80.0)), dict(props=R.INTERPRETER), dict(dtype=torch.float32),
    dict(dtype=torch.float8_e4m3fn), dict(head_dim=256), dict(head_dim=96), dict(seqlen_q=2), dict(heads=136),
    dict(paged=True), dict(plain=False), dict(aligned=False),
])
def test_refuses_what_the_kernel_does_not_compute(change):
    change = dict(change)
    props, dtype, paged = change.pop("props", H200), change.pop("dtype", torch.bfloat16), change.pop("paged", False)
    assert not R._gluon_covers(_shape(**change), dtype, paged, props)


def test_alignment_check():
    x = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    assert common.aligned(x)
    assert not common.aligned(x[:, :, :, 1:])  # inner stride 1 but rows off 16 bytes
    assert not common.aligned(torch.zeros(2, 16, 2, 68, dtype=torch.bfloat16)[..., :64])  # 68-element rows
    # 72-element heads: 16-byte rows, but a stride the JIT does not mark aligned (not a multiple of 16)
    assert not common.aligned(torch.zeros(2, 16, 2, 72, dtype=torch.bfloat16)[..., :64])
    assert common.aligned(torch.zeros(2, 16, 2, 80, dtype=torch.bfloat16)[..., :64])


def test_forced_on_cpu_is_refused_by_name():
    q, kc, vc, args = make_case(dtype=torch.float32, cap=40, s_new=1)
    with config.override(interpret=True, decode_route="gluon"), pytest.raises(ValueError, match="'gluon' cannot"):
        _run_and_check(q, kc, vc, args, num_splits=1)


def test_merge_reads_back_the_group_rows():
    # a power of two of at least 4 (the merge's 4 warps along the rows), at most the kernel's 16 rows
    assert [gluon.merge_rows(g) for g in (1, 2, 3, 4, 5, 8, 9, 16)] == [4, 4, 4, 4, 8, 8, 16, 16]


def _route(b=32, capacity=8192, new=0, **kw):
    return R.select_route(_shape(b, capacity, new_tokens=new, **kw), torch.bfloat16, False, 0, H200)


def test_unsplit_rule_takes_long_caches_with_two_programs_an_sm():
    cap = R.GLUON_MIN_CAPACITY
    assert _route(32, cap).kernel == "gluon" and _route(32, cap).splits == 1
    assert _route(32, cap - 1).kernel == "split"  # below 8k unmeasured: the Triton kernel
    assert _route(16, cap).kernel == "split"  # one program an SM: 17% slower (and below the split rule's 32k)
    assert _route(32, cap, head_dim=64).kernel == "split"  # covered, but unmeasured: half the bytes in flight
    assert _route(32, cap, new=1).append_in_kernel  # appends in the kernel from the same bound
    assert _route(32, cap, num_splits=1).kernel == "gluon"  # an explicit unsplit call on a full grid
    assert _route(32, cap, num_splits=2).kernel == "split"  # explicit splits: the Triton kernel


def test_split_rule():
    # grids below the rule's run split into the fewest powers of two that reach it, at most 8 ways, from 32k keys
    cap = R.GLUON_SPLIT_MIN_CAPACITY
    for b, splits in ((16, 2), (8, 4), (4, 8)):
        r = _route(b, cap)
        assert r.kernel == "gluon" and r.splits == splits and r.merge_pdl and not r.append_in_kernel
    assert _route(8, cap, new=1).kernel == "gluon" and not _route(8, cap, new=1).append_in_kernel
    assert _route(2, cap).kernel == "split" and _route(1, cap).kernel == "split"  # 16 / 32 splits: more than 8
    assert _route(8, cap - 1).kernel == "split"  # below the split rule's shortest cache
    # before the whole-row kernels' rule, which would take b = 16 at 128k as half rows
    assert _route(16, 131072).kernel == "gluon"
    assert _route(16, 131072, aligned=False).kernel == "rows"


@pytest.fixture
def gluon_launch(monkeypatch):
    """kvcache_fwd on a Gluon route (the kernel and the append stubbed): returns (call(new), launches, appends)."""
    launches, appends = [], []

    def kernel(q, kc, vc, route, **kw):
        launches.append(kw)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], 1)

    monkeypatch.setattr(gluon, "decode", kernel)
    monkeypatch.setattr(decode, "kv_append", lambda *args, **kw: appends.append(kw))

    def call(new=None, splits=1):
        b, cap, d = 4, 64, 128
        route = R.Route("gluon", splits=splits, block_n=64, append_in_kernel=new is not None and splits == 1)
        monkeypatch.setattr(decode, "select_route", lambda *a, **k: route)
        q = torch.zeros(b, 1, 32, d, dtype=torch.bfloat16)
        kc, vc = torch.zeros(b, cap, 8, d, dtype=torch.bfloat16), torch.zeros(b, cap, 8, d, dtype=torch.bfloat16)
        k = v = None
        if new == "own":
            k, v = torch.zeros(b, 1, 8, d, dtype=torch.bfloat16), torch.zeros(b, 1, 8, d, dtype=torch.bfloat16)
        elif new == "alias":
            k, v = kc[:, -1:], vc[:, -1:]
        lens = torch.full((b,), cap // 2, dtype=torch.int32)
        decode.kvcache_fwd(q, kc, vc, k, v, None, None, lens, 0, None, None, None, 0.1, True, -1, 0, 0.0, False,
                           None, 0)

    return call, launches, appends


def test_the_kernel_appends_unless_the_new_keys_alias_the_cache(gluon_launch):
    call, launches, appends = gluon_launch
    call()
    assert launches[-1]["k_new"] is None and not appends
    call("own")
    assert launches[-1]["k_new"] is not None and not appends  # appended inside
    call("alias")  # aliased keys are appended apart: one program's writes could land in slots another reads
    assert launches[-1]["k_new"] is None and len(appends) == 1
    call("own", splits=4)  # a split launch reads the new keys from the cache
    assert launches[-1]["k_new"] is None and len(appends) == 2


def test_split_launch_refuses_its_own_append():
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="append them first"):
        gluon.decode(q, kc, kc, R.Route("gluon", splits=2, block_n=64), cache_seqlens=None, cache_len_const=10,
                     s_new=1, softmax_scale=0.1, k_new=kc[:, :1], v_new=kc[:, :1])
