"""Where a JFA fwd+bwd spends its device time, per kernel launch, with and without TMA tile loads.

Runs on the lent H200 from the package layout deploy/h200/kernels_bench.sh builds (``gemray`` importable):
``python3 profile_bwd.py [--tiles JSON]``. For each bench batch (bf16, H=4, D=128, causal softmax) and each
TMA setting it runs 5 warm-up and 20 profiled fwd+bwd steps under torch.profiler and prints the mean device
time of each launch in step order: ``_gdpa_fwd``, then the backward's dQ launch (the first ``_gdpa_bwd``) and
dK/dV launch (the second). ``--tiles`` takes the "chosen tiles" JSON a bench run printed. Under ``ncu``
(``GEMRAY_PROFILE_ONE=uniform:64:4096:1`` runs only that batch / TMA setting, 3 steps) it serves as the
workload for Nsight Compute's stall sections.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.profiler import ProfilerActivity, profile

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja


def _steps(off, n, q, k, v, count: int) -> None:
    for _ in range(count):
        out = ja.jagged_attention_triton(q, k, v, off, n)
        out.backward(torch.ones_like(out) / math.sqrt(out.numel()))
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", default="")
    args = p.parse_args()
    if args.tiles:
        bench.apply_tiles(args.tiles)
    one = os.environ.get("GEMRAY_PROFILE_ONE")
    runs = [(kind, b, n, tma) for kind, b, n in bench.BATCHES for tma in (False, True)]
    if one:
        kind, b, n, tma = one.split(":")
        runs = [(kind, int(b), int(n), tma == "1")]
    print("| batch | TMA | fwd ms | dQ ms | dK/dV ms | sum ms | launches per step |")
    print("|---|---|---|---|---|---|---|")
    for kind, b, n, tma in runs:
        torch.manual_seed(0)
        off = bench.offsets_of(bench.make_lengths(kind, b, n))
        t = int(off[-1])
        q, k, v = (torch.randn(t, bench.H, bench.D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                   for _ in range(3))
        reg = ja.regime(t, b)
        saved = ja.TMA_LOADS[reg]
        ja.TMA_LOADS[reg] = tma
        try:
            _steps(off, n, q, k, v, 5)
            if one:
                _steps(off, n, q, k, v, 3)
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _steps(off, n, q, k, v, 20)
        finally:
            ja.TMA_LOADS[reg] = saved
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and e.name.startswith("_gdpa")), key=lambda e: e.time_range.start)
        per = len(kernels) // 20
        sums = [0.0] * per
        for i, e in enumerate(kernels[:per * 20]):
            sums[i % per] += e.time_range.elapsed_us() / 20 / 1000
        names = [e.name for e in kernels[:per]]
        cells = " | ".join(f"{s:.3f}" for s in sums[:3])
        print(f"| {kind} B={b} N={n} | {tma} | {cells} | {sum(sums):.3f} | {per}: {', '.join(names)} |", flush=True)


if __name__ == "__main__":
    main()
