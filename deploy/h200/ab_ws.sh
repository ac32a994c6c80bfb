#!/usr/bin/env bash
# One device call on a lent H200: compile (four processes), the Gluon forward's check against the Triton
# forward (deploy/h200/ab_ws.py --check), optionally the GPU-marked WS tests, then the A/B timing. Same package
# layout as kernels_bench.sh. From the repo root:  OUT=$OUT bash deploy/h200/ab_ws.sh
# Knobs: TESTS (1: the GPU-marked ws tests), WARM_S (150), CHECK_S (120), AB_S (240).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}; WARM_S=${WARM_S:-150}; CHECK_S=${CHECK_S:-120}; AB_S=${AB_S:-240}
TESTS=${TESTS:-1}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}
rm -rf "$P"; mkdir -p "$P" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r tests pyproject.toml deploy/h200/ab_ws.py "$P/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
for i in 0 1 2 3; do timeout -k 5 "$WARM_S" python3 ab_ws.py --warm "$i" > "$OUT/warm_$i.log" 2>&1 & done
wait
echo "== compiled after $(( $(date +%s) - T0 )) s"
cat "$OUT"/warm_*.log > "$OUT/warm.log"; rm -f "$OUT"/warm_*.log
grep -h "Error\|error" "$OUT/warm.log" | sort | uniq -c | head -5
tail -5 "$OUT/warm.log" | cut -c1-400
echo "== check"
timeout -k 5 "$CHECK_S" python3 ab_ws.py --check > "$OUT/check.log" 2>&1
echo "check rc=$?" >> "$OUT/check.log"; cut -c1-300 "$OUT/check.log" | tail -40
if [ "$TESTS" = 1 ]; then
  echo "== GPU tests (ws)"
  timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -k "ws" tests/test_kernels_attention.py \
    > "$OUT/pytest.log" 2>&1; tail -15 "$OUT/pytest.log" | cut -c1-300
fi
echo "== A/B"
timeout -k 5 "$AB_S" python3 ab_ws.py > "$OUT/ab_ws.log" 2>&1
echo "ab rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/ab_ws.log"
cut -c1-220 "$OUT/ab_ws.log" | tail -60
echo "total $(( $(date +%s) - T0 )) s"
