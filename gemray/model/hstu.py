"""HSTU blocks and encoder, jagged end to end (Zhai et al. 2024, arXiv:2402.17152, sec. 3.1, eqs. 1-3).

Shape key: T tokens, B sequences, D = ``cfg.width`` (residual width: model_dim, or embedding_dim), H heads, A = attention_dim
(per-head q/k width), V = linear_dim (per-head u/v width), N = max_seq_len, n = longest sequence.

One block (generative-recommenders' ``SequentialTransductionUnitJagged``, "uvqk" + "rel_bias")::

    x_norm     = LayerNorm(x)                                  [T, D]   (no affine, eps 1e-6)
    u, v, q, k = split(silu(x_norm @ W_uvqk + b_uvqk))         [T, H*V], [T, H*V], [T, H*A], [T, H*A]
                                                               (gemray.ops.uvqk_projection, model.uvqk_kernel;
                                                               u's SiLU applied in the gate below, where
                                                               train.compile fuses it into the gate's pass)
    a          = silu(q k^T * alpha + rab^{p,t}) / N, causal   per head, via gemray.ops.attention
    y          = LayerNorm(a @ v) * u                          [T, H*V]
    x          = x + Dropout(y) @ W_o + b_o                    [T, D]   (dropout before W_o, as GR)

rab^{p,t}: learned bias per bucketed relative position |i-j| plus per bucketed time difference
tq_i - ts_j (``gemray.ops.relative_bias_buckets``), one per block, shared across heads. tq_i is the query
time of position i: with ``model.time_bias_query = "next"`` (default, as generative-recommenders) the
timestamp of the item position i predicts (its next item; at evaluation the held-out target's time, i.e.
the request time), with "self" its own timestamp ts_i.

Parameters are owned directly by the modules that initialise them; every such module has
``reset_parameters()`` (its own parameters) and the constructors call it, so a build on a real device is
initialised. A build on device "meta" is materialised with ``to_empty(device=...)`` and then
``init_weights()``, which draws exactly what construction on a real device draws, in the same order
(children before their parent: per block the relative bias, then the block; the encoder's positional table
last).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from gemray import ops
from gemray.config import ModelConfig, kernel_tiles_spec
from gemray.kernels import config as kconfig
from gemray.kernels.config import KernelConfig
from gemray.jagged import positions

LN_EPS = 1e-6


@functools.lru_cache(maxsize=16)
def kernel_config_of(kernel_tiles: str) -> KernelConfig:
    """The attention kernels' ``KernelConfig`` of a ``model.kernel_tiles`` value ("" -> DEFAULT; see
    ``gemray.config.ModelConfig``), cached per value (configs are immutable). Raises ValueError naming
    model.kernel_tiles for an unreadable file, malformed JSON, an unknown regime / tile kind / head-dim bucket
    or a malformed tile."""
    spec = kernel_tiles_spec(kernel_tiles)
    if not spec:
        return kconfig.DEFAULT
    try:
        return kconfig.apply_tiles(spec)
    except ValueError as e:
        raise ValueError(f"model.kernel_tiles: {str(e).removeprefix('kernel tiles: ')}") from None


class RelativeBucketedBias(nn.Module):
    """Learned relative attention bias: position buckets + time-difference buckets (HSTU rab^{p,t}).

    pos_w: [num_position_buckets], ts_w: [num_time_buckets], init normal(0, 0.02) as generative-recommenders.
    """

    def __init__(self, num_position_buckets: int, num_time_buckets: int, max_len: int, device=None):
        super().__init__()
        self.max_len = max_len
        self.pos_w = nn.Parameter(torch.empty(num_position_buckets, device=device))
        self.ts_w = nn.Parameter(torch.empty(num_time_buckets, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_w, std=0.02)
        nn.init.normal_(self.ts_w, std=0.02)

    def inputs(self, timestamps: torch.Tensor, buckets: tuple[torch.Tensor, torch.Tensor] | None = None,
               cache: dict | None = None, query_timestamps: torch.Tensor | None = None
               ) -> ops.RelativeBiasInputs:
        """The ingredients for ``ops.attention(rel_bias=...)``: timestamps [T] int64 + this block's weights.

        buckets / cache: shared by the blocks of one forward (``ops.relative_bias_buckets``, a dict);
        query_timestamps: optional [T] int64 query times (default: ``timestamps``).
        """
        return ops.RelativeBiasInputs(timestamps, self.pos_w, self.ts_w, self.max_len, buckets, cache,
                                      query_timestamps)

    def forward(self, timestamps: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
        """timestamps [T] int64, offsets [B+1] -> dense bias [B, n, n]."""
        return self.inputs(timestamps).dense(offsets, n)


class HSTUBlock(nn.Module):
    """One HSTU layer over jagged tokens ``x [T, D]`` (see module docstring for the exact math)."""

    # the fan-in dimension of each weight matrix (gemray.model.lr_scaling): uvqk_weight [D, W] is x @ W,
    # o_weight [D, H*V] is nn.Linear's [out, in]
    FAN_IN_DIMS = {"uvqk_weight": 0, "o_weight": 1}

    def __init__(self, cfg: ModelConfig, max_seq_len: int, device=None):
        super().__init__()
        if cfg.attn_dropout > 0:
            raise ValueError("model.attn_dropout: attention dropout is not implemented (use 0.0)")
        self.d, self.h, self.a, self.v = cfg.width, cfg.num_heads, cfg.attention_dim, cfg.linear_dim
        self.max_seq_len = max_seq_len
        self.activation = cfg.attn_activation
        self.backend = cfg.attention_backend
        self.uvqk_backend = cfg.uvqk_kernel
        self.kernel_config = kernel_config_of(cfg.kernel_tiles)
        width = 2 * self.h * self.v + 2 * self.h * self.a
        self.uvqk_weight = nn.Parameter(torch.empty(self.d, width, device=device))
        self.uvqk_bias = nn.Parameter(torch.empty(width, device=device))
        self.o_weight = nn.Parameter(torch.empty(self.d, self.h * self.v, device=device))
        self.o_bias = nn.Parameter(torch.empty(self.d, device=device))
        self.dropout = nn.Dropout(cfg.dropout)
        # model.relative_bias = false: no rab^{p,t} (no parameters, attention without a bias)
        self.rel_bias = (RelativeBucketedBias(cfg.num_position_buckets, cfg.num_time_buckets, max_seq_len,
                                              device=device) if cfg.relative_bias else None)
        self.fp8 = None  # gemray.model.fp8.Fp8Settings once convert_to_fp8 converted this block
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.uvqk_weight, std=0.02)   # generative-recommenders' _uvqk init
        nn.init.zeros_(self.uvqk_bias)
        nn.init.xavier_uniform_(self.o_weight)        # generative-recommenders' _o init
        nn.init.zeros_(self.o_bias)

    def init_weights(self) -> None:
        """Draw this block's parameters anew as construction does: ``rel_bias`` first, then the block's own."""
        if self.rel_bias is not None:
            self.rel_bias.reset_parameters()
        self.reset_parameters()

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                buckets: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: dict | None = None, query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] float, offsets [B+1] int64, timestamps [T] int64 -> [T, D].

        buckets / cache: optional ``ops.relative_bias_buckets`` of this batch and a dict, both shared by
        the blocks of one forward (bucketise and slice once; the reference backend's). query_timestamps:
        optional [T] int64 query times of the time bias (default ``timestamps``; the reference ignores them when
        ``buckets`` are given, which must then have been made from them; the Triton kernels use them).
        """
        T = x.shape[0]
        sizes = [self.h * self.v, self.h * self.v, self.h * self.a, self.h * self.a]
        # z_u: u before its SiLU (ops.uvqk_projection says why the gate applies it)
        if self.fp8 is None:
            x_norm = F.layer_norm(x, (self.d,), eps=LN_EPS)
            z_u, v, q, k = ops.uvqk_projection(x_norm, self.uvqk_weight, self.uvqk_bias, sizes,
                                               backend=self.uvqk_backend)
        else:
            z = self._fp8_uvqk(x)
            z_u = z[:, :sizes[0]]
            v, q, k = torch.split(F.silu(z[:, sizes[0]:]), sizes[1:], 1)
        attn = ops.attention(
            q.reshape(T, self.h, self.a), k.reshape(T, self.h, self.a), v.reshape(T, self.h, self.v),
            offsets, self.max_seq_len, activation=self.activation, causal=True,
            rel_bias=(None if self.rel_bias is None else self.rel_bias.inputs(timestamps, buckets, cache,
                                                                               query_timestamps)),
            backend=self.backend, config=self.kernel_config)
        y = F.layer_norm(attn.reshape(T, self.h * self.v), (self.h * self.v,), eps=LN_EPS) * F.silu(z_u)
        if self.fp8 is not None:
            from gemray.model.fp8 import fp8_linear

            return x + fp8_linear(self.dropout(y), self.o_weight, self.o_bias, self._fp8_for("o"))
        return x + F.linear(self.dropout(y), self.o_weight, self.o_bias)

    def _fp8_uvqk(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> x_norm @ W_uvqk + b_uvqk [T, width] in FP8: the LayerNorm emits its output as e4m3 with
        one scale per row (``norm_quant(block_size=D)``: the fused Triton kernel on CUDA, the reference
        elsewhere) straight into the rowwise FP8 GEMM (``gemray.model.fp8``). A D that is not a power of two
        (the kernel's block must be) falls back to LayerNorm + a separate quantization, and so does the
        tensorwise recipe: its one scale is the amax of the whole [T, D] output, known only once every row is
        normalised, so a row-by-row kernel cannot emit those bytes. Re-scaling the kernel's rowwise bytes to the
        tensor's scale instead would round every value twice (the row grid, then the coarser tensor grid) and
        still cost a pass over x; quantizing the LayerNorm's output once is both simpler and exact to the one
        rounding of the recipe."""
        from gemray.kernels.reference import norm_quant_ref
        from gemray.model.fp8 import fp8_linear

        w = self.uvqk_weight.t()  # [width, D]: the [N, K] layout fp8_linear takes (a view, no copy)
        if self.d & (self.d - 1) or self.fp8.recipe == "tensorwise":
            x_norm = F.layer_norm(x, (self.d,), eps=LN_EPS)
            return fp8_linear(x_norm, w, self.uvqk_bias, self._fp8_for("uvqk"))
        if x.is_cuda:
            from gemray.kernels.norm_quant import norm_quant

            x_norm, x_q, x_s = norm_quant(x, None, None, kind="layer", eps=LN_EPS, block_size=self.d)
        else:
            x_norm, x_q, x_s = norm_quant_ref(x, None, None, kind="layer", eps=LN_EPS, block_size=self.d)
        return fp8_linear(x_norm, w, self.uvqk_bias, self._fp8_for("uvqk"), x_fp8=x_q, x_scale=x_s)

    def _fp8_for(self, gemm: str):
        """This block's FP8 settings named ``<block>.<gemm>`` (the numerics counters' key)."""
        import dataclasses

        return dataclasses.replace(self.fp8, name=f"{self.fp8.name}.{gemm}" if self.fp8.name else "")


class InputScale(nn.Module):
    """The encoder's input: ``tok_emb * scale + pos_emb[pos]`` -> [T, D], cast to ``dtype`` when given (the
    bf16 residual stream, ``model.fp32_residual = false``). Parameterless (``pos_emb`` stays the encoder's
    parameter, so state-dict keys do not change): a module of its own so that ``train.compile`` compiles it
    (``gemray.parallel.compile.compile_targets``) into one kernel forward and one backward.

    tok_emb [T, D] float, pos_emb [max_seq_len, D], pos [T] int64 (positions inside each sequence)."""

    def forward(self, tok_emb: torch.Tensor, pos_emb: torch.Tensor, pos: torch.Tensor, scale: float,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        x = tok_emb * scale + pos_emb[pos]
        return x if dtype is None else x.to(dtype)


class L2Norm(nn.Module):
    """``F.normalize(x, dim=-1, eps)``: x [T, D] -> unit-norm rows in x's dtype (the encoder's output,
    generative-recommenders' ``L2NormEmbeddingPostprocessor``), the norm taken in float32 (or wider). A module so that
    ``train.compile`` compiles it: eager, its forward and backward were several float32 broadcast divisions over [T, D].

    The explicit dtype matters on CUDA: autocast runs ``norm`` in float32 and the division promotes, so a bf16 stream
    (``model.fp32_residual = false``) came out float32, and its consumers cast [T, D] back to bf16 eagerly, their
    backward converting and accumulating a float32 gradient."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
        return F.normalize(x.to(wide), dim=-1, eps=self.eps).to(x.dtype)


class HSTUEncoder(nn.Module):
    """Token embeddings -> L2-normalised user states, jagged.

    Input preprocessing as generative-recommenders' ``LearnablePositionalEmbeddingInputFeaturesPreprocessor``:
    ``x = tok_emb * sqrt(D) + pos_emb[position]`` (float32; in the autocast dtype under ``model.fp32_residual =
    false``) then dropout; ``tok_emb`` is the item embedding plus the
    optional rating / time-gap embeddings. Then ``num_blocks`` HSTU blocks and an L2 normalisation
    (generative-recommenders' ``L2NormEmbeddingPostprocessor``).

    pos_emb: [max_seq_len, D], truncated normal std sqrt(1/D). Positions count from each sequence's start.
    """

    def __init__(self, cfg: ModelConfig, max_seq_len: int = 200, device=None):
        super().__init__()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
        self.cfg = cfg
        self.d = cfg.width
        self.max_seq_len = max_seq_len
        self.pos_emb = nn.Parameter(torch.empty(max_seq_len, self.d, device=device))
        self.input_dropout = nn.Dropout(cfg.dropout)
        self.input_scale = InputScale()
        self.output_norm = L2Norm(eps=1e-6)
        self.blocks = nn.ModuleList(HSTUBlock(cfg, max_seq_len, device=device) for _ in range(cfg.num_blocks))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = math.sqrt(1.0 / self.d)
        nn.init.trunc_normal_(self.pos_emb, std=std, a=-2 * std, b=2 * std)

    def init_weights(self) -> None:
        """Draw every parameter anew, in construction order: the blocks in order (each its relative bias,
        then its projections), then ``pos_emb``. The same global-RNG draws as ``HSTUEncoder(...)`` on a real
        device, so ``torch.manual_seed(s)`` before either gives equal parameters."""
        for block in self.blocks:
            block.init_weights()
        self.reset_parameters()

    def forward(self, tok_emb: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                query_timestamps: torch.Tensor | None = None, *, max_len: int | None = None) -> torch.Tensor:
        """tok_emb [T, D] float, offsets [B+1] int64, timestamps [T] int64 -> states [T, D], unit L2 norm.

        query_timestamps: optional [T] int64 query time of each position for the time bias (default
        ``timestamps``; the model passes ``gemray.jagged.query_timestamps``, see the module docstring).
        max_len: the longest sequence as a host int (``gemray.jagged.HostShape``; GEM passes it); None: read
        from the offsets, which on CUDA is a host sync (the Triton kernels bound it by ``max_seq_len`` anyway
        and assert on the device).

        Raises ValueError when a sequence is longer than ``max_seq_len`` (with max_len known or on the CPU).
        """
        n = max_len
        if n is None and (offsets.device.type == "cpu" or self._needs_n()):
            lengths = offsets[1:] - offsets[:-1]
            n = int(lengths.max()) if lengths.numel() else 0
        if n is not None and n > self.max_seq_len:
            raise ValueError(f"HSTUEncoder: a sequence of length {n} > max_seq_len {self.max_seq_len}")
        pos = positions(offsets, tok_emb.shape[0])
        dev = tok_emb.device.type
        # model.fp32_residual = false: the stream in the autocast dtype (bf16; config.py)
        dtype = (torch.get_autocast_dtype(dev) if not self.cfg.fp32_residual and torch.is_autocast_enabled(dev)
                 else None)
        x = self.input_dropout(self.input_scale(tok_emb, self.pos_emb, pos, math.sqrt(self.d), dtype))
        # the reference bucketises once per forward ([B, n, n] indices shared by the blocks); the Triton kernels
        # bucketise per tile from the timestamps themselves (no [B, n, n] tensor)
        buckets = None
        if self.cfg.relative_bias and (ops.resolve_backend(self.cfg.attention_backend, x.device)
                                       is ops.AttentionBackend.REFERENCE):
            buckets = ops.relative_bias_buckets(timestamps, offsets, n, self.cfg.num_position_buckets,
                                                self.cfg.num_time_buckets, self.max_seq_len, query_timestamps)
        cache: dict = {}
        for block in self.blocks:  # (train.compile: each block a compiled module, gemray.parallel.compile)
            x = block(x, offsets, timestamps, buckets, cache, query_timestamps)
        return self.output_norm(x)

    def _needs_n(self) -> bool:
        """Whether the forward needs the longest length itself: the reference backend's bucketing does."""
        return bool(self.cfg.relative_bias) and ops.resolve_backend(
            self.cfg.attention_backend, self.pos_emb.device) is ops.AttentionBackend.REFERENCE
