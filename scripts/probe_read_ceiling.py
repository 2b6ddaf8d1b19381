"""How fast can any kernel read a b = 32 decode cache on this GPU? (H200 probe, session 23)

Usage: PYTHONPATH=src python scripts/probe_read_ceiling.py --out read_ceiling.json [--seqlens 16384 131072]

At b = 32 the decode kernels of flashtile and cuDNN are both memory-bound, within 1% of each other
(docs/decode_tuning_log.md, sessions 12-22). Before more kernel work, this measures the ceiling they
share: kernels that only read the cache, timed the way `bench decode --cuda-graph --layers 8` times
attention (a graph of one call a layer, each layer its own cache, per-call medians, the order of the
variants rotating over --rounds), beside flashtile's default decode call and SDPA cuDNN in the same
process. The read kernels XOR every 16-bit element into a register accumulator (the cheapest use
that the compiler cannot drop) and store one word a program:
- ``flat_P<p>_w<w>``: K and V as flat buffers, program i reading the i-th of P contiguous chunks of
  each, a K tile then a V tile per step (BLOCK elements each). With P = 128 this is the memory
  order of a whole-row kernel with 4 splits; with P = 256, per-head programs on a head-major cache.
- ``heads_n<n>_w<w>``: FlashAttention's (b, s, h_k, d) layout read by one program per (row, kv head),
  as flashtile's per-head kernels read it: n keys x d a tile, 256-byte pieces 2 KB apart.
If ``flat`` reads faster than cuDNN's attention, cuDNN is not at the ceiling and a kernel could beat
it; if ``heads`` reads slower than ``flat``, that difference is the layout's price for per-head
programs, which no per-head attention kernel can avoid.
"""

import argparse
import json
import re
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_with_kvcache
from flashtile.bench.decode import _time_in_rounds
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench_graph
from flashtile.env import overrides

H, H_K, D = 32, 8, 128
# lease F23 timed four (block_n, warps, ahead): (64, 4, no) (64, 4, yes) (64, 8, yes) (32, 4, yes), all 6%-40% slower
# than flashtile's kernels; --bare runs them again
ATTN_VARIANTS = {
    "attn_n64_w4": dict(block_n=64, warps=4, ahead=False),
    "attn_n64_w4_ahead": dict(block_n=64, warps=4, ahead=True),
    "attn_n64_w8_ahead": dict(block_n=64, warps=8, ahead=True),
    "attn_n32_w4_ahead": dict(block_n=32, warps=4, ahead=True),
}
LAYER_BYTES_BUDGET = 16 << 30  # as bench decode: the layers' caches of a row stay under this


@triton.jit
def _read_flat(k_ptr, v_ptr, out_ptr, n_tiles, P: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
               AHEAD: tl.constexpr):
    pid = tl.program_id(0)
    t0 = pid * n_tiles // P
    t1 = (pid + 1) * n_tiles // P
    offs = t0.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    kp = k_ptr + offs
    vp = v_ptr + offs
    acc = tl.zeros([BLOCK], tl.int16)
    if AHEAD:  # registers double-buffered: the next tile's loads are issued before this tile is used
        k_cur = tl.load(kp)
        v_cur = tl.load(vp)
        for _ in tl.range(t0 + 1, t1):
            kp += BLOCK
            vp += BLOCK
            k_nxt = tl.load(kp)
            v_nxt = tl.load(vp)
            acc ^= k_cur ^ v_cur
            k_cur = k_nxt
            v_cur = v_nxt
        acc ^= k_cur ^ v_cur
    else:  # STAGES > 1: Triton's pipeliner (cp.async into shared memory) if it takes these loads
        for _ in tl.range(t0, t1, num_stages=STAGES):
            acc ^= tl.load(kp)
            acc ^= tl.load(vp)
            kp += BLOCK
            vp += BLOCK
    tl.store(out_ptr + pid, tl.sum(acc.to(tl.int32)))


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """One thread of the program asks the TMA unit to pull [ptr, ptr + nbytes) into L2 (sm_90 bulk prefetch; no
    registers, no shared memory, nothing to wait for)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(k_ptr, v_ptr, row_base, key0, S, stride_s, head,
                   H_KV: tl.constexpr, BLOCK_N: tl.constexpr, L2_DIST: tl.constexpr, L2_ROTATE: tl.constexpr):
    """Whole key rows of the tile L2_DIST tiles ahead into L2, in contiguous pieces, shared out among the row's
    H_KV per-head programs: each takes an H_KV-th of every tile (L2_ROTATE false), or every H_KV-th tile whole."""
    key = key0 + L2_DIST * BLOCK_N
    if key < S:
        tile_elems = BLOCK_N * stride_s
        if L2_ROTATE:
            if (key // BLOCK_N) % H_KV == head:
                start = row_base + key.to(tl.int64) * stride_s
                _prefetch_l2(k_ptr + start, tile_elems * 2)
                _prefetch_l2(v_ptr + start, tile_elems * 2)
        else:
            start = row_base + key.to(tl.int64) * stride_s + head * (tile_elems // H_KV)
            _prefetch_l2(k_ptr + start, tile_elems // H_KV * 2)
            _prefetch_l2(v_ptr + start, tile_elems // H_KV * 2)


@triton.jit
def _read_heads(k_ptr, v_ptr, out_ptr, S, stride_b, stride_s, stride_h,
                H_KV: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr,
                STAGES: tl.constexpr, stamps_ptr=None, L2_DIST: tl.constexpr = 0, L2_ROTATE: tl.constexpr = False):
    pid = tl.program_id(0)
    if stamps_ptr is not None:  # --stamps: the program's start and end (ns)
        tl.store(stamps_ptr + pid * 4, _globaltimer())
    row = pid // H_KV
    head = pid % H_KV
    base = row.to(tl.int64) * stride_b + head * stride_h
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, HEAD_D)
    acc = tl.zeros([BLOCK_N, HEAD_D], tl.int16)
    off = base + rn[:, None].to(tl.int64) * stride_s + rd[None, :]
    step = BLOCK_N * stride_s
    if AHEAD:
        row_base = row.to(tl.int64) * stride_b
        if L2_DIST > 0:  # the first tiles' rows, then a tile's a step (L2_DIST tiles ahead of the loads)
            for t in tl.static_range(L2_DIST + 1):
                _prefetch_rows(k_ptr, v_ptr, row_base, (t - L2_DIST) * BLOCK_N, S, stride_s, head, H_KV, BLOCK_N,
                               L2_DIST, L2_ROTATE)
        k_cur = tl.load(k_ptr + off)
        v_cur = tl.load(v_ptr + off)
        for key0 in range(BLOCK_N, S, BLOCK_N):
            if L2_DIST > 0:
                _prefetch_rows(k_ptr, v_ptr, row_base, key0, S, stride_s, head, H_KV, BLOCK_N, L2_DIST, L2_ROTATE)
            off += step
            k_nxt = tl.load(k_ptr + off)
            v_nxt = tl.load(v_ptr + off)
            acc ^= k_cur ^ v_cur
            k_cur = k_nxt
            v_cur = v_nxt
        acc ^= k_cur ^ v_cur
    else:
        for _ in tl.range(0, S, BLOCK_N, num_stages=STAGES):
            acc ^= tl.load(k_ptr + off)
            acc ^= tl.load(v_ptr + off)
            off += step
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc.to(tl.int32), axis=1), axis=0))
    if stamps_ptr is not None:
        tl.store(stamps_ptr + pid * 4 + 2, _globaltimer())


@triton.jit
def _attn_step(q, k, v, m_i, l_i, acc, qk_scale):
    s = tl.dot(q, tl.trans(k)) * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn_heads(Q, K, V, O, S, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_ob, stride_oh, qk_scale,
                H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
                AHEAD: tl.constexpr):
    """A bare per-head decode (full rows, S a multiple of BLOCK_N, no masks): the group's query heads against one
    kv head's keys, Triton's pipeliner off. AHEAD: the next tile's K and V loads are issued into registers before
    this tile's dots, as heads_*_ahead reads; otherwise after them."""
    BLOCK_M: tl.constexpr = 16
    pid = tl.program_id(0)
    row = pid // H_KV
    head = pid % H_KV
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, HEAD_D)
    rn = tl.arange(0, BLOCK_N)
    q = tl.load(Q + row * stride_qb + (head * GROUP + rm)[:, None] * stride_qh + rd[None, :],
                mask=(rm < GROUP)[:, None], other=0.0)
    off = row.to(tl.int64) * stride_kb + head * stride_kh + rn[:, None].to(tl.int64) * stride_ks + rd[None, :]
    step = BLOCK_N * stride_ks
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    k_cur = tl.load(K + off)
    v_cur = tl.load(V + off)
    for _ in tl.range(BLOCK_N, S, BLOCK_N, num_stages=1):  # every tile but the last, then the last
        off += step
        if AHEAD:
            k_nxt = tl.load(K + off)
            v_nxt = tl.load(V + off)
            m_i, l_i, acc = _attn_step(q, k_cur, v_cur, m_i, l_i, acc, qk_scale)
            k_cur = k_nxt
            v_cur = v_nxt
        else:
            m_i, l_i, acc = _attn_step(q, k_cur, v_cur, m_i, l_i, acc, qk_scale)
            k_cur = tl.load(K + off)
            v_cur = tl.load(V + off)
    m_i, l_i, acc = _attn_step(q, k_cur, v_cur, m_i, l_i, acc, qk_scale)
    out = acc / l_i[:, None]
    tl.store(O + row * stride_ob + (head * GROUP + rm)[:, None] * stride_oh + rd[None, :], out.to(O.dtype.element_ty),
             mask=(rm < GROUP)[:, None])


def attn_call(q, kc, vc, o, block_n, warps, ahead):
    b, s, h_k, d = kc.shape
    h = q.shape[2]
    assert s % block_n == 0 and kc.stride() == vc.stride()

    def call():
        _attn_heads[(b * h_k,)](q, kc, vc, o, s, q.stride(0), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
                                o.stride(0), o.stride(2), d ** -0.5 * 1.4426950408889634, H_KV=h_k, GROUP=h // h_k,
                                HEAD_D=d, BLOCK_N=block_n, AHEAD=ahead, num_warps=warps, num_stages=1)
    return call


def flat_call(kc, vc, out, programs, block, warps, stages=1, ahead=False):
    k16, v16 = kc.view(torch.int16).view(-1), vc.view(torch.int16).view(-1)
    n_tiles = k16.numel() // block
    assert n_tiles * block == k16.numel(), "the cache must be a whole number of tiles"

    def call():
        _read_flat[(programs,)](k16, v16, out, n_tiles, P=programs, BLOCK=block, STAGES=stages, AHEAD=ahead,
                                num_warps=warps, num_stages=1)
    return call


def heads_call(kc, vc, out, block_n, warps, ahead=False, stages=1, stamps=None, l2_dist=0, l2_rotate=False):
    b, s, h_k, d = kc.shape
    k16, v16 = kc.view(torch.int16), vc.view(torch.int16)
    assert s % block_n == 0
    assert not l2_dist or (ahead and kc.is_contiguous() and vc.is_contiguous()), "L2 prefetch: contiguous rows"

    def call():
        _read_heads[(b * h_k,)](k16, v16, out, s, k16.stride(0), k16.stride(1), k16.stride(2),
                                H_KV=h_k, HEAD_D=d, BLOCK_N=block_n, AHEAD=ahead, STAGES=stages,
                                stamps_ptr=stamps, L2_DIST=l2_dist, L2_ROTATE=l2_rotate, num_warps=warps,
                                num_stages=1)
    return call


def expected_flat_xor(kc, vc, programs, block):
    """The flat kernel's per-program XOR words, from torch (a check that the kernel read every byte)."""
    k16, v16 = kc.view(torch.int16).view(-1, block), vc.view(torch.int16).view(-1, block)
    n_tiles = k16.shape[0]
    words = []
    for p in range(programs):
        t0, t1 = p * n_tiles // programs, (p + 1) * n_tiles // programs
        x = torch.zeros(block, dtype=torch.int32, device=kc.device)
        for part in (k16[t0:t1], v16[t0:t1]):
            acc = part.to(torch.int32) & 0xFFFF
            # XOR down the tiles, by halving (torch has no XOR reduction)
            while acc.shape[0] > 1:
                half = acc.shape[0] // 2
                rest = acc[2 * half:]
                acc = torch.cat([acc[:half] ^ acc[half:2 * half], rest])
            if acc.shape[0]:
                x ^= acc[0]
        # the kernel XORs 16-bit words, then sums them as signed int32
        words.append(int(((x + 0x8000) % 0x10000 - 0x8000).sum()))
    return words


def layer_inputs(b, sk):
    """(kv bytes a layer, layers, q, lengths, [(K, V) a layer]) for a row, as `bench decode --layers 8` sizes it."""
    kv_bytes = 2 * b * sk * H_K * D * 2
    layers = max(1, min(8, LAYER_BYTES_BUDGET // kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(b * 7 + sk)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    caches = []
    for _ in range(layers):
        kc = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
        caches.append((kc, torch.randn_like(kc)))
    return kv_bytes, layers, q, lens, caches


def run_row(b, sk, variants, rounds, warmup, rep, bare=False, extra_settings=None):
    kv_bytes, layers, q, lens, caches = layer_inputs(b, sk)
    kc = None
    out = torch.zeros(4096, dtype=torch.int32, device="cuda")
    row = {"b": b, "seqlen_k": sk, "layers": layers, "kv_bytes": kv_bytes, "us": {}, "rounds_us": {}, "tb_s": {}}

    # correctness of the flat read (every byte read), plain, registers-ahead and pipelined, against torch
    want = expected_flat_xor(*caches[0], 128, 8192) if sk <= 16384 else None
    row["flat_check"] = {}
    for label, kwargs in (("plain", {}), ("ahead", dict(ahead=True)), ("stages3", dict(stages=3))):
        check = flat_call(*caches[0], out, 128, 8192, 8, **kwargs)
        check()
        got = out[:128].tolist()
        row["flat_check"][label] = "not run (long row)" if want is None else ("ok" if got == want else "MISMATCH")

    timers = {}
    calls = None  # (no variants: flashtile's settings and cuDNN only)
    for name, (make, kwargs) in variants.items():
        calls = [make(kc, vc, out, **kwargs) for kc, vc in caches]
        timers[name] = calls
    # the per-head reads' XOR words against the plain one's (a prefetch changes no value; a wrong one would fault)
    heads_call(*caches[0], out, 64, 4)()
    want_heads = out[:b * H_K].clone()
    row["heads_check"] = {}
    for name in (n for n in timers if n.startswith("heads")):
        out.zero_()
        timers[name][0]()
        row["heads_check"][name] = "ok" if torch.equal(out[:b * H_K], want_heads) else "MISMATCH"
    ft_calls = [lambda kc=kc, vc=vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens) for kc, vc in caches]
    # bare per-head attention kernels (no masks, no lengths), their outputs checked against flashtile's
    o_bare = torch.empty_like(q)
    ref = ft_calls[0]().float()
    row["bare_check_max_abs"] = {}
    for name, kwargs in (ATTN_VARIANTS if bare else {}).items():
        calls = [attn_call(q, kc, vc, o_bare, **kwargs) for kc, vc in caches]
        try:
            calls[0]()
            row["bare_check_max_abs"][name] = (o_bare.float() - ref).abs().max().item()
            timers[name] = calls
        except Exception as e:
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
    # flashtile's default, and kernels forced (the Gluon per-head kernel is the rule from 16k keys, the Triton one
    # below), and the whole-row kernels (an experiment since session 19, FLASHTILE_DECODE_GLUON_ROWS)
    gluon = {"FLASHTILE_DECODE_GLUON_WARP_KEYS": "1"}
    # leases E23 / G23 timed the whole-row kernels here too (FLASHTILE_DECODE_GLUON_ROWS=1, ..._TMA=0, and
    # FLASHTILE_DECODE_ROWS=8), and J23 the Gluon kernel's warp merge through shared memory (now its only merge)
    settings = {"flashtile": {}, "flashtile_triton": {"FLASHTILE_DECODE_GLUON_WARP_KEYS": "0"},
                "flashtile_gluon": gluon, **(extra_settings or {})}
    # (lease M23 also timed the merge reading back all 16 rows, FLASHTILE_DECODE_GLUON_ALL_ROWS=1, since removed)
    for name in settings:
        timers[name] = ft_calls
    # every flashtile setting's output against the default's (bf16 rounding apart, equal)
    base = ft_calls[0]().float()
    row["ft_check_max_abs"] = {}
    row.setdefault("errors", {})
    for name in settings:
        try:
            with overrides(settings[name]):
                got = timers[name][0]().float()
            row["ft_check_max_abs"][name] = (got - base).abs().max().item()
        except Exception as e:  # a setting the kernel cannot build: recorded, not timed
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            del timers[name]
    row["timeline"] = []  # (name, unix start, unix end) of every timing, to match a clock / power log

    def time_calls(calls, env=None, name=None):
        t0 = time.time()
        with overrides(env or {}):  # read when the graph is captured
            us = bench_graph(lambda: [c() for c in calls], "cuda", warmup, rep) * 1e3 / len(calls)
        row["timeline"].append((name, t0, time.time()))
        return us

    # every variant `rounds` times, the first of each round rotating (bench decode's rounds)
    _time_in_rounds([(n, lambda c=c, n=n: time_calls(c, settings.get(n), n)) for n, c in timers.items()], rounds, row)
    # cuDNN last, on head-major copies made now, the caches freed first (closures hold them too)
    del timers, calls, check, kc, ft_calls
    qt = q.transpose(1, 2)
    peer = []
    for i, (kc, vc) in enumerate(caches):
        kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        caches[i] = None
        del kc, vc
        peer.append((kt, vt))
    calls = [lambda kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True) for kt, vt in peer]
    # the flat read on the same head-major buffers (the same bytes, so the same ceiling unless placement matters)
    hm = [flat_call(kt, vt, out, 256, 8192, 8, stages=3) for kt, vt in peer]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        _time_in_rounds([(n, lambda c=c, n=n: time_calls(c, name=n))
                         for n, c in (("cudnn", calls), ("flat_P256_b8192_w8_s3_headmajor", hm))], rounds, row)
    for n, us in row["us"].items():  # None: it failed (row["errors"] says why)
        row["rounds_us"].setdefault(n, [us] if us else [])  # one round: its only sample
        row["tb_s"][n] = kv_bytes / (us * 1e-6) / 1e12 if us else None
    del peer, calls, hm
    torch.cuda.empty_cache()
    return row


def print_and_save(row: dict, out: str, meta: dict, rows: list) -> None:
    """A row's timings, fastest first, then every row so far to ``out`` (rewritten after each row, so a run cut short
    keeps what it measured)."""
    for n, us in sorted(((n, us) for n, us in row["us"].items() if us), key=lambda kv: kv[1]):
        rounds = [round(x, 1) for x in row["rounds_us"][n]]
        print(f"  {n:36s} {us:9.1f} us  {row['tb_s'][n]:.3f} TB/s  rounds {rounds}", flush=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def stamp_summary(stamps: torch.Tensor) -> dict:
    """One launch's per-program stamps (programs, 4; ns: start, loop end or -1, end) as spans in microseconds."""
    st = stamps.double()
    t0, t1, t2 = st[:, 0], st[:, 1], st[:, 2]
    origin = t0.min()
    out = {"span_us": (t2.max() - origin).item() / 1e3, "start_skew_us": (t0.max() - origin).item() / 1e3,
           "end_spread_us": (t2.max() - t2.min()).item() / 1e3,
           "program_us_min_med_max": [x / 1e3 for x in ((t2 - t0).min().item(), (t2 - t0).median().item(),
                                                       (t2 - t0).max().item())]}
    if (t1 > 0).all():
        epi = t2 - t1
        out["epilogue_us_med_max"] = [epi.median().item() / 1e3, epi.max().item() / 1e3]
        t3 = st[:, 3]
        if (t3 > 0).all():  # the Gluon kernel's merge of its 4 warps' states ends at t3
            merge = t3 - t1
            out["merge_us_med_max"] = [merge.median().item() / 1e3, merge.max().item() / 1e3]
    return out


def replay_stamped(step, stamps: torch.Tensor, replays: int) -> None:
    """``step()`` once on a side stream (compiles), captured there in a CUDA graph, then replayed ``replays`` times
    with ``stamps`` reset to -1 before each: it holds the last replay's stamps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    for _ in range(replays):
        stamps.fill_(-1)
        graph.replay()
    torch.cuda.synchronize()


def parse_settings(items: list[str], base: dict | None = None) -> dict:
    """``NAME=VAR=VALUE,VAR=VALUE`` items as {NAME: {VAR: VALUE, ...}}, each on top of ``base``. A value may hold
    commas (FLASHTILE_DECODE_ROWS_CFG=16,16,3): the items split only before the next VAR=."""
    out = {}
    for item in items:
        name, _, body = item.partition("=")
        out[name] = {**(base or {}), **dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Z0-9_]+=)", body) if kv)}
    return out


def row_parser(seqlens: list) -> argparse.ArgumentParser:
    """The arguments every b-by-seqlen probe takes: --out, --batch, --seqlens (default ``seqlens``), --rounds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlens", type=int, nargs="+", default=seqlens)
    ap.add_argument("--rounds", type=int, default=2)
    return ap


def layer_gaps(layers: list) -> dict:
    """From each layer's (programs, >= 3) stamps (ns: start, ..., end at column 2): the gaps from one layer's last
    end to the next one's first start, and the first start to the last end over the layers, per layer (us)."""
    gaps = [(nxt[:, 0].min() - cur[:, 2].max()).item() / 1e3 for cur, nxt in zip(layers, layers[1:])]
    total = (layers[-1][:, 2].max() - layers[0][:, 0].min()).item() / 1e3
    return {"gaps_us": gaps, "first_start_to_last_end_per_call_us": total / len(layers)}


def run_stamps(b, sk, replays=5):
    """--stamps: each program's %globaltimer stamps in one replay of an 8-layer graph (fewer layers past 16 GB),
    for the rule's Gluon kernel and the per-head read; per layer the kernel's span, its programs' start skew and
    end spread, the Gluon kernel's epilogue (loop end to end), and the gaps from one layer's last program end to
    the next one's first start."""
    from flashtile.backends.triton import decode_gluon

    _, layers, q, lens, caches = layer_inputs(b, sk)
    programs = b * H_K
    stamps = torch.full((layers, programs, 4), -1, dtype=torch.int64, device="cuda")
    out = torch.zeros(4096, dtype=torch.int32, device="cuda")
    result = {"b": b, "seqlen_k": sk, "layers": layers}

    def gluon_layer(i):
        kc, vc = caches[i]
        decode_gluon.STAMPS = stamps[i]
        try:
            with overrides({"FLASHTILE_DECODE_GLUON_WARP_KEYS": "1"}):
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        finally:
            decode_gluon.STAMPS = None

    read_calls = [heads_call(kc, vc, out, 64, 4, ahead=True, stamps=stamps[i]) for i, (kc, vc) in enumerate(caches)]
    # (lease J23 also ran the Gluon kernel with its warp merge through shared memory, then behind a switch)
    cases = (("gluon", [lambda i=i: gluon_layer(i) for i in range(layers)]), ("heads_read", read_calls))
    for name, calls in cases:
        replay_stamped(lambda calls=calls: [c() for c in calls], stamps, replays)
        result[name] = {"per_layer": [stamp_summary(stamps[i]) for i in range(layers)],
                        **layer_gaps([stamps[i] for i in range(layers)])}
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=25)
    ap.add_argument("--rep", type=float, default=100)
    ap.add_argument("--bare", action="store_true", help="also time the bare per-head attention kernels")
    ap.add_argument("--l2", action="store_true",
                    help="also the per-head read with whole rows bulk-prefetched into L2 a few tiles ahead")
    ap.add_argument("--stamps", action="store_true",
                    help="instead of timing: each program's %%globaltimer stamps, Gluon kernel and per-head read")
    args = ap.parse_args()
    if args.stamps:
        meta = collect_meta(sys.argv, "cuda")
        meta["command"] = "PYTHONPATH=src python scripts/probe_read_ceiling.py " + " ".join(sys.argv[1:])
        rows = []
        for sk in args.seqlens:
            rows.append(run_stamps(args.batch, sk))
            r = rows[-1]
            for name in ("gluon", "heads_read"):
                x = r[name]
                lay = x["per_layer"]
                spans = [round(v["span_us"], 1) for v in lay]
                skews = [round(v["start_skew_us"], 2) for v in lay]
                ends = [round(v["end_spread_us"], 1) for v in lay]
                epilogue = [(v.get("epilogue_us_med_max"), v.get("merge_us_med_max")) for v in lay][:2]
                gaps = [round(v, 2) for v in x["gaps_us"]]
                print(f"b={r['b']} s={sk} {name:10s} per call {x['first_start_to_last_end_per_call_us']:.1f} us; "
                      f"span {spans}; start skew {skews}; end spread {ends}; epilogue, merge {epilogue}; gaps {gaps}",
                      flush=True)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        return
    flat, heads = flat_call, heads_call
    variants = {
        "flat_P264_b8192_w8_s3": (flat, dict(programs=264, block=8192, warps=8, stages=3)),
        "flat_P132_b16384_w8_s3": (flat, dict(programs=132, block=16384, warps=8, stages=3)),
        "heads_n64_w4_ahead": (heads, dict(block_n=64, warps=4, ahead=True)),
    }
    if args.l2:  # the per-head read with the row's whole key rows pulled into L2 ahead by bulk prefetches
        for dist in (2, 4, 8):
            variants[f"heads_n64_w4_ahead_l2slice_d{dist}"] = (heads, dict(block_n=64, warps=4, ahead=True,
                                                                           l2_dist=dist))
        for dist in (4, 8):
            variants[f"heads_n64_w4_ahead_l2rotate_d{dist}"] = (heads, dict(block_n=64, warps=4, ahead=True,
                                                                            l2_dist=dist, l2_rotate=True))
    meta = collect_meta(sys.argv, "cuda")
    meta["command"] = "PYTHONPATH=src python scripts/probe_read_ceiling.py " + " ".join(sys.argv[1:])
    rows = []
    for sk in args.seqlens:
        row = run_row(args.batch, sk, variants, args.rounds, args.warmup, args.rep, args.bare)
        rows.append(row)
        print(f"b={row['b']} s={sk} layers={row['layers']} check={row['flat_check']} {row['heads_check']} "
              f"flashtile settings' max |diff|: {row['ft_check_max_abs']} bare kernels': {row['bare_check_max_abs']} "
              f"errors: {row['errors']}", flush=True)
        print_and_save(row, args.out, meta, rows)


if __name__ == "__main__":
    main()
