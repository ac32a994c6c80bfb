#!/usr/bin/env bash
# FP8 training and activation checkpointing on one lent H200 (issue 18), in one or two device calls: the GPU-marked
# FP8 tests, then step time + peak memory of `gemray bench train` on the GEM-scale config for each variant:
#   bf16, fp8 (e4m3 / e5m2 / bf16 gradients; rowwise, and fp8tw: the tensorwise recipe), AC none / full / selective
#   (op-level: GEMM and attention outputs kept) / auto at budget 0.5 / torch at budget 0.5, fp16 embedding tables,
#   and a 2x history (data.max_seq_len doubled) under auto with the bf16 default's peak (bytes) as its budget.
# Then the numerics guard `gemray bench numerics` (bf16 vs fp8 on the same data and seed, exit 1 beyond RTOL).
# Needs ray / torchrec / fbgemm-gpu in /tmp/site (../shared/tools/gpu-stack, see benchmarks/README.md), the prepared
# data carried, and `gemray bench train` (gemray/bench/train.py: --config --set --steps --warmup --json).
# From the repository root:
#   OUT=$OUT bash benchmarks/fp8_ac_h200.sh
# Knobs: CONFIG (configs/gem-h200.toml), STEPS (30), WARMUP (5), VARIANTS (space-separated names of the list below,
# default all), GUARD_STEPS (0 = skip the numerics guard; it trains two runs through Ray), RTOL (1e-3), PY (python3).
# Results in $OUT: <variant>.json (bench train's JSON), <variant>.log, summary.txt (one line per variant: step ms,
# peak GiB), pytest.log, numerics.log.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; CONFIG=${CONFIG:-configs/gem-h200.toml}; STEPS=${STEPS:-30}; WARMUP=${WARMUP:-5}
GUARD_STEPS=${GUARD_STEPS:-0}; RTOL=${RTOL:-1e-3}
mkdir -p "$OUT" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh
echo "== $(date -u +%T) $(git rev-parse --short HEAD 2>/dev/null) pytest -m gpu tests/test_fp8.py tests/test_activation_checkpoint.py tests/test_table_dtype.py"
timeout -k 10 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_fp8.py tests/test_activation_checkpoint.py tests/test_table_dtype.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"; tail -3 "$OUT/pytest.log"
# the default's max_seq_len, for the 2x history run
MSL=$("$PY" -c "from gemray.config import load_config; print(load_config('$CONFIG').data.max_seq_len)") || exit 1
declare -A SETS=(
  [bf16]="train.precision=bf16 train.activation_checkpointing=none"
  [fp8]="train.precision=fp8 train.fp8_grad=e4m3 train.activation_checkpointing=none"
  [fp8_e5m2grad]="train.precision=fp8 train.fp8_grad=e5m2 train.activation_checkpointing=none"
  [fp8_bf16grad]="train.precision=fp8 train.fp8_grad=bf16 train.activation_checkpointing=none"
  [fp8tw]="train.precision=fp8 train.fp8_recipe=tensorwise train.fp8_grad=e4m3 train.activation_checkpointing=none"
  [ac_full]="train.precision=bf16 train.activation_checkpointing=full"
  [ac_sel]="train.precision=bf16 train.activation_checkpointing=selective"
  [fp16tab]="train.precision=bf16 train.activation_checkpointing=none model.table_dtype=fp16"
  [ac_auto]="train.precision=bf16 train.activation_checkpointing=auto train.activation_memory_budget=0.5"
  [ac_torch]="train.precision=bf16 train.activation_checkpointing=torch train.activation_memory_budget=0.5"
  [hist2x_auto]="train.precision=bf16 data.max_seq_len=$((2 * MSL)) train.activation_checkpointing=auto"
)
ORDER=${VARIANTS:-"bf16 fp8 fp8tw fp8_e5m2grad fp8_bf16grad ac_full ac_sel ac_auto ac_torch hist2x_auto fp16tab"}
peak_of() {  # peak allocated bytes out of bench train's JSON (peak_memory.allocated_bytes)
  "$PY" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['peak_memory']['allocated_bytes']))" "$1" 2>/dev/null \
    || echo 0
}
: > "$OUT/summary.txt"
for v in $ORDER; do
  extra=()
  if [ "$v" = hist2x_auto ]; then  # the budget: the peak the default history used in bf16 without checkpointing
    p=$(peak_of "$OUT/bf16.json")
    if [ "$p" -le 0 ]; then echo "$v: skipped, no peak in $OUT/bf16.json (run bf16 first)" | tee -a "$OUT/summary.txt"; continue; fi
    extra=("train.activation_memory_budget=$p")
  fi
  echo "== $(date -u +%T) $v: ${SETS[$v]} ${extra[*]}"
  # shellcheck disable=SC2086  # SETS values are --set lists
  timeout -k 10 420 gemray bench train --config "$CONFIG" --steps "$STEPS" --warmup "$WARMUP" --json "$OUT/$v.json" \
    --set ${SETS[$v]} "${extra[@]}" > "$OUT/$v.log" 2>&1
  rc=$?
  "$PY" - "$v" "$OUT/$v.json" "$rc" >> "$OUT/summary.txt" <<'PYEOF'
import json, sys
v, path, rc = sys.argv[1:]
try:
    d = json.load(open(path))
except (OSError, ValueError):
    print(f"{v:<14} rc={rc} (no JSON)"); sys.exit()
step, peak = d["step_s"]["median"] * 1e3, d["peak_memory"].get("allocated_bytes")
print(f"{v:<14} rc={rc} step_ms={step:.1f} peak_GiB={None if peak is None else round(peak / 2**30, 2)} "
      f"tokens_per_s={d.get('tokens_per_s'):.0f} local_mfu={d.get('local_mfu')}")
PYEOF
  grep -E "activation checkpointing: (auto|measured)|fp8: converted" "$OUT/$v.log" | cut -c1-300
done
if [ "$GUARD_STEPS" -gt 0 ]; then
  echo "== $(date -u +%T) numerics guard ($GUARD_STEPS steps, rtol $RTOL)"
  timeout -k 10 500 gemray bench numerics --config "$CONFIG" --steps "$GUARD_STEPS" --rtol "$RTOL" \
    --output /tmp/gemray-numerics > "$OUT/numerics.log" 2>&1
  echo "numerics rc=$?" >> "$OUT/numerics.log"; tail -8 "$OUT/numerics.log"
fi
echo "== summary"; cat "$OUT/summary.txt"
echo "total $(( $(date +%s) - T0 )) s"
