"""Fused LayerNorm / RMSNorm + FP8 (e4m3) block quantization, in Triton (issue 3).

One pass over the input row produces three outputs:

* ``y``       [N, D] in ``x.dtype``: the normalized, affine-transformed row (differentiable);
* ``y_fp8``   [N, D] ``torch.float8_e4m3fn``: ``y`` quantized with one scale per block of
  ``block_size`` consecutive columns of a row (non-differentiable side output);
* ``scales``  [N, D // block_size] float32: ``amax(|y_block|) / 448`` (448 = largest finite e4m3fn
  value), so that ``y ~= y_fp8.float() * scales.repeat_interleave(block_size, dim=1)``.

Shape key: N rows (tokens), D features, G = D // block_size scale groups per row.

The quantized copy is what the next matmul consumes (1 x ``block_size`` tile-wise activation scaling as in
the DeepSeek-V3 technical report, sec. 3.3.2, arXiv:2412.19437); fusing it into the normalization saves
re-reading ``y`` and the several element-wise passes an eager quantize needs. The norms follow
Ba et al. 2016 (LayerNorm, arXiv:1607.06450) and Zhang & Sennrich 2019 (RMSNorm, arXiv:1910.07467); the
kernel structure (one row per program forward; row-chunked backward with per-program partial weight
gradients) follows the Triton "Layer Normalization" tutorial.

Quantization details (shared by the Triton kernel and the reference, so both give the same bytes):
``y`` is first rounded to ``x.dtype`` (the value the caller sees), then per block
``amax = max |y|``, ``scale = amax / 448``, ``q = clamp(y * (448 / amax), -448, 448)`` cast to e4m3fn
with round-to-nearest-even; an all-zero block gets ``scale = 0`` and ``q = 0``.

Notes:

* ``torch.float8_e4m3fn`` tensors work on CPU and in the Triton interpreter (``TRITON_INTERPRET=1``,
  triton 3.9): the kernel stores e4m3 directly, no uint8 view is needed (checked in the tests). But the
  interpreter's fp32 -> fp8e4nv cast rounds wrongly (no carry into the exponent: 125.06 -> 64), so the
  kernel rounds to the e4m3 grid itself first (``_round_to_e4m3``); the test checks it byte-for-byte
  against torch's cast, incl. ties (also passed on the H200 with triton 3.6).
* ``D`` must be a multiple of ``block_size`` and ``block_size`` a power of two (ValueError otherwise).
* ``backend="auto"`` runs Triton on CUDA tensors and the PyTorch reference elsewhere; it never falls back
  silently from an explicit ``backend="triton"``.

Measured (H200, bf16, triton 3.6, torch 2.11, block_size=128, do_bench median, 2026-11-30), forward with
the warp count ``_fwd_num_warps`` now picks, vs ``F.layer_norm``/``F.rms_norm`` + eager quantize:

    kind   N      D     fused ms  GB/s (of 4200)  speedup  vs torch.compile'd quantize
    layer  16384  1024  0.033     2571 (61%)       9.0x    5.7x
    layer  16384  4096  0.107     3153 (75%)       9.4x    5.6x
    layer  65536  1024  0.107     3158 (75%)       9.9x    6.0x
    layer  65536  4096  0.404     3347 (80%)       9.6x    5.8x
    rms    16384  1024  0.028     2981 (71%)       9.9x    5.4x
    rms    16384  4096  0.096     3505 (83%)      10.2x    6.0x
    rms    65536  1024  0.093     3631 (86%)      10.7x    6.2x
    rms    65536  4096  0.359     3759 (90%)      10.6x    6.3x

The backward (dx, dweight, dbias) is slower than PyTorch's at N=16384 (0.2-0.6 ms vs 0.1-0.23 ms) and
faster at N=65536, D=4096 (0.64 vs 0.94 ms layer; 0.58 vs 0.90 ms rms): not yet tuned.

The PyTorch reference (``norm_quant_ref``, ``quantize_blocks_ref``) and the input checks live in
``gemray.kernels.reference`` (importable without triton); they are re-exported here. The benchmark is
``gemray.bench.norm_quant.bench_norm_quant`` (``gemray bench kernels`` runs it on a CUDA machine).

Custom ops (torch.library, namespace ``gemray``): ``gemray::norm_quant_fwd`` (-> y, y_fp8, scales, mean, rstd) and
``gemray::norm_quant_bwd`` (-> dx, dweight, dbias), with fake (meta) implementations and the backward registered as
the forward's autograd formula, so torch.compile and FakeTensor / meta tracing see through ``norm_quant``. Plain
eager calls run the same launches through an autograd.Function instead of the dispatcher (the Python custom op's
dispatch costs tens of microseconds per call, as much as the forward kernel at N=16384, D=1024), as
``gemray.kernels._eager.plain_eager`` decides (the attention ops too).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from ._eager import plain_eager
from .reference import (  # noqa: F401  (re-exported: the spec lives in reference.py)
    NORM_QUANT_FP8_DTYPE as FP8_DTYPE,
    NORM_QUANT_FP8_MAX as FP8_MAX,
    check_norm_quant_inputs,
    norm_quant_ref,
    quantize_blocks_ref,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _round_to_e4m3(v):
    """Round float32 ``v`` (|v| <= 448) to the nearest e4m3fn value, ties to even; returns float32.

    Why: triton 3.9's interpreter converts fp32 -> fp8e4nv by adding the first dropped bit without carrying
    into the exponent (125.06 -> 64.0 instead of 128.0) and without ties-to-even. Rounding here first makes
    the later ``.to(float8e4nv)`` exact on the interpreter and on GPUs alike (costs a few integer ops on a
    memory-bound kernel). Normal range (|v| >= 2^-6): RTNE on the fp32 bits to 3 mantissa bits (the carry
    moves into the exponent by itself). Subnormal range: fixed 2^-9 grid via the fp32 magic-number
    trick ``(v + 1.5 * 2^14) - 1.5 * 2^14``, whose ulp is 2^-9.
    """
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + (0x7FFFF + lsb)) & 0xFFF00000).to(tl.float32, bitcast=True)
    mag = tl.abs(v)
    sub_mag = ((mag + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    sub = (sub_mag | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # keep the sign of -0.0
    return tl.where(mag < 0.015625, sub, normal)


@triton.jit
def _norm_quant_fwd(
    X, W, B, Y, Q, S, MEAN, RSTD,
    stride_x, stride_y, stride_q, stride_s,
    D, G, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
    BLOCK: tl.constexpr, NG: tl.constexpr,
):
    """One program per row. The row is held as an [NG, BLOCK] tile: NG (power of two >= G) scale groups
    of BLOCK columns, so the per-group amax is a reduction over axis 1 (no reshape needed)."""
    row = tl.program_id(0).to(tl.int64)
    grp = tl.arange(0, NG)
    offs = grp[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [NG, BLOCK]
    mask = offs < D
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        mean = 0.0
        ms = tl.sum(tl.sum(x * x, axis=1), axis=0) / D
        rstd = 1.0 / tl.sqrt(ms + eps)
        xhat = x * rstd
    else:
        mean = tl.sum(tl.sum(x, axis=1), axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(tl.sum(xc * xc, axis=1), axis=0) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        xhat = xc * rstd
    y = xhat
    if HAS_W:
        y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    y_out = y.to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + offs, y_out, mask=mask)
    # Quantize the value the caller sees (y rounded to x.dtype), exactly as quantize_blocks_ref does.
    yq = tl.where(mask, y_out.to(tl.float32), 0.0)
    amax = tl.max(tl.abs(yq), axis=1)  # [NG]
    nz = amax > 0.0
    inv = tl.where(nz, 448.0 / tl.where(nz, amax, 1.0), 0.0)  # all-zero (or padding) group -> q = 0
    q = yq * inv[:, None]
    q = _round_to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
    tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_s + grp, amax / 448.0, mask=grp < G)
    if STORE_STATS:
        if not IS_RMS:
            tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd(
    X, W, DY, DX, MEAN, RSTD, DW, DB,
    stride_x, stride_dy, stride_dx,
    N, D, rows_per_prog,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program p handles rows [p * rows_per_prog, min((p + 1) * rows_per_prog, N)); it writes dx for its
    rows and its partial dweight/dbias sums (float32) into row p of DW/DB [P, D] (summed on the host)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, N)
    for r in range(row_start, row_end):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            wdy = dy * w
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=0) / D
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / D
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += dy * xhat
        if HAS_B:
            db_acc += dy
    if HAS_W:
        tl.store(DW + pid * D + cols, dw_acc, mask=mask)
    if HAS_B:
        tl.store(DB + pid * D + cols, db_acc, mask=mask)


def _fwd_num_warps(d: int) -> int:
    """~1024 row elements per warp, 2..16 warps. Measured on the H200 (bf16, triton 3.6, 2026-11-30): of
    2/4/8/16 warps, 2 was fastest at D=1024 and 4 at D=4096 (the tutorial's 256 per warp was 10-25% slower)."""
    return min(max(triton.next_power_of_2(d) // 1024, 2), 16)


def _launch_fwd(x, weight, bias, kind, eps, block_size, store_stats, num_warps=None):
    """Launch the forward kernel. x: [N, D] with unit column stride. Returns (y, y_fp8, scales, mean, rstd);
    mean/rstd are [N] float32 (mean unused for kind="rms") or None when ``store_stats`` is False."""
    n, d = x.shape
    g = d // block_size
    y = torch.empty_like(x)
    q = torch.empty((n, d), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((n, g), dtype=torch.float32, device=x.device)
    mean = torch.empty(n, dtype=torch.float32, device=x.device) if store_stats else None
    rstd = torch.empty(n, dtype=torch.float32, device=x.device) if store_stats else None
    if n == 0:
        return y, q, s, mean, rstd
    dummy = s  # never dereferenced when the matching constexpr flag is off
    _norm_quant_fwd[(n,)](
        x, weight if weight is not None else dummy, bias if bias is not None else dummy, y, q, s,
        mean if store_stats else dummy, rstd if store_stats else dummy,
        x.stride(0), y.stride(0), q.stride(0), s.stride(0),
        d, g, float(eps),
        IS_RMS=kind == "rms", HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=store_stats,
        BLOCK=block_size, NG=triton.next_power_of_2(g),
        num_warps=num_warps or _fwd_num_warps(d),
    )
    return y, q, s, mean, rstd


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _bwd_programs(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n, 4 * _sm_count(index)))
    return max(1, min(n, 4))  # interpreter: few programs, it runs them one after another


def _launch_bwd(dy, x, weight, has_bias, mean, rstd, kind):
    """Backward of y w.r.t. x, weight, bias. dy, x: [N, D]. Returns (dx [N, D] x.dtype,
    dweight [D] weight.dtype or None, dbias [D] float32 or None)."""
    n, d = x.shape
    dx = torch.empty_like(x)
    has_w = weight is not None
    if n == 0:
        dw = torch.zeros(d, dtype=torch.float32, device=x.device) if has_w else None
        db = torch.zeros(d, dtype=torch.float32, device=x.device) if has_bias else None
        return dx, dw, db
    p = _bwd_programs(n, x.device)
    rows_per_prog = triton.cdiv(n, p)
    p = triton.cdiv(n, rows_per_prog)
    dw_part = torch.empty((p, d), dtype=torch.float32, device=x.device) if has_w else None
    db_part = torch.empty((p, d), dtype=torch.float32, device=x.device) if has_bias else None
    dummy = rstd
    block_d = triton.next_power_of_2(d)
    _norm_bwd[(p,)](
        x, weight if has_w else dummy, dy, dx, mean if kind == "layer" else dummy, rstd,
        dw_part if has_w else dummy, db_part if has_bias else dummy,
        x.stride(0), dy.stride(0), dx.stride(0),
        n, d, rows_per_prog,
        IS_RMS=kind == "rms", HAS_W=has_w, HAS_B=has_bias, BLOCK_D=block_d,
        num_warps=min(max(block_d // 256, 1), 16),
    )
    dw = dw_part.sum(dim=0) if has_w else None
    db = db_part.sum(dim=0) if has_bias else None
    return dx, dw, db


# ----------------------------------------------------------------------------------------------------------
# Custom ops (gemray::norm_quant_fwd / gemray::norm_quant_bwd) and the eager autograd.Function
# ----------------------------------------------------------------------------------------------------------
@torch.library.custom_op("gemray::norm_quant_fwd", mutates_args=())
def norm_quant_fwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], kind: str,
                      eps: float, block_size: int, store_stats: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """The fused forward as a custom op (inputs validated by :func:`norm_quant`; x [N, D] with unit column
    stride, weight / bias [D] contiguous or None). Returns (y [N, D] x.dtype, y_fp8 [N, D] float8_e4m3fn,
    scales [N, D // block_size] fp32, mean [N] fp32, rstd [N] fp32); mean / rstd are empty [0] tensors unless
    ``store_stats`` (what the backward needs), mean also for kind "rms" (which has none)."""
    y, q, s, mean, rstd = _launch_fwd(x, weight, bias, kind, eps, block_size, store_stats)
    if mean is None:  # outputs may not alias each other: two empty tensors
        mean, rstd = x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)
    elif kind == "rms":  # the kernel writes no mean for RMSNorm: do not return uninitialized memory
        mean = x.new_empty((0,), dtype=torch.float32)
    return y, q, s, mean, rstd


@norm_quant_fwd_op.register_fake
def _norm_quant_fwd_fake(x, weight, bias, kind, eps, block_size, store_stats):
    n, d = x.shape
    stats = (n,) if store_stats else (0,)
    return (torch.empty_like(x), x.new_empty((n, d), dtype=FP8_DTYPE),
            x.new_empty((n, d // block_size), dtype=torch.float32),
            x.new_empty(stats if kind == "layer" else (0,), dtype=torch.float32), x.new_empty(stats, dtype=torch.float32))


@torch.library.custom_op("gemray::norm_quant_bwd", mutates_args=())
def norm_quant_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                      rstd: torch.Tensor, has_bias: bool, kind: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """The backward as a custom op: dy, x [N, D]; mean / rstd [N] fp32 from the forward. Returns (dx [N, D]
    x.dtype, dweight [D] fp32 or an empty [0] tensor without weight, dbias [D] fp32 or an empty [0] tensor
    without bias)."""
    dx, dw, db = _launch_bwd(dy.contiguous(), x, weight, has_bias, mean, rstd, kind)
    empty = x.new_empty((0,), dtype=torch.float32)
    return dx, (dw if dw is not None else empty), (db if db is not None else empty.clone())


@norm_quant_bwd_op.register_fake
def _norm_quant_bwd_fake(dy, x, weight, mean, rstd, has_bias, kind):
    d = x.shape[1]
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(x), x.new_empty((d,) if weight is not None else (0,), **f32),
            x.new_empty((d,) if has_bias else (0,), **f32))


def _nq_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, kind, eps, block_size, store_stats = inputs
    _, q, s, mean, rstd = output
    ctx.mark_non_differentiable(q, s, mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.kind, ctx.has_bias = kind, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _nq_backward(ctx, dy, _dq, _ds, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_quant_bwd_op(dy, x, weight, mean, rstd, ctx.has_bias, ctx.kind)
    dw = None if weight is None else dw.to(weight.dtype)
    db = None if not ctx.has_bias else db.to(ctx.bias_dtype)
    return dx, dw, db, None, None, None, None


norm_quant_fwd_op.register_autograd(_nq_backward, setup_context=_nq_setup_context)


class NormQuantFunction(torch.autograd.Function):
    """The eager path (no dispatcher): forward -> (y, y_fp8, scales); only ``y`` is differentiable."""

    @staticmethod
    def forward(ctx, x, weight, bias, kind, eps, block_size):
        needs_grad = any(ctx.needs_input_grad[:3])
        y, q, s, mean, rstd = _launch_fwd(x, weight, bias, kind, eps, block_size, store_stats=needs_grad)
        ctx.mark_non_differentiable(q, s)
        ctx.kind = kind
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        if needs_grad:
            ctx.save_for_backward(x, weight, mean, rstd)
        return y, q, s

    @staticmethod
    def backward(ctx, dy, _dq, _ds):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _launch_bwd(dy.contiguous(), x, weight, ctx.has_bias, mean, rstd, ctx.kind)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def norm_quant_triton(x, weight, bias=None, *, kind="layer", eps=1e-5, block_size=128):
    """Triton forward+backward of :func:`norm_quant` (inputs already validated). See ``norm_quant``. Plain eager
    calls go through NormQuantFunction, traced ones (torch.compile, FakeTensor, meta) through the custom ops."""
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    if plain_eager(x, weight, bias):
        return NormQuantFunction.apply(x, weight, bias, kind, eps, block_size)
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    y, q, s, _, _ = norm_quant_fwd_op(x, weight, bias, kind, float(eps), int(block_size), store)
    return y, q, s


def norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "layer",
    eps: float = 1e-5,
    block_size: int = 128,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm/RMSNorm that also emits an FP8 e4m3 copy of its output with per-row-block scales.

    Args:
        x: [N, D] float32/float16/bfloat16 (N may be 0; D > 0 and a multiple of ``block_size``).
        weight: [D] or None (no scale). bias: [D] or None.
        kind: "layer" (LayerNorm, biased variance) or "rms" (RMSNorm).
        eps: added to the variance / mean square, > 0.
        block_size: columns per scale group, a power of two dividing D (128 = DeepSeek-V3's 1x128 tiles).
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" (also on CPU under
            ``TRITON_INTERPRET=1``) or "reference" (plain PyTorch, autograd).

    Returns:
        y: [N, D] in ``x.dtype``, differentiable w.r.t. x, weight, bias.
        y_fp8: [N, D] ``torch.float8_e4m3fn``, not differentiable.
        scales: [N, D // block_size] float32, ``amax / 448`` per block; dequantize with
            ``y_fp8.float() * scales.repeat_interleave(block_size, 1)``.

    Raises:
        ValueError: bad kind/backend/eps/block_size, x not 2-D or not floating, D == 0, D not a multiple of
            ``block_size``, weight/bias not of shape [D] or on another device.

    Example (N=2, D=4, block_size=2)::

        y, q, s = norm_quant(torch.tensor([[1., 2., 3., 4.], [0., 0., 0., 1.]]), None, block_size=2)
        # s.shape == (2, 2); (q.float() * s.repeat_interleave(2, 1) - y).abs().max() small (e4m3 rounding)
    """
    check_norm_quant_inputs(x, weight, bias, kind, eps, block_size, backend)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "reference"
    if backend == "reference":
        return norm_quant_ref(x, weight, bias, kind=kind, eps=eps, block_size=block_size)
    return norm_quant_triton(x, weight, bias, kind=kind, eps=eps, block_size=block_size)
