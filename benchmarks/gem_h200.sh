#!/usr/bin/env bash
# Training steps of a config, measured on a lent H200 by `gemray bench train`, each run with --profile (time by
# attention / GEMMs / embeddings / optimizer / data wait / exposed communication / other, and GPU idle). Single
# process, world 1, NCCL, no Ray; the attention kernels (and, with train.compile, the compiled modules) compile
# before step 1 (logged). Two modes:
#   * BACKENDS (default "triton reference"): the attention on the Triton path, then on the reference path (the
#     Triton path must be the faster one inside the model); one line compares their tokens/s.
#   * VARIANTS ("name=SETTINGS;name=SETTINGS;..."): runs of one config side by side, one after the other on the one
#     GPU, then one comparison table (median step ms, tokens/s, MFU, peak GiB, max/median step, the profile's
#     attention / GEMM / other / GPU-idle ms, torch.compile seconds, host syncs). SETTINGS: --set values (key=value,
#     after ray.use_gpu=true model.attention_backend=triton and before the command line's), `gemray bench
#     train` flags (words starting with --, e.g. --sync-debug) and environment variables for that run alone
#     (upper-case NAME=value words, e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); empty: the config as it is.
# Needs the GPU stack of ../shared/tools/gpu-stack installed in /tmp/site (its README: four staging calls) and, for a
# config whose data is not generated, the Parquet made on the CPU machine and carried (e.g. data/ml-1m).
# From the repository root:
#   OUT=$OUT bash benchmarks/gem_h200.sh                                        # configs/gem-h200.toml
#   CONFIG=configs/ml-1m.toml NAME=ml1m OUT=$OUT bash benchmarks/gem_h200.sh    # ML-1M (carry data/ml-1m)
#   BACKENDS=reference OUT=$OUT bash benchmarks/gem_h200.sh model.num_blocks=4   # one path, more --set values
#   VARIANTS="base=;nobias=model.relative_bias=false --sync-debug;nobias_compile=model.relative_bias=false \
#     train.compile=true --sync-debug" STEPS=20 WARMUP=5 PROFILE_STEPS=2 OUT=$OUT bash benchmarks/gem_h200.sh
# Knobs: CONFIG (configs/gem-h200.toml), NAME (gem), STEPS (30), WARMUP (10), PROFILE_STEPS (3), BACKENDS
# ("triton reference"), VARIANTS (unset), PY (python3). Results in $OUT: $NAME.<backend or variant>.json (gemray
# bench train --json) and .log. Exit status: 0, or 1 when a bench run failed, or 3 (BACKENDS) when both ran and
# the Triton path was not faster than the reference path. The Triton compile cache (~/.triton/cache) and
# inductor's (/tmp/torchinductor_$USER) outlive the process: a second call on the same warm machine compiles less.
set -uo pipefail
OUT=${OUT:-/tmp/out}; NAME=${NAME:-gem}; CONFIG=${CONFIG:-configs/gem-h200.toml}
STEPS=${STEPS:-30}; WARMUP=${WARMUP:-10}; PROFILE_STEPS=${PROFILE_STEPS:-3}; BACKENDS=${BACKENDS:-triton reference}
VARIANTS=${VARIANTS:-}
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

# one `gemray bench train` run: bench <tag> <words...> (the words: --set values and bench flags, in any order)
bench() {
  local tag=$1; shift
  local sets=() flags=() envs=() w
  for w in "$@"; do
    case "$w" in
      --*) flags+=("$w") ;;
      [A-Z_]*=*) [[ "$w" =~ ^[A-Z_][A-Z0-9_]*= ]] && envs+=("$w") || sets+=("$w") ;;
      *) sets+=("$w") ;;
    esac
  done
  echo "== $(date -u +%T) $NAME $tag: $CONFIG, $WARMUP + $STEPS steps; --set ${sets[*]:-} ${EXTRA[*]:-}; flags ${flags[*]:-}; env ${envs[*]:-}"
  env "${envs[@]}" gemray bench train --config "$CONFIG" --set ray.use_gpu=true "${sets[@]}" "${EXTRA[@]}" \
    --steps "$STEPS" --warmup "$WARMUP" --profile --profile-steps "$PROFILE_STEPS" "${flags[@]}" \
    --json "$OUT/$NAME.$tag.json" > "$OUT/$NAME.$tag.log" 2>&1
  local rc=$?
  grep -v -i -E "fbgemm|TBE=|warn" "$OUT/$NAME.$tag.log" | tail -40
  echo "== $(date -u +%T) $NAME $tag: exit $rc"
  [ "$rc" = 0 ] || status=1
}
EXTRA=("$@")

if [ -n "$VARIANTS" ]; then
  IFS=';' read -ra VS <<< "$VARIANTS"
  names=()
  for v in "${VS[@]}"; do
    name=${v%%=*}; settings=${v#*=}
    [ "$name" = "$v" ] && settings=""
    [ -n "$name" ] || { echo "VARIANTS: an entry without a name: '$v'" >&2; exit 1; }
    names+=("$name")
    # shellcheck disable=SC2086  # $settings is a list of words
    bench "$name" model.attention_backend=triton $settings
  done
  "$PY" - "$OUT" "$NAME" "${names[@]}" <<'EOF' || status=1
import json, os, sys
out, name, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
cols = ["variant", "step ms", "tokens/s", "MFU", "MFU 2nd half", "peak GiB", "retries", "max/med", "max gc ms", "attn ms", "gemm ms",
        "other ms", "idle ms", "steady idle", "device idle", "compile s", "syncs"]
rows = []
for v in variants:
    p = os.path.join(out, f"{name}.{v}.json")
    if not os.path.exists(p):
        rows.append([v, "failed"] + [""] * (len(cols) - 2))
        continue
    r = json.load(open(p))
    prof = (r.get("profile") or {}).get("per_step_s", {})
    idle = (r.get("profile") or {}).get("gpu_idle_s")
    steady = ((r.get("profile") or {}).get("idle") or {}).get("steady_idle_s_per_step")
    dev = (r.get("profile") or {}).get("device_only") or {}
    ms = lambda x: "n/a" if x is None else f"{1e3 * x:.1f}"
    tc = r.get("torch_compile") or {}
    sd = r.get("sync_debug")
    rows.append([v, ms(r["step_s"]["median"]), f"{r['tokens_per_s']:.0f}",
                 "n/a" if r["local_mfu"] is None else f"{100 * r['local_mfu']:.2f}%",
                 "n/a" if r.get("local_mfu_second_half") is None else f"{100 * r['local_mfu_second_half']:.2f}%",
                 f"{r['peak_memory'].get('allocated_bytes', 0) / 2**30:.1f}",
                 "n/a" if not r.get("allocator") else str(r["allocator"]["alloc_retries"]),
                 f"{r['compile_stall']['max_over_median'] or 0:.2f}" + ("!" if r["compile_stall"]["flagged"] else ""),
                 ms((r.get("gc") or {}).get("max_step_s")),
                 ms(prof.get("attention")), ms(prof.get("gemm")), ms(prof.get("other")), ms(idle), ms(steady),
                 ms(dev.get("idle_s_per_step")),
                 f"{tc.get('until_measured', {}).get('seconds', 0.0):.0f}" if tc.get("enabled") else "off",
                 "-" if sd is None else str(sd["total"])])
w = [max(len(str(x)) for x in c) for c in zip(cols, *rows)]
for row in [cols] + rows:
    print("  ".join(str(x).rjust(n) for x, n in zip(row, w)))
print("(step ms: median; MFU: local, dense bf16 peak; MFU 2nd half: the later half of the measured steps; retries: "
      "allocations that found the GPU full and freed the allocator's cache (a device sync each); max/med: '!' = compile-stall flag; "
      "max gc ms: the longest Python garbage-collection time inside one measured step; attn / gemm / other / idle: "
      "ms per profiled step; steady idle: idle ms after the first profiled step, which starts on an empty launch queue; "
      "device idle: the GPU's idle ms per step with only the device's activity recorded (no profiler host cost: an "
      "ordinary step's); "
      "compile s: torch.compile before the measured steps; syncs: host syncs in one step, "
      "--sync-debug)")
for v in variants:
    p = os.path.join(out, f"{name}.{v}.json")
    sd = json.load(open(p)).get("sync_debug") if os.path.exists(p) else None
    if sd:
        print(f"host syncs of {v} (one step, by site):")
        for s in sd["sites"]:
            print(f"  {s['count']:4d}x {s['site']}" + (f"  (from {s['frame']})" if s["frame"] and s["frame"] != s["site"] else ""))
EOF
  exit "$status"
fi

for b in $BACKENDS; do
  bench "$b" model.attention_backend="$b"
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
