"""How many clusters of the Gluon warps-along-keys decode kernel fit on this GPU at once (session 22's lockstep
experiment, FLASHTILE_DECODE_CLUSTER=C): a grid of b x h_k programs runs in one wave only if
cuOccupancyMaxActiveClusters(C) x C >= b x h_k. Compiles the kernel through one b = 32, 8k call per cluster size
and prints / writes {C: clusters, programs} as JSON (FLASHTILE_DECODE_GLUON_MAXNREG applies, as in the calls).
    PYTHONPATH=src python scripts/probe_cluster_occupancy.py [--out PATH.json]"""

import argparse
import json

import torch
import triton

from flashtile import env, flash_attn_with_kvcache
from flashtile.kernels.gluon_decode_warp_keys import _gluon_decode_warp_keys_kernel as kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    b, h, h_k, d, cap = 32, 32, 8, 128, 8192
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, cap, h_k, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((b,), cap, device="cuda", dtype=torch.int32)
    utils = triton.runtime.driver.active.utils
    got = {"gpu": torch.cuda.get_device_name(), "maxnreg": env.get("FLASHTILE_DECODE_GLUON_MAXNREG"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "programs": b * h_k, "clusters": {}}
    for c in (1, 2, 4, 8):
        with env.overrides({"FLASHTILE_DECODE_GLUON_WARP_KEYS": "1", "FLASHTILE_DECODE_CLUSTER": str(c)}):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        torch.cuda.synchronize()
        compiled = [k for cache in kernel.device_caches.values() for k in cache[0].values()
                    if k.packed_metadata[1] == c]
        n = utils.cuOccupancyMaxActiveClusters(compiled[-1].function, compiled[-1].metadata.shared, c)
        got["clusters"][c] = {"max_active_clusters": n, "programs_at_once": n * c}
        print(f"cluster {c}: {n} clusters at once = {n * c} programs (grid {b * h_k})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
