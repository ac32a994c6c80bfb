"""Op dispatch: one jagged attention entry point, routed to the Triton kernels or the PyTorch reference.

Shape key: T total tokens, B sequences, H heads, Dqk / Dv per-head widths, N = max_len.

Backends (:class:`AttentionBackend`, or its value as a string: the config's ``model.attention_backend``):
    REFERENCE ("reference"): ``gemray.kernels.reference`` (any device; the spec).
    TRITON ("triton"): ``gemray.kernels.jagged_attention.jagged_attention_triton`` (the ``gemray::gdpa_*`` custom
        ops), on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter: tests). A
        call it cannot run (triton or the kernel module not importable, tensors on another device) raises
        RuntimeError with the reason; nothing falls back.
    AUTO ("auto"): TRITON when the tensors are on CUDA and the kernel module imports, else REFERENCE; the
        choice (and, on CUDA, why Triton was not taken) is logged once per (choice, device type).
Like generative-recommenders' ``hstu_mha(..., kernel=HammerKernel.TRITON)``, the backend is an explicit enum
argument; unlike it, an explicit backend never silently becomes another.

Relative attention bias: ``rel_bias`` (a :class:`RelativeBiasInputs`, the HSTU position / time bias ingredients)
or a dense ``attn_bias`` [B, n', n']. The reference takes the ingredients (grouped by length, no dense tensor);
the Triton kernels take a dense bias, which :func:`_triton_bias` materialises from the ingredients here -- the
seam where a kernel that takes the ingredients itself (buckets and weights) will plug in.
"""

from __future__ import annotations

import enum
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from gemray.kernels import reference as _ref
from gemray.kernels.config import KernelConfig

log = logging.getLogger(__name__)

TRITON_MODULE = "gemray.kernels.jagged_attention"


class AttentionBackend(enum.Enum):
    """Which implementation ``attention`` runs (see the module docstring)."""

    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"

    @classmethod
    def parse(cls, value: "AttentionBackend | str") -> "AttentionBackend":
        """The backend for an enum member or its value ("auto" / "triton" / "reference"). Raises ValueError
        for anything else."""
        if isinstance(value, AttentionBackend):
            return value
        member = _BACKENDS_BY_VALUE.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"attention backend must be one of {BACKENDS} or an AttentionBackend, got {value!r}")
        return member


_BACKENDS_BY_VALUE = {b.value: b for b in AttentionBackend}
BACKENDS = tuple(_BACKENDS_BY_VALUE)  # ("auto", "triton", "reference"): the config's choices


@dataclass
class RelativeBiasInputs:
    """Ingredients of the HSTU relative attention bias (see ``kernels.reference.relative_bias_ref``).

    timestamps: [T] int64 unix seconds; pos_weights: [P] float (relative-position buckets,
    ``position_bucket_ref``); ts_weights: [Q] float (time-difference buckets, ``time_bucket_ref``);
    max_len: N used by the position bucketing. Shared by all heads.
    buckets: optional precomputed ``relative_bias_buckets(...)`` (pos [n, n], time [B, n, n]) so that
    several blocks sharing timestamps bucketise once.
    """

    timestamps: torch.Tensor
    pos_weights: torch.Tensor
    ts_weights: torch.Tensor
    max_len: int
    buckets: tuple[torch.Tensor, torch.Tensor] | None = None
    cache: dict | None = None  # shared by the blocks of one forward: per-group bucket slices
    # [T] int64 query time of each position (``gemray.jagged.query_timestamps``); None = ``timestamps``,
    # i.e. the time bias buckets ts_i - ts_j instead of HSTU's ts_{i+1} - ts_j.
    query_timestamps: torch.Tensor | None = None

    def dense(self, offsets: torch.Tensor, n: int) -> torch.Tensor:
        """Materialise to [B, n, n] float (differentiable in the weights)."""
        if self.buckets is not None and self.buckets[0].shape[-1] == n:
            pb, tb = self.buckets
            return bucket_gather(self.pos_weights, pb).unsqueeze(0) + bucket_gather(self.ts_weights, tb)
        if self.query_timestamps is not None:
            pb, tb = relative_bias_buckets(self.timestamps, offsets, n, self.pos_weights.numel(),
                                           self.ts_weights.numel(), self.max_len, self.query_timestamps)
            return bucket_gather(self.pos_weights, pb).unsqueeze(0) + bucket_gather(self.ts_weights, tb)
        return _ref.relative_bias_ref(self.timestamps, offsets, n, self.pos_weights, self.ts_weights,
                                      self.max_len)

    def group_bias_fn(self, offsets: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """``(seqs [G] int64, m) -> [G, 1, m, m]`` bias of those sequences (for the grouped reference)."""
        n = _longest(offsets)
        if self.buckets is not None and self.buckets[0].shape[-1] >= n:
            pb, tb = self.buckets
        else:
            pb, tb = relative_bias_buckets(self.timestamps, offsets, n, self.pos_weights.numel(),
                                           self.ts_weights.numel(), self.max_len, self.query_timestamps)

        cache = self.cache if self.cache is not None else {}

        def fn(seqs: torch.Tensor, m: int) -> torch.Tensor:
            key = (int(seqs[0]) if seqs.numel() else -1, seqs.numel(), m)
            if key not in cache:
                cache[key] = (pb[:m, :m].contiguous(), tb[:, :m, :m][seqs])
            pbm, tbg = cache[key]
            return (bucket_gather(self.pos_weights, pbm).unsqueeze(0)
                    + bucket_gather(self.ts_weights, tbg)).unsqueeze(1)

        return fn


class _BucketGather(torch.autograd.Function):
    """weights[idx] whose backward is one ``bincount`` (the default index backward sorts millions of
    indices into a few dozen buckets, which dominated CPU step time)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.num = weights.numel()
        return weights[idx]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (idx,) = ctx.saved_tensors
        g = torch.bincount(idx.reshape(-1), weights=grad.reshape(-1), minlength=ctx.num)
        return g.to(grad.dtype), None


def bucket_gather(weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """weights [Q] float, idx int64 (any shape, values in [0, Q)) -> weights[idx], same shape as idx. Eager: the
    bincount backward (_BucketGather); under torch.compile plain indexing (bincount's output size depends on the
    data, which would break the graph; the compiled index backward is a scatter-add)."""
    if torch.compiler.is_compiling():
        return weights[idx]
    return _BucketGather.apply(weights, idx)


def relative_bias_buckets(timestamps: torch.Tensor, offsets: torch.Tensor, n: int, num_pos_buckets: int,
                          num_time_buckets: int, max_len: int, query_timestamps: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket indices of the relative bias: (pos [n, n] int64, time [B, n, n] int64).

    Same bucketing as ``kernels.reference.relative_bias_ref`` (position |i-j|, time tq_i - ts_j).
    timestamps: [T] int64 (keys); offsets: [B+1] int64; n >= the longest sequence; query_timestamps:
    optional [T] int64 query times tq (default ``timestamps``; HSTU: the next item's time, see
    ``gemray.jagged.query_timestamps``).
    """
    B = offsets.numel() - 1
    ids = torch.arange(n, device=offsets.device)
    pb = _ref.position_bucket_ref(ids.view(n, 1) - ids.view(1, n), num_pos_buckets, max_len)
    if n == 0:
        return pb, torch.zeros((B, 0, 0), dtype=torch.int64, device=offsets.device)
    ts = _ref._pad(timestamps.view(-1, 1).to(torch.float64), offsets, n).view(B, n)
    tq = ts if query_timestamps is None else \
        _ref._pad(query_timestamps.view(-1, 1).to(torch.float64), offsets, n).view(B, n)
    tb = _ref.time_bucket_ref(tq.unsqueeze(2) - ts.unsqueeze(1), num_time_buckets)
    return pb, tb


_TRITON: list = []  # [(kernel module or None, why it does not import or None)] once imported


def _triton_module():
    """(the kernel module, None) or (None, why it is not importable); imported once. A module imported already
    (sys.modules) is taken as is, so that a call traced by torch.compile never imports."""
    if _TRITON:
        return _TRITON[0]
    mod = sys.modules.get(TRITON_MODULE)
    if mod is not None:
        return mod, None
    try:
        mod, err = importlib.import_module(TRITON_MODULE), None
    except ImportError as e:  # triton (or the kernel module) is not installed
        mod, err = None, f"{TRITON_MODULE} is not importable ({e})"
    _TRITON.append((mod, err))
    return mod, err


def choose_backend(requested: AttentionBackend, device_type: str, triton_error: str | None,
                   interpreting: bool) -> tuple[AttentionBackend, str]:
    """The pure rule behind :func:`resolve_backend`: (TRITON or REFERENCE, why). ``triton_error``: why the kernel
    module does not import (None: it does); ``interpreting``: the kernels run in Triton's CPU interpreter (then
    they take CPU tensors, not CUDA ones). Raises RuntimeError when TRITON was asked for and cannot run."""
    if requested is AttentionBackend.REFERENCE:
        return AttentionBackend.REFERENCE, "requested"
    kernel_device = "cpu" if interpreting else "cuda"
    if requested is AttentionBackend.TRITON:
        if triton_error is not None:
            raise RuntimeError(f"attention backend 'triton' requested but {triton_error}")
        if device_type != kernel_device:
            raise RuntimeError(
                f"attention backend 'triton' requested but the tensors are on {device_type}; the Triton kernels "
                f"run on {kernel_device} tensors here" + ("" if interpreting else
                                                         " (CPU tensors only under TRITON_INTERPRET=1)")
                + " -- use backend 'reference' or 'auto'")
        return AttentionBackend.TRITON, "requested"
    if device_type != "cuda":
        return AttentionBackend.REFERENCE, f"tensors on {device_type}"
    if triton_error is not None:
        return AttentionBackend.REFERENCE, triton_error
    return AttentionBackend.TRITON, "tensors on cuda"


# (requested, device type) -> chosen: a plain dict (under torch.compile a hit is a guarded constant, nothing traced)
_CHOSEN: dict[tuple[AttentionBackend, str], AttentionBackend] = {}


def resolve_backend(backend: AttentionBackend | str, device: torch.device) -> AttentionBackend:
    """TRITON or REFERENCE for a requested backend and the tensors' device, decided and logged once per pair
    (by the first eager call: dynamo cannot trace logging, so a call traced by torch.compile decides without
    logging or remembering).

    Raises ValueError for an unknown backend name and RuntimeError (with the reason) when TRITON is requested
    but cannot run here.
    """
    key = (AttentionBackend.parse(backend), torch.device(device).type)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        mod, err = _triton_module() if key[0] is not AttentionBackend.REFERENCE else (None, None)
        chosen, why = choose_backend(key[0], key[1], err, bool(mod is not None and mod.interpreting()))
        if not torch.compiler.is_compiling():
            log.info("gemray.ops.attention: %s backend on %s (%s: %s)", chosen.value, key[1], key[0].value, why)
            _CHOSEN[key] = chosen
    return chosen


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, *,
              activation: str = "silu", causal: bool = True, attn_bias: torch.Tensor | None = None,
              rel_bias: RelativeBiasInputs | None = None, alpha: float | None = None,
              num_targets: torch.Tensor | None = None, backend: AttentionBackend | str = AttentionBackend.AUTO,
              config: KernelConfig | None = None) -> torch.Tensor:
    """Jagged attention ``q [T,H,Dqk], k [T,H,Dqk], v [T,H,Dv], offsets [B+1] int64 -> [T,H,Dv]``.

    Semantics (masks, activations, alpha default, N normaliser) are those of
    ``gemray.kernels.reference.jagged_attention_ref``. ``attn_bias`` ([B, n', n'] or [B, H, n', n']) and
    ``rel_bias`` (ingredients) are mutually exclusive. ``backend``: an :class:`AttentionBackend` or its value
    (module docstring); ``config``: the Triton kernels' ``KernelConfig`` (None = its DEFAULT; the reference
    ignores it).

    Raises ValueError (bad arguments, unknown backend) or RuntimeError (TRITON requested but not runnable here,
    with the reason).
    """
    if attn_bias is not None and rel_bias is not None:
        raise ValueError("attention: pass attn_bias or rel_bias, not both")
    chosen = resolve_backend(backend, q.device)
    if chosen is AttentionBackend.TRITON:
        if rel_bias is not None:
            attn_bias = _triton_bias(rel_bias, offsets)
        return _triton_module()[0].jagged_attention_triton(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                       attn_bias=attn_bias, alpha=alpha, num_targets=num_targets, config=config)
    if rel_bias is not None:
        alpha = _ref.check_attention_args(q, k, v, offsets, max_len, activation=activation, attn_bias=None,
                                          alpha=alpha, num_targets=num_targets)
        return _ref.jagged_attention_grouped_ref(q, k, v, offsets, max_len, activation=activation,
                                                 causal=causal, alpha=alpha, num_targets=num_targets,
                                                 bias_fn=rel_bias.group_bias_fn(offsets))
    return _ref.jagged_attention_ref(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                     attn_bias=attn_bias, alpha=alpha, num_targets=num_targets)


def _triton_bias(rel_bias: RelativeBiasInputs, offsets: torch.Tensor) -> torch.Tensor:
    """The dense relative bias [B, n, n] the Triton kernels take (the seam: a kernel that takes the bucket indices
    and the weights itself replaces this materialisation). n: the precomputed buckets' size when given (>= the
    longest sequence; no host sync, nothing data-dependent under torch.compile), else the longest sequence."""
    n = rel_bias.buckets[0].shape[-1] if rel_bias.buckets is not None else _longest(offsets)
    return rel_bias.dense(offsets, n)


def _longest(offsets: torch.Tensor) -> int:
    return int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0


if torch.cuda.is_available():  # GPU machines import the kernels with gemray.ops: a torch.compile trace never does
    _triton_module()
