"""FP8 (e4m3) training GEMMs with rowwise scales, the norm-fused activation quantization, and numerics counters.

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
FP8 copies exist only inside a GEMM. The output is bf16 on CUDA (what rowwise ``_scaled_mm`` produces on sm90).

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
bytes and multiplies the dequantized operands in fp32, so CPU tests exercise the scaling code; ``"scaled_mm"``
(the default on CUDA) calls ``torch._scaled_mm``. The two differ only by the GEMM's accumulation order.

Outlier handling: scales are *current* (computed from this call's amax, no amax history: a spike cannot
overflow a stale scale) and per row, so one outlier token or output channel coarsens only its own row's grid,
not the tensor's. A row's amax maps exactly to +-448 (e4m3) / +-57344 (e5m2), so nothing saturates except
non-finite inputs; the cost of an outlier is underflow of the small values in its row (|v| < amax * 2^-17
for e4m3 flushes to 0). An all-zero row gets scale 0 and q = 0. Gradients can use e5m2 (2^-16..57344) for a
wider range within a row. The numerics counters below measure exactly these two effects per layer:

* ``amax``: the max |x| / |w| / |grad| seen (fp32);
* ``overflow``: fraction of values saturated at the FP8 max (|v * inv_scale| > fp8_max before the clamp,
  beyond fp32 rounding: non-finite inputs with current scaling);
* ``underflow``: fraction of nonzero values quantized to 0.

They are collected only inside :func:`collect_fp8_stats` (the trainer opens it every ``train.log_every``
steps), as device tensors summed per layer, and read once by :func:`pop_fp8_stats`.
"""

from __future__ import annotations

import contextlib
import logging
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
MIN_DIM = 128  # default smallest K / N converted (smaller GEMMs gain nothing from FP8 and lose precision)


@dataclass(frozen=True)
class Fp8Settings:
    """How one converted layer runs. grad: "e4m3" / "e5m2" (FP8 dgrad + wgrad, gradients in that format) or
    "bf16"; backend: "auto" (scaled_mm
    on CUDA, emulate elsewhere), "scaled_mm" or "emulate"; name: the layer's qualified name (stats key)."""

    grad: str = "e4m3"
    backend: str = "auto"
    name: str = ""

    def __post_init__(self):
        if self.grad not in GRAD_FORMATS:
            raise ValueError(f"fp8 grad format: expected one of {GRAD_FORMATS}, got {self.grad!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"fp8 backend: expected one of {BACKENDS}, got {self.backend!r}")


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
    if _STATS is None or not key:
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
    if _STATS is None or not key:
        return
    with torch.no_grad():
        inv = torch.where(scale > 0, 1.0 / scale.clamp_min(1e-30), torch.zeros_like(scale))
        _record(key, x, x.float() * inv, q, fmax)


# ----------------------------------------------------------------------------------------------------------
# quantization
# ----------------------------------------------------------------------------------------------------------
def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3, dim: int = -1, *, stats_key: str = ""
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale + cast ``x`` [M, K] to FP8 with one scale per slice along ``dim`` (the GEMM's contraction).

    dim=-1: scale [M, 1] (one per row); dim=0: scale [1, K] (one per column). ``scale = amax / fp8_max``
    (float32, 0 for an all-zero slice) and ``q = clamp(x * (fp8_max / amax), +-fp8_max)`` cast with
    round-to-nearest-even -- the same arithmetic as ``gemray.kernels.reference.quantize_blocks_ref`` /
    the fused norm kernel, so ``quantize_rowwise(y)`` equals the kernel's ``(y_fp8, scales)`` for
    ``block_size = K``. Returns (q [M, K] ``dtype``, contiguous row-major; scale). ``x ~= q.float() * scale``.
    Raises ValueError for a non-FP8 dtype or x not 2-D.
    """
    if dtype not in FP8_MAX:
        raise ValueError(f"quantize_rowwise: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise: x must be 2-D [M, K], got {tuple(x.shape)}")
    fmax = FP8_MAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=dim, keepdim=True) if x.numel() else xf.new_zeros(
        (x.shape[0], 1) if dim in (-1, 1) else (1, x.shape[1]))
    nz = amax > 0
    inv = torch.where(nz, fmax / torch.where(nz, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    scaled = xf * inv
    q = scaled.clamp(-fmax, fmax).to(dtype).contiguous()
    _record(stats_key, x, scaled, q, fmax)
    return q, amax / fmax


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "scaled_mm" if device.type == "cuda" else "emulate"
    if backend == "scaled_mm" and device.type != "cuda":
        raise RuntimeError("fp8 backend 'scaled_mm' needs CUDA tensors (use 'emulate' on CPU)")
    return backend


def fp8_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
           out_dtype: torch.dtype, *, backend: str = "auto", fast_accum: bool = False) -> torch.Tensor:
    """``(a_q * a_scale) @ (b_q * b_scale)``: a_q [M, K] FP8 row-major, a_scale [M, 1] fp32; b_q [K, N] FP8
    column-major (the transpose of a row-major [N, K]), b_scale [1, N] fp32 -> [M, N] ``out_dtype``.

    backend "scaled_mm": ``torch._scaled_mm`` (rowwise scales, sm89+; K and N multiples of 16; out_dtype
    bf16); "emulate": dequantize to fp32 and matmul (any device). fast_accum: Hopper's fast FP8 accumulation
    (torchao uses it for the forward GEMM only)."""
    backend = _resolve_backend(backend, a_q.device)
    if 0 in (a_q.shape[0], a_q.shape[1], b_q.shape[1]):  # an empty batch (B = 0 trailing steps): no GEMM to run
        return torch.zeros((a_q.shape[0], b_q.shape[1]), dtype=out_dtype, device=a_q.device)
    if backend == "emulate":  # fp32 matmul of the dequantized operands, also inside an autocast region
        with torch.autocast(a_q.device.type, enabled=False):
            return ((a_q.float() * a_scale) @ (b_q.float() * b_scale)).to(out_dtype)
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale.float().contiguous(), scale_b=b_scale.float().contiguous(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


def _out_dtype(x: torch.Tensor, backend: str) -> torch.dtype:
    if backend == "scaled_mm":
        return torch.bfloat16
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w^T + b with FP8 GEMMs (module docstring). x [M, K], w [N, K], b [N] or None; x_q / x_s: an
    FP8 copy of x with rowwise scales made by the caller (the fused norm), or None."""

    @staticmethod
    def forward(ctx, x, w, b, x_q, x_s, settings: Fp8Settings):
        backend = _resolve_backend(settings.backend, x.device)
        name = settings.name
        if x_q is None:
            x_q, x_s = quantize_rowwise(x, E4M3, -1, stats_key=f"{name}.x")
        else:
            _record_quantized(f"{name}.x", x, x_q, x_s, FP8_MAX[E4M3])
        w_q, w_s = quantize_rowwise(w, E4M3, -1, stats_key=f"{name}.w")
        out_dtype = _out_dtype(x, backend)
        y = fp8_mm(x_q, x_s, w_q.t(), w_s.t(), out_dtype, backend=backend, fast_accum=True)
        if b is not None:
            y = y + b.to(y.dtype)
        ctx.save_for_backward(x, w)
        ctx.settings, ctx.backend, ctx.has_bias = settings, backend, b is not None
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        s, backend = ctx.settings, ctx.backend
        x_dt, w_dt, b_dt = ctx.dtypes
        dx = dw = db = None
        if s.grad == "bf16":
            hp = torch.bfloat16 if backend == "scaled_mm" else g.dtype
            gh = g.to(hp)
            if ctx.needs_input_grad[0]:
                dx = (gh @ w.to(hp)).to(x_dt)
            if ctx.needs_input_grad[1]:
                dw = (gh.t() @ x.to(hp)).to(w_dt)
        else:
            out_dt = torch.bfloat16 if backend == "scaled_mm" else torch.float32
            gdt = E5M2 if s.grad == "e5m2" else E4M3
            if ctx.needs_input_grad[0]:  # dx [M, K] = g [M, N] @ w [N, K]: contraction over N
                g_q, g_s = quantize_rowwise(g, gdt, -1, stats_key=f"{s.name}.grad")
                wt_q, wt_s = quantize_rowwise(w.t(), E4M3, -1)          # [K, N] rowwise over N
                dx = fp8_mm(g_q, g_s, wt_q.t(), wt_s.t(), out_dt, backend=backend).to(x_dt)
            if ctx.needs_input_grad[1]:  # dw [N, K] = g^T [N, M] @ x [M, K]: contraction over M (padded to 16)
                gt_q, gt_s = quantize_rowwise(_pad_rows(g).t(), gdt, -1)   # [N, M'] rowwise over M
                xt_q, xt_s = quantize_rowwise(_pad_rows(x).t(), E4M3, -1)  # [K, M'] rowwise over M
                dw = fp8_mm(gt_q, gt_s, xt_q.t(), xt_s.t(), out_dt, backend=backend).to(w_dt)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.float().sum(0).to(b_dt)
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: Fp8Settings, *,
               x_fp8: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` with FP8 GEMMs (forward e4m3 rowwise; backward per ``settings.grad``).

    Args:
        x: [M, K] float (the high-precision activation; saved for the backward). M may be 0.
        weight: [N, K] (nn.Linear layout; a transposed view of a [K, N] parameter works), bias: [N] or None.
        settings: :class:`Fp8Settings`.
        x_fp8, x_scale: optional [M, K] float8_e4m3fn and [M, 1] float32 (x ~= x_fp8 * x_scale), e.g. from
            ``norm_quant(..., block_size=K)``; skips the activation quantization.
    Returns [M, N]: bf16 on the scaled_mm backend, else the autocast dtype or x.dtype.
    Raises ValueError on mismatched shapes.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: expected x [M, K] and weight [N, K], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if (x_fp8 is None) != (x_scale is None) or (x_fp8 is not None and (x_fp8.shape != x.shape
                                                                       or x_scale.shape != (x.shape[0], 1))):
        raise ValueError("fp8_linear: x_fp8 [M, K] and x_scale [M, 1] go together")
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
        return super().extra_repr() + f", fp8_grad={self.fp8.grad}"


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


def convert_to_fp8(model: nn.Module, grad: str = "e4m3", *, min_dim: int = MIN_DIM, backend: str = "auto"
                   ) -> dict[str, list[str]]:
    """Swap the model's GEMMs to FP8 in place, before parallelize (torchtitan's "model converters").

    Converted: every ``HSTUBlock`` (its uvqk projection, fed by the norm-fused FP8 LayerNorm, and its output
    projection: ``block.fp8`` is set) and every ``nn.Linear`` (replaced by :class:`Fp8Linear`, sharing its
    parameters) whose dims pass :func:`fp8_eligible`. Embedding tables are untouched.

    Returns {"converted": [names], "skipped": ["name: why"]} (also logged). Raises ValueError on a bad grad /
    backend.
    """
    from gemray.model.hstu import HSTUBlock

    Fp8Settings(grad, backend)  # validate
    converted: list[str] = []
    skipped: list[str] = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, HSTUBlock):
            why = fp8_eligible(mod.d, mod.uvqk_weight.shape[1], min_dim) or fp8_eligible(
                mod.h * mod.v, mod.d, min_dim)
            if why:
                skipped.append(f"{name}: {why}")
            else:
                mod.fp8 = Fp8Settings(grad, backend, name)
                converted.append(name)
        for cname, child in list(mod.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{cname}" if name else cname
                why = fp8_eligible(child.in_features, child.out_features, min_dim)
                if why:
                    skipped.append(f"{full}: {why}")
                else:
                    setattr(mod, cname, Fp8Linear.from_linear(child, Fp8Settings(grad, backend, full)))
                    converted.append(full)
    log.info("fp8: converted %d GEMM modules (%s); kept high precision: %s", len(converted),
             ", ".join(converted) or "none", "; ".join(skipped) or "none")
    return {"converted": converted, "skipped": skipped}
