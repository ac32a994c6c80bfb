"""The HSTU block's uvqk activation, fused: ``u, v, q, k = split(silu(x + bias))`` forward, and in the backward the
SiLU derivative, the four gradients' concatenation and the bias gradient's column sum in one pass.

Shape key: T tokens, W = sum(sizes) (the uvqk width, 2 H V + 2 H A), sizes = the split widths (u, v, q, k).

Why a kernel: compiled by inductor, the block's backward ran the SiLU derivative + concatenation as one pass (read
du, dv, dq, dk and the GEMM output, write d_uvqk) and the bias gradient ``d_uvqk.sum(0)`` as a second one that reads
d_uvqk again (a column reduction inductor does not fuse into its producer): at GEM scale (T ~ 131k, W = 4096, bf16)
1.07 GB a block, 2.7 ms a step on an H100 (benchmarks/reports/gem_h200_2026-12-06.md). Here each tile's column sums
are taken in registers while d_uvqk is written, so the backward reads x and the four gradients once and writes
d_uvqk once (plus the tiles' partial sums). Measured inside the GEM step on an H100 (session 27): backward 9.1 ms a
step (~2.8 TB/s) against inductor's 9.0 + 2.75, forward 5.9 ms against its 5.6; the step 1.6-2.0 ms shorter. The bias leaves the projection's GEMM (``x = x_norm @ W``, no cuBLAS bias epilogue) and is added here,
where the forward reads x anyway.

* forward ``_bias_silu_fwd``: one launch per split, grid (T tiles, column tiles); y = z sigmoid(z), z = x + bias in
  float32, stored in x's dtype.
* backward ``_bias_silu_bwd``: one launch per split, grid (T tiles, column tiles); each program stores dx =
  g sigmoid(z) (1 + z (1 - sigmoid(z))) of its tile and the tile's float32 column sums; the tiles' partial sums
  ([T / BLOCK_T, W] float32, ~3% of dx's bytes in 16 bits at BLOCK_T = 64) are summed by torch afterwards (a split reduction, as
  inductor's): deterministic, no atomics, every program independent. T is not specialised on (no recompile when
  a batch's token count changes its divisibility).

torch.library custom ops ``gemray::bias_silu_split`` (-> the splits) and ``gemray::bias_silu_split_bwd`` (-> dx,
dbias) with fake implementations; the backward is the forward's autograd formula. Entry point:
:func:`bias_silu_split_triton` (``gemray.ops.uvqk_projection`` dispatches v / q / k to it, after their GEMM); the spec is
``gemray.kernels.reference.bias_silu_split_ref``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BLOCK_T, BLOCK_W, num_warps): 64 x 128 tiles of 16-bit rows (256 contiguous bytes per row and load), 8 warps.
# Not swept (benchmarks/bias_silu_h200.py times candidates): both kernels are a stream over x and the gradients.
# Compiled for sm_90 (ptxas of the triton wheel): forward 84 registers, backward 120, no stack.
FWD_BLOCKS = (64, 128, 8)
BWD_BLOCKS = (64, 128, 8)


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when triton was imported): then
    they take CPU tensors; else CUDA tensors."""
    return _INTERPRET


@triton.jit(do_not_specialize=["T"])
def _bias_silu_fwd(X, B, Y, T, W, col0, stride_xt, stride_yt, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """Y[t, c] = silu(X[t, col0 + c] + B[col0 + c]) for the [BLOCK_T, BLOCK_W] tile (t, c) of the split."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = offs_c < W
    mask = (offs_t[:, None] < T) & cmask[None, :]
    x = tl.load(X + offs_t[:, None] * stride_xt + (col0 + offs_c)[None, :], mask=mask, other=0.0)
    b = tl.load(B + col0 + offs_c, mask=cmask, other=0.0)
    z = x.to(tl.float32) + b.to(tl.float32)[None, :]
    y = z * tl.sigmoid(z)
    tl.store(Y + offs_t[:, None] * stride_yt + offs_c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _bias_silu_bwd(X, B, G, DX, PART, T, W, col0, stride_xt, stride_gt, stride_dxt, stride_pt,
                   BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """For the [BLOCK_T, BLOCK_W] tile (t, c) of the split: DX[t, col0 + c] = G[t, c] silu'(X[t, col0 + c] +
    B[col0 + c]); PART[tile row, col0 + c] = the tile's column sums of DX (float32, before DX's rounding)."""
    pid_t = tl.program_id(0)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = offs_c < W
    mask = (offs_t[:, None] < T) & cmask[None, :]
    x = tl.load(X + offs_t[:, None] * stride_xt + (col0 + offs_c)[None, :], mask=mask, other=0.0)
    g = tl.load(G + offs_t[:, None] * stride_gt + offs_c[None, :], mask=mask, other=0.0)
    b = tl.load(B + col0 + offs_c, mask=cmask, other=0.0).to(tl.float32)
    z = x.to(tl.float32) + b[None, :]
    s = tl.sigmoid(z)
    dz = tl.where(mask, g.to(tl.float32) * s * (1.0 + z * (1.0 - s)), 0.0)
    tl.store(DX + offs_t[:, None] * stride_dxt + (col0 + offs_c)[None, :], dz.to(DX.dtype.element_ty), mask=mask)
    tl.store(PART + pid_t.to(tl.int64) * stride_pt + col0 + offs_c, tl.sum(dz, axis=0), mask=cmask)


def _check(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> None:
    if x.dim() != 2 or bias.dim() != 1:
        raise ValueError(f"bias_silu_split: expected x [T, W] and bias [W], got {tuple(x.shape)} and "
                         f"{tuple(bias.shape)}")
    if not sizes or any(int(s) < 1 for s in sizes) or sum(int(s) for s in sizes) != x.shape[1] \
            or bias.shape[0] != x.shape[1]:
        raise ValueError(f"bias_silu_split: sizes {list(sizes)} (each >= 1) must sum to W = {x.shape[1]}, the width "
                         f"of x and of bias {tuple(bias.shape)}")
    if x.dtype not in _DTYPES or bias.dtype not in _DTYPES:
        raise ValueError(f"bias_silu_split: x / bias must be one of {_DTYPES}, got {x.dtype}, {bias.dtype}")
    dev = "cpu" if _INTERPRET else "cuda"
    for t in (x, bias):
        if t.device.type != dev:
            raise RuntimeError(f"bias_silu_split_triton: the kernels run on {dev} tensors here, got one on "
                               f"{t.device.type}" + ("" if _INTERPRET else " (CPU only under TRITON_INTERPRET=1)"))


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (the kernels index rows by a stride, columns densely)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    T = x.shape[0]
    outs = [x.new_empty((T, int(s))) for s in sizes]
    if T == 0:
        return outs
    x = _row_major(x)
    bias = bias.contiguous()
    bt, bw, warps = FWD_BLOCKS
    col0 = 0
    for y in outs:
        w = y.shape[1]
        _bias_silu_fwd[(triton.cdiv(T, bt), triton.cdiv(w, bw))](
            x, bias, y, T, w, col0, x.stride(0), y.stride(0), BLOCK_T=bt, BLOCK_W=bw, num_warps=warps)
        col0 += w
    return outs


def _backward(grads: list[torch.Tensor], x: torch.Tensor, bias: torch.Tensor,
              sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    T, W = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return dx, torch.zeros_like(bias)
    x = _row_major(x)
    bias = bias.contiguous()
    bt, bw, warps = BWD_BLOCKS
    tiles_t = triton.cdiv(T, bt)
    part = torch.empty((tiles_t, W), dtype=torch.float32, device=x.device)  # T / BLOCK_T x W: ~3% of dx's bytes
    col0 = 0
    for g, s in zip(grads, sizes):
        w = int(s)
        g = _row_major(g)
        _bias_silu_bwd[(tiles_t, triton.cdiv(w, bw))](
            x, bias, g, dx, part, T, w, col0, x.stride(0), g.stride(0), dx.stride(0), part.stride(0),
            BLOCK_T=bt, BLOCK_W=bw, num_warps=warps)
        col0 += w
    return dx, part.sum(0).to(bias.dtype)


@torch.library.custom_op("gemray::bias_silu_split", mutates_args=())
def bias_silu_split_op(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Forward as a custom op (arguments as :func:`bias_silu_split_triton`). Returns the splits, each [T, size]
    contiguous in x's dtype."""
    return _forward(x, bias, sizes)


@bias_silu_split_op.register_fake
def _fwd_fake(x, bias, sizes):
    return [x.new_empty((x.shape[0], int(s))) for s in sizes]


@torch.library.custom_op("gemray::bias_silu_split_bwd", mutates_args=())
def bias_silu_split_bwd_op(grads: list[torch.Tensor], x: torch.Tensor, bias: torch.Tensor,
                           sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward as a custom op: grads[i] [T, sizes[i]] (d loss / d split i), x and bias the forward's. Returns
    (dx [T, W] in x's dtype, dbias [W] in bias's dtype)."""
    return _backward(grads, x, bias, sizes)


@bias_silu_split_bwd_op.register_fake
def _bwd_fake(grads, x, bias, sizes):
    return x.new_empty(x.shape), torch.empty_like(bias)


def _setup(ctx, inputs, output) -> None:
    x, bias, sizes = inputs
    ctx.save_for_backward(x, bias)
    ctx.sizes = list(sizes)


def _autograd_backward(ctx, grads):
    x, bias = ctx.saved_tensors
    grads = [torch.zeros((x.shape[0], s), dtype=x.dtype, device=x.device) if g is None else g
             for g, s in zip(grads, ctx.sizes)]
    dx, dbias = torch.ops.gemray.bias_silu_split_bwd(grads, x, bias, ctx.sizes)
    return dx, dbias, None


bias_silu_split_op.register_autograd(_autograd_backward, setup_context=_setup)


def bias_silu_split_triton(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``torch.split(silu(x + bias), sizes, 1)``, fused (semantics: ``reference.bias_silu_split_ref``).

    Args:
        x: [T, W] float32 / bf16 / fp16, the uvqk projection without its bias (unit column stride, or copied).
        bias: [W] float32 / bf16 / fp16 (added in float32).
        sizes: the split widths, each >= 1, summing to W.
    Returns:
        one [T, sizes[i]] tensor per split, contiguous, x's dtype (SiLU in float32, then rounded). Differentiable
        in x and bias: dx in x's dtype, dbias in bias's dtype (float32 column sums of the unrounded dx).
    Raises:
        ValueError (shapes, dtypes, sizes) or RuntimeError (tensors on a device the kernels do not run on).
    """
    sizes = [int(s) for s in sizes]
    _check(x, bias, sizes)
    return list(torch.ops.gemray.bias_silu_split(x, bias, sizes))
