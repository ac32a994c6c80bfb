"""Host time of the GEM step's GEMMs when the token count changes every call, on the lent H200.

Why: in the GEM-scale step's profile (benchmarks/reports/gem_h200_2026-12-04.md) the host spent 9.1 ms per step in
54 ``aten::mm`` calls and 7.0 ms in 27 ``aten::addmm`` (170-260 us each, self time), and its own work per step was
of the order of the device's. Jagged batches give every step a new token count T, i.e. a new GEMM shape M = T (and
K = T for the weight gradients); cuBLAS(Lt) caches its heuristic's choice per shape, so a new T may pay the
heuristic on every first call of a shape. This script measures that directly: the host microseconds to enqueue
each GEMM of an HSTU block (width 1024, uvqk 4096, bf16) -- forward (addmm with bias), activation gradient, weight
gradient -- when T is (a) the same every call, (b) new every call, (c) new every call but rounded up to a multiple of
256 (``--round``) so that shapes repeat, and the device time of the same calls (CUDA events), so that a host saving
can be weighed against padding's extra rows.

    . benchmarks/h200_env.sh && python3 benchmarks/gemm_host_h200.py --out $OUT

Prints one table (median / p90 host us per call, median device us per call, per GEMM and variant) and writes
$OUT/gemm_host.json. No gemray code is used: plain torch on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

WIDTH, UVQK, T0 = 1024, 4096, 131_072


def _gemms(t: int, w1: torch.Tensor, b1: torch.Tensor, dev: torch.device) -> dict:
    """The block's three GEMM kinds at T = t: forward x @ W + b, activation gradient dY @ W^T, weight gradient
    x^T @ dY (inputs made here, outside the timed region)."""
    x = torch.randn(t, WIDTH, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(t, UVQK, device=dev, dtype=torch.bfloat16)
    return {"fwd addmm [T,1024]x[1024,4096]": lambda: torch.addmm(b1, x, w1),
            "dgrad mm [T,4096]x[4096,1024]": lambda: torch.mm(dy, w1.t()),
            "wgrad mm [1024,T]x[T,4096]": lambda: torch.mm(x.t(), dy)}


def _time(gname: str, t_of, calls: int, w1: torch.Tensor, b1: torch.Tensor, dev: torch.device) -> dict:
    """Host and device microseconds of ``calls`` calls of GEMM ``gname`` at T = t_of(i) (3 untimed first)."""
    host, dev_us = [], []
    for i in range(calls + 3):
        fn = _gemms(t_of(i), w1, b1, dev)[gname]
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        fn()
        h = time.perf_counter() - t0
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:  # the first calls of a process pay cuBLAS's set-up
            host.append(h * 1e6)
            dev_us.append(e0.elapsed_time(e1) * 1e3)
    host.sort()
    return {"host_us_median": statistics.median(host), "host_us_p90": host[int(0.9 * (len(host) - 1))],
            "device_us_median": statistics.median(dev_us), "calls": len(host)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--calls", type=int, default=40, help="calls per GEMM and variant")
    ap.add_argument("--round", type=int, default=256, help="variant (c): T rounded up to a multiple of this")
    ap.add_argument("--blas", default="default,cublas,cublaslt",
                    help="comma-separated torch.backends.cuda.preferred_blas_library values to run each variant "
                         "under ('default': as the process starts); default %(default)s")
    args = ap.parse_args()
    dev = torch.device("cuda")
    w1 = torch.randn(WIDTH, UVQK, device=dev, dtype=torch.bfloat16)
    b1 = torch.randn(UVQK, device=dev, dtype=torch.bfloat16)
    rows = []
    start_blas = torch.backends.cuda.preferred_blas_library()
    for k, blas in enumerate(args.blas.split(",")):
        torch.backends.cuda.preferred_blas_library(start_blas if blas == "default" else blas)
        new = T0 + 1000 * args.calls * (k + 1)  # T values no earlier library run has seen
        variants = {"same T": lambda i: T0,
                    "new T each call": lambda i, new=new: new + 7 * (i + 1),
                    f"new T rounded to {args.round}": lambda i: -(-(T0 + 7 * (i + 1)) // args.round) * args.round}
        for vname, t_of in variants.items():
            for gname in _gemms(16, w1, b1, dev):
                r = {"blas": blas, "variant": vname, "gemm": gname, **_time(gname, t_of, args.calls, w1, b1, dev)}
                rows.append(r)
                print(f"{blas:9s} {vname:24s} {gname:34s} host {r['host_us_median']:8.1f} us "
                      f"(p90 {r['host_us_p90']:8.1f})  device {r['device_us_median']:8.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
            "blas_at_start": str(start_blas), "rows": rows}
    (args.out / "gemm_host.json").write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
