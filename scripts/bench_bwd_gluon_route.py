"""``python -m flashtile.bench ARGS`` with the Gluon dK/dV kernel routed in, for its peer ratios.

Usage: PYTHONPATH=src python scripts/bench_bwd_gluon_route.py bwd --d 128 --peers flash flex --out x.json

Runs the benchmark command line unchanged, with the route forced on (``OVERRIDE``) and
``GPU_VERIFIED`` set (gpu_check runs this only after tests/test_gpu_gluon_bwd.py passed). It counts
the Gluon kernel's launches and fails if none happened, so a refused route cannot pass Triton's
numbers off as Gluon's. With FLASHTILE_GLUON_BWD_DQ=1 in the environment the Gluon dQ kernel is
routed in too (and counted alike).
"""

import json
import os
import sys

from flashtile.backends.triton import gluon_bwd
from flashtile.bench.cli import main

if __name__ == "__main__":
    os.environ["FLASHTILE_GLUON_BWD"] = "1"  # recorded in the results' meta, beside the command
    gluon_bwd.GPU_VERIFIED = True
    gluon_bwd.OVERRIDE = True
    launches = []
    real = gluon_bwd.gluon_attn_bwd_dkdv

    def counted(*args, **kwargs):
        launches.append(1)
        return real(*args, **kwargs)

    gluon_bwd.gluon_attn_bwd_dkdv = counted
    with_dq = os.environ.get("FLASHTILE_GLUON_BWD_DQ", "0") != "0"
    dq_launches = []
    if with_dq:
        gluon_bwd.DQ_GPU_VERIFIED = True
        gluon_bwd.DQ_OVERRIDE = True
        real_dq = gluon_bwd.gluon_attn_bwd_dq

        def counted_dq(*args, **kwargs):
            dq_launches.append(1)
            return real_dq(*args, **kwargs)

        gluon_bwd.gluon_attn_bwd_dq = counted_dq
    rc = main(sys.argv[1:])
    print(f"Gluon dK/dV launches: {len(launches)}; Gluon dQ launches: {len(dq_launches)}", flush=True)
    if not launches or (with_dq and not dq_launches):
        print("error: a Gluon kernel never ran; these are not its numbers", file=sys.stderr)
        rc = rc or 1
    path = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")), None)
    if "--out" in sys.argv[:-1]:
        path = sys.argv[sys.argv.index("--out") + 1]
    if path:  # say in the results which command really produced them
        with open(path) as f:
            results = json.load(f)
        results["meta"]["wrapper"] = (f"scripts/bench_bwd_gluon_route.py (Gluon dK/dV launches: {len(launches)}, "
                                      f"Gluon dQ launches: {len(dq_launches)})")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    raise SystemExit(rc)
