"""Op dispatch: one jagged attention entry point, routed to the Triton kernels or the PyTorch reference.

Shape key: T total tokens, B sequences, H heads, Dqk / Dv per-head widths, N = max_len.

Backends (:class:`AttentionBackend`, or its value as a string: the config's ``model.attention_backend``):
    REFERENCE ("reference"): ``gemray.kernels.reference`` (any device; the spec).
    TRITON ("triton"): ``gemray.kernels.jagged_attention.jagged_attention_triton`` (the ``gemray::gdpa_*`` custom
        ops), on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter: tests). A
        call it cannot run (triton or the kernel module not importable, tensors on another device) raises
        RuntimeError with the reason; nothing falls back.
    AUTO ("auto"): TRITON when the tensors are on CUDA and the kernel module imports, else REFERENCE.
Every choice is logged (INFO) once per (op, backend, device type), naming the setting, its value and, for AUTO, why
(:func:`choice_message`).
Like generative-recommenders' ``hstu_mha(..., kernel=HammerKernel.TRITON)``, the backend is an explicit enum
argument; unlike it, an explicit backend never silently becomes another.

Sampled softmax (:func:`sampled_softmax_lse`, the retrieval head's "uniform_shared" negatives): the same
backends and rules, over ``gemray.kernels.sampled_softmax`` (fused Triton) or
``gemray.kernels.reference.sampled_softmax_lse_ref``. The HSTU block's projection + activation
(:func:`uvqk_projection`: u's pre-activation, ``split(silu(x @ W_vqk + b_vqk))``): the same again, over
``gemray.kernels.bias_silu`` (after the GEMM) or PyTorch.

Relative attention bias: ``rel_bias`` (a :class:`RelativeBiasInputs`, the HSTU position / time bias ingredients)
or a dense ``attn_bias`` [B, n', n']. Both backends take the ingredients and never materialise a [B, n, n] bias:
the reference groups sequences by length and gathers the bucket weights per group; the Triton kernels compute
the bias of each tile in the kernel from the per-token query / key times and the two weight vectors
(``gemray.kernels.jagged_attention.RelBias``: the same bucket indices, bit for bit), forward and backward
(d pos_w / d ts_w summed per bucket in the kernel).
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
    indices into a few dozen buckets, which dominated CPU step time). CPU only: the CPU bincount adds in index
    order (reproducible); the CUDA one adds with float atomics, in whatever order the threads run."""

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
    """weights [Q] float, idx int64 (any shape, values in [0, Q)) -> weights[idx], same shape as idx. Eager on the
    CPU: the bincount backward (_BucketGather). On CUDA plain indexing: its backward (``index_put_`` with
    accumulate, which sorts the indices and adds each bucket's terms in a fixed order) gives the same gradient on
    every run, where CUDA's weighted bincount adds with atomics and made the reference path's d pos_w / d ts_w
    differ run to run in the last bits. Under torch.compile plain indexing too (bincount's output size depends
    on the data, which would break the graph; the compiled index backward is a scatter-add)."""
    if torch.compiler.is_compiling() or weights.device.type == "cuda":
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


_MODULES: dict[str, tuple] = {}  # kernel module name -> (the module or None, why it does not import or None)


def _kernel_module(name: str):
    """(the kernel module ``name``, None) or (None, why it is not importable); imported once. A module imported
    already (sys.modules) is taken as is, so that a call traced by torch.compile never imports."""
    if name in _MODULES:
        return _MODULES[name]
    mod = sys.modules.get(name)
    if mod is not None:
        return mod, None
    try:
        mod, err = importlib.import_module(name), None
    except ImportError as e:  # triton (or the kernel module) is not installed
        mod, err = None, f"{name} is not importable ({e})"
    _MODULES[name] = (mod, err)
    return mod, err


def _triton_module():
    """The attention kernels' module: ``_kernel_module(TRITON_MODULE)``."""
    return _kernel_module(TRITON_MODULE)


def choose_backend(requested: AttentionBackend, device_type: str, triton_error: str | None,
                   interpreting: bool) -> tuple[AttentionBackend, str]:
    """The pure rule behind :func:`resolve_backend`: (TRITON or REFERENCE, why AUTO chose it; "" for an explicit
    TRITON or REFERENCE, which is taken as given). ``triton_error``: why the kernel module does not import (None:
    it does); ``interpreting``: the kernels run in Triton's CPU interpreter (then they take CPU tensors, not CUDA
    ones). Raises RuntimeError when TRITON was asked for and cannot run."""
    if requested is AttentionBackend.REFERENCE:
        return AttentionBackend.REFERENCE, ""
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
        return AttentionBackend.TRITON, ""
    if device_type != "cuda":
        return AttentionBackend.REFERENCE, f"the tensors are on {device_type}, and \"auto\" takes Triton on cuda only"
    if triton_error is not None:
        return AttentionBackend.REFERENCE, triton_error
    return AttentionBackend.TRITON, "the tensors are on cuda"


#: the config key whose value an op's ``backend`` is (the model passes it through), named in the logged choice
_SETTINGS = {"attention": "model.attention_backend", "sampled_softmax_lse": "model.retrieval_kernel",
             "uvqk_projection": "model.uvqk_kernel"}


def choice_message(op: str, requested: AttentionBackend, device_type: str, chosen: AttentionBackend,
                   why: str) -> str:
    """Pure: the log line of a backend choice: the backend taken, the setting and its value, and (for "auto") why,
    e.g. ``gemray.ops.attention: reference backend on cpu (model.attention_backend = "auto": the tensors are on
    cpu, and "auto" takes Triton on cuda only)``. It says what the value is, not whether a user set it (a default
    reads the same)."""
    setting = _SETTINGS.get(op, "backend")
    return (f'gemray.ops.{op}: {chosen.value} backend on {device_type} ({setting} = "{requested.value}"'
            + (f": {why})" if why else ")"))


# (op, requested, device type) -> chosen: a plain dict (under torch.compile a hit is a guarded constant, nothing
# traced)
_CHOSEN: dict[tuple[str, AttentionBackend, str], AttentionBackend] = {}


def resolve_backend(backend: AttentionBackend | str, device: torch.device) -> AttentionBackend:
    """TRITON or REFERENCE for a requested backend and the tensors' device, decided and logged once per pair
    (by the first eager call: dynamo cannot trace logging, so a call traced by torch.compile decides without
    logging or remembering).

    Raises ValueError for an unknown backend name and RuntimeError (with the reason) when TRITON is requested
    but cannot run here.
    """
    return _resolve(backend, device, TRITON_MODULE, "attention")


def _resolve(backend: AttentionBackend | str, device: torch.device, module: str, op: str) -> AttentionBackend:
    """:func:`choose_backend` for the op ``op`` whose Triton kernels live in ``module``, decided and logged
    ("gemray.ops.<op>: ...") once per (op, requested backend, device type) by the first eager call."""
    key = (op, AttentionBackend.parse(backend), torch.device(device).type)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        mod, err = _kernel_module(module) if key[1] is not AttentionBackend.REFERENCE else (None, None)
        chosen, why = choose_backend(key[1], key[2], err, bool(mod is not None and mod.interpreting()))
        if not torch.compiler.is_compiling():
            log.info("%s", choice_message(op, key[1], key[2], chosen, why))
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
        mod = _triton_module()[0]
        return mod.jagged_attention_triton(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                           attn_bias=attn_bias, alpha=alpha, num_targets=num_targets, config=config,
                                           rel_bias=None if rel_bias is None else _triton_rel_bias(mod, rel_bias))
    if rel_bias is not None:
        alpha = _ref.check_attention_args(q, k, v, offsets, max_len, activation=activation, attn_bias=None,
                                          alpha=alpha, num_targets=num_targets)
        return _ref.jagged_attention_grouped_ref(q, k, v, offsets, max_len, activation=activation,
                                                 causal=causal, alpha=alpha, num_targets=num_targets,
                                                 bias_fn=rel_bias.group_bias_fn(offsets))
    return _ref.jagged_attention_ref(q, k, v, offsets, max_len, activation=activation, causal=causal,
                                     attn_bias=attn_bias, alpha=alpha, num_targets=num_targets)


# ----------------------------------------------------------------------------------------------------------
# Sampled softmax over per-sequence shared negatives (the retrieval head's "uniform_shared"): the fused Triton
# kernels (gemray.kernels.sampled_softmax, custom ops gemray::sampled_softmax_lse / _bwd) or the reference
# (gemray.kernels.reference.sampled_softmax_lse_ref), chosen by the rules of ``choose_backend``.
# ----------------------------------------------------------------------------------------------------------

SAMPLED_SOFTMAX_MODULE = "gemray.kernels.sampled_softmax"


def resolve_sampled_softmax_backend(backend: AttentionBackend | str, device: torch.device) -> AttentionBackend:
    """TRITON or REFERENCE for :func:`sampled_softmax_lse` on ``device``: ``choose_backend``'s rules ("auto":
    Triton on CUDA when the kernel module imports; "triton" off its device raises RuntimeError), decided and
    logged once per (requested, device type) by the first eager call."""
    return _resolve(backend, device, SAMPLED_SOFTMAX_MODULE, "sampled_softmax_lse")


def sampled_softmax_lse(h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor, neg_ids: torch.Tensor,
                        target_ids: torch.Tensor, row_offsets: torch.Tensor, max_rows: int, temperature: float, *,
                        backend: AttentionBackend | str = AttentionBackend.AUTO, block_m: int = 0,
                        block_r: int = 0) -> torch.Tensor:
    """Per-row log-sum-exp of ``[pos_i, <h_i, e_neg[b(i), r]> for r] / temperature`` (negatives equal to the
    row's target masked), rows of sequence b at row_offsets[b]:row_offsets[b+1].

    h: [M, E], pos: [M], e_neg: [B, R, E] float; neg_ids: [B, R] int64; target_ids: [M] int64; row_offsets:
    [B+1] int64; max_rows: host int >= every row count (no host sync); temperature > 0. Returns lse [M] float32,
    differentiable in h, pos, e_neg. backend: "auto" | "triton" | "reference" (``choose_backend``); block_m /
    block_r: the Triton tiles (0 = defaults; the reference ignores them). Semantics:
    ``gemray.kernels.reference.sampled_softmax_lse_ref``; kernel: ``gemray.kernels.sampled_softmax``.
    Raises ValueError (unknown backend, bad shapes) or RuntimeError ("triton" where it cannot run).
    """
    if resolve_sampled_softmax_backend(backend, h.device) is AttentionBackend.TRITON:
        return _kernel_module(SAMPLED_SOFTMAX_MODULE)[0].sampled_softmax_lse_triton(h, pos, e_neg, neg_ids, target_ids, row_offsets,
                                                           max_rows, temperature, block_m=block_m,
                                                           block_r=block_r)
    return _ref.sampled_softmax_lse_ref(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, temperature)


# ----------------------------------------------------------------------------------------------------------
# The HSTU block's projection + activation: u's pre-activation from its own addmm (its SiLU is the gate's), and
# split(silu(x @ W_vqk + b_vqk)) as torch.mm then one fused Triton pass forward and one backward
# (gemray.kernels.bias_silu, custom ops gemray::bias_silu_split / _bwd), or addmm + F.silu, chosen by the rules of
# ``choose_backend``.
# ----------------------------------------------------------------------------------------------------------

BIAS_SILU_MODULE = "gemray.kernels.bias_silu"


def uvqk_projection(x_norm: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, sizes: list[int], *,
                    backend: AttentionBackend | str = AttentionBackend.AUTO) -> list[torch.Tensor]:
    """The HSTU block's projection: ``z = x_norm @ weight + bias`` split as (u, v, q, k) = ``sizes``, returned as
    ``[z_u, silu(z_v), silu(z_q), silu(z_k)]``: u WITHOUT its SiLU, which its one consumer applies
    (``HSTUBlock``'s gate ``LayerNorm(a @ v) * silu(z_u)``, where ``train.compile`` fuses it into the gate's own
    pass forward and backward).

    Why u's SiLU is the gate's: applied here it was a [T, H V] pass of its own (read z_u, write u) and, backward,
    another (read du and z_u, write dz_u) that the gate's fused kernels do for free as they read u anyway: at GEM
    scale (T ~ 131k, H V = 1024, 8 blocks) ~10 GB of traffic a step, ~1/4 of the fused kernels' 15 ms on an H100.
    So u gets its own GEMM (``addmm``: the bias in cuBLAS's epilogue) beside v / q / k's, and its gradient feeds
    its own weight-gradient and input-gradient GEMMs straight from the gate's backward, with no concatenation.

    x_norm: [T, D] float, weight: [D, W], bias: [W], sizes: the split widths (u, v, q, k) summing to W (u: H V,
    v: H V, q and k: H A). Returns one [T, sizes[i]] tensor per split in the GEMM's dtype (bf16 under autocast).
    backend ("auto" | "triton" | "reference", ``model.uvqk_kernel``; ``choose_backend``'s rules) chooses v / q /
    k's bias + SiLU: the reference is ``addmm`` then ``F.silu`` and views, which ``train.compile`` fuses as inductor
    sees fit; the Triton path is ``torch.mm`` then ``gemray.kernels.bias_silu`` (bias, SiLU and split in one pass;
    backward: the SiLU derivative, the three gradients and the bias gradient's column sums in one pass; spec
    ``gemray.kernels.reference.bias_silu_split_ref``). Raises ValueError (bad shapes or sizes, unknown backend) or
    RuntimeError ("triton" where it cannot run)."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != 4 or min(sizes) < 1 or weight.dim() != 2 or sum(sizes) != weight.shape[1] \
            or bias.shape != (weight.shape[1],):
        raise ValueError(f"uvqk_projection: sizes {sizes} (u, v, q, k; each >= 1) must sum to W, the width of "
                         f"weight {tuple(weight.shape)} and of bias {tuple(bias.shape)}")
    hv = sizes[0]
    z_u = torch.addmm(bias[:hv], x_norm, weight[:, :hv])
    w_vqk, b_vqk = weight[:, hv:], bias[hv:]
    if _resolve(backend, x_norm.device, BIAS_SILU_MODULE, "uvqk_projection") is AttentionBackend.TRITON:
        vqk = _kernel_module(BIAS_SILU_MODULE)[0].bias_silu_split_triton(torch.mm(x_norm, w_vqk), b_vqk, sizes[1:])
    else:
        vqk = torch.split(torch.nn.functional.silu(torch.addmm(b_vqk, x_norm, w_vqk)), sizes[1:], 1)
    return [z_u, *vqk]


def _triton_rel_bias(mod, rel_bias: RelativeBiasInputs):
    """The Triton kernels' in-kernel bias ingredients (``RelBias``) of ``rel_bias``: query times
    (``query_timestamps``, else the keys' own ``timestamps``), key times, the two weight vectors and the position
    bucketing's max_len. Precomputed ``buckets`` are not used (the kernels bucketise per tile): callers give
    ``query_timestamps`` with them when the buckets were made from query times."""
    ts = rel_bias.timestamps.to(torch.int64).contiguous()
    tq = ts if rel_bias.query_timestamps is None else rel_bias.query_timestamps.to(torch.int64).contiguous()
    return mod.RelBias(tq, ts, rel_bias.pos_weights, rel_bias.ts_weights, int(rel_bias.max_len))


def _longest(offsets: torch.Tensor) -> int:
    return int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0


# ----------------------------------------------------------------------------------------------------------
# Cross-attention and PMA (GDPA with jagged queries of another set / with shared seed queries).
#
# Self-contained on purpose (the dispatch above is being rewritten; these two rebase onto its backend enum).
# Both are torch.library custom ops, forward and backward, so that torch.utils.flop_counter can count them
# on their real jagged lengths (the formulas registered at the end: valid pairs only) and torch.compile sees
# one opaque op each:
#     gemray::cross_attention / gemray::cross_attention_backward
#     gemray::pma             / gemray::pma_backward
# The forward ops return (out, lse): lse [H, T_out] fp32, the Triton softmax forward's base-2 log-sum-exp that its
# backward reads (an empty [0] tensor on the reference backend and for the pointwise activations); the public
# functions return out. Backward: on the reference backend, explicit padded gradients (``_attend_padded_bwd``,
# checked against autograd through kernels.reference by tests/test_model_ranking.py); on the Triton backend the
# kernels' backward launches on the forward's out / lse (``gdpa_triton_backward``; until session 28 the backward op
# re-ran the Triton forward under autograd, copying the strided k / v with ``contiguous()``: the step measured
# 0.85-2.15 ms shorter on an H100 without it). No double backward.
# ----------------------------------------------------------------------------------------------------------

_INV_SQRT2 = 0.7071067811865476       # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327    # 1 / sqrt(2 pi)


def _gdpa_triton() -> Callable:
    """``gemray.kernels.jagged_attention.gdpa_triton``; only called once the backend is TRITON."""
    return _triton_module()[0].gdpa_triton


def _gdpa_backend(backend: str, device: torch.device, name: str) -> str:
    """"triton" or "reference" for op ``name`` ("cross" / "pma"), by :func:`resolve_backend`'s rules (AUTO:
    Triton on CUDA when importable; TRITON that cannot run raises RuntimeError; an unknown name ValueError)."""
    return resolve_backend(backend, device).value


def _dact(s: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(s), act'(s)) of the pointwise activations (gelu: erf form, as F.gelu's default)."""
    if activation == "silu":
        sig = torch.sigmoid(s)
        return s * sig, sig * (1 + s * (1 - sig))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(s * _INV_SQRT2))
        return s * cdf, cdf + s * torch.exp(-0.5 * s * s) * _INV_SQRT_2PI
    return s, torch.ones_like(s)


def _attend_padded_bwd(pq, pk, pv, valid, do, activation: str, alpha: float, norm: float):
    """Gradients of ``kernels.reference._attend_padded_ref``: pq [B|1, H, m, Dqk], pk [B, H, n, Dqk],
    pv [B, H, n, Dv], valid [B, 1, m, n] bool, do [B, H, m, Dv] -> (dq [B, H, m, Dqk], dk, dv) (dq per
    sequence even when pq is broadcast: the caller sums). softmax: dS = P (dP - rowsum(dP P)); pointwise:
    dS = act'(S) / N dP on valid pairs."""
    s = torch.matmul(pq, pk.transpose(-1, -2)) * alpha
    dp = torch.matmul(do, pv.transpose(-1, -2))
    if activation == "softmax":
        row_any = valid.any(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(~(valid | ~row_any), float("-inf")), dim=-1) * (valid & row_any)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    else:
        a, da = _dact(s, activation)
        mask = valid.to(s.dtype) / norm
        p = a * mask
        ds = da * mask * dp
    dv = torch.matmul(p.transpose(-1, -2), do)
    dq = torch.matmul(ds, pk) * alpha
    dk = torch.matmul(ds.transpose(-1, -2), pq.expand(pk.shape[0], *pq.shape[1:])) * alpha
    return dq, dk, dv


def _cross_check(q, q_offsets, k, v, kv_offsets) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[1:] != k.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"cross_attention: expected q [Tq,H,D], k [Tk,H,D], v [Tk,H,Dv], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(f"cross_attention: q_offsets has B={q_offsets.numel() - 1}, kv_offsets "
                         f"B={kv_offsets.numel() - 1}")


def _lse_shape(backend: str, device: torch.device, name: str, activation: str, heads: int,
               t_out: int) -> tuple[int, ...]:
    """The lse a cross-attention / PMA forward op returns: [H, T_out] for the Triton softmax, else [0]."""
    return (heads, t_out) if activation == "softmax" and _gdpa_backend(backend, device, name) == "triton" else (0,)


def _no_lse(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("gemray::cross_attention", mutates_args=())
def _cross_attention_op(q: torch.Tensor, q_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, activation: str,
                        alpha: float | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        if _gdpa_backend(backend, q.device, "cross") == "triton":
            out, lse = _gdpa_triton()(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len,
                                      activation=activation, causal=False, alpha=alpha, with_lse=True)
            return out, (lse if activation == "softmax" else _no_lse(q))
        return _ref.jagged_cross_attention_ref(q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len,
                                               activation=activation, alpha=alpha), _no_lse(q)


@_cross_attention_op.register_fake
def _(q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len, activation, alpha, backend):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
            q.new_empty(_lse_shape(backend, q.device, "cross", activation, q.shape[1], q.shape[0]),
                        dtype=torch.float32))


@torch.library.custom_op("gemray::cross_attention_backward", mutates_args=())
def _cross_attention_bwd_op(do: torch.Tensor, q: torch.Tensor, q_offsets: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int,
                            activation: str, alpha: float | None, backend: str, out: torch.Tensor,
                            lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out / lse: the forward op's (the Triton softmax backward reads them; unused otherwise)."""
    B = q_offsets.numel() - 1
    if B == 0 or q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if _gdpa_backend(backend, q.device, "cross") == "triton":
        return _triton_module()[0].gdpa_triton_backward(do, q, k, v, out, lse, q_offsets, kv_offsets, max_q_len,
                                                        max_kv_len, activation=activation, alpha=alpha)
    a = _ref._default_alpha(activation, alpha, q.shape[2])
    (Tq, H, Dqk), Dv = q.shape, v.shape[2]
    mq = _longest(q_offsets)
    mk = _longest(kv_offsets)
    if mq == 0 or mk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    pq = _ref._pad(q.reshape(Tq, H * Dqk), q_offsets, mq).view(B, mq, H, Dqk).transpose(1, 2)
    pk = _ref._pad(k.reshape(-1, H * Dqk), kv_offsets, mk).view(B, mk, H, Dqk).transpose(1, 2)
    pv = _ref._pad(v.reshape(-1, H * Dv), kv_offsets, mk).view(B, mk, H, Dv).transpose(1, 2)
    pdo = _ref._pad(do.reshape(Tq, H * Dv), q_offsets, mq).view(B, mq, H, Dv).transpose(1, 2)
    lk = (kv_offsets[1:] - kv_offsets[:-1]).view(B, 1, 1, 1)
    valid = (torch.arange(mk, device=q.device).view(1, 1, 1, mk) < lk).expand(B, 1, mq, mk)
    dq, dk, dv = _attend_padded_bwd(pq, pk, pv, valid, pdo, activation, a, float(max(max_kv_len, 1)))
    dq = _ref._unpad(dq.transpose(1, 2).reshape(B, mq, H * Dqk), q_offsets).view(Tq, H, Dqk)
    dk = _ref._unpad(dk.transpose(1, 2).reshape(B, mk, H * Dqk), kv_offsets).view(k.shape)
    dv = _ref._unpad(dv.transpose(1, 2).reshape(B, mk, H * Dv), kv_offsets).view(v.shape)
    return dq, dk, dv


@_cross_attention_bwd_op.register_fake
def _(do, q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len, activation, alpha, backend, out, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _cross_setup(ctx, inputs, output):
    q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len, activation, alpha, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, q_offsets, k, v, kv_offsets, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.args = (max_q_len, max_kv_len, activation, alpha, backend)


def _cross_backward(ctx, do, _dlse):
    q, q_offsets, k, v, kv_offsets, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gemray.cross_attention_backward(do.contiguous(), q, q_offsets, k, v, kv_offsets,
                                                           *ctx.args, out, lse)
    return dq, None, dk, dv, None, None, None, None, None, None


_cross_attention_op.register_autograd(_cross_backward, setup_context=_cross_setup)


def cross_attention(q: torch.Tensor, q_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int, *, activation: str = "softmax",
                    alpha: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Jagged cross-attention (GDPA cross): query rows of sequence b attend to every key of sequence b.

    Args:
        q: [Tq, H, Dqk] float (e.g. the candidates of each request), jagged by q_offsets [B+1] int64.
        k: [Tk, H, Dqk], v: [Tk, H, Dv], same dtype and device (e.g. the user history), jagged by
            kv_offsets [B+1] int64 (the same B). Non-causal: every key of the sequence is seen.
        max_q_len / max_kv_len: host ints >= every query / key sequence length; pointwise activations
            divide by N = max_kv_len (HSTU's constant normaliser).
        activation: "softmax" (over the sequence's keys), "silu" / "gelu" / "none" (act(alpha q.k) / N).
        alpha: logit scale; default 1/sqrt(Dqk) for softmax, 1.0 otherwise.
        backend: "auto" | "triton" | "reference", the rules of ``attention`` (module docstring).
    Returns:
        [Tq, H, Dv] in q's dtype; a query whose sequence has no keys gets 0. Differentiable in q, k, v
        (once: no double backward); every input stays in the graph when Tq, Tk or B is 0.
    Raises:
        ValueError: bad shapes, batch sizes or backend name, a sequence longer than its max length
        (reference); RuntimeError: "triton" forced off CUDA or without the kernels.
    Semantics: ``gemray.kernels.reference.jagged_cross_attention_ref``; kernel:
    ``gemray.kernels.jagged_attention.jagged_cross_attention_triton``.
    """
    _cross_check(q, q_offsets, k, v, kv_offsets)
    return torch.ops.gemray.cross_attention(q, q_offsets, k, v, kv_offsets, int(max_q_len), int(max_kv_len),
                                            activation, None if alpha is None else float(alpha), backend)[0]


_PMA_Q_OFFSETS: dict = {}


def _pma_q_offsets(kv_offsets: torch.Tensor, s: int) -> torch.Tensor:
    """[B+1] int64 ``arange(B+1) * s``: the seed rows of PMA as jagged queries. Kept per (B, s, device) so
    the Triton launch plans keyed on the offsets object are reused across backward calls."""
    key = (kv_offsets.numel(), s, kv_offsets.device)
    hit = _PMA_Q_OFFSETS.get(key)
    if hit is None:
        if len(_PMA_Q_OFFSETS) > 64:
            _PMA_Q_OFFSETS.clear()
        hit = torch.arange(kv_offsets.numel(), device=kv_offsets.device, dtype=torch.int64) * s
        if not (hit.is_meta or isinstance(hit, torch._subclasses.FakeTensor)):
            _PMA_Q_OFFSETS[key] = hit
    return hit


@torch.library.custom_op("gemray::pma", mutates_args=())
def _pma_op(seeds: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor, max_kv_len: int,
            activation: str, alpha: float | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, (S, H, _), Dv = kv_offsets.numel() - 1, seeds.shape, v.shape[2]
    with torch.no_grad():
        if _gdpa_backend(backend, k.device, "pma") == "triton":
            out, lse = _gdpa_triton()(seeds, k, v, _pma_q_offsets(kv_offsets, S), kv_offsets, S, max_kv_len,
                                      activation=activation, causal=False, alpha=alpha, q_broadcast=True,
                                      with_lse=True)
            return out.view(B, S, H, Dv), (lse if activation == "softmax" else _no_lse(seeds))
        # contiguous: the reference returns a transposed view; the op's (fake) output layout is contiguous
        return (_ref.pma_ref(seeds, k, v, kv_offsets, max_kv_len, activation=activation, alpha=alpha).contiguous(),
                _no_lse(seeds))


@_pma_op.register_fake
def _(seeds, k, v, kv_offsets, max_kv_len, activation, alpha, backend):
    B, S, H = kv_offsets.shape[0] - 1, seeds.shape[0], seeds.shape[1]
    return (seeds.new_empty((B, S, H, v.shape[2])),
            seeds.new_empty(_lse_shape(backend, k.device, "pma", activation, H, B * S), dtype=torch.float32))


@torch.library.custom_op("gemray::pma_backward", mutates_args=())
def _pma_bwd_op(do: torch.Tensor, seeds: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor,
                max_kv_len: int, activation: str, alpha: float | None, backend: str, out: torch.Tensor,
                lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [B, S, H, Dv] / lse: the forward op's (the Triton softmax backward reads them; unused otherwise)."""
    B = kv_offsets.numel() - 1
    if B == 0 or k.shape[0] == 0 or seeds.shape[0] == 0:
        return torch.zeros_like(seeds), torch.zeros_like(k), torch.zeros_like(v)
    S, H, Dqk = seeds.shape
    Dv = v.shape[2]
    if _gdpa_backend(backend, k.device, "pma") == "triton":
        return _triton_module()[0].gdpa_triton_backward(
            do.reshape(B * S, H, Dv), seeds, k, v, out.reshape(B * S, H, Dv), lse, _pma_q_offsets(kv_offsets, S),
            kv_offsets, S, max_kv_len, activation=activation, alpha=alpha, q_broadcast=True)
    a = _ref._default_alpha(activation, alpha, Dqk)
    mk = _longest(kv_offsets)
    if mk == 0:
        return torch.zeros_like(seeds), torch.zeros_like(k), torch.zeros_like(v)
    pq = seeds.transpose(0, 1).unsqueeze(0)  # [1, H, S, Dqk]
    pk = _ref._pad(k.reshape(-1, H * Dqk), kv_offsets, mk).view(B, mk, H, Dqk).transpose(1, 2)
    pv = _ref._pad(v.reshape(-1, H * Dv), kv_offsets, mk).view(B, mk, H, Dv).transpose(1, 2)
    lk = (kv_offsets[1:] - kv_offsets[:-1]).view(B, 1, 1, 1)
    valid = (torch.arange(mk, device=k.device).view(1, 1, 1, mk) < lk).expand(B, 1, S, mk)
    dq, dk, dv = _attend_padded_bwd(pq, pk, pv, valid, do.transpose(1, 2), activation, a,
                                    float(max(max_kv_len, 1)))
    dseeds = dq.sum(0).transpose(0, 1).contiguous()  # [S, H, Dqk]
    dk = _ref._unpad(dk.transpose(1, 2).reshape(B, mk, H * Dqk), kv_offsets).view(k.shape)
    dv = _ref._unpad(dv.transpose(1, 2).reshape(B, mk, H * Dv), kv_offsets).view(v.shape)
    return dseeds, dk, dv


@_pma_bwd_op.register_fake
def _(do, seeds, k, v, kv_offsets, max_kv_len, activation, alpha, backend, out, lse):
    return torch.empty_like(seeds), torch.empty_like(k), torch.empty_like(v)


def _pma_setup(ctx, inputs, output):
    seeds, k, v, kv_offsets, max_kv_len, activation, alpha, backend = inputs
    out, lse = output
    ctx.save_for_backward(seeds, k, v, kv_offsets, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.args = (max_kv_len, activation, alpha, backend)


def _pma_backward(ctx, do, _dlse):
    seeds, k, v, kv_offsets, out, lse = ctx.saved_tensors
    ds, dk, dv = torch.ops.gemray.pma_backward(do.contiguous(), seeds, k, v, kv_offsets, *ctx.args, out, lse)
    return ds, dk, dv, None, None, None, None, None


_pma_op.register_autograd(_pma_backward, setup_context=_pma_setup)


def pma(seeds: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor, max_kv_len: int, *,
        activation: str = "softmax", alpha: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Pooled multi-head attention (PMA, Lee et al. 2019 "Set Transformer", ICML; GDPA with seed queries):
    S learned seed queries per head, shared by every sequence, attend to each jagged history.

    Args:
        seeds: [S, H, Dqk] float; k: [T, H, Dqk], v: [T, H, Dv] (same dtype / device), jagged by
            kv_offsets [B+1] int64.
        max_kv_len: host int >= every history length; pointwise activations divide by N = max_kv_len.
        activation / alpha / backend: as ``cross_attention``.
    Returns:
        [B, S, H, Dv] in seeds' dtype; an empty history gives 0. Differentiable in seeds, k, v (once);
        every input stays in the graph when B or T is 0.
    Raises:
        ValueError: bad shapes or backend name, a history longer than max_kv_len (reference);
        RuntimeError: "triton" forced off CUDA or without the kernels.
    Semantics: ``gemray.kernels.reference.pma_ref``; kernel: ``gemray.kernels.jagged_attention.pma_triton``.
    """
    if seeds.dim() != 3 or k.dim() != 3 or v.dim() != 3 or seeds.shape[1:] != k.shape[1:] or \
            v.shape[:2] != k.shape[:2]:
        raise ValueError(f"pma: expected seeds [S,H,D], k [T,H,D], v [T,H,Dv], got seeds {tuple(seeds.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    return torch.ops.gemray.pma(seeds, k, v, kv_offsets, int(max_kv_len), activation,
                                None if alpha is None else float(alpha), backend)[0]


# FLOP formulas (torch.utils.flop_counter, raw arguments: the offsets' values give the valid pairs). Model
# FLOPs, the convention of gemray.model.flops: forward = 2 GEMMs over the valid (query, key) pairs,
# 2 * pairs * H * (Dqk + Dv); backward = 2.5x the forward (FlashAttention's 5 GEMMs, QK^T recomputed; exact
# when Dqk == Dv), so forward + backward = 3.5x the forward as NVIDIA's cal_hstu_flops_single_rank.
# Fake / meta offsets (no values) count the padded bound B * max_q_len * max_kv_len.


def _pairs(q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q_len: int, max_kv_len: int) -> int:
    try:
        lq = (q_offsets[1:] - q_offsets[:-1]).to(torch.float64)
        lk = (kv_offsets[1:] - kv_offsets[:-1]).to(torch.float64)
        return int((lq * lk).sum().item())
    except RuntimeError:  # fake / meta tensors have no values
        return (q_offsets.shape[0] - 1) * int(max_q_len) * int(max_kv_len)


def gdpa_flops(pairs: int, heads: int, d_qk: int, d_v: int, backward: bool = False) -> int:
    """Model FLOPs of attention over ``pairs`` valid (query, key) pairs per head: forward
    2 * pairs * heads * (d_qk + d_v); ``backward``: 2.5x that (see the note above). Shared with
    ``gemray.model.flops``."""
    fwd = 2 * pairs * heads * (d_qk + d_v)
    return fwd * 5 // 2 if backward else fwd


def _register_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    def cross_fwd(q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len, *args, out_val=None, **kw):
        return gdpa_flops(_pairs(q_offsets, kv_offsets, max_q_len, max_kv_len), q.shape[1], q.shape[2], v.shape[2])

    def cross_bwd(do, q, q_offsets, k, v, kv_offsets, max_q_len, max_kv_len, *args, out_val=None, **kw):
        return gdpa_flops(_pairs(q_offsets, kv_offsets, max_q_len, max_kv_len), q.shape[1], q.shape[2], v.shape[2],
                          backward=True)

    def _pma_pairs(seeds, kv_offsets, max_kv_len):
        try:
            return int((kv_offsets[-1] - kv_offsets[0]).item()) * seeds.shape[0]
        except RuntimeError:  # fake / meta tensors have no values: the padded bound
            return (kv_offsets.shape[0] - 1) * int(max_kv_len) * seeds.shape[0]

    def pma_fwd(seeds, k, v, kv_offsets, max_kv_len, *args, out_val=None, **kw):
        return gdpa_flops(_pma_pairs(seeds, kv_offsets, max_kv_len), seeds.shape[1], seeds.shape[2], v.shape[2])

    def pma_bwd(do, seeds, k, v, kv_offsets, max_kv_len, *args, out_val=None, **kw):
        return gdpa_flops(_pma_pairs(seeds, kv_offsets, max_kv_len), seeds.shape[1], seeds.shape[2], v.shape[2],
                          backward=True)

    for op, fn in ((torch.ops.gemray.cross_attention, cross_fwd),
                   (torch.ops.gemray.cross_attention_backward, cross_bwd),
                   (torch.ops.gemray.pma, pma_fwd), (torch.ops.gemray.pma_backward, pma_bwd)):
        if op not in flop_registry:
            register_flop_formula(op, get_raw=True)(fn)


_register_flops()


if torch.cuda.is_available():  # GPU machines import the kernels with gemray.ops: a torch.compile trace never does
    _triton_module()
