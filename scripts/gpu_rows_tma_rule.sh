#!/usr/bin/env bash
# Session 20: where does the whole-row TMA decode kernel (3,3 ring) beat the default? The default (0) against it (1),
# alternated twice, beside cuDNN in 8-layer graphs: b = 16 / 64 at 32k-128k, b = 32 at 32k, and b = 32 / 8 at
# 64k / 128k with one appended key a call. RULE_ON / RULE_OFF override the two arms' settings. Packs its
# rows_tma_rule_*.json into $OUT/rows_tma_rule.tgz after every run (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
on=${RULE_ON:-FLASHTILE_DECODE_GLUON_ROWS=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=1 FLASHTILE_DECODE_GLUON_ROWS_SLOTS=3,3}
off=${RULE_OFF:-FLASHTILE_DECODE_GLUON_ROWS=0}
run() {  # run TAG SETTING ARGS...
  local tag=$1 setting=$2
  shift 2
  env $setting python3 -m flashtile.bench decode --cuda-graph --layers 8 --pages --peers cudnn "$@" \
    --out "$WORK/rows_tma_rule_${tag}_$SECONDS.json" 2>> "$WORK/rows_tma_rule.log" | tail -n +3
  tar czf "$OUT/rows_tma_rule.tgz" -C "$WORK" .
}
for round in 1 2; do
  for arm in 0 1; do
    setting=$off; [[ $arm == 1 ]] && setting=$on
    run "grid_$arm" "$setting" --batch 16 64 --seqlens 32768 65536 131072
    run "b32_$arm" "$setting" --batch 32 --seqlens 32768
    run "append_$arm" "$setting" --batch 32 8 --seqlens 65536 131072 --new-tokens 1
  done
done
