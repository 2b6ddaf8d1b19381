"""The decode launcher's measured rules, on CPU with an sm_90 device standing in
(backends/triton/decode.py): programmatic dependent launch (use_pdl: by default only for calls that read
at most PDL_MAX_KV_BYTES of K and V, where the H200 measured it faster, the switch overriding both ways),
8 warps for long programs (long_program_warps) and 2 stages for grids of more than one wave
(grid_full_stages), each with its environment switch."""

import pytest
import torch

from flashtile.backends.triton import decode

CUDA = torch.device("cuda")
SMALL, LARGE = decode.PDL_MAX_KV_BYTES, decode.PDL_MAX_KV_BYTES + 1


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(decode, "capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("FLASHTILE_DECODE_PDL", raising=False)
    monkeypatch.delenv("FLASHTILE_DECODE_MERGE_PDL", raising=False)
    return monkeypatch


def test_default_follows_the_measured_size(sm90):
    # b = 1 at 64k with 8 kv heads of d = 128 in bf16 is exactly the limit
    assert 2 * 1 * 65536 * 8 * 128 * 2 == decode.PDL_MAX_KV_BYTES
    assert decode.use_pdl(CUDA, SMALL)
    assert not decode.use_pdl(CUDA, LARGE)


def test_serving_steps_on_few_rows(sm90):
    """A call whose new keys the separate append kernel writes first takes it on at most PDL_APPEND_MAX_ROWS
    (batch row, kv head) pairs (b = 1 and 2 with 8 kv heads) up to PDL_APPEND_MAX_KV_BYTES (b = 1 at 256k keys,
    b = 2 at 128k), not on more pairs or bytes, not without an append, and an fp8 cache still only when forced."""
    few, many = decode.PDL_APPEND_MAX_ROWS, decode.PDL_APPEND_MAX_ROWS + 1
    assert 2 * 1 * 262144 * 8 * 128 * 2 == decode.PDL_APPEND_MAX_KV_BYTES
    assert decode.use_pdl(CUDA, LARGE, appended_rows=few)
    assert decode.use_pdl(CUDA, decode.PDL_APPEND_MAX_KV_BYTES, appended_rows=1)
    assert not decode.use_pdl(CUDA, decode.PDL_APPEND_MAX_KV_BYTES + 1, appended_rows=1)
    assert not decode.use_pdl(CUDA, LARGE, appended_rows=many)
    assert not decode.use_pdl(CUDA, LARGE, appended_rows=0)
    assert not decode.use_pdl(CUDA, LARGE, fp8=True, appended_rows=few)
    sm90.setenv("FLASHTILE_DECODE_PDL", "0")
    assert not decode.use_pdl(CUDA, SMALL, appended_rows=few)


@pytest.mark.parametrize("env,small,large", [("1", True, True), ("0", False, False), ("", True, False)])
def test_switch(sm90, env, small, large):
    sm90.setenv("FLASHTILE_DECODE_PDL", env)
    assert decode.use_pdl(CUDA, SMALL) is small
    assert decode.use_pdl(CUDA, LARGE) is large


def test_fp8_caches_only_when_forced(sm90):
    # not run with it on a GPU: the default leaves e4m3 caches on ordinary launches
    assert not decode.use_pdl(CUDA, SMALL, fp8=True)
    sm90.setenv("FLASHTILE_DECODE_PDL", "1")
    assert decode.use_pdl(CUDA, SMALL, fp8=True)


def test_override_wins(sm90):
    sm90.setenv("FLASHTILE_DECODE_PDL", "1")
    sm90.setattr(decode, "PDL_OVERRIDE", False)
    assert not decode.use_pdl(CUDA, SMALL)
    sm90.setattr(decode, "PDL_OVERRIDE", True)
    assert decode.use_pdl(CUDA, LARGE)


def test_never_without_griddepcontrol(sm90):
    assert not decode.use_pdl(torch.device("cpu"), SMALL)
    sm90.setattr(decode, "capability", lambda device: (8, 0))
    assert not decode.use_pdl(CUDA, SMALL)
    sm90.setattr(decode, "capability", lambda device: (9, 0))
    sm90.setattr(torch.version, "hip", "6.0")  # an MI300 reports 9.x too
    assert not decode.use_pdl(CUDA, SMALL)


@pytest.mark.parametrize("env,small,large", [("", True, False), ("1", True, True), ("0", False, False)])
def test_append_follows_the_decode_rule_unless_switched(sm90, env, small, large):
    """The append kernel launches as a programmatic dependent where the decode kernels do (append_pdl: use_pdl's
    size rule, FLASHTILE_DECODE_PDL included); FLASHTILE_DECODE_APPEND_PDL=0 / 1 forces it either way."""
    k = torch.empty(0, device="meta")
    sm90.setattr(decode, "pdl_capable", lambda device: True)
    sm90.setenv("FLASHTILE_DECODE_APPEND_PDL", env)
    many = decode.PDL_APPEND_MAX_ROWS + 1
    assert decode.append_pdl(k, SMALL, False, many) is small
    assert decode.append_pdl(k, LARGE, False, many) is large
    if env == "":
        assert decode.append_pdl(k, LARGE, False, decode.PDL_APPEND_MAX_ROWS)  # a serving step on few rows
        assert not decode.append_pdl(k, SMALL, True, many)  # fp8 caches: as use_pdl, only when forced
        sm90.setenv("FLASHTILE_DECODE_PDL", "0")
        assert not decode.append_pdl(k, SMALL, False, many)
    sm90.setattr(decode, "pdl_capable", lambda device: False)
    assert not decode.append_pdl(k, SMALL, False, many)  # never without griddepcontrol, even when forced
    sm90.setenv("FLASHTILE_DECODE_APPEND_PDL", "x")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_APPEND_PDL"):
        decode.append_pdl(k, SMALL, False, many)


def test_kv_append_passes_its_cache_bytes(monkeypatch):
    """kv_append's wiring, launch recorded, not run: the bytes it asks about are the whole cache's K and V at
    capacity (contiguous or paged), the rows batch x kv heads, and a yes adds USE_PDL and launch_pdl to the
    launch."""
    asked, launches = [], []
    monkeypatch.setattr(decode, "append_pdl", lambda k, kv_bytes, fp8, rows: asked.append((kv_bytes, rows)) or True)
    monkeypatch.setattr(decode, "run_kernel", lambda kernel, grid, *a, **meta: launches.append(meta))
    k = torch.zeros(2, 1, 8, 128, dtype=torch.float16)
    cache = torch.zeros(2, 1000, 8, 128, dtype=torch.float16)
    decode.kv_append(cache, cache, k, k, None, 5, None, None, None, None, False)
    pool = torch.zeros(12, 16, 8, 128, dtype=torch.float16)
    table = torch.zeros(2, 6, dtype=torch.int32)
    decode.kv_append(pool, pool, k, k, None, 5, None, table, None, None, False)
    assert asked == [(2 * 2 * 1000 * 8 * 128 * 2, 16), (2 * 2 * 6 * 16 * 8 * 128 * 2, 16)]
    assert all(m["USE_PDL"] and m["launch_pdl"] for m in launches)


@pytest.mark.parametrize("b,appends,expected", [(1, True, True), (2, True, True), (4, True, False),
                                                 (1, False, False)])
def test_serving_step_wiring(sm90, b, appends, expected):
    """kvcache_fwd's wiring, launches recorded, not run, every cache counted as large (PDL_MAX_KV_BYTES = 0): a
    call that appends through the separate kernel on b x 8 kv heads <= PDL_APPEND_MAX_ROWS launches the append,
    split and merge kernels as programmatic dependents; more rows, or no new keys, none of them but the merge
    (merge_pdl)."""
    sm90.setattr(decode, "PDL_MAX_KV_BYTES", 0)
    sm90.setattr(decode, "_arch", lambda device: "sm90")
    sm90.setattr(decode, "num_sms", lambda device: 132)
    sm90.setattr(decode, "pdl_capable", lambda device: True)
    sm90.setattr(decode, "TMA_OVERRIDE", False)
    for knob in ("FLASHTILE_DECODE_APPEND_PDL", "FLASHTILE_DECODE_ROWS", "FLASHTILE_DECODE_GLUON_WARP_KEYS"):
        sm90.delenv(knob, raising=False)
    launches = []
    record = lambda kernel, grid, *a, **meta: launches.append(bool(meta.get("launch_pdl")))  # noqa: E731
    sm90.setattr(decode, "launch", record)
    sm90.setattr(decode, "run_kernel", record)
    q = torch.zeros(b, 1, 32, 128, dtype=torch.float16)
    cache = torch.zeros(b, 4096, 8, 128, dtype=torch.float16)
    new = torch.zeros(b, 1, 8, 128, dtype=torch.float16) if appends else None
    decode.kvcache_fwd(q, cache, cache.clone(), new, new, None, None, None, 4000, None, None, None, 0.1, True,
                       -1, 0, 0.0, False, None, 0)
    assert len(launches) == (3 if appends else 2)  # [append,] split, merge
    assert launches == [expected] * (len(launches) - 1) + [True]


@pytest.mark.parametrize("env,expected", [("", [(True, False), True]), ("1", [(True, False), True]),
                                          ("0", [(False, False), False])])
def test_merge_alone_as_a_dependent(sm90, env, expected):
    """A large split call (b = 8, 64k: use_pdl says no) by default: the split kernel is built with USE_PDL (its
    release after the key loop) but launched in order, and the merge launches as a dependent;
    FLASHTILE_DECODE_MERGE_PDL=0 both ordinary. Launches recorded, not run."""
    sm90.setattr(decode, "_arch", lambda device: "sm90")
    sm90.setattr(decode, "num_sms", lambda device: 132)
    sm90.setattr(decode, "pdl_capable", lambda device: True)
    sm90.setattr(decode, "TMA_OVERRIDE", False)
    for knob in ("FLASHTILE_DECODE_ROWS", "FLASHTILE_DECODE_GLUON_WARP_KEYS"):
        sm90.delenv(knob, raising=False)
    sm90.setenv("FLASHTILE_DECODE_MERGE_PDL", env)
    launches = []
    sm90.setattr(decode, "launch", lambda kernel, grid, *a, **meta: launches.append(
        (bool(meta.get("USE_PDL")), bool(meta.get("launch_pdl")))))
    sm90.setattr(decode, "combine", lambda *a, pdl=False: launches.append(pdl))
    q = torch.zeros(8, 1, 32, 128, dtype=torch.float16)
    cache = torch.zeros(8, 65536, 8, 128, dtype=torch.float16, device="meta").expand(8, 65536, 8, 128)
    decode.decode_attn(q, cache, cache, s_new=0, cache_seqlens=None, cache_len_const=65536, cache_batch_idx=None,
                       cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                       rotary_interleaved=False, rotary_per_token=False, softmax_scale=0.1, window_left=-1,
                       window_right=0, softcap=0.0, alibi_slopes=None, num_splits=0)
    assert launches == expected
    assert not decode.merge_pdl(CUDA, False, 1, False)  # unsplit calls have no merge
    assert not decode.merge_pdl(CUDA, False, 4, True)  # nor do calls merged in the kernel
    assert decode.merge_pdl(CUDA, True, 1, False)  # calls on PDL keep it whatever the knob
    assert decode.merge_pdl(CUDA, False, 4, False, fp8=True) is (env == "1")  # fp8: only when forced
    sm90.setattr(decode, "PDL_OVERRIDE", False)
    assert not decode.merge_pdl(CUDA, False, 4, False)  # ordinary launches pinned: none
    sm90.setattr(decode, "PDL_OVERRIDE", None)
    sm90.setenv("FLASHTILE_DECODE_PDL", "0")  # no programmatic dependent launch at all, unless this one is forced
    assert decode.merge_pdl(CUDA, False, 4, False) is (env == "1")
    sm90.setattr(decode, "pdl_capable", lambda device: False)  # sm_80, ROCm, CPU: never, even forced
    assert not decode.merge_pdl(CUDA, False, 4, False)  # (pdl_on comes from use_pdl, which checks the same)


# FLASHTILE_DECODE_LONG_WARPS (decode.long_program_warps): by default sm_90 contiguous-cache programs of
# at least LONG_PROGRAM_BLOCKS key blocks take 8 warps (measured on the H200); 0 keeps the table's, 4 / 8
# force a count on the long programs of any GPU.
def test_long_program_warps(monkeypatch):
    long, short = decode.LONG_PROGRAM_BLOCKS, decode.LONG_PROGRAM_BLOCKS - 1
    monkeypatch.delenv("FLASHTILE_DECODE_LONG_WARPS", raising=False)
    assert decode.long_program_warps(long, False, 4, "sm90", True) == 8  # the rule
    assert decode.long_program_warps(short, False, 4, "sm90", True) == 4
    assert decode.long_program_warps(long, True, 4, "sm90", True) == 4  # paged launches keep the table's
    assert decode.long_program_warps(long, False, 4, "sm90", False) == 4  # a shape not measured
    assert decode.long_program_warps(long, False, 4, "default", True) == 4  # not measured off sm_90
    assert decode.long_program_warps(long, False, 4, "interpret", True) == 4
    assert decode.long_program_warps(long, False, 4) == 4  # no arch given: not sm_90's rule
    monkeypatch.setenv("FLASHTILE_DECODE_LONG_WARPS", "0")
    assert decode.long_program_warps(long, False, 4, "sm90", True) == 4
    monkeypatch.setenv("FLASHTILE_DECODE_LONG_WARPS", "8")
    assert decode.long_program_warps(long, False, 4, "default") == 8  # forced: any shape, any GPU
    assert decode.long_program_warps(short, False, 4, "default") == 4
    monkeypatch.setenv("FLASHTILE_DECODE_LONG_WARPS", "4")
    assert decode.long_program_warps(long, False, 4, "sm90", True) == 4
    for bad in ("6", "on"):
        monkeypatch.setenv("FLASHTILE_DECODE_LONG_WARPS", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_LONG_WARPS"):
            decode.long_program_warps(short, False, 4, "sm90")  # checked on short programs too


# decode.grid_full_stages: unsplit launches of more programs than SMs on sm_90 contiguous caches take
# GRID_FULL_STAGES in the measured shape; FLASHTILE_DECODE_STAGES (replacing the table's stages in
# launch_config) turns the rule off.
def test_grid_full_stages(monkeypatch):
    two = decode.GRID_FULL_STAGES
    monkeypatch.delenv("FLASHTILE_DECODE_STAGES", raising=False)
    assert decode.grid_full_stages(256, 132, 1, False, 3, "sm90", True) == two  # the rule (b = 32, 8 kv heads)
    assert decode.grid_full_stages(128, 132, 1, False, 3, "sm90", True) == 3  # one wave: no CTA gained per SM
    assert decode.grid_full_stages(132, 132, 1, False, 3, "sm90", True) == 3
    assert decode.grid_full_stages(256, 132, 2, False, 3, "sm90", True) == 3  # split (num_splits forced)
    assert decode.grid_full_stages(256, 132, 1, True, 5, "sm90", True) == 5  # paged: not measured
    assert decode.grid_full_stages(256, 132, 1, False, 3, "sm90", False) == 3  # a shape not measured
    assert decode.grid_full_stages(256, 132, 1, False, 3, "default", True) == 3  # not measured off sm_90
    assert decode.grid_full_stages(256, 132, 1, False, 3, "interpret", True) == 3
    assert decode.grid_full_stages(256, 132, 1, False, 3) == 3
    monkeypatch.setenv("FLASHTILE_DECODE_STAGES", "3")
    assert decode.grid_full_stages(256, 132, 1, False, 3, "sm90", True) == 3
    assert decode.launch_config("sm90", 128, False, 2)[2] == 3
    assert decode.launch_config("sm90", 128, True, 2, page_size=256)[2] == 5  # paged still adds two
    monkeypatch.setenv("FLASHTILE_DECODE_STAGES", "1")
    assert decode.launch_config("sm90", 128, False, 2)[2] == 1
    for bad in ("0", "5", "two"):
        monkeypatch.setenv("FLASHTILE_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_STAGES"):
            decode.launch_config("sm90", 128, False, 2)


def test_decode_attn_passes_the_stage_rule_its_shape(monkeypatch):
    """decode_attn's wiring of grid_full_stages, on CPU tensors with the launch recorded, not run: a
    one-token GQA step at b = 32 (256 programs) on sm_90 takes 2 stages; b = 16 (128), an 8-token step
    (32-row query tiles), a paged cache or fp32 keep the table's 3 (5 paged)."""
    import torch

    monkeypatch.delenv("FLASHTILE_DECODE_STAGES", raising=False)
    monkeypatch.setattr(decode, "_arch", lambda device: "sm90")
    monkeypatch.setattr(decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(decode, "TMA_OVERRIDE", False)
    stages = []
    monkeypatch.setattr(decode, "launch", lambda kernel, grid, *a, **meta: stages.append(meta["num_stages"]))

    def call(b, sq=1, dtype=torch.float16, paged=False):
        q = torch.zeros(b, sq, 32, 128, dtype=dtype)
        if paged:
            kc = torch.zeros(b * 4, 256, 8, 128, dtype=dtype)
            table = torch.arange(b * 4, dtype=torch.int32).view(b, 4)
        else:
            kc, table = torch.zeros(b, 1024, 8, 128, dtype=dtype), None
        decode.decode_attn(q, kc, kc, s_new=0, cache_seqlens=None, cache_len_const=1000, cache_batch_idx=None,
                           cache_leftpad=None, block_table=table, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=False, rotary_per_token=False, softmax_scale=0.1, window_left=-1,
                           window_right=-1, softcap=0.0, alibi_slopes=None, num_splits=0)
        return stages[-1]

    assert call(32) == decode.GRID_FULL_STAGES
    assert call(16) == 3
    assert call(32, sq=8) == 3  # 32 query rows per program
    assert call(32, paged=True) == 5
    assert call(32, dtype=torch.float32) == 3


def test_block_n_knob(monkeypatch):
    """FLASHTILE_DECODE_BLOCK_N replaces the table's key tile (an A/B knob); bad values name the variable."""
    monkeypatch.delenv("FLASHTILE_DECODE_BLOCK_N", raising=False)
    table = decode.launch_config("sm90", 128, False, 2)
    monkeypatch.setenv("FLASHTILE_DECODE_BLOCK_N", "64")
    assert decode.launch_config("sm90", 128, False, 2) == (64, *table[1:])
    assert decode.launch_config("sm90", 128, False, 4)[0] == 32  # fp32 caches still halve it
    for bad in ("16", "256", "x"):
        monkeypatch.setenv("FLASHTILE_DECODE_BLOCK_N", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_BLOCK_N"):
            decode.launch_config("sm90", 128, False, 2)


def test_paged_stages_knob(monkeypatch):
    """FLASHTILE_DECODE_PAGED_STAGES replaces a paged launch's whole depth and leaves contiguous launches alone."""
    monkeypatch.delenv("FLASHTILE_DECODE_PAGED_STAGES", raising=False)
    monkeypatch.delenv("FLASHTILE_DECODE_STAGES", raising=False)
    contiguous = decode.launch_config("sm90", 128, False, 2)
    paged = decode.launch_config("sm90", 128, True, 2, 16)
    assert paged[2] == contiguous[2] + 2
    monkeypatch.setenv("FLASHTILE_DECODE_PAGED_STAGES", "7")
    assert decode.launch_config("sm90", 128, True, 2, 16) == (*paged[:2], 7)
    assert decode.launch_config("sm90", 128, False, 2) == contiguous
    for bad in ("0", "8", "x"):
        monkeypatch.setenv("FLASHTILE_DECODE_PAGED_STAGES", bad)
        with pytest.raises(ValueError, match="FLASHTILE_DECODE_PAGED_STAGES"):
            decode.launch_config("sm90", 128, True, 2, 16)
