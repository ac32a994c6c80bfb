#!/usr/bin/env bash
# One device call on a lent H200 (~2 minutes): deploy/h200/ab_plan.py, the launch plans against the code before
# them (OLD_KERNELS: a folder holding that version's kernels/, e.g. carried as .gpu/old), alternating processes.
# Same package layout as kernels_bench.sh. From the repo root:
#   OLD_KERNELS=.gpu/old/kernels OUT=$OUT bash deploy/h200/ab_plan.sh
# Knobs: AB_S (200), ROUNDS (3).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}; AB_S=${AB_S:-200}; ROUNDS=${ROUNDS:-3}
OLD_KERNELS=${OLD_KERNELS:?set OLD_KERNELS to the older kernels/ folder}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}
rm -rf "$P" "$P-old"; mkdir -p "$P" "$P-old" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r gemray "$P-old/" && cp -r "$OLD_KERNELS" "$P-old/gemray/kernels" \
  && cp -r pipelines "$P-old/gemray/pipelines" && cp deploy/h200/ab_plan.py "$P/" && cp deploy/h200/ab_plan.py "$P-old/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
timeout -k 5 "$AB_S" python3 ab_plan.py --trees "$P-old" "$P" --rounds "$ROUNDS" > "$OUT/ab_plan.log" 2>&1
echo "ab rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/ab_plan.log"
cut -c1-250 "$OUT/ab_plan.log" | tail -40
