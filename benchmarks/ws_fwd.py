"""The warp-specialized silu forward (``RegimeConfig.ws_fwd_silu``) against Triton's _gdpa_fwd, one GEM layer.

Times ``ops.attention`` (silu, causal, no bias: configs/gem-h200.toml's attention) on a batch of the gem-h200
config's log-normal lengths (B = 128, H = 4, D = 256, bf16; benchmarks/attn_sweep_d256.py's inputs) with the shipped
tiles (configs/kernel-tiles-h200.json: the Triton forward, and behind it the ws_bwd + ws_dkdq backward it ships):
the forward alone (under no_grad) and forward + backward, with the Triton forward and with the Gluon silu forward
(ws_attention.forward_silu) at each (BLOCK_N, STAGES) of --silu-tiles that fits the head dim. Each variant's output
and gradients are checked against the Triton forward's (bf16: relative error of the norm < 1e-2 expected; the
largest elementwise error over the largest reference value is printed too), then one profiled forward + backward
per variant gives the kernel sums (ms per step). Runs on a bare torch + triton image (no torchrec / ray):

    . benchmarks/h200_env.sh && python3 benchmarks/ws_fwd.py --out $OUT

Prints one JSON line per variant and a table; writes $OUT/ws_fwd.json.
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
from gemray.kernels import ws_attention as ws  # noqa: E402


def _errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Per tensor (o, dq, dk, dv): relative error of the norm and max |got - ref| / max |ref| (fp32)."""
    out = {}
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        scale = float(b.abs().max().clamp_min(1e-30))
        out[name] = dict(rel=float((a - b).norm() / b.norm().clamp_min(1e-30)),
                         max_rel=float((a - b).abs().max()) / scale)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tiles", default="configs/kernel-tiles-h200.json")
    ap.add_argument("--silu-tiles", default="64x2", help="comma-separated BLOCK_NxSTAGES of the Gluon silu forward "
                    "(those that do not fit D = 256 are skipped)")
    ap.add_argument("--reps", type=int, default=3, help="timing rounds over the variants (interleaved)")
    args = ap.parse_args()
    from triton.testing import do_bench

    args.out.mkdir(parents=True, exist_ok=True)
    lengths, off, q, k, v, *_ = inputs(batch=args.batch)
    base = kconfig.apply_tiles(json.loads(Path(args.tiles).read_text()))
    reg = base.regime_of(int(off[-1]), args.batch)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    flop_f = 4.0 * H * D * pairs  # S = Q K^T and O = P V over the valid (causal) pairs
    flop_fb = 3.5 * flop_f
    print(f"{torch.cuda.get_device_name()}: B={args.batch} T={int(off[-1])} regime={reg} {flop_f / 1e12:.3f} TFLOP "
          f"fwd, {flop_fb / 1e12:.3f} fwd+bwd; shipped {reg} mode: {base.regime(reg)}", flush=True)
    torch.manual_seed(1)
    do = torch.randn(q.shape[0], H, D, device="cuda", dtype=torch.bfloat16)

    def result(cfg):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        o = ops.attention(qq, kk, vv, off, N, activation="silu", backend="triton", config=cfg)
        o.backward(do)
        return [x.detach().float() for x in (o, qq.grad, kk.grad, vv.grad)]

    def fwd(cfg):
        with torch.no_grad():
            ops.attention(q, k, v, off, N, activation="silu", backend="triton", config=cfg)

    def step(cfg):
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        ops.attention(qq, kk, vv, off, N, activation="silu", backend="triton", config=cfg).backward(do)

    triton_fwd = base.with_regime(reg, ws_fwd_silu=False)
    variants = [("triton _gdpa_fwd", triton_fwd)]
    for t in args.silu_tiles.split(","):
        tiles = tuple(int(x) for x in t.lower().split("x"))
        if not ws.silu_tiles_fit(D, tiles):
            print(f"skipped: silu tiles {tiles} do not fit D = {D}", flush=True)
            continue
        variants.append((f"ws_fwd_silu {tiles}", base.with_regime(reg, ws_fwd_silu=True, ws_fwd_silu_tiles=tiles)))
    ref = result(triton_fwd)
    rows = {}
    for name, cfg in variants:
        row = rows[name] = {"variant": name}
        try:
            got = result(cfg)
            row["err"] = _errors(got, ref)
            row["finite"] = all(bool(torch.isfinite(x).all()) for x in got)
            row["fwd_ms"], row["fwd_bwd_ms"] = [], []
        except Exception as e:  # noqa: BLE001 -- report and go on with the other variants
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
    for _ in range(args.reps):
        for name, cfg in variants:
            if "error" not in rows[name]:
                rows[name]["fwd_ms"].append(do_bench(lambda: fwd(cfg), warmup=5, rep=40))
                rows[name]["fwd_bwd_ms"].append(do_bench(lambda: step(cfg), warmup=5, rep=40))
    for name, cfg in variants:
        row = rows[name]
        if "error" in row:
            continue
        row["best_fwd_ms"], row["best_fwd_bwd_ms"] = min(row["fwd_ms"]), min(row["fwd_bwd_ms"])
        row["fwd_tflops"] = flop_f / row["best_fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = flop_fb / row["best_fwd_bwd_ms"] / 1e9
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
    print(f"\n{'variant':<26} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}  "
          "max rel err (o, dq, dk, dv)")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<26} {row['error'][:80]}")
            continue
        errs = ", ".join(f"{row['err'][t]['max_rel']:.1e}" for t in ("o", "dq", "dk", "dv"))
        print(f"{name:<26} {row['best_fwd_ms']:8.3f} {row['fwd_tflops']:8.1f} {row['best_fwd_bwd_ms']:11.3f} "
              f"{row['fwd_bwd_tflops']:8.1f}  {errs}")
    (args.out / "ws_fwd.json").write_text(json.dumps(list(rows.values()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
