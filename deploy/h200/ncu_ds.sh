#!/usr/bin/env bash
# One device call: Nsight Compute on the DS_STORE backward's launches (dK/dV with the dS store, dQ = dS K) of the
# uniform B=64 N=4096 and heavy B=256 N=4096 bench batches. Layout as kernels_bench.sh. From the root:
#   OUT=$OUT bash deploy/h200/ncu_ds.sh
# Knobs: NCU_BATCHES ("KIND B N;..."), NCU_KERNELS (space-separated kernel names), NCU_EXTRA (more metrics,
# comma-first). Output also in $OUT/ncu.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; P=${P:-/tmp/gemray-kern}
NCU_BATCHES=${NCU_BATCHES:-uniform 64 4096;heavy 256 4096;uniform 128 1024}; NCU_KERNELS=${NCU_KERNELS:-_gdpa_dq_ds _gdpa_bwd}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gemray-triton-cache}
rm -rf "$P"; mkdir -p "$P" "$OUT"
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" && cp -r pipelines "$P/gemray/pipelines" \
  && cp -r pyproject.toml deploy/h200/ncu_ds.py "$P/" || { echo "copy failed"; exit 1; }
cd "$P" || exit 1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
METRICS=dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__occupancy_limit_shared_mem,launch__registers_per_thread,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio${NCU_EXTRA:-}
IFS=';' read -r -a batches <<< "$NCU_BATCHES"
for batch in "${batches[@]}"; do
  for kern in $NCU_KERNELS; do
    echo "== $batch $kern" | tee -a "$OUT/ncu.log"
    # shellcheck disable=SC2086
    timeout -k 5 150 "$NCU" --clock-control none -k "regex:^${kern}\$" --launch-skip 2 --launch-count 1 \
      --metrics "$METRICS" python3 ncu_ds.py $batch 2>&1 \
      | grep -vE "^==PROF==|^\s*$" | grep -E "regime|dram__|lts__|gpu__time|sm__|smsp__|l1tex__|launch__" | cut -c1-160 \
      | tee -a "$OUT/ncu.log"
  done
done
