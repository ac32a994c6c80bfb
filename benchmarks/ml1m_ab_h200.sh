#!/usr/bin/env bash
# ML-1M runs side by side on one lent H200, each a benchmarks/ml1m_h200.sh run with its own name and embedded Ray
# cluster (the HSTU-large model uses a small part of the GPU, so four runs share it). The default is the issue-16
# A/B: the model on the reference attention path and on the Triton path, each run twice (ref, ref2, triton,
# triton2), 12 epochs. Expected: the training loss of every epoch agrees to about 4 decimals across all four and
# the test HR@10 / NDCG@10 nearly so; ref vs ref2 and triton vs triton2 say what run-to-run nondeterminism alone
# does. At the end a table: the loss per epoch of every run, the largest per-step and per-epoch differences of
# each run against the first, and the first global step where a run's loss differs from the first's (> 1e-6).
# Same needs as ml1m_h200.sh (the gpu-stack in /tmp/site, data/ml-1m carried). From the repository root:
#   OUT=$OUT bash benchmarks/ml1m_ab_h200.sh                                     # ref, ref2, triton, triton2
#   REPEAT=0 OUT=$OUT bash benchmarks/ml1m_ab_h200.sh                            # ref, triton only
#   VARIANTS="a=model.negatives=uniform;b=model.negatives=uniform_shared" EPOCHS=20 OUT=$OUT bash benchmarks/ml1m_ab_h200.sh
# Knobs: VARIANTS ("name=--set values;..."), REPEAT (1: each variant also runs as <name>2), EPOCHS (12),
# DEADLINE_S (480: each run's stop, then resumable with RESUME=1 as in ml1m_h200.sh; 4 runs sharing the GPU
# need ~4-6 min for 12 epochs), RESUME (0: every run starts afresh, its folder under RUNS removed first), RUNS
# (/tmp/gemray-ab), STAGGER_S (10: between the Ray start-ups), CPUS_PER_WORKER (3) / NUM_CPUS (4) per run (16
# cores for four), and ml1m_h200.sh's DATA, CONFIG, PY. Results in $OUT: ml1m_h200.sh's four files per run and
# ab_table.txt (the table).
set -uo pipefail
export OUT=${OUT:-/tmp/out} EPOCHS=${EPOCHS:-12} DEADLINE_S=${DEADLINE_S:-480} RUNS=${RUNS:-/tmp/gemray-ab}
export CPUS_PER_WORKER=${CPUS_PER_WORKER:-3} NUM_CPUS=${NUM_CPUS:-4}
VARIANTS=${VARIANTS:-"ref=model.attention_backend=reference;triton=model.attention_backend=triton"}
REPEAT=${REPEAT:-1}; RESUME=${RESUME:-0}; STAGGER_S=${STAGGER_S:-10}
mkdir -p "$OUT" "$RUNS" || exit 1
# shellcheck source=benchmarks/h200_env.sh
. benchmarks/h200_env.sh   # once here, so that the runs below do not install side by side
IFS=';' read -ra VS <<< "$VARIANTS"
runs=()
for v in "${VS[@]}"; do
  runs+=("$v")
  [ "$REPEAT" = 1 ] && runs+=("${v%%=*}2=${v#*=}")
done
pids=(); names=()
for v in "${runs[@]}"; do
  name=${v%%=*}; sets=${v#*=}
  [ "$RESUME" = 1 ] || rm -rf "${RUNS:?}/$name"
  # shellcheck disable=SC2086  # $sets is a list of --set values
  NAME=$name bash benchmarks/ml1m_h200.sh $sets > "$OUT/$name.stdout" 2>&1 &
  pids+=($!); names+=("$name")
  sleep "$STAGGER_S"   # stagger the Ray start-ups
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for name in "${names[@]}"; do echo "== $name"; tail -8 "$OUT/$name.stdout"; rm -f "$OUT/$name.stdout"; done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
"$PY" - "$RUNS" "${names[@]}" <<'EOF' | tee "$OUT/ab_table.txt"
import json, sys
from pathlib import Path

runs, names = Path(sys.argv[1]), sys.argv[2:]

def steps(name):  # {global_step: (epoch, loss)}, the last attempt's value of a step that ran twice (a resume)
    out, f = {}, runs / name / "full" / "events.jsonl"
    for line in (f.read_text().splitlines() if f.exists() else []):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        d = e.get("detail", {})  # gemray.events: {"kind", "t", "attempt", "detail": {...}}
        if e.get("kind") == "step" and "loss" in d:
            out[int(d["global_step"])] = (int(d["epoch"]), float(d["loss"]))
    return out

def epochs(name, st):  # {epoch: train_loss}: metrics.json's history, else the mean of the steps' losses
    f = runs / name / "full" / "metrics.json"
    hist = json.loads(f.read_text()).get("history", []) if f.exists() else []
    if hist:
        return {int(h["epoch"]): float(h["train_loss"]) for h in hist if "train_loss" in h}, "history"
    by = {}
    for ep, loss in st.values():
        by.setdefault(ep, []).append(loss)
    return {ep: sum(v) / len(v) for ep, v in by.items()}, "mean of steps"

def test(name):
    f = runs / name / "full" / "metrics.json"
    m = json.loads(f.read_text()) if f.exists() else {}
    return m.get("hr@10"), m.get("ndcg@10")

st = {n: steps(n) for n in names}
ep = {n: epochs(n, st[n]) for n in names}
n_ep = max([max(e, default=0) for e, _ in ep.values()], default=0)
print(f"train loss per epoch ({', '.join(f'{n}: {ep[n][1]}' for n in names)})")
print(f"{'epoch':>12} " + " ".join(f"{n:>10}" for n in names))
for e in range(1, n_ep + 1):
    print(f"{e:>12} " + " ".join(f"{ep[n][0][e]:>10.4f}" if e in ep[n][0] else f"{'-':>10}" for n in names))
for label, i in (("test HR@10", 0), ("test NDCG@10", 1)):
    print(f"{label:>12} " + " ".join(f"{test(n)[i]:>10.4f}" if test(n)[i] is not None else f"{'-':>10}" for n in names))
base = names[0]
pairs = [(n, base) for n in names[1:]] + [(n, n[:-1]) for n in names if n.endswith("2") and n[:-1] in names[1:]]
for n, base in pairs:
    common = sorted(set(st[base]) & set(st[n]))
    d = [abs(st[n][s][1] - st[base][s][1]) for s in common]
    first = next((s for s in common if abs(st[n][s][1] - st[base][s][1]) > 1e-6), None)
    de = [abs(ep[n][0][e] - ep[base][0][e]) for e in ep[base][0] if e in ep[n][0]]
    print(f"{n} vs {base}: {len(common)} common steps, bit-identical {sum(x == 0 for x in d)}, max |d loss| per step "
          f"{max(d, default=float('nan')):.2e}, first step differing > 1e-6: {first}, max |d loss| per epoch "
          f"{max(de, default=float('nan')):.2e}")
EOF
exit "$rc"
