"""The warp-specialized silu backward (``RegimeConfig.ws_bwd``) against the shipped Triton launches, one GEM layer.

Times forward + backward of ``ops.attention`` (silu, causal, no bias: configs/gem-h200.toml's attention) on a
batch of the gem-h200 config's log-normal lengths (B = 128, H = 4, D = 256, bf16) with the shipped tiles
(configs/kernel-tiles-h200.json: ds_store + dk_from_ds) and the Triton dV + dS^T launch (ws_bwd off), then with
that launch replaced by the Gluon kernel (ws_attention.backward_dv_ds, ws_bwd), then with dQ and dK from its
stored dS^T also in Gluon (ws_attention.ds_gemm, ws_dkdq) at each number of ring slots, and once more with the
dS^T scratch NaN-filled; each variant's output and gradients are checked against the Triton launch's (bf16:
relative error < 1e-2), then one profiled forward + backward per variant gives the kernel sums. Runs on a bare torch + triton image (no torchrec):

    . benchmarks/h200_env.sh && python3 benchmarks/ws_bwd.py --out $OUT
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
from gemray.kernels import config as kconfig  # noqa: E402

# ring slots of the Gluon dQ / dK products (ws_dkdq), on the shipped ws_bwd tiles
DKDQ_STAGES = [3, 4]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tiles", default="configs/kernel-tiles-h200.json")
    ap.add_argument("--reps", type=int, default=3, help="timing rounds over the variants (interleaved)")
    args = ap.parse_args()
    from triton.testing import do_bench

    args.out.mkdir(parents=True, exist_ok=True)
    lengths, off, q, k, v, *_ = inputs(batch=args.batch)
    base = kconfig.apply_tiles(json.loads(Path(args.tiles).read_text()))
    reg = base.regime_of(int(off[-1]), args.batch)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    flop_fb = 3.5 * 4.0 * H * D * pairs
    print(f"{torch.cuda.get_device_name()}: B={args.batch} T={int(off[-1])} regime={reg} "
          f"{flop_fb / 1e12:.3f} TFLOP fwd+bwd; shipped {reg} mode: {base.regime(reg)}", flush=True)
    torch.manual_seed(1)
    do = torch.randn(q.shape[0], H, D, device="cuda", dtype=torch.bfloat16)

    def result(cfg):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        o = ops.attention(qq, kk, vv, off, N, activation="silu", backend="triton", config=cfg)
        o.backward(do)
        return [x.detach().float() for x in (o, qq.grad, kk.grad, vv.grad)]

    def step(cfg):
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        ops.attention(qq, kk, vv, off, N, activation="silu", backend="triton", config=cfg).backward(do)

    triton_bwd = base.with_regime(reg, ws_bwd=False)  # the Triton dK/dV launch (the shipped tiles before 2026-12-07)
    ref = result(triton_bwd)
    ws_bwd = base.with_regime(reg, ws_bwd=True, ws_dkdq=False)
    variants = [("triton dV + dS^T", triton_bwd), (f"ws_bwd {ws_bwd.regime(reg).ws_bwd_tiles}", ws_bwd)]
    variants += [(f"ws_dkdq stages {n}", base.with_regime(reg, ws_bwd=True, ws_dkdq=True, ws_dkdq_stages=n))
                 for n in DKDQ_STAGES]
    # the products read only what the dV + dS^T launch wrote: a NaN-filled scratch must change nothing
    variants += [("ws_dkdq, NaN scratch", variants[-1][1].replace(ds_scratch_nan=True))]
    rows = {}
    for name, cfg in variants:
        row = rows[name] = {"variant": name}
        try:
            got = result(cfg)
            row["err"] = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
            row["finite"] = all(bool(torch.isfinite(x).all()) for x in got)
            row["ms"] = []
        except Exception as e:  # noqa: BLE001 -- report and go on with the other variants
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
    for _ in range(args.reps):
        for name, cfg in variants:
            if "error" not in rows[name]:
                rows[name]["ms"].append(do_bench(lambda: step(cfg), warmup=5, rep=40))
    for name, cfg in variants:
        row = rows[name]
        if "error" in row:
            continue
        row["best_ms"] = min(row["ms"])
        row["tflops"] = flop_fb / row["best_ms"] / 1e9
        sums = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(cfg)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                sums[e.key[:40]] += e.device_time_total / 1e3 / 3
        row["kernels_ms"] = {kk: round(vv, 3) for kk, vv in sorted(sums.items(), key=lambda x: -x[1])[:8]}
        print(json.dumps(row), flush=True)
    (args.out / "ws_bwd.json").write_text(json.dumps(list(rows.values()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
