#!/usr/bin/env bash
# One training step of a config, measured on a lent H200 by `gemray bench train`: the attention on the Triton path,
# then on the reference path (the Triton path must be the faster one inside the model), each with --profile (time by
# attention / GEMMs / embeddings / optimizer / data wait / exposed communication / other). Single process, world 1,
# NCCL, no Ray; the attention kernels compile for every reachable length regime before step 1 (logged).
# Needs the GPU stack of ../shared/tools/gpu-stack installed in /tmp/site (its README: four staging calls) and, for a
# config whose data is not generated, the Parquet made on the CPU machine and carried (e.g. data/ml-1m).
# From the repository root:
#   OUT=$OUT bash benchmarks/gem_h200.sh                                        # configs/gem-h200.toml
#   CONFIG=configs/ml-1m.toml NAME=ml1m OUT=$OUT bash benchmarks/gem_h200.sh    # ML-1M (carry data/ml-1m)
#   BACKENDS=reference OUT=$OUT bash benchmarks/gem_h200.sh model.num_blocks=4   # one path, more --set values
# Knobs: CONFIG (configs/gem-h200.toml), NAME (gem), STEPS (30), WARMUP (10), PROFILE_STEPS (3), BACKENDS
# ("triton reference"), PY (python3). Results in $OUT: $NAME.<backend>.json (gemray bench train --json) and
# $NAME.<backend>.log, then one line comparing the two paths' tokens/s. Exit status: 0, or 1 when a bench run failed,
# or 3 when both ran and the Triton path was not faster than the reference path. The Triton compile cache
# (~/.triton/cache) outlives the process: a second call on the same warm machine compiles nothing.
set -uo pipefail
OUT=${OUT:-/tmp/out}; NAME=${NAME:-gem}; CONFIG=${CONFIG:-configs/gem-h200.toml}
STEPS=${STEPS:-30}; WARMUP=${WARMUP:-10}; PROFILE_STEPS=${PROFILE_STEPS:-3}; BACKENDS=${BACKENDS:-triton reference}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh
"$PY" -c "import torchrec, fbgemm_gpu" 2>/dev/null \
  || { echo "torchrec / fbgemm-gpu missing: install ../shared/tools/gpu-stack into /tmp/site first" >&2; exit 1; }
[ -f "$CONFIG" ] || { echo "$CONFIG: no such config" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton, torchrec, fbgemm_gpu; print('torch', torch.__version__, 'triton', triton.__version__, \
'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)"
status=0
for b in $BACKENDS; do
  echo "== $(date -u +%T) $NAME: $CONFIG, attention $b, $WARMUP + $STEPS steps; extra --set: $*"
  gemray bench train --config "$CONFIG" --set ray.use_gpu=true model.attention_backend="$b" "$@" \
    --steps "$STEPS" --warmup "$WARMUP" --profile --profile-steps "$PROFILE_STEPS" --json "$OUT/$NAME.$b.json" \
    > "$OUT/$NAME.$b.log" 2>&1
  rc=$?
  grep -v -i -E "fbgemm|TBE=|warn" "$OUT/$NAME.$b.log" | tail -40
  echo "== $(date -u +%T) $NAME $b: exit $rc"
  [ "$rc" = 0 ] || status=1
done
if [ -f "$OUT/$NAME.triton.json" ] && [ -f "$OUT/$NAME.reference.json" ]; then
  "$PY" - "$OUT/$NAME.triton.json" "$OUT/$NAME.reference.json" <<'EOF' || { [ "$status" = 0 ] && status=3; }
import json, sys
t, r = (json.load(open(p)) for p in sys.argv[1:3])
ratio = t["tokens_per_s"] / r["tokens_per_s"]
mfu = lambda x: "n/a" if x is None else f"{100 * x:.2f}%"
print(f"triton {t['tokens_per_s']:.0f} tokens/s (MFU {mfu(t['local_mfu'])}, median step {t['step_s']['median']*1e3:.1f} ms)"
      f" vs reference {r['tokens_per_s']:.0f} tokens/s (MFU {mfu(r['local_mfu'])}): triton/reference = {ratio:.2f}x"
      f" -> {'triton faster' if ratio > 1 else 'TRITON NOT FASTER'}")
sys.exit(0 if ratio > 1 else 1)
EOF
fi
exit "$status"
