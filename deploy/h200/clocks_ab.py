"""JFA vs varlen_attn fwd+bwd with the SM clock and board power logged, rested and under sustained load.

Runs on the lent H200 from the package layout deploy/h200/kernels_bench.sh builds (``gemray`` importable):
``python3 clocks_ab.py``. Starts ``nvidia-smi`` logging SM clock, power and throttle reasons every 100 ms, then
for the two N=4096 bench batches (bf16, H=4, D=128, causal softmax) times each variant's fwd+bwd with
``triton.testing.do_bench`` (median, as the bench) in two states: "rested" (2 s idle before each timing, four
rounds, the variants alternating) and "sustained" (after 3 s of back-to-back steps of the same variant). Prints
one row per timing with the mean SM clock and power over its interval (read back from the log), so that a
ratio can be told apart from the clock the card ran at. Touches no clock or power setting.
"""

from __future__ import annotations

import csv
import os
import subprocess
import time
from datetime import datetime

import torch
from triton.testing import do_bench

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja

LOG = os.path.join(os.environ.get("OUT", "/tmp"), "smi.csv")


def _window(rows: list[dict], t0: float, t1: float) -> tuple[float, float, str]:
    """(mean SM MHz, mean W, throttle reasons seen) of the log rows between host times t0 and t1."""
    sel = [r for r in rows if t0 <= r["t"] <= t1]
    if not sel:
        return float("nan"), float("nan"), "-"
    reasons = sorted({r["why"] for r in sel})
    return (sum(r["mhz"] for r in sel) / len(sel), sum(r["w"] for r in sel) / len(sel), ",".join(reasons))


def _read_log() -> list[dict]:
    rows = []
    with open(LOG) as f:
        for r in csv.reader(f):
            if not r or r[0].startswith("timestamp"):
                continue
            try:
                t = datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append({"t": t, "mhz": float(r[1].split()[0]), "w": float(r[2].split()[0]),
                             "why": r[3].strip()})
            except (ValueError, IndexError):
                continue
    return rows


def main() -> None:
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv", "-lms", "100"], stdout=open(LOG, "w"), stderr=subprocess.DEVNULL)
    timings = []
    try:
        time.sleep(1.0)
        for kind, b, n in (("uniform", 64, 4096), ("heavy", 256, 4096)):
            lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
            fns = {"jfa": lambda a, bb, c: ja.jagged_attention_triton(a, bb, c, off, n, activation="softmax"),
                   "varlen": bench.varlen_causal(off, max(lengths))}
            do = torch.randn_like(q)

            def step(fn):
                fn(q, k, v).backward(do)

            for fn in fns.values():  # compile / warm up
                step(fn)
            torch.cuda.synchronize()
            for state in ("rested", "sustained"):
                for rnd in range(4 if state == "rested" else 1):
                    for name, fn in fns.items():
                        if state == "rested":
                            time.sleep(2.0)
                        else:
                            t_end = time.time() + 3.0
                            while time.time() < t_end:
                                for _ in range(5):
                                    step(fn)
                                torch.cuda.synchronize()
                        t0 = time.time()
                        ms = do_bench(lambda fn=fn: step(fn), warmup=25, rep=100, grad_to_none=[q, k, v],
                                      return_mode="median")
                        timings.append((f"{kind} B={b} N={n}", state, rnd, name, ms, t0, time.time()))
            del q, k, v
            torch.cuda.empty_cache()
        time.sleep(0.5)
    finally:
        smi.terminate()
        smi.wait()
    rows = _read_log()
    print("| batch | state | round | variant | fwd+bwd ms | mean SM MHz | mean W | throttle reasons (bitmask) |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, state, rnd, name, ms, t0, t1 in timings:
        mhz, w, why = _window(rows, t0, t1)
        print(f"| {batch} | {state} | {rnd} | {name} | {ms:.3f} | {mhz:.0f} | {w:.0f} | {why} |", flush=True)


if __name__ == "__main__":
    main()
