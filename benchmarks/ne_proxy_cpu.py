"""NE / AUC of the click tower on a CPU proxy of configs/gem-h200.toml (issue 17): one ``gemray train`` per variant.

The GEM config at its full width (model_dim 1024, 4 heads x 256, the candidate tower, tasks retrieval / CTR / CVR)
cut to what 2 CPU cores train in minutes: 1 HSTU block, 8,192 synthetic users (histories <= 128 tokens, 100k items),
24 steps at batch 128, reference attention, fp32. It reproduces the H200's width-1024 collapse of the click tower
(nearly constant output, AUC ~0.5) and tests what fixes it before a device session spends its time on it.

    .venv/bin/python benchmarks/ne_proxy_cpu.py --out /tmp/ne_proxy \\
        --variant config= --variant "unscaled=train.lr_base_fan_in=0"

Each variant is ``name=--set values`` (space-separated ``section.key=value``). Results: ``OUT/<name>/metrics.json``
(test_ctr_ne / test_ctr_auc / test_ctr_calibration, test_cvr_*, hr@10 ...), ``OUT/<name>.log`` and one line per
variant on stdout and in ``OUT/summary.txt``. The data is generated once into ``OUT/data``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = ('["users=8192", "items=100000", "seed=0", "max_len=512", "min_len=16", "length_dist=lognormal", '
             '"mean_len=128", "len_sigma=1.0", "features=category=512,author=20000", "devices=4", "candidates=64", '
             '"ctr=0.05", "cvr=0.1", "signal=1.0"]')


def proxy_overrides(out: Path, steps: int) -> list[str]:
    """The --set values that cut configs/gem-h200.toml down to the proxy (module docstring)."""
    return [f"data.prepared_dir={out / 'data'}", "data.num_files=2", "data.max_seq_len=128",
            "data.eval_batch_size=128", f"data.synthetic={SYNTHETIC}", "model.num_blocks=1",
            "model.attention_backend=reference", "model.kernel_tiles=", "model.table_rows=[]", "train.epochs=1",
            "train.eval_every=1", "train.log_every=4", "train.precision=fp32", "train.compile=false",
            f"train.max_steps_per_epoch={steps}", "ray.use_gpu=false", "ray.cpus_per_worker=1"]


def summary_line(name: str, metrics_path: Path, rc: int, secs: float) -> str:
    try:
        m = json.loads(metrics_path.read_text())
    except (OSError, ValueError) as e:
        return f"{name}: rc={rc} {secs:.0f}s no metrics ({e}); see {name}.log"
    keys = ["test_ctr_ne", "test_ctr_auc", "test_ctr_calibration", "test_cvr_ne", "test_cvr_auc", "hr@10",
            "hr@10_unfiltered"]
    vals = " ".join(f"{k}={m[k]:.4f}" for k in keys if isinstance(m.get(k), (int, float)))
    return f"{name}: rc={rc} {secs:.0f}s {vals}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/ne_proxy"),
                    help="output folder (the data, one run folder and log per variant, summary.txt)")
    ap.add_argument("--variant", action="append", default=[],
                    help="name=--set values (repeatable; default: config= and unscaled=train.lr_base_fan_in=0)")
    ap.add_argument("--steps", type=int, default=24, help="training steps per variant (batch 128)")
    ap.add_argument("--gemray", default=str(Path(sys.executable).with_name("gemray")), help="the gemray CLI")
    ns = ap.parse_args(argv)
    ns.out = ns.out.resolve()  # the runs start in the repository root
    variants = ns.variant or ["config=", "unscaled=train.lr_base_fan_in=0"]
    ns.out.mkdir(parents=True, exist_ok=True)
    worst = 0
    with open(ns.out / "summary.txt", "w") as summary:
        for item in variants:
            name, _, sets = item.partition("=")
            t0 = time.time()
            cmd = [ns.gemray, "train", "--config", "configs/gem-h200.toml", "--output", str(ns.out / name),
                   "--set", *proxy_overrides(ns.out, ns.steps), *shlex.split(sets)]
            print(f"== {time.strftime('%H:%M:%S')} {name}: {sets}", flush=True)
            with open(ns.out / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            line = summary_line(name, ns.out / name / "metrics.json", rc, time.time() - t0)
            print(line, flush=True)
            summary.write(line + "\n")
            worst = max(worst, rc, 1 if "no metrics" in line else 0)
    return worst


if __name__ == "__main__":
    sys.exit(main())
