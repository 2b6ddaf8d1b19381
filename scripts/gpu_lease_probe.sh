#!/usr/bin/env bash
# Session 20: which H200 is this, and does the whole-row TMA decode kernel (3,3) win or lose on it? Records the
# board's clocks and power (nvidia-smi -q) and times b = 32 at 64k / 128k, default (0) against the TMA kernel (1),
# alternated twice, in 8-layer graphs beside cuDNN. Packs everything into $OUT/lease_probe.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,MEMORY > "$WORK/nvidia_smi_q.txt" 2>&1
on="FLASHTILE_DECODE_GLUON_ROWS=1 FLASHTILE_DECODE_GLUON_ROWS_TMA=1 FLASHTILE_DECODE_GLUON_ROWS_SLOTS=3,3"
for round in 1 2; do
  for arm in 0 1; do
    setting="FLASHTILE_DECODE_GLUON_ROWS=0"; [[ $arm == 1 ]] && setting=$on
    env $setting python3 -m flashtile.bench decode --cuda-graph --layers 8 --batch 32 --seqlens 65536 131072 \
      --peers cudnn --out "$WORK/lease_probe_${arm}_$SECONDS.json" 2>> "$WORK/lease_probe.log" | tail -n +3
    tar czf "$OUT/lease_probe.tgz" -C "$WORK" .
  done
done
