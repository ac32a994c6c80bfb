#!/usr/bin/env bash
# Full-length ML-1M runs of several variants side by side on one lent H200 (the HSTU-large model uses a small
# fraction of the GPU, so two runs share it), each through deploy/h200/run_ml1m.sh with its own embedded Ray
# cluster. Resumable across device calls: the runs live in $RUNS (default /tmp/gemray-runs, which survives
# while the machine stays warm) and re-running this script continues each unfinished run from its latest
# committed checkpoint (same output folder and job name). Each call stops the runs after DEADLINE_S seconds
# so that it ends inside the device's per-call limit, then copies metrics.json / curves.png / logs to $OUT.
#   OUT=$OUT EPOCHS=100 DEADLINE_S=500 bash deploy/h200/ab_ml1m.sh
# Variants: name=--set values, separated by ';' in $VARIANTS (default below).
set -uo pipefail
RUNS=${RUNS:-/tmp/gemray-runs}; DEADLINE_S=${DEADLINE_S:-500}; EPOCHS=${EPOCHS:-100}; OUT=${OUT:-/tmp/out}
VARIANTS=${VARIANTS:-"base=model.attention_backend=reference;hstu=model.attention_backend=reference model.use_rating_feature=false model.use_time_feature=false model.num_position_buckets=200"}
mkdir -p "$RUNS" "$OUT"
IFS=';' read -ra VS <<< "$VARIANTS"
pids=()
for v in "${VS[@]}"; do
  name=${v%%=*}; sets=${v#*=}
  if [ -f "$RUNS/$name/full/metrics.json" ]; then echo "$name: finished earlier"; continue; fi
  echo "== $(date -u +%T) start $name: $sets" | tee -a "$RUNS/$name.log"
  # shellcheck disable=SC2086  # $sets is a list of --set values
  OUT="$RUNS/$name" EPOCHS=$EPOCHS timeout -k 20 "$DEADLINE_S" bash deploy/h200/run_ml1m.sh $sets \
    >> "$RUNS/$name.log" 2>&1 &
  pids+=($!)
  sleep 15   # stagger the two Ray start-ups
done
for p in "${pids[@]}"; do wait "$p"; done
# A run stopped by the deadline can leave its Ray processes behind: clear them before the next call.
pkill -9 -f 'raylet|gcs_server|ray::|default_worker.py|dashboard' 2>/dev/null; sleep 2
for v in "${VS[@]}"; do
  name=${v%%=*}
  grep -v -i "fbgemm\|warn" "$RUNS/$name.log" | tail -60 > "$OUT/$name.log"
  cp "$RUNS/$name/full/metrics.json" "$OUT/$name.metrics.json" 2>/dev/null \
    && cp "$RUNS/$name/full/curves.png" "$OUT/$name.curves.png" 2>/dev/null
  cp "$RUNS/$name/full/events.jsonl" "$OUT/$name.events.jsonl" 2>/dev/null || true
  echo "== $name"; tail -12 "$OUT/$name.log"
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
