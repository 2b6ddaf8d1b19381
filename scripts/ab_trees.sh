#!/usr/bin/env bash
# A/B of two source trees on one card: the same `python -m flashtile.bench` command run alternately on a base
# tree and on this checkout's src/, ROUNDS times each (base first in odd rounds, head first in even ones), then
# the flashtile / cuDNN columns side by side (scripts/ab_table.py; decode tables).
#
# Prepare the base tree where git is (the device copy has no history), ignored and carried:
#   mkdir -p .ab && git archive REV src | tar -x -C .ab && echo /.ab/ >> .git/info/exclude
# then on the GPU machine (carry ".ab"):
#   OUT=$OUT bash scripts/ab_trees.sh .ab/src 3 decode --cuda-graph --layers 8 --batch 1 8 32
# Files: $OUT/ab_base_<seconds>.json and $OUT/ab_head_<seconds>.json, one per run, in the names
# scripts/merge_ab.py reads (--prefix ab_ --setting tree).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { sed -n '2,12p' "$0"; exit 2; }
base=$1 rounds=$2
shift 2
[ -d "$base/flashtile" ] || { echo "no flashtile package under $base"; exit 2; }
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$SECONDS
run() {
  local name=$1 src=$2
  shift 2
  echo "=== $name (round $r): $*"
  PYTHONPATH="$src" python -m flashtile.bench "$@" --out "$OUT/ab_${name}_$((SECONDS - t0)).json" 2>&1 | tail -3
}
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then
    run base "$base" "$@"; run head src "$@"
  else
    run head src "$@"; run base "$base" "$@"
  fi
done
python scripts/ab_table.py "$OUT"/ab_*.json
