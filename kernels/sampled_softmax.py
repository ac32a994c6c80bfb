"""Fused sampled-softmax log-sum-exp over per-sequence shared negatives (the retrieval head's "uniform_shared").

Shape key: B sequences, M rows (positions with a next item), E embedding width, R negatives per sequence.

Per row i of sequence b(i) (rows of one sequence contiguous, ``row_offsets`` [B+1] int64 bounds them):
``lse_i = logsumexp([pos_i, <h_i, e_neg[b(i), r]> for r in 0..R-1] / temperature)`` where a negative whose id
equals the row's target id (``neg_ids[b(i), r] == target_ids[i]``) is left out (-inf). The spec is
``gemray.kernels.reference.sampled_softmax_lse_ref``.

Why a kernel: the padded formulation (``jagged_to_padded_dense`` -> bmm -> ``dense_to_jagged`` -> gather ->
cat -> mask -> / temperature -> logsumexp, and their backward) materialises [M, R+1] fp32 tensors ~20 times
per step (at GEM scale M ~ 127k, R = 512: 0.25-2 GB each) and the padded [B, max_len, R] product. The kernels
below keep the logits of one [BLOCK_M, BLOCK_R] tile in registers and reduce them online (FlashAttention-style
running max / sum over the R negatives), so nothing of size [M, R] ever reaches memory:

* forward ``_ssm_fwd``: one program per (row tile of one sequence, sequence); loops over R in BLOCK_R chunks
  of that sequence's negatives; stores lse [M] fp32.
* backward, deterministic (no atomics): ``_ssm_bwd_dh`` (same grid as the forward) recomputes p = exp(s - lse)
  per chunk and accumulates dh = sum_r g p_r e_r / temperature in registers; it also writes
  d pos = g exp(pos / temperature - lse) / temperature. ``_ssm_bwd_de``: one program per (R chunk, sequence)
  loops over that sequence's row tiles and accumulates de_r = sum_i g_i p_ir h_i / temperature.

Products: ``tl.dot``; float32 inputs with ``input_precision = FP32_PRODUCTS`` ("tf32x3": each operand split into
a TF32 high and low part, three tensor-core products -- float32-class accuracy, ~1e-6 relative), bf16 / fp16
inputs on the tensor cores (the probabilities are cast to the input dtype for the backward products).
Accumulation, max / sum and lse are float32. Under TRITON_INTERPRET=1 16-bit inputs run in float32 (the
interpreter's bf16 ``tl.dot`` is wrong: triton-lang/triton#11584) and every precision computes exact float32
products. Why not "ieee" (exact products on the CUDA cores, the attention kernels' choice for float32): at GEM
scale (M ~ 146k rows, R = 512, E = 64) the three kernels did ~48 GFLOP a step on FMAs in 4.3 ms, the largest
kernels of the step after the blocks' own (H100, 2026-12-06); the tensor cores do the three products' work in a
fraction of that.

torch.library custom ops: ``gemray::sampled_softmax_lse`` (-> lse) and ``gemray::sampled_softmax_lse_bwd``
(-> dh, dpos, de_neg), with fake implementations and the backward registered as the forward's autograd formula,
so torch.compile / FakeTensor tracing see one op each. Host ints (``max_rows``) come from the caller: no host
sync. Entry point: :func:`sampled_softmax_lse_triton` (``gemray.ops.sampled_softmax_lse`` dispatches to it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from gemray.kernels.config import _pow2 as _block_e  # the tile width of E: the next power of two >= E, >= 16

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the float32 inputs' tl.dot input_precision (module docstring): "tf32x3"; "ieee" and "tf32" are Triton's others
#: (benchmarks/sampled_softmax_h200.py times all three)
FP32_PRODUCTS = "tf32x3"
# default (BLOCK_M, BLOCK_R, num_warps) of each kernel ("fwd", "dh", "de") by the products' dtype. Float32 (tf32x3):
# the fastest of benchmarks/sampled_softmax_h200.py --sweep (H100, 2026-12-06, B = 128, R = 512, E = 64, M = 104k;
# ms against "ieee"'s fastest tile): forward 0.151 (0.784), dH 0.362 (1.184), dE 0.586 (1.821), relative error
# against float64 2.6e-6 / 3.0e-6 as "ieee"'s ("tf32" alone: 8e-3). sm_90 compiles (`python -m
# gemray.bench.sass_check --ssm`, triton 3.6): no spill in any loop; a tf32x3 product holds both halves of each
# operand, so dE spills at 64 x 64 (32 spill loads a loop). 16-bit products (wgmma) at 64 x 64 use 93-206 registers,
# no spills (not timed).
DEFAULT_TILES = {
    torch.float32: {"fwd": (64, 64, 4), "dh": (128, 64, 8), "de": (64, 32, 4)},
    torch.bfloat16: {"fwd": (64, 64, 4), "dh": (64, 64, 4), "de": (64, 64, 4)},
    torch.float16: {"fwd": (64, 64, 4), "dh": (64, 64, 4), "de": (64, 64, 4)},
}
#: every kernel's tile when float32 products run as "ieee" (GPUs before Ampere, ``_dot_prec``): 32 x 32, 4 warps, the
#: largest that does not spill on the CUDA cores (dH at 128 x 64: 15 ms instead of 1.2, the sweep above)
IEEE_TILE = (32, 32, 4)


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when triton was imported): then
    they take CPU tensors; else CUDA tensors."""
    return _INTERPRET


@triton.jit
def _scores(h, e, ids, tgt, valid_r, scale, DOT_PREC: tl.constexpr):
    """[BLOCK_M, BLOCK_R] logits h e^T * scale, -inf where the column is out of range or its id is the target."""
    s = tl.dot(h, tl.trans(e), input_precision=DOT_PREC) * scale
    keep = valid_r[None, :] & (ids[None, :] != tgt[:, None])
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _row_tile(H, TGT, start, m0, n, stride_hm, offs_e, emask, BLOCK_M: tl.constexpr):
    """Rows [m0, m0 + BLOCK_M) of a sequence whose rows start at ``start`` (n of them): (rows [BLOCK_M] int64,
    rmask, h [BLOCK_M, BLOCK_E] (0 past n), their target ids (-1 past n))."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rmask = offs_m < n
    rows = start + offs_m
    h = tl.load(H + rows[:, None] * stride_hm + offs_e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0)
    tgt = tl.load(TGT + rows, mask=rmask, other=-1)
    return rows, rmask, h, tgt


@triton.jit
def _neg_chunk(e_base, n_base, r0, R, stride_er, offs_e, emask, BLOCK_R: tl.constexpr):
    """Negatives [r0, r0 + BLOCK_R) of one sequence: (valid_r, e [BLOCK_R, BLOCK_E] (0 past R), ids (-1 past R))."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    valid_r = offs_r < R
    e = tl.load(e_base + offs_r[:, None] * stride_er + offs_e[None, :], mask=valid_r[:, None] & emask[None, :],
                other=0.0)
    ids = tl.load(n_base + offs_r, mask=valid_r, other=-1)
    return valid_r, e, ids


@triton.jit
def _ssm_fwd(H, POS, EN, NEG, TGT, ROW_OFF, LSE, R, E_DIM, stride_hm, stride_eb, stride_er, stride_nb, scale,
             BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(ROW_OFF + b)
    n = tl.load(ROW_OFF + b + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 >= n:
        return
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < E_DIM
    rows, rmask, h, tgt = _row_tile(H, TGT, start, m0, n, stride_hm, offs_e, emask, BLOCK_M)
    # the positive starts the running max (finite), so no row ever sees max = -inf
    m_i = tl.load(POS + rows, mask=rmask, other=0.0).to(tl.float32) * scale
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    e_base = EN + b.to(tl.int64) * stride_eb
    n_base = NEG + b.to(tl.int64) * stride_nb
    for r0 in range(0, R, BLOCK_R):
        valid_r, e, ids = _neg_chunk(e_base, n_base, r0, R, stride_er, offs_e, emask, BLOCK_R)
        s = _scores(h, e, ids, tgt, valid_r, scale, DOT_PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + rows, m_i + tl.log(l_i), mask=rmask)


@triton.jit
def _ssm_bwd_dh(H, POS, EN, NEG, TGT, ROW_OFF, LSE, G, DH, DPOS, R, E_DIM, stride_hm, stride_eb, stride_er,
                stride_nb, stride_dhm, scale,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(ROW_OFF + b)
    n = tl.load(ROW_OFF + b + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 >= n:
        return
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < E_DIM
    rows, rmask, h, tgt = _row_tile(H, TGT, start, m0, n, stride_hm, offs_e, emask, BLOCK_M)
    hmask = rmask[:, None] & emask[None, :]
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    g = tl.load(G + rows, mask=rmask, other=0.0)
    pos = tl.load(POS + rows, mask=rmask, other=0.0).to(tl.float32) * scale
    e_base = EN + b.to(tl.int64) * stride_eb
    n_base = NEG + b.to(tl.int64) * stride_nb
    dh = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        valid_r, e, ids = _neg_chunk(e_base, n_base, r0, R, stride_er, offs_e, emask, BLOCK_R)
        s = _scores(h, e, ids, tgt, valid_r, scale, DOT_PREC)
        # rows past the sequence: s - lse could overflow exp (lse = 0 there); zero them (g is 0 there too)
        w = tl.where(rmask[:, None], g[:, None] * tl.exp(s - lse[:, None]), 0.0)
        dh = tl.dot(w.to(e.dtype), e, dh, input_precision=DOT_PREC)
    dh = dh * scale
    tl.store(DH + rows[:, None] * stride_dhm + offs_e[None, :], dh.to(DH.dtype.element_ty), mask=hmask)
    dpos = tl.where(rmask, g * tl.exp(pos - lse) * scale, 0.0)
    tl.store(DPOS + rows, dpos.to(DPOS.dtype.element_ty), mask=rmask)


@triton.jit
def _ssm_bwd_de(H, EN, NEG, TGT, ROW_OFF, LSE, G, DE, R, E_DIM, stride_hm, stride_eb, stride_er, stride_nb,
                stride_deb, stride_der, scale,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_r = tl.program_id(0)
    b = tl.program_id(1)
    start = tl.load(ROW_OFF + b)
    n = tl.load(ROW_OFF + b + 1) - start
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < E_DIM
    b64 = b.to(tl.int64)
    valid_r, e, ids = _neg_chunk(EN + b64 * stride_eb, NEG + b64 * stride_nb, pid_r * BLOCK_R, R, stride_er, offs_e,
                                 emask, BLOCK_R)
    de = tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.float32)
    for m0 in range(0, n, BLOCK_M):
        rows, rmask, h, tgt = _row_tile(H, TGT, start, m0, n, stride_hm, offs_e, emask, BLOCK_M)
        lse = tl.load(LSE + rows, mask=rmask, other=0.0)
        g = tl.load(G + rows, mask=rmask, other=0.0)
        # scores laid out negatives-first (s^T = e h^T [BLOCK_R, BLOCK_M]), so that de += w^T h needs no transposed
        # register tile (with fp32 "ieee" products that transpose spilled thousands of values per step, sm_90)
        st = tl.dot(e, tl.trans(h), input_precision=DOT_PREC) * scale
        keep = valid_r[:, None] & (ids[:, None] != tgt[None, :]) & rmask[None, :]
        wt = tl.where(keep, g[None, :] * tl.exp(st - lse[None, :]), 0.0)
        de = tl.dot(wt.to(h.dtype), h, de, input_precision=DOT_PREC)
    de = de * scale
    tl.store(DE + b64 * stride_deb + offs_r[:, None] * stride_der + offs_e[None, :], de.to(DE.dtype.element_ty),
             mask=valid_r[:, None] & emask[None, :])


def _dot_prec(dtype: torch.dtype, device: torch.device | None = None) -> str | None:
    """tl.dot's input_precision for products in ``dtype`` on ``device``: for float32 FP32_PRODUCTS, or "ieee" on a
    CUDA GPU older than Ampere (compute capability < 8: no TF32 tensor cores); Triton's default (the tensor cores'
    own format) for 16-bit inputs. device None (or CPU: the interpreter): FP32_PRODUCTS."""
    if dtype != torch.float32:
        return None
    if device is not None and device.type == "cuda" and _capability(device.index)[0] < 8:
        return "ieee"
    return FP32_PRODUCTS


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``index`` (None: the current one), cached per index."""
    return torch.cuda.get_device_capability(index)


def _tile(kernel: str, block_m: int, block_r: int, dtype: torch.dtype, prec: str | None = None
          ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_R, num_warps) of ``kernel`` ("fwd" | "dh" | "de"): DEFAULT_TILES of the products' ``dtype``
    (IEEE_TILE when ``prec`` is "ieee"), with block_m / block_r replacing its blocks where > 0 (4 warps then).
    Raises ValueError for a block that is not a power of two >= 16."""
    bm, br, warps = IEEE_TILE if prec == "ieee" else DEFAULT_TILES[dtype][kernel]
    if block_m > 0 or block_r > 0:
        bm, br, warps = block_m if block_m > 0 else bm, block_r if block_r > 0 else br, 4
    for name, v in (("block_m", bm), ("block_r", br)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"sampled_softmax: {name} must be a power of two >= 16 (tl.dot), got {v}")
    return bm, br, warps


def _kernel_dtype(*xs: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: float32 if any input is float32 or under the interpreter, else the 16-bit
    input dtype (both inputs must share it)."""
    if _INTERPRET or any(x.dtype == torch.float32 for x in xs):
        return torch.float32
    return xs[0].dtype


def _check(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature) -> None:
    if h.dim() != 2 or e_neg.dim() != 3 or neg_ids.dim() != 2 or pos.dim() != 1 or target_ids.dim() != 1 \
            or row_offsets.dim() != 1:
        raise ValueError(f"sampled_softmax: expected h [M, E], pos [M], e_neg [B, R, E], neg_ids [B, R], "
                         f"target_ids [M], row_offsets [B+1], got {tuple(h.shape)}, {tuple(pos.shape)}, "
                         f"{tuple(e_neg.shape)}, {tuple(neg_ids.shape)}, {tuple(target_ids.shape)}, "
                         f"{tuple(row_offsets.shape)}")
    M, E = h.shape
    B, R = neg_ids.shape
    if pos.shape[0] != M or target_ids.shape[0] != M or tuple(e_neg.shape) != (B, R, E) \
            or row_offsets.shape[0] != B + 1:
        raise ValueError(f"sampled_softmax: inconsistent shapes h {tuple(h.shape)}, pos {tuple(pos.shape)}, "
                         f"e_neg {tuple(e_neg.shape)}, neg_ids {tuple(neg_ids.shape)}, target_ids "
                         f"{tuple(target_ids.shape)}, row_offsets {tuple(row_offsets.shape)}")
    if h.dtype not in _DTYPES or e_neg.dtype not in _DTYPES:
        raise ValueError(f"sampled_softmax: h / e_neg must be one of {_DTYPES}, got {h.dtype}, {e_neg.dtype}")
    if h.dtype != e_neg.dtype and torch.float32 not in (h.dtype, e_neg.dtype):
        raise ValueError(f"sampled_softmax: 16-bit h and e_neg must share a dtype, got {h.dtype}, {e_neg.dtype}")
    if max_rows < 0 or temperature <= 0:
        raise ValueError(f"sampled_softmax: max_rows must be >= 0 and temperature > 0, got {max_rows}, "
                         f"{temperature}")
    dev = "cpu" if _INTERPRET else "cuda"
    for x in (h, pos, e_neg, neg_ids, target_ids, row_offsets):
        if x.device.type != dev:
            raise RuntimeError(f"sampled_softmax_lse_triton: the kernels run on {dev} tensors here, got one on "
                               f"{x.device.type}" + ("" if _INTERPRET else " (CPU only under TRITON_INTERPRET=1)"))


def _prep(h, e_neg, neg_ids, target_ids, row_offsets):
    dt = _kernel_dtype(h, e_neg)
    return (h.to(dt).contiguous(), e_neg.to(dt).contiguous(), neg_ids.to(torch.int64).contiguous(),
            target_ids.to(torch.int64).contiguous(), row_offsets.to(torch.int64).contiguous())


def _forward(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature, block_m, block_r):
    M, E = h.shape
    B, R = neg_ids.shape
    lse = torch.empty((M,), dtype=torch.float32, device=h.device)
    if M == 0 or B == 0 or max_rows == 0:
        return lse
    hk, ek, nk, tk, ro = _prep(h, e_neg, neg_ids, target_ids, row_offsets)
    prec = _dot_prec(hk.dtype, hk.device)
    launch_fwd(hk, pos.contiguous(), ek, nk, tk, ro, lse, max_rows, 1.0 / temperature,
               _tile("fwd", block_m, block_r, hk.dtype, prec), prec)
    return lse


def launch_fwd(hk, pos, ek, nk, tk, ro, lse, max_rows, scale, tile, prec) -> None:
    """One ``_ssm_fwd`` launch on prepared inputs (``_prep``'s, all on the kernels' device): hk [M, E] and ek
    [B, R, E] (float32 or one 16-bit dtype, contiguous), pos [M] float (the positives' dots), nk [B, R] / tk [M] /
    ro [B+1] int64 (negative ids, target ids, row offsets); writes lse [M] float32. max_rows: host int >= every
    sequence's rows; scale: 1 / temperature; tile: (BLOCK_M, BLOCK_R, num_warps) (powers of two >= 16); prec:
    tl.dot's input_precision ("ieee" | "tf32x3" | "tf32" for float32, None for 16-bit). No checks: the entry point
    (:func:`sampled_softmax_lse_triton`) makes them; benchmarks/sampled_softmax_h200.py --sweep calls this directly."""
    bm, br, warps = tile
    B, R = nk.shape
    _ssm_fwd[(triton.cdiv(max_rows, bm), B)](
        hk, pos, ek, nk, tk, ro, lse, R, hk.shape[1], hk.stride(0), ek.stride(0), ek.stride(1), nk.stride(0), scale,
        BLOCK_M=bm, BLOCK_R=br, BLOCK_E=_block_e(hk.shape[1]), DOT_PREC=prec, num_warps=warps)


def launch_dh(hk, pos, ek, nk, tk, ro, lse, g, dh, dpos, max_rows, scale, tile, prec) -> None:
    """One ``_ssm_bwd_dh`` launch: writes dh [M, E] (hk's dtype) and dpos [M]; lse [M] float32 the forward's, g [M]
    float32 the loss's gradient by lse; the rest as :func:`launch_fwd`."""
    bm, br, warps = tile
    B, R = nk.shape
    _ssm_bwd_dh[(triton.cdiv(max_rows, bm), B)](
        hk, pos, ek, nk, tk, ro, lse, g, dh, dpos, R, hk.shape[1], hk.stride(0), ek.stride(0), ek.stride(1),
        nk.stride(0), dh.stride(0), scale, BLOCK_M=bm, BLOCK_R=br, BLOCK_E=_block_e(hk.shape[1]), DOT_PREC=prec,
        num_warps=warps)


def launch_de(hk, ek, nk, tk, ro, lse, g, de, scale, tile, prec) -> None:
    """One ``_ssm_bwd_de`` launch: writes de [B, R, E] (ek's dtype); arguments as :func:`launch_dh`."""
    bm, br, warps = tile
    B, R = nk.shape
    _ssm_bwd_de[(triton.cdiv(R, br), B)](
        hk, ek, nk, tk, ro, lse, g, de, R, hk.shape[1], hk.stride(0), ek.stride(0), ek.stride(1), nk.stride(0),
        de.stride(0), de.stride(1), scale, BLOCK_M=bm, BLOCK_R=br, BLOCK_E=_block_e(hk.shape[1]), DOT_PREC=prec,
        num_warps=warps)


def _backward(g, h, pos, e_neg, neg_ids, target_ids, row_offsets, lse, max_rows, temperature, block_m, block_r):
    M, E = h.shape
    B, R = neg_ids.shape
    if M == 0 or B == 0 or max_rows == 0 or R == 0:
        return torch.zeros_like(h), torch.zeros_like(pos), torch.zeros_like(e_neg)
    hk, ek, nk, tk, ro = _prep(h, e_neg, neg_ids, target_ids, row_offsets)
    g = g.to(torch.float32).contiguous()
    lse = lse.contiguous()
    dh = torch.empty((M, E), dtype=hk.dtype, device=h.device)
    dpos = torch.empty((M,), dtype=pos.dtype, device=h.device)
    de = torch.empty((B, R, E), dtype=ek.dtype, device=h.device)
    prec, scale = _dot_prec(hk.dtype, hk.device), 1.0 / temperature
    launch_dh(hk, pos.contiguous(), ek, nk, tk, ro, lse, g, dh, dpos, max_rows, scale,
              _tile("dh", block_m, block_r, hk.dtype, prec), prec)
    launch_de(hk, ek, nk, tk, ro, lse, g, de, scale, _tile("de", block_m, block_r, hk.dtype, prec), prec)
    return dh.to(h.dtype), dpos, de.to(e_neg.dtype)


@torch.library.custom_op("gemray::sampled_softmax_lse", mutates_args=())
def sampled_softmax_lse_op(h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor, neg_ids: torch.Tensor,
                           target_ids: torch.Tensor, row_offsets: torch.Tensor, max_rows: int, temperature: float,
                           block_m: int = 0, block_r: int = 0) -> torch.Tensor:
    """Forward as a custom op (arguments as :func:`sampled_softmax_lse_triton`; block_m / block_r: tile sizes,
    0 = the defaults). Returns lse [M] float32."""
    return _forward(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature, block_m, block_r)


@sampled_softmax_lse_op.register_fake
def _fwd_fake(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature, block_m=0, block_r=0):
    return h.new_empty((h.shape[0],), dtype=torch.float32)


@torch.library.custom_op("gemray::sampled_softmax_lse_bwd", mutates_args=())
def sampled_softmax_lse_bwd_op(grad_lse: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor,
                               neg_ids: torch.Tensor, target_ids: torch.Tensor, row_offsets: torch.Tensor,
                               lse: torch.Tensor, max_rows: int, temperature: float, block_m: int = 0,
                               block_r: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward as a custom op: grad_lse [M] (d loss / d lse), lse the forward's. Returns (dh like h, dpos like
    pos, de_neg like e_neg)."""
    return _backward(grad_lse, h, pos, e_neg, neg_ids, target_ids, row_offsets, lse, max_rows, temperature,
                     block_m, block_r)


@sampled_softmax_lse_bwd_op.register_fake
def _bwd_fake(grad_lse, h, pos, e_neg, neg_ids, target_ids, row_offsets, lse, max_rows, temperature, block_m=0,
              block_r=0):
    return torch.empty_like(h), torch.empty_like(pos), torch.empty_like(e_neg)


def _setup(ctx, inputs, output) -> None:
    h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature, block_m, block_r = inputs
    ctx.save_for_backward(h, pos, e_neg, neg_ids, target_ids, row_offsets, output)
    ctx.args = (max_rows, temperature, block_m, block_r)


def _autograd_backward(ctx, grad_lse):
    h, pos, e_neg, neg_ids, target_ids, row_offsets, lse = ctx.saved_tensors
    max_rows, temperature, block_m, block_r = ctx.args
    dh, dpos, de = torch.ops.gemray.sampled_softmax_lse_bwd(grad_lse.contiguous(), h, pos, e_neg, neg_ids,
                                                            target_ids, row_offsets, lse, max_rows, temperature,
                                                            block_m, block_r)
    return dh, dpos, de, None, None, None, None, None, None, None


sampled_softmax_lse_op.register_autograd(_autograd_backward, setup_context=_setup)


def sampled_softmax_lse_triton(h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor, neg_ids: torch.Tensor,
                               target_ids: torch.Tensor, row_offsets: torch.Tensor, max_rows: int,
                               temperature: float, *, block_m: int = 0, block_r: int = 0) -> torch.Tensor:
    """Sampled-softmax log-sum-exp per row, fused (semantics: ``reference.sampled_softmax_lse_ref``).

    Args:
        h: [M, E] float32 / bf16 / fp16 (the unit-norm user states of the rows).
        pos: [M] float, the positive's dot product <h_i, e_pos_i> (not yet divided by the temperature).
        e_neg: [B, R, E] (the unit-norm negatives of each sequence), h's dtype or float32.
        neg_ids: [B, R] int64; target_ids: [M] int64 (a negative equal to its row's target is masked).
        row_offsets: [B+1] int64, rows of sequence b are row_offsets[b]:row_offsets[b+1].
        max_rows: host int >= every sequence's row count (rows past it would be left unwritten).
        temperature: > 0, the logit divisor.
        block_m / block_r: tile sizes (powers of two >= 16; 0 = defaults).
    Returns:
        lse [M] float32. Differentiable in h, pos and e_neg (once).
    Raises:
        ValueError (shapes, dtypes, blocks) or RuntimeError (tensors on a device the kernels do not run on).
    """
    _check(h, pos, e_neg, neg_ids, target_ids, row_offsets, int(max_rows), float(temperature))
    return torch.ops.gemray.sampled_softmax_lse(h, pos, e_neg, neg_ids, target_ids, row_offsets, int(max_rows),
                                                float(temperature), int(block_m), int(block_r))
