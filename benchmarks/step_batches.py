"""The batches behind a `gemray bench train` run's steps, rebuilt on the CPU, beside the steps' measured times.

`gemray bench train` reads the train stream from its start: its records (warm-up, then measured) are the stream's
batches 0, 1, 2, ... in order, the same for every run of a config and seed. This rebuilds them from the prepared
data (a synthetic config's data is generated first when missing, as training does; ~1 min for configs/gem-h200.toml
on 2 cores) and prints, per measured step, the mean step time over the given runs, the time a least-squares fit on
tokens and causal attention pairs predicts (fitted on the steps `slow_steps` does not list in any run), and what
sets the batch apart: tokens, longest history, pairs, the attention's tile waste (causal 128 x 64 tiles over valid
pairs), histories under 128 / over 2048 tokens, candidates. Checks each record's token count against its batch.

    python benchmarks/step_batches.py --config configs/gem-h200.toml --data /tmp/gem-h200 RUN.json [RUN2.json ...]

Used on session 37's four H100 runs (benchmarks/reports/gem_h200_2026-12-08.md): the slow batches are not told
apart by any of these.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gemray.bench.train import slow_steps
from gemray.config import load_config
from gemray.pipelines.loader import TrainLoader
from gemray.pipelines.synthetic import ensure_synthetic


def causal_tiles(lengths: np.ndarray, block_m: int = 128, block_n: int = 64) -> int:
    """Causal attention tiles (block_m query rows x block_n keys) the kernels visit over histories ``lengths``."""
    t = 0
    for n in lengths.tolist():
        for q0 in range(0, n, block_m):
            t += -(-min(n, q0 + block_m) // block_n)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", default=None, help="data.prepared_dir to use (default: the config's)")
    ap.add_argument("runs", nargs="+", help="gemray bench train --json files of that config")
    a = ap.parse_args()
    runs = [json.load(open(f)) for f in a.runs]
    warm = {r["warmup_steps"] for r in runs}
    if len(warm) != 1:
        raise SystemExit(f"the runs have different warm-up step counts {sorted(warm)}: their steps are other batches")
    warm = warm.pop()
    cfg = load_config(a.config, [f"data.prepared_dir={a.data}"] if a.data else [])
    if cfg.data.synthetic:
        ensure_synthetic(cfg.data)
    measured = [[s for s in r["steps"] if s["phase"] != "warmup"] for r in runs]
    n = min(len(m) for m in measured)
    stream = TrainLoader.from_config(cfg.data, rank=0, world_size=1, seed=cfg.train.seed, device_type="cpu")
    batches = []
    for i, (b, _) in enumerate(stream.iter_epoch(0, 0)):
        if i >= warm:
            lens = np.diff(b.offsets.numpy())
            cands = np.diff(b.candidate_offsets.numpy()) if b.candidate_offsets is not None else np.zeros(0)
            batches.append((lens, int(cands.sum())))
        if len(batches) == n:
            break
    slow = set()
    for m in measured:
        for rec, (lens, _) in zip(m, batches):
            if rec["tokens"] != int(lens.sum()):
                raise SystemExit(f"a record has {rec['tokens']} tokens where the stream's batch has {lens.sum()}: "
                                 "another data folder or seed than the run's")
        res = slow_steps(m[:n])
        slow |= {s["index"] for s in (res or {}).get("steps", [])}
    ms = np.array([[m[i]["step_s"] * 1e3 for m in measured] for i in range(n)]).mean(axis=1)
    pairs = np.array([float((l * (l + 1) / 2).sum()) for l, _ in batches])
    x = np.array([[l.sum() / 1e3, p / 1e6, 1.0] for (l, _), p in zip(batches, pairs)])
    good = [i for i in range(n) if i not in slow]
    coef, *_ = np.linalg.lstsq(x[good], ms[good], rcond=None)
    print(f"{len(runs)} run(s), {n} measured steps after {warm} warm-up; fit on the {len(good)} steps no run lists as "
          f"slow: {coef[0]:.3f} ms per 1k tokens + {coef[1]:.4f} ms per M causal pairs + {coef[2]:.1f} ms")
    print("step      ms    fit  excess  tokens  longest  pairs(M)  tile waste  <128  >2048  candidates")
    for i, ((lens, c), p) in enumerate(zip(batches, pairs)):
        pred = x[i] @ coef
        waste = causal_tiles(lens) * 128 * 64 / p
        print(f"{i:3d}{'*' if i in slow else ' '} {ms[i]:7.1f} {pred:6.1f} {ms[i] - pred:+6.1f} {lens.sum():7d} "
              f"{lens.max():7d} {p / 1e6:8.1f} {waste:10.3f} {(lens < 128).sum():5d} {(lens > 2048).sum():5d} {c:10d}")


if __name__ == "__main__":
    main()
