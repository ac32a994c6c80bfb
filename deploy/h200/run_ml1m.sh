#!/usr/bin/env bash
# Full-length ML-1M run on one lent H200 (offline image: python 3.12, torch 2.11, triton 3.6).
# ray / torchrec / fbgemm-gpu come from ../shared/tools/gpu-stack, installed in /tmp/site beforehand
# (four staged calls; see that README). Data: the Parquet made here by `gemray prepare movielens`, carried
# as data/ml-1m. Usage on the device:  OUT=... BUDGET_S=420 bash deploy/h200/run_ml1m.sh
# With EPOCHS=N it runs N epochs; otherwise it first times one epoch, then runs as many epochs (<= MAX_EPOCHS)
# as fit in BUDGET_S. Extra arguments are more `--set` values (e.g. model.negatives=uniform).
set -euo pipefail
OUT=${OUT:-/tmp/out}; BUDGET_S=${BUDGET_S:-420}; MAX_EPOCHS=${MAX_EPOCHS:-100}
P=$(mktemp -d /tmp/gemray-pkg.XXXX)   # one per run: two runs side by side must not share it
cp -r gemray "$P/" && cp -r kernels "$P/gemray/kernels" \
  && cp -r pipelines "$P/gemray/pipelines" && cp -r configs "$P/"
REPO=$PWD; cd "$P"   # run outside the checkout: its gemray/ lacks the mapped kernels/ and pipelines/
export PYTHONPATH=$P:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, torchrec, fbgemm_gpu, ray; print('torch', torch.__version__, 'triton', triton.__version__, 'torchrec', torchrec.__version__, 'ray', ray.__version__)"
COMMON=(--config configs/ml-1m.toml --set data.prepared_dir="$REPO/data/ml-1m" ray.use_gpu=true
        ray.num_workers=1 ray.cpus_per_worker=8 ray.num_cpus=16 train.sparse_optimizer=adam train.sparse_lr=1e-3)
if [ -n "${EPOCHS:-}" ]; then   # known epoch count: no timing run
  python3 -m gemray.cli train "${COMMON[@]}" train.epochs="$EPOCHS" "$@" --output "$OUT/full" 2>&1 \
    | grep --line-buffered -v "FBGEMM\|fbgemm_gpu\|UserWarning\|warnings.warn"
  exit "${PIPESTATUS[0]}"
fi
t0=$(date +%s)
python3 -m gemray.cli train "${COMMON[@]}" train.epochs=1 "$@" --output "$OUT/epoch1" 2>&1 | tail -25
t1=$(date +%s); per=$(( t1 - t0 ))
left=$(( BUDGET_S - per ))
epochs=$(python3 -c "import json; m=json.load(open('$OUT/epoch1/metrics.json')); e=max(1.0, m['history'][0].get('train_s', m['wall_s'])); s=max(1.0, $per - e); print(max(1, min($MAX_EPOCHS, int(($left - s) / (e * 1.08)))))")
echo "one-epoch run took ${per}s; running $epochs epochs in the remaining ${left}s"
python3 -m gemray.cli train "${COMMON[@]}" train.epochs="$epochs" "$@" --output "$OUT/full" 2>&1 | tail -40
cp "$OUT/full/metrics.json" "$OUT/metrics_full.json" 2>/dev/null || true
