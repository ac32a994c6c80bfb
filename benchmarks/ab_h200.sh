#!/usr/bin/env bash
# Trees side by side on one lent GPU: the same `gemray bench train` run (benchmarks/gem_h200.sh, one variant each) in
# several checkouts, one after the other, then the paired step differences. The bench sees the same batches in the
# same order in every run, so step i of one run and step i of another are the same batch: the median of their
# differences is the comparison (a run's median alone moves ~1 ms between replicates on one machine).
# Usage, from the repository root (the GPU stack staged into /tmp/site; each tree a full checkout, e.g. an archive
# of the commit to compare against: `git archive <rev> | tar -x -C .gpu/old`, carried with the call):
#   TREES="old:.gpu/old new:. new2:. old2:.gpu/old" OUT=$OUT bash benchmarks/ab_h200.sh
# (or the NAME:TREE words as arguments). Each NAME:TREE runs `VARIANTS="NAME=" STEPS=30 WARMUP=10 PROFILE_STEPS=3 bash benchmarks/gem_h200.sh` inside TREE
# (its own benchmarks/, config and code: h200_env.sh installs that tree in place); the first NAME is the baseline.
# Knobs: STEPS / WARMUP / PROFILE_STEPS (30 / 10 / 3), CONFIG (configs/gem-h200.toml). Results in $OUT:
# gem.<NAME>.{json,log} and the comparison on stdout. Exit status 1 when a run failed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; status=0; names=()
# shellcheck disable=SC2206  # TREES is a list of words
trees=("$@"); [ $# -gt 0 ] || trees=(${TREES:-})
[ ${#trees[@]} -ge 2 ] || { echo "usage: TREES=\"NAME:TREE NAME:TREE ...\" OUT=DIR bash benchmarks/ab_h200.sh" >&2; exit 2; }
mkdir -p "$OUT" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh
for nt in "${trees[@]}"; do  # every word checked before the first run
  [ "${nt%%:*}" != "$nt" ] && [ -d "${nt#*:}" ] || { echo "ab_h200.sh: expected NAME:TREE with TREE a folder, got '$nt'" >&2; exit 2; }
done
for nt in "${trees[@]}"; do
  n=${nt%%:*}; t=${nt#*:}
  names+=("$n")
  (cd "$t" && VARIANTS="$n=" STEPS=${STEPS:-30} WARMUP=${WARMUP:-10} PROFILE_STEPS=${PROFILE_STEPS:-3} OUT=$OUT \
     bash benchmarks/gem_h200.sh 2>&1 | tail -4) || status=1
done
"$PY" - "$OUT" "${names[@]}" <<'PY' || status=1
import json, os, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(os.path.join(out, f"gem.{n}.json"))) for n in names
        if os.path.exists(os.path.join(out, f"gem.{n}.json"))}
steps = {n: [s["step_s"] for s in r["steps"] if s["phase"] == "measured"] for n, r in runs.items()}
for n, r in runs.items():
    prof = r["profile"]["per_step_s"]
    dev = r["profile"].get("device_only") or {}
    print(f"{n:8s} median {1e3 * r['step_s']['median']:.1f} ms  local MFU {100 * r['local_mfu']:.2f}% (later half "
          f"{100 * r['local_mfu_second_half']:.2f}%)  attention / GEMM / other {1e3 * prof['attention']:.1f} / "
          f"{1e3 * prof['gemm']:.1f} / {1e3 * prof['other']:.1f} ms  device busy {1e3 * dev.get('busy_s_per_step', 0):.1f}"
          f" / idle {1e3 * dev.get('idle_s_per_step', 0):.1f} ms")
base = names[0]
for n in names[1:]:
    if base in steps and n in steps:
        d = [1e3 * (b - a) for a, b in zip(steps[base], steps[n])]
        print(f"{n} - {base}: paired median {statistics.median(d):+.2f} ms over {len(d)} steps")
PY
exit "$status"
