"""Sweep the flex kernels' tile configs on the GPU; print and save every timing and each kernel's winner.

Usage: PYTHONPATH=src python scripts/tune_flex.py --out $OUT/tune_flex.json [--variants causal document softcap]

Shape: bench flex's (hidden 2048, 16384 tokens, d = 128, bf16, 128-token mask blocks). The forward candidates are
timed on the forward alone; the backward is greedy, as scripts/tune_bwd.py: dK/dV candidates with the current dQ
config, then dQ candidates with the best dK/dV one (the two kernels run one after the other and share nothing).
Time: median of triton.testing.do_bench per candidate, summed over the variants, so a winner must hold across
mask-only and score_mod variants. Every candidate's output is checked against the current config's first.
Winners go into FLEX_FWD_CONFIGS / FLEX_BWD_CONFIGS (kernels/flex_fwd.py, flex_bwd.py) by hand, the JSON cited.
"""

import argparse
import json
import sys
import time

import torch
import triton

from flashtile import config
from flashtile.bench.flex import HIDDEN, TOKENS, build_variant
from flashtile.flex import create_block_mask, flex_attention
from flashtile.kernels.flex_bwd import flex_bwd_configs
from flashtile.kernels.flex_fwd import flex_fwd_config

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the table's entry is prepended at run time
FWD = [(128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]
# dK/dV programs own BLOCK_N keys and stream BLOCK_M queries; dQ programs own BLOCK_M queries
DKDV = [(64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2),
        (32, 128, 4, 2)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]


def _case(name, s, d):
    h, b = HIDDEN // d, max(1, TOKENS // s)
    score_mod, mask_mod = build_variant(name, b, h, s, "cuda")
    mask = create_block_mask(mask_mod, b if name == "document" else None, None, s, s, device="cuda")
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return dict(q=q, k=k, v=v, g=torch.randn_like(q), score_mod=score_mod, mask=mask)


def _time(case, mode, pin):
    q, k, v = case["q"], case["k"], case["v"]

    def fwd():
        return flex_attention(q, k, v, score_mod=case["score_mod"], block_mask=case["mask"])
    with config.override(**pin):
        out = fwd()
        if mode == "fwd":
            ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            return ms, out.detach()
        grads = torch.autograd.grad(out, (q, k, v), case["g"], retain_graph=True)
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), case["g"], retain_graph=True),
                                     warmup=25, rep=100, return_mode="median")
        return ms, torch.cat([x.detach().flatten() for x in grads])


def _sweep(cases, mode, pins, log):
    """Total ms over the cases per pin (inf where a pin fails or disagrees with the first)."""
    totals, ref = [], {}
    for i, pin in enumerate(pins):
        total = 0.0
        for name, case in cases.items():
            try:
                ms, res = _time(case, mode, pin)
            except Exception as e:  # a config that does not fit is recorded, not fatal
                log.append(dict(mode=mode, pin=repr(pin), variant=name, error=f"{type(e).__name__}: {e}"[:200]))
                total = float("inf")
                break
            if i == 0:
                ref[name] = res
            elif (res.float() - ref[name].float()).abs().max().item() > 0.05 * ref[name].float().abs().max().item():
                log.append(dict(mode=mode, pin=repr(pin), variant=name, error="disagrees with the table config"))
                total = float("inf")
                break
            log.append(dict(mode=mode, pin=repr(pin), variant=name, ms=ms))
            total += ms
        totals.append(total)
        print(f"{mode} {pin}: {total:.3f} ms", file=sys.stderr, flush=True)
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tune_flex.json")
    ap.add_argument("--variants", nargs="+", default=["causal", "document", "softcap"])
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    t0 = time.time()
    cases = {name: _case(name, args.s, args.d) for name in args.variants}
    log = []
    fwd_cur = tuple(flex_fwd_config("sm90", args.d))
    fwd_pins = [dict(fwd_tiles=c) for c in [fwd_cur] + [c for c in FWD if c != fwd_cur]]
    fwd_tot = _sweep(cases, "fwd", fwd_pins, log)
    kv_cur, q_cur = (tuple(c) for c in flex_bwd_configs("sm90", args.d))
    kv_pins = [dict(bwd_tiles=(c, q_cur)) for c in [kv_cur] + [c for c in DKDV if c != kv_cur]]
    kv_tot = _sweep(cases, "bwd", kv_pins, log)
    best_kv = kv_pins[min(range(len(kv_pins)), key=kv_tot.__getitem__)]["bwd_tiles"][0]
    q_pins = [dict(bwd_tiles=(best_kv, c)) for c in [q_cur] + [c for c in DQ if c != q_cur]]
    q_tot = _sweep(cases, "bwd", q_pins, log)
    best = dict(fwd=fwd_pins[min(range(len(fwd_pins)), key=fwd_tot.__getitem__)]["fwd_tiles"],
                bwd=q_pins[min(range(len(q_pins)), key=q_tot.__getitem__)]["bwd_tiles"],
                fwd_ms=dict(table=fwd_tot[0], best=min(fwd_tot)), bwd_ms=dict(table=kv_tot[0], best=min(q_tot)))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), s=args.s, d=args.d,
                variants=args.variants, seconds=round(time.time() - t0, 1))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, best=best, log=log), f, indent=1)
    print(json.dumps(best))


if __name__ == "__main__":
    main()
