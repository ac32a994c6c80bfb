#!/usr/bin/env bash
# One ML-1M training run on a lent H200 through `gemray train`: configs/ml-1m.toml (the published protocol), one Ray
# Train worker, NCCL, attention on the Triton path (`auto`), FBGEMM's fused TBE with Adam lr 1e-3 for the embeddings.
# Resumable across device calls: the run lives in $RUNS/$NAME (/tmp survives while the machine stays warm); after
# DEADLINE_S the driver gets SIGTERM, commits an emergency checkpoint and exits 75, and the same command resumes it.
# Needs the GPU stack of ../shared/tools/gpu-stack installed in /tmp/site (four staging calls, its README) and the
# Parquet made on the CPU machine, carried as data/ml-1m:
#   gemray prepare movielens --src ../shared/data/ml-1m --out data/ml-1m
# From the repository root:
#   OUT=$OUT bash benchmarks/ml1m_h200.sh                                         # the full-length run, 100 epochs
#   NAME=hstu OUT=$OUT bash benchmarks/ml1m_h200.sh model.use_rating_feature=false   # more --set values
#   CONFIG=configs/gem-h200.toml DATA=data/gem-h200 NAME=gem EPOCHS=1 OUT=$OUT bash benchmarks/ml1m_h200.sh \
#     train.sparse_optimizer=rowwise_adagrad train.sparse_lr=1e-2     # another config (synthetic: generated on first use)
# Knobs: NAME (cfg), EPOCHS (100), DEADLINE_S (540), RUNS (/tmp/gemray-runs), DATA (data/ml-1m), CONFIG
# (configs/ml-1m.toml), PY (python3), CPUS_PER_WORKER (8) and NUM_CPUS (16: the embedded cluster's CPUs; keep at
# least one more than CPUS_PER_WORKER for Ray Data's read tasks). Results in $OUT: $NAME.metrics.json,
# $NAME.curves.png, $NAME.events.jsonl and $NAME.log (the end of the run's log); the exit status is gemray train's
# (75: stopped at the deadline).
set -uo pipefail
OUT=${OUT:-/tmp/out}; NAME=${NAME:-cfg}; EPOCHS=${EPOCHS:-100}; DEADLINE_S=${DEADLINE_S:-540}
RUNS=${RUNS:-/tmp/gemray-runs}; DATA=${DATA:-data/ml-1m}; CONFIG=${CONFIG:-configs/ml-1m.toml}
CPUS_PER_WORKER=${CPUS_PER_WORKER:-8}; NUM_CPUS=${NUM_CPUS:-16}
RUN=$RUNS/$NAME
case $DATA in /*) ;; *) DATA=$PWD/$DATA ;; esac   # the Ray workers read it from their own working folders
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RUN" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh
if [ -f "$RUN/DONE" ]; then echo "$NAME: finished in an earlier call ($RUN)"; exit 0; fi
"$PY" -c "import ray, torchrec, fbgemm_gpu" 2>/dev/null \
  || { echo "ray / torchrec / fbgemm-gpu missing: install ../shared/tools/gpu-stack into /tmp/site first" >&2; exit 1; }
[ -f "$DATA/manifest.json" ] || grep -q "^synthetic *=" "$CONFIG" || { echo "$DATA: no prepared ML-1M (gemray prepare movielens ... --out $DATA)" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton, torchrec, fbgemm_gpu, ray; print('torch', torch.__version__, 'triton', \
triton.__version__, 'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'ray', ray.__version__)"
echo "== $(date -u +%T) $NAME: $EPOCHS epochs, stop at ${DEADLINE_S} s; extra --set: $*" | tee -a "$RUN/train.log"
# A session of its own, so that whatever this run leaves behind (Ray's processes after a hard kill) is ended by
# session id below, not by name (a run beside it has its own); timeout --foreground signals the driver alone.
rm -f "$RUN/session"
# shellcheck disable=SC2016  # $$ and $@ are the inner shell's
setsid --wait bash -c 'echo $$ > "$0"; exec "$@"' "$RUN/session" \
  timeout --foreground --preserve-status -s TERM -k 120 "$DEADLINE_S" \
  gemray train --config "$CONFIG" --set data.prepared_dir="$DATA" ray.use_gpu=true ray.num_workers=1 \
    ray.cpus_per_worker="$CPUS_PER_WORKER" ray.num_cpus="$NUM_CPUS" train.sparse_optimizer=adam train.sparse_lr=1e-3 \
    train.epochs="$EPOCHS" \
    "$@" --output "$RUN/full" >> "$RUN/train.log" 2>&1
rc=$?
sid=$(cat "$RUN/session" 2>/dev/null)
[ -n "$sid" ] && [ "$sid" != "$(ps -o sid= -p $$ | tr -d ' ')" ] && pkill -KILL -s "$sid"
[ "$rc" = 0 ] && touch "$RUN/DONE"
echo "== $(date -u +%T) $NAME: gemray train exit $rc" | tee -a "$RUN/train.log"
grep -v -i -E "fbgemm|warn" "$RUN/train.log" | tail -300 > "$OUT/$NAME.log"   # Ray's and torchrec's warnings out
for f in metrics.json curves.png events.jsonl; do cp "$RUN/full/$f" "$OUT/$NAME.$f" 2>/dev/null; done
tail -25 "$OUT/$NAME.log"
exit "$rc"
