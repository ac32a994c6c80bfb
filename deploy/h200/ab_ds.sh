#!/usr/bin/env bash
# One device call on a lent H200 (~5 minutes): the GPU-marked attention tests, then deploy/h200/ab_ds.py
# (DS_STORE backward vs the recomputing one vs varlen_attn; five processes compile first), then its --profile
# (per-launch device time of the variants in PROFILE). Same package layout as kernels_bench.sh. From the root:
#   OUT=$OUT bash deploy/h200/ab_ds.sh
# Knobs: TESTS (1: run the GPU tests), TEST_S (150), WARM_S (180), AB_S (240), PROF_S (120), PROFILE, CASES (indices
# into ab_ds.py's CASES, comma-separated).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}; TEST_S=${TEST_S:-150}; WARM_S=${WARM_S:-180}; AB_S=${AB_S:-240}
PROF_S=${PROF_S:-120}; PROFILE=${PROFILE:-rec,ds}; TESTS=${TESTS:-1}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}
rm -rf "$P"; mkdir -p "$P" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r tests pyproject.toml deploy/h200/ab_ds.py "$P/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/nvidia-smi.txt" 2>&1
for i in 0 1 2 3 4; do timeout -k 5 "$WARM_S" python3 ab_ds.py --warm "$i" ${CASES:+--cases "$CASES"} > "$OUT/warm_$i.log" 2>&1 & done
if [ "$TESTS" = 1 ]; then
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_kernels_attention.py 2>/dev/null \
    | grep '::' > "$OUT/gpu_ids.txt"
  split -n r/6 "$OUT/gpu_ids.txt" "$OUT/gpu_chunk_"
  for f in "$OUT"/gpu_chunk_*; do
    # shellcheck disable=SC2046
    timeout -k 5 "$TEST_S" python3 -m pytest -q -p no:cacheprovider -rfE $(cat "$f") > "$f.log" 2>&1 &
  done
fi
wait
echo "== GPU tests and compile after $(( $(date +%s) - T0 )) s"
if [ "$TESTS" = 1 ]; then
  grep -hE "^(FAILED|ERROR)|passed|failed|error" "$OUT"/gpu_chunk_*.log | cut -c1-300
  cat "$OUT"/gpu_chunk_*.log > "$OUT/pytest.log"; rm -f "$OUT"/gpu_chunk_* "$OUT/gpu_ids.txt"
fi
cat "$OUT"/warm_*.log > "$OUT/warm.log"; rm -f "$OUT"/warm_*.log
grep -h "Error\|error" "$OUT/warm.log" | sort | uniq -c | head -5
echo "== A/B DS_STORE"
timeout -k 5 "$AB_S" python3 ab_ds.py ${CASES:+--cases "$CASES"} > "$OUT/ab_ds.log" 2>&1
echo "ab rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/ab_ds.log"
cut -c1-220 "$OUT/ab_ds.log" | tail -80
echo "== per-launch device time"
timeout -k 5 "$PROF_S" python3 ab_ds.py --profile "$PROFILE" > "$OUT/profile.log" 2>&1
echo "profile rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/profile.log"
cut -c1-300 "$OUT/profile.log"
echo "total $(( $(date +%s) - T0 )) s"
