"""Where does a whole-row decode kernel lose to a plain read of the same bytes? (H200 probe, session 24)

Usage: PYTHONPATH=src python scripts/probe_row_pipeline.py --out row_pipeline.json [--seqlens 16384 131072]

Session 23 (docs/decode_tuning_log.md) found that a plain read of a b = 32 cache in whole key rows
(``flat_P132_b16384_w8_s3``: 16 rows a tile, Triton's 3-stage cp.async pipeline) beats cuDNN by 0.3%-0.8% at
64k-128k keys, while every whole-row attention kernel built so far trails that read by 0.4%-2.5%. This probe
takes the row kernel's shape (a program per (row, key split), 4 splits at b = 32: 128 programs of 8 warps,
16-key tiles of all 8 kv heads, 3 stages) and adds the attention's work to it a piece at a time, in the same
8-layer graphs as ``probe_read_ceiling.py`` and beside its reads, flashtile and cuDNN:
- ``rows_read``: the loads only (every 16-bit element XORed into registers), as [h_k, keys, d] pointer tiles;
- ``rows_read2d``: the same bytes as [keys, h_k * d] tiles, each key row's 2 KB one piece;
- ``rows_qk``: + the 8 heads' scores S = Q K^T (batched dots), V still XORed;
- ``rows_attn``: + the online softmax and O += P V, the whole attention (checked against flashtile);
- ``rows_attn2d``: the whole attention on the 2-D tiles, reshaped to [h_k, keys, d] in registers;
- ``rows_attn_combine``: the whole attention, its 4 splits' partials merged by flashtile's combine kernel;
- ``rows_diag`` / ``rows_diag_combine``: the whole attention as plain 2-D dots of all the program's query heads
  against all its kv heads' keys, the other heads' scores masked (``_rows_diag``).
The first variant that is slower than the read says which step costs the time.
"""

import sys

import torch
import triton
import triton.language as tl
from probe_read_ceiling import H_K, D, H, flat_call, print_and_save, row_parser, run_row

from flashtile.bench.report import collect_meta

BLOCK_M = 16  # a GQA group of 4 padded to one MMA's rows


@triton.jit
def _rows_probe(Q, K, V, O, out_ptr, O_PART, LSE_PART, S, stride_qb, stride_qh, stride_kb, stride_ks, stride_ob,
                stride_oh, stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph, qk_scale,
                SPLITS: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, TILE_2D: tl.constexpr,
                STAGES: tl.constexpr):
    """MODE 0: read only; 1: + scores; 2: the whole attention (full rows, S a multiple of SPLITS * BLOCK_N, no
    masks, and the splits' partials not merged: O gets split 0's normalized output, enough for a check at
    SPLITS = 1); 3: the whole attention, every split's normalized output and lse stored as flashtile's combine
    kernel takes them (O_PART (splits, b, 1, h, d), LSE_PART (splits, b, h, 1)). TILE_2D: K / V tiles loaded as
    [BLOCK_N, H_KV * HEAD_D] and reshaped."""
    pid = tl.program_id(0)
    row = pid // SPLITS
    split = pid % SPLITS
    per = S // SPLITS
    lo = split * per
    base = row.to(tl.int64) * stride_kb
    if TILE_2D:
        rn = tl.arange(0, BLOCK_N)[:, None]
        rc = tl.arange(0, H_KV * HEAD_D)[None, :]
        off = base + (lo + rn).to(tl.int64) * stride_ks + rc
    else:
        rh = tl.arange(0, H_KV)[:, None, None]
        rn = tl.arange(0, BLOCK_N)[None, :, None]
        rd = tl.arange(0, HEAD_D)[None, None, :]
        off = base + (lo + rn).to(tl.int64) * stride_ks + rh * HEAD_D + rd
    step = BLOCK_N * stride_ks
    hm = tl.arange(0, H_KV)[:, None, None]
    mm = tl.arange(0, BLOCK_M)[None, :, None]
    dd = tl.arange(0, HEAD_D)[None, None, :]
    q = tl.load(Q + row * stride_qb + (hm * GROUP + mm) * stride_qh + dd, mask=mm < GROUP, other=0.0)
    x = tl.zeros([BLOCK_N, H_KV * HEAD_D] if TILE_2D else [H_KV, BLOCK_N, HEAD_D], tl.int16)
    m_i = tl.full([H_KV, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([H_KV, BLOCK_M], tl.float32)
    acc = tl.zeros([H_KV, BLOCK_M, HEAD_D], tl.float32)
    for _ in tl.range(0, per, BLOCK_N, num_stages=STAGES):
        k = tl.load(K + off)
        v = tl.load(V + off)
        off += step
        if MODE == 0:
            x ^= k.to(tl.int16, bitcast=True) ^ v.to(tl.int16, bitcast=True)
        else:
            if TILE_2D:
                k = tl.permute(tl.reshape(k, (BLOCK_N, H_KV, HEAD_D)), (1, 0, 2))
                v = tl.permute(tl.reshape(v, (BLOCK_N, H_KV, HEAD_D)), (1, 0, 2))
            s = tl.dot(q, tl.permute(k, (0, 2, 1))) * qk_scale  # [H_KV, BLOCK_M, BLOCK_N]
            if MODE == 1:
                m_i = tl.maximum(m_i, tl.max(s, 2))
                if TILE_2D:
                    x ^= tl.reshape(tl.permute(v, (1, 0, 2)), (BLOCK_N, H_KV * HEAD_D)).to(tl.int16, bitcast=True)
                else:
                    x ^= v.to(tl.int16, bitcast=True)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 2))
                p = tl.exp2(s - m_new[:, :, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 2)
                acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
    if MODE == 3:
        out = acc / l_i[:, :, None]
        q_head = hm * GROUP + mm
        split64 = split.to(tl.int64)
        tl.store(O_PART + split64 * stride_ops + row * stride_opb + q_head * stride_oph + dd, out, mask=mm < GROUP)
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
        lse_head = tl.arange(0, H_KV)[:, None] * GROUP + tl.arange(0, BLOCK_M)[None, :]
        tl.store(LSE_PART + split64 * stride_lps + row * stride_lpb + lse_head * stride_lph, lse,
                 mask=tl.arange(0, BLOCK_M)[None, :] < GROUP)
    elif MODE == 2:
        out = acc / l_i[:, :, None]
        if split == 0:
            tl.store(O + row * stride_ob + (hm * GROUP + mm) * stride_oh + dd, out.to(O.dtype.element_ty),
                     mask=mm < GROUP)
        tl.store(out_ptr + pid, tl.sum(tl.sum(tl.sum(out, 2), 1), 0).to(tl.int32))
    else:
        if TILE_2D:
            word = tl.sum(tl.sum(x.to(tl.int32), 1), 0)
        else:
            word = tl.sum(tl.sum(tl.sum(x.to(tl.int32), 2), 1), 0)
        if MODE == 1:
            word += tl.sum(tl.sum(m_i, 1), 0).to(tl.int32)
        tl.store(out_ptr + pid, word)


@triton.jit
def _rows_diag(Q, K, V, O, O_PART, LSE_PART, S, stride_qb, stride_qh, stride_kb, stride_ks, stride_ob, stride_oh,
               stride_ops, stride_opb, stride_oph, stride_lps, stride_lpb, stride_lph, qk_scale,
               SPLITS: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr,
               Q_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr, STAGES: tl.constexpr):
    """The whole attention with plain 2-D dots: a tile is BLOCK_N whole key rows read as [BLOCK_N * H_KV, HEAD_D]
    (row r: key r // H_KV, kv head r % H_KV; contiguous rows, so one 32 KB piece), and the program's query heads
    are [Q_ROWS, HEAD_D] (row j: query head j, of kv head j // GROUP). S = Q K^T scores every query head against
    every kv head's keys; the pairs of different heads are masked to -inf (block-diagonal), so no padding a head
    and no 3-D dots: 8x the MMA work of a per-head product, for a memory-bound loop. PARTIALS: every split's
    normalized output and lse for the combine kernel; otherwise O gets split 0's output (a check at SPLITS = 1)."""
    pid = tl.program_id(0)
    row = pid // SPLITS
    split = pid % SPLITS
    per = S // SPLITS
    lo = split * per
    rr = tl.arange(0, BLOCK_N * H_KV)
    rd = tl.arange(0, HEAD_D)[None, :]
    off = row.to(tl.int64) * stride_kb + lo.to(tl.int64) * stride_ks + rr[:, None] * HEAD_D + rd
    step = BLOCK_N * stride_ks
    rq = tl.arange(0, Q_ROWS)
    q_ok = rq < H_KV * GROUP
    q = tl.load(Q + row * stride_qb + rq[:, None] * stride_qh + rd, mask=q_ok[:, None], other=0.0)
    same_head = (rq // GROUP)[:, None] == (rr % H_KV)[None, :]  # [Q_ROWS, BLOCK_N * H_KV]
    m_i = tl.full([Q_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([Q_ROWS], tl.float32)
    acc = tl.zeros([Q_ROWS, HEAD_D], tl.float32)
    for _ in tl.range(0, per, BLOCK_N, num_stages=STAGES):
        k = tl.load(K + off)
        v = tl.load(V + off)
        off += step
        s = tl.where(same_head, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    if PARTIALS:
        split64 = split.to(tl.int64)
        tl.store(O_PART + split64 * stride_ops + row * stride_opb + rq[:, None] * stride_oph + rd, out,
                 mask=q_ok[:, None])
        tl.store(LSE_PART + split64 * stride_lps + row * stride_lpb + rq * stride_lph,
                 (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=q_ok)
    elif split == 0:
        tl.store(O + row * stride_ob + rq[:, None] * stride_oh + rd, out.to(O.dtype.element_ty), mask=q_ok[:, None])


def diag_call(q, o, kc, vc, out, partials=False, splits=4, block_n=16, warps=8, stages=3):
    """rows_diag (partials=False) / rows_diag_combine: _rows_diag, and with partials the combine kernel."""
    from flashtile.backends.triton.decode import combine, split_partials

    b, s, h_k, d = kc.shape
    h = q.shape[2]
    assert s % (splits * block_n) == 0 and kc.is_contiguous() and vc.is_contiguous() and q.shape[1] == 1
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    lse = torch.empty(b, h, 1, device=q.device, dtype=torch.float32)

    def call():
        _rows_diag[(b * splits,)](q, kc, vc, o, o_part, lse_part, s, q.stride(0), q.stride(2), kc.stride(0),
                                  kc.stride(1), o.stride(0), o.stride(2), o_part.stride(0), o_part.stride(1),
                                  o_part.stride(3), lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
                                  d ** -0.5 * 1.4426950408889634, SPLITS=splits, H_KV=h_k, GROUP=h // h_k,
                                  HEAD_D=d, Q_ROWS=max(16, triton.next_power_of_2(h)), BLOCK_N=block_n,
                                  PARTIALS=partials, STAGES=stages, num_warps=warps, num_stages=1)
        if partials:
            combine(o_part, lse_part, o, lse)
    return call


def rows_call(q, o, kc, vc, out, mode, tile_2d=False, splits=4, block_n=16, warps=8, stages=3):
    """Mode 3 merges the splits with flashtile's combine kernel into o (and an lse)."""
    from flashtile.backends.triton.decode import combine, split_partials

    b, s, h_k, d = kc.shape
    h = q.shape[2]
    assert s % (splits * block_n) == 0 and kc.stride() == vc.stride() and kc.stride(2) == d
    o_part, lse_part = split_partials(splits, b, 1, h, d, q.device)
    lse = torch.empty(b, h, 1, device=q.device, dtype=torch.float32)

    def call():
        _rows_probe[(b * splits,)](q, kc, vc, o, out, o_part, lse_part, s, q.stride(0), q.stride(2), kc.stride(0),
                                   kc.stride(1), o.stride(0), o.stride(2), o_part.stride(0), o_part.stride(1),
                                   o_part.stride(3), lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
                                   d ** -0.5 * 1.4426950408889634, SPLITS=splits,
                                   H_KV=h_k, GROUP=h // h_k, HEAD_D=d, BLOCK_M=BLOCK_M, BLOCK_N=block_n, MODE=mode,
                                   TILE_2D=tile_2d, STAGES=stages, num_warps=warps, num_stages=1)
        if mode == 3:
            combine(o_part, lse_part, o, lse)
    return call


def check_attention(b=4, sk=4096):
    """rows_attn / rows_attn2d at one split against torch (fp32 softmax), max |difference|."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(b, sk, H_K, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    kk = kc.float().repeat_interleave(H // H_K, dim=2).transpose(1, 2)  # b, h, s, d
    vv = vc.float().repeat_interleave(H // H_K, dim=2).transpose(1, 2)
    ref = torch.softmax(q.float().transpose(1, 2) @ kk.transpose(-1, -2) * D ** -0.5, -1) @ vv  # b, h, 1, d
    out = torch.zeros(4096, dtype=torch.int32, device="cuda")
    result = {}
    for name, mode, tile_2d, splits in (("rows_attn", 2, False, 1), ("rows_attn2d", 2, True, 1),
                                        ("rows_attn_combine", 3, False, 4)):
        o = torch.zeros_like(q)
        rows_call(q, o, kc, vc, out, mode, tile_2d=tile_2d, splits=splits)()
        result[name] = (o.float().transpose(1, 2) - ref).abs().max().item()
    for name, partials, splits in (("rows_diag", False, 1), ("rows_diag_combine", True, 4)):
        o = torch.zeros_like(q)
        diag_call(q, o, kc, vc, out, partials=partials, splits=splits)()
        result[name] = (o.float().transpose(1, 2) - ref).abs().max().item()
    return result


def main():
    ap = row_parser([16384, 131072])
    ap.add_argument("--rule", action="store_true",
                    help="only flashtile's kernels (the default, the row kernel with PDL) beside cuDNN, for a rule")
    ap.add_argument("--cfgs", nargs="*", default=[],
                    help="also the row kernel with FLASHTILE_DECODE_ROWS_CFG=BLOCK_N,warps,stages set to each")
    args = ap.parse_args()
    meta = collect_meta(sys.argv, "cuda")
    meta["command"] = "PYTHONPATH=src python scripts/probe_row_pipeline.py " + " ".join(sys.argv[1:])
    meta["attention_check_max_abs"] = check_attention()
    print("attention check, max |diff| against torch:", meta["attention_check_max_abs"], flush=True)
    q = torch.randn(args.batch, 1, H, D, device="cuda", dtype=torch.bfloat16)
    o = torch.zeros_like(q)

    def rows(kc, vc, out, **kw):
        return rows_call(q, o, kc, vc, out, **kw)

    variants = {
        "flat_P128_b16384_w8_s3": (flat_call, dict(programs=128, block=16384, warps=8, stages=3)),
        "flat_P132_b16384_w8_s3": (flat_call, dict(programs=132, block=16384, warps=8, stages=3)),
        "rows_read": (rows, dict(mode=0)),
        "rows_read2d": (rows, dict(mode=0, tile_2d=True)),
        "rows_qk": (rows, dict(mode=1)),
        "rows_attn": (rows, dict(mode=2)),
        "rows_attn_combine": (rows, dict(mode=3)),
    }
    # (lease B24 also ran rows_attn2d: 10%-13% slower, the 2-D tiles' reshape goes through shared memory; lease F24
    # rows_diag and rows_diag_combine: 14%-18% slower; check_attention still checks both)
    rows8 = {"FLASHTILE_DECODE_ROWS": "8"}
    extra = {"flashtile_rows8": rows8, "flashtile_rows8_fused": {**rows8, "FLASHTILE_DECODE_ROWS_FUSED": "1"},
             "flashtile_rows8_pdl": {**rows8, "FLASHTILE_DECODE_ROWS_PDL": "1"},
             "flashtile_rows8_fused_pdl": {**rows8, "FLASHTILE_DECODE_ROWS_FUSED": "1",
                                           "FLASHTILE_DECODE_ROWS_PDL": "1"}}
    extra["flashtile_rows8_streamk"] = {**rows8, "FLASHTILE_DECODE_ROWS_STREAMK": "1"}
    if args.rule:
        variants = {}
        extra = {"flashtile_rows8_pdl": extra["flashtile_rows8_pdl"],
                 "flashtile_rows8_streamk": extra["flashtile_rows8_streamk"]}
    for cfg in args.cfgs:
        extra[f"flashtile_rows8_cfg{cfg.replace(',', '_')}"] = {**rows8, "FLASHTILE_DECODE_ROWS_CFG": cfg}
    rows_out = []
    for sk in args.seqlens:
        row = run_row(args.batch, sk, variants, args.rounds, 25, 100, extra_settings=extra)
        rows_out.append(row)
        print(f"b={row['b']} s={sk} layers={row['layers']} errors: {row['errors']}", flush=True)
        print_and_save(row, args.out, meta, rows_out)


if __name__ == "__main__":
    main()
