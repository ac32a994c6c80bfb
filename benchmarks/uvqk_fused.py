"""The fused v / q / k activation + attention (``model.uvqk_kernel = "fused"``) against today's two ops, one GEM layer.

Forward + backward of one gem-h200 layer's v / q / k bias + SiLU and its attention (silu, causal, no bias; B = 128
log-normal lengths, H = 4, D = 256, bf16; configs/kernel-tiles-h200.json, whose regime runs the Gluon dV + dS^T
launch and the Gluon dQ / dK products): "unfused" is ``bias_silu_split_triton`` then ``ops.attention`` (the
attention backward writes dq / dk, bias_silu's backward reads them back with x), "fused" is
``uvqk_attention.vqk_attention_triton`` (dQ / dK's epilogue writes q / k's d_x and bias partial sums). Checked
against each other first: out and dx must be the same bits, dbias close (rel < 1e-3: q / k's columns are summed in
another order); then best-of-``--reps`` interleaved timings of forward + backward and one profiled pass per variant
(kernel sums, ms), the fused op also without its L2 prefetch of x (``ws_attention.ACT_PREFETCH``). Prints a table and writes ``$OUT/uvqk_fused.json``. Runs on a bare torch + triton image:

    . benchmarks/h200_env.sh && python3 benchmarks/uvqk_fused.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_sweep_d256 import H, D, N, inputs  # noqa: E402

from gemray import ops  # noqa: E402
from gemray.kernels import bias_silu  # noqa: E402
from gemray.kernels import config as kconfig  # noqa: E402
from gemray.kernels import uvqk_attention  # noqa: E402
from gemray.kernels import ws_attention as ws  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tiles", default="configs/kernel-tiles-h200.json")
    ap.add_argument("--reps", type=int, default=3, help="timing rounds over the variants (interleaved)")
    args = ap.parse_args()
    from triton.testing import do_bench

    args.out.mkdir(parents=True, exist_ok=True)
    lengths, off, *_ = inputs(batch=args.batch)
    T = int(off[-1])
    cfg = kconfig.apply_tiles(json.loads(Path(args.tiles).read_text()))
    reg = cfg.regime_of(T, args.batch)
    rc = cfg.regime(reg)
    print(f"{torch.cuda.get_device_name()}: B={args.batch} T={T} regime={reg} ws_bwd={rc.ws_bwd} "
          f"ws_dkdq={rc.ws_dkdq} stages={rc.ws_dkdq_stages}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    sizes = [H * D] * 3  # v, q, k
    x = torch.randn(T, sum(sizes), device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(sum(sizes), device="cuda", dtype=torch.float32, generator=g) * 0.1
    do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def unfused(xx, bb):
        v, q, k = bias_silu.bias_silu_split_triton(xx, bb, sizes)
        return ops.attention(q.view(T, H, D), k.view(T, H, D), v.view(T, H, D), off, N, activation="silu",
                             backend="triton", config=cfg)

    def fused(xx, bb):
        return uvqk_attention.vqk_attention_triton(xx, bb, off, N, H, D, D, activation="silu", config=cfg)

    def result(fn):
        xx, bb = x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
        o = fn(xx, bb)
        o.backward(do)
        return o.detach(), xx.grad, bb.grad

    def step(fn):
        xx, bb = x.detach().requires_grad_(True), bias.detach().requires_grad_(True)
        fn(xx, bb).backward(do)

    epilogue = []
    real = ws.ds_gemm

    def spy(*a, **kw):  # whether the fused backward's dQ / dK ran the ACT_GRAD epilogue
        epilogue.append(kw.get("act") is not None)
        return real(*a, **kw)

    def fused_no_prefetch(xx, bb):  # the epilogue's x loads from DRAM (ws_attention.ACT_PREFETCH off)
        ws.ACT_PREFETCH = False
        try:
            return fused(xx, bb)
        finally:
            ws.ACT_PREFETCH = True

    variants = [("unfused", unfused), ("fused", fused), ("fused, no L2 prefetch", fused_no_prefetch)]
    rows = {name: {"variant": name, "ms": []} for name, _ in variants}
    try:
        want = result(unfused)
        ws.ds_gemm = spy
        got = result(fused)
        ws.ds_gemm = real
        rows["fused"]["epilogue_ran"] = bool(epilogue) and all(epilogue)
        rows["fused"]["check"] = {
            "out_equal": bool(torch.equal(got[0], want[0])),
            "dx_equal": bool(torch.equal(got[1], want[1])),
            "dx_mismatches": int((got[1] != want[1]).sum()),
            "dx_v_equal": bool(torch.equal(got[1][:, :H * D], want[1][:, :H * D])),
            "dbias_rel": float((got[2] - want[2]).abs().max() / want[2].abs().max().clamp_min(1e-30)),
            "finite": bool(all(torch.isfinite(t.float()).all() for t in got)),
        }
        print(json.dumps(rows["fused"]), flush=True)
    except Exception as e:  # noqa: BLE001 -- report and still time what runs
        ws.ds_gemm = real
        rows["fused"]["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    for _ in range(args.reps):
        for name, fn in variants:
            if "error" not in rows[name]:
                rows[name]["ms"].append(do_bench(lambda: step(fn), warmup=5, rep=40))
    for name, fn in variants:
        row = rows[name]
        if "error" in row:
            continue
        row["best_ms"] = min(row["ms"])
        sums = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(fn)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                sums[e.key[:40]] += e.device_time_total / 1e3 / 3
        row["kernels_ms"] = {kk: round(vv, 3) for kk, vv in sorted(sums.items(), key=lambda s: -s[1])[:10]}
        print(json.dumps(row), flush=True)
    print(f"\n| variant | best fwd+bwd ms | {' | '.join(f'rep {i + 1}' for i in range(args.reps))} |")
    print("|---|---|" + "---|" * args.reps)
    for row in rows.values():
        if "best_ms" in row:
            print(f"| {row['variant']} | {row['best_ms']:.3f} | " + " | ".join(f"{m:.3f}" for m in row["ms"]) + " |")
    kernels = sorted({k for r in rows.values() for k in r.get("kernels_ms", {})},
                     key=lambda k: -max(r.get("kernels_ms", {}).get(k, 0.0) for r in rows.values()))
    names = [name for name, _ in variants]
    print(f"\n| kernel (ms per fwd+bwd) | {' | '.join(names)} |\n|---|" + "---|" * len(names))
    for k in kernels:
        print(f"| {k} | " + " | ".join(f"{rows[n].get('kernels_ms', {}).get(k, 0.0):.3f}" for n in names) + " |")
    (args.out / "uvqk_fused.json").write_text(json.dumps(list(rows.values()), indent=1))
    ok = "error" not in rows["fused"] and rows["fused"]["check"]["dx_equal"] and rows["fused"]["check"]["out_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
