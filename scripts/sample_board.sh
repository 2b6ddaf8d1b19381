#!/usr/bin/env bash
# One board's standing on the KV-cache bar, its class, and the split rule's A/B: most valuable first, since leases
# have been short and scarce (session 33: twelve refused calls before one H100).
# Usage (device): OUT=/some/dir PYTHONPATH=src bash scripts/sample_board.sh      (SAMPLE_TABLE=0: no table)
# 1. tests-decode-board (the run-time board measurement and the full-grid routes, stream-K among them, against the
#    reference), tests-decode-gluon-splits (the split Gluon kernel and its rule, session 32), then bench-decode-layers
#    with the bar's rows (b = 1, 8, 32; 8k-128k; 3 rounds; the default: the board measured at run time), about 2 min,
#    then tests-decode-rows (the row kernels and their rules, the H100 bounds among them).
# 2. probe-sm-balance at 8 GiB: an even 132-program read (about 1869 us on the usual H200; fast boards read it in
#    about 1830) and a 128-program one (J24 / E26 / C29's kind, "full-grid" boards: 128 programs 1.9%-2.5% slower);
#    probe-board-ratio: the run-time board measurement (backends/triton/board.py) repeated.
# 3. bench-decode-gluon-split-rule: the split rule (b = 4-16 from 32k keys) against FLASHTILE_DECODE_GLUON_SPLITS=1
#    (the rule before), twice each, beside cuDNN; measured on the H100s A32 / A33 / A34 and the H200 A35. Then
#    bench-decode-b32-kernels: b = 32 at 64k-128k on the default, the Gluon kernel and whole rows (an H100 wanted
#    other kernels there than an H200, session 34); on an H100 only this one.
# Results: $OUT/gpu_check.tgz (every step's files), summary_table.txt, summary_balance.txt, summary.txt, serial.txt.
set -u
export WORK=${WORK:-/tmp/sample_board_work}  # outside $OUT: only the archive and summaries come back
nvidia-smi --query-gpu=name,serial --format=csv,noheader > "$OUT/serial.txt"
steps=(tests-decode-board tests-decode-gluon-splits)
[[ ${SAMPLE_TABLE:-1} == 1 ]] && steps+=(bench-decode-layers)
steps+=(tests-decode-rows)  # the row kernels and their rule (the H100 bounds' GPU tests, session 34), after the table
LAYERS_BENCH_ARGS="--rounds 3 --batch 1 8 32" TIMED_XDIST=1 bash scripts/gpu_check.sh "${steps[@]}" > /dev/null 2>&1
cp "$OUT/summary.txt" "$OUT/summary_table.txt"
grep -E 'passed|failed' "$OUT/summary_table.txt" | head -5
grep -A18 ' b  seqlen_k' "$OUT/summary_table.txt" | head -19
BALANCE_GIB=8 bash scripts/gpu_check.sh probe-sm-balance probe-board-ratio > /dev/null 2>&1
cp "$OUT/summary.txt" "$OUT/summary_balance.txt"
read -r p132 p128 <<< "$(awk '/even_P132/{a=$2} /even_P128/{b=$2} END{print a, b}' "$OUT/summary_balance.txt")"
# this script's own class, from the 8 GiB probe (normal boards 1.0011-1.0024 there, C29 1.0249); the library decides
# by its own 1 GiB measurement (backends/triton/board.py), which probe-board-ratio prints
kind=$(python3 -c "import sys; a, b = map(float, sys.argv[1:]); print('full-grid' if b / a > 1.006 else 'fast' if a < 1850 else 'normal')" \
  "$p132" "$p128")
echo "board $(cat "$OUT/serial.txt"): even_P132 $p132 us, even_P128 $p128 us: $kind"
grep -E 'MiB: P128' "$OUT/summary_balance.txt"
# the A/Bs are gated on tests-decode-gluon-splits having passed in step 1 (same WORK); on an H100 (the split rule
# measured on three already) only the b = 32 kernels, to replicate its own bounds (timed kernel by kernel on one
# normal H100, C34; the tables of D34 and B35-E35 ran with them)
abs=(bench-decode-gluon-split-rule bench-decode-b32-kernels)
grep -q H100 "$OUT/serial.txt" && abs=(bench-decode-b32-kernels)
TIMED_XDIST=1 bash scripts/gpu_check.sh "${abs[@]}" > /dev/null 2>&1
grep -B2 -A12 ' b  seqlen_k' "$OUT/summary.txt" | tail -60
