"""Time the Gluon MLA decode kernel's candidate configs against the Triton MLA kernel on the GPU.

Usage: PYTHONPATH=src python scripts/tune_gluon_mla.py --out $OUT/tune_gluon_mla.json [--batch 32 64]

One decode step of DeepSeek's shape (h = 128 on one latent head, d 64 / dv 512, bf16, one query token, a
contiguous cache and 64-token pages in random order), each candidate (BLOCK_N, NUM_BUFFERS) and the Triton
kernel (FLASHTILE_GLUON off) as CUDA-graph replays, alternated in rounds; every candidate's output is checked
against the Triton kernel's. The winner goes into GLUON_MLA_CONFIGS (kernels/gluon_decode_mla.py) by hand, the
JSON cited; a Gluon route slower than the Triton kernel is removed, not kept behind a switch.
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch

from flashtile import config, flash_attn_with_kvcache
from flashtile.bench.report import collect_meta
from flashtile.bench.timing import bench_graph, time_in_rounds
from flashtile.kernels import gluon_decode_mla

# (BLOCK_N, NUM_BUFFERS): both fit sm_90's shared memory (tests/test_gluon_mla_compile.py compiles the table's)
CANDIDATES = [(32, 3), (64, 2), (32, 2)]
H, D, DV = 128, 64, 512


def _case(b, sk, page):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + sk)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qv = torch.randn(b, 1, H, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    if page is None:
        kc = torch.randn(b, sk, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, sk, 1, DV, device="cuda", dtype=torch.bfloat16, generator=g)
        return dict(q=q, k_cache=kc, v_cache=vc, qv=qv, cache_seqlens=lens)
    n = sk // page
    kc = torch.randn(b * n, page, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b * n, page, 1, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(b * n, device="cuda", generator=g).view(b, n).to(torch.int32)
    return dict(q=q, k_cache=kc, v_cache=vc, qv=qv, cache_seqlens=lens, block_table=table)


@contextlib.contextmanager
def _only(bn, nb):
    """The Gluon MLA route with one candidate as its only config."""
    saved = gluon_decode_mla.GLUON_MLA_CONFIGS
    gluon_decode_mla.GLUON_MLA_CONFIGS = (dict(BLOCK_N=bn, NUM_BUFFERS=nb, num_warps=8),)
    try:
        yield
    finally:
        gluon_decode_mla.GLUON_MLA_CONFIGS = saved


def _timer(case, cand):
    def run():
        if cand is None:
            with config.override(gluon=False):
                return bench_graph(lambda: flash_attn_with_kvcache(**case), "cuda")
        with _only(*cand):
            return bench_graph(lambda: flash_attn_with_kvcache(**case), "cuda")
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--pages", type=int, nargs="*", default=[64])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    meta = collect_meta(sys.argv[1:], "cuda", program=f"python {sys.argv[0]}")
    rows = []
    for b in args.batch:
        for sk in args.seqlens:
            for page in [None, *args.pages]:
                case = _case(b, sk, page)
                with config.override(gluon=False):
                    want = flash_attn_with_kvcache(**case).float()
                errs = {}
                for cand in CANDIDATES:
                    bn, nb = cand
                    with _only(bn, nb):
                        errs[f"{bn}x{nb}"] = (flash_attn_with_kvcache(**case).float() - want).abs().max().item()
                timers = [("triton", _timer(case, None))] + [(f"{bn}x{nb}", _timer(case, (bn, nb)))
                                                             for bn, nb in CANDIDATES]
                results, failed = time_in_rounds(timers, args.rounds)
                us = {name: statistics.median(r) * 1e3 for name, r in results.items() if r}
                row = dict(b=b, seqlen_k=sk, page=page, us=us, max_diff=errs,
                           errors={n: repr(e)[:200] for n, e in failed.items()})
                rows.append(row)
                print(f"b={b} sk={sk} page={page}: " + "  ".join(f"{n} {t:.1f} us" for n, t in us.items())
                      + f"  |diff| {max(errs.values()):.1e} {row['errors'] or ''}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
