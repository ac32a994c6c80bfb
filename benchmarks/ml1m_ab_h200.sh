#!/usr/bin/env bash
# ML-1M runs side by side on one lent H200, each a benchmarks/ml1m_h200.sh run with its own name and embedded Ray
# cluster (the HSTU-large model uses a small part of the GPU, so two runs share it). The default pair is the model on
# the Triton attention path against the reference path, 12 epochs: their training losses should agree to 4 decimals
# every epoch, their test HR@10 / NDCG@10 exactly, and the samples/s of each epoch say what the kernels are worth.
# Same needs as ml1m_h200.sh (the gpu-stack in /tmp/site, data/ml-1m carried). From the repository root:
#   OUT=$OUT bash benchmarks/ml1m_ab_h200.sh
#   VARIANTS="a=model.negatives=uniform;b=model.negatives=uniform_shared" EPOCHS=20 OUT=$OUT bash benchmarks/ml1m_ab_h200.sh
# Knobs: VARIANTS ("name=--set values;..."), EPOCHS (12), DEADLINE_S (330: each run's stop, then resumable as in
# ml1m_h200.sh), and ml1m_h200.sh's RUNS, DATA, CONFIG, PY. Results in $OUT: its four files per variant
# (two variants fill the eight files a device call brings back).
set -uo pipefail
export OUT=${OUT:-/tmp/out} EPOCHS=${EPOCHS:-12} DEADLINE_S=${DEADLINE_S:-330}
VARIANTS=${VARIANTS:-"ref=model.attention_backend=reference;triton=model.attention_backend=triton"}
mkdir -p "$OUT" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh   # once here, so that the runs below do not install side by side
IFS=';' read -ra VS <<< "$VARIANTS"
pids=()
for v in "${VS[@]}"; do
  name=${v%%=*}; sets=${v#*=}
  # shellcheck disable=SC2086  # $sets is a list of --set values
  NAME=$name bash benchmarks/ml1m_h200.sh $sets > "$OUT/$name.stdout" 2>&1 &
  pids+=($!)
  sleep 15   # stagger the Ray start-ups
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for v in "${VS[@]}"; do name=${v%%=*}; echo "== $name"; tail -20 "$OUT/$name.stdout"; rm -f "$OUT/$name.stdout"; done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit "$rc"
