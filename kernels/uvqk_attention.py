"""The HSTU block's v / q / k activation and its self-attention as one differentiable op, whose backward writes the
q and k ranges of the projection's gradient from the attention's dQ / dK products (``model.uvqk_kernel =
"fused"``).

Shape key: T tokens, H heads, A = attention_dim (q / k per head), V = linear_dim (v per head), W = H V + 2 H A (the
v / q / k width; split order v, q, k), B sequences.

Forward, the same kernels as ``model.uvqk_kernel = "triton"`` with the Triton attention (so the same bits):
``v, q, k = split(silu(x + bias))`` by ``gemray.kernels.bias_silu`` (one launch per split), then the jagged
attention ``out = attn(q, k, v)`` by ``gemray.kernels.jagged_attention`` (causal self-attention, no attention
bias). x [T, W] is the projection's GEMM output (``x_norm @ W_vqk``, no bias), saved for the backward with q, k, v
(the attention backward reads them), as the two separate ops save them.

Backward: the attention backward's plan. Where its dQ and dK are the warp-specialized Gluon products from the stored
dS^T (``ws_attention._ws_dv_ds`` then ``_ws_ds_gemm`` twice: an sm_90 GPU, the regime's ws_bwd + ws_dkdq), those
two launches run with their ACT_GRAD epilogue: where they would store a dq / dk tile they store d_x = round(dq)
silu'(x + bias) into the q / k columns of d_x [T, W] and the tile's fp32 column sums into their own row of a
partial-sum buffer (no atomics); v's range stays bias_silu's ``_bias_silu_bwd`` launch on dv. Everywhere else (the
interpreter, other regimes, the Triton dQ / dK launches) dq and dk are computed as without this op and bias_silu's
backward runs on dv, dq, dk: today's launches, bit for bit. Why: with separate ops the attention backward writes dq
and dk ([T, H, A] bf16 each) and bias_silu's backward reads them back with x: at GEM scale (T ~ 131k, H = 4, A =
256) ~0.5 GB a slot a layer; bias_silu's backward took 7.0 ms a step for v + q + k on an H100 (~2.8 TB/s). The
fused dQ / dK epilogue reads x and writes d_x where it wrote dq / dk: an estimate of ~3 ms a step less, to be
measured on a GPU (benchmarks/uvqk_fused.py). d_x of q / k is the unfused path's bit for bit (the same rounding of
dq, the same float32 formula); the bias gradient's q / k columns are summed in another order (close, not equal).

torch.library custom ops ``gemray::vqk_attention`` (-> out, v, q, k, lse) and ``gemray::vqk_attention_bwd`` (->
dx, dbias) with fake implementations; the backward is the forward's autograd formula, so torch.compile
(``train.compile``, fullgraph per block) sees two opaque ops. Not supported: an attention bias (dense or the
relative position / time bias), targets, PMA; the config refuses ``uvqk_kernel = "fused"`` with
``relative_bias = true``, FP8 precision or the reference attention. Entry point: :func:`vqk_attention_triton`
(``gemray.ops.uvqk_attention`` dispatches to it after the GEMM).
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
    """The split widths (v, q, k)."""
    return [heads * linear_dim, heads * attention_dim, heads * attention_dim]


def _spec(max_len: int, activation: str, causal: bool, alpha: float) -> ja._Spec:
    """The HSTU block's attention as ``jagged_attention_triton`` calls it: self-attention, N = max(max_len, 1), no
    block / window / targets / contextual prefix."""
    return ja._spec_of(activation, causal, alpha, 1.0 / float(max(max_len, 1)), 0, 0, False, max_len, max_len, 0)


def _attn_inputs(*xs: torch.Tensor) -> tuple:
    """The attention kernels' inputs: as given, or float32 under the interpreter for bf16 (its bf16 tl.dot is
    wrong; ``gdpa_triton`` does the same, so the results match the unfused ops')."""
    if interpreting() and xs[0].dtype == torch.bfloat16:
        return tuple(x.float() for x in xs)
    return xs


def _forward(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config):
    T = x.shape[0]
    v, q, k = bs._forward(x, bias, _sizes(heads, attention_dim, linear_dim))
    q, k, v = (t.view(T, heads, d) for t, d in ((q, attention_dim), (k, attention_dim), (v, linear_dim)))
    cfg = kconfig.lookup(config)
    spec = _spec(max_len, activation, causal, alpha)
    qa, ka, va = _attn_inputs(q, k, v)
    t_out, plan = ja._plan_of(qa, ka, va, None, offsets, offsets, None, spec, cfg)
    o, lse = ja._forward(qa, ka, va, None, offsets, offsets, None, spec, t_out, cfg, plan)
    return o.to(x.dtype), v, q, k, (lse if lse is not None else x.new_empty((0,), dtype=torch.float32))


@torch.library.custom_op("gemray::vqk_attention", mutates_args=())
def vqk_attention_op(x: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, heads: int, attention_dim: int,
                     linear_dim: int, max_len: int, activation: str, causal: bool, alpha: float, config: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward as a custom op (arguments checked by :func:`vqk_attention_triton`): x [T, W] (contiguous), bias [W],
    offsets [B+1] int64; config a KernelConfig name. Returns (out [T, H, V], v [T, H, V], q [T, H, A], k [T, H, A],
    lse [H, T] fp32 for softmax else [0]), all in x's dtype but lse; v / q / k / lse are what the backward reads
    (not differentiable outputs)."""
    return _forward(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config)


@vqk_attention_op.register_fake
def _fwd_fake(x, bias, offsets, heads, attention_dim, linear_dim, max_len, activation, causal, alpha, config):
    T = x.shape[0]
    lse = x.new_empty((heads, T) if activation == "softmax" else (0,), dtype=torch.float32)
    return (x.new_empty((T, heads, linear_dim)), x.new_empty((T, heads, linear_dim)),
            x.new_empty((T, heads, attention_dim)), x.new_empty((T, heads, attention_dim)), lse)


def _backward(d_out, x, bias, v, q, k, out, lse, offsets, heads, attention_dim, linear_dim, max_len, activation,
              causal, alpha, config):
    """(dx [T, W] in x's dtype, dbias [W] in bias's dtype): module docstring."""
    T, W = x.shape
    sizes = _sizes(heads, attention_dim, linear_dim)
    if T == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format), torch.zeros_like(bias)
    cfg = kconfig.lookup(config)
    spec = _spec(max_len, activation, causal, alpha)
    softmax = activation == "softmax"
    qa, ka, va, da = _attn_inputs(q, k, v, d_out)
    oa = _attn_inputs(out)[0] if softmax else None
    _, plan = ja._plan_of(qa, ka, va, None, offsets, offsets, None, spec, cfg)
    hv, ha = sizes[0], sizes[1]
    dx = torch.empty((T, W), device=x.device, dtype=x.dtype)  # contiguous, as bias_silu's
    bias = bias.contiguous()
    act = None
    if plan is not None and not interpreting():  # the Gluon products' epilogue, where the plan has them
        bias32 = bias.to(torch.float32)
        cols = ((hv, hv + ha), (hv + ha, W))
        xq, xk = (x[:, a:b].view(T, heads, attention_dim) for a, b in cols)
        dxq, dxk = (dx[:, a:b].view(T, heads, attention_dim) for a, b in cols)
        act = (xq, bias32[cols[0][0]:cols[0][1]], dxq, xk, bias32[cols[1][0]:cols[1][1]], dxk)
    dq, dk, dv, parts, _ = ja._backward(da, qa, ka, va, oa, lse if softmax else None, None, offsets, offsets, None,
                                        spec, False, cfg, plan, None, act)
    if dq is None:  # the epilogue wrote d_x's q / k columns: bias_silu's backward for v's alone
        part = _bias_silu_bwd_into([dv], x, bias, [hv], dx)
        return dx, torch.cat([part.sum(0), parts[0].sum(0), parts[1].sum(0)]).to(bias.dtype)
    # no epilogue ran: bias_silu's backward on the three gradients (the unfused launches)
    part = _bias_silu_bwd_into([dv, dq, dk], x, bias, sizes, dx)
    return dx, part.sum(0).to(bias.dtype)


def _bias_silu_bwd_into(grads: list, x: torch.Tensor, bias: torch.Tensor, sizes: list[int],
                        dx: torch.Tensor) -> torch.Tensor:
    """``bias_silu._backward``'s launches (the same kernel, blocks and grid) for the first sum(sizes) columns of x
    [T, W] (contiguous) and bias [W] (contiguous), grads[i] [T, H, D] (any float dtype: cast to x's as autograd
    casts the unfused attention's gradients), writing into dx [T, W] (contiguous). Returns the partial column sums
    [T / BLOCK_T, sum(sizes)] fp32 (every entry written)."""
    T = x.shape[0]
    bt, bw, warps = bs.BWD_BLOCKS
    tiles_t = triton.cdiv(T, bt)
    part = torch.empty((tiles_t, sum(sizes)), dtype=torch.float32, device=x.device)
    col0 = 0
    for g, w in zip(grads, sizes):
        g = bs._row_major(g.reshape(T, w).to(x.dtype))
        bs._bias_silu_bwd[(tiles_t, triton.cdiv(w, bw))](
            x, bias, g, dx, part, T, w, col0, x.stride(0), g.stride(0), dx.stride(0), part.stride(0),
            BLOCK_T=bt, BLOCK_W=bw, num_warps=warps)
        col0 += w
    return part


@torch.library.custom_op("gemray::vqk_attention_bwd", mutates_args=())
def vqk_attention_bwd_op(d_out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, v: torch.Tensor,
                         q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         offsets: torch.Tensor, heads: int, attention_dim: int, linear_dim: int, max_len: int,
                         activation: str, causal: bool, alpha: float, config: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward as a custom op: d_out [T, H, V] (x's dtype), the forward's x, bias, v, q, k, out, lse (out / lse
    read for softmax only) and its other arguments. Returns (dx [T, W] contiguous in x's dtype, dbias [W] in bias's
    dtype: float32 column sums of the unrounded dx)."""
    return _backward(d_out, x, bias, v, q, k, out, lse, offsets, heads, attention_dim, linear_dim, max_len,
                     activation, causal, alpha, config)


@vqk_attention_bwd_op.register_fake
def _bwd_fake(d_out, x, bias, v, q, k, out, lse, offsets, heads, attention_dim, linear_dim, max_len, activation,
              causal, alpha, config):
    return x.new_empty(x.shape), torch.empty_like(bias)


def _setup(ctx, inputs, output) -> None:
    x, bias, offsets = inputs[:3]
    o, v, q, k, lse = output
    softmax = inputs[7] == "softmax"
    ctx.save_for_backward(x, bias, offsets, v, q, k, o if softmax else None, lse)
    ctx.scalars = inputs[3:]  # heads ... config
    ctx.mark_non_differentiable(v, q, k, lse)


def _autograd_backward(ctx, d_out, *_unused):
    x, bias, offsets, v, q, k, o, lse = ctx.saved_tensors
    if d_out is None:
        d_out = x.new_zeros(v.shape)
    dx, dbias = torch.ops.gemray.vqk_attention_bwd(d_out, x, bias, v, q, k, o if o is not None else d_out, lse,
                                                   offsets, *ctx.scalars)
    return (dx, dbias) + (None,) * 9


vqk_attention_op.register_autograd(_autograd_backward, setup_context=_setup)


def vqk_attention_triton(x: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, max_len: int, heads: int,
                         attention_dim: int, linear_dim: int, *, activation: str = "silu", causal: bool = True,
                         alpha: float | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """``v, q, k = split(silu(x + bias), (H V, H A, H A))`` then ``out = jagged_attention(q, k, v)``, with the
    fused q / k backward (module docstring). Semantics: ``bias_silu_split_ref`` then ``jagged_attention_ref``.

    Args:
        x: [T, W] float32 / bf16 / fp16, the v / q / k projection without its bias (copied when not contiguous).
        bias: [W] float (added in float32).
        offsets: [B+1] int64 jagged offsets of the T rows; max_len: host int >= every length, also the N of the
            pointwise activations.
        heads, attention_dim, linear_dim: H, A, V (W must be H V + 2 H A; A, V <= 256).
        activation: "silu" | "softmax" | "gelu" | "none"; causal; alpha: score scale (None: the reference's
            default, 1/sqrt(A) for softmax, else 1); config: the attention kernels' KernelConfig (None: DEFAULT).
    Returns:
        out [T, H, V] in x's dtype, differentiable in x and bias (dx in x's dtype, dbias in bias's).
    Raises:
        ValueError (shapes, dtypes, options, a bad batch on host tensors) or RuntimeError (tensors on a device the
        kernels do not run on).
    """
    sizes = _sizes(heads, attention_dim, linear_dim)
    if min(heads, attention_dim, linear_dim) < 1 or max(attention_dim, linear_dim) > 256:
        raise ValueError(f"vqk_attention: heads, attention_dim, linear_dim must be >= 1 (head dims <= 256), got "
                         f"{heads}, {attention_dim}, {linear_dim}")
    bs._check(x, bias, sizes)
    if activation not in ja.ACTIVATIONS:
        raise ValueError(f"vqk_attention: activation must be one of {sorted(ja.ACTIVATIONS)}, got {activation!r}")
    ja._check_offsets("offsets", offsets, x.shape[0], x.device)
    if max_len < 0:
        raise ValueError(f"vqk_attention: max_len must be >= 0, got {max_len}")
    cfg = kconfig.resolve(config)
    if alpha is None:  # the reference's convention (jagged_attention_ref)
        alpha = 1.0 / math.sqrt(attention_dim) if activation == "softmax" else 1.0
    if not alpha > 0:
        raise ValueError(f"vqk_attention: alpha must be > 0, got {alpha}")
    x = x.contiguous()  # d_x is allocated contiguous and the epilogue indexes x with d_x's layout
    out, *_ = torch.ops.gemray.vqk_attention(x, bias.contiguous(), offsets, int(heads), int(attention_dim),
                                             int(linear_dim), int(max_len), activation, bool(causal), float(alpha),
                                             cfg.name)
    return out
