"""Generalized dot-product attention (GDPA) over jagged sequences, in Triton.

One kernel family covers the attention-like patterns of GEM / HSTU generative recommenders:

* activation ``softmax`` (jagged flash attention, online softmax, LSE saved for the backward),
  ``silu`` (HSTU: ``silu(alpha * q.k) / N``), ``gelu`` (``gelu(alpha * q.k) / N``, erf form) and
  ``none`` (``alpha * q.k / N``), N = the normaliser (``max_len`` for self-attention);
* self-attention (q, k, v share ``offsets``), causal or not, with an optional per-sequence number of
  target tokens (targets attend to the history and to themselves, not to each other);
* cross-attention (jagged q against a different jagged kv with the same batch size; a dense kv
  ``[B, Nk, H, D]`` is passed as a view with uniform offsets, no copy);
* pooled multi-head attention (PMA: S learned seed queries per head, shared by all sequences, against the
  jagged history; output ``[B, S, H, Dv]``);
* block attention (each query sees only keys of its own fixed block of ``block_size`` positions) and
  sliding-window attention (``|i - j| < window``), whose cost grows linearly with the history length;
* an optional additive bias ``attn_bias`` ([B, n, n] shared by heads or [B, H, n, n]), differentiable (dbias
  written by the dQ kernel);
* HSTU's relative position / time bias computed inside the kernels (``rel_bias``, :class:`RelBias`): from the
  per-token query / key times [T] int64 and the bucket weights pos_w [P] / ts_w [NT], each tile bucketises
  |i - j| (a per-distance table of ``reference.position_bucket_ref``) and tq_i - ts_j (an fp32 log estimate
  corrected against the exact ``reference.time_bucket_ref`` thresholds: the reference's bucket, bit for bit) and
  gathers the weights; no [B, n, n] tensor exists. Backward: each dQ program sums dS per bucket over its key tiles
  (one masked reduction per bucket present in a tile, in registers) and writes its two histograms to its own row
  of an fp32 [programs, buckets] buffer that the host sums in row order (no atomics: d pos_w / d ts_w are the
  same bits on every run). With it the warp-specialized forward and ``ds_store`` are off (the per-bucket sums
  live in the recomputing dQ kernel).

Shape key: B sequences; T = offsets[-1] total tokens; H heads; Dqk query/key width; Dv value width;
L_b = offsets[b+1] - offsets[b]. Tensors stay in gemray's jagged layout ``[T, H, D]`` with
``offsets [B+1] int64`` (see gemray/jagged.py); nothing is padded or converted.

Design (after FlashAttention-2, Dao 2023, and the HSTU kernels of Zhai et al. 2024, "Actions Speak Louder
than Words", arXiv:2402.17152; written from the papers, not copied):

* Work items are (sequence, tile) pairs built on the device from ``offsets`` (no host sync) and sorted
  longest-first (most key tiles first), so the long sequences of a heavy-tailed batch start first and the
  short ones fill the SMs at the end; or (``seq_order_*``) whole sequences longest first with each sequence's
  tiles together, so programs running at once share their sequence's rows in L2. Items past a sequence's end
  are sorted last and exit at once.
* Masks are index arithmetic on the tile's positions, never a materialised 2-D tensor; tiles that are
  entirely valid skip the mask (causal tile skipping: tiles above the diagonal are never visited).
* Backward: dK/dV work items (a key tile, looping over query tiles) and dQ work items (a query tile, looping
  over key tiles) are computed separately, so dQ needs no atomics: two launches, dQ first (for softmax it also
  writes delta = rowsum(o * dO) of its rows, which the dK/dV launch after it reads). Or, per regime
  (``ds_store``), the dK/dV launch also stores dS^T into a scratch and a third launch computes dQ = dS K from it
  (five matmuls per tile pair instead of seven; softmax's delta then comes from its own small launch); with the
  regime's ``dk_from_ds`` the dK/dV launch keeps dV only and a fourth launch computes dK = dS^T Q from the same
  scratch (still five matmuls; one [BLOCK_N, D] fp32 accumulator per dK/dV program instead of two, which at D =
  256 is what fills its registers). PMA sums its per-sequence dQ over the batch with one torch reduction.
* Tile loads (per regime, ``tma_loads``): by pointers (cp.async with row masks), or through tensor descriptors
  made on the device per program (Hopper's bulk tensor copy; rows past a sequence's end read as zeros), which
  pay off only where the loops are long (on for "xlong"; never for block / window attention).
* Configuration: tiles per regime and kind and the launch modes come from one immutable
  ``gemray.kernels.config.KernelConfig`` passed as ``config=`` (None: its DEFAULT, the H200 sweep winners);
  the kernel run reports (benchmarks/reports/kernels_h200_*.md) is the run log of why each mode is on or off. Modes that lost everywhere were deleted
  (one-launch backward, inline delta, atomic dQ, query-rows-first dK/dV, length classes: git has them).
* Host cost per call (it bounds short, heavy-tailed batches): what a call launches (tiles, launch modes, work
  tables, grids, scalar arguments and constexprs of every launch) is decided once per batch and configuration
  and cached as a launch plan (``_fwd_plan`` / ``_bwd_plan``, keyed on the offsets object, shapes, strides,
  dtype, alignment and the config's name); the batch checks run when a plan is made. A call allocates its
  outputs and runs the plan's launches: a JFA fwd+bwd enqueues 3 Triton launches and 6 allocations (o, lse, dq,
  dk, dv, delta), GDPA 3 launches and 5 allocations (o, an empty lse, dq, dk, dv); ``gemray bench kernels
  --host-profile`` counts them. Once a configuration is compiled, launches call the compiled kernel's launcher
  directly (``direct_launch``, ``_Launch``), without the JIT's per-call argument binding.
* torch.library custom ops (namespace ``gemray``): ``gemray::gdpa_fwd`` (-> out, lse) and ``gemray::gdpa_bwd``
  (-> dq, dk, dv, dbias), with fake (meta) implementations and the backward registered as the forward's autograd
  formula, so torch.compile, export and FakeTensor / meta tracing see one op per call. The config travels by name
  (``gemray.kernels.config``: a registry of immutable configs). Plain eager calls (no compile, no fake / proxy /
  functional mode, plain tensors) take the same implementation through an ``autograd.Function`` instead of the
  dispatcher: the Python custom op's dispatch costs ~100-200 us more per fwd+bwd on the host (measured on the
  2-core CI box), which the host-bound short batches would pay per layer (``gemray.kernels._eager.plain_eager``).
* silu on 16-bit inputs (CUDA): ``silu(x) = h + h tanh(h)``, h = x/2, with ``tanh.approx.f32`` (one MUFU op
  per score instead of exp2 + reciprocal; act and act' share it in the backward); fp32 inputs and the
  interpreter keep the exact sigmoid. The 1/N of the pointwise activations is applied once per output tile.

Public entry points: :func:`jagged_attention_triton` (same signature as
``gemray.kernels.reference.jagged_attention_ref`` plus ``config``), :func:`jagged_cross_attention_triton`,
:func:`pma_triton`, :func:`jagged_block_attention_triton`, and the generic :func:`gdpa_triton`.
Works with triton 3.6 on CUDA and with ``TRITON_INTERPRET=1`` (triton 3.9) on CPU, where bf16 inputs run in
float32 (the interpreter's bf16 ``tl.dot`` is wrong: triton-lang/triton#11584) and the batch checks raise at once.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from gemray.kernels import config as kconfig
from gemray.kernels._eager import plain_eager
from gemray.kernels.config import KernelConfig

try:  # the Hopper warp-specialized forward (Gluon ships with Triton >= 3.5)
    from gemray.kernels import ws_attention as ws
except ImportError:  # pragma: no cover - an older Triton: the Triton kernels only
    ws = None

log = logging.getLogger(__name__)

ACTIVATIONS = MappingProxyType({"softmax": 0, "silu": 1, "gelu": 2, "none": 3})
_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# triton picks the interpreter or the compiler when it decorates the kernels below, i.e. at import; read the
# switch once here as well (an os.environ lookup per call was measurable host time)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreting() -> bool:
    return _INTERPRET


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when triton was imported): then
    they take CPU tensors; else CUDA tensors."""
    return _INTERPRET


def regime(total: int, batch: int, config: KernelConfig | None = None) -> str:
    """Tile regime of a batch from its mean sequence length total / batch (host ints): "short" / "medium" /
    "long" / "xlong" against ``config.regime_mean_len`` (see gemray.kernels.config)."""
    return kconfig.resolve(config).regime_of(total, batch)


def _tiles(kind: str, d: int, reg: str, max_q_len: int | None, cfg: KernelConfig, *, d_v: int | None = None,
           rel: bool = False, elem_bytes: int = 2, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """Tile config (BLOCK_M, BLOCK_N, num_warps, num_stages) of a kernel kind in regime ``reg`` at head dims
    ``d`` (q / k) and ``d_v`` (default d) with ``elem_bytes``-byte inputs: ``cfg.tile`` -- the regime's tile,
    shrunk where its shared memory would not fit ``device``'s per-block limit (the in-kernel relative bias,
    ``rel``, needs more) -- or, in the interpreter, ``cfg.interpret_tiles``; ``max_q_len`` <= 64 (cross/PMA with
    few queries) shrinks BLOCK_M."""
    if _interpreting():
        bm, bn, warps, stages = cfg.interpret_tiles.get(kind, d)
    else:
        bm, bn, warps, stages = cfg.tile(reg, kind, d, d_v, rel=rel, elem_bytes=elem_bytes,
                                         limit=_smem_limit(device))
    if not _interpreting() and max_q_len is not None and max_q_len <= 64:
        small = max(16, 1 << (max_q_len - 1).bit_length())
        if kind in ("fwd", "fwd_silu", "dq", "dq_ds"):
            bm, warps = small, 4
        else:
            bm = min(bm, small)
    return bm, bn, warps, stages


@functools.lru_cache(maxsize=16)
def _smem_limit(device: torch.device | None) -> int:
    """Shared memory one block may opt into on ``device`` (bytes; sm_90's 232,448 when torch does not say)."""
    if device is None or device.type != "cuda":
        return kconfig.SMEM_LIMIT_SM90
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or kconfig.SMEM_LIMIT_SM90)


_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def _cached(tensors: tuple, extra: tuple, make):
    """Memoise ``make()`` on the identity and version of ``tensors`` (e.g. offsets) plus ``extra``.

    A jagged batch's offsets tensor is shared by every layer and by forward and backward, so the work
    tables (and the length checks) are built once per batch. Identity is checked through weak references
    (an id reused by a new tensor never hits) and in-place edits bump ``_version``.
    """
    key = extra + tuple([None if t is None else (id(t), t._version) for t in tensors])
    hit = _CACHE.get(key)
    if hit is not None:
        refs, val = hit
        for r, t in zip(refs, tensors):
            if (None if r is None else r()) is not t:
                break
        else:
            _CACHE.move_to_end(key)
            return val
    val = make()
    _CACHE[key] = (tuple(None if t is None else weakref.ref(t) for t in tensors), val)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return val


# the current CUDA device and its raw stream handle (module attributes: gemray.bench.kernels' host profile, which
# runs without a GPU, replaces them)
_current_device = torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_LAUNCHERS: OrderedDict = OrderedDict()
_LAUNCHERS_SIZE = 512
_NO_DIRECT: set = set()  # kernels whose launch did not return a compiled kernel (stubs, other Triton versions)


def _launch_hooked() -> bool:
    """Whether a Triton launch hook is installed (triton 3.6 keeps them in HookChain objects, empty by
    default; a profiler adds to them): the direct launch passes no hooks, so it steps aside then."""
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True)))


class _Launch:
    """One kernel launch with everything but its tensor arguments fixed: ``kernel[grid](*tensors, *scalars,
    **consts, num_warps=, num_stages=)``; our kernels' signatures list the tensor arguments, then the scalar
    ones, then the constexprs. A launch plan (_FwdPlan, _BwdPlan) holds one per kernel it runs and calls it
    with each call's tensors.

    With ``direct`` (the config's direct_launch) on a GPU, the first launch of a configuration goes through the JIT, which returns the
    compiled kernel; a later launch with the same scalars, constexprs and options, and tensors of the same
    dtypes and 16-byte alignment (what the JIT specializes a tensor on), on the same device, calls that
    kernel's launcher directly, as the JIT does after binding. That skips the JIT's per-call Python work
    (binding and specializing ~70 arguments, its cache key, option parsing): host time that bounds short,
    heavy-tailed batches (the kernel run reports (benchmarks/reports/kernels_h200_*.md) "Run 18"). Scalars enter the key by value (a value of 1 or a
    multiple of 16 compiles differently), so a new value takes the JIT once more. The compiled launchers are
    kept in _LAUNCHERS (by the whole key) and, for the last tensor signature, on the object itself (a plan's
    launch then skips building the key). Falls back to the JIT under the interpreter, while a Triton launch
    hook is installed (profilers), and for any kernel whose launch does not return a compiled kernel (other
    Triton versions, the bench's host-profile stubs)."""

    __slots__ = ("kernel", "grid", "scalars", "consts", "num_warps", "num_stages", "key", "direct", "allow_direct")

    def __init__(self, kernel, grid: tuple, scalars, consts: dict, num_warps: int, num_stages: int,
                 direct: bool = True):
        self.kernel, self.grid, self.scalars, self.consts = kernel, tuple(grid), tuple(scalars), consts
        self.num_warps, self.num_stages, self.allow_direct = num_warps, num_stages, direct
        self.key = (kernel, num_warps, num_stages, tuple(consts), tuple(consts.values()), self.scalars)
        self.direct = None  # (tensor signature, compiled kernel, constexpr values) of the last direct launch

    def __call__(self, tensors: list) -> None:
        kernel = self.kernel
        if not self.allow_direct or _INTERPRET or kernel in _NO_DIRECT or _launch_hooked():
            kernel[self.grid](*tensors, *self.scalars, **self.consts, num_warps=self.num_warps,
                              num_stages=self.num_stages)
            return
        device = _current_device()
        sig = (device, tuple([t.dtype for t in tensors]), tuple([t.data_ptr() % 16 == 0 for t in tensors]))
        hit = self.direct
        if hit is None or hit[0] != sig:
            hit = _LAUNCHERS.get(self.key + sig)
            if hit is None:
                self._jit(tensors, sig)
                return
            self.direct = hit
        self._run(hit, device, tensors)

    def planned(self, tensors: list) -> None:
        """A launch of a plan: the plan's key fixes every tensor's dtype and alignment (q / k / v / bias / dO by
        value; outputs, scratch and work tables are fresh or cached allocations; offsets by identity), so once
        this launch has run directly, the next ones skip building the tensor signature (same device only)."""
        hit = self.direct
        if hit is not None and self.allow_direct and not _launch_hooked():
            device = _current_device()
            if hit[0][0] == device:
                self._run(hit, device, tensors)
                return
        self(tensors)

    def _run(self, hit: tuple, device: int, tensors: list) -> None:
        _, compiled, const_vals = hit
        grid = self.grid
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, _raw_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *tensors, *self.scalars, *const_vals)

    def _jit(self, tensors: list, sig: tuple) -> None:
        """Launch through the JIT and keep the compiled kernel's launcher for the next launch like it."""
        kernel = self.kernel
        compiled = kernel[self.grid](*tensors, *self.scalars, **self.consts, num_warps=self.num_warps,
                                     num_stages=self.num_stages)
        params = getattr(kernel, "params", None)
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")) or params is None:
            _NO_DIRECT.add(kernel)
            return
        # the launcher takes every parameter in signature order, constexprs included (it skips them)
        rest = params[len(tensors) + len(self.scalars):]
        if len(self.grid) > 2 or any(not p.is_constexpr or p.name not in self.consts for p in rest):
            _NO_DIRECT.add(kernel)
            return
        self.direct = _LAUNCHERS[self.key + sig] = (sig, compiled, tuple(self.consts[p.name] for p in rest))
        while len(_LAUNCHERS) > _LAUNCHERS_SIZE:
            _LAUNCHERS.popitem(last=False)


# ----------------------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _tanh_approx(x):
    """tanh.approx.f32: one special-function (MUFU) op, max relative error about 2^-11 (compiled CUDA only)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _act(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """Pointwise activation of the scaled score s (fp32), without the 1/N factor (applied once per tile
    row at the end). FAST (bf16/fp16 on CUDA): silu(s) = h + h tanh(h), h = s / 2, one MUFU op per score
    instead of two (exp2 + reciprocal), which bounded the silu kernels on the H200."""
    if ACT == 1:
        if FAST:
            h = 0.5 * s
            out = h * _tanh_approx(h) + h
        else:  # s * sigmoid(s) with the fast (approximate, 2 ulp) division
            out = tl.fdiv(s, 1.0 + tl.exp2(-1.4426950408889634 * s), ieee_rounding=False)
    elif ACT == 2:
        out = 0.5 * s * (1.0 + tl.erf(s * 0.7071067811865476))
    else:
        out = s
    return out


@triton.jit
def _act_and_grad(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(s), d act(s) / ds) for the pointwise activations (fp32), sharing one sigmoid evaluation."""
    if ACT == 1:
        if FAST:  # sigmoid = (1 + t) / 2 with t = tanh(s / 2); silu' = sig (1 + s (1 - sig))
            h = 0.5 * s
            t = _tanh_approx(h)
            out = h * t + h
            grad = (0.5 + 0.5 * t) * (1.0 + h - h * t)
        else:
            sig = tl.fdiv(s * 0.0 + 1.0, 1.0 + tl.exp2(-1.4426950408889634 * s), ieee_rounding=False)
            out = s * sig
            grad = sig * (1.0 + s * (1.0 - sig))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        out = s * cdf
        grad = cdf + s * 0.3989422804014327 * tl.exp(-0.5 * s * s)
    else:
        out = s
        grad = s * 0.0 + 1.0
    return out, grad


@triton.jit
def _valid(qpos, kpos, lq, lk, n_hist, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
           ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, CONTEXT: tl.constexpr):
    """Boolean validity of (query position, key position) pairs; qpos/kpos broadcast to a 2-D tile.
    The contextual prefix (CONTEXT > 0, causal) is applied after the targets' rule, as in
    ``jagged_contextual_attention_ref``: prefix positions see each other even where a short sequence's
    targets reach into the prefix."""
    inside = (qpos < lq) & (kpos < lk)
    ok = inside
    if CAUSAL:
        ok = ok & (kpos <= qpos)
    if HAS_TARGETS:
        ok = ok & ((kpos < n_hist) | (kpos == qpos))
    if CAUSAL and CONTEXT > 0:  # the first CONTEXT positions form a bidirectional prefix
        ok = ok | (inside & (qpos < CONTEXT) & (kpos < CONTEXT))
    if ATT_BLOCK > 0:
        ok = ok & ((kpos // ATT_BLOCK) == (qpos // ATT_BLOCK))
    if WINDOW > 0:
        ok = ok & ((qpos - kpos) < WINDOW) & ((kpos - qpos) < WINDOW)
    return ok


@triton.jit
def _key_range(m0, lk, n_hist, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, ATT_BLOCK: tl.constexpr,
               WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CONTEXT: tl.constexpr):
    """Key tiles a query tile [m0, m0+BLOCK_M) visits: [lo, hi); [lo, full_hi) needs no mask."""
    lo = m0 * 0
    hi = lk
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
        if CONTEXT > 0:  # prefix queries also see the prefix keys after them
            hi = tl.where(m0 < CONTEXT, tl.maximum(hi, tl.minimum(lk, CONTEXT)), hi)
    if ATT_BLOCK > 0:
        lo = (m0 // ATT_BLOCK) * ATT_BLOCK
        hi = tl.minimum(hi, ((m0 + BLOCK_M - 1) // ATT_BLOCK + 1) * ATT_BLOCK)
    if WINDOW > 0:
        lo = tl.maximum(m0 - WINDOW + 1, 0)
        if not CAUSAL:
            hi = tl.minimum(hi, m0 + BLOCK_M - 1 + WINDOW)
    lo = (lo // BLOCK_N) * BLOCK_N
    if (ATT_BLOCK > 0) or (WINDOW > 0):
        full_hi = lo
    else:
        if CAUSAL:
            full_hi = (tl.minimum(m0 + 1, lk) // BLOCK_N) * BLOCK_N
        else:
            full_hi = (lk // BLOCK_N) * BLOCK_N
        if HAS_TARGETS:
            full_hi = tl.minimum(full_hi, (n_hist // BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(full_hi, lo)
    return lo, hi, full_hi


@triton.jit
def _query_range(n0, lq, n_hist, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, ATT_BLOCK: tl.constexpr,
                 WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CONTEXT: tl.constexpr):
    """Query tiles a key tile [n0, n0+BLOCK_N) is seen by: [lo, hi); [full_lo, hi) needs no mask."""
    lo = n0 * 0
    hi = lq
    if CAUSAL:
        lo = n0
        if CONTEXT > 0:  # prefix keys are also seen by the prefix queries before them
            lo = tl.where(n0 < CONTEXT, 0, lo)
    if HAS_TARGETS:
        # a key tile made only of targets (and no prefix) is seen only by those targets themselves
        hi = tl.where((n0 >= n_hist) & (n0 >= CONTEXT), tl.minimum(hi, n0 + BLOCK_N), hi)
    if ATT_BLOCK > 0:
        lo = tl.maximum(lo, (n0 // ATT_BLOCK) * ATT_BLOCK)
        hi = tl.minimum(hi, ((n0 + BLOCK_N - 1) // ATT_BLOCK + 1) * ATT_BLOCK)
    if WINDOW > 0:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 + WINDOW)
        if not CAUSAL:
            lo = tl.maximum(lo, n0 - WINDOW + 1)
    lo = (lo // BLOCK_M) * BLOCK_M
    if (ATT_BLOCK > 0) or (WINDOW > 0):
        full_lo = hi
    else:
        if CAUSAL:
            full_lo = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M
        else:
            full_lo = lo
        if HAS_TARGETS:
            full_lo = tl.where(n0 + BLOCK_N > n_hist, hi, full_lo)
        full_lo = tl.maximum(full_lo, lo)
    return lo, hi, full_lo


@triton.jit
def _rows_desc(base, n_rows, stride_t, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptor of one sequence's rows [n_rows, BLOCK_D] (row stride stride_t, unit column
    stride) read in [BLOCK_R, BLOCK_D] boxes; rows >= n_rows read as zeros (the jagged tail needs no mask).
    Made on the device per program (Triton keeps it in the global scratch the host allocator gives)."""
    return tl.make_tensor_descriptor(base, shape=[tl.maximum(n_rows, 1), BLOCK_D], strides=[stride_t, 1],
                                     block_shape=[BLOCK_R, BLOCK_D])


@triton.jit
def _ds_desc(DS, h, kv_start, lk, lq, stride_dsh, stride_dst, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tensor descriptor of one (sequence, head)'s dS^T block of the DS_STORE buffer [H, Tk, W]: rows = the
    sequence's key rows (lk), columns = its query positions (lq), row stride W; [BLOCK_N, BLOCK_M] boxes.
    Stores past lk / lq are dropped and loads there read zeros (the jagged edges need no masks)."""
    return tl.make_tensor_descriptor(DS + h * stride_dsh + kv_start * stride_dst,
                                     shape=[tl.maximum(lk, 1), tl.maximum(lq, 1)], strides=[stride_dst, 1],
                                     block_shape=[BLOCK_N, BLOCK_M])


@triton.jit
def _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS: tl.constexpr):
    """(q_start, lq, kv_start, lk, n_hist) of sequence b: its first query / key row, its query / key lengths
    (int32) and its number of history positions (lk minus its targets with HAS_TARGETS, else lk)."""
    q_start = tl.load(Q_OFF + b)
    lq = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
    kv_start = tl.load(KV_OFF + b)
    lk = (tl.load(KV_OFF + b + 1) - kv_start).to(tl.int32)
    n_hist = lk
    if HAS_TARGETS:
        n_hist = lk - tl.load(NT + b).to(tl.int32)
    return q_start, lq, kv_start, lk, n_hist


@triton.jit
def _item_head(WORK, n_heads, HEADS_INNER: tl.constexpr):
    """(work item id from the longest-first table WORK, head as int64) of this program. Grid (items, H):
    program_id(1) is the head, so CUDA dispatches all of head 0's items before head 1's (each head's
    longest items start a quarter of the launch later than the previous head's: a tail on heavy-tailed
    batches). HEADS_INNER: grid (items * H,), head = pid % H, so the table's order holds across heads."""
    if HEADS_INNER:
        pid = tl.program_id(0)
        w = tl.load(WORK + pid // n_heads)
        h = (pid % n_heads).to(tl.int64)
    else:
        w = tl.load(WORK + tl.program_id(0))
        h = tl.program_id(1).to(tl.int64)
    return w, h


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _load_bias(bias_base, qpos, kpos, stride_bi, stride_bj, lq, lk, ACT: tl.constexpr):
    """Bias tile (fp32) at broadcastable query/key positions; base 2 for softmax. Masked to the sequence."""
    b = tl.load(bias_base + qpos * stride_bi + kpos * stride_bj, mask=(qpos < lq) & (kpos < lk), other=0.0)
    b = b.to(tl.float32)
    if ACT == 0:
        b = b * 1.4426950408889634
    return b

@triton.jit
def _rel_bias(qpos, kpos, tq, tk, lq, lk, PB_TAB, TTHR, PW, TW, n_tb, ACT: tl.constexpr):
    """HSTU relative bias of a tile computed from its ingredients (no dense bias): ``PW[pb(|i-j|)] +
    TW[tb(tq_i - ts_j)]`` at broadcastable query / key positions qpos / kpos with their times tq / tk (int64).
    Returns (bias fp32, base 2 for softmax; position bucket int32; time bucket int32), 0 / bucket 0 outside the
    sequence. pb: PB_TAB [max_len] int32 (the host's ``position_bucket_ref`` per distance). tb = the largest b
    with |dt| >= TTHR[b] (TTHR [n_tb + 1] sorted, TTHR[0] = 0, TTHR[n_tb] = the type's max: the host's exact
    ``time_bucket_ref`` thresholds), found from an fp32 log estimate (off by at most one bucket) corrected by
    two exact integer comparisons: the same bucket as ``time_bucket_ref`` on the device, bit for bit.
    TTHR int32 (:func:`_kernel_thresholds`: when every real threshold is below 2^31 - 2, e.g. 64 time buckets):
    |dt| is saturated to 2^31 - 2 right after the int64 subtraction and the bucket search runs on int32 tiles --
    exact for every int64 input, since any |dt| >= 2^31 - 2 is past the last real threshold (the last bucket
    either way); this halves the registers of the two threshold gathers and of |dt| (the kernels spilled with
    int64 tiles here). TTHR int64: the search on int64 tiles (more buckets, e.g. 128 reach |dt| >= 2^31)."""
    ok = (qpos < lq) & (kpos < lk)
    d = qpos - kpos
    d = tl.where(d < 0, -d, d)
    pb = tl.load(PB_TAB + d, mask=ok, other=0)
    dt = tq - tk
    adt = tl.where(dt < 0, -dt, dt)
    if TTHR.dtype.element_ty == tl.int32:
        adt = tl.minimum(adt, 2147483646).to(tl.int32)
    est = (tl.log(tl.maximum(adt, 1).to(tl.float32)) * (1.0 / 0.301)).to(tl.int32)
    tb = tl.minimum(tl.maximum(est, 0), n_tb - 1)
    tb = tl.where(ok, tb, 0)
    lo = tl.load(TTHR + tb, mask=ok, other=0)
    tb = tl.where(adt < lo, tb - 1, tb)
    hi = tl.load(TTHR + tb + 1, mask=ok, other=0)
    tb = tl.where(ok & (adt >= hi), tb + 1, tb)
    tb = tl.where(ok, tb, 0)
    b = tl.load(PW + pb, mask=ok, other=0.0).to(tl.float32) + tl.load(TW + tb, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:
        b = b * 1.4426950408889634
    return b, pb, tb


@triton.jit
def _bucket_sums(hist, ds, idx, NB_PAD: tl.constexpr):
    """hist [NB_PAD] fp32 += per-bucket sums of the tile ds [R, C] (fp32) over its bucket indices idx [R, C]
    (int32): one masked reduction per bucket present among the tile's non-zero ds (pairs with ds = 0 -- masked
    or outside the sequence -- add nothing, so they do not widen the loop); no atomics (the program writes its
    histogram to its own row once, at its end; the host sums the rows)."""
    nz = ds != 0.0
    b_lo = tl.min(tl.min(tl.where(nz, idx, NB_PAD), 1), 0)
    b_hi = tl.max(tl.max(tl.where(nz, idx, -1), 1), 0)
    slots = tl.arange(0, NB_PAD)
    for bkt in range(b_lo, b_hi + 1):
        s = tl.sum(tl.sum(tl.where(idx == bkt, ds, 0.0), 1), 0)
        hist += tl.where(slots == bkt, s, 0.0)
    return hist


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk, n_hist, alpha_s,
               inv_n, lo, hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj,
               tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb,
               ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
               ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
               BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
               CONTEXT: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr, REL: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if TMA:  # k_base / v_base are tensor descriptors [lk, D]: rows past lk arrive as zeros
            kt = tl.trans(k_base.load([n0, 0]))
            v = v_base.load([n0, 0])
        else:
            kt_ptrs = k_base + offs_n[None, :] * stride_kt + offs_dk[:, None]
            v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dv[None, :]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < lk) & (offs_dk[:, None] < D_QK), other=0.0)
                v = tl.load(v_ptrs, mask=(offs_n[:, None] < lk) & (offs_dv[None, :] < D_V), other=0.0)
            elif EVEN_D:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=offs_dk[:, None] < D_QK, other=0.0)
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PREC)
        if HAS_BIAS:
            s = s * alpha_s + _load_bias(bias_base, offs_m[:, None], offs_n[None, :], stride_bi, stride_bj,
                                         lq, lk, ACT)
            sc = 1.0
        elif REL:
            tk = tl.load(tk_base + offs_n, mask=offs_n < lk, other=0)
            rb, _pb, _tb = _rel_bias(offs_m[:, None], offs_n[None, :], tq[:, None], tk[None, :], lq, lk, PB_TAB,
                                     TTHR, PW, TW, n_tb, ACT)
            s = s * alpha_s + rb
            sc = 1.0
        else:
            sc = alpha_s
        if ACT == 0:
            if MASKED:
                ok = _valid(offs_m[:, None], offs_n[None, :], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                s = tl.where(ok, s, float("-inf"))
            # sc > 0 (alpha checked on the host): max of the scaled scores = scaled max; one FMA per score
            m_new = tl.maximum(m_i, tl.max(s, 1) * sc)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            corr = tl.exp2(m_i - m_safe)
            p = tl.exp2(s * sc - m_safe[:, None])
            l_i = l_i * corr + tl.sum(p, 1)
            acc = acc * corr[:, None]
            m_i = m_new
        else:
            if ACT == 1 and FAST:  # silu(x) = h + h tanh(h) with h = x / 2: the 1/2 folded into the scale
                h = s * (0.5 * sc)
                p = h * _tanh_approx(h) + h
            else:
                p = _act(s * sc, ACT, FAST)  # 1/N is applied to acc once, in the epilogue
            if MASKED:
                ok = _valid(offs_m[:, None], offs_n[None, :], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                p = tl.where(ok, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _gdpa_fwd(Q, K, V, O, LSE, Q_OFF, KV_OFF, NT, WORK, BIAS, TQ, TK, PB_TAB, TTHR, PW, TW,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
              stride_lh, stride_bb, stride_bh, stride_bi, stride_bj, alpha, inv_n, n_tiles, D_QK, D_V, n_heads,
              n_tb,
              ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
              ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, Q_BCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
              BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
              CONTEXT: tl.constexpr, FAST: tl.constexpr, HEADS_INNER: tl.constexpr, TMA: tl.constexpr,
              REL: tl.constexpr):
    """Forward work item: grid (items, H), or (items * H,) with HEADS_INNER (see _item_head). TMA: the key /
    value tiles of the loop come through tensor descriptors (Hopper's bulk tensor copy; needs EVEN_D). REL: the
    HSTU relative bias computed per tile from query times TQ / key times TK [T] int64, the position-bucket table
    PB_TAB, the time thresholds TTHR and the weights PW / TW (see _rel_bias); self-attention only."""
    w, h = _item_head(WORK, n_heads, HEADS_INNER)
    if w < 0:
        return
    b = w // n_tiles
    m0 = (w % n_tiles) * BLOCK_M
    q_start, lq, kv_start, lk, n_hist = _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    q_row = q_start
    if Q_BCAST:
        q_row = q_start * 0

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + (q_row + offs_m[:, None]) * stride_qt + h * stride_qh + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < lq) & (offs_dk[None, :] < D_QK), other=0.0)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh
    if TMA:
        k_base = _rows_desc(k_base, lk, stride_kt, BLOCK_N, BLOCK_DQK)
        v_base = _rows_desc(v_base, lk, stride_vt, BLOCK_N, BLOCK_DV)

    if ACT == 0:
        alpha_s = alpha * 1.4426950408889634  # softmax in base 2
    else:
        alpha_s = alpha
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h * stride_bh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if REL:
        tq = tl.load(TQ + q_start + offs_m, mask=offs_m < lq, other=0)
    else:
        tq = offs_m
    tk_base = TK + kv_start
    lo, hi, full_hi = _key_range(m0, lk, n_hist, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, BLOCK_M, BLOCK_N, CONTEXT)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk,
                               n_hist, alpha_s, inv_n, lo, full_hi, offs_dk, offs_dv, D_QK, D_V,
                               bias_base, stride_bi, stride_bj, tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb,
                               ACT, False, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, EVEN_D, BLOCK_N,
                               DOT_PREC, HAS_BIAS, CONTEXT, FAST, TMA, REL)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk,
                               n_hist, alpha_s, inv_n, full_hi, hi, offs_dk, offs_dv, D_QK, D_V,
                               bias_base, stride_bi, stride_bj, tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb,
                               ACT, True, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, EVEN_D, BLOCK_N,
                               DOT_PREC, HAS_BIAS, CONTEXT, FAST, TMA, REL)
    row_ok = offs_m < lq
    if ACT == 0:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        acc = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("inf"), m_i + tl.log2(l_safe))
        tl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=row_ok)
    else:
        acc = acc * inv_n
    o_ptrs = O + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))


# ----------------------------------------------------------------------------------------------------------
# Backward: dK/dV (key tile, loop over query tiles) and dQ (query tile, loop over key tiles); no atomics.
# One kernel, _gdpa_bwd, runs either kind of item (PART 1 / 2: one launch per kind) or both kinds from one
# merged longest-first work table (PART 0: one launch, the short dQ items fill the tail of the dK/dV ones).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, lq, lk, n_hist,
                alpha_s, lo, hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj, dbias_base, stride_dbi,
                stride_dbj, ds_scale, ds_desc, n0, tq_base, tk, PB_TAB, TTHR, PW, TW, n_tb,
                ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_TARGETS: tl.constexpr, ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr, CONTEXT: tl.constexpr, FAST: tl.constexpr,
                STORE_DBIAS: tl.constexpr, TMA: tl.constexpr, STORE_DS: tl.constexpr, REL: tl.constexpr,
                NO_DK: tl.constexpr):
    """The query loop of a dK/dV program over query tiles [lo, hi), scores laid out key-rows-first (s^T = k q^T
    [BLOCK_N, BLOCK_M]: lse / delta per column). NO_DK (with STORE_DS): dK is left to _gdpa_dk_ds, dk untouched."""
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < lq
        if TMA:  # q_base / do_base are tensor descriptors [lq, D]
            qt = tl.trans(q_base.load([m0, 0]))
            do = do_base.load([m0, 0])
        else:
            qt = tl.load(q_base + offs_m[None, :] * stride_qt + offs_dk[:, None],
                         mask=row_ok[None, :] & (offs_dk[:, None] < D_QK), other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        st = tl.dot(k, qt, input_precision=DOT_PREC) * alpha_s  # [BLOCK_N, BLOCK_M]
        if HAS_BIAS:
            st = st + _load_bias(bias_base, offs_m[None, :], offs_n[:, None], stride_bi, stride_bj, lq, lk, ACT)
        elif REL:
            tq = tl.load(tq_base + offs_m, mask=row_ok, other=0)
            rb, _pb, _tb = _rel_bias(offs_m[None, :], offs_n[:, None], tq[None, :], tk[:, None], lq, lk, PB_TAB,
                                     TTHR, PW, TW, n_tb, ACT)
            st = st + rb
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        if ACT == 0:
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            pt = tl.exp2(st - lse[None, :])
            if MASKED:
                ok = _valid(offs_m[None, :], offs_n[:, None], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                pt = tl.where(ok, pt, 0.0)
            dst = pt * (dpt - delta[None, :])
        else:  # 1/N is applied to dk, dv once, in the epilogue
            pt, gt = _act_and_grad(st, ACT, FAST)
            dst = dpt * gt
            if MASKED:
                ok = _valid(offs_m[None, :], offs_n[:, None], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                pt = tl.where(ok, pt, 0.0)
                dst = tl.where(ok, dst, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dst_lp = dst.to(qt.dtype)
        if STORE_DS:  # dS^T tile [BLOCK_N, BLOCK_M] for the dQ launch (_gdpa_dq_ds); TMA clips the jagged edges
            ds_desc.store([n0, m0], dst_lp)
        if not NO_DK:
            dk = tl.dot(dst_lp, tl.trans(qt), dk, input_precision=DOT_PREC)
        if STORE_DBIAS:  # d logits = d bias; every (row, key) pair is in exactly one key tile's program
            tl.store(dbias_base + offs_m[None, :] * stride_dbi + offs_n[:, None] * stride_dbj, dst * ds_scale,
                     mask=row_ok[None, :] & (offs_n[:, None] < lk))
    return dk, dv


@triton.jit
def _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, Q_OFF, KV_OFF, NT, BIAS, DBIAS, b, n0, h,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
               stride_bb, stride_bh, stride_bi, stride_bj, stride_dbb, stride_dbh, stride_dbi, stride_dbj,
               alpha, inv_n, D_QK, D_V,
               ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
               ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, Q_BCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
               BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
               CONTEXT: tl.constexpr, FAST: tl.constexpr, STORE_DBIAS: tl.constexpr, TMA: tl.constexpr, DS,
               stride_dsh, stride_dst, STORE_DS: tl.constexpr, TQ, TK, PB_TAB, TTHR, PW, TW, n_tb,
               REL: tl.constexpr, NO_DK: tl.constexpr):
    """dK, dV of keys [n0, n0 + BLOCK_N) of sequence b, head h and, with STORE_DBIAS, dbias of their pairs.
    STORE_DS: also writes dS^T of every pair it visits (0 where masked) into DS, rows = key rows, columns = query
    positions. NO_DK (with STORE_DS): dV only; _gdpa_dk_ds computes dK from the stored dS^T."""
    q_start, lq, kv_start, lk, n_hist = _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    q_row = q_start
    if Q_BCAST:
        q_row = q_start * 0

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < lk
    k = tl.load(K + (kv_start + offs_n[:, None]) * stride_kt + h * stride_kh + offs_dk[None, :],
                mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    v = tl.load(V + (kv_start + offs_n[:, None]) * stride_vt + h * stride_vh + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if ACT == 0:
        alpha_s = alpha * 1.4426950408889634
    else:
        alpha_s = alpha
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h * stride_bh
    q_base = Q + q_row * stride_qt + h * stride_qh
    do_base = DO + q_start * stride_dot + h * stride_doh
    if TMA:
        q_base = _rows_desc(q_base, lq, stride_qt, BLOCK_M, BLOCK_DQK)
        do_base = _rows_desc(do_base, lq, stride_dot, BLOCK_M, BLOCK_DV)
    lse_base = LSE + h * stride_lh + q_start
    delta_base = DELTA + h * stride_lh + q_start
    dbias_base = DBIAS + b.to(tl.int64) * stride_dbb + h * stride_dbh
    if ACT == 0:
        ds_scale = 1.0
    else:
        ds_scale = inv_n
    lo, hi, full_lo = _query_range(n0, lq, n_hist, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, BLOCK_M,
                                   BLOCK_N, CONTEXT)
    if REL:
        tk = tl.load(TK + kv_start + offs_n, mask=col_ok, other=0)
    else:
        tk = offs_n
    tq_base = TQ + q_start
    ds_desc = DS
    if STORE_DS:
        ds_desc = _ds_desc(DS, h, kv_start, lk, lq, stride_dsh, stride_dst, BLOCK_N, BLOCK_M)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, lq,
                         lk, n_hist, alpha_s, lo, full_lo, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj,
                         dbias_base, stride_dbi, stride_dbj, ds_scale, ds_desc, n0, tq_base, tk, PB_TAB, TTHR, PW,
                         TW, n_tb, ACT, True, CAUSAL, HAS_TARGETS,
                         ATT_BLOCK, WINDOW, BLOCK_M, DOT_PREC, HAS_BIAS, CONTEXT, FAST, STORE_DBIAS, TMA, STORE_DS,
                         REL, NO_DK)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_n, lq,
                         lk, n_hist, alpha_s, full_lo, hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj,
                         dbias_base, stride_dbi, stride_dbj, ds_scale, ds_desc, n0, tq_base, tk, PB_TAB, TTHR, PW,
                         TW, n_tb, ACT, False, CAUSAL, HAS_TARGETS,
                         ATT_BLOCK, WINDOW, BLOCK_M, DOT_PREC, HAS_BIAS, CONTEXT, FAST, STORE_DBIAS, TMA, STORE_DS,
                         REL, NO_DK)
    if ACT == 0:
        dk = dk * alpha
    else:
        dk = dk * (alpha * inv_n)
        dv = dv * inv_n
    if not NO_DK:
        tl.store(DK + (kv_start + offs_n[:, None]) * stride_dkt + h * stride_dkh + offs_dk[None, :],
                 dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_dk[None, :] < D_QK))
    tl.store(DV + (kv_start + offs_n[:, None]) * stride_dvt + h * stride_dvh + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk, n_hist, alpha_s,
              ds_scale, lo, hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj, dbias_base,
              stride_dbi, stride_dbj, tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb, hist_p, hist_t,
              ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
              ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr,
              CONTEXT: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr, REL: tl.constexpr,
              P_PAD: tl.constexpr, NT_PAD: tl.constexpr):
    """The key loop of a dQ program over key tiles [lo, hi). REL: also the per-bucket sums of dS (without 1/N)
    into the program's histograms hist_p [P_PAD] / hist_t [NT_PAD]. Returns (dq, hist_p, hist_t)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < lk
        if TMA:  # k_base / v_base are tensor descriptors [lk, D]
            kt = tl.trans(k_base.load([n0, 0]))
            vt = tl.trans(v_base.load([n0, 0]))
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_dk[:, None],
                         mask=col_ok[None, :] & (offs_dk[:, None] < D_QK), other=0.0)
            vt = tl.load(v_base + offs_n[None, :] * stride_vt + offs_dv[:, None],
                         mask=col_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * alpha_s
        if HAS_BIAS:
            s = s + _load_bias(bias_base, offs_m[:, None], offs_n[None, :], stride_bi, stride_bj, lq, lk, ACT)
        elif REL:
            tk = tl.load(tk_base + offs_n, mask=col_ok, other=0)
            rb, pb, tb = _rel_bias(offs_m[:, None], offs_n[None, :], tq[:, None], tk[None, :], lq, lk, PB_TAB,
                                   TTHR, PW, TW, n_tb, ACT)
            s = s + rb
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        if ACT == 0:
            p = tl.exp2(s - lse[:, None])
            if MASKED:
                ok = _valid(offs_m[:, None], offs_n[None, :], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                p = tl.where(ok, p, 0.0)
            ds = p * (dp - delta[:, None])
        else:  # without 1/N (ds_scale), applied to dq once in the epilogue
            _unused, g = _act_and_grad(s, ACT, FAST)
            ds = dp * g
            if MASKED:
                ok = _valid(offs_m[:, None], offs_n[None, :], lq, lk, n_hist, CAUSAL, HAS_TARGETS,
                            ATT_BLOCK, WINDOW, CONTEXT)
                ds = tl.where(ok, ds, 0.0)
        if STORE_DBIAS:  # d logits = d bias; every (row, key) pair is written by exactly one program
            tl.store(dbias_base + offs_m[:, None] * stride_dbi + offs_n[None, :] * stride_dbj, ds * ds_scale,
                     mask=(offs_m[:, None] < lq) & (offs_n[None, :] < lk))
        if REL:  # d pos_w / d ts_w: every (row, key) pair is visited by exactly one dQ program
            hist_p = _bucket_sums(hist_p, ds, pb, P_PAD)
            hist_t = _bucket_sums(hist_t, ds, tb, NT_PAD)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PREC)
    return dq, hist_p, hist_t


@triton.jit
def _dq_tile(Q, K, V, DO, LSE, DELTA, O, DQ, Q_OFF, KV_OFF, NT, BIAS, DBIAS, b, m0, h,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
             stride_ot, stride_oh,
             stride_dqt, stride_dqh, stride_lh, stride_bb, stride_bh, stride_bi, stride_bj,
             stride_dbb, stride_dbh, stride_dbi, stride_dbj, alpha, inv_n, D_QK, D_V,
             ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
             ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, Q_BCAST: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
             BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
             STORE_DBIAS: tl.constexpr, CONTEXT: tl.constexpr, FAST: tl.constexpr, STORE_DELTA: tl.constexpr,
             TMA: tl.constexpr, TQ, TK, PB_TAB, TTHR, PW, TW, DPW, DTW, n_pb, n_tb, REL: tl.constexpr,
             P_PAD: tl.constexpr, NT_PAD: tl.constexpr, prog):
    """dQ (and dbias) of query rows [m0, m0 + BLOCK_M) of sequence b, head h. softmax: with STORE_DELTA, delta =
    rowsum(o * dO) of these rows is computed here from o and written to DELTA for the dK/dV launch that runs after
    this one; else it is loaded from DELTA."""
    q_start, lq, kv_start, lk, n_hist = _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    q_row = q_start
    if Q_BCAST:
        q_row = q_start * 0

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < lq
    q = tl.load(Q + (q_row + offs_m[:, None]) * stride_qt + h * stride_qh + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + (q_start + offs_m[:, None]) * stride_dot + h * stride_doh + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if ACT == 0:
        alpha_s = alpha * 1.4426950408889634
        ds_scale = 1.0
        lse = tl.load(LSE + h * stride_lh + q_start + offs_m, mask=row_ok, other=float("inf"))
        if STORE_DELTA:
            o = tl.load(O + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :],
                        mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
            tl.store(DELTA + h * stride_lh + q_start + offs_m, delta, mask=row_ok)
        else:
            delta = tl.load(DELTA + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
    else:
        alpha_s = alpha
        ds_scale = inv_n
        lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        delta = lse
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh
    if TMA:
        k_base = _rows_desc(k_base, lk, stride_kt, BLOCK_N, BLOCK_DQK)
        v_base = _rows_desc(v_base, lk, stride_vt, BLOCK_N, BLOCK_DV)
    lo, hi, full_hi = _key_range(m0, lk, n_hist, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, BLOCK_M, BLOCK_N, CONTEXT)
    bias_base = BIAS + b.to(tl.int64) * stride_bb + h * stride_bh
    dbias_base = DBIAS + b.to(tl.int64) * stride_dbb + h * stride_dbh
    if REL:
        tq = tl.load(TQ + q_start + offs_m, mask=row_ok, other=0)
    else:
        tq = offs_m
    tk_base = TK + kv_start
    hist_p = tl.zeros([P_PAD], dtype=tl.float32)
    hist_t = tl.zeros([NT_PAD], dtype=tl.float32)
    dq, hist_p, hist_t = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk, n_hist,
        alpha_s, ds_scale, lo, full_hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj,
        dbias_base, stride_dbi, stride_dbj, tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb, hist_p, hist_t, ACT, False,
        CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, BLOCK_N, DOT_PREC, HAS_BIAS, STORE_DBIAS, CONTEXT, FAST, TMA, REL,
        P_PAD, NT_PAD)
    dq, hist_p, hist_t = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, offs_m, lq, lk, n_hist,
        alpha_s, ds_scale, full_hi, hi, offs_dk, offs_dv, D_QK, D_V, bias_base, stride_bi, stride_bj,
        dbias_base, stride_dbi, stride_dbj, tq, tk_base, PB_TAB, TTHR, PW, TW, n_tb, hist_p, hist_t, ACT, True,
        CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, BLOCK_N, DOT_PREC, HAS_BIAS, STORE_DBIAS, CONTEXT, FAST, TMA, REL,
        P_PAD, NT_PAD)
    if REL:  # this program's histograms (summed over its key tiles) to its own rows: no atomics, the host sums
        # the rows in a fixed order, so d pos_w / d ts_w are the same bits on every run
        row = prog.to(tl.int64)
        tl.store(DPW + row * P_PAD + tl.arange(0, P_PAD), hist_p * ds_scale)
        tl.store(DTW + row * NT_PAD + tl.arange(0, NT_PAD), hist_t * ds_scale)
    dq = dq * (alpha * ds_scale)
    tl.store(DQ + (q_start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_dk[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_dk[None, :] < D_QK))


@triton.jit
def _gdpa_bwd(Q, K, V, DO, LSE, DELTA, O, DK, DV, DQ, Q_OFF, KV_OFF, NT, WORK, BIAS, DBIAS, DS,
              TQ, TK, PB_TAB, TTHR, PW, TW, DPW, DTW,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
              stride_ot, stride_oh,
              stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh, stride_lh,
              stride_bb, stride_bh, stride_bi, stride_bj, stride_dbb, stride_dbh, stride_dbi, stride_dbj,
              stride_dsh, stride_dst, alpha, inv_n, n_tiles_k, n_tiles_q, D_QK, D_V, n_heads, n_pb, n_tb,
              ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
              ATT_BLOCK: tl.constexpr, WINDOW: tl.constexpr, Q_BCAST: tl.constexpr, PART: tl.constexpr,
              DK_BM: tl.constexpr, DK_BN: tl.constexpr, DQ_BM: tl.constexpr, DQ_BN: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr,
              HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr, CONTEXT: tl.constexpr, FAST: tl.constexpr,
              STORE_DELTA: tl.constexpr, HEADS_INNER: tl.constexpr, TMA: tl.constexpr, STORE_DS: tl.constexpr,
              REL: tl.constexpr, P_PAD: tl.constexpr, NT_PAD: tl.constexpr, NO_DK: tl.constexpr):
    """Backward work item WORK[pid]: with PART 1 a dK/dV key tile (b * n_tiles_k + tile), with PART 2 a dQ query
    tile (b * n_tiles_q + tile); each launch compiles one branch. LSE and DELTA are [H, T_out] fp32 (softmax):
    the forward's base-2 log-sum-exp and delta = rowsum(o * dO), written by the dQ launch (PART 2 with
    STORE_DELTA, which runs first) or by _bwd_delta. STORE_DBIAS is set for the launch that writes dbias (the dQ
    items', or the dK/dV items' with STORE_DS). Grid (items, H) or, with HEADS_INNER, (items * H,). REL: the
    in-kernel relative bias (see _gdpa_fwd); each dQ program writes its per-bucket sums of dS to its own row of
    DPW [programs, P_PAD] / DTW [programs, NT_PAD] fp32 (row = the program's linear id; zeroed by the host, which
    sums the rows: d pos_w / d ts_w without atomics, bit-reproducible; never with STORE_DS). NO_DK (PART 1 with
    STORE_DS, the regime's dk_from_ds): the dK/dV items accumulate dV only and leave dK to _gdpa_dk_ds."""
    w, h = _item_head(WORK, n_heads, HEADS_INNER)
    if w < 0:
        return
    if PART == 1:
        _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, Q_OFF, KV_OFF, NT, BIAS, DBIAS, w // n_tiles_k,
                   (w % n_tiles_k) * DK_BN, h, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
                   stride_bb, stride_bh, stride_bi, stride_bj, stride_dbb, stride_dbh, stride_dbi, stride_dbj,
                   alpha, inv_n, D_QK, D_V,
                   ACT, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, Q_BCAST, DK_BM, DK_BN, BLOCK_DQK, BLOCK_DV,
                   DOT_PREC, HAS_BIAS, CONTEXT, FAST, STORE_DBIAS, TMA, DS, stride_dsh, stride_dst, STORE_DS,
                   TQ, TK, PB_TAB, TTHR, PW, TW, n_tb, REL, NO_DK)
    else:
        _dq_tile(Q, K, V, DO, LSE, DELTA, O, DQ, Q_OFF, KV_OFF, NT, BIAS, DBIAS, w // n_tiles_q,
                 (w % n_tiles_q) * DQ_BM, h, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_ot, stride_oh, stride_dqt, stride_dqh, stride_lh, stride_bb, stride_bh,
                 stride_bi,
                 stride_bj, stride_dbb, stride_dbh, stride_dbi, stride_dbj, alpha, inv_n, D_QK, D_V,
                 ACT, CAUSAL, HAS_TARGETS, ATT_BLOCK, WINDOW, Q_BCAST, DQ_BM, DQ_BN, BLOCK_DQK, BLOCK_DV,
                 DOT_PREC, HAS_BIAS, STORE_DBIAS, CONTEXT, FAST, STORE_DELTA, TMA, TQ, TK, PB_TAB, TTHR, PW, TW,
                 DPW, DTW, n_pb, n_tb, REL, P_PAD, NT_PAD,
                 tl.program_id(0) if HEADS_INNER else tl.program_id(0) * n_heads + tl.program_id(1))


@triton.jit
def _dq_ds_inner(dq, ds_desc, k_base, stride_kt, offs_m, m0, offs_dk, lq, lk, n_hist, lo, hi, D_QK,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, CONTEXT: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        dst = ds_desc.load([n0, m0])  # [BLOCK_N, BLOCK_M]
        if TMA:
            k = k_base.load([n0, 0])
        else:
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_dk[None, :],
                        mask=(offs_n[:, None] < lk) & (offs_dk[None, :] < D_QK), other=0.0)
        if MASKED:  # pairs outside the mask may be unwritten memory: select, never multiply
            ok = _valid(offs_m[None, :], offs_n[:, None], lq, lk, n_hist, CAUSAL, HAS_TARGETS, 0, 0, CONTEXT)
            dst = tl.where(ok, dst, 0.0).to(k.dtype)
        dq = tl.dot(tl.trans(dst), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _gdpa_dq_ds(DS, K, DQ, Q_OFF, KV_OFF, NT, WORK,
                stride_dsh, stride_dst, stride_kt, stride_kh, stride_dqt, stride_dqh, dq_scale, n_tiles, D_QK,
                n_heads, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, CONTEXT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, DOT_PREC: tl.constexpr,
                HEADS_INNER: tl.constexpr, TMA: tl.constexpr):
    """dQ of query rows [m0, m0 + BLOCK_M) of one (sequence, head) from the dS^T the dK/dV launch stored
    (DS_STORE): dQ = dq_scale * sum over key tiles of dS K, one matmul per tile pair instead of the three of
    the recomputing dQ kernel (QK^T, dO V^T, dS K). Key tiles that hold pairs outside the mask are masked
    again here: the dK/dV programs wrote every valid pair (0 where masked) of the query tiles they visit, but
    this kernel's tiles may reach pairs none of them visited (unwritten memory). Grid as _gdpa_fwd."""
    w, h = _item_head(WORK, n_heads, HEADS_INNER)
    if w < 0:
        return
    b = w // n_tiles
    m0 = (w % n_tiles) * BLOCK_M
    q_start, lq, kv_start, lk, n_hist = _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    ds_desc = _ds_desc(DS, h, kv_start, lk, lq, stride_dsh, stride_dst, BLOCK_N, BLOCK_M)
    k_base = K + kv_start * stride_kt + h * stride_kh
    if TMA:
        k_base = _rows_desc(k_base, lk, stride_kt, BLOCK_N, BLOCK_DQK)
    lo, hi, full_hi = _key_range(m0, lk, n_hist, CAUSAL, HAS_TARGETS, 0, 0, BLOCK_M, BLOCK_N, CONTEXT)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    dq = _dq_ds_inner(dq, ds_desc, k_base, stride_kt, offs_m, m0, offs_dk, lq, lk, n_hist, lo, full_hi, D_QK,
                      False, CAUSAL, HAS_TARGETS, CONTEXT, BLOCK_N, DOT_PREC, TMA)
    dq = _dq_ds_inner(dq, ds_desc, k_base, stride_kt, offs_m, m0, offs_dk, lq, lk, n_hist, full_hi, hi, D_QK,
                      True, CAUSAL, HAS_TARGETS, CONTEXT, BLOCK_N, DOT_PREC, TMA)
    tl.store(DQ + (q_start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_dk[None, :],
             (dq * dq_scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < lq) & (offs_dk[None, :] < D_QK))


@triton.jit
def _dk_ds_inner(dk, ds_desc, q_base, stride_qt, offs_n, n0, offs_dk, lq, lk, n_hist, lo, hi, D_QK,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, CONTEXT: tl.constexpr,
                 BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        dst = ds_desc.load([n0, m0])  # [BLOCK_N, BLOCK_M]
        if TMA:
            q = q_base.load([m0, 0])
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_dk[None, :],
                        mask=(offs_m[:, None] < lq) & (offs_dk[None, :] < D_QK), other=0.0)
        if MASKED:  # pairs outside the mask may be unwritten memory: select, never multiply
            ok = _valid(offs_m[None, :], offs_n[:, None], lq, lk, n_hist, CAUSAL, HAS_TARGETS, 0, 0, CONTEXT)
            dst = tl.where(ok, dst, 0.0).to(q.dtype)
        dk = tl.dot(dst, q, dk, input_precision=DOT_PREC)
    return dk


@triton.jit
def _gdpa_dk_ds(DS, Q, DK, Q_OFF, KV_OFF, NT, WORK,
                stride_dsh, stride_dst, stride_qt, stride_qh, stride_dkt, stride_dkh, dk_scale, n_tiles, D_QK,
                n_heads, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, CONTEXT: tl.constexpr,
                Q_BCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                DOT_PREC: tl.constexpr, HEADS_INNER: tl.constexpr, TMA: tl.constexpr):
    """dK of key rows [n0, n0 + BLOCK_N) of one (sequence, head) from the dS^T the dK/dV launch stored with NO_DK
    (the regime's dk_from_ds): dK = dk_scale * sum over query tiles of dS^T Q, one matmul per tile pair -- the
    mirror of _gdpa_dq_ds, so the dK/dV launch holds one [BLOCK_N, Dv] accumulator instead of two. Query tiles
    holding pairs outside the mask are masked again here: the dK/dV programs wrote every valid pair (0 where
    masked) of the tiles they visited, but this kernel's tiles may reach pairs none of them visited (unwritten
    memory). Q_BCAST: the queries are PMA's seeds, shared by every sequence (rows from 0). Grid as the dK/dV
    launch's (WORK: a key-tile table)."""
    w, h = _item_head(WORK, n_heads, HEADS_INNER)
    if w < 0:
        return
    b = w // n_tiles
    n0 = (w % n_tiles) * BLOCK_N
    q_start, lq, kv_start, lk, n_hist = _seq_bounds(Q_OFF, KV_OFF, NT, b, HAS_TARGETS)
    q_row = q_start
    if Q_BCAST:
        q_row = q_start * 0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DQK)
    ds_desc = _ds_desc(DS, h, kv_start, lk, lq, stride_dsh, stride_dst, BLOCK_N, BLOCK_M)
    q_base = Q + q_row * stride_qt + h * stride_qh
    if TMA:
        q_base = _rows_desc(q_base, lq, stride_qt, BLOCK_M, BLOCK_DQK)
    lo, hi, full_lo = _query_range(n0, lq, n_hist, CAUSAL, HAS_TARGETS, 0, 0, BLOCK_M, BLOCK_N, CONTEXT)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dk = _dk_ds_inner(dk, ds_desc, q_base, stride_qt, offs_n, n0, offs_dk, lq, lk, n_hist, lo, full_lo, D_QK,
                      True, CAUSAL, HAS_TARGETS, CONTEXT, BLOCK_M, DOT_PREC, TMA)
    dk = _dk_ds_inner(dk, ds_desc, q_base, stride_qt, offs_n, n0, offs_dk, lq, lk, n_hist, full_lo, hi, D_QK,
                      False, CAUSAL, HAS_TARGETS, CONTEXT, BLOCK_M, DOT_PREC, TMA)
    tl.store(DK + (kv_start + offs_n[:, None]) * stride_dkt + h * stride_dkh + offs_dk[None, :],
             (dk * dk_scale).to(DK.dtype.element_ty), mask=(offs_n[:, None] < lk) & (offs_dk[None, :] < D_QK))


# ----------------------------------------------------------------------------------------------------------
# Host side: work tables, launchers, autograd
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    act: int
    causal: bool
    alpha: float
    inv_n: float
    att_block: int
    window: int
    q_bcast: bool
    max_q_len: int
    max_kv_len: int
    context: int = 0


@functools.lru_cache(maxsize=256)
def _spec(act: int, causal: bool, alpha: float, inv_n: float, att_block: int, window: int, q_bcast: bool,
          max_q_len: int, max_kv_len: int, context: int) -> _Spec:
    """One shared _Spec per distinct call configuration (a frozen dataclass costs a few us to build)."""
    return _Spec(act, causal, alpha, inv_n, att_block, window, q_bcast, max_q_len, max_kv_len, context)


def _work_table(tile_len: torch.Tensor, max_len: int, block: int, cost: torch.Tensor | None = None,
                total: int | None = None, grouped: int = 0) -> tuple[torch.Tensor, int]:
    """Sorted (sequence, tile) work items, computed on the device without a host sync.

    tile_len: [B] int64 length of the tiled axis of each sequence; max_len: bound on it (host int);
    block: tile size; cost: [B, n_tiles] relative cost of each item (default: 1). Returns (table [B *
    n_tiles] int32 holding ``b * n_tiles + tile`` sorted by decreasing cost, -1 for items past a
    sequence's end, which sort last), n_tiles). ``total`` (host int, = sum of tile_len) trims the table
    to ``total // block + B`` >= the number of valid items, so that few empty programs are launched
    (each still costs a block launch; without the bound a heavy-tailed batch launches ~10x too many).
    ``grouped`` (the config's seq_order_*): +1 / -1 orders whole sequences longest first and each sequence's
    tiles together, last tile first (+1: query tiles, whose causal cost grows with the tile index) or first tile
    first (-1: key tiles), instead of all items by cost: the programs running at once then share their
    sequence's keys / queries in L2 (one sequence-head's 128-row tiles each read the same key / value rows).
    """
    n_tiles = max(1, triton.cdiv(max_len, block))
    bsz = tile_len.numel()
    dev = tile_len.device
    t = torch.arange(n_tiles, device=dev, dtype=torch.int64)
    valid = (t[None, :] * block) < tile_len[:, None]
    if cost is None:
        cost = torch.ones((bsz, n_tiles), device=dev, dtype=torch.int64)
    if grouped:  # (length desc, sequence asc, tile in cost order): a sort key that fits int64 for any batch
        b_rank = (bsz - 1 - torch.arange(bsz, device=dev, dtype=torch.int64))
        t_rank = t if grouped > 0 else (n_tiles - 1 - t)
        cost = ((tile_len.clamp(min=0)[:, None] * bsz + b_rank[:, None]) * n_tiles + t_rank[None, :])
    key = torch.where(valid, cost, torch.full_like(cost, -1)).flatten()
    order = torch.argsort(key, descending=True, stable=True)
    ids = torch.arange(bsz * n_tiles, device=dev, dtype=torch.int64)
    table = torch.where(valid.flatten()[order], ids[order], torch.full_like(ids, -1))
    if total is not None:
        table = table[: max(1, min(table.numel(), total // block + bsz))]
    return table.to(torch.int32).contiguous(), n_tiles


def _q_tile_cost(spec: _Spec, lk: torch.Tensor, n_tiles: int, block_m: int) -> torch.Tensor:
    """Approximate key positions a query tile visits: [B, n_tiles] int64."""
    t = torch.arange(n_tiles, device=lk.device, dtype=torch.int64)
    if spec.att_block or spec.window:
        return torch.ones((lk.numel(), n_tiles), device=lk.device, dtype=torch.int64)
    if spec.causal:
        return torch.minimum((t[None, :] + 1) * block_m, lk[:, None])
    return lk[:, None].expand(-1, n_tiles).contiguous()


def _k_tile_cost(spec: _Spec, lq: torch.Tensor, n_tiles: int, block_n: int) -> torch.Tensor:
    t = torch.arange(n_tiles, device=lq.device, dtype=torch.int64)
    if spec.att_block or spec.window:
        return torch.ones((lq.numel(), n_tiles), device=lq.device, dtype=torch.int64)
    if spec.causal:
        return lq[:, None] - t[None, :] * block_n
    return lq[:, None].expand(-1, n_tiles).contiguous()


def _dot_prec(dtype: torch.dtype) -> str | None:
    # fp32 inputs: exact IEEE products (the tests' 1e-3 bound); bf16/fp16: Triton's default (tensor cores).
    return "ieee" if dtype == torch.float32 else None


# power-of-two tile width >= d (>= 16), in plain Python (triton.next_power_of_2 costs ~10 us a call through its
# JIT wrapper on the host): the config's own rule
_block_d = kconfig._pow2


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(batch, head, row, col) strides of a [B, n1, n2] (head stride 0) or [B, H, n1, n2] bias."""
    if bias is None:
        return (0, 0, 0, 0)
    if bias.dim() == 3:
        return (bias.stride(0), 0, bias.stride(1), bias.stride(2))
    return tuple(bias.stride())


def _q_table(spec: _Spec, q_off: torch.Tensor, kv_off: torch.Tensor, bm: int, t_q: int,
             grouped: bool = False) -> tuple[torch.Tensor, int]:
    """Cached work table of query tiles (fwd and dQ kernels); t_q = number of output rows; grouped: tiles of a
    sequence together (seq_order)."""
    def make():
        lq = q_off[1:] - q_off[:-1]
        lk = kv_off[1:] - kv_off[:-1]
        n_tiles = max(1, triton.cdiv(spec.max_q_len, bm))
        return _work_table(lq, spec.max_q_len, bm, _q_tile_cost(spec, lk, n_tiles, bm), total=t_q,
                           grouped=1 if grouped else 0)

    return _cached((q_off, kv_off), ("q", bm, spec.max_q_len, spec.max_kv_len, spec.causal,
                                     spec.att_block, spec.window, t_q, grouped), make)


def _k_table(spec: _Spec, q_off: torch.Tensor, kv_off: torch.Tensor, bn: int, t_k: int,
             grouped: bool = False) -> tuple[torch.Tensor, int]:
    """Cached work table of key tiles (dK/dV kernel); t_k = number of key rows; grouped: see _q_table."""
    def make():
        lq = q_off[1:] - q_off[:-1]
        lk = kv_off[1:] - kv_off[:-1]
        n_tiles = max(1, triton.cdiv(spec.max_kv_len, bn))
        return _work_table(lk, spec.max_kv_len, bn, _k_tile_cost(spec, lq, n_tiles, bn), total=t_k,
                           grouped=-1 if grouped else 0)

    return _cached((q_off, kv_off), ("k", bn, spec.max_q_len, spec.max_kv_len, spec.causal,
                                     spec.att_block, spec.window, t_k, grouped), make)


@triton.jit
def _bwd_delta(O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh, D_V,
               BLOCK_T: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta[h, t] = sum_d o[t, h, d] * do[t, h, d] in fp32 (softmax backward) into DELTA [H, T] (row stride
    stride_lh; grid (cdiv(T, BLOCK_T), H))."""
    h = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_DV)
    m = (offs_t[:, None] < T) & (offs_d[None, :] < D_V)
    o = tl.load(O + offs_t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=m, other=0.0)
    do = tl.load(DO + offs_t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=m, other=0.0)
    tl.store(DELTA + h * stride_lh + offs_t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_t < T)


@functools.lru_cache(maxsize=16)
def _tma_device(device: torch.device) -> bool:
    """Whether ``device`` can run the TMA tile loads (Hopper or newer; the interpreter emulates them)."""
    if _interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the device-made tensor descriptors (Triton asks its allocator per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(rc: kconfig.RegimeConfig, even_d: bool, spec: _Spec, *xs: torch.Tensor) -> bool:
    """The regime's tma_loads where the pattern and tensors allow it: full attention rows (no block / window:
    their loops visit one or two tiles, too few to repay making the descriptors; run 9 measured block attention
    19% slower with them), head dims equal to the tile width (``even_d``), rows and heads 16-byte aligned (TMA's
    global address and stride rule). When True it also sets Triton's allocator (a context variable: the
    backward runs in autograd's own thread, so it is set per call, not once)."""
    if not (rc.tma_loads and even_d and not spec.att_block and not spec.window and _tma_device(xs[0].device)):
        return False
    for x in xs:
        es = x.element_size()
        if x.data_ptr() % 16 or (x.stride(0) * es) % 16 or (x.stride(1) * es) % 16 or (x.shape[2] * es) % 16:
            return False
    triton.set_allocator(_scratch)
    return True


def _ds_width(max_q_len: int) -> int:
    """Row width W of the DS_STORE buffer: max_q_len rounded up to 64 elements (128-byte rows in 16-bit)."""
    return max(64, -(-max_q_len // 64) * 64)


def _ds_buffer(shape: tuple, like: torch.Tensor, nan: bool = False) -> torch.Tensor:
    """The DS_STORE scratch, uninitialized (``nan``: filled with NaN, the config's ds_scratch_nan)."""
    if nan:
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    return like.new_empty(shape)


@functools.lru_cache(maxsize=16)
def _device_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def _use_ds_store(rc: kconfig.RegimeConfig, spec: _Spec, h: int, t_k: int, q: torch.Tensor,
                  cfg: KernelConfig) -> bool:
    """The regime's ds_store where it applies: full attention rows, tensor descriptors on the device, and a dS
    buffer of at most cfg.ds_max_bytes and cfg.ds_max_fraction of the device's memory."""
    if not rc.ds_store or spec.att_block or spec.window or not _tma_device(q.device):
        return False
    nbytes = h * t_k * _ds_width(spec.max_q_len) * q.element_size()
    cap = _device_bytes(q.device)
    return nbytes <= cfg.ds_max_bytes and (cap == 0 or nbytes <= cfg.ds_max_fraction * cap)


def _plain_rows(spec: _Spec, nt, bias) -> bool:
    """Whether a call attends over plain full rows (no targets, bias, contextual prefix, block, window or PMA's
    broadcast queries): the only calls the Gluon kernels take."""
    return (nt is None and bias is None and not spec.context and not spec.att_block and not spec.window
            and not spec.q_bcast)


def _use_ws_fwd(rc: kconfig.RegimeConfig, spec: _Spec, nt, bias, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> bool:
    """Whether a warp-specialized forward takes the call (ws_attention.eligible): softmax where the regime's ws_fwd
    is on (ws_attention.forward), silu where its ws_fwd_silu is and its ws_fwd_silu_tiles fit the head dim
    (ws_attention.forward_silu); full rows, no targets / bias / prefix / block / window / PMA, on an sm_90 GPU (not
    the interpreter)."""
    if ws is None or _interpreting():
        return False
    if spec.act == 0:
        on = rc.ws_fwd
    else:
        on = spec.act == 1 and rc.ws_fwd_silu and ws.silu_tiles_fit(q.shape[2], rc.ws_fwd_silu_tiles)
    return on and ws.eligible(q, k, v, spec.act, _plain_rows(spec, nt, bias))


def _use_ws_bwd(rc: kconfig.RegimeConfig, spec: _Spec, nt, bias, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, do: torch.Tensor) -> bool:
    """The regime's ws_bwd where the warp-specialized dV + dS^T launch takes the call (ws_attention.eligible_bwd):
    silu over full rows, no targets / bias / prefix / block / window / PMA, on an sm_90 GPU (not the interpreter)."""
    if ws is None or not rc.ws_bwd or _interpreting():
        return False
    return ws.eligible_bwd(q, k, v, do, spec.act, _plain_rows(spec, nt, bias))


def _fast_act(dtype: torch.dtype, cfg: KernelConfig) -> bool:
    """tanh.approx silu (one MUFU op per score) for 16-bit inputs on CUDA; exact path for fp32 and the
    interpreter (which cannot run inline PTX)."""
    return cfg.fast_act and dtype != torch.float32 and not _interpreting()


# ----------------------------------------------------------------------------------------------------------
# The in-kernel relative bias (HSTU rab^{p,t}): its lookup tables, made on the host once per shape and device
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _pos_bucket_table(n_pb: int, bucket_max_len: int, n: int, device: torch.device) -> torch.Tensor:
    """[max(n, 1)] int32: the position bucket of each distance |i - j| < n, by ``reference.position_bucket_ref``
    itself on ``device`` (so the kernel's buckets are the reference's, bit for bit)."""
    from gemray.kernels.reference import position_bucket_ref

    d = torch.arange(max(n, 1), device=device, dtype=torch.int64)
    return position_bucket_ref(d, n_pb, bucket_max_len).to(torch.int32).contiguous()


_INT64_MAX = 2 ** 63 - 1


@functools.lru_cache(maxsize=32)
def _time_thresholds(n_tb: int, device: torch.device) -> torch.Tensor:
    """[n_tb + 1] int64: thr[b] = the smallest |dt| (integer seconds) that ``reference.time_bucket_ref`` puts in
    bucket >= b (thr[0] = 0), int64 max for buckets no |dt| < 2^62 reaches and as the end sentinel thr[n_tb]. Found
    by a bisection over the reference function itself on ``device`` (it is non-decreasing in |dt|), so ``the
    largest b with |dt| >= thr[b]`` is exactly its bucket."""
    from gemray.kernels.reference import time_bucket_ref

    want = torch.arange(n_tb, device=device, dtype=torch.int64)
    lo = torch.zeros(n_tb, device=device, dtype=torch.int64)  # bucket(lo) < want (for want >= 1)
    top = 2 ** 62
    hi = torch.full((n_tb,), top, device=device, dtype=torch.int64)
    for _ in range(64):
        mid = lo + (hi - lo) // 2
        up = time_bucket_ref(mid, n_tb) >= want
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
        if bool(((hi - lo) <= 1).all()):
            break
    reached = time_bucket_ref(hi, n_tb) >= want
    thr = torch.where(reached, hi, torch.full_like(hi, _INT64_MAX))
    thr[0] = 0
    return torch.cat([thr, thr.new_full((1,), _INT64_MAX)]).contiguous()


_INT32_SAT = 2 ** 31 - 2  # the int32 bucket search's saturation of |dt| (below the table's sentinel 2^31 - 1)


@functools.lru_cache(maxsize=32)
def _kernel_thresholds(n_tb: int, device: torch.device) -> torch.Tensor:
    """The TTHR table the kernels get: :func:`_time_thresholds` as int32 (saturated at 2^31 - 1, the sentinel)
    when its last real threshold thr[n_tb - 1] <= 2^31 - 2 -- then the kernels' int32 search is exact for every
    int64 time difference (see _rel_bias) --, else the int64 table. One host read per (n_tb, device)."""
    thr = _time_thresholds(n_tb, device)
    if int(thr[n_tb - 1]) <= _INT32_SAT:
        return thr.clamp(max=_INT32_SAT + 1).to(torch.int32).contiguous()
    return thr


@dataclass(frozen=True)
class RelBias:
    """The in-kernel HSTU relative bias of a self-attention call (``gdpa_triton(rel_bias=...)``): bias(i, j) =
    pos_w[position_bucket(|i - j|, P, max_len)] + ts_w[time_bucket(query_times[i] - key_times[j], NT)], the
    bucketing of ``gemray.kernels.reference.position_bucket_ref`` / ``time_bucket_ref`` (as
    ``gemray.ops.relative_bias_buckets``), shared by all heads, added to the scaled logits.

    query_times / key_times: [T] int64 seconds (the query time tq of each position, e.g. the next item's, and each
    key's own timestamp); pos_w: [P] float; ts_w: [NT] float (differentiable: the backward sums dS per bucket);
    max_len: the N of the position bucketing."""

    query_times: torch.Tensor
    key_times: torch.Tensor
    pos_w: torch.Tensor
    ts_w: torch.Tensor
    max_len: int


def _pad_buckets(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _rel_tensors(rel: tuple | None, max_q_len: int, dummy: torch.Tensor) -> list:
    """The kernels' REL tensor arguments [TQ, TK, PB_TAB, TTHR, PW, TW] (``dummy`` six times without a bias).
    rel: (query_times, key_times, pos_w, ts_w, max_len)."""
    if rel is None:
        return [dummy] * 6
    tq, tk, pw, tw, bucket_len = rel
    return [tq, tk, _pos_bucket_table(pw.numel(), int(bucket_len), int(max_q_len), tq.device),
            _kernel_thresholds(tw.numel(), tq.device), pw, tw]


@dataclass(eq=False)
class _FwdPlan:
    """What a forward call launches, decided once per batch and call configuration (:func:`_fwd_plan`).

    reg: the batch's regime; ws: (tiles, work table, tiles per sequence) when the Gluon softmax forward runs the
    call, (tiles, work table, tiles per sequence, tanh.approx silu) when the Gluon silu forward does, else None;
    launch: (_Launch of _gdpa_fwd, its work table) or None (Gluon); tma: the launch makes tensor
    descriptors on the device, so Triton's allocator is set first; bwd: the backward plans made from this one
    (:func:`_bwd_plan`)."""
    reg: str
    ws: tuple | None
    launch: tuple | None
    tma: bool
    bwd: dict


@dataclass(eq=False)
class _BwdPlan:
    """What a backward call launches and allocates, decided once per forward plan and gradient layout.

    dbias_shape: the fp32 [B, H, n1, n2] dbias buffer (zeroed) or None; ds_shape: the DS_STORE scratch [H, Tk, W]
    or None; tma: set Triton's allocator first; delta: the _bwd_delta launch or None; steps: ((_Launch, work
    table, kind), ...) in launch order, kind "bwd" (a _gdpa_bwd launch), "dq_ds" or "dk_ds" (the launches that
    read the dS scratch, each with its own tensor list);
    rel_rows: with the in-kernel relative bias, the dQ launch's program count = the rows of its d pos_w / d ts_w
    partial sums (0 without)."""
    dbias_shape: tuple | None
    ds_shape: tuple | None
    tma: bool
    delta: _Launch | None
    steps: tuple
    rel_rows: int = 0


def _fwd_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              q_off: torch.Tensor, kv_off: torch.Tensor, nt: torch.Tensor | None, spec: _Spec,
              t_out: int, cfg: KernelConfig, rel: tuple | None = None) -> _FwdPlan:
    """The cached forward plan of a call, keyed on the offsets / num_targets objects (as the work tables), the
    spec, the shapes, strides, dtype, device and 16-byte alignment of q / k / v, the bias's layout, dtype and
    alignment, and the config's name (another config: another plan). Making a plan also checks the batch
    (_check_batch), so a batch is checked once per configuration, not per call."""
    key = ("fwd plan", cfg.name, spec, t_out, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
           q.dtype, q.device, q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.data_ptr() % 16 == 0),
           None if rel is None else (rel[2].numel(), rel[3].numel()))

    def make():
        _check_batch(q_off, kv_off, nt, bias, t_out, k.shape[0], spec.max_q_len, spec.max_kv_len)
        return _make_fwd_plan(q, k, v, bias, q_off, kv_off, nt, spec, t_out, cfg, rel)

    return _cached((q_off, kv_off, nt), key, make)


def _make_fwd_plan(q, k, v, bias, q_off, kv_off, nt, spec: _Spec, t_out: int, cfg: KernelConfig,
                   rel: tuple | None = None) -> _FwdPlan:
    h = k.shape[1]
    d_qk, d_v = q.shape[2], v.shape[2]
    bdk, bdv = _block_d(d_qk), _block_d(d_v)
    reg = cfg.regime_of(t_out, q_off.numel() - 1)
    rc = cfg.regime(reg)
    if rel is None and _use_ws_fwd(rc, spec, nt, bias, q, k, v):  # Hopper: warp-specialized forward (Gluon)
        if spec.act == 0:
            table, n_tiles = _q_table(spec, q_off, kv_off, ws.block_m(rc.ws_tiles), t_out,
                                      grouped=cfg.seq_order_fwd)
            return _FwdPlan(reg, (rc.ws_tiles, table, n_tiles), None, False, {})
        table, n_tiles = _q_table(spec, q_off, kv_off, ws.SILU_ROWS, t_out, grouped=cfg.seq_order_fwd)
        return _FwdPlan(reg, (rc.ws_fwd_silu_tiles, table, n_tiles, _fast_act(q.dtype, cfg)), None, False, {})
    even_d = bdk == d_qk and bdv == d_v
    # o is allocated contiguous [T_out, H, Dv]; softmax's lse is [H, T_out] (pointwise activations: o stands in)
    o_strides, stride_lh = (h * d_v, d_v), (t_out if spec.act == 0 else 0)
    bm, bn, warps, stages = _tiles("fwd_silu" if spec.act == 1 else "fwd", d_qk, reg, spec.max_q_len, cfg,
                                   d_v=d_v, rel=rel is not None, elem_bytes=q.element_size(), device=q.device)
    table, n_tiles = _q_table(spec, q_off, kv_off, bm, t_out, cfg.seq_order_fwd)
    inner = rc.heads_inner
    tma = _use_tma(rc, even_d, spec, k, v)
    launch = _Launch(_gdpa_fwd, (table.numel() * h,) if inner else (table.numel(), h), [
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *o_strides, stride_lh, *_bias_strides(bias),
        spec.alpha, spec.inv_n, n_tiles, d_qk, d_v, h, 0 if rel is None else rel[3].numel()], dict(
        ACT=spec.act, CAUSAL=spec.causal, HAS_TARGETS=nt is not None, ATT_BLOCK=spec.att_block,
        WINDOW=spec.window, Q_BCAST=spec.q_bcast, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DQK=bdk, BLOCK_DV=bdv, EVEN_D=even_d, DOT_PREC=_dot_prec(q.dtype), HAS_BIAS=bias is not None,
        CONTEXT=spec.context, FAST=_fast_act(q.dtype, cfg), HEADS_INNER=inner, TMA=tma, REL=rel is not None),
        warps, stages, cfg.direct_launch)
    return _FwdPlan(reg, None, (launch, table), tma, {})


def _bwd_plan(fwd: _FwdPlan, q, k, v, bias, do, q_off, kv_off, nt, spec: _Spec, want_dbias: bool,
              ds_ok: bool, cfg: KernelConfig, rel: tuple | None = None) -> _BwdPlan:
    """The cached backward plan of a call, kept on its forward plan (made for the same config) by dO's strides,
    dtype and alignment, whether dbias is wanted and whether the DS_STORE scratch may be used (``ds_ok``: False
    after its allocation failed)."""
    key = (do.stride(), do.dtype, do.data_ptr() % 16 == 0, want_dbias, ds_ok)
    plan = fwd.bwd.get(key)
    if plan is None:
        plan = fwd.bwd[key] = _make_bwd_plan(fwd, q, k, v, bias, do, q_off, kv_off, nt, spec, want_dbias, ds_ok,
                                             cfg, rel)
    return plan


def _make_bwd_plan(fwd: _FwdPlan, q, k, v, bias, do, q_off, kv_off, nt, spec: _Spec, want_dbias: bool,
                   ds_ok: bool, cfg: KernelConfig, rel: tuple | None = None) -> _BwdPlan:
    reg = fwd.reg
    rc = cfg.regime(reg)
    h = k.shape[1]
    d_qk, d_v = q.shape[2], v.shape[2]
    bdk, bdv = _block_d(d_qk), _block_d(d_v)
    t_out = do.shape[0]
    softmax = spec.act == 0
    # softmax reads o (contiguous) and lse / delta [H, T_out]; the pointwise activations read neither: dO stands in
    o_strides, stride_lh = ((h * d_v, d_v), t_out) if softmax else (do.stride()[:2], 0)
    # the in-kernel relative bias sums dS per bucket in the recomputing dQ kernel: no ds_store with it
    ds_store = ds_ok and rel is None and _use_ds_store(rc, spec, h, k.shape[0], q, cfg)
    # dS^T [H, Tk, W]: every entry the dQ launch reads unmasked is written by the dK/dV launch
    ds_shape = (h, k.shape[0], _ds_width(spec.max_q_len)) if ds_store else None

    def grid(n_items: int, inner: bool) -> tuple:  # inner: (items * H,), head fastest, instead of (items, H)
        return (n_items * h,) if inner else (n_items, h)

    delta = None
    if softmax and ds_store:  # no dQ launch before dK/dV to write delta: its own launch
        delta = _Launch(_bwd_delta, (-(-t_out // 64), h), [t_out, *o_strides, *do.stride()[:2], stride_lh, d_v],
                        dict(BLOCK_T=64, BLOCK_DV=bdv), 4, 3, cfg.direct_launch)
    # the gradients' layouts as the backward allocates them: dk / dv like k / v, dq like q (contiguous for PMA's
    # per-sequence dQ), dbias and dS contiguous
    dk_strides = torch.empty_like(k, device="meta").stride()[:2]
    dv_strides = torch.empty_like(v, device="meta").stride()[:2]
    dq_strides = (h * d_qk, d_qk) if spec.q_bcast else torch.empty_like(q, device="meta").stride()[:2]
    dbias_shape = (bias.shape[0], h, bias.shape[-2], bias.shape[-1]) if want_dbias else None
    dbias_strides = (h * dbias_shape[2] * dbias_shape[3], dbias_shape[2] * dbias_shape[3], dbias_shape[3], 1) \
        if want_dbias else (0, 0, 0, 0)
    ds_strides = (ds_shape[1] * ds_shape[2], ds_shape[2]) if ds_store else (0, 0)
    args = [*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2], *o_strides, *dk_strides,
            *dv_strides, *dq_strides, stride_lh, *_bias_strides(bias), *dbias_strides, *ds_strides,
            spec.alpha, spec.inv_n, 1, 1, d_qk, d_v, h,
            0 if rel is None else rel[2].numel(), 0 if rel is None else rel[3].numel()]
    even_d = bdk == d_qk and bdv == d_v
    use_tma = _use_tma(rc, even_d, spec, q, k, v, do)
    consts = dict(ACT=spec.act, CAUSAL=spec.causal, HAS_TARGETS=nt is not None, HAS_BIAS=bias is not None,
                  ATT_BLOCK=spec.att_block, WINDOW=spec.window, Q_BCAST=spec.q_bcast, CONTEXT=spec.context,
                  BLOCK_DQK=bdk, BLOCK_DV=bdv, DOT_PREC=_dot_prec(q.dtype), FAST=_fast_act(q.dtype, cfg),
                  HEADS_INNER=rc.heads_inner, TMA=use_tma, REL=rel is not None,
                  P_PAD=_pad_buckets(0 if rel is None else rel[2].numel()),
                  NT_PAD=_pad_buckets(0 if rel is None else rel[3].numel()))

    def bwd(table, items: tuple, warps: int, stages: int, **part) -> tuple:  # a _gdpa_bwd launch
        a = list(args)
        a[-7:-5] = items  # (n_tiles_k, n_tiles_q)
        return _Launch(_gdpa_bwd, grid(table.numel(), rc.heads_inner), a, dict(**part, **consts), warps, stages,
                       cfg.direct_launch), table, "bwd"

    fit = dict(d_v=d_v, rel=rel is not None, elem_bytes=q.element_size(), device=q.device)  # _tiles' smem fit
    steps, rel_rows = [], 0
    if ds_store:  # dK/dV (also storing dS^T), then dQ = dS K (and, dk_from_ds, dK = dS^T Q) from the stored tiles
        ds_scale = spec.alpha * (1.0 if softmax else spec.inv_n)
        ws_path = rc.dk_from_ds and not want_dbias and _use_ws_bwd(rc, spec, nt, bias, q, k, v, do)
        if ws_path:
            table, ntk = _k_table(spec, q_off, kv_off, ws.BWD_KEYS, k.shape[0], grouped=cfg.seq_order_dkdv)
            # the step holds the launch's arguments: ws.backward_dv_ds is looked up when it runs
            steps.append((dict(n_tiles_k=ntk, causal=spec.causal, alpha=spec.alpha, inv_n=spec.inv_n,
                               tiles=rc.ws_bwd_tiles, fast=consts["FAST"]), table, "ws_dv_ds"))
        else:
            kbm, kbn, kwarps, kstages = _tiles("dkdv_ds", d_qk, reg, spec.max_q_len, cfg, **fit)
            table, ntk = _k_table(spec, q_off, kv_off, kbn, k.shape[0], grouped=cfg.seq_order_dkdv)
            steps.append(bwd(table, (ntk, 1), kwarps, kstages, PART=1, DK_BM=kbm, DK_BN=kbn, DQ_BM=0, DQ_BN=0,
                             STORE_DBIAS=want_dbias, STORE_DELTA=False, STORE_DS=True, NO_DK=rc.dk_from_ds))
        if ws_path and rc.ws_dkdq:  # the Gluon products read only what ws_dv_ds wrote (ws.ds_gemm)
            qtable, ntq = _q_table(spec, q_off, kv_off, ws.BWD_KEYS, t_out, grouped=cfg.seq_order_dq)
            gemm = dict(causal=spec.causal, scale=ds_scale, stages=rc.ws_dkdq_stages)
            steps.append((dict(n_tiles=ntq, dq=True, **gemm), qtable, "ws_dq"))
            steps.append((dict(n_tiles=ntk, dq=False, **gemm), table, "ws_dk"))  # ws_dv_ds's key tiles
        else:
            qbm, qbn, qwarps, qstages = _tiles("dq_ds", d_qk, reg, spec.max_q_len, cfg, **fit)
            table, ntq = _q_table(spec, q_off, kv_off, qbm, t_out, grouped=cfg.seq_order_dq)
            steps.append((_Launch(_gdpa_dq_ds, grid(table.numel(), rc.heads_inner), [
                *ds_strides, *k.stride()[:2], *dq_strides, ds_scale, ntq, d_qk, h],
                dict(CAUSAL=spec.causal, HAS_TARGETS=nt is not None, CONTEXT=spec.context, BLOCK_M=qbm,
                     BLOCK_N=qbn, BLOCK_DQK=bdk, DOT_PREC=consts["DOT_PREC"], HEADS_INNER=rc.heads_inner,
                     TMA=use_tma),
                qwarps, qstages, cfg.direct_launch), table, "dq_ds"))
            if rc.dk_from_ds:
                dbm, dbn, dwarps, dstages = _tiles("dk_ds", d_qk, reg, spec.max_q_len, cfg, **fit)
                table, ntk = _k_table(spec, q_off, kv_off, dbn, k.shape[0], grouped=cfg.seq_order_dkdv)
                steps.append((_Launch(_gdpa_dk_ds, grid(table.numel(), rc.heads_inner), [
                    *ds_strides, *q.stride()[:2], *dk_strides, ds_scale, ntk, d_qk, h],
                    dict(CAUSAL=spec.causal, HAS_TARGETS=nt is not None, CONTEXT=spec.context,
                         Q_BCAST=spec.q_bcast, BLOCK_M=dbm, BLOCK_N=dbn, BLOCK_DQK=bdk, DOT_PREC=consts["DOT_PREC"],
                         HEADS_INNER=rc.heads_inner, TMA=use_tma),
                    dwarps, dstages, cfg.direct_launch), table, "dk_ds"))
    else:  # two launches: dQ first (it writes softmax's delta), then dK/dV (reads it)
        qbm, qbn, qwarps, qstages = _tiles("dq", d_qk, reg, spec.max_q_len, cfg, **fit)
        table, ntq = _q_table(spec, q_off, kv_off, qbm, t_out)
        # the other part's tile sizes are unused (pruned branch): 0 keeps one compiled variant per config
        steps.append(bwd(table, (1, ntq), qwarps, qstages, PART=2, DK_BM=0, DK_BN=0, DQ_BM=qbm, DQ_BN=qbn,
                         STORE_DBIAS=want_dbias, STORE_DELTA=softmax, STORE_DS=False, NO_DK=False))
        rel_rows = table.numel() * h if rel is not None else 0  # one row per dQ program (grid items x H)
        kbm, kbn, kwarps, kstages = _tiles("dkdv", d_qk, reg, spec.max_q_len, cfg, **fit)
        table, ntk = _k_table(spec, q_off, kv_off, kbn, k.shape[0])
        steps.append(bwd(table, (ntk, 1), kwarps, kstages, PART=1, DK_BM=kbm, DK_BN=kbn, DQ_BM=0, DQ_BN=0,
                         STORE_DBIAS=False, STORE_DELTA=False, STORE_DS=False, NO_DK=False))
    return _BwdPlan(dbias_shape, ds_shape, use_tma or ds_store, delta, tuple(steps), rel_rows)


# ----------------------------------------------------------------------------------------------------------
# The two halves of a call (shared by the custom ops and the eager autograd.Function)
# ----------------------------------------------------------------------------------------------------------


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, q_off: torch.Tensor,
             kv_off: torch.Tensor, nt: torch.Tensor | None, spec: _Spec, t_out: int, cfg: KernelConfig,
             plan: _FwdPlan | None, rel: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a forward: (o [T_out, H, Dv] in q's dtype, lse [H, T_out] fp32 (base 2) for softmax, else None).
    ``plan``: the call's forward plan (None for an empty batch: o = 0, lse = +inf); ``rel``: the in-kernel
    relative bias (query_times, key_times, pos_w, ts_w, max_len) or None."""
    h = k.shape[1]
    softmax = spec.act == 0
    if plan is None:
        o = q.new_zeros((t_out, h, v.shape[2]))
        lse = torch.full((h, t_out), float("inf"), device=q.device, dtype=torch.float32) if softmax else None
        return o, lse
    o = q.new_empty((t_out, h, v.shape[2]))
    lse = torch.empty((h, t_out), device=q.device, dtype=torch.float32) if softmax else None
    if plan.ws is not None:
        if softmax:
            tiles, table, n_tiles = plan.ws
            ws.forward(q, k, v, o, lse, q_off, kv_off, table, n_tiles, spec.causal, spec.alpha, tiles)
        else:
            tiles, table, n_tiles, fast = plan.ws
            ws.forward_silu(q, k, v, o, q_off, kv_off, table, n_tiles, spec.causal, spec.alpha, spec.inv_n, tiles,
                            fast=fast)
        return o, lse
    if plan.tma:
        triton.set_allocator(_scratch)  # a context variable: set per call
    launch, table = plan.launch
    launch.planned([q, k, v, o, lse if lse is not None else o, q_off, kv_off, nt if nt is not None else q_off,
                    table, bias if bias is not None else q, *_rel_tensors(rel, spec.max_q_len, q_off)])
    return o, lse


def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None,
              lse: torch.Tensor | None, bias: torch.Tensor | None, q_off: torch.Tensor, kv_off: torch.Tensor,
              nt: torch.Tensor | None, spec: _Spec, want_dbias: bool, cfg: KernelConfig,
              plan: _FwdPlan | None, rel: tuple | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, tuple | None]:
    """Run a backward: (dq like q, dk like k, dv like v, dbias like bias or None, (d pos_w, d ts_w) like the
    weights with ``rel``, else None). o / lse: the forward's (softmax; None for the pointwise activations);
    ``plan``: the forward's plan (None: empty batch, zeros); ``rel``: as :func:`_forward`'s."""
    if plan is None:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros_like(bias) if want_dbias else None,
                None if rel is None else (torch.zeros_like(rel[2]), torch.zeros_like(rel[3])))
    if do.stride(-1) != 1:
        do = do.contiguous()
    bplan = _bwd_plan(plan, q, k, v, bias, do, q_off, kv_off, nt, spec, want_dbias, True, cfg, rel)
    ds = None
    if bplan.ds_shape is not None:
        try:
            ds = _ds_buffer(bplan.ds_shape, q, cfg.ds_scratch_nan)
        except torch.OutOfMemoryError:  # under the caps but not free now: recompute dS instead
            log.warning("gdpa backward: no memory for the %.2f GiB dS buffer, recomputing dS (ds_store)",
                        math.prod(bplan.ds_shape) * q.element_size() / 2**30)
            bplan = _bwd_plan(plan, q, k, v, bias, do, q_off, kv_off, nt, spec, want_dbias, False, cfg, rel)
    if bplan.tma:
        triton.set_allocator(_scratch)  # its tensor descriptors are made on the device (autograd's thread)
    h, d_qk = k.shape[1], q.shape[2]
    t_out = do.shape[0]
    if spec.act == 0:
        delta = torch.empty_like(lse)
    else:  # o, lse and delta are not read by the pointwise activations: do stands in for their pointers
        o = lse = delta = do
    if bplan.delta is not None:
        bplan.delta.planned([o, do, delta])
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = q.new_empty((t_out, h, d_qk)) if spec.q_bcast else torch.empty_like(q)
    # dbias per head, fp32, zero where no program writes (pairs outside the mask / key range)
    dbias = (torch.zeros(bplan.dbias_shape, device=q.device, dtype=torch.float32)
             if bplan.dbias_shape is not None else None)
    ntarg = nt if nt is not None else q_off
    # d pos_w / d ts_w: fp32 sums of dS per bucket, one row per dQ program (padded to P_PAD / NT_PAD buckets),
    # summed here in row order: no atomics, the same bits on every run
    if rel is not None:
        dpw = torch.zeros((bplan.rel_rows, _pad_buckets(rel[2].numel())), device=q.device, dtype=torch.float32)
        dtw = torch.zeros((bplan.rel_rows, _pad_buckets(rel[3].numel())), device=q.device, dtype=torch.float32)
    else:
        dpw = dtw = q_off
    tensors = [q, k, v, do, lse, delta, o, dk, dv, dq, q_off, kv_off, ntarg, None, bias if bias is not None else q,
               dbias if dbias is not None else q, ds if ds is not None else q,
               *_rel_tensors(rel, spec.max_q_len, q_off), dpw, dtw]
    for launch, table, kind in bplan.steps:
        if kind == "dq_ds":
            launch.planned([ds, k, dq, q_off, kv_off, ntarg, table])
        elif kind == "dk_ds":
            launch.planned([ds, q, dk, q_off, kv_off, ntarg, table])
        elif kind == "ws_dv_ds":
            ws.backward_dv_ds(q, k, v, do, dv, ds, q_off, kv_off, table, **launch)
        elif kind == "ws_dq":
            ws.ds_gemm(ds, k, dq, q_off, kv_off, table, **launch)
        elif kind == "ws_dk":
            ws.ds_gemm(ds, q, dk, q_off, kv_off, table, **launch)
        else:
            tensors[13] = table
            launch.planned(tensors)
    if spec.q_bcast:
        dq = dq.view(-1, q.shape[0], h, d_qk).sum(0, dtype=torch.float32).to(q.dtype)
    if dbias is not None:
        dbias = (dbias if bias.dim() == 4 else dbias.sum(1)).to(bias.dtype)
    drel = None if rel is None else (dpw.sum(0)[:rel[2].numel()].to(rel[2].dtype),
                                     dtw.sum(0)[:rel[3].numel()].to(rel[3].dtype))
    return dq, dk, dv, dbias, drel


def _spec_of(activation: str, causal: bool, alpha: float, inv_n: float, block_size: int, window: int,
             q_broadcast: bool, max_q_len: int, max_kv_len: int, contextual_len: int) -> _Spec:
    return _spec(ACTIVATIONS[activation], bool(causal), float(alpha), float(inv_n), int(block_size), int(window),
                 bool(q_broadcast), int(max_q_len), int(max_kv_len), int(contextual_len))


def _plan_of(q, k, v, bias, q_off, kv_off, nt, spec: _Spec, cfg: KernelConfig,
             rel: tuple | None = None) -> tuple[int, _FwdPlan | None]:
    """(T_out, the call's forward plan or None for an empty batch, whose offsets are still checked)."""
    bsz = q_off.numel() - 1
    t_out = bsz * q.shape[0] if spec.q_bcast else q.shape[0]
    if t_out == 0 or bsz == 0:
        if bsz:
            _check_batch(q_off, kv_off, nt, bias, t_out, k.shape[0], spec.max_q_len, spec.max_kv_len)
        return t_out, None
    return t_out, _fwd_plan(q, k, v, bias, q_off, kv_off, nt, spec, t_out, cfg, rel)


# ----------------------------------------------------------------------------------------------------------
# torch.library custom ops: gemray::gdpa_fwd, gemray::gdpa_bwd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("gemray::gdpa_fwd", mutates_args=())
def gdpa_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                kv_offsets: torch.Tensor, num_targets: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor],
                max_q_len: int, max_kv_len: int, activation: str, causal: bool, alpha: float, inv_n: float,
                block_size: int, window: int, q_broadcast: bool, contextual_len: int,
                config: str, query_times: Optional[torch.Tensor] = None, key_times: Optional[torch.Tensor] = None,
                pos_w: Optional[torch.Tensor] = None, ts_w: Optional[torch.Tensor] = None,
                rel_max_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPA forward as a custom op (arguments checked by :func:`gdpa_triton`, which calls it).

    q: [Tq, H, Dqk] (q_broadcast: [S, H, Dqk]); k: [Tk, H, Dqk]; v: [Tk, H, Dv]; offsets [B+1] int64;
    num_targets [B] int64 or None; attn_bias [B, n1, n2] / [B, H, n1, n2] float or None; activation one of
    ACTIVATIONS; alpha > 0; inv_n = 1 / N; config: a KernelConfig name (gemray.kernels.config.lookup).
    Returns (out [T_out, H, Dv] in q's dtype, lse [H, T_out] fp32 base-2 log-sum-exp for softmax, else an empty
    [0] fp32 tensor); T_out = B * S with q_broadcast, else Tq. Under TRITON_INTERPRET=1 give it float32 or
    float16 (gdpa_triton runs bf16 in float32 there). query_times / key_times [T] int64, pos_w [P] / ts_w [NT]
    float, rel_max_len: the in-kernel relative bias (:class:`RelBias`; all four tensors or none)."""
    cfg = kconfig.lookup(config)
    spec = _spec_of(activation, causal, alpha, inv_n, block_size, window, q_broadcast, max_q_len, max_kv_len,
                    contextual_len)
    rel = _rel_tuple(query_times, key_times, pos_w, ts_w, rel_max_len)
    t_out, plan = _plan_of(q, k, v, attn_bias, q_offsets, kv_offsets, num_targets, spec, cfg, rel)
    o, lse = _forward(q, k, v, attn_bias, q_offsets, kv_offsets, num_targets, spec, t_out, cfg, plan, rel)
    return o, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


def _rel_tuple(query_times, key_times, pos_w, ts_w, rel_max_len) -> tuple | None:
    if pos_w is None:
        return None
    return (query_times, key_times, pos_w, ts_w, int(rel_max_len))


@gdpa_fwd_op.register_fake
def _gdpa_fwd_fake(q, k, v, q_offsets, kv_offsets, num_targets, attn_bias, max_q_len, max_kv_len, activation,
                   causal, alpha, inv_n, block_size, window, q_broadcast, contextual_len, config, query_times=None,
                   key_times=None, pos_w=None, ts_w=None, rel_max_len=0):
    t_out = (q_offsets.shape[0] - 1) * q.shape[0] if q_broadcast else q.shape[0]
    o = q.new_empty((t_out, k.shape[1], v.shape[2]))
    if activation == "softmax":
        return o, q.new_empty((k.shape[1], t_out), dtype=torch.float32)
    return o, q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("gemray::gdpa_bwd", mutates_args=())
def gdpa_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: Optional[torch.Tensor], lse: Optional[torch.Tensor], q_offsets: torch.Tensor,
                kv_offsets: torch.Tensor, num_targets: Optional[torch.Tensor], attn_bias: Optional[torch.Tensor],
                max_q_len: int, max_kv_len: int, activation: str, causal: bool, alpha: float, inv_n: float,
                block_size: int, window: int, q_broadcast: bool, contextual_len: int, need_dbias: bool,
                config: str, query_times: Optional[torch.Tensor] = None, key_times: Optional[torch.Tensor] = None,
                pos_w: Optional[torch.Tensor] = None, ts_w: Optional[torch.Tensor] = None, rel_max_len: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPA backward as a custom op: grad_out [T_out, H, Dv]; out / lse the forward's (softmax; None otherwise);
    the other arguments as :func:`gdpa_fwd_op`'s. Returns (dq like q, dk like k, dv like v, dbias like attn_bias
    when ``need_dbias``, else an empty [0] tensor, d pos_w like pos_w and d ts_w like ts_w with the in-kernel
    relative bias, else empty [0] tensors)."""
    cfg = kconfig.lookup(config)
    spec = _spec_of(activation, causal, alpha, inv_n, block_size, window, q_broadcast, max_q_len, max_kv_len,
                    contextual_len)
    rel = _rel_tuple(query_times, key_times, pos_w, ts_w, rel_max_len)
    _, plan = _plan_of(q, k, v, attn_bias, q_offsets, kv_offsets, num_targets, spec, cfg, rel)
    dq, dk, dv, dbias, drel = _backward(grad_out, q, k, v, out, lse, attn_bias, q_offsets, kv_offsets, num_targets,
                                        spec, need_dbias, cfg, plan, rel)
    empty = q.new_empty((0,))
    dpw, dtw = drel if drel is not None else (empty, q.new_empty((0,)))
    return dq, dk, dv, (dbias if dbias is not None else q.new_empty((0,))), dpw, dtw


@gdpa_bwd_op.register_fake
def _gdpa_bwd_fake(grad_out, q, k, v, out, lse, q_offsets, kv_offsets, num_targets, attn_bias, max_q_len,
                   max_kv_len, activation, causal, alpha, inv_n, block_size, window, q_broadcast, contextual_len,
                   need_dbias, config, query_times=None, key_times=None, pos_w=None, ts_w=None, rel_max_len=0):
    dbias = torch.empty_like(attn_bias) if need_dbias else q.new_empty((0,))
    dpw = torch.empty_like(pos_w) if pos_w is not None else q.new_empty((0,))
    dtw = torch.empty_like(ts_w) if ts_w is not None else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dpw, dtw


def _op_setup_context(ctx, inputs, output) -> None:
    q, k, v, q_off, kv_off, nt, bias = inputs[:7]
    o, lse = output
    softmax = inputs[9] == "softmax"
    tq, tk, pw, tw = (list(inputs[18:22]) + [None] * 4)[:4]
    ctx.save_for_backward(q, k, v, q_off, kv_off, nt, bias, o if softmax else None, lse if softmax else None,
                          tq, tk, pw, tw)
    ctx.scalars = inputs[7:17]  # max_q_len ... contextual_len
    ctx.config = inputs[17]
    ctx.rel_max_len = inputs[22] if len(inputs) > 22 else 0
    ctx.mark_non_differentiable(lse)


def _op_backward(ctx, grad_out, _grad_lse):
    q, k, v, q_off, kv_off, nt, bias, o, lse, tq, tk, pw, tw = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[6]
    dq, dk, dv, dbias, dpw, dtw = gdpa_bwd_op(grad_out, q, k, v, o, lse, q_off, kv_off, nt, bias, *ctx.scalars,
                                              need_dbias, ctx.config, tq, tk, pw, tw, ctx.rel_max_len)
    rel = pw is not None
    return (dq, dk, dv, None, None, None, dbias if need_dbias else None, *([None] * 11), None, None,
            dpw if rel else None, dtw if rel else None, None)


gdpa_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _GDPA(torch.autograd.Function):
    """The eager path of a call (see plain_eager): the custom ops' implementation without the dispatcher. Forward
    runs the plan's launch (or the Gluon forward); the backward its two or three launches. Offsets, targets, lse,
    the config and the plan ride on ctx (not save_for_backward: they are not differentiable and not modified in
    place), which saves their unpacking per backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, pos_w, ts_w, meta: tuple):
        """meta = (q_off [B+1] int64, kv_off [B+1] int64, nt [B] int64 or None, spec, t_out, config, plan,
        rel_meta: (query_times, key_times, max_len) of the in-kernel relative bias or None); pos_w / ts_w: its
        weights (None without)."""
        q_off, kv_off, nt, spec, t_out, cfg, plan, rel_meta = meta
        rel = None if rel_meta is None else (rel_meta[0], rel_meta[1], pos_w, ts_w, rel_meta[2])
        o, lse = _forward(q, k, v, bias, q_off, kv_off, nt, spec, t_out, cfg, plan, rel)
        # o only for softmax (delta = rowsum(o * dO)): saving an output costs a detach and its unpacking
        ctx.save_for_backward(q, k, v, bias, o if spec.act == 0 else None, pos_w, ts_w)
        ctx.lse, ctx.meta = lse, meta
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, o, pos_w, ts_w = ctx.saved_tensors
        q_off, kv_off, nt, spec, _, cfg, plan, rel_meta = ctx.meta
        rel = None if rel_meta is None else (rel_meta[0], rel_meta[1], pos_w, ts_w, rel_meta[2])
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias, drel = _backward(do, q, k, v, o, ctx.lse, bias, q_off, kv_off, nt, spec, want_dbias, cfg,
                                            plan, rel)
        dpw, dtw = drel if drel is not None else (None, None)
        return dq, dk, dv, dbias, dpw, dtw, None


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def _check_offsets(name: str, offsets: torch.Tensor, t: int, device: torch.device) -> None:
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"gdpa: {name} must be 1-D int64 [B+1], got {offsets.dtype} {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"gdpa: {name} is on {offsets.device}, tensors on {device}")


def _check_batch(q_off: torch.Tensor, kv_off: torch.Tensor, num_targets: torch.Tensor | None,
                 attn_bias: torch.Tensor | None, t_out: int, t_k: int, max_q_len: int, max_kv_len: int) -> None:
    """The batch checks of gdpa_triton (B >= 1): on host tensors at once, as ValueErrors (_check_batch_host); on
    CUDA as asynchronous device assertions (no host sync): offsets that do not cover the rows, or a sequence
    longer than max_len, would read and write out of bounds or lose tiles."""
    lq = q_off[1:] - q_off[:-1]
    lk = kv_off[1:] - kv_off[:-1]
    if q_off.device.type != "cuda":
        _check_batch_host(q_off, kv_off, lq, lk, t_out, t_k, max_q_len, max_kv_len, num_targets, attn_bias)
        return
    torch._assert_async((q_off[0] == 0) & (q_off[-1] == t_out) & (kv_off[0] == 0) & (kv_off[-1] == t_k)
                        & (lq.min() >= 0) & (lk.min() >= 0))
    torch._assert_async((lq.max() <= max_q_len) & (lk.max() <= max_kv_len))
    if num_targets is not None:
        torch._assert_async(((num_targets >= 0) & (num_targets <= lq)).all())
    if attn_bias is not None:
        torch._assert_async((lq.max() <= attn_bias.shape[-2]) & (lk.max() <= attn_bias.shape[-1]))


def _check_batch_host(q_off: torch.Tensor, kv_off: torch.Tensor, lq: torch.Tensor, lk: torch.Tensor, t_out: int,
                      t_k: int, max_q_len: int, max_kv_len: int, num_targets: torch.Tensor | None,
                      attn_bias: torch.Tensor | None) -> None:
    """The batch checks of gdpa_triton on host tensors, as ValueErrors naming the field and the sequence: offsets
    start at 0, never decrease and end at the number of rows; no sequence longer than its max_len; num_targets in
    [0, length]; attn_bias at least as large as the longest sequences."""
    for name, off, lens, t, cap, cap_name in (("q_offsets", q_off, lq, t_out, max_q_len, "max_q_len"),
                                              ("kv_offsets", kv_off, lk, t_k, max_kv_len, "max_kv_len")):
        if int(off[0]) != 0:
            raise ValueError(f"gdpa: {name}[0] must be 0, got {int(off[0])}")
        if lens.numel() and int(lens.min()) < 0:
            b = int(torch.argmin(lens))
            raise ValueError(f"gdpa: {name} must not decrease: sequence {b} has length {int(lens[b])}")
        if int(off[-1]) != t:
            raise ValueError(f"gdpa: {name}[-1]={int(off[-1])} but the tensor it indexes has {t} rows")
        if lens.numel() and int(lens.max()) > cap:
            b = int(torch.argmax(lens))
            raise ValueError(f"gdpa: sequence {b} has length {int(lens[b])} > {cap_name} {cap}")
    if num_targets is not None:
        bad = (num_targets < 0) | (num_targets > lq)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise ValueError(f"gdpa: num_targets[{b}]={int(num_targets[b])} outside [0, its length {int(lq[b])}]")
    if attn_bias is not None and lq.numel() and (int(lq.max()) > attn_bias.shape[-2]
                                                 or int(lk.max()) > attn_bias.shape[-1]):
        raise ValueError(f"gdpa: attn_bias {tuple(attn_bias.shape)} is smaller than the longest sequences "
                         f"({int(lq.max())} queries, {int(lk.max())} keys)")


def _prep(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"gdpa: {name} must be [T, H, D], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()




def _scales(activation: str, alpha: float | None, norm: float | None, d_qk: int, max_kv_len: int
            ) -> tuple[float, float]:
    """(alpha, 1 / N) of a call: alpha defaults to 1/sqrt(Dqk) for softmax, 1.0 otherwise (the reference's
    convention, gemray.kernels.reference.jagged_attention_ref); N defaults to max_kv_len (at least 1). Raises
    ValueError for alpha <= 0."""
    if alpha is None:
        alpha = 1.0 / math.sqrt(d_qk) if activation == "softmax" else 1.0
    if not alpha > 0:
        raise ValueError(f"gdpa: alpha must be > 0 for the Triton kernels, got {alpha}")
    return alpha, 1.0 / float(max(max_kv_len, 1) if norm is None else norm)


def gdpa_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, *, activation: str = "silu",
                causal: bool = False, alpha: float | None = None, norm: float | None = None,
                num_targets: torch.Tensor | None = None, block_size: int = 0, window: int = 0,
                q_broadcast: bool = False, attn_bias: torch.Tensor | None = None,
                contextual_len: int = 0, config: KernelConfig | None = None,
                rel_bias: RelBias | None = None,
                with_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Generalized jagged attention: ``out_i = sum_j f(alpha * q_i.k_j + bias_ij) v_j`` over valid pairs.

    Args:
        q: [Tq, H, Dqk] (or [S, H, Dqk] seeds shared by every sequence when ``q_broadcast``);
            float32, bfloat16 or float16. k: [Tk, H, Dqk]; v: [Tk, H, Dv], same dtype.
        q_offsets: [B+1] int64 offsets of the query rows (and of the output rows); with
            ``q_broadcast`` it must be ``arange(B+1) * S``.
        kv_offsets: [B+1] int64 offsets of the key/value rows; ``kv_offsets is q_offsets`` for self-attn.
        max_q_len / max_kv_len: host ints bounding every sequence's length (tiles beyond are not run:
            a longer sequence raises on host tensors, triggers an asynchronous device assertion on CUDA).
        activation: "softmax" (f = row softmax) | "silu" | "gelu" | "none" (f(s) = act(s) / norm).
        causal: key position <= query position (positions counted from each sequence's start).
        alpha: score scale; default 1/sqrt(Dqk) for softmax, 1.0 otherwise (as the reference).
        norm: N of the pointwise activations; default max_kv_len.
        num_targets: [B] int64 or None: the last num_targets[b] positions of sequence b are targets that
            attend to the history and to themselves only (requires causal self-attention).
        block_size: > 0 restricts attention to the query's own block of positions [k*bs, (k+1)*bs).
        window: > 0 restricts attention to |i - j| < window.
        attn_bias: optional float [B, n1, n2] (shared by heads) or [B, H, n1, n2], padded, added to the
            scaled logits at (query position, key position) of each sequence, as in
            ``jagged_attention_ref``; n1 / n2 must be >= the longest query / key sequence. Differentiable:
            dbias is written by the dQ kernel (by the dK/dV kernel under ds_store).
        contextual_len: > 0 (causal only): the first contextual_len positions of every sequence form a
            bidirectional prefix (they see each other; later positions see them causally anyway).
        config: the kernels' KernelConfig (tiles and launch modes per regime); None = config.DEFAULT.
        rel_bias: optional :class:`RelBias` (self-attention only, not with attn_bias): the HSTU relative
            position / time bias computed inside the kernels from per-token times and the bucket weights (no
            dense [B, n, n] tensor), forward and backward (differentiable in pos_w / ts_w).
        with_lse: return ``(out, lse)`` and record nothing for autograd (lse [H, T_out] fp32, the base-2
            log-sum-exp for softmax, else an empty [0] tensor): for callers that own their backward and run it
            with :func:`gdpa_triton_backward` (gemray.ops' cross-attention and PMA custom ops).
    Returns:
        out: [Tq, H, Dv] (q_broadcast: [B*S, H, Dv]) in q's dtype; rows with no valid key are 0.
    Raises:
        ValueError: on bad shapes, dtypes, devices, option combinations, or (host tensors) a batch whose
            offsets, lengths, targets or bias do not fit, naming the field and the sequence.
        TypeError: ``config`` is not a KernelConfig.

    Runs as the custom ops ``gemray::gdpa_fwd`` / ``gemray::gdpa_bwd`` under torch.compile, export and fake /
    meta tracing, and as their implementation behind an autograd.Function in plain eager calls (``plain_eager``).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    cfg = kconfig.resolve(config)
    q, k, v = _prep(q, "q"), _prep(k, "k"), _prep(v, "v")
    (tq, hq, dq), (tk, hk, dk), (tv, hv, dv) = q.shape, k.shape, v.shape  # ints (torch.Size slices compare slowly)
    if tk != tv or hk != hv or hq != hk or dq != dk:
        raise ValueError(f"gdpa: shape mismatch q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"gdpa: q/k/v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if dq > 256 or dv > 256:
        raise ValueError(f"gdpa: head dims up to 256 supported, got {dq}, {dv}")
    _check_offsets("q_offsets", q_offsets, tq, q.device)
    _check_offsets("kv_offsets", kv_offsets, tk, q.device)
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(f"gdpa: q_offsets has B={q_offsets.numel() - 1}, kv_offsets B={kv_offsets.numel() - 1}")
    if num_targets is not None:
        if not causal or (q_offsets is not kv_offsets and not torch.equal(q_offsets, kv_offsets)):
            raise ValueError("gdpa: num_targets needs causal self-attention")
        if num_targets.numel() != q_offsets.numel() - 1:
            raise ValueError(f"gdpa: num_targets must be [B={q_offsets.numel() - 1}], got {tuple(num_targets.shape)}")
        num_targets = num_targets.to(device=q.device, dtype=torch.int64).contiguous()
    if block_size < 0 or window < 0 or (block_size and window):
        raise ValueError(f"gdpa: use at most one of block_size ({block_size}) and window ({window}), >= 0")
    if q_broadcast and causal:
        raise ValueError("gdpa: q_broadcast (PMA) is not causal")
    if contextual_len < 0 or (contextual_len and not causal):
        raise ValueError(f"gdpa: contextual_len ({contextual_len}) must be >= 0 and needs causal attention")
    if max_q_len < 0 or max_kv_len < 0:
        raise ValueError("gdpa: max lengths must be >= 0")
    bsz = q_offsets.numel() - 1
    if attn_bias is not None:
        if (attn_bias.dim() not in (3, 4) or attn_bias.shape[0] != bsz
                or (attn_bias.dim() == 4 and attn_bias.shape[1] != q.shape[1])
                or not attn_bias.is_floating_point() or attn_bias.device != q.device):
            raise ValueError(f"gdpa: attn_bias must be float [B={bsz}, n1, n2] or [B, H={q.shape[1]}, n1, n2] "
                             f"on {q.device}, got {attn_bias.dtype} {tuple(attn_bias.shape)} on {attn_bias.device}")
    if rel_bias is not None:
        _check_rel_bias(rel_bias, q, k, q_offsets, kv_offsets, q_broadcast, attn_bias)
    if _interpreting() and q.dtype == torch.bfloat16:
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton-lang/triton#11584): run in float32
        up = gdpa_triton(q.float(), k.float(), v.float(), q_offsets, kv_offsets, max_q_len, max_kv_len,
                         activation=activation, causal=causal, alpha=alpha, norm=norm, num_targets=num_targets,
                         block_size=block_size, window=window, q_broadcast=q_broadcast, attn_bias=attn_bias,
                         contextual_len=contextual_len, config=cfg, rel_bias=rel_bias, with_lse=with_lse)
        return (up[0].to(torch.bfloat16), up[1]) if with_lse else up.to(torch.bfloat16)
    alpha, inv_n = _scales(activation, alpha, norm, dq, max_kv_len)
    rb = rel_bias
    pos_w = ts_w = None
    if rb is not None:
        pos_w, ts_w = rb.pos_w.contiguous(), rb.ts_w.contiguous()
    if with_lse or not plain_eager(q, k, v, attn_bias, q_offsets, pos_w):
        rel_args = () if rb is None else (rb.query_times, rb.key_times, pos_w, ts_w, int(rb.max_len))
        if with_lse:  # (out, lse), nothing recorded for autograd
            with torch.no_grad():
                return gdpa_fwd_op(q, k, v, q_offsets, kv_offsets, num_targets, attn_bias, int(max_q_len),
                                   int(max_kv_len), activation, bool(causal), float(alpha), inv_n, int(block_size),
                                   int(window), bool(q_broadcast), int(contextual_len), cfg.name, *rel_args)
        out, _ = gdpa_fwd_op(q, k, v, q_offsets, kv_offsets, num_targets, attn_bias, int(max_q_len),
                             int(max_kv_len), activation, bool(causal), float(alpha), inv_n, int(block_size),
                             int(window), bool(q_broadcast), int(contextual_len), cfg.name, *rel_args)
        return out
    spec = _spec_of(activation, causal, alpha, inv_n, block_size, window, q_broadcast, max_q_len, max_kv_len,
                    contextual_len)
    rel = None if rb is None else (rb.query_times, rb.key_times, pos_w, ts_w, int(rb.max_len))
    # the launch plan, made (and the batch checked: _check_batch) once per batch and configuration
    t_out, plan = _plan_of(q, k, v, attn_bias, q_offsets, kv_offsets, num_targets, spec, cfg, rel)
    # the non-differentiable arguments travel as one tuple: autograd.Function.apply's cost grows per argument
    rel_meta = None if rb is None else (rb.query_times, rb.key_times, int(rb.max_len))
    return _GDPA.apply(q, k, v, attn_bias, pos_w, ts_w,
                       (q_offsets, kv_offsets, num_targets, spec, t_out, cfg, plan, rel_meta))


def _check_rel_bias(rb: RelBias, q: torch.Tensor, k: torch.Tensor, q_offsets: torch.Tensor,
                    kv_offsets: torch.Tensor, q_broadcast: bool, attn_bias: torch.Tensor | None) -> None:
    """ValueError naming the field for a rel_bias gdpa_triton cannot take."""
    if attn_bias is not None:
        raise ValueError("gdpa: pass attn_bias or rel_bias, not both")
    if q_broadcast or q.shape[0] != k.shape[0] or (
            q_offsets is not kv_offsets and not torch.equal(q_offsets, kv_offsets)):
        raise ValueError("gdpa: rel_bias needs self-attention (q and k rows share their offsets)")
    for name, t in (("query_times", rb.query_times), ("key_times", rb.key_times)):
        if t.dtype != torch.int64 or t.shape != (k.shape[0],) or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"gdpa: rel_bias.{name} must be contiguous int64 [T={k.shape[0]}] on {q.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    for name, t in (("pos_w", rb.pos_w), ("ts_w", rb.ts_w)):
        if t.dim() != 1 or t.numel() < 1 or not t.is_floating_point() or t.device != q.device:
            raise ValueError(f"gdpa: rel_bias.{name} must be a non-empty 1-D float tensor on {q.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if rb.max_len < 1:
        raise ValueError(f"gdpa: rel_bias.max_len must be >= 1, got {rb.max_len}")


def jagged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                            max_len: int, *, activation: str = "silu", causal: bool = True,
                            attn_bias: torch.Tensor | None = None, alpha: float | None = None,
                            num_targets: torch.Tensor | None = None, contextual_len: int = 0,
                            config: KernelConfig | None = None, rel_bias: RelBias | None = None) -> torch.Tensor:
    """Jagged self-attention (JFA for softmax, HSTU for silu); signature of ``jagged_attention_ref``
    plus ``contextual_len`` (bidirectional prefix of that many positions), ``config`` and ``rel_bias`` (the
    in-kernel relative position / time bias, :class:`RelBias`) (see ``gdpa_triton``).

    q: [T, H, Dqk], k: [T, H, Dqk], v: [T, H, Dv]; offsets: [B+1] int64; max_len: host int >= every
    length, also the N of ``silu(alpha*qk + bias)/N``. attn_bias: optional float [B, n', n'] or
    [B, H, n', n'] (n' >= longest sequence), added to the scaled logits, differentiable.
    num_targets: [B] int64 or None (causal only). Returns [T, H, Dv]. Raises ValueError as gdpa_triton.
    """
    return gdpa_triton(q, k, v, offsets, offsets, max_len, max_len, activation=activation, causal=causal,
                       alpha=alpha, norm=float(max(max_len, 1)), num_targets=num_targets, attn_bias=attn_bias,
                       contextual_len=contextual_len, config=config, rel_bias=rel_bias)


def jagged_cross_attention_triton(q: torch.Tensor, q_offsets: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int,
                                  max_kv_len: int, *, activation: str = "softmax",
                                  alpha: float | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Cross-attention: jagged q [Tq, H, Dqk] (offsets q_offsets [B+1]) against jagged k [Tk, H, Dqk],
    v [Tk, H, Dv] (kv_offsets [B+1]), non-causal; pointwise activations use N = max_kv_len.

    For a dense kv [B, Nk, H, D] pass ``kv.view(B * Nk, H, D)`` and ``kv_offsets = arange(B+1) * Nk``.
    Returns [Tq, H, Dv]. Follows ``gemray.kernels.reference.jagged_cross_attention_ref``.
    """
    return gdpa_triton(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, activation=activation,
                       causal=False, alpha=alpha, config=config)


def pma_triton(seeds: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor,
               max_kv_len: int, *, activation: str = "softmax", alpha: float | None = None,
               config: KernelConfig | None = None) -> torch.Tensor:
    """Pooled multi-head attention: seeds [S, H, Dqk] (shared learned queries) against the jagged history
    k [T, H, Dqk], v [T, H, Dv] with kv_offsets [B+1]. Returns [B, S, H, Dv]; an empty history gives 0.
    Follows ``gemray.kernels.reference.pma_ref``.
    """
    if seeds.dim() != 3:
        raise ValueError(f"pma: seeds must be [S, H, D], got {tuple(seeds.shape)}")
    bsz = kv_offsets.numel() - 1
    s = seeds.shape[0]
    if torch.compiler.is_compiling():
        q_off = torch.arange(bsz + 1, device=kv_offsets.device, dtype=torch.int64) * s
    else:  # cached per kv_offsets object so that the work tables keyed on it are reused across calls
        q_off = _cached((kv_offsets,), ("pma_q_off", s),
                        lambda: torch.arange(bsz + 1, device=kv_offsets.device, dtype=torch.int64) * s)
    out = gdpa_triton(seeds, k, v, q_off, kv_offsets, s, max_kv_len, activation=activation, causal=False,
                      alpha=alpha, q_broadcast=True, config=config)
    return out.view(bsz, s, seeds.shape[1], v.shape[2])


def gdpa_triton_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, q_offsets: torch.Tensor, kv_offsets: torch.Tensor,
                         max_q_len: int, max_kv_len: int, *, activation: str = "softmax", alpha: float | None = None,
                         q_broadcast: bool = False, config: KernelConfig | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a non-causal :func:`gdpa_triton` call made with ``with_lse=True`` (cross-attention, PMA):
    the Triton backward launches on the forward's ``out`` / ``lse``, no forward recomputed and no autograd.

    Args:
        grad_out: [T_out, H, Dv], d loss / d out. q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len,
            activation, alpha, q_broadcast, config: exactly the forward call's (k / v may be strided views, e.g.
            splits of one projection: rows are indexed by their stride, no copy).
        out: [T_out, H, Dv] and lse [H, T_out] fp32: the forward's (read for softmax only: delta = rowsum(out *
            grad_out) and the probabilities; the pointwise activations ignore them).
    Returns:
        (dq like q, dk [Tk, H, Dqk], dv [Tk, H, Dv]) in q's dtype; with q_broadcast dq is summed over the sequences
        ([S, H, Dqk]).
    Raises:
        ValueError: an unknown activation or alpha <= 0 (the forward's checks are not repeated).

    Why: run under autograd again, the candidate tower's backward recomputed its forwards (~0.5 ms of a GEM step on
    an H100) on ``contiguous()`` copies of its strided k / v (1.39 ms); without both the step measured 0.85-2.15 ms
    shorter (session 28, benchmarks/reports/gem_h200_2026-12-06.md).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    cfg = kconfig.resolve(config)
    if _interpreting() and q.dtype == torch.bfloat16:  # as gdpa_triton: the interpreter runs bf16 in float32
        grads = gdpa_triton_backward(grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse, q_offsets,
                                     kv_offsets, max_q_len, max_kv_len, activation=activation, alpha=alpha,
                                     q_broadcast=q_broadcast, config=cfg)
        return tuple(g.to(torch.bfloat16) for g in grads)
    alpha, inv_n = _scales(activation, alpha, None, q.shape[2], max_kv_len)
    softmax = activation == "softmax"
    q, k, v = _prep(q, "q"), _prep(k, "k"), _prep(v, "v")
    with torch.no_grad():
        dq, dk, dv, *_ = gdpa_bwd_op(grad_out, q, k, v, out if softmax else None, lse if softmax else None,
                                     q_offsets, kv_offsets, None, None, int(max_q_len), int(max_kv_len), activation,
                                     False, float(alpha), inv_n, 0, 0, bool(q_broadcast), 0, False, cfg.name)
    return dq, dk, dv


def jagged_block_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                  max_len: int, *, block_size: int = 64, window: int = 0,
                                  activation: str = "softmax", causal: bool = True,
                                  alpha: float | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Block-local self-attention: a query at position i sees keys j with j // block_size == i //
    block_size (or, with ``window`` > 0 instead, |i - j| < window), causal or not; cost is linear in
    the length. q/k: [T, H, Dqk], v: [T, H, Dv], offsets [B+1] int64. Pointwise activations use
    N = max_len. Returns [T, H, Dv]. Follows ``gemray.kernels.reference.jagged_block_attention_ref``.
    """
    if window:
        block_size = 0
    elif block_size <= 0:
        raise ValueError(f"block attention: block_size must be > 0, got {block_size}")
    return gdpa_triton(q, k, v, offsets, offsets, max_len, max_len, activation=activation, causal=causal,
                       alpha=alpha, norm=float(max(max_len, 1)), block_size=block_size, window=window,
                       config=config)
