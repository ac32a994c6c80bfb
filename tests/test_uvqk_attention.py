"""The fused uvqk activation + attention (gemray.kernels.uvqk_attention, ``model.uvqk_kernel = "fused"``): the
attention backward's ACT_GRAD stores (d_x's v / q / k ranges through silu', partial column sums) against the
unfused path and the float64 references, in both backward regimes, and the HSTU block with it.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set below when no CUDA device is present), float32, random inputs
(never zeros) on jagged batches with an empty sequence, length-1 sequences and one at the maximal length.
GPU (@pytest.mark.gpu): a larger bf16 case against the unfused Triton path.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray import ops  # noqa: E402
from gemray.config import ModelConfig  # noqa: E402
from gemray.kernels import bias_silu  # noqa: E402
from gemray.kernels import jagged_attention as ja  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.config import DEFAULT, TileSet  # noqa: E402
from gemray.kernels.uvqk_attention import uvqk_attention_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _batch(seed: int, heads: int, a: int, v: int, n_max: int = 40):
    """Random jagged batch: lengths with an empty sequence, two of length 1 and one of the maximal length n;
    x [T, W] (pre-activation, scale 2), bias [W], d_u [T, H V], d_out [T, H, V], all float64, never zero."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, n_max, (4,), generator=g).tolist() + [0, 1, 1]
    n = max(lengths) + 3
    lengths.append(n)
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    off = torch.tensor([0] + lengths).cumsum(0)
    T, W = int(off[-1]), 2 * heads * v + 2 * heads * a
    x = torch.randn(T, W, generator=g, dtype=torch.float64) * 2.0
    bias = torch.randn(W, generator=g, dtype=torch.float64) * 0.5
    d_u = torch.randn(T, heads * v, generator=g, dtype=torch.float64)
    d_out = torch.randn(T, heads, v, generator=g, dtype=torch.float64)
    return off, n, x, bias, d_u, d_out


def _grads(fn, x, bias, d_u, d_out, dtype):
    """(u, out, dx, dbias) of fn(x, bias) -> (u, out) in ``dtype``, backpropagating <u, d_u> + <out, d_out>."""
    xi = x.to(dtype).clone().requires_grad_()
    bi = bias.to(dtype).clone().requires_grad_()
    u, out = fn(xi, bi)
    dx, db = torch.autograd.grad((u * d_u.to(dtype)).sum() + (out * d_out.to(dtype)).sum(), [xi, bi])
    return u.detach(), out.detach(), dx, db


def _unfused_ref(off, n, heads, a, v, activation):
    """The spec: bias_silu_split_ref then jagged_attention_ref (autograd through both)."""
    def fn(x, bias):
        T = x.shape[0]
        u, vv, q, k = ref.bias_silu_split_ref(x, bias, [heads * v, heads * v, heads * a, heads * a])
        out = ref.jagged_attention_ref(q.reshape(T, heads, a), k.reshape(T, heads, a), vv.reshape(T, heads, v),
                                       off, n, activation=activation)
        return u, out
    return fn


def _unfused_triton(off, n, heads, a, v, activation, cfg):
    """Today's "triton" path: bias_silu's kernels then the Triton attention (dq / dk / dv in between)."""
    def fn(x, bias):
        T = x.shape[0]
        u, vv, q, k = bias_silu.bias_silu_split_triton(x, bias, [heads * v, heads * v, heads * a, heads * a])
        out = ja.jagged_attention_triton(q.view(T, heads, a), k.view(T, heads, a), vv.view(T, heads, v), off, n,
                                         activation=activation, config=cfg)
        return u, out
    return fn


def _config(ds) -> object:
    """Every regime recomputing (ds False), storing dS^T with dQ from it (True), or also dK from it ("dk",
    dk_from_ds); unequal interpreter tiles (query and key tiles differ); the dS scratch NaN-filled when used."""
    cfg = DEFAULT.with_all_regimes(ds_store=bool(ds), dk_from_ds=ds == "dk")
    return cfg.replace(ds_scratch_nan=bool(ds), interpret_tiles=TileSet.uniform((16, 32, 4, 1)))


def _act_plans(cfg) -> list:
    """The ACT_GRAD backward plans made under ``cfg`` (from the launch-plan cache)."""
    out = []
    for key, (_, plan) in list(ja._CACHE.items()):
        if key[0] == "fwd plan" and key[1] == cfg.name:
            out += [bp for k, bp in plan.bwd.items() if k[-1] is not None]
    return out


@cpu_only
@pytest.mark.parametrize("activation,ds", [("silu", False), ("silu", "dk"), ("softmax", True), ("gelu", False)])
def test_fused_matches_unfused_and_reference(activation, ds, monkeypatch):
    """u, out, dx, dbias of the fused op against the float64 reference (1e-5) and against today's unfused Triton
    path (1e-5), with H = 2, A = 16, V = 8 (unequal widths: the q / k / v column offsets differ), for the
    recomputing backward and the dS-storing one (dk_from_ds: dK's store in _gdpa_dk_ds)."""
    monkeypatch.setattr(bias_silu, "BWD_BLOCKS", (16, 32, 4))  # several row tiles of the u range's partial sums
    monkeypatch.setattr(bias_silu, "FWD_BLOCKS", (16, 32, 4))
    heads, a, v = 2, 16, 8
    off, n, x, bias, d_u, d_out = _batch(3, heads, a, v)
    cfg = _config(ds)
    got = _grads(lambda xi, bi: uvqk_attention_triton(xi, bi, off, n, heads, a, v, activation=activation,
                                                      config=cfg), x, bias, d_u, d_out, torch.float32)
    want = _grads(_unfused_ref(off, n, heads, a, v, activation), x, bias, d_u, d_out, torch.float64)
    unfused = _grads(_unfused_triton(off, n, heads, a, v, activation, cfg), x, bias, d_u, d_out, torch.float32)
    for i, name in enumerate(("u", "out", "dx", "dbias")):
        assert got[i].shape == want[i].shape and got[i].dtype == torch.float32, name
        assert _rel(got[i], want[i]) < 1e-5, (name, _rel(got[i], want[i]))
        assert _rel(got[i], unfused[i]) < 1e-5, (name, _rel(got[i], unfused[i]))
    plans = _act_plans(cfg)
    assert plans, "no ACT_GRAD backward plan was made"
    kinds = {tuple(kind for _, _, kind in bp.steps) for bp in plans}
    want_kinds = {False: ("bwd", "bwd"), True: ("bwd", "dq_ds"), "dk": ("bwd", "dq_ds", "dk_ds")}[ds]
    assert kinds == {want_kinds}, kinds
    assert all(launch.consts["ACT_GRAD"] for bp in plans for launch, _, _ in bp.steps)


@cpu_only
def test_fused_heads_inner_equal_widths_and_one_gradient(monkeypatch):
    """The heads-inner grid (_item_slot = pid // H) with tile loads through tensor descriptors (tma_loads, as the
    GEM config's), equal head widths (A = V, the GEM block's layout) and 3 heads; then a loss through ``out`` only
    (d_u is None: the u range's dx and dbias are 0) and through ``u`` only (the attention gradients are 0)."""
    heads, a, v = 3, 16, 16
    off, n, x, bias, d_u, d_out = _batch(5, heads, a, v, n_max=30)
    cfg = _config("dk").with_all_regimes(heads_inner=True, tma_loads=True)
    fused = lambda xi, bi: uvqk_attention_triton(xi, bi, off, n, heads, a, v, config=cfg)  # noqa: E731
    got = _grads(fused, x, bias, d_u, d_out, torch.float32)
    want = _grads(_unfused_ref(off, n, heads, a, v, "silu"), x, bias, d_u, d_out, torch.float64)
    for i in range(4):
        assert _rel(got[i], want[i]) < 1e-5, (i, _rel(got[i], want[i]))
    plans = _act_plans(cfg)
    assert plans and all(launch.consts["TMA"] and launch.consts["HEADS_INNER"]
                         for bp in plans for launch, _, _ in bp.steps)
    for only in ("out", "u"):
        xi, bi = x.float().clone().requires_grad_(), bias.float().clone().requires_grad_()
        u, out = fused(xi, bi)
        dx, db = torch.autograd.grad((out * d_out.float()).sum() if only == "out" else (u * d_u.float()).sum(),
                                     [xi, bi])
        xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
        ur, outr = _unfused_ref(off, n, heads, a, v, "silu")(xr, br)
        dxr, dbr = torch.autograd.grad((outr * d_out).sum() if only == "out" else (ur * d_u).sum(), [xr, br])
        assert _rel(dx, dxr) < 1e-5 and _rel(db, dbr) < 1e-5, (only, _rel(dx, dxr), _rel(db, dbr))
        hv = heads * v
        zero = dx[:, :hv] if only == "out" else dx[:, hv:]
        assert torch.equal(zero, torch.zeros_like(zero)), only


@cpu_only
def test_fused_empty_batch_bf16_and_bad_arguments():
    """T = 0 (all sequences empty) gives empty outputs and a zero dbias; bf16 under the interpreter runs in float32
    and rounds; bad arguments raise ValueError; q_broadcast is refused by the ACT_GRAD backward."""
    heads, a, v = 2, 8, 8
    W = 2 * heads * (a + v)
    off0 = torch.zeros(3, dtype=torch.int64)
    x0 = torch.randn(0, W, requires_grad=True)
    b0 = torch.randn(W, requires_grad=True)
    u, out = uvqk_attention_triton(x0, b0, off0, 4, heads, a, v)
    assert u.shape == (0, heads * v) and out.shape == (0, heads, v)
    dx, db = torch.autograd.grad(u.sum() + out.sum(), [x0, b0])
    assert dx.shape == (0, W) and torch.equal(db, torch.zeros(W))
    off, n, x, bias, d_u, d_out = _batch(7, heads, a, v, n_max=12)
    got = _grads(lambda xi, bi: uvqk_attention_triton(xi, bi, off, n, heads, a, v), x, bias, d_u, d_out,
                 torch.bfloat16)
    want = _grads(_unfused_ref(off, n, heads, a, v, "silu"), x, bias, d_u, d_out, torch.float64)
    for i in range(4):
        assert got[i].dtype == torch.bfloat16 and _rel(got[i], want[i]) < 2e-2, (i, _rel(got[i], want[i]))
    xf = x.float()
    with pytest.raises(ValueError, match="sum to W"):
        uvqk_attention_triton(xf, bias.float(), off, n, heads, a + 1, v)
    with pytest.raises(ValueError, match="activation"):
        uvqk_attention_triton(xf, bias.float(), off, n, heads, a, v, activation="relu")
    with pytest.raises(ValueError, match="longer|length"):
        uvqk_attention_triton(xf, bias.float(), off, n - 1, heads, a, v)
    q = torch.randn(2, heads, a)
    spec = ja._spec_of("silu", False, 1.0, 1.0, 0, 0, True, 4, 4, 0)
    with pytest.raises(ValueError, match="q_broadcast"):
        ja._backward(q, q, q, q, None, None, None, off0, off0, None, spec, False, DEFAULT, None,
                     act=(x0, b0, torch.empty(0, W), (0, 0, 0), 1))


@cpu_only
def test_fused_opcheck_and_deterministic():
    heads, a, v = 2, 8, 8
    off, n, x, bias, d_u, d_out = _batch(9, heads, a, v, n_max=10)
    cfg = _config(True)
    run = lambda: _grads(lambda xi, bi: uvqk_attention_triton(xi, bi, off, n, heads, a, v, config=cfg),  # noqa
                         x, bias, d_u, d_out, torch.float32)
    for p, q in zip(run(), run()):
        assert torch.equal(p, q)  # no atomics: the same bits every run
    torch.library.opcheck(torch.ops.gemray.uvqk_attention.default,
                          (x.float().requires_grad_(), bias.float().requires_grad_(), off, heads, a, v, n, "silu",
                           True, 1.0, cfg.name),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_config_and_dispatch_rules():
    with pytest.raises(ValueError, match="relative_bias"):
        ModelConfig(uvqk_kernel="fused").validate()  # relative_bias defaults to true
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(uvqk_kernel="fused", relative_bias=False, attention_backend="reference").validate()
    ModelConfig(uvqk_kernel="fused", relative_bias=False, attention_backend="triton").validate()
    ModelConfig(uvqk_kernel="fused", relative_bias=False).validate()  # "auto"
    g = torch.Generator().manual_seed(1)
    x_norm, w, b = torch.randn(5, 4, generator=g), torch.randn(4, 32, generator=g), torch.randn(32, generator=g)
    off = torch.tensor([0, 2, 5])
    with pytest.raises(RuntimeError, match="fused"):  # the attention resolves to the reference here
        ops.uvqk_attention(x_norm, w, b, off, 4, 2, 4, 4, attention_backend="reference")


def test_selective_checkpointing_keeps_the_fused_op():
    """Selective activation checkpointing saves the fused op's outputs (it would otherwise rerun the attention)."""
    from gemray.parallel.activation_checkpoint import saves_output

    assert saves_output(torch.ops.gemray.uvqk_attention.default)
    assert not saves_output(torch.ops.gemray.uvqk_attention_bwd.default)


def _block_results(kernel: str, cfg: ModelConfig, x, offsets, ts, max_len: int):
    from gemray.model.hstu import HSTUBlock

    torch.manual_seed(0)
    block = HSTUBlock(ModelConfig(**{**cfg.__dict__, "uvqk_kernel": kernel}), max_seq_len=max_len)
    with torch.no_grad():
        block.uvqk_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # a bias that matters
    xi = x.clone().requires_grad_()
    y = block(xi, offsets, ts)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    return [y.detach(), xi.grad] + [p.grad for _, p in sorted(block.named_parameters())]


@cpu_only
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_hstu_block_fused_matches_triton(activation):
    """One HSTU block with model.uvqk_kernel = "fused" against "triton" (same Triton attention): output, d x and
    every parameter's gradient, on a batch with empty, length-1 and maximal-length sequences."""
    cfg = ModelConfig(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=16, dropout=0.0,
                      attention_backend="triton", relative_bias=False, attn_activation=activation,
                      kernel_tiles='{"short": {"mode": {"ds_store": true, "dk_from_ds": true}}}')
    lengths = [0, 1, 7, 16, 1, 0, 5]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    T = int(offsets[-1])
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(11))
    ts = torch.arange(T) * 60
    from gemray.model.hstu import kernel_config_of

    fused = _block_results("fused", cfg, x, offsets, ts, 16)
    unfused = _block_results("triton", cfg, x, offsets, ts, 16)
    plans = _act_plans(kernel_config_of(cfg.kernel_tiles))  # the fused block took the dS-storing backward
    assert plans and all([k for _, _, k in bp.steps] == ["bwd", "dq_ds", "dk_ds"] for bp in plans)
    assert len(fused) == len(unfused) == 6
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert _rel(a, b) < 1e-5, (i, _rel(a, b))


@cpu_only
def test_block_compiles_fullgraph_with_the_fused_op():
    """torch.compile traces the fused block as one graph (the custom ops' fakes and autograd), same results."""
    from gemray.model.hstu import HSTUBlock

    cfg = ModelConfig(embedding_dim=16, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0,
                      attention_backend="triton", relative_bias=False, uvqk_kernel="fused")
    torch.manual_seed(0)
    block = HSTUBlock(cfg, max_seq_len=8)
    offsets = torch.tensor([0, 3, 4, 9])
    x = torch.randn(9, 16)
    ts = torch.arange(9)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (block, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi, offsets, ts)
        results.append([y.detach(), *torch.autograd.grad(y.square().sum(), [xi, block.uvqk_bias,
                                                                             block.uvqk_weight])])
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled)")
@pytest.mark.parametrize("ds", [False, "dk"])
def test_fused_matches_unfused_bf16_cuda(ds):
    """A larger bf16 case (H = 4, A = V = 128, sequences up to 1024, ~10k tokens) on the GPU: the fused op against
    today's unfused Triton path (u, out equal; dx, dbias to bf16 rounding: the fused path multiplies the unrounded
    gradient) and both against the float32 reference."""
    heads, a, v = 4, 128, 128
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1024, (18,), generator=g).tolist() + [0, 1, 1024]
    off = torch.tensor([0] + lengths).cumsum(0).cuda()
    n = 1024
    T, W = int(off[-1]), 2 * heads * (a + v)
    x = (torch.randn(T, W, generator=g) * 2.0).cuda()
    bias = (torch.randn(W, generator=g) * 0.5).cuda()
    d_u = torch.randn(T, heads * v, generator=g).cuda()
    d_out = torch.randn(T, heads, v, generator=g).cuda()
    cfg = DEFAULT.with_all_regimes(ds_store=bool(ds), dk_from_ds=ds == "dk")
    got = _grads(lambda xi, bi: uvqk_attention_triton(xi, bi, off, n, heads, a, v, config=cfg), x, bias, d_u, d_out,
                 torch.bfloat16)
    unfused = _grads(_unfused_triton(off, n, heads, a, v, "silu", cfg), x, bias, d_u, d_out, torch.bfloat16)
    want = _grads(_unfused_ref(off, n, heads, a, v, "silu"), x, bias, d_u, d_out, torch.float32)
    for i, name in enumerate(("u", "out", "dx", "dbias")):
        if i < 2:  # the same forward kernels
            assert torch.equal(got[i], unfused[i]), name
        assert _rel(got[i], unfused[i]) < 2e-2, (name, _rel(got[i], unfused[i]))
        assert _rel(got[i], want[i]) < 3e-2, (name, _rel(got[i], want[i]))
