"""A/B of the direct launch (jagged_attention.DIRECT_LAUNCH) against the JIT launch and varlen_attn, one process.

Runs on the lent H200 from the package layout deploy/h200/kernels_bench.sh builds (``gemray`` importable):
``python3 ab_launch.py [--rounds R]``. For each bench batch (bf16, H=4, D=128, causal softmax) and R alternating
rounds it times fwd+bwd as the bench does (eager ``do_bench`` median), the host time to enqueue one fwd+bwd
and one no-grad forward (no sync in the loop), for varlen_attn, JFA with direct launches and JFA through the
JIT, then once each as CUDA-graph replays (device time; the launch path cannot change it). One table.
"""

from __future__ import annotations

import argparse

import torch

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print("| batch | variant | round | fwd+bwd ms (eager) | host ms fwd+bwd | host ms fwd | vs varlen (eager) |")
    print("|---|---|---|---|---|---|---|")
    graph_rows = []
    for kind, b, n in bench.BATCHES:
        lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
        varlen = bench.varlen_causal(off, max(lengths))

        def jfa(a, bb, c):
            return ja.jagged_attention_triton(a, bb, c, off, n, activation="softmax")

        variants = {"varlen": (varlen, None), "jfa direct": (jfa, True), "jfa jit": (jfa, False)}
        with torch.no_grad():
            want = varlen(q, k, v)
            for name, (fn, direct) in variants.items():
                if direct is not None:
                    ja.DIRECT_LAUNCH = direct
                    diff = bench._rel(fn(q, k, v), want)
                    assert diff < 2e-2, (name, diff)
        for r in range(args.rounds):
            base = None
            for name, (fn, direct) in variants.items():
                if direct is not None:
                    ja.DIRECT_LAUNCH = direct
                _, t_fb = bench._time_fwd_bwd(fn, (q, k, v))
                host = bench._host_ms(fn, (q, k, v))
                host_f = bench._host_ms_fwd(fn, (q, k, v))
                base = t_fb if name == "varlen" else base
                print(f"| {kind} B={b} N={n} | {name} | {r + 1} | {t_fb:.3f} | {host:.3f} | {host_f:.3f} | "
                      f"{base / t_fb:.2f}x |", flush=True)
        for name, (fn, direct) in variants.items():
            if direct is not None:
                ja.DIRECT_LAUNCH = direct
            graph_rows.append((f"{kind} B={b} N={n}", name, bench._graph_ms(fn, (q, k, v))))
        ja.DIRECT_LAUNCH = True
        del q, k, v
        torch.cuda.empty_cache()
    print("\n| batch | variant | graph replay ms fwd+bwd |\n|---|---|---|")
    for batch, name, ms in graph_rows:
        print(f"| {batch} | {name} | {ms:.3f} |")
    print(f"\ndirect-launch cache entries: {len(ja._LAUNCHERS)}")


if __name__ == "__main__":
    main()
