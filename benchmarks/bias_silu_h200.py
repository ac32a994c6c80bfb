"""The HSTU block's uvqk activation at GEM scale on a lent GPU: the fused kernels (``model.uvqk_kernel = "triton"``)
against the compiled reference path, and the kernels' tiles.

Why: session 27 measured the fused forward at 5.9 ms a step against inductor's SiLU pass at 5.6 (the backward
9.1 ms against 9.0 + 2.75), inside the whole step (benchmarks/reports/gem_h200_2026-12-06.md). This times the
activation alone, one block's worth (T tokens of a gem-h200 batch, sizes 4 x 1024, bf16 x, float32 bias), CUDA
events via ``triton.testing.do_bench`` (median ms), and the bandwidth each reaches:

* ``reference``: ``torch.compile`` of split(silu(addmm(b, x_norm, W))) minus the GEMM: silu(x + b) then split, the
  bias gradient as inductor's column sum (what ``model.uvqk_kernel = "reference"`` runs under ``train.compile``);
* ``fused``: ``bias_silu_split_triton`` forward, and forward + backward, at the shipped tiles and at the
  ``--fwd-tiles`` / ``--bwd-tiles`` candidates (BLOCK_T x BLOCK_W / warps).

    . benchmarks/h200_env.sh && python3 benchmarks/bias_silu_h200.py --out $OUT

Prints one table; writes $OUT/bias_silu.json. Bytes moved per call: forward 2 T W x 2 B (read x, write the
splits); backward 3 T W x 2 B (read x and the gradients, write dx), the partial sums not counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from gemray.kernels import bias_silu

SIZES = [1024] * 4


def _tiles(spec: str) -> list[tuple[int, int, int]]:
    """"64x128/8,32x128/4" -> [(64, 128, 8), (32, 128, 4)]."""
    out = []
    for part in filter(None, spec.split(",")):
        tile, warps = part.split("/")
        bt, bw = tile.split("x")
        out.append((int(bt), int(bw), int(warps)))
    return out


def _reference(x, b, sizes):
    return list(torch.split(F.silu(x + b.to(x.dtype)), sizes, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--tokens", type=int, default=131072, help="T, a gem-h200 batch's tokens (default 131072)")
    ap.add_argument("--fwd-tiles", default="64x128/8,32x128/4,128x128/8,64x256/8,32x256/4")
    ap.add_argument("--bwd-tiles", default="64x128/8,32x128/4,128x128/8,32x256/8")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    T, W = args.tokens, sum(SIZES)
    x = torch.randn(T, W, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(W, device="cuda") * 0.1
    grads = [torch.randn(T, s, device="cuda", dtype=torch.bfloat16) for s in SIZES]
    gb = 2 * T * W  # bytes of one [T, W] bf16 tensor
    rows = []

    def add(name, fwd_ms, fb_ms):
        bwd_ms = fb_ms - fwd_ms
        rows.append(dict(name=name, fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, fwd_tb_s=2 * gb / fwd_ms / 1e9,
                         bwd_tb_s=3 * gb / bwd_ms / 1e9 if bwd_ms > 0 else None))

    ref = torch.compile(_reference)

    def ref_fb():
        xs, bs = x.detach().requires_grad_(), b.detach().requires_grad_()
        torch.autograd.backward(ref(xs, bs, SIZES), grads)

    ref(x, b, SIZES)
    ref_fb()
    add("reference (compiled)", do_bench(lambda: ref(x, b, SIZES)), do_bench(ref_fb))

    def fused_fb():
        xs, bs = x.detach().requires_grad_(), b.detach().requires_grad_()
        torch.autograd.backward(bias_silu.bias_silu_split_triton(xs, bs, SIZES), grads)

    want = _reference(x.float(), b, SIZES)
    fwd0, bwd0 = bias_silu.FWD_BLOCKS, bias_silu.BWD_BLOCKS
    for ft in _tiles(args.fwd_tiles):
        bias_silu.FWD_BLOCKS = ft
        got = bias_silu.bias_silu_split_triton(x, b, SIZES)
        err = max(float((g.float() - w.to(torch.bfloat16).float()).abs().max()) for g, w in zip(got, want))
        fwd = do_bench(lambda: bias_silu.bias_silu_split_triton(x, b, SIZES))
        for bt in _tiles(args.bwd_tiles) if ft == fwd0 else [bwd0]:
            bias_silu.BWD_BLOCKS = bt
            add(f"fused fwd {ft} bwd {bt}" + (" (shipped)" if (ft, bt) == (fwd0, bwd0) else "") +
                f" max|err| {err:.3g}", fwd, do_bench(fused_fb))
        bias_silu.BWD_BLOCKS = bwd0
    bias_silu.FWD_BLOCKS = fwd0
    print(f"{torch.cuda.get_device_name()}: T = {T}, sizes {SIZES}, bf16 x, float32 bias")
    print(f"{'variant':<70} {'fwd ms':>8} {'fwd+bwd ms':>11} {'fwd TB/s':>9} {'bwd TB/s':>9}")
    for r in rows:
        bw = "n/a" if r["bwd_tb_s"] is None else f"{r['bwd_tb_s']:.2f}"
        print(f"{r['name']:<70} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} {r['fwd_tb_s']:9.2f} {bw:>9}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bias_silu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "tokens": T, "sizes": SIZES, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
