"""Benchmark of the fused LayerNorm / RMSNorm + FP8 quantize kernel (gemray.kernels.norm_quant) against
F.layer_norm / F.rms_norm followed by a separate quantize pass, on one CUDA device (``gemray bench kernels`` runs it
as its "norm" section; the figures it measured are in gemray.kernels.norm_quant's docstring)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from gemray.kernels.norm_quant import _fwd_num_warps, _launch_fwd, norm_quant, quantize_blocks_ref

log = logging.getLogger(__name__)


def _useful_bytes(n: int, d: int, block_size: int, x_dtype: torch.dtype, has_bias: bool) -> int:
    """Bytes the op must move: read x + weight (+ bias), write y + fp8 copy + scales."""
    es = torch.empty((), dtype=x_dtype).element_size()
    return n * d * es + d * es * (2 if has_bias else 1) + n * d * es + n * d + n * (d // block_size) * 4


def bench_norm_quant(
    shapes: tuple[tuple[int, int], ...] = ((16384, 1024), (16384, 4096), (65536, 1024), (65536, 4096)),
    kinds: tuple[str, ...] = ("layer", "rms"),
    *,
    block_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-5,
    copy_ceiling_gbs: float = 4200.0,
    warps_sweep: tuple[int, ...] = (),
    backward: bool = True,
    compiled_baseline: bool = False,
    print_table: bool = True,
    device: str = "cuda",
) -> list[dict]:
    """Time the fused norm+quantize kernel against an unfused PyTorch pipeline on the current CUDA device.

    For each kind ("layer": weight+bias; "rms": weight) and (N, D) in ``shapes``, with x [N, D] ``dtype``
    (random normal), times with ``triton.testing.do_bench`` (median, ms; L2 flushed between runs):

    * ``ms_fused``: the Triton forward kernel alone (no autograd, stats not stored);
    * ``ms_fused_api``: the public ``norm_quant(..., backend="triton")`` (validation + autograd overhead);
    * ``ms_unfused``: ``F.layer_norm`` / ``F.rms_norm`` then ``quantize_blocks_ref`` (eager PyTorch:
      amax per block, scale, cast);
    * ``ms_unfused_compiled`` (if ``compiled_baseline``): the quantize pass under ``torch.compile``;
    * ``ms_bwd_fused`` / ``ms_bwd_torch`` (if ``backward``): dx, dweight, dbias of the Triton backward vs
      autograd through ``F.layer_norm`` / ``F.rms_norm``;
    * ``num_warps`` / ``ms_w<k>`` for each k in ``warps_sweep`` (forward kernel at other warp counts).

    GB/s counts useful bytes only (read x + weight (+ bias), write y + fp8 + scales; see ``_useful_bytes``),
    ``pct_ceiling`` is the fused GB/s over ``copy_ceiling_gbs`` (4.2 TB/s device-to-device copy measured on
    the H200, ../shared/NOTES.md), ``speedup`` = ms_unfused / ms_fused. Correctness is checked first:
    ``max_abs_err_y`` vs the unfused y and ``fp8_match`` = fraction of identical fp8 bytes.

    Returns one dict per (kind, N, D) and prints a table. Raises RuntimeError if ``device`` is "cuda" and
    none is available (``device="cpu"`` only makes sense under TRITON_INTERPRET=1, for smoke tests).
    """
    from triton.testing import do_bench

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_norm_quant needs a CUDA device")
    quant_compiled = torch.compile(quantize_blocks_ref, dynamic=True) if compiled_baseline else None
    rows = []
    for kind in kinds:
        for n, d in shapes:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n, d, device=dev, dtype=dtype, generator=g)
            w = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(dtype)
            b = (0.1 * torch.randn(d, device=dev, generator=g)).to(dtype) if kind == "layer" else None

            def unfused(quant=quantize_blocks_ref):
                if kind == "layer":
                    y = F.layer_norm(x, (d,), w, b, eps)
                else:
                    y = F.rms_norm(x, (d,), w, eps)
                return (y, *quant(y, block_size))

            def fused(num_warps=None):
                return _launch_fwd(x, w, b, kind, eps, block_size, False, num_warps)[:3]

            y, q, s = fused()
            yu, qu, su = unfused()
            row = {
                "kind": kind, "N": n, "D": d, "dtype": str(dtype).replace("torch.", ""),
                "block_size": block_size,
                "max_abs_err_y": (y.float() - yu.float()).abs().max().item(),
                "fp8_match": (q.view(torch.uint8) == qu.view(torch.uint8)).float().mean().item(),
                "num_warps": _fwd_num_warps(d),
            }
            del y, q, s, yu, qu, su
            nbytes = _useful_bytes(n, d, block_size, dtype, b is not None)
            row["ms_fused"] = do_bench(fused, return_mode="median")
            row["ms_fused_api"] = do_bench(
                lambda: norm_quant(x, w, b, kind=kind, eps=eps, block_size=block_size, backend="triton"),
                return_mode="median")
            row["ms_unfused"] = do_bench(unfused, return_mode="median")
            if quant_compiled is not None:
                try:
                    unfused(quant_compiled)
                    row["ms_unfused_compiled"] = do_bench(lambda: unfused(quant_compiled), return_mode="median")
                except Exception as exc:  # report, don't lose the other numbers
                    log.warning("compiled baseline failed for %s N=%d D=%d: %s", kind, n, d, exc)
            row["GB/s_fused"] = nbytes / row["ms_fused"] / 1e6
            row["GB/s_unfused"] = nbytes / row["ms_unfused"] / 1e6
            row["pct_ceiling"] = 100.0 * row["GB/s_fused"] / copy_ceiling_gbs
            row["speedup"] = row["ms_unfused"] / row["ms_fused"]
            if "ms_unfused_compiled" in row:
                row["speedup_vs_compiled"] = row["ms_unfused_compiled"] / row["ms_fused"]
            for nw in warps_sweep:
                row[f"ms_w{nw}"] = do_bench(lambda nw=nw: fused(nw), return_mode="median")
            if backward:
                params = [t.detach().requires_grad_(True) for t in (x, w, b) if t is not None]
                xp, wp = params[0], params[1]
                bp = params[2] if len(params) > 2 else None
                dy = torch.randn(n, d, device=dev, dtype=dtype, generator=g)
                yf = norm_quant(xp, wp, bp, kind=kind, eps=eps, block_size=block_size, backend="triton")[0]
                yt = F.layer_norm(xp, (d,), wp, bp, eps) if kind == "layer" else F.rms_norm(xp, (d,), wp, eps)
                gf = torch.autograd.grad(yf, params, dy, retain_graph=True)
                gt = torch.autograd.grad(yt, params, dy, retain_graph=True)
                row["bwd_max_rel_err"] = max(
                    ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-12)).item()
                    for a, c in zip(gf, gt))
                row["ms_bwd_fused"] = do_bench(
                    lambda: torch.autograd.grad(yf, params, dy, retain_graph=True), return_mode="median")
                row["ms_bwd_torch"] = do_bench(
                    lambda: torch.autograd.grad(yt, params, dy, retain_graph=True), return_mode="median")
                del yf, yt, gf, gt, params, xp, wp, bp, dy
            rows.append(row)
            log.info("bench_norm_quant row: %s", row)
            del x, w, b
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if print_table:
        _print_table(rows)
    return rows


def _print_table(rows: list[dict]) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(" | ".join(k.rjust(wd) for k, wd in zip(keys, widths)))
    for c in cells:
        print(" | ".join(v.rjust(wd) for v, wd in zip(c, widths)))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    bench_norm_quant()
