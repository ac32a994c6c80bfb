"""The fused v / q / k activation + attention (gemray.kernels.uvqk_attention, ``model.uvqk_kernel = "fused"``):
the op against today's composition (bias_silu's kernels then the Triton attention) and the float64 references, the
backward's hand-over of the q / k ranges to the Gluon dQ / dK products' ACT_GRAD epilogue, the HSTU block with it,
and the config's refusals.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set below when no CUDA device is present) on jagged batches with
empty, length-1 and maximal sequences; the Gluon launches (GPU only) are replaced by float64 torch emulations
where a test forces their path, so the host plumbing (column ranges, strides, partial-sum rows) is checked here.
GPU (@pytest.mark.gpu, the lead's H100): the real epilogue against the unfused path, bit for bit on d_x.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray.config import JobConfig, ModelConfig  # noqa: E402
from gemray.kernels import bias_silu  # noqa: E402
from gemray.kernels import jagged_attention as ja  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels import uvqk_attention as ua  # noqa: E402
from gemray.kernels.config import DEFAULT, TileSet  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _batch(seed: int, heads: int, a: int, v: int, n_max: int = 40, device: str = "cpu", lengths=None):
    """A jagged batch (random lengths plus an empty sequence, two of length 1 and one of the maximal length n,
    shuffled; or ``lengths``), x [T, W] pre-activation (scale 2), bias [W], d_out [T, H, V], all float64 and never
    zero. W = H V + 2 H A (v, q, k)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(2, n_max, (4,), generator=g).tolist() + [0, 1, 1]
        lengths.append(max(lengths) + 3)
        lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    off = torch.tensor([0] + list(lengths)).cumsum(0).to(device)
    T, W = int(off[-1]), heads * v + 2 * heads * a
    x = (torch.randn(T, W, generator=g, dtype=torch.float64) * 2.0).to(device)
    bias = (torch.randn(W, generator=g, dtype=torch.float64) * 0.5).to(device)
    d_out = torch.randn(T, heads, v, generator=g, dtype=torch.float64).to(device)
    return off, max(lengths, default=0), x, bias, d_out


def _grads(fn, x, bias, d_out, dtype, bias_dtype=None):
    """(out, dx, dbias) of fn(x, bias) -> out, x in ``dtype`` (bias in ``bias_dtype``, default the same),
    backpropagating <out, d_out>."""
    xi = x.to(dtype).clone().requires_grad_()
    bi = bias.to(bias_dtype or dtype).clone().requires_grad_()
    out = fn(xi, bi)
    dx, db = torch.autograd.grad((out * d_out.to(out.dtype)).sum(), [xi, bi])
    return out.detach(), dx, db


def _composition(off, n, heads, a, v, activation, cfg=None, reference=False):
    """Today's path (``model.uvqk_kernel = "triton"``): bias_silu's kernels, then the Triton attention; or with
    ``reference`` the spec: bias_silu_split_ref then jagged_attention_ref."""
    def fn(x, bias):
        T = x.shape[0]
        split = ref.bias_silu_split_ref if reference else bias_silu.bias_silu_split_triton
        vv, q, k = split(x, bias, [heads * v, heads * a, heads * a])
        attn = ref.jagged_attention_ref if reference else ja.jagged_attention_triton
        kw = {} if reference else dict(config=cfg)
        return attn(q.reshape(T, heads, a), k.reshape(T, heads, a), vv.reshape(T, heads, v), off, n,
                    activation=activation, **kw)
    return fn


def _fused(off, n, heads, a, v, activation, cfg=None):
    return lambda x, bias: ua.vqk_attention_triton(x, bias, off, n, heads, a, v, activation=activation, config=cfg)


@cpu_only
@pytest.mark.parametrize("activation,dtype", [("silu", torch.float32), ("silu", torch.bfloat16),
                                              ("softmax", torch.float32), ("gelu", torch.float32)])
@pytest.mark.parametrize("ds", [False, True])
def test_fused_op_matches_the_composition(activation, dtype, ds, monkeypatch):
    """out, dx and dbias of the fused op: the same bits as today's composition (the interpreter never runs the
    Gluon epilogue: the op's fallback launches are the composition's, in the recomputing backward and the
    dS-storing one alike; bf16 as gdpa_triton runs it, the attention in float32), and close to the float64 spec.
    H = 2, A = 16, V = 8 (unequal widths: the q / k column ranges start at H V and H V + H A)."""
    monkeypatch.setattr(bias_silu, "BWD_BLOCKS", (16, 32, 4))  # several row tiles of the partial sums
    monkeypatch.setattr(bias_silu, "FWD_BLOCKS", (16, 32, 4))
    heads, a, v = 2, 16, 8
    off, n, x, bias, d_out = _batch(3, heads, a, v)
    cfg = DEFAULT.with_all_regimes(ds_store=ds, dk_from_ds=ds).replace(
        ds_scratch_nan=ds, interpret_tiles=TileSet.uniform((16, 32, 4, 1)))
    got = _grads(_fused(off, n, heads, a, v, activation, cfg), x, bias, d_out, dtype, torch.float32)
    today = _grads(_composition(off, n, heads, a, v, activation, cfg), x, bias, d_out, dtype, torch.float32)
    want = _grads(_composition(off, n, heads, a, v, activation, reference=True), x, bias, d_out, torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, t, w in zip(("out", "dx", "dbias"), got, today, want):
        assert g.dtype == t.dtype and g.shape == w.shape, name
        assert torch.equal(g, t), (name, _rel(g, t))
        assert _rel(g, w) < tol, (name, _rel(g, w))


@cpu_only
def test_fused_op_empty_batch_and_no_sequences():
    """T = 0 (a batch of empty sequences): out [0, H, V], dx [0, W], dbias 0."""
    heads, a, v = 2, 16, 8
    for lengths in ([0, 0], []):
        off, n, x, bias, d_out = _batch(4, heads, a, v, lengths=lengths)
        out, dx, db = _grads(_fused(off, n, heads, a, v, "silu"), x, bias, d_out, torch.float32)
        assert out.shape == (0, heads, v) and dx.shape == (0, heads * v + 2 * heads * a)
        assert torch.equal(db, torch.zeros_like(db))


@cpu_only
def test_fused_op_argument_checks():
    heads, a, v = 2, 16, 8
    off, n, x, bias, _ = _batch(5, heads, a, v)
    with pytest.raises(ValueError, match="sizes"):
        ua.vqk_attention_triton(x.float()[:, 1:], bias.float()[1:], off, n, heads, a, v)
    with pytest.raises(ValueError, match="activation"):
        ua.vqk_attention_triton(x.float(), bias.float(), off, n, heads, a, v, activation="relu")
    with pytest.raises(ValueError, match="head dims"):
        ua.vqk_attention_triton(x.float(), bias.float(), off, n, heads, 0, v)
    with pytest.raises(ValueError, match="alpha"):
        ua.vqk_attention_triton(x.float(), bias.float(), off, n, heads, a, v, alpha=-1.0)


@cpu_only
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_opcheck_vqk_attention(activation):
    """torch.library.opcheck of gemray::vqk_attention (schema, autograd registration, fake tensors, AOT dispatch) and
    of gemray::vqk_attention_bwd on the forward's outputs."""
    heads, a, v = 2, 16, 8
    off, n, x, bias, d_out = _batch(8, heads, a, v, lengths=[0, 1, 7, 13])
    x, bias = x.float().requires_grad_(), bias.float().requires_grad_()
    args = (x, bias, off, heads, a, v, n, activation, True, 0.25, DEFAULT.name)
    torch.library.opcheck(ua.vqk_attention_op, args)
    out, vv, q, k, lse = ua.vqk_attention_op(x.detach(), bias.detach(), *args[2:])
    torch.library.opcheck(ua.vqk_attention_bwd_op, (d_out.float(), x.detach(), bias.detach(), vv, q, k, out, lse,
                                                    *args[2:]))


# ------------------------------------------------------------------- the epilogue's hand-over (Gluon emulated)


def _emulate_dv_ds(calls):
    """A float64 torch stand-in for ws_attention.backward_dv_ds (silu): dV / N and the unscaled dS^T (0 where
    masked) of every sequence into dv and ds [H, Tk, W]."""
    def backward_dv_ds(q, k, v, do, dv, ds, q_off, kv_off, table, n_tiles_k, causal, alpha, inv_n, tiles, fast):
        calls.append("ws_dv_ds")
        for b in range(q_off.numel() - 1):
            q0, q1, k0, k1 = (int(t) for t in (q_off[b], q_off[b + 1], kv_off[b], kv_off[b + 1]))
            for h in range(q.shape[1]):
                qq, kk, vv, dd = (t[s0:s1, h].double() for t, s0, s1 in
                                  ((q, q0, q1), (k, k0, k1), (v, k0, k1), (do, q0, q1)))
                s = alpha * qq @ kk.T
                ok = torch.ones_like(s, dtype=torch.bool)
                if causal:
                    ok = torch.tril(ok)
                sig = torch.sigmoid(s)
                p = torch.where(ok, s * sig, 0.0)
                dv[k0:k1, h] = (inv_n * p.T @ dd).to(dv.dtype)
                dss = torch.where(ok, (dd @ vv.T) * sig * (1 + s * (1 - sig)), 0.0)
                ds[h, k0:k1, :q1 - q0] = dss.T.to(ds.dtype)
    return backward_dv_ds


def _emulate_ds_gemm(calls):
    """A float64 torch stand-in for ws_attention.ds_gemm: dQ = scale dS K / dK = scale dS^T Q rounded to out's
    dtype; with ``act`` = (x, xbias, part) the ACT_GRAD epilogue instead (d_x = g silu'(x + xbias) into out, the
    column sums into part row 0: one row is enough for the sum; the kernel spreads them over 2 x table rows)."""
    def ds_gemm(ds, b, out, q_off, kv_off, table, n_tiles, dq, causal, scale, stages, act=None):
        calls.append(("dq" if dq else "dk", act, out))
        h_n, d = b.shape[1], b.shape[2]
        for bi in range(q_off.numel() - 1):
            q0, q1, k0, k1 = (int(t) for t in (q_off[bi], q_off[bi + 1], kv_off[bi], kv_off[bi + 1]))
            for h in range(h_n):
                dst = ds[h, k0:k1, :q1 - q0].double()  # [lk, lq]
                r0, r1 = (q0, q1) if dq else (k0, k1)
                g = (scale * (dst.T @ b[k0:k1, h].double() if dq else dst @ b[q0:q1, h].double())).to(out.dtype)
                if act is None:
                    out[r0:r1, h] = g
                    continue
                x, xbias, part = act
                z = x[r0:r1, h].double() + xbias[h * d:(h + 1) * d].double()
                sig = torch.sigmoid(z)
                dz = g.double() * sig * (1 + z * (1 - sig))
                out[r0:r1, h] = dz.to(out.dtype)
                part[0, h * d:(h + 1) * d] += dz.sum(0).float()
    return ds_gemm


@cpu_only
@pytest.mark.parametrize("dkdq", [True, False])
def test_backward_hands_q_and_k_to_the_epilogue_where_the_gluon_products_run(monkeypatch, dkdq):
    """With the warp-specialized backward forced (its eligibility needs an sm_90 GPU; the Gluon launches emulated
    in torch), the op's backward passes the q / k column ranges of x and d_x, their biases and zero-filled
    partial sums of 2 x table-entries rows to ws_dq / ws_dk (ACT_GRAD) and takes v's range through bias_silu;
    dx and dbias match the float64 spec. Without the Gluon products (ws_dkdq off: Triton's dq_ds / dk_ds) no
    epilogue runs and the result is the same."""
    from gemray.kernels import ws_attention as ws

    monkeypatch.setattr(ja, "_use_ws_bwd", lambda *a: True)
    monkeypatch.setattr(ja, "_use_ds_store", lambda *a: True)
    monkeypatch.setattr(ua, "interpreting", lambda: False)  # build the epilogue's arguments (float32: no upcast)
    calls = []
    monkeypatch.setattr(ws, "backward_dv_ds", _emulate_dv_ds(calls))
    monkeypatch.setattr(ws, "ds_gemm", _emulate_ds_gemm(calls))
    heads, a, v = 2, 16, 8
    off, n, x, bias, d_out = _batch(6, heads, a, v, n_max=150)
    cfg = DEFAULT.with_all_regimes(ds_store=True, dk_from_ds=True, ws_bwd=True, ws_dkdq=dkdq).replace(
        ds_scratch_nan=True, interpret_tiles=TileSet.uniform((16, 32, 4, 1)))
    got = _grads(_fused(off, n, heads, a, v, "silu", cfg), x, bias, d_out, torch.float32)
    want = _grads(_composition(off, n, heads, a, v, "silu", reference=True), x, bias, d_out, torch.float64)
    for name, g, w in zip(("out", "dx", "dbias"), got, want):
        assert _rel(g, w) < 1e-5, (name, _rel(g, w))
    if not dkdq:
        assert calls == ["ws_dv_ds"]  # dQ / dK: the Triton launches, dq / dk through bias_silu
        return
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["ws_dv_ds", "dq", "dk"]
    T, hv, ha = x.shape[0], heads * v, heads * a
    spec = ua._spec(n, "silu", True, 1.0)
    tables = {"dq": ja._q_table(spec, off, off, ws.BWD_KEYS, T, grouped=cfg.seq_order_dq)[0],
              "dk": ja._k_table(spec, off, off, ws.BWD_KEYS, T, grouped=cfg.seq_order_dkdv)[0]}
    for (kind, (xs, xbias, part), dxs), col in zip(calls[1:], (hv, hv + ha)):
        # the q / k column range of x and of d_x: [T, H, A] views at column col, row stride W, head stride A
        for t in (xs, dxs):
            assert t.shape == (T, heads, a) and t.stride() == (hv + 2 * ha, a, 1) and t.storage_offset() == col
        torch.testing.assert_close(xbias, bias.float()[col:col + ha], rtol=0, atol=0)
        assert part.dtype == torch.float32 and part.shape == (2 * tables[kind].numel(), ha)
        assert torch.equal(part[1:], torch.zeros_like(part[1:]))  # zero-filled: rows no launch wrote add nothing


@cpu_only
def test_backward_plan_act_argument_is_rejected_where_it_cannot_apply():
    """ja._backward refuses the epilogue's arguments with an attention bias (the op never passes them there)."""
    off = torch.tensor([0, 3, 5])
    q = torch.randn(5, 1, 16)
    spec = ja._spec(1, True, 1.0, 1 / 3, 0, 0, False, 3, 3, 0)
    bias = torch.zeros(2, 3, 3)
    _, plan = ja._plan_of(q, q, q, bias, off, off, None, spec, DEFAULT)
    with pytest.raises(ValueError, match="attention bias"):
        ja._backward(q, q, q, q, None, None, bias, off, off, None, spec, False, DEFAULT, plan, None,
                     act=(q, q, q, q, q, q))


# ------------------------------------------------------------------------------------ model and config


def _block_cfg(kernel: str, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=8, dropout=0.0,
                                 attention_backend="triton", relative_bias=False, uvqk_kernel=kernel), **kw})


@cpu_only
@pytest.mark.parametrize("fp32_residual", [True, False])
def test_hstu_block_fused_matches_triton(fp32_residual):
    """One HSTU block with model.uvqk_kernel = "fused" against "triton": the same output and the same gradient of
    the input and of every parameter (on CPU the op's backward runs the unfused launches: bit for bit)."""
    from gemray.model.hstu import HSTUBlock

    lengths = [0, 1, 7, 13, 1, 0, 5]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    T = int(offsets[-1])
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(11))
    ts = torch.arange(T) * 60
    results = []
    for kernel in ("triton", "fused"):
        torch.manual_seed(0)
        block = HSTUBlock(_block_cfg(kernel, fp32_residual=fp32_residual), max_seq_len=16)
        with torch.no_grad():
            block.uvqk_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # a bias that matters
        xi = x.clone().requires_grad_()
        y = block(xi, offsets, ts)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for _, p in sorted(block.named_parameters())])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), (i, _rel(a, b))


@cpu_only
def test_hstu_block_fused_compiles_fullgraph():
    """torch.compile traces the fused block as one graph (the custom ops' fakes and autograd)."""
    from gemray.model.hstu import HSTUBlock

    torch.manual_seed(0)
    block = HSTUBlock(_block_cfg("fused"), max_seq_len=8)
    offsets = torch.tensor([0, 3, 4, 9])
    x = torch.randn(9, 32)
    ts = torch.arange(9)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (block, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi, offsets, ts)
        results.append([y.detach(), *torch.autograd.grad(y.square().sum(), [xi, block.uvqk_bias])])
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-6


def test_uvqk_attention_on_the_reference_backend_is_the_composition():
    """ops.uvqk_attention where the attention resolves to the reference ("auto" on CPU): today's composition
    (uvqk_projection, then attention), the same values."""
    from gemray import ops

    torch.manual_seed(3)
    heads, a, v, d = 2, 4, 3, 5
    sizes = [heads * v, heads * v, heads * a, heads * a]
    x_norm, w, b = torch.randn(9, d), torch.randn(d, sum(sizes)), torch.randn(sum(sizes))
    off = torch.tensor([0, 4, 4, 9])
    z_u, out = ops.uvqk_attention(x_norm, w, b, sizes, off, 6, heads, attention_backend="reference")
    zu2, vv, q, k = ops.uvqk_projection(x_norm, w, b, sizes, backend="reference")
    want = ops.attention(q.reshape(9, heads, a), k.reshape(9, heads, a), vv.reshape(9, heads, v), off, 6,
                         backend="reference")
    assert torch.equal(z_u, zu2) and torch.equal(out, want)
    with pytest.raises(ValueError, match=r"uvqk_attention: sizes"):
        ops.uvqk_attention(x_norm, w, b, [6, 6, 8, 4], off, 6, heads, attention_backend="reference")


@pytest.mark.parametrize("kw,match", [
    (dict(relative_bias=True), "relative_bias = true"),
    (dict(attention_backend="reference"), 'attention_backend = "reference"'),
])
def test_config_refuses_fused_where_it_cannot_apply(kw, match):
    with pytest.raises(ValueError, match=match):
        _block_cfg("fused", **kw).validate()
    _block_cfg("fused").validate()
    _block_cfg("fused", attention_backend="auto").validate()
    _block_cfg("triton", **kw).validate()  # only "fused" needs the Triton attention without a bias


def test_config_refuses_fused_under_fp8():
    cfg = JobConfig()
    cfg.model.uvqk_kernel = "fused"
    cfg.model.relative_bias = False
    cfg.validate()
    cfg.train.precision = "fp8"
    with pytest.raises(ValueError, match='uvqk_kernel = "fused" does not apply with train.precision = "fp8"'):
        cfg.validate()


# ------------------------------------------------------------------------------------------------ GPU


def _heavy_lengths(b: int, n: int) -> list[int]:
    """b log-normal lengths with median n/16, clipped to [1, n]."""
    lens = torch.distributions.LogNormal(math.log(n / 16), 1.0).sample((b,))
    return lens.clamp(1, n).long().tolist()


@gpu
@needs_cuda
@pytest.mark.parametrize("d", [256, 128])
@pytest.mark.parametrize("stages,prefetch", [(4, True), (4, False), (3, True)])
def test_gpu_fused_epilogue_matches_unfused_bf16(monkeypatch, d, stages, prefetch):
    """The Gluon dQ / dK products' ACT_GRAD epilogue (ws_bwd + ws_dkdq forced in every regime, the dS^T scratch
    NaN-filled) on a heavy-tailed bf16 silu batch with empty, length-1, tile-edge (63 / 64 / 65 / 127 / 128 / 129)
    and 2048-token sequences, H = 4, head dim d (v / q / k): against the unfused path (bias_silu's kernels + the
    same attention) out and dx are the same bits (d_x of q / k is the same rounding of dq / dk through the same
    float32 formula), dbias is close (its q / k columns are summed in another order); the epilogue ran, with and
    without its L2 prefetch of x (ws_attention.ACT_PREFETCH)."""
    from gemray.kernels import ws_attention as ws

    monkeypatch.setattr(ws, "ACT_PREFETCH", prefetch)
    cfg = DEFAULT.with_all_regimes(ds_store=True, dk_from_ds=True, ws_bwd=True, ws_dkdq=True,
                                   ws_dkdq_stages=stages).replace(ds_scratch_nan=True)
    acts, real = [], ws.ds_gemm

    def spy(*args, **kw):
        acts.append(("dq" if kw["dq"] else "dk", kw.get("act") is not None))
        return real(*args, **kw)

    monkeypatch.setattr(ws, "ds_gemm", spy)
    torch.manual_seed(27)
    lengths = _heavy_lengths(24, 2048) + [0, 1, 2048, 63, 64, 65, 127, 128, 129, 0]
    heads = 4
    off, n, x, bias, d_out = _batch(7, heads, d, d, device="cuda", lengths=lengths)
    got = _grads(_fused(off, n, heads, d, d, "silu", cfg), x, bias, d_out, torch.bfloat16, torch.float32)
    assert acts == [("dq", True), ("dk", True)]
    want = _grads(_composition(off, n, heads, d, d, "silu", cfg), x, bias, d_out, torch.bfloat16, torch.float32)
    assert acts[2:] == [("dq", False), ("dk", False)]
    assert torch.equal(got[0], want[0]), "out"
    assert torch.equal(got[1], want[1]), ("dx", (got[1].float() - want[1].float()).abs().max())
    assert _rel(got[2], want[2]) < 1e-3, ("dbias", _rel(got[2], want[2]))
    hv = heads * d
    assert torch.equal(got[2][:hv], want[2][:hv]) or _rel(got[2][:hv], want[2][:hv]) < 1e-6  # v: bias_silu's sums
