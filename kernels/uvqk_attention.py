"""The HSTU block's uvqk activation and its self-attention as one differentiable op, whose backward writes the
activation's input gradient straight from the attention's gradient kernels (``model.uvqk_kernel = "fused"``).

Shape key: T tokens, H heads, A = attention_dim (q / k per head), V = linear_dim (u / v per head),
W = 2 H V + 2 H A (the uvqk width; split order u, v, q, k), B sequences.

Forward (as ``model.uvqk_kernel = "triton"`` + the Triton attention): ``u, v, q, k = split(silu(x + bias))`` by
``gemray.kernels.bias_silu`` (one pass), then the jagged attention ``out = attn(q, k, v)`` by
``gemray.kernels.jagged_attention`` (causal self-attention, no attention bias). x [T, W] is the projection's GEMM
output (``x_norm @ W_uvqk``), saved for the backward, with q, k, v (the attention backward reads them).

Backward: the attention backward's kernels run with ACT_GRAD (``jagged_attention._store_grad``): where they would
store a dq / dk / dv tile they store ``g silu'(x + bias)`` of it into the q / k / v column range of d_x [T, W]
instead, and the tile's fp32 column sums into their own row of a partial-sum buffer; the u range keeps
bias_silu's ``_bias_silu_bwd`` launch (column offset 0) into the same d_x and buffer; d_bias = the buffer's column
sums. Why: with separate ops the attention backward writes dq, dk, dv ([T, H, D] each) and bias_silu's backward
reads them back with x: at GEM scale (T ~ 131k, H = 4, D = 256, bf16) ~1.6 GB of the block's 3.2 GB of backward
traffic is that round trip (an estimate: to be measured on a GPU). The u range cannot take that path (u's
gradient comes from the block's output LayerNorm product, not from the attention).

torch.library custom ops ``gemray::uvqk_attention`` (-> u, out, q, k, v, lse) and ``gemray::uvqk_attention_bwd``
(-> dx, dbias) with fake implementations; the backward is the forward's autograd formula, so torch.compile
(``train.compile``, fullgraph per block) sees two opaque ops. Not supported: an attention bias (dense or the
relative position / time bias), targets, PMA; the config refuses ``uvqk_kernel = "fused"`` with
``relative_bias = true``. Entry point: :func:`uvqk_attention_triton` (``gemray.ops.uvqk_attention`` dispatches
to it after the GEMM).
"""

from __future__ import annotations

import math

import torch
import triton

from gemray.kernels import bias_silu as bs
from gemray.kernels import config as kconfig
from gemray.kernels import jagged_attention as ja
from gemray.kernels.config import KernelConfig


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (then they take CPU tensors)."""
    return ja.interpreting()


def _sizes(heads: int, attention_dim: int, linear_dim: int) -> list[int]:
    """The split widths (u, v, q, k)."""
    return [heads * linear_dim, heads * linear_dim, heads * attention_dim, heads * attention_dim]


def _spec(heads, attention_dim, max_len, activation, causal, alpha):
    # the HSTU block's attention: self-attention, N = max_len, no block / window / targets / contextual prefix
    return ja._spec_of(activation, causal, alpha, 1.0 / float(max(max_len, 1)), 0, 0, False, max_len, max_len, 0)


def _forward(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config):
    T = x.shape[0]
    u, v, q, k = bs._forward(x, bias, _sizes(heads, attention_dim, linear_dim))
    q, k, v = (t.view(T, heads, d) for t, d in ((q, attention_dim), (k, attention_dim), (v, linear_dim)))
    cfg = kconfig.lookup(config)
    spec = _spec(heads, attention_dim, max_len, activation, causal, alpha)
    t_out, plan = ja._plan_of(q, k, v, None, offsets, offsets, None, spec, cfg)
    o, lse = ja._forward(q, k, v, None, offsets, offsets, None, spec, t_out, cfg, plan)
    return u, o, q, k, v, (lse if lse is not None else x.new_empty((0,), dtype=torch.float32))


@torch.library.custom_op("gemray::uvqk_attention", mutates_args=())
def uvqk_attention_op(x: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, heads: int, attention_dim: int,
                      linear_dim: int, max_len: int, activation: str, causal: bool, alpha: float, config: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward as a custom op (arguments checked by :func:`uvqk_attention_triton`): x [T, W] (contiguous), bias
    [W], offsets [B+1] int64; config a KernelConfig name. Returns (u [T, H V], out [T, H, V], q [T, H, A],
    k [T, H, A], v [T, H, V], lse [H, T] fp32 for softmax else [0]), all in x's dtype but lse; q / k / v / lse are
    what the backward reads (not differentiable outputs)."""
    return _forward(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config)


@uvqk_attention_op.register_fake
def _fwd_fake(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config):
    T = x.shape[0]
    lse = x.new_empty((heads, T) if activation == "softmax" else (0,), dtype=torch.float32)
    return (x.new_empty((T, heads * linear_dim)), x.new_empty((T, heads, linear_dim)),
            x.new_empty((T, heads, attention_dim)), x.new_empty((T, heads, attention_dim)),
            x.new_empty((T, heads, linear_dim)), lse)


def _backward(d_u, d_out, x, bias, q, k, v, out, lse, offsets, heads, attention_dim, linear_dim, max_len,
              activation, causal, alpha, config):
    T, W = x.shape
    hv = heads * linear_dim
    dx = torch.empty((T, W), device=x.device, dtype=x.dtype)
    if T == 0:
        return dx, torch.zeros_like(bias)
    cfg = kconfig.lookup(config)
    spec = _spec(heads, attention_dim, max_len, activation, causal, alpha)
    softmax = activation == "softmax"
    _, plan = ja._plan_of(q, k, v, None, offsets, offsets, None, spec, cfg)
    bt, bw, warps = bs.BWD_BLOCKS
    tiles_t = triton.cdiv(T, bt)
    cols = (2 * hv, 2 * hv + heads * attention_dim, hv)  # q, k, v ranges of the (u, v, q, k) split
    # the attention's gradients through the SiLU into dx's v, q, k columns; their partial column sums into part
    *_, part, _ = ja._backward(d_out, q, k, v, out if softmax else None, lse if softmax else None, None, offsets,
                               offsets, None, spec, False, cfg, plan, None, act=(x, bias, dx, cols, tiles_t))
    # the u range as bias_silu's backward does it (rows < tiles_t of part, columns [0, H V))
    d_u = bs._row_major(d_u)
    bs._bias_silu_bwd[(tiles_t, triton.cdiv(hv, bw))](
        x, bias, d_u, dx, part, T, hv, 0, x.stride(0), d_u.stride(0), dx.stride(0), part.stride(0),
        BLOCK_T=bt, BLOCK_W=bw, num_warps=warps)
    return dx, part.sum(0).to(bias.dtype)


@torch.library.custom_op("gemray::uvqk_attention_bwd", mutates_args=())
def uvqk_attention_bwd_op(d_u: torch.Tensor, d_out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          offsets: torch.Tensor, heads: int, attention_dim: int, linear_dim: int, max_len: int,
                          activation: str, causal: bool, alpha: float, config: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward as a custom op: d_u [T, H V] and d_out [T, H, V] (x's dtype), the forward's x, bias, q, k, v,
    out, lse (out / lse read for softmax only) and its other arguments. Returns (dx [T, W] contiguous in x's dtype,
    dbias [W] in bias's dtype: float32 column sums of the unrounded dx)."""
    return _backward(d_u, d_out, x, bias, q, k, v, out, lse, offsets, heads, attention_dim, linear_dim, max_len,
                     activation, causal, alpha, config)


@uvqk_attention_bwd_op.register_fake
def _bwd_fake(d_u, d_out, x, bias, q, k, v, out, lse, offsets, heads, attention_dim, linear_dim, max_len,
              activation, causal, alpha, config):
    return x.new_empty(x.shape), torch.empty_like(bias)


def _setup(ctx, inputs, output) -> None:
    x, bias, offsets = inputs[:3]
    _, o, q, k, v, lse = output
    ctx.save_for_backward(x, bias, offsets, q, k, v, o, lse)
    ctx.scalars = inputs[3:]  # heads ... config
    ctx.mark_non_differentiable(q, k, v, lse)


def _autograd_backward(ctx, d_u, d_out, *_unused):
    x, bias, offsets, q, k, v, o, lse = ctx.saved_tensors
    heads, attention_dim, linear_dim = ctx.scalars[:3]
    T = x.shape[0]
    if d_u is None:
        d_u = x.new_zeros((T, heads * linear_dim))
    if d_out is None:
        d_out = x.new_zeros((T, heads, linear_dim))
    dx, dbias = torch.ops.gemray.uvqk_attention_bwd(d_u, d_out, x, bias, q, k, v, o, lse, offsets, *ctx.scalars)
    return (dx, dbias) + (None,) * 9


uvqk_attention_op.register_autograd(_autograd_backward, setup_context=_setup)


def uvqk_attention_triton(x: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, max_len: int, heads: int,
                          attention_dim: int, linear_dim: int, *, activation: str = "silu", causal: bool = True,
                          alpha: float | None = None, config: KernelConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``u, v, q, k = split(silu(x + bias), (H V, H V, H A, H A))`` then ``out = jagged_attention(q, k, v)``, with
    the fused backward (module docstring). Semantics: ``bias_silu_split_ref`` then ``jagged_attention_ref``.

    Args:
        x: [T, W] float32 / bf16 / fp16, the uvqk projection without its bias (copied when not contiguous).
        bias: [W] float (added in float32).
        offsets: [B+1] int64 jagged offsets of the T rows; max_len: host int >= every length, also the N of the
            pointwise activations.
        heads, attention_dim, linear_dim: H, A, V (W must be 2 H V + 2 H A; A, V <= 256).
        activation: "silu" | "softmax" | "gelu" | "none"; causal; alpha: score scale (None: the reference's
            default, 1/sqrt(A) for softmax, else 1); config: the attention kernels' KernelConfig (None: DEFAULT).
    Returns:
        (u [T, H V], out [T, H, V]) in x's dtype, differentiable in x and bias (dx in x's dtype, dbias in
        bias's). Under TRITON_INTERPRET=1 bf16 runs in float32 (the interpreter's bf16 tl.dot is wrong).
    Raises:
        ValueError (shapes, dtypes, options, a bad batch on host tensors) or RuntimeError (tensors on a device the
        kernels do not run on).
    """
    sizes = _sizes(heads, attention_dim, linear_dim)
    bs._check(x, bias, sizes)
    if activation not in ja.ACTIVATIONS:
        raise ValueError(f"uvqk_attention: activation must be one of {sorted(ja.ACTIVATIONS)}, got {activation!r}")
    if min(heads, attention_dim, linear_dim) < 1 or max(attention_dim, linear_dim) > 256:
        raise ValueError(f"uvqk_attention: heads, attention_dim, linear_dim must be >= 1 (head dims <= 256), got "
                         f"{heads}, {attention_dim}, {linear_dim}")
    ja._check_offsets("offsets", offsets, x.shape[0], x.device)
    if max_len < 0:
        raise ValueError(f"uvqk_attention: max_len must be >= 0, got {max_len}")
    cfg = kconfig.resolve(config)
    if ja.interpreting() and x.dtype == torch.bfloat16:  # the interpreter's bf16 tl.dot is wrong: float32
        u, out = uvqk_attention_triton(x.float(), bias, offsets, max_len, heads, attention_dim, linear_dim,
                                       activation=activation, causal=causal, alpha=alpha, config=cfg)
        return u.to(torch.bfloat16), out.to(torch.bfloat16)
    if alpha is None:  # the reference's convention (jagged_attention_ref)
        alpha = 1.0 / math.sqrt(attention_dim) if activation == "softmax" else 1.0
    if not alpha > 0:
        raise ValueError(f"uvqk_attention: alpha must be > 0, got {alpha}")
    x = x.contiguous()  # dx is allocated contiguous and the kernels index x with dx's layout
    u, out, *_ = torch.ops.gemray.uvqk_attention(x, bias.contiguous(), offsets, int(heads), int(attention_dim),
                                                 int(linear_dim), int(max_len), activation, bool(causal),
                                                 float(alpha), cfg.name)
    return u, out
