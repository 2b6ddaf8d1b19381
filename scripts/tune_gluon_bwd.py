"""Configs of the Gluon dK/dV kernel, and the backward with and without it (H200).

Usage: PYTHONPATH=src python scripts/tune_gluon_bwd.py --out tune_gluon_bwd.json [--d 128] [--seqlens 1024 4096]

Shapes follow BASELINES.md (b * s = 16k tokens, h * d = 2048), bf16, plain and causal. Per row:
- ``triton_bwd_ms`` / ``gluon_bwd_ms``: the whole backward (delta, dK/dV, dQ) with the Triton or the
  Gluon dK/dV kernel (its default config), autograd.grad after one forward: the numbers behind
  gluon_bwd.ROUTE_TABLE;
- per config of CANDIDATES: the Gluon dK/dV kernel alone (``dkdv_ms``, TFLOP/s of its 4 GEMMs), and
  the largest |dk, dv - default config's| relative to the largest value (another summation order:
  about 1e-2 at bf16 is rounding, O(1) is a broken config);
- ``rest_ms`` = gluon_bwd_ms - the default config's dkdv_ms: delta and the Triton dQ kernel.
Times are medians of triton.testing.do_bench. A config that fails to compile or launch is recorded
with its error and the sweep goes on. ``--fused``: the fused dQ build's configs instead (FUSED_CANDIDATES; the
kernel computes dQ too, 5 GEMMs, its buffer zeroed inside each timed call as the backward does).
"""

import argparse
import json
import time

import torch
import triton

import flashtile
from flashtile import config
from flashtile.backends.triton import gluon_bwd
from flashtile.kernels.gluon_bwd import BWD_DKDV_CONFIGS, BWD_FUSED_CONFIGS

# (BLOCK_M, BLOCK_N, NUM_BUFFERS, num_warps); each compiled for sm_90 on the CPU first
# (tests/aot_gluon_bwd.py): no spills, within the 227 KiB of shared memory a CTA may use
# a fifth element: WARPS_N (d = 256: two warpgroups side by side); a sixth: ROTATED (0: the plain
# order with 64-row steps: d = 128 causal spills 24 bytes there; at d = 256 it takes 208 KiB of
# shared memory, so one CTA per SM and no second CTA to overlap with)
CANDIDATES = {
    256: [(64, 64, 2, 8, 2, 0), (32, 64, 4, 8, 2)],
    128: [(64, 64, 2, 4, 1, 0), (32, 64, 4, 4), (64, 128, 2, 8, 1, 0), (128, 64, 2, 8, 2, 0)],
    64: [(64, 64, 4, 4), (64, 64, 2, 4, 1, 0), (64, 128, 4, 8)],
}
# The plain order won every d = 128 / 256 row (docs/gluon.md, "The backward's dK/dV kernel"); the other
# d = 128 candidates are plain-order variants with one CTA per SM: (64, 128, 2, 8) two warpgroups on 128
# keys sharing the Q / dO ring, (128, 64, 2, 8, 2) two warpgroups side by side on 128-row steps.
# The fused dQ build (plain order only; the table's first). ptxas -v, causal: d = 64 (64, 64, 2, 4) 211 registers,
# 82 KB (two CTAs an SM), (64, 128, 2, 8) 208, 115 KB, (128, 64, 2, 8, 2) 186, 147 KB; d = 128 (32, 64, 2, 4) 229
# registers, 90 KB (two CTAs an SM); (32, 128, 2, 8) 255 registers, 12 bytes of spill, 131 KB (one CTA, half the
# reduce-adds a key); (32, 64, 3, 4) 16 bytes of spill, 106 KB. d = 256 (32, 64, 2, 8, 2) 214 registers, 172 KB.
FUSED_CANDIDATES = {
    64: [(64, 64, 2, 4, 1, 0), (64, 128, 2, 8, 1, 0), (128, 64, 2, 8, 2, 0)],
    128: [(32, 64, 2, 4, 1, 0), (32, 128, 2, 8, 1, 0), (32, 64, 3, 4, 1, 0)],
    192: [(64, 64, 2, 8, 2, 0), (32, 64, 2, 8, 2, 0)],
    256: [(32, 64, 2, 8, 2, 0)],
}
KEYS = ("BLOCK_M", "BLOCK_N", "NUM_BUFFERS", "num_warps", "WARPS_N", "ROTATED")


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bwd_ms(out, inputs, g, gluon: bool) -> float:
    with config.override(gluon_bwd=gluon):
        return _ms(lambda: torch.autograd.grad(out, inputs, g, retain_graph=True))


# a candidate's missing trailing numbers take the kernel's defaults, not the table's (the table's
# ROTATED = 0 would otherwise turn a rotated candidate into the plain order)
KERNEL_DEFAULTS = {"WARPS_N": 1, "ROTATED": 1}


def _sweep(candidates, launch, ref, flops, key, outputs):
    """Time launch(tiles) -> output for each candidate; compare with ref (None: the first's output).
    outputs are NaN-filled before each candidate's checked launch, so a config that skips rows
    cannot pass on the previous candidate's values."""
    entries = []
    for cfg in candidates:
        tiles = dict(zip(KEYS, cfg))
        tiles.update({k: KERNEL_DEFAULTS[k] for k in KEYS[len(cfg):]})
        entry = dict(tiles)  # the config and what was measured of it
        try:
            for x in outputs:
                x.fill_(float("nan"))
            got = launch(tiles)
            torch.cuda.synchronize()
            if ref is None:
                ref = tuple(x.clone() for x in got)
            entry["max_rel_diff"] = max(((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
                                        for a, r in zip(got, ref))
            if not all(torch.isfinite(x).all() for x in got):
                entry["max_rel_diff"] = float("nan")  # rows left unwritten: a broken config
            entry[f"{key}_ms"] = _ms(lambda tiles=tiles: launch(tiles))
            entry[f"{key}_tflops"] = flops / entry[f"{key}_ms"] / 1e9
        except Exception as exc:  # record and go on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        entries.append(entry)
    return entries


def row_of(d, s, causal, fused=False):
    b, h = max(1, 16384 // s), 2048 // d
    torch.manual_seed(0)
    # v's head dim as the kernel takes it (192 -> 128, DeepSeek-V3's split)
    q, k, v = (torch.randn(b, s, h, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (d, d, gluon_bwd.V_HEAD_DIM[d]))
    g = torch.randn(b, s, h, v.shape[-1], device="cuda", dtype=torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    scale = d ** -0.5
    delta = (g.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (b, h, s)
    lse = lse.contiguous()
    row = dict(d=d, s=s, b=b, h=h, causal=causal)
    row["triton_bwd_ms"] = _bwd_ms(out, (q, k, v), g, False)
    row["gluon_bwd_ms"] = _bwd_ms(out, (q, k, v), g, True)
    dv_dim = v.shape[-1]
    gemm = 2 * b * h * s * s * d / (2 if causal else 1)  # one q / k-wide product
    # the split kernel's 4 products (S^T, dK over q / k's head dim; dP^T, dV over v's), the fused build's dQ too
    kernel_flops = gemm * ((3 * d + 2 * dv_dim) if fused else (2 * d + 2 * dv_dim)) / d
    qd, kd, vd, gd = (x.detach() for x in (q, k, v, g))
    dk, dv = torch.empty_like(kd), torch.empty_like(vd)

    dq_accum = torch.zeros(qd.shape, device="cuda") if fused else None

    def dkdv(tiles):
        if fused:
            dq_accum.zero_()
        gluon_bwd.gluon_attn_bwd_dkdv(qd, kd, vd, gd, lse, delta, dk, dv, scale, causal, config=tiles,
                                      dq_accum=dq_accum)
        return (dk, dv, dq_accum) if fused else (dk, dv)

    outputs = (dk, dv, dq_accum) if fused else (dk, dv)
    row["configs"] = _sweep((FUSED_CANDIDATES if fused else CANDIDATES)[d], dkdv, None, kernel_flops, "dkdv",
                            outputs)
    first = row["configs"][0]
    if "dkdv_ms" in first and not fused:  # the fused kernel has no dQ kernel after it to isolate
        row["rest_ms"] = row["gluon_bwd_ms"] - first["dkdv_ms"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_gluon_bwd.json")
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--fused", action="store_true", help="the fused dQ build's configs (FUSED_CANDIDATES)")
    args = ap.parse_args()
    table, candidates = (BWD_FUSED_CONFIGS, FUSED_CANDIDATES) if args.fused else (BWD_DKDV_CONFIGS, CANDIDATES)
    for d in args.d:  # the default configs must be the first candidates: rest_ms is measured on them
        assert dict(zip(KEYS, candidates[d][0])) == table[d], d
    rows = []
    for d in args.d:
        for s in args.seqlens:
            for causal in (False, True):
                row = row_of(d, s, causal, args.fused)
                rows.append(row)
                best = min((c for c in row["configs"] if "dkdv_ms" in c), key=lambda c: c["dkdv_ms"], default=None)
                print(json.dumps({key: row[key] for key in row if key != "configs"} | {"best": best}), flush=True)
                torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command="scripts/tune_gluon_bwd.py",
                candidates=candidates)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
