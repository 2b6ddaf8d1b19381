#!/usr/bin/env bash
# GPU suite + benchmarks on the H200 (torch/triton preinstalled, no network).
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [tests|tune|bench|all]   (default: all)
# Writes logs and JSON under $OUT (default ./out) and prints a short summary table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
what=${1:-all}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" \
  | tee "$OUT/env.txt"
status=0
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -m gpu --maxfail=10 --durations=15 -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -n 25
  status=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == tune ]]; then
  python3 scripts/tune_fwd.py ${TUNE_ARGS:-} --out "$OUT/tune_fwd.json" 2> "$OUT/tune_fwd.log"
fi
if [[ $what == all || $what == bench ]]; then
  python3 -m flashtile.bench fwd --ceilings --out "$OUT/fwd.json" --plot "$OUT/fwd.png" 2> "$OUT/bench_fwd.log" \
    | tee "$OUT/bench_fwd.txt"
  python3 scripts/bench_fwd_extras.py --out "$OUT/fwd_extras.json" 2>> "$OUT/bench_fwd.log" | tee -a "$OUT/bench_fwd.txt"
fi
echo "== gpu_check: tests exit status $status; files in $OUT =="
ls "$OUT"
exit $status
