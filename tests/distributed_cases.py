"""Cases of tests/test_distributed_cpu.py, run inside gloo worker processes (one spawn per world size).

Each worker builds the same full-sequence inputs (seeded by the case name), runs the context-parallel
function on its shard, and records the largest differences of out, lse, dq, dk, dv from the single-process
flash_attn_func on the full sequence (fp64 on the CPU path, so the bar is a tight absolute one). Error cases
record the message they raised. The parent asserts per case.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import flashtile.distributed as cp
from flashtile import flash_attn_func, flash_attn_varlen_func

DOCS = (0, 5, 13, 14, 27, 32)  # packed documents over 32 tokens: some cross shard boundaries, one token long


@dataclass(frozen=True)
class Case:
    name: str
    fn: str
    layout: str = "contiguous"
    kw: dict = field(default_factory=dict)
    h: int = 4
    hk: int = 4
    b: int = 1
    docs: tuple | None = None
    raises: str | None = None  # a substring of the expected error
    extra: dict = field(default_factory=dict)  # keywords that break the call (error cases)
    sink: bool = False  # a learnable sink, its gradient summed over the ranks


CAUSAL = {"causal": True}
WIN = {"window_size": (5, 3)}
CWIN = {"causal": True, "window_size": (6, 0)}

CASES = {
    2: [
        Case("ring_full", "ring", b=2),
        Case("ring_causal", "ring", kw=CAUSAL),
        Case("ring_window", "ring", kw=WIN),
        Case("ring_causal_window_gqa", "ring", kw=CWIN, hk=2),
        Case("ring_softcap_causal", "ring", kw={"causal": True, "softcap": 3.0}),
        Case("ring_varlen_causal", "ring", kw=CAUSAL, docs=DOCS),
        Case("ring_varlen_window", "ring", kw=WIN, docs=DOCS, hk=1),
        Case("ring_devicemesh_causal", "ring_mesh", kw=CAUSAL),
        Case("zigzag_causal", "zigzag", "zigzag", kw=CAUSAL, b=2),
        Case("zigzag_causal_window_gqa", "zigzag", "zigzag", kw=CWIN, hk=2),
        Case("zigzag_varlen_causal", "zigzag", "zigzag", kw=CAUSAL, docs=DOCS),
        Case("allgather_causal_gqa", "allgather", kw=CAUSAL, hk=1),
        Case("allgather_zigzag_window", "allgather", "zigzag", kw=CWIN, hk=2),
        Case("allgather_varlen_window", "allgather", "zigzag", kw=WIN, docs=DOCS),
        Case("ulysses_causal", "ulysses", kw=CAUSAL),
        Case("ulysses_gqa_repeat_window", "ulysses", kw=CWIN, hk=1),
        Case("ulysses_varlen_softcap", "ulysses", kw={"causal": True, "softcap": 3.0}, docs=DOCS),
        Case("ring_sink_causal_window", "ring", kw=CWIN, hk=2, sink=True),
        Case("zigzag_sink_varlen", "zigzag", "zigzag", kw=CAUSAL, docs=DOCS, sink=True),
        Case("allgather_sink_window", "allgather", "zigzag", kw=WIN, hk=1, sink=True),
        Case("ulysses_sink_causal", "ulysses", kw=CAUSAL, hk=2, sink=True),
        Case("mha_zigzag", "mha", "zigzag", kw=CAUSAL, hk=2),
        Case("error_dropout", "ring", kw=CAUSAL, raises="dropout_p", extra={"dropout_p": 0.1}),
        Case("error_ulysses_heads", "ulysses", h=3, hk=3, raises="heads (3)"),
        Case("error_cu_seqlens_end", "ring", docs=(0, 5, 30), raises="cu_seqlens"),
        Case("error_zigzag_odd", "zigzag", "zigzag", raises="divisible by 2", extra={"trim": 1}),
    ],
    4: [
        Case("ring_causal", "ring", kw=CAUSAL),
        Case("zigzag_varlen_window", "zigzag", "zigzag", kw=CWIN, docs=DOCS),
        Case("allgather_zigzag_causal_gqa", "allgather", "zigzag", kw=CAUSAL, hk=2),
        Case("ulysses_causal_gqa", "ulysses", kw=CAUSAL, hk=2),
        Case("hybrid_causal", "hybrid", kw=CAUSAL),
        Case("hybrid_zigzag_varlen_gqa", "hybrid", "zigzag", kw=CWIN, hk=2, docs=DOCS),
        Case("hybrid_sink_causal", "hybrid", "zigzag", kw=CAUSAL, sink=True),
        Case("error_hybrid_groups", "hybrid_bad", kw=CAUSAL, raises="must share exactly"),
    ],
}
SEQ = 32


def reference(q, k, v, kw, docs, sink=None):
    """Single-process flash attention on the full sequence: (out, lse (b, h, s)) with autograd."""
    kw = dict(kw, learnable_sink=sink)
    if docs is None:
        out, lse, _ = flash_attn_func(q, k, v, **kw, return_attn_probs=True)
        return out, lse
    b, s = q.shape[:2]
    cu = torch.tensor([c + i * s for i in range(b) for c in docs[:-1]] + [b * s], dtype=torch.int32)
    m = max(e - a for a, e in zip(docs, docs[1:]))
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*flat, cu, cu, m, m, **kw, return_attn_probs=True)
    return out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)


def _groups(world):
    """The 2 x 2 grid of world 4: Ulysses rows {0,1}, {2,3}; ring columns {0,2}, {1,3} (every rank makes all)."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rows, cols


def _shard(x, case, rank, world):
    if case.fn.startswith("hybrid"):
        return cp.shard_hybrid(x, 2, rank // 2, 2, rank % 2, case.layout)
    return cp.shard(x, world, rank, case.layout)


def _call(case, q, k, v, rank, world, groups, sink=None):
    kw = dict(case.kw, return_attn_probs=True)
    if sink is not None:
        kw["learnable_sink"] = sink
    kw.update({key: val for key, val in case.extra.items() if key != "trim"})
    cu = None if case.docs is None else torch.tensor(case.docs, dtype=torch.int32)
    if case.fn == "ring":
        return cp.ring_flash_attn_func(q, k, v, **kw, cu_seqlens=cu)
    if case.fn == "ring_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return cp.ring_flash_attn_func(q, k, v, **kw, group=init_device_mesh("cpu", (world,)))
    if case.fn == "zigzag":
        return cp.zigzag_ring_flash_attn_func(q, k, v, **kw, cu_seqlens=cu)
    if case.fn == "allgather":
        return cp.kv_allgather_flash_attn_func(q, k, v, **kw, layout=case.layout, cu_seqlens=cu)
    if case.fn == "ulysses":
        return cp.ulysses_flash_attn_func(q, k, v, **kw, cu_seqlens=cu)
    rows, cols = groups
    if case.fn == "hybrid":
        return cp.hybrid_flash_attn_func(q, k, v, **kw, ulysses_group=rows[rank // 2], ring_group=cols[rank % 2],
                                         layout=case.layout, cu_seqlens=cu)
    if case.fn == "hybrid_bad":
        return cp.hybrid_flash_attn_func(q, k, v, **kw, ulysses_group=cols[rank % 2], ring_group=cols[rank % 2])
    raise ValueError(case.fn)


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


def _lse_err(a, b):
    if not torch.equal(a.isinf(), b.isinf()):
        return float("inf")
    return _err(a.masked_fill(a.isinf(), 0), b.masked_fill(b.isinf(), 0))


def run_case(case: Case, rank: int, world: int, groups) -> dict:
    torch.manual_seed(zlib.crc32(case.name.encode()))
    d = 16
    q, k, v = (torch.randn(case.b, SEQ, n, d, dtype=torch.float64) for n in (case.h, case.hk, case.hk))
    dout = torch.randn(case.b, SEQ, case.h, d, dtype=torch.float64)
    if case.fn == "mha":
        return _run_mha(case, rank, world, dout)
    shards = [_shard(x, case, rank, world) for x in (q, k, v)]
    if "trim" in case.extra:
        shards = [x[:, case.extra["trim"]:] for x in shards]
    shards = [x.requires_grad_() for x in shards]
    sink = torch.randn(case.h, dtype=torch.float64) if case.sink else None
    mine_sink = sink.clone().requires_grad_() if case.sink else None
    try:
        out, lse, _ = _call(case, *shards, rank, world, groups, mine_sink)
    except (ValueError, RuntimeError) as e:
        return {"raised": str(e)}
    out.backward(_shard(dout, case, rank, world))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_sink = sink.clone().requires_grad_() if case.sink else None
    ref_out, ref_lse = reference(*full, case.kw, case.docs, ref_sink)
    ref_out.backward(dout)
    lse_shard = _shard(ref_lse.transpose(1, 2), case, rank, world).transpose(1, 2)
    errs = {"out": _err(out, _shard(ref_out, case, rank, world)), "lse": _lse_err(lse, lse_shard)}
    for name, mine, ref in zip(("dq", "dk", "dv"), shards, full):
        errs[name] = _err(mine.grad, _shard(ref.grad, case, rank, world))
    if case.sink:  # each rank's gradient is its share of the rows (and heads): the sum over ranks is the whole
        dsink = mine_sink.grad.clone()
        dist.all_reduce(dsink)
        errs["dsink"] = _err(dsink, ref_sink.grad)
    return errs


def _run_mha(case, rank, world, dout):
    """MHA with cp_group against the same weights on the whole sequence: output shard, input gradient and
    weight gradients (summed over ranks)."""
    from flashtile.modules.mha import MHA

    e = case.h * 16
    x = torch.randn(1, SEQ, e, dtype=torch.float64)
    ref = MHA(e, case.h, case.hk, causal=True, dtype=torch.float64)
    mine = MHA(e, case.h, case.hk, causal=True, dtype=torch.float64, cp_group=dist.group.WORLD, cp_scheme="zigzag")
    mine.load_state_dict(ref.state_dict())
    gy = torch.randn(1, SEQ, e, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    xs = cp.shard(x, world, rank, "zigzag").requires_grad_()
    y = mine(xs)
    y.backward(cp.shard(gy, world, rank, "zigzag"))
    wgrad = mine.Wqkv.weight.grad.clone()
    dist.all_reduce(wgrad)
    return {"out": _err(y, cp.shard(ref(x), world, rank, "zigzag")),
            "dx": _err(xs.grad, cp.shard(xr.grad, world, rank, "zigzag")),
            "dWqkv": _err(wgrad, ref.Wqkv.weight.grad)}


def worker(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    # a rendezvous file, not a TCP port: a port picked free by the parent can be taken by another test
    # process (pytest-xdist runs several) before the workers bind it
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{outdir}/rendezvous")
    groups = _groups(world) if world == 4 else None
    results = {}
    for case in CASES[world]:
        try:
            results[case.name] = run_case(case, rank, world, groups)
        except Exception as e:  # reported per case; the other cases still run
            results[case.name] = {"crashed": f"{type(e).__name__}: {e}"}
        dist.barrier()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
