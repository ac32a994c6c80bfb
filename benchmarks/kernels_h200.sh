#!/usr/bin/env bash
# The full kernel benchmark on one lent H200, in one device call (3-6 minutes): the GPU-marked kernel tests, then
# `gemray bench kernels` (jagged attention and GDPA silu vs varlen_attn / padded SDPA / FlexAttention, cross-attention
# and PMA, block attention, HSTU attention with the in-kernel relative bias vs the dense-bias path, fused norm + FP8;
# eager and CUDA-graph times, errors against the float32 reference, the
# summary against the bars), then `gemray bench kernels --host-profile` (this host's Python work per fwd+bwd, launches
# stubbed). Installs the checkout in place first (benchmarks/h200_env.sh). From the repository root:
#   OUT=$OUT bash benchmarks/kernels_h200.sh                # the kernels as committed
#   SWEEP=1 OUT=$OUT bash benchmarks/kernels_h200.sh        # first sweep tiles and backward launch modes per length
#                                                           # regime (precompiled in 8 processes); the winners are
#                                                           # used by the bench and printed as a --tiles JSON
# Knobs: TOTAL_S (340: the whole script), TEST_S (150: the tests; the precompile gets as much), SWEEP (0),
# SWEEP_BUDGET (120: sweep timing, split over the 4 regimes), TILES_JSON (pin an earlier run's "chosen tiles"),
# BENCH_ARGS (more bench flags, no spaces inside a value, e.g. --skip=flex,sdpa), PY (python3).
# Results in $OUT: bench_kernels.jsonl (one record per measurement), bench.log (tables, bars), pytest.log,
# precompile.log (SWEEP=1), host_profile.log, nvidia-smi.txt; the reply's tail has the test summary and the tables.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; TOTAL_S=${TOTAL_S:-340}; TEST_S=${TEST_S:-150}; SWEEP=${SWEEP:-0}
SWEEP_BUDGET=${SWEEP_BUDGET:-120}; BENCH_ARGS=${BENCH_ARGS:-}; TILES_JSON=${TILES_JSON:-}
WORK=${WORK:-/tmp/gemray-bench-kernels}   # scratch (per-process test logs); only the files above go to $OUT
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}   # shared by the tests and the bench
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used --format=csv \
  > "$OUT/nvidia-smi.txt" 2>&1
TESTS="tests/test_kernels_attention.py tests/test_kernels_norm_quant.py tests/test_kernels_rel_bias.py"
gpu_tests() {  # 8 pytest processes: pytest-xdist when installed, else the collected ids dealt 8 ways
  if "$PY" -c "import xdist" 2>/dev/null; then
    # shellcheck disable=SC2086
    "$PY" -m pytest -n 8 -m gpu -q -p no:cacheprovider -rfE $TESTS > "$WORK/pytest.log" 2>&1
    return
  fi
  # shellcheck disable=SC2086
  "$PY" -m pytest --collect-only -q -m gpu -p no:cacheprovider $TESTS 2>/dev/null | grep '::' > "$WORK/gpu_ids.txt"
  split -n r/8 "$WORK/gpu_ids.txt" "$WORK/gpu_chunk_"
  for f in "$WORK"/gpu_chunk_??; do
    # shellcheck disable=SC2046
    "$PY" -m pytest -q -p no:cacheprovider -rfE $(cat "$f") > "$f.log" 2>&1 &
  done
  wait
  cat "$WORK"/gpu_chunk_*.log > "$WORK/pytest.log"
  echo "(no xdist: $(wc -l < "$WORK/gpu_ids.txt") tests in 8 processes, one summary line each)" >> "$WORK/pytest.log"
}
# The precompile of every sweep candidate (8 processes, into the shared Triton cache) comes before the tests, not
# beside them: run 6 ran both at once and two tests ran out of GPU memory. Nothing is timed until both are done.
echo "== $(date -u +%T) $(git rev-parse --short HEAD 2>/dev/null) precompile (SWEEP=$SWEEP), then pytest -m gpu"
if [ "$SWEEP" = 1 ]; then
  timeout -k 10 "$TEST_S" gemray bench kernels --out "$WORK/precompile" --precompile 8 --precompile-only \
    > "$OUT/precompile.log" 2>&1
  echo "precompile rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/precompile.log"
fi
export -f gpu_tests; export PY WORK TESTS
timeout -k 10 "$TEST_S" bash -c gpu_tests
rc=$?; cp "$WORK/pytest.log" "$OUT/pytest.log" 2>/dev/null; echo "pytest rc=$rc after $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.log"
LEFT=$(( TOTAL_S - ($(date +%s) - T0) - 10 ))
SW=(); [ "$SWEEP" = 1 ] && SW=(--sweep --sweep-budget "$SWEEP_BUDGET")
TILES_ARG=(); [ -n "$TILES_JSON" ] && TILES_ARG=(--tiles "$TILES_JSON")
echo "== $(date -u +%T) bench ($LEFT s left) ${SW[*]} $BENCH_ARGS"
# shellcheck disable=SC2086  # BENCH_ARGS is a flag list
timeout -k 10 $(( LEFT + 5 )) gemray bench kernels --out "$OUT" --time-limit "$LEFT" "${SW[@]}" $BENCH_ARGS \
  "${TILES_ARG[@]}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/bench.log"
timeout -k 5 30 gemray bench kernels --out "$OUT" --host-profile > "$OUT/host_profile.log" 2>&1
# the reply carries the last 12,000 characters: failures and the pytest summary, then the bench's tables
echo "== pytest"; grep -E "^(FAILED|ERROR)|passed|failed|skipped|rc=|no xdist" "$OUT/pytest.log" | tail -25
tail -2 "$OUT/precompile.log" 2>/dev/null
echo "== bench"; grep -E "^chosen tiles" "$OUT/bench.log"
if grep -q "^sweep (" "$OUT/bench.log"; then sed -n '/^sweep (/,$p' "$OUT/bench.log"; else  # no sweep: the tables
  sed -n '/^| section | batch/,$p' "$OUT/bench.log"; fi | grep -v "^| norm_quant"
echo "== host profile (launches stubbed)"; tail -2 "$OUT/host_profile.log" | cut -c1-400
echo "total $(( $(date +%s) - T0 )) s"
