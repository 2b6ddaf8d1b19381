#!/usr/bin/env bash
# GPU suite + benchmarks on the H200 (torch/triton preinstalled, no network).
#
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [STEP ...]     (default: tests bench)
# Steps:
#   tests         every gpu-marked test (tests/test_gpu_*.py); over 300 tests, likely more than one
#                 10-minute device call: tests-fwd, tests-bwd, tests-kv, tests-rest split them;
#                 tests-route: the Gluon route's tests and the forward's; tests-fp8: the route's and fp8's
#   tune          forward config sweep (scripts/tune_fwd.py)      tune-bwd   backward sweep (scripts/tune_bwd.py)
#   bench         forward benchmark + sliding-window/varlen extras
#   bench-graph   forward benchmark timed as CUDA-graph replays (kernel time without host overhead)
#   bench-bwd     backward and fwd+bwd benchmarks                   bench-decode   decode benchmark
#   bench-fp8     fp8 forward beside flashtile bf16 and cuDNN bf16
#   bench-bwd-short  backward at s=512/1024, default timing and CUDA-graph replays
#   bench-heavy-first  causal Triton fwd (d=64/256) and bwd (d=128/256) with FLASHTILE_HEAVY_FIRST=0 then 1
#   bench-bwd-s1024-route  d=128/256 s=1024 backward with the Gluon dK/dV route forced on and off, eager and graphs
#                 (ROUTE_SEQLENS, e.g. "512", times other lengths; ROUTE_MODES=eager: no graphs)
#   host-ab-cache  the launch cache on and off, alternated in one process (AB_ROUNDS rounds)
#   host-trace    inclusive host time per flashtile function of an eager call (scripts/host_trace.py)
#   host-breakdown  host time per piece of an eager call (scripts/host_breakdown.py), then with FLASHTILE_FAST_LAUNCH=0
#   tests-bwd-pdl  the backward with programmatic dependent launch of its dQ kernel (FLASHTILE_BWD_PDL), against ordinary launches
#   bench-decode-b1-layers  bench-decode-layers' b = 1 rows alone
#   probe-decode-layout  decode on a sequence-major vs head-major cache, flashtile and SDPA cuDNN (graph replays)
#   probe-read-ceiling  b = 32 read-only kernels (flat and per-head) beside flashtile's decode kernels and cuDNN, with an
#                 nvidia-smi clock / power log (scripts/probe_read_ceiling.py; CEILING_SEQLENS, default "8192 16384 65536 131072")
#   probe-streamk  the split and stream-K whole-row kernels on one board (scripts/probe_streamk.py): timings beside the
#                 flat reads on 128 / 132 programs and cuDNN, then both kernels' per-program stamps (b = 32 / 64)
#   probe-sm-balance  a plain read split evenly against split by each SM's measured speed (%smid-indexed ranges), with
#                 the per-SM times of 132- and 128-program reads (scripts/probe_sm_balance.py; BALANCE_GIB, default "8 2 1")
#   probe-paged-rows  paged caches (16 / 256-token pages) on the whole-row kernel against the per-head paged kernel and
#                 the contiguous cache, in 8-layer graphs (scripts/probe_paged_rows.py)
#   probe-decode-stamps  per-program %globaltimer stamps of the Gluon decode kernel and the per-head read (--stamps)
#   probe-bwd-modes  the causal s=1024 backward fresh, after heavy rows, PDL off/on, split into kernels
#   bench-bwd-pdl  the backward with FLASHTILE_BWD_PDL=0 then 1, alternated twice (d = 64 / 128 / 256, s = 1024-16384)
#   tests-decode-gluon-warp-keys / bench-decode-gluon-warp-keys  the Gluon decode kernel with cuDNN's warp shape
#                 (FLASHTILE_DECODE_GLUON_WARP_KEYS=1; unset: the rule) against the reference, then beside the Triton
#                 kernel and cuDNN at b = 32
#   bench-decode-gluon-rule  the same A/B on the other grids the rule covers: b = 16 (16k / 64k), b = 32 / 64 at 32k
#   bench-decode-gluon-append  the same A/B with a serving step's append (--new-tokens 1), b = 32, 16k
#   tests-decode-gluon-rows / bench-decode-gluon-rows  the whole-row Gluon decode kernel (FLASHTILE_DECODE_GLUON_ROWS)
#   bench-decode-gluon-rows-tma  its TMA-copy variant (FLASHTILE_DECODE_GLUON_ROWS_TMA=1) with rings 3,3 and 2,1
#                 and the 16-byte-copy variant, beside the default (after tests-decode-gluon-rows)
#   bench-decode-head-major  b = 32 on a head-major cache view beside the usual layout and cuDNN (is the gap layout?)
#   tests-decode-rows / bench-decode-rows  the row-stream decode experiment (programs of adjacent kv heads)
#   bench-decode-fused-append  the Triton kernel's in-kernel append against the separate append kernel, b = 1 / 8
#   bench-decode-layers-append  the 8-layer table with one appended key a call (--new-tokens 1), beside cuDNN
#   bench-decode-pdl-append  serving steps (--new-tokens 1) at b = 1-8, 32k-128k: the PDL rule, the decode and append
#                 kernels forced on, the decode kernels alone forced on; then b = 1-4 without an append, rule / forced
#                 (each alternated twice; session 28)
#   bench-decode-rows-nomerge  b = 32 at 64k / 128k: the rule's 8 heads a program with 4 splits and a merge against
#                 2 heads a program unsplit (no merge; 512-byte pieces) and 4 heads with 2 splits, twice (session 28)
#   bench-decode-rows4  b = 32 at 64k / 128k and b = 64 at 8k / 16k: the rule's 8 heads a program against 4 heads
#                 on 32-key tiles (one program an SM: 2 splits at b = 32, none at b = 64) at 4 and 8 warps, twice
#                 (session 28)
#   bench-decode-rows4-rule  b = 32 at 64k / 128k beside cuDNN: the rule (4 heads a program since session 28) against
#                 FLASHTILE_DECODE_ROWS=8 (the rule before), twice
#   bench-decode-rows4-small  b = 8 / 16 / 32 at 8k / 32k / 128k beside cuDNN: the default against the half-row
#                 kernel everywhere (FLASHTILE_DECODE_ROWS=4: 32-key tiles, one program an SM; 8 / 4 / 2 splits), twice
#                 (queued in session 28, not yet run; b = 32 at 128k is the rule's already)
#   tests-decode-board  the board class's measurement and the full-grid rule's routes against the reference
#   probe-board-ratio  the board class's P128 / P132 measurement repeated at 256 and 1024 MiB (its steadiness)
#   bench-decode-board  b = 1, 2, 8, 16, 32 at 32k-128k beside cuDNN with FLASHTILE_DECODE_BOARD=normal / full-grid
#                 (each board class's rule forced), twice
#   bench-decode-rows-b16  b = 16 at 64k / 128k beside cuDNN: the rule (half rows from 128k since session 29) against
#                 the per-head kernel (FLASHTILE_DECODE_ROWS=0), twice
#   probe-append-pdl-idle  b = 32, 64k serving steps (one appended key a call) with the split row kernel's stamps:
#                 the append launched ordinarily (the rule there) against as a programmatic dependent
#                 (FLASHTILE_DECODE_APPEND_PDL=1: 0.7%-1.2% slower, F27): which SMs sit idle? (queued in session 28)
#   bench-decode-pdl-append-rule  serving steps at b = 1 / 2, 64k-256k, contiguous and paged: the rule (session 28's,
#                 PDL for appends on at most 16 row-kv-head pairs) against FLASHTILE_DECODE_PDL=0, twice
#                 (probe-decode-ncu's ft_b32_8k_append_triton / _gluon cases profile the two kernels' appends)
#   (the A/Bs of Triton-kernel settings below pin FLASHTILE_DECODE_GLUON_WARP_KEYS=0, so that both arms run it)
#   bench-decode-long-warps  long decode programs at 8 warps (the rule) against the table's 4, alternated twice
#   tests-decode-tma  the decode kernel's descriptor loads (FLASHTILE_DECODE_TMA) against the reference and pointer loads
#   bench-decode-tma  the 8-layer decode table (contiguous, beside cuDNN) with FLASHTILE_DECODE_TMA=0 1 0 1, after tests-decode-tma
#   bench-decode-tma-small  FLASHTILE_DECODE_TMA=0 1 alternated three times on b = 1 / 8 / 32 at 8k-64k, after tests-decode-tma
#   bench-decode-tma-paged  256-token pages with FLASHTILE_DECODE_TMA=0 1 0 1 (b = 1 / 8, 8k-64k), after tests-decode-tma
#   bench-decode-tma-eager  eager (host-bound) decode calls with FLASHTILE_DECODE_TMA=0 1 0 1, after tests-decode-tma
#   tests-decode-page-gather  the by-page gather for small pages (the default; FLASHTILE_DECODE_PAGE_GATHER) on the GPU
#   bench-decode-page-gather  16-token pages with FLASHTILE_DECODE_PAGE_GATHER=0 1 0 1 (b = 1), 0 1 (b = 8 / 32 at 8k)
#   tune-decode-occupancy  b = 32 at 8k / 128k: (128, 4|8, 3) against 2-stage configs that fit 2-3 CTAs per SM
#   bench-decode-b1-splits  b = 1 at 8k / 16k in 8-layer graphs with 0 (heuristic) / 12 / 20 / 24 / 0 splits
#   probe-decode-ncu  Nsight Compute on b = 1 / 32, 8k and b = 8, 64k decode kernels (flashtile, SDPA cuDNN; NCU_CASES,
#                 NCU_SECTIONS; NCU_SOURCE=1 keeps the report and a per-instruction SASS table)
#   bench-decode-b32-stages  b = 32 beside cuDNN: FLASHTILE_DECODE_STAGES=3 (the table's), =2 (the default there), and 2 with PDL, twice
#   bench-decode-b1-occupancy  b = 1: the table's stages and split heuristic against FLASHTILE_DECODE_STAGES=2 with the
#                 heuristic (16 splits at 8k / 16k), 32 and 24 splits
#   bench-decode-p16-stages  b = 1, 16-token pages at paged depths 5 / 4 (FLASHTILE_DECODE_STAGES=3 / 2), twice
#   bench-decode-b32-tiles  b = 32 at 8k / 64k: the table's 128-key tiles at 2 stages against 64-key tiles at 4 / 3 stages
#                 (cuDNN's b = 32 program holds 86 KB, ours 74 KB; 64 keys: 104 / 72 KB), twice
#   bench-decode-edges  masked edge loops unpipelined (default) against pipelined (FLASHTILE_DECODE_PIPELINE_EDGES=1),
#                 b = 1 / 8 / 32 with 16- and 256-token pages beside cuDNN, 1 0 1 0 (after tests-kv)
#   tests-fwd-edges  the forward's GPU tests with FLASHTILE_FWD_PIPELINE_EDGES=0 (every edge range loaded directly)
#   bench-fwd-edges  the Triton forward at s = 512-4096 with pipelined (1) / direct (0) edge ranges, 1 0 1 0
#   tests-bwd-edges  the Triton backward's GPU tests with FLASHTILE_BWD_PIPELINE_EDGES=0 (masked ranges loaded directly)
#   bench-bwd-edges  the backward at s = 512-2048, d = 64 / 128, pipelined (1) / direct (0) edge ranges, 1 0 1 0
#   bench-decode-b1-depth  b = 1 / 8: the table's depth against contiguous 4 stages and paged 7 (three K/V buffers), twice
#   bench-decode-b32-tma  b = 32 at 16k / 64k (2 stages): pointer loads (the rule past 64 blocks a program) against
#                 descriptor loads (FLASHTILE_DECODE_TMA=1), twice
#   bench-decode-b8-split4  b = 8 at 16k-128k: the heuristic's 2 splits against 4 splits at 2 / 3 stages (cuDNN's grid)
#   bench-decode-block-n  split contiguous launches (b = 1 / 8, 8k-64k) at 128- / 64-key tiles, alternated twice
#   tests-decode-long-warps  8-warp decode launches for long programs (the default on sm_90) against the reference
#   bench-decode-long-warps-rounds  b = 8 / 32 at 32k / 128k beside cuDNN, --rounds 4, FLASHTILE_DECODE_LONG_WARPS=0
#                 then 8 (named bench-decode-long-warps until session 18, a duplicate label that never ran)
#   tests-decode-pdl  the decode kernels with programmatic dependent launch (FLASHTILE_DECODE_PDL), alone
#   bench-decode-fast-rows  fast boards' trailing rows (b = 32 at 8k / 16k, b = 8 at 64k / 128k) on other kernels, beside cuDNN
#   tests-decode-gluon-splits  the Gluon decode kernel split N ways (FLASHTILE_DECODE_GLUON_SPLITS) against the reference
#   bench-decode-gluon-splits  b = 4 / 8 on it (4 and 8 splits) against the default, beside cuDNN (after the tests)
#   bench-decode-gluon-split-rule  the split Gluon rule (session 32) against FLASHTILE_DECODE_GLUON_SPLITS=1, twice (after the tests)
#   bench-decode-b32-long-gluon  b = 32 from 64k on the per-head Gluon kernel (FLASHTILE_DECODE_ROWS=0) against the default, twice
#   bench-decode-b32-kernels  b = 32 at 64k-128k: the default, the Gluon kernel (ROWS=0) and whole rows (ROWS=8), twice
#   tests-decode-seqlens-evict  the decode GPU tests with FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1
#   bench-decode-seqlens-evict  the split / row kernels' lengths load marked evict_last against the default, 0 1 0 1
#   bench-decode-gluon-early  b = 32 with the Gluon kernel's first tile copied early (FLASHTILE_DECODE_GLUON_EARLY), 0 1 x3
#   bench-decode-b8-pdl  b = 8, 128k with the whole call as programmatic dependents against the default, beside cuDNN
#   bench-decode-full-grid-b4  b = 4 at 32k / 128k on half rows and stream-K against the default, beside cuDNN (full-grid boards)
#   bench-decode-merge-pdl  split calls past use_pdl's bound with the merge alone as a dependent (FLASHTILE_DECODE_MERGE_PDL)
#                 against ordinary launches, 0 1 0 1 (after tests-decode-pdl; MERGE_PDL_BATCH / _SEQLENS / _PAGES)
#   bench-decode-layers-pdl  bench-decode-layers' 8-layer table without, then with FLASHTILE_DECODE_PDL=1 (after
#                 tests-decode-pdl; PDL_BENCH_ARGS, e.g. "--batch 1")
#   tests-decode-fused-graph  the fused split merge inside CUDA graphs (captured, not the merge kernel)
#   bench-decode-fused-combine-layers  b = 1 in 8-layer graphs, fused split merge off/on alternated twice
#   bench-decode-layers  decode as CUDA graphs of 8 calls on 8 caches (--layers 8: per-call time with one
#                 graph launch per model step; LAYERS_BENCH_ARGS, e.g. "--rounds 2"), and b = 1 single-call graphs beside it
#   bench-decode-fused-combine  decode (b=1, 8) with the split merge fused into the decode kernel
#   profile-bwd   where an eager training step's time goes (scripts/profile_bwd.py: eager vs grad vs graph,
#                 host enqueue time, kernels by name)
#   host-profile  host time of eager calls per phase, and a cProfile of training steps (scripts/host_profile.py)
#   host-profile-fast  the same with the experimental launch fast path (FLASHTILE_FAST_LAUNCH=1)
#   tests-one-launch   the one-launch backward's GPU tests (every candidate config)
#   tests-fused-dq     the fused backward's GPU tests (dQ by TMA reduce-add and by atomics)
#   tests-fast-launch  the fast path's GPU tests (bit-identical results, alignment re-specialisation)
#   bench-bwd-flex   backward d=128, s>=2048 beside SDPA flash and FlexAttention (issue 4's Flex bar)
#   tune-gluon-bwd  the Gluon dK/dV kernel's configs alone, and the backward's time split (scripts/tune_gluon_bwd.py)
#   bench-bwd-flex-gluon  the same (and s=1024) with the Gluon dK/dV kernel, after tests-gluon-bwd passed
#   bench-bwd-flex-gluon-dq  the same with the Gluon dQ kernel too (FLASHTILE_GLUON_BWD_DQ=1)
#   bench-bwd-flex-fused  the same with FLASHTILE_BWD_FUSED_DQ=1 on the table a "tune-bwd --fused-only" step emitted
#   bench-bwd-d256   backward d=256, every s, beside SDPA flash and cuDNN
#   bench-fwd-d128   forward d=128, every s, beside SDPA flash, cuDNN and Flex (the Gluon route's rows)
#   tests-gluon-bwd  the Gluon dK/dV and dQ kernels' GPU tests (marker gluon: not in "tests")
#   bench-gluon-bwd  scripts/probe_gluon_bwd.py, then scripts/bench_gluon_bwd.py (Gluon dK/dV against Triton)
#   tests-gluon   the experimental Gluon kernel's GPU tests, alone, under a 300 s timeout
#   bench-gluon-fp8  the Gluon fp8 kernel beside Triton fp8, Gluon/Triton bf16 and cuDNN (timeout GLUON_TIMEOUT)
#   tune-gluon    scripts/tune_gluon.py (TUNE_GLUON_ARGS, e.g. "--dtypes fp8 --seqlens 4096"; timeout GLUON_TIMEOUT)
#   bench-gluon   the Gluon kernel beside the Triton kernel and cuDNN (scripts/bench_gluon.py), timeout 300 s
#   tune-fwd-short  forward d=128 rows at s=512/1024       tune-fp8   fp8 forward configs at s=4096
#   tune-bwd-short  backward rows at s=512                  tune-short = the three above
#   tune-decode   decode configs and split counts (CUDA-graph timing, contiguous and paged caches;
#                 TUNE_DECODE_ARGS, e.g. "--page-orders random sequential")
# Env knobs: BENCH_ARGS (extra bench options, e.g. "--d 128 --peers flash cudnn"), BENCH_FWDBWD=0,
# TUNE_ARGS / TUNE_BWD_ARGS (sweep options), GPU_TEST_WORKERS, GLUON_TIMEOUT (seconds, default 300),
# TIMED_XDIST=1 (the timed test steps, e.g. tests-decode-*, on GPU_TEST_WORKERS workers, not one process),
# GLUON_K (a pytest -k filter for tests-gluon, e.g. "not candidate"), GPU_K (the same for the other test steps), BENCH_GLUON_BWD_ARGS (e.g.
# "--d 128 --dtype fp16"), GLUON_BWD_PROBE=0 (bench-gluon-bwd without the probe), TUNE_GLUON_BWD_ARGS.
# Everything is written under a work folder and packed into $OUT/gpu_check.tgz (the device tool
# returns at most 8 files) after every step, so a call cut by its time limit still returns the
# finished steps; $OUT/summary.txt holds the tables and prints last.
# Test steps run on GPU_TEST_WORKERS pytest-xdist workers (default 8) when xdist is installed:
# compiling Triton kernels is most of their time, and it is CPU work that parallelises.
# Compiled kernels are kept in .triton_cache/ (git-ignored), so a later call on a warm machine reuses them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
xdist=()
if python3 -c "import xdist" 2>/dev/null && [[ ${GPU_TEST_WORKERS:-8} -gt 1 ]]; then
  # loadgroup: tests marked xdist_group("...") share one worker (the 128k-key caches' references need
  # ~10 GiB each; eight at once ran the 140 GiB GPU out of memory in session 20)
  xdist=(-n "${GPU_TEST_WORKERS:-8}" --dist loadgroup)
fi
pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" . ; }
# timed_tests NAME PYTEST_ARGS...: gpu-marked tests run alone under GLUON_TIMEOUT (default 300 s); log in
# gpu_tests_NAME.log, exit status in NAME_tests.rc, which tests_passed NAME reads to gate bench steps
timed_tests() {
  local name=$1 rc
  shift
  local par=()
  [[ ${TIMED_XDIST:-0} == 1 ]] && par=("${xdist[@]}")  # compiling is most of their time: spread it over workers
  timeout "${GLUON_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider "${par[@]}" "$@" \
    > "$WORK/gpu_tests_$name.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=$rc
  echo $rc > "$WORK/${name}_tests.rc"
  tail -n 25 "$WORK/gpu_tests_$name.log" >> "$summary"
}
tests_passed() { [[ $(cat "$WORK/$1_tests.rc" 2>/dev/null) == 0 ]]; }
# gate TESTS NAME: true if the timed_tests step TESTS passed in this call (TESTS "-": no gate); otherwise say
# that the benchmark NAME is skipped, and false
gate() {
  [[ $1 == - ]] && return 0
  tests_passed "$1" && return 0
  echo "skipped: $2 (its tests did not pass in this call)" | tee -a "$summary"
  return 1
}
# decode_runs NAME "SETTING|SETTING|..." BENCH_ARGS...: `bench decode BENCH_ARGS` once per setting, in the
# order given; a setting's words are environment assignments (VAR=value) and extra bench options (the
# rest), e.g. "FLASHTILE_DECODE_STAGES=2 --num-splits 32"; each run's JSON as NAME_<setting>_<seconds>.json
# (spaces as "_", "=" as "-", no "--"), its stderr in bench_NAME.log, packed after each run
decode_runs() {
  local name=$1 settings=$2 setting word tag
  shift 2
  IFS='|' read -ra settings <<< "$settings"
  for setting in "${settings[@]}"; do
    local envs=() opts=()
    for word in $setting; do
      if [[ $word == [A-Z]*=* ]]; then envs+=("$word"); else opts+=("$word"); fi
    done
    tag=$(echo "$setting" | sed 's/--//g' | tr ' =' '_-')
    env "${envs[@]}" python3 -m flashtile.bench decode "$@" "${opts[@]}" --out "$WORK/${name}_${tag}_$SECONDS.json" \
      2>> "$WORK/bench_$name.log" >> "$summary"
    pack
  done
}
# decode_ab TESTS NAME VAR "VALUES" BENCH_ARGS...: if the timed_tests step TESTS passed in this call (TESTS "-": no gate),
# decode_runs once per value of the environment variable VAR, in the order given (an A/B alternated inside
# one call): each run's JSON as NAME_VAR-<value>_<seconds>.json
decode_ab() {
  local tests=$1 name=$2 var=$3 values=$4 v settings=()
  shift 4
  gate "$tests" "$name" || return
  for v in $values; do settings+=("$var=$v"); done
  decode_runs "$name" "$(IFS='|'; echo "${settings[*]}")" "$@"
}
# attn_ab NAME MODE VAR "VALUES" BENCH_ARGS...: if the timed_tests step NAME passed in this call, `bench MODE
# BENCH_ARGS` (fwd / bwd) once per value of the environment variable VAR, in the order given; each run's JSON as
# NAME_VAR-<value>_<seconds>.json (scripts/merge_ab.py reads them)
attn_ab() {
  local name=$1 mode=$2 var=$3 values=$4 v
  shift 4
  gate "$name" "bench $name" || return
  for v in $values; do
    env "$var=$v" python3 -m flashtile.bench "$mode" "$@" --out "$WORK/${name}_${var}-${v}_$SECONDS.json" \
      2>> "$WORK/bench_$name.log" >> "$summary"
    pack
  done
}
steps=()
for a in "$@"; do  # tune-short: the three open sweeps
  if [[ $a == tune-short ]]; then steps+=(tune-fwd-short tune-fp8 tune-bwd-short); else steps+=("$a"); fi
done
[[ $# -eq 0 ]] && steps=(tests bench)
summary="$OUT/summary.txt"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)" \
  | tee "$summary"
status=0
for step in "${steps[@]}"; do
  echo "== $step ($(date +%H:%M:%S))" | tee -a "$summary"
  case $step in
    tests|tests-fwd|tests-bwd|tests-kv|tests-rest|tests-route|tests-fp8|tests-fast-launch|tests-one-launch|tests-fused-dq|tests-bwd-pdl)
      case $step in
        tests-fast-launch) files=(tests/test_gpu_fast_launch.py) ;;
        tests-bwd-pdl) files=(tests/test_gpu_bwd_pdl.py) ;;
        tests-one-launch) files=(tests/test_gpu_bwd_one_launch.py) ;;
        tests-fused-dq) files=(tests/test_gpu_bwd_fused_dq.py) ;;
        tests-fp8) files=(tests/test_gpu_gluon_route.py tests/test_gpu_fp8.py) ;;
        tests-route) files=(tests/test_gpu_gluon_route.py tests/test_gpu_fwd.py) ;;
        tests) files=(tests) ;;
        tests-fwd) files=(tests/test_gpu_fwd.py) ;;
        tests-bwd) files=(tests/test_gpu_bwd.py) ;;
        tests-kv) files=(tests/test_gpu_kvcache.py tests/test_gpu_decode_board.py tests/test_gpu_decode_long_warps.py tests/test_gpu_decode_page_gather.py
          tests/test_gpu_decode_grid_full_stages.py) ;;
        tests-rest) files=(tests/test_gpu_layers.py tests/test_gpu_compile.py tests/test_gpu_fp8.py tests/test_gpu_heavy_first.py) ;;
      esac
      python3 -m pytest -q -m "gpu and not gluon" --maxfail=20 --durations=10 -p no:cacheprovider "${xdist[@]}" \
        ${GPU_K:+-k "$GPU_K"} "${files[@]}" \
        > "$WORK/gpu_$step.log" 2>&1
      rc=$?
      [[ $rc -ne 0 ]] && status=$rc
      tail -n 25 "$WORK/gpu_$step.log" >> "$summary" ;;
    tune)
      python3 scripts/tune_fwd.py ${TUNE_ARGS:-} --out "$WORK/tune_fwd.json" --emit-table "$WORK/fwd_table.json" \
        2> "$WORK/tune_fwd.log" | tail -n 16 >> "$summary" ;;
    tune-bwd)
      python3 scripts/tune_bwd.py ${TUNE_BWD_ARGS:---fused-dq --jobs 8} --out "$WORK/tune_bwd.json" --emit-table "$WORK/bwd_table.json" \
        2> "$WORK/tune_bwd.log" | tail -n 10 >> "$summary" ;;
    tests-gluon-bwd)
      # the Gluon backward kernels' GPU tests (marker gluon, so not in full runs); the rc gates the
      # bench steps that force these kernels on
      TIMED_XDIST=1 timed_tests gluon_bwd tests/test_gpu_gluon_bwd.py tests/test_gpu_gluon_bwd_dq.py ;;
    bench-gluon-bwd)
      # where the Gluon dK/dV kernel disagrees with Triton, then its speed against the all-Triton backward
      [[ ${GLUON_BWD_PROBE:-1} == 1 ]] && timeout ${GLUON_TIMEOUT:-300} python3 scripts/probe_gluon_bwd.py \
        >> "$summary" 2> "$WORK/probe_gluon_bwd.log"
      pack
      timeout ${GLUON_TIMEOUT:-300} python3 scripts/bench_gluon_bwd.py ${BENCH_GLUON_BWD_ARGS:-} --out "$WORK/gluon_bwd.json" \
        >> "$summary" 2> "$WORK/bench_gluon_bwd.log" ;;
    tests-gluon)
      # the experimental Gluon kernel, alone and under a timeout: its first GPU run may hang
      timeout ${GLUON_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -x "${xdist[@]}" \
        ${GLUON_K:+-k "$GLUON_K"} tests/test_gpu_gluon.py \
        > "$WORK/gpu_tests_gluon.log" 2>&1
      rc=$?
      [[ $rc -eq 124 ]] && echo "tests-gluon: TIMED OUT (likely a hang)" >> "$WORK/gpu_tests_gluon.log"
      [[ $rc -ne 0 ]] && status=$rc
      tail -n 25 "$WORK/gpu_tests_gluon.log" >> "$summary" ;;
    bench-gluon-fp8)
      timeout ${GLUON_TIMEOUT:-300} python3 scripts/bench_gluon.py --fp8 --out "$WORK/gluon_fp8.json" \
        2> "$WORK/bench_gluon_fp8.log" >> "$summary"
      [[ $? -eq 124 ]] && echo "bench-gluon-fp8: TIMED OUT" >> "$summary" ;;
    tune-gluon)
      timeout ${GLUON_TIMEOUT:-300} python3 scripts/tune_gluon.py ${TUNE_GLUON_ARGS:-} --out "$WORK/tune_gluon.json" \
        2> "$WORK/tune_gluon.log" | tail -n 30 >> "$summary"
      [[ ${PIPESTATUS[0]} -eq 124 ]] && echo "tune-gluon: TIMED OUT" >> "$summary" ;;
    bench-gluon)
      timeout ${GLUON_TIMEOUT:-300} python3 scripts/bench_gluon.py --out "$WORK/gluon.json" 2> "$WORK/bench_gluon.log" >> "$summary"
      [[ $? -eq 124 ]] && echo "bench-gluon: TIMED OUT" >> "$summary" ;;
    tune-fwd-short)
      # the forward's d = 128 rows at s <= 1024 (the "short" table rows), TMA path
      python3 scripts/tune_fwd.py --refine --d 128 --seqlens 512 1024 --out "$WORK/tune_fwd_d128_short.json" \
        2> "$WORK/tune_fwd_short.log" | tail -n 6 >> "$summary" ;;
    tune-fp8)
      python3 scripts/tune_fwd.py --fp8 --d 128 256 --seqlens 4096 --out "$WORK/tune_fp8_s4096.json" \
        2> "$WORK/tune_fp8.log" | tail -n 6 >> "$summary" ;;
    tune-bwd-short)
      python3 scripts/tune_bwd.py --s 512 --jobs 8 --out "$WORK/tune_bwd_s512.json" \
        --emit-table "$WORK/bwd_table_s512.json" 2> "$WORK/tune_bwd_s512.log" | tail -n 8 >> "$summary" ;;
    tune-decode)
      python3 scripts/tune_decode.py ${TUNE_DECODE_ARGS:-} --out "$WORK/tune_decode.json" 2> "$WORK/tune_decode.log" \
        | tail -n 24 >> "$summary" ;;
    bench)
      python3 -m flashtile.bench fwd --ceilings --out "$WORK/fwd.json" --plot "$WORK/fwd.png" \
        2> "$WORK/bench_fwd.log" >> "$summary"
      python3 scripts/bench_fwd_extras.py --out "$WORK/fwd_extras.json" 2>> "$WORK/bench_fwd.log" >> "$summary" ;;
    bench-graph)
      python3 -m flashtile.bench fwd --cuda-graph --out "$WORK/fwd_graph.json" --plot "$WORK/fwd_graph.png" \
        2> "$WORK/bench_fwd_graph.log" >> "$summary" ;;
    bench-bwd)
      python3 -m flashtile.bench bwd ${BENCH_ARGS:-} --out "$WORK/bwd.json" --plot "$WORK/bwd.png" \
        2> "$WORK/bench_bwd.log" >> "$summary"
      pack
      [[ ${BENCH_FWDBWD:-1} == 1 ]] && python3 -m flashtile.bench fwdbwd ${BENCH_ARGS:-} --out "$WORK/fwdbwd.json" \
        --plot "$WORK/fwdbwd.png" 2>> "$WORK/bench_bwd.log" >> "$summary" ;;
    bench-heavy-first)
      # causal Triton forward (d = 64 / 256) and backward (the dQ kernel; d = 128 / 256) with the
      # longest row blocks started first (FLASHTILE_HEAVY_FIRST=1) and in launch order (0, the default until this A/B),
      # alternated twice so that neither setting always runs first
      for hf in 0 1 0 1; do
        FLASHTILE_HEAVY_FIRST=$hf python3 -m flashtile.bench fwd --d 64 256 --causal yes --peers \
          --out "$WORK/fwd_causal_heavy_first${hf}_$SECONDS.json" 2>> "$WORK/bench_heavy_first.log" >> "$summary"
        FLASHTILE_HEAVY_FIRST=$hf python3 -m flashtile.bench bwd --d 128 256 --causal yes --seqlens 2048 4096 16384 \
          --peers --out "$WORK/bwd_causal_heavy_first${hf}_$SECONDS.json" 2>> "$WORK/bench_heavy_first.log" >> "$summary"
        pack
      done ;;
    bench-bwd-pdl)
      # the backward with the dQ kernel launched behind the dK/dV kernel (FLASHTILE_BWD_PDL=1) and without,
      # alternated twice; after tests-bwd-pdl
      for pdl in 0 1 0 1; do
        FLASHTILE_BWD_PDL=$pdl python3 -m flashtile.bench bwd --d 64 128 256 --seqlens 1024 2048 4096 16384 --peers \
          --out "$WORK/bwd_pdl${pdl}_$SECONDS.json" 2>> "$WORK/bench_bwd_pdl.log" >> "$summary"
        pack
      done ;;
    bench-decode-b1-layers)
      # the b = 1 rows of bench-decode-layers' table alone
      python3 -m flashtile.bench decode --cuda-graph --layers 8 --batch 1 --out "$WORK/decode_graph_layers8_b1.json" \
        2> "$WORK/bench_decode_b1_layers.log" >> "$summary" ;;
    probe-decode-layout)
      python3 scripts/probe_decode_layout.py --out "$WORK/probe_decode_layout.json" >> "$summary" 2> "$WORK/probe_decode_layout.log" ;;
    probe-read-ceiling)
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_throttle_reasons.active \
        --format=csv,nounits -lms 100 > "$WORK/clocks_read_ceiling.csv" 2>&1 &
      smi=$!
      python3 scripts/probe_read_ceiling.py --out "$WORK/read_ceiling.json" --seqlens ${CEILING_SEQLENS:-8192 16384 65536 131072} \
        --rounds 2 >> "$summary" 2> "$WORK/read_ceiling.log"
      kill "$smi" 2> /dev/null
      python3 scripts/clock_log_by_timing.py "$WORK/read_ceiling.json" "$WORK/clocks_read_ceiling.csv" >> "$summary" ;;
    probe-sm-balance)
      # per-SM read times (132 and 128 programs: a board's fingerprint) and reads weighted by each SM's speed
      python3 scripts/probe_sm_balance.py --out "$WORK/sm_balance.json" --gib ${BALANCE_GIB:-8 2 1} \
        >> "$summary" 2> "$WORK/sm_balance.log" ;;
    probe-streamk)
      # the split and stream-K row kernels on one board: timings beside the flat reads (128 / 132 programs: the
      # board's class) and cuDNN, with a clock log, then both kernels' per-program stamps (session 25)
      python3 scripts/probe_streamk.py --out "$WORK/streamk_b32.json" --clock-log "$WORK/clocks_streamk.csv" \
        >> "$summary" 2> "$WORK/streamk.log"
      python3 scripts/probe_streamk.py --batch 64 --seqlens 8192 32768 --out "$WORK/streamk_b64.json" \
        >> "$summary" 2>> "$WORK/streamk.log"
      python3 scripts/probe_streamk.py --stamps --seqlens 65536 --out "$WORK/streamk_stamps_b32.json" \
        >> "$summary" 2>> "$WORK/streamk.log"
      python3 scripts/probe_streamk.py --stamps --batch 64 --seqlens 8192 --out "$WORK/streamk_stamps_b64.json" \
        >> "$summary" 2>> "$WORK/streamk.log" ;;
    probe-paged-rows)
      # paged caches on the row kernel against the per-head paged kernel and the contiguous cache (session 26;
      # PAGED_BATCHES / PAGED_SEQLENS / PAGED_SETTINGS pick the rows and more contiguous settings)
      python3 scripts/probe_paged_rows.py --out "$WORK/paged_rows.json" --batches ${PAGED_BATCHES:-8 32 64} \
        --seqlens ${PAGED_SEQLENS:-8192 32768 131072} ${PAGED_SETTINGS:+--settings $PAGED_SETTINGS} \
        >> "$summary" 2> "$WORK/paged_rows.log" ;;
    probe-decode-stamps)
      python3 scripts/probe_read_ceiling.py --stamps --out "$WORK/decode_stamps.json" \
        --seqlens ${CEILING_SEQLENS:-1024 8192 16384} >> "$summary" 2> "$WORK/decode_stamps.log" ;;
    probe-bwd-modes)
      python3 scripts/probe_bwd_modes.py --out "$WORK/probe_bwd_modes.json" >> "$summary" 2> "$WORK/probe_bwd_modes.log" ;;
    bench-bwd-s1024-route)
      # is the Gluon route's slow d = 128 causal s = 1024 row host time? the s = 1024 rows with the
      # Gluon dK/dV kernel forced on and off, eager and as CUDA-graph replays, one file each
      for on in 0 1; do
        for mode in ${ROUTE_MODES:-eager graph}; do
          graph=$([[ $mode == graph ]] && echo --cuda-graph)
          FLASHTILE_GLUON_BWD=$on python3 -m flashtile.bench bwd --d 128 256 --seqlens ${ROUTE_SEQLENS:=1024} --peers flash \
            $graph --out "$WORK/bwd_s${ROUTE_SEQLENS// /_}_gluon${on}${graph:+_graph}.json" 2>> "$WORK/bench_bwd_s1024_route.log" >> "$summary"
          pack
        done
      done ;;
    bench-bwd-short)
      # s <= 1024 backward: as users see it, then as CUDA-graph replays (kernel time alone); the gap
      # between the two is host time (docs/backward.md, "short sequences are host-bound")
      python3 -m flashtile.bench bwd --seqlens 512 1024 --peers flash cudnn --out "$WORK/bwd_short.json" \
        2> "$WORK/bench_bwd_short.log" >> "$summary"
      pack
      python3 -m flashtile.bench bwd --seqlens 512 1024 --peers flash cudnn --cuda-graph \
        --out "$WORK/bwd_short_graph.json" 2>> "$WORK/bench_bwd_short.log" >> "$summary" ;;
    host-breakdown)
      # host time per piece of an eager call (empty-kernel launches, descriptors, autograd, whole calls
      # beside SDPA flash), then the same with the launch cache off
      python3 scripts/host_breakdown.py --out "$WORK/host_breakdown.json" 2> "$WORK/host_breakdown.log" >> "$summary"
      FLASHTILE_FAST_LAUNCH=0 python3 scripts/host_breakdown.py --out "$WORK/host_breakdown_nocache.json" \
        2>> "$WORK/host_breakdown.log" >> "$summary" ;;
    host-ab-cache)
      python3 scripts/host_breakdown.py --ab-cache ${AB_ROUNDS:-8} --out "$WORK/host_ab_cache.json" \
        2> "$WORK/host_ab_cache.log" >> "$summary" ;;
    host-trace)
      python3 scripts/host_trace.py --out "$WORK/host_trace.txt" 2> "$WORK/host_trace.log" >> "$summary" ;;
    profile-bwd)
      python3 scripts/profile_bwd.py --out "$WORK/profile_bwd.json" 2> "$WORK/profile_bwd.log" >> "$summary" ;;
    host-profile-fast)
      FLASHTILE_FAST_LAUNCH=1 python3 scripts/host_profile.py --out "$WORK/host_profile_fast.txt" \
        2> "$WORK/host_profile_fast.log" | head -n 60 >> "$summary" ;;
    host-profile)
      python3 scripts/host_profile.py --out "$WORK/host_profile.txt" 2> "$WORK/host_profile.log" | head -n 60 >> "$summary" ;;
    bench-bwd-flex)
      python3 -m flashtile.bench bwd --d 128 --seqlens 2048 4096 8192 16384 --peers flash flex \
        --out "$WORK/bwd_flex.json" 2> "$WORK/bench_bwd_flex.log" >> "$summary" ;;
    tune-gluon-bwd)
      timeout ${GLUON_TIMEOUT:-300} python3 scripts/tune_gluon_bwd.py ${TUNE_GLUON_BWD_ARGS:-} --out "$WORK/tune_gluon_bwd.json" \
        >> "$summary" 2> "$WORK/tune_gluon_bwd.log" ;;
    bench-bwd-flex-gluon)
      # bench-bwd-flex with the Gluon dK/dV kernel routed in; only after tests-gluon-bwd passed in this call
      if tests_passed gluon_bwd; then
        python3 scripts/bench_bwd_gluon_route.py bwd --d 128 --seqlens 1024 2048 4096 8192 16384 --peers flash flex \
          --out "$WORK/bwd_flex_gluon.json" 2> "$WORK/bench_bwd_flex_gluon.log" >> "$summary"
      else
        echo "bench-bwd-flex-gluon: skipped (tests-gluon-bwd did not pass in this call)" >> "$summary"
      fi ;;
    bench-bwd-flex-gluon-dq)
      # bench-bwd-flex-gluon with the Gluon dQ kernel routed in too; only after tests-gluon-bwd passed
      if tests_passed gluon_bwd; then
        FLASHTILE_GLUON_BWD_DQ=1 python3 scripts/bench_bwd_gluon_route.py bwd --d 128 \
          --seqlens 1024 2048 4096 8192 16384 --peers flash flex --out "$WORK/bwd_flex_gluon_dq.json" \
          2> "$WORK/bench_bwd_flex_gluon_dq.log" >> "$summary"
      else
        echo "bench-bwd-flex-gluon-dq: skipped (tests-gluon-bwd did not pass in this call)" >> "$summary"
      fi ;;
    bench-bwd-flex-fused)
      # bench-bwd-flex with the fused variant (dQ by TMA reduce-add) on the configs a preceding
      # "tune-bwd" step with TUNE_BWD_ARGS="--fused-only ..." wrote to $WORK/bwd_table.json
      FLASHTILE_BWD_FUSED_DQ=1 FLASHTILE_BWD_CONFIGS="$WORK/bwd_table.json" python3 -m flashtile.bench bwd --d 128 \
        --seqlens 2048 4096 8192 16384 --peers flash flex --out "$WORK/bwd_flex_fused.json" \
        2> "$WORK/bench_bwd_flex_fused.log" >> "$summary" ;;
    bench-bwd-d256)
      python3 -m flashtile.bench bwd --d 256 --peers flash cudnn --out "$WORK/bwd_d256.json" \
        2> "$WORK/bench_bwd_d256.log" >> "$summary" ;;
    bench-fwd-d128)
      python3 -m flashtile.bench fwd --d 128 --out "$WORK/fwd_d128.json" 2> "$WORK/bench_fwd_d128.log" >> "$summary" ;;
    bench-decode-fused-combine)
      # the split merge fused into the decode kernel (off by default) against the combine kernel
      FLASHTILE_DECODE_FUSED_COMBINE=1 python3 -m flashtile.bench decode --cuda-graph --batch 1 8 \
        --out "$WORK/decode_graph_fused_combine.json" 2> "$WORK/bench_decode_fc.log" >> "$summary" ;;
    tests-decode-fused-graph)
      # the fused split merge captured in CUDA graphs (warm-up and capture on one stream), alone
      timed_tests decode_fused_graph tests/test_gpu_decode_fused_graph.py ;;
    bench-decode-fused-combine-layers)
      # b = 1 per call in 8-layer graphs with the split merge fused into the decode kernel (one kernel
      # per layer; PDL is on by default up to 64k) against the merge kernel, alternated twice, no peers;
      # after tests-decode-fused-graph passed in this call (it checks graphs capture the fused path at all)
      decode_ab decode_fused_graph decode_layers8_fused_combine FLASHTILE_DECODE_FUSED_COMBINE "0 1 0 1" \
        --cuda-graph --layers 8 --batch 1 --peers ;;
    bench-fp8)
      python3 -m flashtile.bench fwd --dtype fp8 --d 64 128 256 --seqlens 1024 4096 16384 ${BENCH_ARGS:---peers cudnn} \
        --out "$WORK/fwd_fp8.json" --plot "$WORK/fwd_fp8.png" 2> "$WORK/bench_fp8.log" >> "$summary" ;;
    tests-decode-tma)
      # the decode kernel's descriptor loads (FLASHTILE_DECODE_TMA), alone and timed out; -s shows
      # whether they were bitwise equal to pointer loads
      timed_tests decode_tma -s tests/test_gpu_decode_tma.py ;;
    bench-decode-tma)
      # the 8-layer decode table without, then with descriptor loads (forced), alternated twice, beside
      # cuDNN; after tests-decode-tma passed
      decode_ab decode_tma decode_layers8_tma FLASHTILE_DECODE_TMA "0 1 0 1" \
        --cuda-graph --layers 8 --pages --peers cudnn --seqlens 8192 32768 131072 ;;
    bench-decode-tma-small)
      # descriptor loads on the small calls (b = 1 / 8 / 32 at 8k-64k, 8-layer graphs, contiguous only, no
      # peers), FLASHTILE_DECODE_TMA=0 1 alternated three times; after tests-decode-tma passed
      decode_ab decode_tma decode_layers8_small_tma FLASHTILE_DECODE_TMA "0 1 0 1 0 1" \
        --cuda-graph --layers 8 --batch 1 8 32 --seqlens 8192 16384 65536 --pages --peers ;;
    bench-decode-tma-paged)
      # descriptor loads on 256-token pages (forced: not the default yet) against pointer loads, b = 1 / 8
      # at 8k-64k in 8-layer graphs, FLASHTILE_DECODE_TMA=0 1 0 1; after tests-decode-tma passed
      decode_ab decode_tma decode_layers8_p256_tma FLASHTILE_DECODE_TMA "0 1 0 1" \
        --cuda-graph --layers 8 --batch 1 8 --seqlens 8192 16384 65536 --pages 256 --peers ;;
    bench-decode-tma-eager)
      # eager calls (host-bound at these sizes) with and without descriptor loads: what building and
      # encoding two descriptors per call costs; b = 1 / 8 at 8k / 16k, no peers, after tests-decode-tma
      decode_ab decode_tma decode_eager_tma FLASHTILE_DECODE_TMA "0 1 0 1" \
        --batch 1 8 --seqlens 8192 16384 --pages --peers ;;
    tests-decode-page-gather)
      # the by-page gather for small pages (FLASHTILE_DECODE_PAGE_GATHER) against the reference and per-key gathers
      timed_tests decode_page_gather tests/test_gpu_decode_page_gather.py ;;
    bench-decode-page-gather)
      # 16-token pages with the by-page gather off / on, alternated twice, 8-layer graphs, b = 1 at 8k-64k and
      # b = 8 / 32 at 8k (the contiguous column is each run's reference); after tests-decode-page-gather
      decode_ab decode_page_gather decode_layers8_p16_gather FLASHTILE_DECODE_PAGE_GATHER "0 1 0 1" \
        --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 65536 --pages 16 --peers
      decode_ab decode_page_gather decode_layers8_p16_gather_b8_32_ FLASHTILE_DECODE_PAGE_GATHER "0 1" \
        --cuda-graph --layers 8 --batch 8 32 --seqlens 8192 --pages 16 --peers ;;
    tune-decode-occupancy)
      # b = 32 (a grid of 256 programs, two waves at one CTA per SM): the table's 3-stage configs against
      # 2-stage ones that fit two or three CTAs per SM, each config twice, alternated, single-call graphs
      python3 scripts/tune_decode.py --batch 32 --seqlens 8192 131072 --pages --splits 0 \
        --configs "128,4,3;128,8,3;128,4,2;128,8,2;128,4,3;128,8,3;128,4,2;128,8,2" \
        --out "$WORK/tune_decode_occupancy.json" 2> "$WORK/tune_decode_occupancy.log" | tail -n 8 >> "$summary" ;;
    bench-decode-b1-splits)
      # b = 1 at 8k / 16k, contiguous, 8-layer graphs, with the split count forced (0 = the heuristic's 16),
      # to re-check the heuristic's start-up constant now that short programs take descriptor loads
      for n in 0 12 20 24 0; do
        python3 -m flashtile.bench decode --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 --pages --peers \
          --num-splits "$n" --out "$WORK/decode_b1_splits${n}_$SECONDS.json" 2>> "$WORK/bench_b1_splits.log" >> "$summary"
        pack
      done ;;
    probe-decode-ncu)
      # Nsight Compute, one kernel at a time, on the decode cases of scripts/probe_decode_ncu.py (b = 1, 8k
      # contiguous / 16- / 256-token pages, b = 32, 8k, b = 8, 64k, and SDPA cuDNN beside them), clocks not locked
      # NCU_CASES: a subset of the script's cases (default: all), e.g. "ft_b8_64k cudnn_b8_64k"
      # NCU_SECTIONS: more sections, e.g. "MemoryWorkloadAnalysis_Tables" (L2 sectors per request, DRAM traffic)
      extra=()
      for sec in ${NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
      cases=(${NCU_CASES:-ft_b1_8k ft_b1_8k_p16 ft_b1_8k_p256 ft_b32_8k cudnn_b1_8k cudnn_b32_8k ft_b8_64k cudnn_b8_64k})
      inc=()
      for c in "${cases[@]}"; do inc+=(--nvtx-include "$c/"); done
      # NCU_SOURCE=1: one profiled call per case, the report kept (ncu_decode.ncu-rep) and its per-instruction
      # SASS table (executed instructions, stall samples: add SourceCounters to NCU_SECTIONS) as CSV
      rep=() calls=()
      [[ ${NCU_SOURCE:-0} == 1 ]] && rep=(-o "$WORK/ncu_decode") calls=(--calls 1)
      ncu --nvtx "${inc[@]}" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy "${extra[@]}" \
        "${rep[@]}" python3 scripts/probe_decode_ncu.py --cases "${cases[@]}" "${calls[@]}" \
        > "$WORK/ncu_decode.txt" 2> "$WORK/ncu_decode.log"
      rc=$?
      if [[ ${NCU_SOURCE:-0} == 1 && -f "$WORK/ncu_decode.ncu-rep" ]]; then
        ncu -i "$WORK/ncu_decode.ncu-rep" --print-details all > "$WORK/ncu_decode.txt" 2>> "$WORK/ncu_decode.log"
        ncu -i "$WORK/ncu_decode.ncu-rep" --page source --print-source sass --csv > "$WORK/ncu_decode_sass.csv" \
          2>> "$WORK/ncu_decode.log" || echo "ncu source page failed" >> "$summary"
        gzip -f "$WORK/ncu_decode_sass.csv"
      fi
      echo "ncu exit $rc" >> "$summary"
      [[ $rc -ne 0 ]] && status=$rc
      grep -E '^  [^ ].*\(|Duration|Grid Size|Waves Per SM|DRAM Throughput|Registers Per|Dynamic Shared|Achieved Occupancy|Warp Cycles Per Issued' \
        "$WORK/ncu_decode.txt" | head -n 200 >> "$summary" ;;
    bench-decode-b32-stages)
      # b = 32 beside cuDNN in 8-layer graphs, --rounds 2: the table's 3 stages (forced: the default has taken
      # 2 there since session 12), 2 stages (two or three CTAs per SM), and 2 stages with programmatic
      # dependent launch; twice, alternated
      st3=FLASHTILE_DECODE_STAGES=3 st2=FLASHTILE_DECODE_STAGES=2
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_runs decode_b32_stages "$st3|$st2|$st2 FLASHTILE_DECODE_PDL=1|$st3|$st2|$st2 FLASHTILE_DECODE_PDL=1" \
        --cuda-graph --layers 8 --batch 32 --seqlens 8192 32768 131072 --pages --peers cudnn --rounds 2 ;;
    bench-decode-b1-occupancy)
      # b = 1 in 8-layer graphs beside cuDNN (contiguous, 16- and 256-token pages): the table's 3 stages and 16
      # splits (one CTA per SM) against 2 stages (two or more CTAs per SM, as cuDNN's 86 KB kernel) at 16 / 24 /
      # 32 splits; twice, alternated
      st3=FLASHTILE_DECODE_STAGES=3 st2=FLASHTILE_DECODE_STAGES=2  # 3: the table's (b = 1 launches are split)
      runs="$st3 --num-splits 0|$st2 --num-splits 0|$st2 --num-splits 32|$st2 --num-splits 24"
      decode_runs decode_b1_occ "$runs|$runs" --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 65536 \
        --pages 16 256 --peers cudnn ;;
    bench-decode-p16-stages)
      # 16-token pages at b = 1 with the by-page gather (the default since session 11) at paged depths 5 (the
      # table's 3 + 2) and 4 (FLASHTILE_DECODE_STAGES=2), alternated twice: session 6's sweep, which kept 5,
      # predates the by-page gather, and a shallower pipeline issues fewer tiles' copies before the first MMA.
      # The knob sets the contiguous column's stages too: compare the p16 column across runs.
      decode_ab - decode_p16_stages FLASHTILE_DECODE_STAGES "3 2 3 2" \
        --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 --pages 16 --peers ;;
    bench-decode-b1-depth)
      # a deeper pipeline for short programs: the contiguous cache at 4 stages (three K/V buffers, 205 KB; the
      # table's 3 give two) and 16-token pages at a paged depth of 7 (three buffers; the default 5 gives two),
      # at b = 1 (4-32 key blocks a program) and b = 8, alternated twice
      base="FLASHTILE_DECODE_STAGES=3 FLASHTILE_DECODE_PAGED_STAGES=5"
      deep="FLASHTILE_DECODE_STAGES=4 FLASHTILE_DECODE_PAGED_STAGES=7"
      decode_runs decode_b1_depth "$base|$deep|$base|$deep" \
        --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 65536 --pages 16 --peers cudnn
      decode_runs decode_b8_depth "$base|$deep" --cuda-graph --layers 8 --batch 8 --seqlens 8192 65536 --pages 16 \
        --peers cudnn ;;
    bench-decode-edges)
      # the masked edge loops unpipelined (the default since session 15) against pipelined
      # (FLASHTILE_DECODE_PIPELINE_EDGES=1, the kernel before), 1 0 1 0; run tests-kv (and tests-decode-tma) first
      decode_ab - decode_edges_b1 FLASHTILE_DECODE_PIPELINE_EDGES "1 0 1 0" \
        --cuda-graph --layers 8 --batch 1 --seqlens 8192 16384 65536 --pages 16 256 --peers cudnn
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_ab - decode_edges_b8_b32 FLASHTILE_DECODE_PIPELINE_EDGES "1 0 1 0" \
        --cuda-graph --layers 8 --batch 8 32 --seqlens 8192 65536 --pages 16 256 --peers cudnn ;;
    tests-fwd-edges)
      # the forward's GPU tests with every launch's masked edge ranges loaded directly (FLASHTILE_FWD_PIPELINE_EDGES=0;
      # by default only sm_90 launches at BLOCK_D 64 up to 1024 keys do, since session 15)
      FLASHTILE_FWD_PIPELINE_EDGES=0 TIMED_XDIST=1 timed_tests fwd_edges tests/test_gpu_fwd.py ;;
    bench-fwd-edges)
      # the Triton forward (d = 64 / 256; d = 128 takes the Gluon kernel) at short lengths, where a program's
      # edge-range prologue weighs most: every launch pipelined (1) against every launch direct (0), as CUDA-graph
      # replays beside cuDNN, 1 0 1 0, after tests-fwd-edges passed in this call (session 15 ran d = 64 / 256 at
      # 512-2048 on one lease; this is the second lease and the longer rows)
      attn_ab fwd_edges fwd FLASHTILE_FWD_PIPELINE_EDGES "1 0 1 0" --cuda-graph --d 64 256 --seqlens 512 1024 2048 4096 \
        --peers cudnn ;;
    tests-bwd-edges)
      # the Triton backward's GPU tests with every masked range loaded directly (FLASHTILE_BWD_PIPELINE_EDGES=0;
      # by default only sm_90 launches without a band do, since session 16)
      FLASHTILE_BWD_PIPELINE_EDGES=0 TIMED_XDIST=1 timed_tests bwd_edges tests/test_gpu_bwd.py \
        tests/test_gpu_bwd_one_launch.py ;;
    bench-bwd-edges)
      # the backward at short lengths (d = 64 and d = 128 at 512 take the Triton kernels; the Gluon dK/dV kernel
      # takes d = 128 from 1024, where only the Triton dQ kernel changes) as CUDA-graph replays beside cuDNN:
      # every launch pipelined (1, the default before session 16) against direct (0), 1 0 1 0, after
      # tests-bwd-edges passed in this call
      attn_ab bwd_edges bwd FLASHTILE_BWD_PIPELINE_EDGES "1 0 1 0" --cuda-graph --d 64 128 --seqlens 512 1024 2048 \
        --peers cudnn ;;
    bench-decode-b32-tiles)
      # smaller tiles, more of them in flight, for the unsplit b = 32 grid (two programs an SM at the
      # table's 74 KB; 64-key tiles: 104 KB at 4 stages, two an SM, 72 KB at 3, up to three)
      t128=FLASHTILE_DECODE_BLOCK_N=128 t64="FLASHTILE_DECODE_BLOCK_N=64 FLASHTILE_DECODE_STAGES"
      runs="$t128|$t64=4|$t64=3"
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_runs decode_b32_tiles "$runs|$runs" \
        --cuda-graph --layers 8 --batch 32 --seqlens 8192 65536 --pages --peers cudnn ;;
    bench-decode-long-warps)
      # long programs (>= 256 key blocks) take 8 warps since session 11, measured at 3 stages (one CTA an SM);
      # b = 32 has run at 2 stages (two CTAs an SM) since session 12: 8 warps against the table's 4 (cuDNN's
      # shape: 4 warps, two CTAs an SM) there, and at b = 8's split launch, 8 4 8 4
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_ab - decode_long_warps FLASHTILE_DECODE_LONG_WARPS "8 0 8 0" --cuda-graph --layers 8 \
        --batch ${LONG_WARPS_BATCH:-32 8} --seqlens 32768 65536 131072 --pages --peers cudnn ;;
    tests-decode-gluon-warp-keys)
      # the Gluon warps-along-keys decode kernel (session 17) against the reference, through the public call
      TIMED_XDIST=1 timed_tests decode_gluon_warp_keys tests/test_gpu_decode_gluon_warp_keys.py ;;
    tests-decode-gluon-splits)
      # the Gluon kernel split N ways (FLASHTILE_DECODE_GLUON_SPLITS, session 31; the split rule since session 32) against
      # the reference, eager and in a CUDA graph
      TIMED_XDIST=1 timed_tests decode_gluon_splits -k split tests/test_gpu_decode_gluon_warp_keys.py ;;
    bench-decode-gluon-splits)
      # b = 4, 8 and 16 on the Gluon kernel split to reach its rule's grid (FLASHTILE_DECODE_GLUON_SPLITS=0: 8 / 4 / 2
      # splits, 256 programs; b = 8 at 128k is then b = 32, 32k's grid, where this kernel leads cuDNN) and split 8 ways,
      # against the default, beside cuDNN, contiguous caches, the default first and last; after
      # tests-decode-gluon-splits passed in this call
      gate decode_gluon_splits bench-decode-gluon-splits && decode_runs gluon_splits \
        "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=0 FLASHTILE_DECODE_GLUON_SPLITS=0|FLASHTILE_DECODE_ROWS=0 FLASHTILE_DECODE_GLUON_SPLITS=8|FLASHTILE_DECODE_ROWS=0 FLASHTILE_DECODE_GLUON_SPLITS=0|FLASHTILE_DECODE_ROWS=" \
        --cuda-graph --layers 8 --peers cudnn --pages --batch 4 8 16 --seqlens 32768 65536 131072 ;;
    bench-decode-gluon-split-rule)
      # the split Gluon rule (session 32: b = 4-16 with 8 kv heads from 32k keys, decode_gluon.requested_splits)
      # against FLASHTILE_DECODE_GLUON_SPLITS=1 (the whole-row / per-head Triton kernels, the rule before), 0 1 0 1
      # as "unset|1|unset|1", beside cuDNN, contiguous caches; after tests-decode-gluon-splits passed in this call
      gate decode_gluon_splits bench-decode-gluon-split-rule && decode_runs gluon_split_rule \
        "FLASHTILE_DECODE_GLUON_SPLITS=|FLASHTILE_DECODE_GLUON_SPLITS=1|FLASHTILE_DECODE_GLUON_SPLITS=|FLASHTILE_DECODE_GLUON_SPLITS=1" \
        --cuda-graph --layers 8 --peers cudnn --batch 4 8 16 --seqlens 32768 65536 131072 ;;
    bench-decode-b32-long-gluon)
      # b = 32 from 64k keys on the per-head Gluon kernel (FLASHTILE_DECODE_ROWS=0; session 24 gave these calls to
      # the whole-row / half-row Triton kernels on H200s) against the default, "unset|0|unset|0", beside cuDNN,
      # contiguous caches: on the H100s A33 / A34 the default trailed cuDNN at b = 32, 64k by 0.1% (session 34);
      # after tests-decode-gluon-splits passed in this call (the same kernel)
      gate decode_gluon_splits bench-decode-b32-long-gluon && decode_runs b32_long_gluon \
        "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=0|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=0" \
        --cuda-graph --layers 8 --peers cudnn --batch 32 --seqlens ${B32_LONG_SEQLENS:-65536 131072} ;;
    bench-decode-b32-kernels)
      # b = 32 at 64k-128k on each kernel that can take it: the default (an H200's half rows; an H100's bounds since
      # session 34: the Gluon kernel below 96k, whole rows from 96k), the per-head Gluon kernel
      # (FLASHTILE_DECODE_ROWS=0) and whole rows (=8), twice each in turn, beside cuDNN, contiguous caches; after
      # tests-decode-gluon-splits passed in this call (the Gluon kernel's)
      r=FLASHTILE_DECODE_ROWS runs="$r=|$r=0|$r=8"
      gate decode_gluon_splits bench-decode-b32-kernels && decode_runs b32_kernels "$runs|$runs" \
        --cuda-graph --layers 8 --peers cudnn --batch 32 --seqlens ${B32_SEQLENS:-65536 98304 131072} ;;
    tests-decode-seqlens-evict)
      # the KV-cache suite's decode files with the lengths' load marked evict_last (FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1)
      FLASHTILE_DECODE_SEQLENS_EVICT_LAST=1 TIMED_XDIST=1 timed_tests decode_seqlens_evict tests/test_gpu_kvcache.py \
        tests/test_gpu_decode_board.py tests/test_gpu_decode_grid_full_stages.py ;;
    bench-decode-seqlens-evict)
      # the split and row kernels with their lengths' load marked evict_last (FLASHTILE_DECODE_SEQLENS_EVICT_LAST,
      # session 31, built, unmeasured: a layer's key stream evicts the lengths from L2, and every program of the next
      # layer's call reads them before its first key) against the default, 0 1 0 1, on the bar's rows those kernels
      # take; after tests-decode-seqlens-evict passed in this call
      decode_ab decode_seqlens_evict seqlens_evict FLASHTILE_DECODE_SEQLENS_EVICT_LAST "0 1 0 1" --cuda-graph --layers 8 --peers cudnn \
        --batch ${EVICT_BATCH:-1 8} --seqlens ${EVICT_SEQLENS:-8192 32768 131072} ;;
    bench-decode-gluon-early)
      # the per-head Gluon kernel with its ring's first tile copied before the row's length is read
      # (FLASHTILE_DECODE_GLUON_EARLY=1, the default since session 31) against after it, 0 1 0 1 0 1, at b = 32 (the
      # calls it takes), beside cuDNN; after tests-decode-gluon-warp-keys passed in this call
      decode_ab decode_gluon_warp_keys gluon_early FLASHTILE_DECODE_GLUON_EARLY "0 1 0 1 0 1" --cuda-graph --layers 8 \
        --peers cudnn --batch 32 --seqlens 8192 16384 32768 ;;
    bench-decode-gluon-warp-keys)
      # b = 32 beside cuDNN in 8-layer graphs (the table's setting), contiguous caches only: the Triton kernel
      # and the Gluon one, each twice, alternated, after tests-decode-gluon-warp-keys passed in this call (session 17
      # ran them at 8k, 16k and 64k, session 18 at 16k, 64k and 128k with the early refill, since removed)
      wk=FLASHTILE_DECODE_GLUON_WARP_KEYS runs="$wk=0|$wk=1"
      gate decode_gluon_warp_keys bench-decode-gluon-warp-keys && decode_runs decode_gluon_wk "$runs|$runs" \
        --cuda-graph --layers 8 --batch ${GLUON_WK_BATCH:-32} \
        --seqlens ${GLUON_WK_SEQLENS:-8192 16384 32768 65536 131072} --pages --peers cudnn ;;
    bench-decode-gluon-rule)
      # the grids the default rule gives the Gluon kernel beyond b = 32's: one program an SM (b = 16) and more
      # than two (b = 64), and b = 32 at 32k; Triton (0) against Gluon (1), alternated twice, after
      # tests-decode-gluon-warp-keys passed in this call
      wk=FLASHTILE_DECODE_GLUON_WARP_KEYS one="--batch 16 --seqlens 16384 65536" two="--batch 32 64 --seqlens 32768"
      gate decode_gluon_warp_keys bench-decode-gluon-rule && decode_runs decode_gluon_rule \
        "$wk=0 $one|$wk=1 $one|$wk=0 $two|$wk=1 $two|$wk=0 $one|$wk=1 $one|$wk=0 $two|$wk=1 $two" \
        --cuda-graph --layers 8 --pages --peers cudnn ;;
    bench-decode-gluon-append)
      # a serving step's append (--new-tokens 1) on the rule's shortest caches, where the Gluon kernel's gain was
      # smallest (0.1% at b = 32, 16k): its in-kernel append against the Triton kernel's, alternated twice, after
      # tests-decode-gluon-warp-keys passed in this call (GLUON_APPEND_SEQLENS overrides the lengths)
      wk=FLASHTILE_DECODE_GLUON_WARP_KEYS
      gate decode_gluon_warp_keys bench-decode-gluon-append && decode_runs decode_gluon_append "$wk=0|$wk=1|$wk=0|$wk=1" \
        --cuda-graph --layers 8 --batch 32 --seqlens ${GLUON_APPEND_SEQLENS:-16384} --new-tokens 1 --pages \
        --peers cudnn ;;
    tests-decode-gluon-rows)
      # the whole-row Gluon decode kernel (FLASHTILE_DECODE_GLUON_ROWS=1, session 19) against the reference
      TIMED_XDIST=1 timed_tests decode_gluon_rows tests/test_gpu_decode_gluon_rows.py ;;
    bench-decode-gluon-rows)
      # the whole-row Gluon kernel against the default (the per-head Gluon kernel at b = 32, the Triton split
      # kernel at b = 8) beside cuDNN in 8-layer graphs, alternated twice, after tests-decode-gluon-rows passed
      # (the 16-byte-copy kernel, as in session 19: the route's default is the TMA kernel since session 20)
      r=FLASHTILE_DECODE_GLUON_ROWS c="FLASHTILE_DECODE_GLUON_ROWS=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=0"
      gate decode_gluon_rows bench-decode-gluon-rows && decode_runs decode_gluon_rows "$r=0|$c|$r=0|$c" \
        --cuda-graph --layers 8 --batch ${GLUON_ROWS_BATCH:-32 8} --seqlens ${GLUON_ROWS_SEQLENS:-16384 65536 131072} \
        --pages --peers cudnn ;;
    bench-decode-gluon-rows-tma)
      # the whole-row kernel's TMA variant (session 20; FLASHTILE_DECODE_GLUON_ROWS_SLOTS: K,V tiles in flight)
      # against the default, beside cuDNN in 8-layer graphs, alternated twice (GLUON_ROWS_TMA_RUNS overrides the
      # settings after the default's, e.g. with FLASHTILE_DECODE_GLUON_ROWS_SPLITS=N)
      r=FLASHTILE_DECODE_GLUON_ROWS t="FLASHTILE_DECODE_GLUON_ROWS=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=1"
      sl=FLASHTILE_DECODE_GLUON_ROWS_SLOTS
      runs="$r=0|${GLUON_ROWS_TMA_RUNS:-$t $sl=3,3|$t $sl=2,1|$r=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=0}"
      gate decode_gluon_rows bench-decode-gluon-rows-tma && decode_runs decode_gluon_rows_tma "$runs|$runs" \
        --cuda-graph --layers 8 --batch ${GLUON_ROWS_BATCH:-32 8} --seqlens ${GLUON_ROWS_SEQLENS:-16384 65536 131072} \
        --pages --peers cudnn ;;
    bench-decode-head-major)
      # is the b = 32 gap to cuDNN the cache layout? flashtile on its (b, s, h_k, d) cache and on the peers'
      # head-major copies (--head-major: each kv head one contiguous stream, as cuDNN reads them), beside cuDNN,
      # in two rounds (HM_BATCH / HM_SEQLENS override the grid)
      python3 -m flashtile.bench decode --cuda-graph --layers 8 --batch ${HM_BATCH:-32} --head-major --rounds 2 \
        --seqlens ${HM_SEQLENS:-16384 65536 131072} --pages --peers cudnn --out "$WORK/decode_head_major.json" \
        2> "$WORK/bench_decode_head_major.log" >> "$summary" ;;
    tests-decode-rows)
      # the row-stream decode experiment (FLASHTILE_DECODE_ROWS=H) against the reference; at most 4 workers: each
      # keeps up to 15 GiB cached, and 8 of them beside the big-cache group ran the GPU out of memory (session 26)
      all_workers=("${xdist[@]}")
      [[ ${#xdist[@]} -gt 0 && ${GPU_TEST_WORKERS:-8} -gt 4 ]] && xdist=(-n 4 --dist loadgroup)
      # an 80 GB H100: one process (the big-cache worker keeps up to 65 GiB cached; beside three others 45 tests ran
      # out of memory on D34, beside one other 13 on E34)
      mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | sort -n | head -1)
      [[ $mem =~ ^[0-9]+$ && $mem -lt 100000 ]] && xdist=()
      TIMED_XDIST=1 timed_tests decode_rows tests/test_gpu_decode_rows.py
      xdist=("${all_workers[@]}") ;;  # the later steps keep their workers
    bench-decode-rows)
      # the row-stream decode experiment at b = 32 beside the default (Gluon) and cuDNN, after tests-decode-rows
      # passed in this call: one kv head a program on both layouts (the kernel's own layout cost), then 2, 4
      # and 8 adjacent heads a program (contiguous 512 B, 1 KB, 2 KB of each key row), and 4 at a deeper ring
      r=FLASHTILE_DECODE_ROWS
      gate decode_rows bench-decode-rows && decode_runs decode_rows \
        "${ROWS_SETTINGS:-$r=0 --head-major|$r=1 --head-major|$r=2|$r=4|$r=8|$r=4 ${r}_CFG=16,4,4}" --cuda-graph \
        --layers 8 --batch 32 --seqlens ${ROWS_SEQLENS:-16384 65536 131072} --pages --peers cudnn ;;
    bench-decode-fused-append)
      # the Triton kernel's in-kernel append against the separate append kernel (FLASHTILE_DECODE_FUSED_APPEND=1 / 0,
      # alternated twice) at b = 1 / 8, where an append cost the decode kernel 5-8 us in session 19
      # (probe_decode_append_leaseC_h200_2026-12-01_session19.json)
      decode_ab - decode_fused_append FLASHTILE_DECODE_FUSED_APPEND "1 0 1 0" --cuda-graph --layers 8 --new-tokens 1 \
        --batch ${FUSED_APPEND_BATCH:-1 8} --seqlens ${FUSED_APPEND_SEQLENS:-8192 32768 131072} --pages 16 --peers cudnn ;;
    bench-decode-layers-append)
      # the 8-layer table with every flashtile call appending one key, as a serving step does (--new-tokens 1; the
      # peers append nothing), contiguous and paged, beside cuDNN
      python3 -m flashtile.bench decode --cuda-graph --layers 8 --new-tokens 1 --peers cudnn ${LAYERS_BENCH_ARGS:-} \
        --out "$WORK/decode_graph_layers8_append.json" 2> "$WORK/bench_decode_layers_append.log" >> "$summary" ;;
    bench-decode-pdl-append)
      # does a call that appends want its decode kernels launched as programmatic dependents on larger caches?
      # (session 27's lead: b = 1, 128k faster with them, b = 8 from 16k slower)
      decode_runs pdl_append "FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1|FLASHTILE_DECODE_PDL=1 FLASHTILE_DECODE_APPEND_PDL=0|FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1|FLASHTILE_DECODE_PDL=1 FLASHTILE_DECODE_APPEND_PDL=0" \
        --cuda-graph --layers 8 --new-tokens 1 --pages --peers --batch 1 2 4 8 --seqlens 32768 65536 131072
      decode_runs pdl_noappend "FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1|FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1" \
        --cuda-graph --layers 8 --pages --peers --batch 1 2 4 --seqlens 65536 131072 ;;
    bench-decode-rows-nomerge)
      # the split merge costs 2.4-3.6 us a call at b = 32 (session 24): do narrower programs that need none pay less?
      decode_runs rows_nomerge "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=2 FLASHTILE_DECODE_ROWS_SPLITS=1 FLASHTILE_DECODE_ROWS_CFG=64,4,3|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_SPLITS=2 FLASHTILE_DECODE_ROWS_CFG=32,4,3|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=2 FLASHTILE_DECODE_ROWS_SPLITS=1 FLASHTILE_DECODE_ROWS_CFG=64,4,3|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_SPLITS=2 FLASHTILE_DECODE_ROWS_CFG=32,4,3" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 32 --seqlens 65536 131072 ;;
    bench-decode-rows4)
      decode_runs rows4 "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,4,3|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,8,3|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,4,3|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,8,3" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 32 --seqlens 65536 131072
      decode_runs rows4_b64 "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,4,3|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_CFG=32,4,3" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 64 --seqlens 8192 16384
      ;;
    bench-decode-rows4-rule)
      decode_runs rows4_rule "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=8|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=8" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 32 --seqlens 65536 131072 ;;
    bench-decode-rows4-small)
      # session 27's 4-head grid (16-key tiles, two programs an SM) lost at b = 8; does session 28's tile win there?
      decode_runs rows4_small "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=4" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 8 16 32 --seqlens 8192 32768 131072 ;;
    tests-decode-board)
      # the board class's measurement and the full-grid boards' decode rule against the reference (session 29)
      timed_tests decode_board tests/test_gpu_decode_board.py ;;
    probe-board-ratio)
      # how steady is the board class's measurement (P128 / P132, 5 repeats at 256 MiB and at its 1 GiB)?
      python3 scripts/probe_board_ratio.py --out "$WORK/board_ratio.json" >> "$summary" 2> "$WORK/board_ratio.log" ;;
    bench-decode-fast-rows)
      # the rows that trail cuDNN by 0.02%-0.07% on fast boards (session 30: A30, D30, E30), each against kernels that
      # could take them there, beside cuDNN, the default first and last: b = 32 at 8k / 16k (the per-head Gluon kernel)
      # against the Triton per-head kernel, half rows and whole rows; b = 8 at 64k / 128k (the per-head split kernel,
      # 128 programs) against cuDNN's grid (4 splits at 2 stages: 256 programs, two an SM), half rows and whole-row
      # stream-K. Only a fast board's result can change a rule (sample_board.sh runs it there)
      dflt=FLASHTILE_DECODE_ROWS=
      decode_runs fast_rows_b32 "$dflt|FLASHTILE_DECODE_GLUON_WARP_KEYS=0|FLASHTILE_DECODE_ROWS=4|FLASHTILE_DECODE_ROWS=8|$dflt" \
        --cuda-graph --layers 8 --peers cudnn --pages --batch 32 --seqlens 8192 16384
      decode_runs fast_rows_b8 "$dflt|FLASHTILE_DECODE_STAGES=2 --num-splits 4|FLASHTILE_DECODE_ROWS=4|FLASHTILE_DECODE_ROWS=8 FLASHTILE_DECODE_ROWS_STREAMK=1|$dflt" \
        --cuda-graph --layers 8 --peers cudnn --pages --batch 8 --seqlens 65536 131072 ;;
    bench-decode-b8-pdl)
      # b = 8, 128k trails cuDNN by 0.02%-0.07% on fast boards (session 30; the per-head split kernel, whose merge
      # alone is a programmatic dependent): the whole call as programmatic dependents (FLASHTILE_DECODE_PDL=1: the
      # split kernel waits on the previous layer's merge, so its launch overlaps it) against the default, 0 1 0 1
      # (sample_board.sh runs it on fast boards; full-grid boards' row kernels take PDL already)
      decode_runs b8_pdl "FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1|FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=1" \
        --cuda-graph --layers 8 --peers cudnn --batch 8 --seqlens 131072 ;;
    bench-decode-full-grid-b4)
      # b = 4 on a full-grid board trails cuDNN by 1.3%-1.7% at 128k (C30: the per-head split kernel, 128 programs; the
      # full-grid rule does not cover b = 4): the default against half rows and whole-row stream-K, beside cuDNN,
      # the default first and last (sample_board.sh runs it on full-grid boards)
      dflt=FLASHTILE_DECODE_ROWS=
      decode_runs full_grid_b4 "$dflt|FLASHTILE_DECODE_ROWS=4|FLASHTILE_DECODE_ROWS=8 FLASHTILE_DECODE_ROWS_STREAMK=1|FLASHTILE_DECODE_ROWS=4 FLASHTILE_DECODE_ROWS_STREAMK=1|$dflt" \
        --cuda-graph --layers 8 --peers cudnn --pages --batch 4 --seqlens 32768 131072 ;;
    bench-decode-merge-pdl)
      # split calls past use_pdl's bound (b = 1 from 128k, b = 2-8) with the merge alone as a programmatic dependent
      # (FLASHTILE_DECODE_MERGE_PDL=1) against ordinary launches, beside cuDNN, 0 1 0 1 (session 30; after
      # tests-decode-pdl, which holds its bitwise test)
      decode_ab decode_pdl decode_merge_pdl FLASHTILE_DECODE_MERGE_PDL "0 1 0 1" --cuda-graph --layers 8 --peers cudnn \
        --pages ${MERGE_PDL_PAGES:-} --batch ${MERGE_PDL_BATCH:-1 4 8} --seqlens ${MERGE_PDL_SEQLENS:-16384 65536 131072} ;;
    bench-decode-board)
      # the bar's rows with each board class's rule forced (FLASHTILE_DECODE_BOARD=normal / full-grid, alternated
      # twice): on a normal board what a wrong class costs, on a full-grid board what the rule gains
      decode_runs decode_board "FLASHTILE_DECODE_BOARD=normal|FLASHTILE_DECODE_BOARD=full-grid|FLASHTILE_DECODE_BOARD=normal|FLASHTILE_DECODE_BOARD=full-grid" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch ${BOARD_BATCH:-1 2 8 16 32} --seqlens ${BOARD_SEQLENS:-32768 65536 131072} ;;
    bench-decode-rows-b16)
      # b = 16 from 128k takes half rows since session 29 (NARROW_RULE_BOUNDS): the rule against the per-head kernel
      # (FLASHTILE_DECODE_ROWS=0) at 64k / 128k beside cuDNN, twice
      decode_runs rows_b16_rule "FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=0|FLASHTILE_DECODE_ROWS=|FLASHTILE_DECODE_ROWS=0" \
        --cuda-graph --layers 8 --pages --peers cudnn --batch 16 --seqlens 65536 131072 ;;
    probe-append-pdl-idle)
      python3 scripts/probe_streamk.py --stamps --new-tokens 1 --seqlens 65536 \
        --settings append_pdl=FLASHTILE_DECODE_ROWS_STREAMK=0,FLASHTILE_DECODE_APPEND_PDL=1 \
        --out "$WORK/append_pdl_idle_stamps.json" >> "$summary" 2> "$WORK/append_pdl_idle.log" ;;
    bench-decode-pdl-append-rule)
      decode_runs pdl_append_rule "FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=0|FLASHTILE_DECODE_PDL=|FLASHTILE_DECODE_PDL=0" \
        --cuda-graph --layers 8 --new-tokens 1 --pages 16 256 --peers --batch 1 2 --seqlens 65536 131072 262144 ;;
    bench-decode-b32-tma)
      # the descriptor-load rule was measured at 3 stages (session 10); b = 32 runs at 2 since session 12
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_ab - decode_b32_tma FLASHTILE_DECODE_TMA "0 1 0 1" --cuda-graph --layers 8 --batch 32 \
        --seqlens 16384 65536 --pages --peers cudnn ;;
    bench-decode-b8-split4)
      # b = 8 beside cuDNN in 8-layer graphs: the heuristic's 2 splits (128 programs, one 139 KB CTA per SM)
      # against cuDNN's shape (Nsight Compute, session 13: 4 splits, 256 CTAs of 86 KB, two per SM, 96% of
      # DRAM peak against our 93.5%): 4 splits at 2 stages, and 4 splits at 3 (two waves); twice
      st3=FLASHTILE_DECODE_STAGES=3 st2=FLASHTILE_DECODE_STAGES=2
      decode_runs decode_b8_split4 "$st3|$st2 --num-splits 4|$st3 --num-splits 4|$st3|$st2 --num-splits 4" \
        --cuda-graph --layers 8 --batch 8 --seqlens 16384 65536 131072 --pages --peers cudnn ;;
    bench-decode-block-n)
      # the contiguous cache's split launches (b = 1 and 8) with the table's 128-key tiles against 64
      # (FLASHTILE_DECODE_BLOCK_N), 8-layer graphs beside cuDNN, alternated twice: session 13's single-call
      # sweep (tune_decode_b1_p16_h200_2026-11-30_session13.json) found (64, 4, 3) 3%-4% faster at b = 1, 8k / 16k
      decode_ab - decode_block_n FLASHTILE_DECODE_BLOCK_N "128 64 128 64" \
        --cuda-graph --layers 8 --batch 1 8 --seqlens 8192 16384 65536 --pages --peers cudnn ;;
    tests-decode-long-warps)
      # 8-warp decode launches for long programs (FLASHTILE_DECODE_LONG_WARPS) against the reference, alone
      timed_tests decode_long_warps tests/test_gpu_decode_long_warps.py ;;
    bench-decode-long-warps-rounds)
      # the long rows beside cuDNN with --rounds 4 (the order of measurement rotating, each first in two
      # rounds; medians), the table's 4 warps then 8 for programs of >= 256 key blocks; after
      # tests-decode-long-warps (one pair per call: the 128k rows take minutes)
      FLASHTILE_DECODE_GLUON_WARP_KEYS=0 decode_ab decode_long_warps decode_layers8_long_warps FLASHTILE_DECODE_LONG_WARPS "0 8" \
        --cuda-graph --layers 8 --batch 8 32 --seqlens 32768 131072 --pages --peers cudnn --rounds 4 ;;
    tests-decode-pdl)
      # programmatic dependent launch for the decode kernels (FLASHTILE_DECODE_PDL), alone and timed out
      timed_tests decode_pdl tests/test_gpu_decode_pdl.py ;;
    bench-decode-layers-pdl)
      # bench-decode-layers' first table with FLASHTILE_DECODE_PDL=1, after tests-decode-pdl passed
      # (ordinary launches first, in the same call, for the ratio)
      if tests_passed decode_pdl; then
        FLASHTILE_DECODE_PDL=0 python3 -m flashtile.bench decode --cuda-graph --layers 8 ${PDL_BENCH_ARGS:-} \
          --out "$WORK/decode_graph_layers8_nopdl.json" 2> "$WORK/bench_decode_layers_pdl.log" >> "$summary"
        pack
        FLASHTILE_DECODE_PDL=1 python3 -m flashtile.bench decode --cuda-graph --layers 8 ${PDL_BENCH_ARGS:-} \
          --out "$WORK/decode_graph_layers8_pdl.json" 2>> "$WORK/bench_decode_layers_pdl.log" >> "$summary"
      else
        echo "bench-decode-layers-pdl: skipped (tests-decode-pdl did not pass in this call)" >> "$summary"
      fi ;;
    bench-decode-layers)
      # per-call time inside a graph of 8 decode calls on 8 caches (a model step's layers), then
      # b = 1 as single-call graphs in the same process for comparison
      python3 -m flashtile.bench decode --cuda-graph --layers 8 ${LAYERS_BENCH_ARGS:-} --out "$WORK/decode_graph_layers8.json" \
        --plot "$WORK/decode_graph_layers8.png" 2> "$WORK/bench_decode_layers.log" >> "$summary"
      pack
      python3 -m flashtile.bench decode --cuda-graph --batch 1 --out "$WORK/decode_graph_b1_layers1.json" \
        2>> "$WORK/bench_decode_layers.log" >> "$summary" ;;
    bench-decode)
      python3 -m flashtile.bench decode --out "$WORK/decode.json" --plot "$WORK/decode.png" \
        2> "$WORK/bench_decode.log" >> "$summary"
      pack
      python3 -m flashtile.bench decode --cuda-graph --out "$WORK/decode_graph.json" --plot "$WORK/decode_graph.png" \
        2>> "$WORK/bench_decode.log" >> "$summary" ;;
    *) echo "unknown step: $step" | tee -a "$summary"; status=2 ;;
  esac
  pack
done
echo "== gpu_check done: tests exit status $status; results in $OUT/gpu_check.tgz" | tee -a "$summary"
cat "$summary"
exit $status
