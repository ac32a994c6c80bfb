"""Op dispatch: one jagged attention entry point, routed to a Triton kernel or the PyTorch reference.

Shape key: T total tokens, B sequences, H heads, Dqk / Dv per-head widths, N = max_len.

Backends:
    "reference": ``gemray.kernels.reference.jagged_attention_ref`` (any device; the spec).
    "triton":    ``gemray.kernels.jagged_attention.jagged_attention_triton`` (CUDA tensors only). Raises
                 RuntimeError when the module is missing or the tensors are not on CUDA: no silent fallback.
    "auto":      Triton when the tensors are on CUDA and the Triton module imports, else the reference;
                 the choice is logged once at INFO per (backend, device type).

Relative attention bias can be handed over either materialised (``attn_bias`` [B, n', n']) or as its raw
ingredients (``rel_bias``: a ``RelativeBiasInputs``); a kernel whose signature accepts ``rel_bias`` gets
the ingredients, the others get the dense tensor built by ``kernels.reference.relative_bias_ref``.
With "auto", a kernel that raises NotImplementedError for an argument (say, attn_bias) hands the call to
the reference (logged once); with "triton" the error propagates.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from gemray.kernels import reference as _ref

log = logging.getLogger(__name__)

TRITON_MODULE = "gemray.kernels.jagged_attention"
TRITON_FUNCTION = "jagged_attention_triton"
BACKENDS = ("auto", "triton", "reference")


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
    """weights [Q] float, idx int64 (any shape, values in [0, Q)) -> weights[idx], same shape as idx."""
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


@functools.lru_cache(maxsize=None)
def _load_triton() -> Callable | None:
    try:
        mod = importlib.import_module(TRITON_MODULE)
    except ImportError as e:  # the kernel (or triton itself) is not installed
        log.debug("Triton attention unavailable: %s", e)
        return None
    return getattr(mod, TRITON_FUNCTION, None)


@functools.lru_cache(maxsize=None)
def _log_choice(backend: str, device_type: str) -> None:
    log.info("gemray.ops.attention: using the %s backend on %s", backend, device_type)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return "triton" or "reference" for a requested backend and the tensors' device.

    Raises ValueError for an unknown backend name and RuntimeError when "triton" is forced but the kernel
    module is not importable or the device is not CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    on_cuda = device.type == "cuda"
    fn = _load_triton() if on_cuda or backend == "triton" else None
    if backend == "triton":
        if fn is None:
            raise RuntimeError(f"attention backend 'triton' requested but {TRITON_MODULE}.{TRITON_FUNCTION} "
                               "is not importable (is triton installed and the kernel written?)")
        if not on_cuda:
            raise RuntimeError(f"attention backend 'triton' requested but the tensors are on {device}; "
                               "the Triton kernel needs CUDA (use backend='reference' or 'auto')")
        return "triton"
    return "triton" if (on_cuda and fn is not None) else "reference"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_len: int, *,
              activation: str = "silu", causal: bool = True, attn_bias: torch.Tensor | None = None,
              rel_bias: RelativeBiasInputs | None = None, alpha: float | None = None,
              num_targets: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Jagged attention ``q [T,H,Dqk], k [T,H,Dqk], v [T,H,Dv], offsets [B+1] int64 -> [T,H,Dv]``.

    Semantics (masks, activations, alpha default, N normaliser) are those of
    ``gemray.kernels.reference.jagged_attention_ref``. ``attn_bias`` ([B, n', n'] or [B, H, n', n']) and
    ``rel_bias`` (ingredients) are mutually exclusive. ``backend`` as in the module docstring.

    Raises ValueError (bad arguments) or RuntimeError (forced Triton unavailable).
    """
    if attn_bias is not None and rel_bias is not None:
        raise ValueError("attention: pass attn_bias or rel_bias, not both")
    chosen = resolve_backend(backend, q.device)
    _log_choice(chosen, q.device.type)
    if chosen == "triton":
        fn = _load_triton()
        assert fn is not None
        kwargs = dict(activation=activation, causal=causal, alpha=alpha, num_targets=num_targets)
        if rel_bias is not None and "rel_bias" in _params(fn):
            kwargs["rel_bias"] = rel_bias
        else:
            if rel_bias is not None:
                attn_bias, rel_bias = rel_bias.dense(offsets, _longest(offsets)), None
            kwargs["attn_bias"] = attn_bias
        try:
            return fn(q, k, v, offsets, max_len, **kwargs)
        except NotImplementedError as e:
            if backend == "triton":
                raise
            # "auto": the kernel declined an argument (e.g. a bias it cannot take): say so once, use the spec.
            _log_decline(str(e))
    if rel_bias is not None:
        alpha = _ref.check_attention_args(q, k, v, offsets, max_len, activation=activation, attn_bias=None,
                                          alpha=alpha, num_targets=num_targets)
        return _ref.jagged_attention_grouped_ref(q, k, v, offsets, max_len, activation=activation,
                                                 causal=causal, alpha=alpha, num_targets=num_targets,
                                                 bias_fn=rel_bias.group_bias_fn(offsets))
    return _ref.jagged_attention_ref(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                     attn_bias=attn_bias, alpha=alpha, num_targets=num_targets)


@functools.lru_cache(maxsize=None)
def _log_decline(reason: str) -> None:
    log.info("gemray.ops.attention: Triton kernel declined (%s); using the reference backend", reason)


def _longest(offsets: torch.Tensor) -> int:
    return int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0


@functools.lru_cache(maxsize=None)
def _params(fn: Callable) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()
