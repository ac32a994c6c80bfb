#!/usr/bin/env bash
# One device call on a lent H200 (~6 minutes): the GPU-marked attention tests, then deploy/h200/ab_launch.py
# (direct vs JIT launches vs varlen_attn, eager and host time), then the bench's self-attention section with
# the defaults (eager, host and CUDA-graph columns). Same package layout as kernels_bench.sh. From the root:
#   OUT=$OUT bash deploy/h200/ab_launch.sh
# Knobs: TOTAL_S (default 390: whole script), TEST_S (130), AB_S (130), ROUNDS (3).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}; TOTAL_S=${TOTAL_S:-390}; TEST_S=${TEST_S:-130}
AB_S=${AB_S:-130}; ROUNDS=${ROUNDS:-3}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}
rm -rf "$P"; mkdir -p "$P" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r tests pyproject.toml deploy/h200/ab_launch.py "$P/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_kernels_attention.py 2>/dev/null \
  | grep '::' > "$OUT/gpu_ids.txt"
split -n r/8 "$OUT/gpu_ids.txt" "$OUT/gpu_chunk_"
for f in "$OUT"/gpu_chunk_*; do
  # shellcheck disable=SC2046
  timeout -k 5 "$TEST_S" python3 -m pytest -q -p no:cacheprovider -rfE $(cat "$f") > "$f.log" 2>&1 &
done
wait
echo "== pytest ($(wc -l < "$OUT/gpu_ids.txt") GPU tests, 8 processes) after $(( $(date +%s) - T0 )) s"
grep -hE "^(FAILED|ERROR)|passed|failed|error" "$OUT"/gpu_chunk_*.log | cut -c1-300
echo "== A/B launch path"
timeout -k 5 "$AB_S" python3 ab_launch.py --rounds "$ROUNDS" > "$OUT/ab_launch.log" 2>&1
echo "ab rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUT/ab_launch.log"
cat "$OUT/ab_launch.log" | cut -c1-200 | tail -70
LEFT=$(( TOTAL_S - ($(date +%s) - T0) - 10 ))
echo "== bench self section ($LEFT s left)"
if [ "$LEFT" -gt 30 ]; then
  timeout -k 5 $(( LEFT + 5 )) python3 -m gemray.kernels.bench --out "$OUT" --time-limit "$LEFT" \
    --skip=flex,sdpa,silu_padded,norm,cross,block > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"
  sed -n '/^| section | batch/,$p' "$OUT/bench.log" | cut -c1-220 | tail -30
fi
timeout -k 5 30 python3 -m gemray.kernels.bench --host-profile > "$OUT/host_profile.log" 2>&1
tail -2 "$OUT/host_profile.log" | cut -c1-400
echo "total $(( $(date +%s) - T0 )) s"
