"""Cases of tests/test_distributed_cpu.py, run inside gloo worker processes (one spawn per world size).

Each worker builds the same full-sequence inputs (seeded by the case name), runs the context-parallel
function on its shard, and records the largest differences of out, lse, dq, dk, dv from the single-process
flash_attn_func on the full sequence (fp64 on the CPU path, so the bar is a tight absolute one). An fp32 case
records its error beside the error of flash_attn_func in fp32, both against fp64, for FlashAttention's 2x
bar. Error cases record the message they raised. The parent asserts per case.
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
    alibi: str | None = None  # ALiBi slopes of shape (h,) ("h") or (b, h) ("bh")
    dtype: str = "float64"  # "float32": FlashAttention's 2x bar against fp64 instead of the tight fp64 one
    mha: dict = field(default_factory=dict)  # fn "mha": the MHA's keywords (cp_scheme, rotary, ALiBi, ...)


CAUSAL = {"causal": True}
WIN = {"window_size": (5, 3)}
CWIN = {"causal": True, "window_size": (6, 0)}
CHUNK = {"causal": True, "attention_chunk": 6}  # chunk bounds 6, 12, 18, ...: none on a shard boundary

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
        Case("ring_chunk_causal", "ring", kw=CHUNK),
        Case("ring_chunk_full_gqa", "ring", kw={"attention_chunk": 8}, hk=2, b=2),  # every remote step skipped
        Case("zigzag_chunk_window_varlen", "zigzag", "zigzag", kw=dict(CWIN, attention_chunk=5), docs=DOCS),
        Case("allgather_chunk_window", "allgather", "zigzag", kw=dict(WIN, attention_chunk=7), hk=1),
        Case("ulysses_zigzag_chunk", "ulysses", "zigzag", kw=CHUNK),
        Case("ring_alibi_full", "ring", alibi="h", b=2),
        Case("ring_alibi_chunk_fp32", "ring", kw=CHUNK, alibi="h", dtype="float32"),
        Case("zigzag_alibi_causal", "zigzag", "zigzag", kw=CAUSAL, alibi="bh", b=2),
        Case("zigzag_alibi_window_varlen", "zigzag", "zigzag", kw=WIN, docs=DOCS, alibi="h", hk=2),
        Case("allgather_alibi_full_gqa", "allgather", alibi="h", hk=2),
        Case("allgather_zigzag_alibi_chunk", "allgather", "zigzag", kw=CHUNK, alibi="bh", b=2),
        Case("ulysses_alibi_causal", "ulysses", kw=CAUSAL, alibi="h"),
        Case("ulysses_zigzag_varlen_alibi", "ulysses", "zigzag", kw=CWIN, docs=DOCS, alibi="bh", b=2),
        Case("mha_rotary_alibi_zigzag", "mha", mha=dict(cp_scheme="zigzag", rotary_emb_dim=8, use_alibi=True)),
        Case("mha_rotary_xpos_ring", "mha", mha=dict(cp_scheme="ring", rotary_emb_dim=16, causal=False,
                                                      rotary_emb_scale_base=64.0)),
        Case("mha_rotary_varlen_ulysses_zigzag", "mha", hk=2, docs=DOCS,
             mha=dict(cp_scheme="ulysses_zigzag", rotary_emb_dim=8, rotary_emb_interleaved=True)),
        Case("mha_alibi_allgather_window", "mha", mha=dict(cp_scheme="allgather", use_alibi=True, window_size=(7, 0))),
        Case("error_mha_generation", "mha", raises="inference_params", extra={"inference_params": True}),
        Case("error_mha_padding_mask", "mha", raises="key_padding_mask", extra={"key_padding_mask": True}),
        Case("error_chunk_negative", "ring", raises="attention_chunk", extra={"attention_chunk": -2}),
        Case("error_alibi_shape", "zigzag", "zigzag", raises="alibi_slopes", extra={"alibi_slopes": "bad"}),
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
        Case("ring_alibi_chunk_causal", "ring", kw=CHUNK, alibi="h"),  # 2 of the 4 steps
        Case("ring_window_two_steps_gqa", "ring", kw=dict(CWIN, window_size=(5, 0)), hk=2, sink=True),
        Case("zigzag_chunk_window_gqa", "zigzag", "zigzag", kw={"window_size": (9, 4), "attention_chunk": 10}, hk=2),
        Case("allgather_alibi_window_varlen", "allgather", kw=WIN, docs=DOCS, alibi="bh", b=2),
        Case("ulysses_zigzag_alibi_gqa", "ulysses", "zigzag", kw=CAUSAL, alibi="h", hk=2),
        Case("hybrid_zigzag_alibi_chunk", "hybrid", "zigzag", kw=CHUNK, alibi="bh", b=2),
        Case("mha_hybrid_rotary_alibi", "mha", mha=dict(cp_scheme="hybrid_zigzag", rotary_emb_dim=8, use_alibi=True)),
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
    slopes = kw.get("alibi_slopes")
    if slopes is not None and slopes.dim() == 2:  # varlen: one row of slopes per sequence
        kw["alibi_slopes"] = slopes.repeat_interleave(len(docs) - 1, dim=0)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*flat, cu, cu, m, m, **kw, return_attn_probs=True)
    return out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)


def _groups(world):
    """The 2 x 2 grid of world 4: Ulysses rows {0,1}, {2,3}; ring columns {0,2}, {1,3} (every rank makes all)."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rows, cols


def _hybrid(case) -> bool:
    return case.fn.startswith("hybrid") or case.mha.get("cp_scheme", "").startswith("hybrid")


def _layout(case) -> str:
    return "zigzag" if case.mha.get("cp_scheme", "").endswith("zigzag") else case.layout


def _shard(x, case, rank, world):
    if _hybrid(case):
        return cp.shard_hybrid(x, 2, rank // 2, 2, rank % 2, _layout(case))
    return cp.shard(x, world, rank, _layout(case))


def _call(case, q, k, v, rank, world, groups, sink=None, slopes=None):
    kw = dict(case.kw, return_attn_probs=True, alibi_slopes=slopes)
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
        return cp.ulysses_flash_attn_func(q, k, v, **kw, layout=case.layout, cu_seqlens=cu)
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
        return _run_mha(case, rank, world, groups)
    slopes = None
    if case.alibi:
        slopes = torch.rand((case.h,) if case.alibi == "h" else (case.b, case.h)) + 0.05  # ALiBi slopes are fp32
    dtype = getattr(torch, case.dtype)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    shards = [_shard(x, case, rank, world) for x in (q, k, v)]
    if "trim" in case.extra:
        shards = [x[:, case.extra["trim"]:] for x in shards]
    shards = [x.requires_grad_() for x in shards]
    sink = torch.randn(case.h, dtype=dtype) if case.sink else None
    mine_sink = sink.clone().requires_grad_() if case.sink else None
    try:
        out, lse, _ = _call(case, *shards, rank, world, groups, mine_sink, slopes)
    except (ValueError, RuntimeError, TypeError) as e:
        return {"raised": str(e)}
    out.backward(_shard(dout, case, rank, world))
    kw = dict(case.kw, alibi_slopes=slopes)
    refs = [_reference_run(q, k, v, dout, kw, case.docs, sink, torch.float64)]
    if dtype != torch.float64:  # flash_attn_func in the same dtype: FlashAttention's bar is twice its error
        refs.append(_reference_run(q, k, v, dout, kw, case.docs, sink, dtype))
    errs = {}
    for name, mine, *ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *(x.grad for x in shards)), *refs):
        ref = [_shard(r.transpose(1, 2), case, rank, world).transpose(1, 2) if name == "lse" else
               _shard(r, case, rank, world) for r in ref]
        diff = _lse_err if name == "lse" else _err
        errs[name] = [diff(mine, ref[0])] + [diff(r, ref[0]) for r in ref[1:]]
    if case.sink:  # each rank's gradient is its share of the rows (and heads): the sum over ranks is the whole
        dsink = mine_sink.grad.clone()
        dist.all_reduce(dsink)
        errs["dsink"] = [_err(dsink, refs[0][-1])] + [_err(r[-1], refs[0][-1]) for r in refs[1:]]
    return errs


def _reference_run(q, k, v, dout, kw, docs, sink, dtype):
    """flash_attn_func on the whole sequence in ``dtype``: [out, lse, dq, dk, dv] (and dsink with a sink)."""
    full = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    ref_sink = None if sink is None else sink.to(dtype).requires_grad_()
    out, lse = reference(*full, kw, docs, ref_sink)
    out.backward(dout.to(dtype))
    return [out, lse, *(x.grad for x in full)] + ([] if sink is None else [ref_sink.grad])


def _run_mha(case, rank, world, groups):
    """MHA with cp_group against the same weights on the whole sequence: output shard, input gradient and
    weight gradients (summed over ranks)."""
    from flashtile.modules.mha import MHA

    e = case.h * 16
    x = torch.randn(1, SEQ, e, dtype=torch.float64)
    gy = torch.randn(1, SEQ, e, dtype=torch.float64)
    kw = dict(dict(causal=True), **{key: val for key, val in case.mha.items() if key != "cp_scheme"})
    scheme = case.mha.get("cp_scheme", "zigzag" if case.layout == "zigzag" else "ring")
    group = (groups[0][rank // 2], groups[1][rank % 2]) if _hybrid(case) else dist.group.WORLD
    ref = MHA(e, case.h, case.hk, dtype=torch.float64, **kw)
    mine = MHA(e, case.h, case.hk, dtype=torch.float64, cp_group=group, cp_scheme=scheme, **kw)
    mine.load_state_dict(ref.state_dict())
    xs = _shard(x, case, rank, world).requires_grad_()
    call = {}
    if case.docs is not None:
        call = dict(cu_seqlens=torch.tensor(case.docs, dtype=torch.int32),
                    max_seqlen=max(b - a for a, b in zip(case.docs, case.docs[1:])))
    if "inference_params" in case.extra:
        from flashtile.modules.mha import InferenceParams

        call["inference_params"] = InferenceParams(max_seqlen=SEQ, max_batch_size=1)
    if "key_padding_mask" in case.extra:
        call["key_padding_mask"] = torch.ones(1, xs.shape[1], dtype=torch.bool)
    try:
        y = mine(xs, **call)
    except (ValueError, RuntimeError, TypeError) as err:
        return {"raised": str(err)}
    y.backward(_shard(gy, case, rank, world))
    xr = x.clone().requires_grad_()
    if case.docs is None:
        yr = ref(xr)
    else:  # the packed sequence through the module's varlen path: (total, e)
        yr = ref(xr[0], cu_seqlens=call["cu_seqlens"], max_seqlen=call["max_seqlen"])[None]
    yr.backward(gy)
    wgrad = mine.Wqkv.weight.grad.clone()
    dist.all_reduce(wgrad)
    return {"out": [_err(y, _shard(yr, case, rank, world))],
            "dx": [_err(xs.grad, _shard(xr.grad, case, rank, world))],
            "dWqkv": [_err(wgrad, ref.Wqkv.weight.grad)]}


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
