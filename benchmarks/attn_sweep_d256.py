"""Tile sweep of the jagged attention kernels at GEM scale's head dim (D = 256), on the lent H200.

The D = 256 tiles of ``gemray.kernels.config`` were never swept (kept from run 3); the GEM-scale config
(configs/gem-h200.toml: 4 heads x 256, batch 32, log-normal lengths of mean ~1000 capped at 4096) runs them in every
HSTU layer. This script times, on a batch drawn like that config's histories, every candidate tile of the kernel
kinds the batch's regime launches -- the silu forward, then the DS_STORE backward's dK/dV and dQ launches, then the
recomputing backward's (ds_store off) -- one kind at a time (coordinate descent from the defaults), with and without
the in-kernel relative position / time bias. A candidate that does not fit the SM (Triton OutOfResources) or whose
output differs from the default's by more than 1e-2 (relative) is recorded and skipped.

    . benchmarks/h200_env.sh && python3 benchmarks/attn_sweep_d256.py --out $OUT [--deadline-s 240]

A focused re-sweep from the shipped tiles, on the step's batch size, one kind, no bias, with TMA tile loads too:

    python3 benchmarks/attn_sweep_d256.py --out $OUT --base-tiles configs/kernel-tiles-h200.json --batch 128 \
        --kinds dkdv_ds,dkdv_ds+dk_ds,dk_ds --no-bias --tma both

The dK/dV candidates 32x64/8w and 16x64/8w were added on 2026-12-05 from sm_90 compiles (gemray.bench.sass_check
at D = 256): the shipped 64x64/8w/2 keeps 255 registers and reloads 25-38 spilled values (LDL) per query-tile
iteration; 32x64/8w/2 reloads 13-24 (1-9 with TMA loads), 16x64/8w/2 none. With dk_from_ds (the dK/dV launch keeps
only dV; dK = dS^T Q in its own launch) 64x64/8w/2's query loop has no spills left in its unmasked part (14 LDL in
the diagonal tiles'), 32x128/8w/2 none at all. Not timed yet.

Prints one line per timed candidate and, at the end, the winners as ``KernelConfig`` tiles with the fwd+bwd ms of
the default and of the winners; writes $OUT/attn_sweep_d256.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path

import torch

from gemray import ops
from gemray.bench.kernels import rel_bias_inputs
from gemray.kernels.config import DEFAULT, KernelConfig

B, N, H, D = 32, 4096, 4, 256
FWD = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 1),
       (64, 64, 4, 1), (64, 128, 8, 1), (128, 128, 8, 1), (64, 32, 4, 3)]
DKDV = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 1),
        (64, 32, 4, 2), (32, 64, 4, 1), (64, 64, 8, 1), (128, 64, 8, 1), (32, 64, 8, 2), (32, 64, 8, 3),
        (16, 64, 8, 2), (16, 64, 8, 3)]
# dK = dS^T Q from the stored dS^T (the regime's dk_from_ds): (query step, key tile, warps, stages)
DK = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (128, 64, 8, 2),
      (64, 32, 4, 2)]
DQ = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 1),
      (64, 128, 8, 1), (32, 64, 4, 2)]


def gem_lengths(seed: int = 0, batch: int = B) -> list[int]:
    """``batch`` log-normal lengths of mean ~1024 (sigma 1), in [16, N]: the gem-h200 config's histories."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, generator=g)
    return torch.exp(math.log(1024) - 0.5 + z).round().clamp(16, N).long().tolist()


def inputs(seed: int = 0, batch: int = B):
    """(lengths, offsets, q, k, v, timestamps, query times, pos_w [128], ts_w [64]) of a gem-h200-like batch."""
    return rel_bias_inputs("gem", batch, N, H, D, 128, 64, seed, lengths=gem_lengths(seed, batch))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/out"))
    ap.add_argument("--deadline-s", type=float, default=240.0, help="stop starting candidates after this")
    ap.add_argument("--tiles-dir", type=Path, default=None,
                    help="also write the winners as model.kernel_tiles JSON files tiles_d256_{nobias,bias}.json here "
                         "(default: --out)")
    ap.add_argument("--base-tiles", default="", help="start from this model.kernel_tiles JSON (e.g. "
                    "configs/kernel-tiles-h200.json) instead of gemray.kernels.config.DEFAULT")
    ap.add_argument("--batch", type=int, default=B, help=f"sequences in the timed batch (default {B}; the "
                    "gem-h200 step's is 128)")
    ap.add_argument("--kinds", default="fwd_silu,dkdv_ds,dkdv_ds+dk_ds,dk_ds,dq_ds,dkdv,dq",
                    help="comma-separated stages to sweep (a tile kind; dkdv_ds+dk_ds: the dK/dV tiles with "
                         "dk_from_ds on)")
    ap.add_argument("--no-bias", action="store_true", help="skip the pass with the in-kernel relative bias")
    ap.add_argument("--tma", choices=("off", "on", "both"), default="off",
                    help="tile loads through TMA descriptors in the swept stages (both: each candidate twice)")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - {"fwd_silu", "dkdv_ds", "dkdv_ds+dk_ds", "dk_ds", "dq_ds", "dkdv", "dq"})
    if unknown:
        ap.error(f"--kinds: unknown {unknown}")
    if args.base_tiles:
        from gemray.model.hstu import kernel_config_of

        start = kernel_config_of(args.base_tiles)
    else:
        start = DEFAULT
    from triton.testing import do_bench

    t_end = time.monotonic() + args.deadline_s
    lengths, off, q, k, v, ts, tq, pos_w, ts_w = inputs(batch=args.batch)
    reg = start.regime_of(int(off[-1]), args.batch)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    flop_fb = 3.5 * 4.0 * H * D * pairs
    print(f"batch: B={args.batch} tokens={int(off[-1])} max={max(lengths)} mean={sum(lengths) / B:.0f} regime={reg} "
          f"H={H} D={D}; {flop_fb / 1e12:.3f} TFLOP fwd+bwd (NVIDIA convention)", flush=True)
    rows: list[dict] = []

    def run(cfg: KernelConfig, bias: bool, backward: bool) -> float:
        rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, N, query_timestamps=tq) if bias else None

        def fwd():
            return ops.attention(q, k, v, off, N, activation="silu", rel_bias=rel, backend="triton", config=cfg)

        if not backward:
            with torch.no_grad():
                return float(do_bench(fwd, warmup=5, rep=30, return_mode="median"))
        do = torch.randn(q.shape[0], H, D, device="cuda", dtype=torch.bfloat16)
        return float(do_bench(lambda: fwd().backward(do), warmup=5, rep=30, return_mode="median",
                              grad_to_none=[q, k, v, pos_w, ts_w]))

    def output(cfg: KernelConfig, bias: bool):
        rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, N, query_timestamps=tq) if bias else None
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        o = ops.attention(qq, kk, vv, off, N, activation="silu", rel_bias=rel, backend="triton", config=cfg)
        o.backward(torch.ones_like(o) * 1e-2)
        return [x.detach().float() for x in (o, qq.grad, kk.grad, vv.grad)]

    summary = {}
    for bias in (False,) if args.no_bias else (False, True):
        tag = "bias" if bias else "nobias"
        base = start
        ref = output(base, bias)
        t_default = run(base, bias, True)
        print(f"[{tag}] default: fwd+bwd {t_default:.3f} ms ({flop_fb / t_default / 1e9:.0f} TF/s)", flush=True)
        best_cfg, best_t = base, t_default
        # (stage, tile kind, candidates, time the backward, regime mode): "dkdv_ds+dk_ds" sweeps the dK/dV launch's
        # tiles with dk_from_ds on (dV only there; dK = dS^T Q in its own launch, whose tiles "dk_ds" sweeps)
        split = {"ds_store": True, "dk_from_ds": True}
        stages = [("fwd_silu", "fwd_silu", FWD, False, {}),
                  ("dkdv_ds", "dkdv_ds", DKDV, True, {"ds_store": True, "dk_from_ds": False}),
                  ("dkdv_ds+dk_ds", "dkdv_ds", DKDV, True, split), ("dk_ds", "dk_ds", DK, True, split),
                  ("dq_ds", "dq_ds", DQ, True, {"ds_store": True}), ("dkdv", "dkdv", DKDV, True, {"ds_store": False}),
                  ("dq", "dq", DQ, True, {"ds_store": False})]
        tma_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.tma]
        for stage, kind, cands, backward, mode in stages:
            if stage not in kinds:
                continue
            timed = []
            for tile, tma in ((t, m) for t in cands for m in tma_modes):
                mode = dict(mode, tma_loads=tma) if args.tma != "off" else mode
                stage_base = best_cfg.with_regime(reg, **mode) if mode else best_cfg
                if time.monotonic() > t_end:
                    print(f"[{tag}] deadline: {stage} {tile} not timed", flush=True)
                    break
                cfg = stage_base.with_tile(reg, kind, tile, d=256)
                row = {"bias": bias, "stage": stage, "kind": kind, "tile": list(tile), **mode}
                try:
                    got = output(cfg, bias)
                    err = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref))
                    row["err"] = err
                    if not err < 1e-2:
                        row["skipped"] = "output differs from the default's"
                    else:
                        row["ms"] = run(cfg, bias, backward)
                        timed.append((row["ms"], tile, tma))
                except Exception as e:  # OutOfResources (shared memory / registers) and compile failures
                    row["error"] = repr(e)[:200]
                    if "OutOfResources" not in repr(e):
                        traceback.print_exc()
                rows.append(row)
                print(f"[{tag}] {stage} {tile} {mode or ''}: "
                      + (f"{row['ms']:.3f} ms" if "ms" in row else row.get("error", row.get("skipped", ""))),
                      flush=True)
                torch.cuda.empty_cache()
            if timed:
                ms, tile, tma = min(timed)
                mode = dict(mode, tma_loads=tma) if args.tma != "off" else mode
                cand_cfg = (best_cfg.with_regime(reg, **mode) if mode else best_cfg).with_tile(reg, kind, tile, d=256)
                t_fb = run(cand_cfg, bias, True)
                if t_fb < best_t:
                    best_cfg, best_t = cand_cfg, t_fb
                print(f"[{tag}] best {stage}: {tile} -> fwd+bwd {t_fb:.3f} ms (best so far {best_t:.3f})", flush=True)
        rc = best_cfg.regime(reg)
        summary[tag] = {"regime": reg, "default_ms": t_default, "best_ms": best_t,
                        "default_tflops": flop_fb / t_default / 1e9, "best_tflops": flop_fb / best_t / 1e9,
                        "ds_store": rc.ds_store, "tma_loads": rc.tma_loads, "dk_from_ds": rc.dk_from_ds,
                        "tiles_d256": {kk: list(rc.tiles.get(kk, 256)) for kk in
                                       ("fwd_silu", "dkdv_ds", "dk_ds", "dq_ds", "dkdv", "dq")}}
        print(f"[{tag}] RESULT {json.dumps(summary[tag])}", flush=True)
        # the gem-h200 batches' mean length straddles the medium / long bound (1024): both get the winners
        tiles = {}
        for r in sorted({reg, "medium", "long"}):
            tiles[r] = {kk: {"256": list(rc.tiles.get(kk, 256))} for kk in
                        ("fwd_silu", "dkdv_ds", "dk_ds", "dq_ds", "dkdv", "dq")}
            tiles[r]["mode"] = {"ds_store": rc.ds_store, "tma_loads": rc.tma_loads, "dk_from_ds": rc.dk_from_ds}
        for d in {args.out, args.tiles_dir or args.out}:
            d.mkdir(parents=True, exist_ok=True)
            (d / f"tiles_d256_{tag}.json").write_text(json.dumps(tiles))
        print(f"[{tag}] model.kernel_tiles: {json.dumps(tiles)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attn_sweep_d256.json").write_text(json.dumps({"summary": summary, "rows": rows,
                                                               "lengths": lengths}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
