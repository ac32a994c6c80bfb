"""FP8 (e4m3) training GEMMs with rowwise or tensorwise scales, the norm-fused activation quantization, and
numerics counters.

Shape key: M rows (tokens), K input features (the contraction), N output features.

Recipe (torchao's ``Float8Linear`` "rowwise" recipe is the model followed; torchao itself is not available on
the lent H200 -- no network, not in the image -- so this is written on ``torch._scaled_mm`` directly)::

    forward   y  [M, N] = (x_q [M, K] e4m3 * sx [M, 1]) @ (w_q [N, K] e4m3 * sw [N, 1])^T     (+ bias)
    dgrad     dx [M, K] = (g_q [M, N] fg * sg [M, 1]) @ (w_q' [N, K] e4m3 * sw' [1, K])      grad="e4m3"|"e5m2"
    wgrad     dw [N, K] = (g_q' [N, M] fg * sg' [N, 1]) @ (x_q' [M, K] e4m3 * sx' [1, K])    (fg = that format)

with every scale = amax / fp8_max over the contraction dimension of that GEMM (so each GEMM quantizes its
operands along its own K: the forward's x rowwise, the wgrad's x columnwise). The default gradient format is
e4m3, as torchao's rowwise recipe (its rowwise kernels take e4m3 operands; with per-row scales the range e5m2
would add matters less than its lost mantissa bit); "e5m2" is the classic FP8-training choice for gradients,
selectable, and on the lent H200 to be measured (whether torch 2.11's rowwise ``_scaled_mm`` accepts an
e5m2 x e4m3 pair was not checked from here). ``grad="bf16"`` runs dgrad and
wgrad as plain bf16 GEMMs on the saved high-precision x and the master weight instead. The master weights and
the optimizer state stay in the parameters' own dtype (fp32 from the meta build, bf16 if the model is cast):
FP8 copies exist only inside a GEMM (the weights' once per training step, :func:`fp8_weight_cache`). The output is
bf16 on both backends (what rowwise ``_scaled_mm`` produces on sm90, and what the emulation models).

Tensorwise recipe (``Fp8Settings.recipe = "tensorwise"``, ``train.fp8_recipe``; torchao's default recipe)::

    forward   y  [M, N] = (x_q [M, K] e4m3 * sx) @ (w_q [N, K] e4m3 * sw)^T                         (+ bias)
    dgrad     dx [M, K] = (g_q [M, N] fg * sg) @ (w_q [N, K] e4m3 * sw)             w_q: the forward's bytes
    wgrad     dw [N, K] = (g_q^T [N, M'] fg * sg) @ (x_q^T [K, M'] e4m3 * sx)^T     g_q, x_q: the same bytes

with ONE fp32 scale per tensor (0-dim, current: this call's amax), s = amax(|t|) / fp8_max, so x, w and g are
quantized once each and the backward's operands are the forward's / dgrad's FP8 bytes, transposed (1 byte read +
1 written per element, no amax; the wgrad's contraction M zero-padded to M' = a multiple of 16). The forward saves
x_q, sx, w_q, sw for the backward instead of x and w: 1 byte per element of x instead of 2 (bf16) or 4 (fp32:
the HSTU GEMMs' inputs under autocast, a LayerNorm's output and its product with u). grad="bf16" saves x and w as
rowwise does (its bf16 GEMMs need them). Quantizations per linear per training step (eager, FP8 gradients, the
weight through :func:`fp8_weight_cache`): rowwise 4 over activations -- x (none for the uvqk GEMM: the fused
norm's), g, then g^T and x^T column-wise -- and 2 over the weight (w, w^T); tensorwise 2 over activations (x, g)
and 1 over the weight, plus 3 byte transposes (g_q, x_q, w_q). Under torch.compile the weight is quantized at
each use instead (rowwise twice, tensorwise once: its FP8 copy is saved), and which tensors the compiled step keeps
for its backward is AOT autograd's partitioner's choice. What tensorwise gives up: its amax is a whole-tensor
reduction that must finish before the first element is cast (rowwise: a per-row one, fused with the cast); one
outlier coarsens the whole tensor's grid (below); and the HSTU pre-norm's output is quantized after the LayerNorm,
not by the fused kernel (``HSTUBlock._fp8_uvqk`` says why), so the uvqk input costs a pass that rowwise does not.
Measured: nothing on a GPU yet -- neither the step time nor the peak memory against rowwise and bf16 (the run is
planned in benchmarks/README.md, "FP8 recipes") nor tensorwise ``_scaled_mm`` against the emulation (the GPU
test ``test_scaled_mm_matches_emulation[*-tensorwise]``). On the CPU every GEMM of both recipes passes torch's
meta checks of ``_scaled_mm`` (layouts, multiples of 16, 1-element fp32 scales = tensorwise; torch 2.13's meta
function, not 2.11's CUDA op). torchao's own figures for Llama3-8B (+25% tensorwise, +10% rowwise over bf16) are
the reason to try it: the compiled rowwise GEM step spent ~28 ms in the kernels that hold the wgrad operands'
column-wise amax reductions (benchmarks/reports/gem_h200_2026-12-04.md: 16.5 + 12.0 ms of its 204.8).

Why rowwise and not the DeepSeek-V3 1x128 / 128x128 blocks: blockwise scaling is reached only through
``torch.nn.functional.scaled_mm`` / ``torch._scaled_mm_v2`` (``ScalingType.BlockWise1x128``), which needs
cuBLAS >= 12.9 and outer-dim-major scale layouts and could not be checked on both torch 2.11 (the H200
image) and 2.13 (CPU) here; rowwise ``torch._scaled_mm`` (a [M, 1] / [1, N] fp32 scale pair, bf16 output)
works on sm90 in both. The fused norm kernel (``gemray.kernels.norm_quant``) emits exactly these rowwise scales
when its ``block_size`` is the whole row (one scale group per row).

Norm fusion: the HSTU block's pre-norm LayerNorm produces its output directly as FP8 + scales
(``norm_quant(..., block_size=D)``, Triton on CUDA, the PyTorch reference on CPU) and the uvqk GEMM consumes
them (``fp8_linear(..., x_fp8=, x_scale=)``) without a second quantization pass.

CPU / emulation: ``backend="emulate"`` (the default off CUDA) quantizes with the same scales to the same FP8
bytes, multiplies the dequantized operands with fp32 accumulation and rounds the product to bf16 as
``_scaled_mm`` does, so CPU tests exercise the scaling code; ``"scaled_mm"`` (the default on CUDA) calls
``torch._scaled_mm``. The two differ only by the GEMM's accumulation order (see :func:`fp8_mm`). Until
2026-12-02 the emulation returned the fp32 product unrounded: a caller's gradient of that output then differed
from the scaled_mm side's by bf16's rounding, and re-quantizing two such gradients to FP8 put ~1/64 of their
values on the neighbouring e4m3 step -- the GPU test's dgrad / wgrad differences of 1.3% (e4m3) / 1.8% (e5m2)
(reproduced on the CPU by the same comparison with a bf16-rounding stand-in for _scaled_mm: 1.25% / 1.74%).

What FP8 can gain at the GEM-scale shape (configs/gem-h200.toml: 8 HSTU blocks, width 1024, uvqk 1024 -> 4096,
output 1024 -> 1024, 32,270 tokens per step; benchmarks/reports/gem_h200_2026-12-02.md, runs 1 and 6): every GEMM
of the bf16 step together takes 11.2 ms of 167.8 (the profile), so FP8's 2x tensor-core rate can save at most
5.6 ms (3.3%). Against it, the quantizations a step needs touch ~3.4 G elements (per block: the output
projection's input forward; backward the uvqk gradient rowwise and transposed, the uvqk input transposed, the
output projection's gradient both ways and its input transposed: 13,312 values per token), which even a fused
kernel at ~4 bytes per element (read bf16, write e4m3; a second read for the transposed ones) moves in ~4 ms at
3.3 TB/s. So the best FP8 step at this shape is ~1% faster than bf16 -- FP8 pays only where GEMMs dominate
(wider layers, longer rows per GEMM). The measured 0.69x (243.8 vs 167.8 ms) came from the eager quantization:
~38 bytes of traffic and ~12 launches per quantization, the padding copies of g and x for the wgrad, on a step
whose GPU already idles 40% waiting for the host; now 13 bytes, ~6 launches, no copies (not re-measured:
``VARIANTS="bf16 fp8" OUT=$OUT bash benchmarks/fp8_ac_h200.sh``; expected still below 1x).

Outlier handling: scales are *current* (computed from this call's amax, no amax history: a spike cannot
overflow a stale scale) and, rowwise, per row, so one outlier token or output channel coarsens only its own row's
grid, not the tensor's (tensorwise: the whole tensor's -- every value below amax * 2^-17 then flushes to 0). A row's amax maps exactly to +-448 (e4m3) / +-57344 (e5m2), so nothing saturates except
non-finite inputs; the cost of an outlier is underflow of the small values in its row (|v| < amax * 2^-17
for e4m3 flushes to 0). An all-zero row (tensorwise: tensor) gets scale 0 and q = 0. Gradients can use e5m2 (2^-16..57344) for a
wider range within a row. The numerics counters below measure exactly these two effects per layer:

* ``amax``: the max |x| / |w| / |grad| seen (fp32);
* ``overflow``: fraction of values off the FP8 grid (|v * inv_scale| > fp8_max beyond fp32 rounding, i.e.
  non-finite inputs with current scaling);
* ``underflow``: fraction of nonzero values quantized to 0.

They are collected only inside :func:`collect_fp8_stats` (the trainer opens it every ``train.log_every``
steps), as device tensors summed per layer, and read once by :func:`pop_fp8_stats`. Only eager code records
them: a step under ``torch.compile`` records none (a traced read of the counters' global would guard the graph
on it and recompile it at each collection).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
GRAD_FORMATS = ("e4m3", "e5m2", "bf16")
BACKENDS = ("auto", "scaled_mm", "emulate")
RECIPES = ("rowwise", "tensorwise")
MIN_DIM = 128  # default smallest K / N converted (smaller GEMMs gain nothing from FP8 and lose precision)


@dataclass(frozen=True)
class Fp8Settings:
    """How one converted layer runs. grad: "e4m3" / "e5m2" (FP8 dgrad + wgrad, gradients in that format) or
    "bf16"; backend: "auto" (scaled_mm on CUDA, emulate elsewhere), "scaled_mm" or "emulate"; name: the layer's
    qualified name (stats key); recipe: "rowwise" (one scale per row of each GEMM operand along its contraction)
    or "tensorwise" (one scale per tensor, the FP8 bytes shared by the forward and both backward GEMMs; module
    docstring). Raises ValueError on an unknown grad / backend / recipe."""

    grad: str = "e4m3"
    backend: str = "auto"
    name: str = ""
    recipe: str = "rowwise"

    def __post_init__(self):
        if self.grad not in GRAD_FORMATS:
            raise ValueError(f"fp8 grad format: expected one of {GRAD_FORMATS}, got {self.grad!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"fp8 backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe: expected one of {RECIPES}, got {self.recipe!r}")


# ----------------------------------------------------------------------------------------------------------
# numerics counters
# ----------------------------------------------------------------------------------------------------------
_STATS: dict[str, dict[str, torch.Tensor]] | None = None  # None: not collecting
_DONE: dict[str, dict[str, torch.Tensor]] = {}  # the last finished collection
_SAT_SLACK = 1.0 + 1e-6  # amax * (fmax / amax) may round a few fp32 ulps above fmax: that is no saturation


@contextlib.contextmanager
def collect_fp8_stats():
    """Collect per-layer amax / overflow / underflow of every FP8 quantization inside this block (the
    backward too, when it runs inside); :func:`pop_fp8_stats` reads them afterwards."""
    global _STATS, _DONE
    _STATS = {}
    try:
        yield
    finally:
        _DONE, _STATS = _STATS, None


def pop_fp8_stats() -> dict[str, dict[str, float]]:
    """The counters of the last :func:`collect_fp8_stats` block as {"<layer>.<operand>": {"amax",
    "overflow", "underflow"}} (fractions in [0, 1]; one host sync per value); resets them."""
    global _DONE
    stats, _DONE = _DONE, {}
    out = {}
    for key, acc in stats.items():
        n = float(acc["count"])
        out[key] = {"amax": float(acc["amax"]), "overflow": float(acc["overflow"]) / max(n, 1.0),
                    "underflow": float(acc["underflow"]) / max(n, 1.0)}
    return out


def log_fp8_stats(stats: dict[str, dict[str, float]], logger: logging.Logger = log) -> None:
    """One INFO line per quantized operand of :func:`pop_fp8_stats`: amax, overflow / underflow in percent;
    a WARNING when anything overflowed (non-finite values reached an FP8 GEMM)."""
    for key, v in sorted(stats.items()):
        level = logging.WARNING if v["overflow"] > 0 else logging.INFO
        logger.log(level, "fp8 %s: amax %.4g overflow %.4f%% underflow %.4f%%", key, v["amax"],
                   100 * v["overflow"], 100 * v["underflow"])


def _record(key: str, x: torch.Tensor, scaled: torch.Tensor, q: torch.Tensor, fmax: float) -> None:
    # Not under torch.compile: a traced read of _STATS (a new dict per collection) would guard on it and
    # recompile the graph at each collection; compiled models collect no counters (the trainer says so).
    if torch.compiler.is_compiling() or _STATS is None or not key:
        return
    with torch.no_grad():
        acc = _STATS.setdefault(key, {"amax": x.new_zeros((), dtype=torch.float32),
                                      "overflow": x.new_zeros((), dtype=torch.float64),
                                      "underflow": x.new_zeros((), dtype=torch.float64), "count": 0})
        acc["amax"] = torch.maximum(acc["amax"], x.detach().abs().amax().float() if x.numel() else acc["amax"])
        acc["overflow"] += (~(scaled.abs() <= fmax * _SAT_SLACK)).sum()
        acc["underflow"] += ((q.float() == 0) & (x != 0)).sum()
        acc["count"] += x.numel()


def _record_quantized(key: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmax: float) -> None:
    """Counters for a tensor quantized elsewhere (the fused norm kernel): scale [M, 1] = amax / fmax."""
    if torch.compiler.is_compiling() or _STATS is None or not key:
        return
    with torch.no_grad():
        inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), torch.zeros_like(scale))
        _record(key, x, x.float() * inv, q, fmax)


# ----------------------------------------------------------------------------------------------------------
# quantization
# ----------------------------------------------------------------------------------------------------------
def _check_quantize(fn: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in FP8_MAX:
        raise ValueError(f"{fn}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be 2-D [M, K], got {tuple(x.shape)}")


def _scale_and_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, pad_to: int, stats_key: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic both recipes share: ``q = x * (fp8_max / amax)`` cast to ``dtype`` (round-to-nearest-even),
    amax fp32 [M, 1], [1, K] or [1, 1] (2-D, so that a bf16 x is multiplied in fp32 and rounded once, by the
    cast); a slice whose ``fp8_max / amax`` is not finite is multiplied by 0. The last dim of q is zero-padded to
    a multiple of ``pad_to``. Returns (q, amax / fp8_max)."""
    fmax = FP8_MAX[dtype]
    inv = (fmax / amax).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    k = x.shape[1]
    k_pad = -(-k // pad_to) * pad_to
    if torch.compiler.is_compiling():  # functional (an out= view breaks dynamo's graph); inductor fuses it all
        # no branch on k_pad != k: with a symbolic token count that test guards the graph on T % pad_to == 0,
        # and the first batch whose count is a multiple of pad_to recompiles it (the compiled FP8 GEM step
        # recompiled once mid-run on the H200, 20.7 s; tests/test_fp8.py counts the frames)
        scaled = x.float() * inv
        q = F.pad(scaled, (0, k_pad - k)).to(dtype)
    else:
        scaled = torch.empty((x.shape[0], k_pad), dtype=torch.float32, device=x.device)
        if k_pad != k:
            scaled[:, k:] = 0.0
        torch.mul(x, inv, out=scaled[:, :k])
        q = scaled.to(dtype)
    _record(stats_key, x, scaled[:, :k], q[:, :k], fmax)
    return q, amax / fmax


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3, dim: int = -1, *, stats_key: str = "",
                     pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale + cast ``x`` [M, K] to FP8 with one scale per slice along ``dim`` (the GEMM's contraction).

    dim=-1: scale [M, 1] (one per row); dim=0: scale [1, K] (one per column). ``scale = amax / fp8_max``
    (float32) and ``q = x * (fp8_max / amax)`` cast with round-to-nearest-even -- the same arithmetic as
    ``gemray.kernels.reference.quantize_blocks_ref`` / the fused norm kernel, so ``quantize_rowwise(y)`` equals
    the kernel's ``(y_fp8, scales)`` for ``block_size = K``. A slice whose ``fp8_max / amax`` is not finite (all
    zeros, non-finite values, amax < 448 / 3.4e38) is multiplied by 0: q = 0 (NaN where x is not finite).
    ``pad_to``: the last dim of q is padded with zeros to a multiple of it (``_scaled_mm`` wants contraction
    dims that are multiples of 16; the scales do not change) -- written in place, x is not copied.
    Returns (q [M, K'] ``dtype``, contiguous row-major; scale). ``x ~= q[:, :K].float() * scale``.
    Raises ValueError for a non-FP8 dtype, x not 2-D or a pad_to < 1 / with dim=0.

    Cost (eager, no clamp needed: |x| <= amax keeps |x * inv| <= fp8_max up to fp32 rounding, which the cast
    rounds to fp8_max): one amax reduction over x, two tiny kernels on the scales, one multiply into an fp32
    buffer and one cast -- 13 bytes of traffic per element of a bf16 x (the former eager chain: about 38 and
    twice the launches). The numerics counters (inside :func:`collect_fp8_stats` only) add their own passes.
    """
    _check_quantize("quantize_rowwise", x, dtype)
    if pad_to < 1 or (pad_to > 1 and dim not in (-1, 1)):
        raise ValueError(f"quantize_rowwise: pad_to must be >= 1 and pads the contraction (dim=-1), got pad_to="
                         f"{pad_to}, dim={dim}")
    if x.numel():
        amax = torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)
    else:
        amax = x.new_zeros((x.shape[0], 1) if dim in (-1, 1) else (1, x.shape[1]), dtype=torch.float32)
    return _scale_and_cast(x, amax, dtype, pad_to, stats_key)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = E4M3, *, stats_key: str = ""
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale + cast ``x`` [M, K] to FP8 with ONE scale for the whole tensor (current scaling: this call's amax).

    ``scale = amax(|x|) / fp8_max`` (float32, 0-dim: what ``_scaled_mm`` reads as tensorwise, a 1-element fp32
    scale per operand) and ``q = x * (fp8_max / amax)`` cast with round-to-nearest-even -- the arithmetic of
    :func:`quantize_rowwise` with the amax taken over every element. An all-zero (or empty) x gets scale 0 and
    q = 0; a non-finite amax scales everything to 0 (NaN where x is not finite), as a row does rowwise.
    Returns (q [M, K] ``dtype``, contiguous row-major; scale 0-dim fp32). ``x ~= q.float() * scale``.
    Raises ValueError for a non-FP8 dtype or x not 2-D.

    Cost: one full reduction over x (it must finish before any element can be cast), then the multiply + cast.
    """
    _check_quantize("quantize_tensorwise", x, dtype)
    # amax [1, 1], not 0-dim, while it scales x: a 0-dim fp32 operand does not promote a bf16 x (type promotion
    # ranks dimensioned tensors first), and the eager multiply would round x * inv to bf16 before the FP8 cast
    if x.numel():  # a shape test (M = 0: an empty batch), not a data-dependent branch
        amax = torch.linalg.vector_norm(x, float("inf"), dim=(0, 1), keepdim=True, dtype=torch.float32)
    else:  # vector_norm's inf norm has no identity for an empty tensor
        amax = x.new_zeros((1, 1), dtype=torch.float32)
    q, scale = _scale_and_cast(x, amax, dtype, 1, stats_key)
    return q, scale.reshape(())


def _transpose_fp8(q: torch.Tensor, pad_to: int = 16) -> torch.Tensor:
    """The transposed FP8 bytes of q [M, K] as a row-major [K, M'] (M' = M rounded up to ``pad_to``, zero
    columns appended): the tensorwise wgrad's operands, which contract over M (``_scaled_mm`` wants it a multiple
    of 16) and reuse the forward / dgrad operand's bytes and scale -- 1 byte read + 1 written per element, no
    amax. The bytes move as uint8 (an FP8 zero is the zero byte in both formats)."""
    m, k = q.shape
    m_pad = -(-m // pad_to) * pad_to
    u = q.view(torch.uint8)
    if torch.compiler.is_compiling():  # functional, no branch on m_pad != m (see _scale_and_cast)
        t = F.pad(u, (0, 0, 0, m_pad - m)).t().contiguous()
    else:
        t = torch.empty((k, m_pad), dtype=torch.uint8, device=q.device)
        if m_pad != m:
            t[:, m:] = 0
        t[:, :m].copy_(u.t())
    return t.view(q.dtype)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "scaled_mm" if device.type == "cuda" else "emulate"
    if backend == "scaled_mm" and device.type not in ("cuda", "meta"):  # meta: shapes and layout checks only
        raise RuntimeError("fp8 backend 'scaled_mm' needs CUDA tensors (use 'emulate' on CPU)")
    return backend


def fp8_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor, *,
           backend: str = "auto", fast_accum: bool = False) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale)`` rounded to bf16: a_q [M, K] FP8 row-major, b_q [K, N] FP8 column-major
    (the transpose of a row-major [N, K]) -> [M, N] bfloat16. Scales fp32, both rowwise -- a_scale [M, 1],
    b_scale [1, N] -- or both tensorwise (0-dim or 1-element: ``_scaled_mm`` reads any 1-element fp32 scale as
    tensorwise, and takes no mixed pair). bf16 is the only output type of rowwise-scaled ``_scaled_mm`` on sm90,
    and the one both recipes use.

    backend "scaled_mm": ``torch._scaled_mm`` (sm89+; K and N multiples of 16): the FP8 products
    accumulated in fp32, then ``acc * a_scale[m] * b_scale[n]`` rounded once to bf16 (tensorwise: cuBLAS's
    ``scale_a * scale_b * acc``, the same arithmetic with one scale each). "emulate" (any device)
    models exactly that: the dequantized operands (each FP8 value times its fp32 scale: exact but for one fp32
    rounding) multiplied with fp32 accumulation, rounded once to bf16 -- the same FP8 bytes and scales, so the
    two differ only by the accumulation's order (and ``fast_accum``'s reduced-precision accumulator: Hopper's
    fast FP8 accumulation, which torchao uses for the forward GEMM only), which can move an output across a bf16
    rounding boundary: at most one bf16 ulp per element. Scales are used as given (no power-of-two rounding) and
    multiply (``amax / fp8_max``, the dequantization scale, not its reciprocal). Raises ValueError on a rowwise /
    tensorwise mix of scales, RuntimeError for "scaled_mm" off CUDA."""
    if (a_scale.dim() == 0) != (b_scale.dim() == 0):  # static (dims, not sizes): no guard under torch.compile
        raise ValueError(f"fp8_mm: scales must be both rowwise or both tensorwise (0-dim), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    backend = _resolve_backend(backend, a_q.device)
    if 0 in (a_q.shape[0], a_q.shape[1], b_q.shape[1]):  # an empty batch (B = 0 trailing steps): no GEMM to run
        return torch.zeros((a_q.shape[0], b_q.shape[1]), dtype=torch.bfloat16, device=a_q.device)
    if backend == "emulate":  # fp32 matmul of the dequantized operands, also inside an autocast region
        with torch.autocast(a_q.device.type, enabled=False):
            return ((a_q.float() * a_scale) @ (b_q.float() * b_scale)).to(torch.bfloat16)
    # _scaled_mm takes a row-major a and a column-major b only. The callers' operands are in those layouts in
    # eager mode (but for the tensorwise dgrad's b, the forward's row-major w_q [N, K]: the transposed copy of
    # its bytes is made here, 1 byte per weight element), but under torch.compile the FP8 copy of a transposed
    # weight view (HSTU's uvqk_weight.t()) is traced with the view's strides, and the compiled step failed
    # ("mat2 must be col_major"): make the layouts explicit (a no-op where they already hold).
    a_q, b_q = a_q.contiguous(), b_q.t().contiguous().t()  # unconditional: the graph must carry them
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale.float().contiguous(), scale_b=b_scale.float().contiguous(),
                            out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


# ----------------------------------------------------------------------------------------------------------
# the weights' FP8 copies, once per training step
# ----------------------------------------------------------------------------------------------------------
_WCACHE: dict | None = None  # None: no step open (every use quantizes)


@contextlib.contextmanager
def fp8_weight_cache():
    """Within this block (one training step: forward, backward, activation-checkpoint recomputes) each weight is
    quantized at most once per layout -- rowwise over K for the forward, over N for the dgrad -- and its FP8 copy
    reused by every later use (a recompute, a weight shared by two GEMMs). A copy is keyed on the weight
    tensor's identity (a view's: its base parameter's, with the view's shape / strides / offset) and its version
    counter, so an in-place update (the optimizer step) is never served a
    stale copy; the copies are dropped when the block ends."""
    global _WCACHE
    outer, _WCACHE = _WCACHE, {}
    try:
        yield
    finally:
        _WCACHE = outer


def _quantize_weight(w: torch.Tensor, dim: int, stats_key: str = "", recipe: str = "rowwise"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rowwise(w, E4M3, -1) (dim -1: the forward's [N, K] rowwise) or of w.t() (dim 0: the dgrad's
    [K, N] rowwise over N); recipe "tensorwise": quantize_tensorwise(w) (dim -1 only: its bytes serve the dgrad
    too). Through the step's cache when one is open (stats are recorded on a miss only)."""
    src = w if dim == -1 else w.t()

    def quantize():
        if recipe == "tensorwise":
            return quantize_tensorwise(src, E4M3, stats_key=stats_key)
        return quantize_rowwise(src, E4M3, -1, stats_key=stats_key)

    if torch.compiler.is_compiling() or _WCACHE is None:  # this order: a traced step never reads _WCACHE
        # Under torch.compile the cache's keys (id, the version counter) would break the graph -- a graph break
        # per GEMM left every quantization eager (the compiled FP8 GEM step measured 297 ms against bf16's
        # 165 on the H200, 2026-12-04) -- so a traced step quantizes the weight at each use and inductor fuses
        # that into the GEMM's neighbours; the weights are ~1/30 of the activations a step quantizes.
        return quantize()
    base = w if w._base is None else w._base  # HSTU passes a fresh view (uvqk_weight.t()) per call: key the parameter
    key = (id(base), tuple(w.shape), w.stride(), w.storage_offset(), dim, recipe)
    hit = _WCACHE.get(key)
    if hit is not None and hit[0]() is base and hit[1] == w._version:  # a view shares its base's version counter
        return hit[2]
    val = quantize()
    _WCACHE[key] = (weakref.ref(base), w._version, val)
    return val


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w^T + b with FP8 GEMMs (module docstring). x [M, K], w [N, K], b [N] or None; x_q / x_s: an
    FP8 copy of x made by the caller with the recipe's scales ([M, 1] rowwise, 0-dim tensorwise), or None. y is
    bf16 (the GEMM's output on both backends), dx / dw / db in the dtypes of x / w / b.

    Saved for the backward: rowwise, and any recipe with grad "bf16": x and w (the high-precision tensors the
    backward re-quantizes or multiplies). Tensorwise with FP8 gradients: x_q, x_s, w_q, w_s -- the forward's FP8
    bytes (1 byte per element of x instead of x's 2 (bf16) or 4 (fp32, a LayerNorm's output under autocast)),
    which the backward's GEMMs reuse as they are.

    Extra kernels per call beyond the bf16 layer's three GEMMs (counted on the eager code below; each
    quantization = 1 amax reduction + 2 tiny scale kernels + 1 multiply + 1 cast). Rowwise -- forward: quantize
    x (skipped when the fused norm gave x_q), quantize w (once per step with :func:`fp8_weight_cache`), two scale
    copies into _scaled_mm; dgrad: quantize g rowwise, quantize w^T (once per step), cast dx to x's dtype;
    wgrad: quantize g^T and x^T (a transposing write each, zero-padded to a multiple of 16 tokens in place), cast
    dw to w's dtype. Tensorwise -- forward: quantize x, quantize w (once per step); backward: quantize g once,
    then byte copies only: w_q transposed for the dgrad, g_q and x_q transposed (padded to 16 tokens) for the
    wgrad; the casts of dx / dw. Both: the bias, one cast + add forward, one sum backward. The numerics counters
    add ~4 reductions per quantization, only inside :func:`collect_fp8_stats` (the trainer's log steps)."""

    @staticmethod
    def forward(ctx, x, w, b, x_q, x_s, settings: Fp8Settings):
        backend = _resolve_backend(settings.backend, x.device)
        name = settings.name
        tensorwise = settings.recipe == "tensorwise"
        if x_q is None:
            if tensorwise:
                x_q, x_s = quantize_tensorwise(x, E4M3, stats_key=f"{name}.x")
            else:
                x_q, x_s = quantize_rowwise(x, E4M3, -1, stats_key=f"{name}.x")
        else:
            _record_quantized(f"{name}.x", x, x_q, x_s, FP8_MAX[E4M3])
        w_q, w_s = _quantize_weight(w, -1, stats_key=f"{name}.w", recipe=settings.recipe)
        y = fp8_mm(x_q, x_s, w_q.t(), w_s.t(), backend=backend, fast_accum=True)
        if b is not None:
            y = y + b.to(y.dtype)
        if tensorwise and settings.grad != "bf16":
            ctx.save_for_backward(x_q, x_s, w_q, w_s)
        else:
            ctx.save_for_backward(x, w)
        ctx.settings, ctx.backend, ctx.has_bias = settings, backend, b is not None
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        s, backend = ctx.settings, ctx.backend
        x_dt, w_dt, b_dt = ctx.dtypes
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        gdt = E5M2 if s.grad == "e5m2" else E4M3
        if s.grad == "bf16":
            x, w = ctx.saved_tensors
            hp = torch.bfloat16  # cuBLAS's bf16 GEMMs on CUDA; the same inputs and output rounding emulated
            gh = g.to(hp)
            if need_dx:
                dx = (gh @ w.to(hp)).to(x_dt)
            if need_dw:
                dw = (gh.t() @ x.to(hp)).to(w_dt)
        elif s.recipe == "tensorwise":  # one quantization of g; every operand's FP8 bytes reused, transposed
            x_q, x_s, w_q, w_s = ctx.saved_tensors
            if need_dx or need_dw:
                g_q, g_s = quantize_tensorwise(g, gdt, stats_key=f"{s.name}.grad")
            if need_dx:  # dx [M, K] = g [M, N] @ w [N, K]: b = the forward's w_q (fp8_mm makes it column-major)
                dx = fp8_mm(g_q, g_s, w_q, w_s, backend=backend).to(x_dt)
            if need_dw:  # dw [N, K] = g^T [N, M'] @ x [M', K]: contraction over M, zero-padded to 16
                dw = fp8_mm(_transpose_fp8(g_q), g_s, _transpose_fp8(x_q).t(), x_s, backend=backend).to(w_dt)
        else:
            x, w = ctx.saved_tensors
            if need_dx:  # dx [M, K] = g [M, N] @ w [N, K]: contraction over N
                g_q, g_s = quantize_rowwise(g, gdt, -1, stats_key=f"{s.name}.grad")
                wt_q, wt_s = _quantize_weight(w, 0)                         # [K, N] rowwise over N
                dx = fp8_mm(g_q, g_s, wt_q.t(), wt_s.t(), backend=backend).to(x_dt)
            if need_dw:  # dw [N, K] = g^T [N, M] @ x [M, K]: contraction over M (padded to 16)
                gt_q, gt_s = quantize_rowwise(g.t(), gdt, -1, pad_to=16)   # [N, M'] rowwise over M
                xt_q, xt_s = quantize_rowwise(x.t(), E4M3, -1, pad_to=16)  # [K, M'] rowwise over M
                dw = fp8_mm(gt_q, gt_s, xt_q.t(), xt_s.t(), backend=backend).to(w_dt)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0, dtype=torch.float32).to(b_dt)  # one pass, fp32 accumulation
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: Fp8Settings, *,
               x_fp8: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` with FP8 GEMMs (forward e4m3 with ``settings.recipe``'s scales; backward per
    ``settings.grad``).

    Args:
        x: [M, K] float (the high-precision activation; saved for the backward unless the recipe is tensorwise
            with FP8 gradients, which saves its e4m3 copy). M may be 0.
        weight: [N, K] (nn.Linear layout; a transposed view of a [K, N] parameter works), bias: [N] or None.
        settings: :class:`Fp8Settings`.
        x_fp8, x_scale: optional [M, K] float8_e4m3fn and its float32 scale -- [M, 1] rowwise (e.g. from
            ``norm_quant(..., block_size=K)``), 0-dim tensorwise (:func:`quantize_tensorwise`), as the recipe
            says (x ~= x_fp8 * x_scale); skips the activation quantization.
    Returns [M, N] bfloat16 on both backends (``_scaled_mm``'s output; the emulation models it).
    Raises ValueError on mismatched shapes, or an x_scale of the other recipe.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: expected x [M, K] and weight [N, K], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    scale_shape = () if settings.recipe == "tensorwise" else (x.shape[0], 1)
    if (x_fp8 is None) != (x_scale is None) or (x_fp8 is not None and (x_fp8.shape != x.shape
                                                                       or x_scale.shape != scale_shape)):
        raise ValueError(f"fp8_linear: x_fp8 [M, K] and x_scale {list(scale_shape)} ({settings.recipe}) go "
                         "together")
    return _Fp8Linear.apply(x, weight, bias, x_fp8, x_scale, settings)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8 (:func:`fp8_linear`); same parameters and state-dict keys."""

    fp8: Fp8Settings

    @classmethod
    def from_linear(cls, lin: nn.Linear, settings: Fp8Settings) -> "Fp8Linear":
        """Wrap ``lin``'s own parameters (shared, not copied; works on the meta device)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        new.fp8 = settings
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.bias, self.fp8)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8_recipe={self.fp8.recipe}, fp8_grad={self.fp8.grad}"


# ----------------------------------------------------------------------------------------------------------
# the model converter
# ----------------------------------------------------------------------------------------------------------
def fp8_eligible(k: int, n: int, min_dim: int = MIN_DIM) -> str | None:
    """Why a [K -> N] GEMM stays high precision (None: it is converted). Both must be multiples of 16
    (``_scaled_mm``) and >= ``min_dim``."""
    if k % 16 or n % 16:
        return f"dims {k}x{n} not multiples of 16"
    if min(k, n) < min_dim:
        return f"dims {k}x{n} below min_dim {min_dim}"
    return None


def convert_to_fp8(model: nn.Module, grad: str = "e4m3", *, min_dim: int = MIN_DIM, backend: str = "auto",
                   recipe: str = "rowwise") -> dict[str, list[str]]:
    """Swap the model's GEMMs to FP8 in place, before parallelize (torchtitan's "model converters").

    Converted: every ``HSTUBlock`` (its uvqk projection, fed by the norm-fused FP8 LayerNorm, and its output
    projection: ``block.fp8`` is set) and every ``nn.Linear`` (replaced by :class:`Fp8Linear`, sharing its
    parameters) whose dims pass :func:`fp8_eligible`. Embedding tables are untouched. recipe: "rowwise" or
    "tensorwise" (:class:`Fp8Settings`), the same for every converted GEMM.

    Returns {"converted": [names], "skipped": ["name: why"]} (also logged). Raises ValueError on a bad grad /
    backend / recipe.
    """
    from gemray.model.hstu import HSTUBlock

    Fp8Settings(grad, backend, recipe=recipe)  # validate
    converted: list[str] = []
    skipped: list[str] = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, HSTUBlock):
            why = fp8_eligible(mod.d, mod.uvqk_weight.shape[1], min_dim) or fp8_eligible(
                mod.h * mod.v, mod.d, min_dim)
            if why:
                skipped.append(f"{name}: {why}")
            else:
                mod.fp8 = Fp8Settings(grad, backend, name, recipe)
                converted.append(name)
        for cname, child in list(mod.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{cname}" if name else cname
                why = fp8_eligible(child.in_features, child.out_features, min_dim)
                if why:
                    skipped.append(f"{full}: {why}")
                else:
                    setattr(mod, cname, Fp8Linear.from_linear(child, Fp8Settings(grad, backend, full, recipe)))
                    converted.append(full)
    log.info("fp8: converted %d GEMM modules, %s scales, %s gradients (%s); kept high precision: %s",
             len(converted), recipe, grad, ", ".join(converted) or "none", "; ".join(skipped) or "none")
    if not converted:  # precision "fp8" would silently train as bf16 (a small model under fp8_min_dim)
        log.warning("fp8: no GEMM was converted (every one is below train.fp8_min_dim = %d or not a multiple of 16): "
                    "this run trains in bf16; lower train.fp8_min_dim (>= 16) to run FP8 on a model this small",
                    min_dim)
    return {"converted": converted, "skipped": skipped}
