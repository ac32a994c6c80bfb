#!/usr/bin/env bash
# One device call on a lent H200 (under 6 minutes): the GPU-marked kernel tests, then the full kernel bench
# (jagged attention vs varlen_attn / padded SDPA / FlexAttention, cross/PMA, block, norm+FP8) after a
# per-regime sweep of tiles and backward launch modes (the winners are used by the rest of the run and
# printed as a --tiles JSON). gemray is not installed on the device, so the tree is copied into a package
# layout first (kernels/ -> gemray/kernels). From the repository root:
#   OUT=$OUT bash deploy/h200/kernels_bench.sh
# Knobs: TOTAL_S (default 340: whole script), TEST_S (150: precompile, and again 150: pytest),
# SWEEP_BUDGET (120: sweep timing, split evenly over the 4 regimes), SWEEP=0 (no precompile, no sweep),
# TILES_JSON (the "chosen tiles" JSON an earlier run printed: pins tiles and launch modes; run 4's winners
# are the defaults since kern4), BENCH_ARGS
# (extra bench flags without spaces inside a value, e.g. --skip=flex).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}; TOTAL_S=${TOTAL_S:-340}; TEST_S=${TEST_S:-150}
SWEEP_BUDGET=${SWEEP_BUDGET:-120}; SWEEP=${SWEEP:-1}; BENCH_ARGS=${BENCH_ARGS:-}; TILES_JSON=${TILES_JSON:-}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}   # shared by the tests and the bench
rm -rf "$P"; mkdir -p "$P" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r tests pyproject.toml "$P/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1
TESTS="tests/test_kernels_attention.py tests/test_kernels_norm_quant.py"
gpu_tests() {  # 8 pytest processes: pytest-xdist when installed, else the collected ids dealt 8 ways
  if python3 -c "import xdist" 2>/dev/null; then
    # shellcheck disable=SC2086
    python3 -m pytest -n 8 -m gpu -q -p no:cacheprovider -rfE $TESTS > "$OUT/pytest.log" 2>&1
    return
  fi
  # shellcheck disable=SC2086
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider $TESTS 2>/dev/null | grep '::' > "$OUT/gpu_ids.txt"
  split -n r/8 "$OUT/gpu_ids.txt" "$OUT/gpu_chunk_"
  for f in "$OUT"/gpu_chunk_*; do
    # shellcheck disable=SC2046
    python3 -m pytest -q -p no:cacheprovider -rfE $(cat "$f") > "$f.log" 2>&1 &
  done
  wait
  cat "$OUT"/gpu_chunk_*.log > "$OUT/pytest.log"
}
# First the compilation of every sweep candidate (8 processes, into the shared Triton cache), then the GPU tests
# (8 pytest processes). Not side by side: run 6 ran them together and two tests hit CUDA out-of-memory, the 16
# processes' contexts and reference tensors filling the GPU. Nothing is timed until both are done.
echo "== $(date -u +%T) precompile, then pytest -m gpu"
if [ "$SWEEP" = 1 ]; then
  timeout -k 10 "$TEST_S" python3 -m gemray.kernels.bench --out "$OUT/precompile" --precompile 8 --precompile-only \
    > "$OUT/precompile.log" 2>&1
  echo "precompile rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/precompile.log"
fi
export -f gpu_tests; export OUT TESTS
timeout -k 10 "$TEST_S" bash -c gpu_tests
echo "pytest rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.log"
LEFT=$(( TOTAL_S - ($(date +%s) - T0) - 10 ))
SW=""; [ "$SWEEP" = 1 ] && SW="--sweep --sweep-budget $SWEEP_BUDGET"
echo "== $(date -u +%T) bench ($LEFT s left) $SW $BENCH_ARGS"
# shellcheck disable=SC2086  # SW / BENCH_ARGS are flag lists
TILES_ARG=(); [ -n "$TILES_JSON" ] && TILES_ARG=(--tiles "$TILES_JSON")
timeout -k 10 $(( LEFT + 5 )) python3 -m gemray.kernels.bench --out "$OUT" --time-limit "$LEFT" $SW $BENCH_ARGS \
  "${TILES_ARG[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/bench.log"
# this host's Python/torch work per fwd+bwd around the launches (launches stubbed; CPU only, a few seconds)
timeout -k 5 30 python3 -m gemray.kernels.bench --host-profile > "$OUT/host_profile.log" 2>&1
# the reply carries the last 12,000 characters: failures and the pytest summary, then the bench's tables
echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|skipped|rc=" "$OUT/pytest.log" | tail -25
[ -f "$OUT/gpu_ids.txt" ] && echo "(no xdist: $(wc -l < "$OUT/gpu_ids.txt") tests in 8 processes, one summary line each)"
tail -2 "$OUT/precompile.log" 2>/dev/null
echo "== bench"; grep -E "^chosen tiles" "$OUT/bench.log"
if grep -q "^sweep (" "$OUT/bench.log"; then sed -n '/^sweep (/,$p' "$OUT/bench.log"; else  # SWEEP=0: the tables
  sed -n '/^| section | batch/,$p' "$OUT/bench.log"; fi | grep -v "^| norm_quant"
echo "== host profile (launches stubbed)"; tail -2 "$OUT/host_profile.log" | cut -c1-400
echo "total $(( $(date +%s) - T0 )) s"
