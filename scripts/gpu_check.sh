#!/usr/bin/env bash
# The GPU suite and the benchmarks, on a Hopper machine with torch and triton installed (no network needed).
#
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [STEP ...]      (default: tests grid sanitize)
# Steps:
#   tests      every gpu-marked test (tests/test_gpu_*.py) but the grid; pytest-xdist workers by GPU memory
#   grid       the FlashAttention-style grid (tests/test_gpu_fa_grid.py): padded / varlen / kvcache x head dims x
#              uneven lengths x features, forward and backward; a failure is logged as it happens
#   sanitize   compute-sanitizer memcheck over one call down every kernel route (scripts/sanitize_routes.py);
#              fails unless the sanitizer reports zero errors
#   bench-fwd  bench-bwd  bench-decode  bench-fp8   the README's tables (python -m flashtile.bench ...)
#   bench-models  bench-mla  bench-flex             docs/models.md's rows (dv / sink / chunk), MLA decode,
#                                                   docs/programmable.md's table (bench-flex-graph: its kernels
#                                                   alone, CUDA-graph replays)
#   bench-train                                     GQA 32/8 and packed documents in a training step (the
#                                                   training bars' own-MHA and SDPA rows)
#   ab-mla                                          MLA decode on the Triton kernel (FLASHTILE_GLUON=0), beside
#                                                   bench-mla's Gluon one
#   flex-dkdv  ab-flex-dkdv  ab-flex-fused          the Gluon flex dK/dV kernel (config.gluon_flex_bwd, not yet a
#                                                   default route) and its fused dQ build: their GPU tests, the
#                                                   kernel's A/B against Triton's, the fused build's against it
#   fused-dq  ab-fused-dq  tune-fused-dq            the Gluon dK/dV kernel's fused dQ build (config.gluon_fused_dq,
#                                                   not yet a default route): its GPU tests, its A/B against the
#                                                   split backward (cuDNN beside them), its configs' sweep
#   profile-host                                    a short training step's host time against SDPA's, and a
#                                                   profile of flashtile's Python by function
#   tune-gluon-mla                                  the Gluon MLA kernel's configs against the Triton MLA kernel
#   tune-fwd   tune-bwd   tune-decode               the config sweeps (scripts/tune_*.py)
#   tune-gluon tune-gluon2  tune-flex              the Gluon forward's candidates (d 64 / 128, d 192 / 256),
#                                                   the flex kernels' tiles
# Results and logs go under $OUT (default: a fresh temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
status=0

# xdist workers: each holds its own CUDA context and caching allocator, so fewer on 80 GB cards
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
workers=$(( ${gpu_mib:-0} > 100000 ? 8 : 4 ))

step() {
  local name=$1
  shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.txt" | tail -25
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

run_step() {
  case "$1" in
    tests) step tests python -m pytest -q -n "$workers" -m gpu -p no:cacheprovider -W ignore \
             --ignore=tests/test_gpu_fa_grid.py tests ;;
    grid) FA_GRID_LOG="$OUT/grid_failures.txt" step grid python -m pytest -q -n 14 -m gpu -p no:cacheprovider \
            -W ignore --tb=line -rf tests/test_gpu_fa_grid.py ;;
    sanitize) step sanitize compute-sanitizer --tool memcheck --error-exitcode 9 --show-backtrace no \
                python scripts/sanitize_routes.py ;;
    bench-fwd) step bench-fwd python -m flashtile.bench fwd --out "$OUT/fwd.json" --plot "$OUT/fwd.png" ;;
    bench-bwd) step bench-bwd python -m flashtile.bench bwd --peers flash cudnn --out "$OUT/bwd.json" ;;
    bench-decode) step bench-decode python -m flashtile.bench decode --cuda-graph --layers 8 --rounds 3 \
                    --batch 1 8 32 --out "$OUT/decode.json" ;;
    bench-fp8) step bench-fp8 python -m flashtile.bench fwd --dtype fp8 --d 64 128 256 --seqlens 1024 4096 16384 \
                 --peers cudnn --out "$OUT/fp8.json" ;;
    bench-models) step bench-models python -m flashtile.bench models --rounds 3 --out "$OUT/models.json" \
                    --plot "$OUT/models.png" ;;
    bench-mla) step bench-mla python -m flashtile.bench decode --mla --cuda-graph --layers 8 --out "$OUT/mla.json" ;;
    ab-mla) step ab-mla env FLASHTILE_GLUON=0 python -m flashtile.bench decode --mla --cuda-graph --layers 8 \
              --out "$OUT/mla-triton.json" ;;
    bench-train) step bench-train python -m flashtile.bench train --cuda-graph --out "$OUT/train.json" ;;
    bench-flex) step bench-flex python -m flashtile.bench flex --rounds 3 --out "$OUT/flex.json" --plot "$OUT/flex.png" ;;
    bench-flex-graph) step bench-flex-graph python -m flashtile.bench flex --rounds 3 --cuda-graph \
                        --out "$OUT/flex_graph.json" ;;
    flex-dkdv) step flex-dkdv timeout 300 python -m pytest -q -n 4 -m gpu -p no:cacheprovider -W ignore \
                 tests/test_gpu_gluon_flex.py -k "dkdv or fused" ;;
    ab-flex-dkdv) step ab-flex-dkdv timeout 300 python scripts/ab_flex.py --setting gluon_flex_bwd \
                    --seqlens 4096 16384 --out "$OUT/ab_flex_dkdv.json" ;;
    ab-flex-fused) step ab-flex-fused timeout 300 python scripts/ab_flex.py --setting gluon_fused_dq \
                     --seqlens 4096 16384 --out "$OUT/ab_flex_fused.json" ;;
    fused-dq) step fused-dq timeout 560 python -m pytest -q -n 6 -m gpu -p no:cacheprovider -W ignore --maxfail=10 \
                tests/test_gpu_gluon_fused_dq.py "tests/test_gpu_bwd.py::test_peak_memory_within_1_1x_of_sdpa_flash" ;;
    tune-fused-dq) step tune-fused-dq timeout 400 python scripts/tune_gluon_bwd.py --fused --d 128 64 256 192 \
                     --seqlens 2048 16384 --out "$OUT/tune_fused_dq.json" ;;
    ab-fused-dq) step ab-fused-dq timeout 560 python scripts/ab_fused_dq.py --d 128 64 256 192 \
                   --out "$OUT/ab_fused_dq.json" ;;
    profile-host) step profile-host python scripts/profile_host.py --out "$OUT/host.json" ;;
    tune-fwd) step tune-fwd python scripts/tune_fwd.py --out "$OUT/tune_fwd.json" ;;
    tune-bwd) step tune-bwd python scripts/tune_bwd.py --out "$OUT/tune_bwd.json" ;;
    tune-decode) step tune-decode python scripts/tune_decode.py --out "$OUT/tune_decode.json" ;;
    # two halves, each within one device call (10 minutes): every candidate compiles before it is timed
    tune-gluon) step tune-gluon timeout 560 python scripts/tune_gluon.py --dtypes 16bit --d 64 128 \
                  --out "$OUT/tune_gluon.json" ;;
    tune-gluon2) step tune-gluon2 timeout 560 python scripts/tune_gluon.py --dtypes 16bit --d 192 256 \
                  --out "$OUT/tune_gluon2.json" ;;
    tune-gluon-mla) step tune-gluon-mla python scripts/tune_gluon_mla.py --out "$OUT/tune_gluon_mla.json" ;;
    tune-flex) step tune-flex python scripts/tune_flex.py --out "$OUT/tune_flex.json" ;;
    *) echo "unknown step: $1 (see the header of $0)"; exit 2 ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
for s in "${@:-tests grid sanitize}"; do
  for one in $s; do run_step "$one"; done
done
exit $status
