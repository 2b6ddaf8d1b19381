#!/usr/bin/env bash
# Session 20: where does the whole-row TMA decode kernel (3,3 ring) beat the default? The default (arm 0) against
# it (arm 1), alternated twice, beside cuDNN in 8-layer graphs.
#   bash scripts/gpu_rows_tma_rule.sh         b = 16 / 64 at 32k-128k, b = 32 at 32k, and b = 32 / 8 at 64k / 128k
#                                             with one appended key a call (rows_tma_rule_*.json)
#   bash scripts/gpu_rows_tma_rule.sh probe   which H200 is this (nvidia-smi -q: clocks, power), and b = 32 at
#                                             64k / 128k only (lease_probe_*.json)
# RULE_ON / RULE_OFF override the two arms' settings. Packs its results into $OUT/rows_tma_rule.tgz after every run
# (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
on=${RULE_ON:-FLASHTILE_DECODE_GLUON_ROWS=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=1 FLASHTILE_DECODE_GLUON_ROWS_SLOTS=3,3}
off=${RULE_OFF:-FLASHTILE_DECODE_GLUON_ROWS=0}
run() {  # run NAME SETTING ARGS...
  local name=$1 setting=$2
  shift 2
  env $setting python3 -m flashtile.bench decode --cuda-graph --layers 8 --pages --peers cudnn "$@" \
    --out "$WORK/${name}_$SECONDS.json" 2>> "$WORK/rows_tma_rule.log" | tail -n +3
  tar czf "$OUT/rows_tma_rule.tgz" -C "$WORK" .
}
[[ ${1:-} == probe ]] && nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,MEMORY > "$WORK/nvidia_smi_q.txt" 2>&1
for round in 1 2; do
  for arm in 0 1; do
    setting=$off; [[ $arm == 1 ]] && setting=$on
    if [[ ${1:-} == probe ]]; then
      run "lease_probe_$arm" "$setting" --batch 32 --seqlens 65536 131072
      continue
    fi
    run "rows_tma_rule_grid_$arm" "$setting" --batch 16 64 --seqlens 32768 65536 131072
    run "rows_tma_rule_b32_$arm" "$setting" --batch 32 --seqlens 32768
    run "rows_tma_rule_append_$arm" "$setting" --batch 32 8 --seqlens 65536 131072 --new-tokens 1
  done
done
