"""A/B of the cached launch plans (jagged_attention._fwd_plan / _bwd_plan) against the code before them, on the
host-bound short batch, in alternating processes.

``python3 ab_plan.py --trees OLD NEW [--rounds R]``: OLD and NEW are package roots (each with ``gemray/kernels``,
as deploy/h200/ab_plan.sh lays them out); each round runs ``python3 ab_plan.py --one`` in OLD, then in NEW, and
prints one table row per tree and batch. ``--one`` (run from a package root) times, per batch (bf16, H=4, D=128,
causal softmax): varlen_attn and JFA fwd+bwd as the bench does (eager ``do_bench`` median), JFA's host time to
enqueue one fwd+bwd and one no-grad forward (no sync in the loop), and JFA as CUDA-graph replays (device time,
which the host code cannot change), and prints them as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

BATCHES = [("heavy", 128, 1024), ("uniform", 128, 1024)]


def one() -> None:
    import torch

    from gemray.kernels import bench
    from gemray.kernels import jagged_attention as ja

    rows = []
    for kind, b, n in BATCHES:
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        varlen = bench.varlen_causal(off, max(lengths))

        def jfa(a, bb, c):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation="softmax")

        with torch.no_grad():
            diff = bench._rel(jfa(q, k, v), varlen(q, k, v))
        _, t_varlen = bench._time_fwd_bwd(varlen, (q, k, v))
        _, t_jfa = bench._time_fwd_bwd(jfa, (q, k, v))
        rows.append(dict(batch=f"{kind} B={b} N={n}", varlen_ms=t_varlen, jfa_ms=t_jfa,
                         host_ms=bench._host_ms(jfa, (q, k, v)), host_fwd_ms=bench._host_ms_fwd(jfa, (q, k, v)),
                         graph_ms=bench._graph_ms(jfa, (q, k, v)), rel_diff_vs_varlen=diff))
        del q, k, v
        torch.cuda.empty_cache()
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--one", action="store_true")
    p.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.one:
        one()
        return
    print("| batch | tree | round | JFA fwd+bwd ms (eager) | varlen ms | vs varlen | host ms fwd+bwd | host ms fwd "
          "| graph replay ms | rel diff vs varlen |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for name, root in zip(("before", "plans"), args.trees):
            # run from the tree's root (each holds a copy of this script), so that its gemray is the one imported
            out = subprocess.run([sys.executable, "ab_plan.py", "--one"], cwd=root, capture_output=True, text=True)
            if out.returncode:
                print(f"{name} failed:\n{out.stderr[-3000:]}", flush=True)
                continue
            for row in json.loads(out.stdout.strip().splitlines()[-1]):
                print(f"| {row['batch']} | {name} | {r + 1} | {row['jfa_ms']:.3f} | {row['varlen_ms']:.3f} | "
                      f"{row['varlen_ms'] / row['jfa_ms']:.2f}x | {row['host_ms']:.3f} | {row['host_fwd_ms']:.3f} | "
                      f"{row['graph_ms']:.3f} | {row['rel_diff_vs_varlen']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
