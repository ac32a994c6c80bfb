"""The fused uvqk activation (gemray.kernels.bias_silu: split(silu(x + bias)), its backward with the bias gradient)
against the reference, the dispatch (gemray.ops.uvqk_projection: u's pre-activation, v / q / k through the kernel),
and the HSTU block with it.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set below when no CUDA device is present), float32, relative error
(max |a - b| / max |b|) of every split and of dx / dbias < 1e-5 against a float64 reference, on random inputs
(never zeros) of T = 0, 1, a partial row tile and several row chunks, and splits that are not multiples of the
column tile (the ML-1M block's 50s) beside the GEM block's. ``test_tolerance_catches_broken_variants`` shows the
bound fails a kernel that dropped the bias or a chunk's partial sum.
GPU (@pytest.mark.gpu): a GEM block's shape (T = 131,072, sizes 4 x 1024) in bf16 against the float32 reference.
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
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.bias_silu import bias_silu_split_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _case(T: int, sizes, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W = sum(sizes)
    x = (torch.randn(T, W, generator=g) * 2.0).to(device=device, dtype=dtype)
    bias = (torch.randn(W, generator=g) * 0.5).to(device=device)
    grads = [torch.randn(T, s, generator=g).to(device=device, dtype=dtype) for s in sizes]
    return x, bias, grads


def _run(fn, x, bias, sizes, grads):
    """(splits..., dx, dbias) of fn at (x, bias), backpropagating sum_i <split_i, grads_i>."""
    xs = [x.clone().requires_grad_(), bias.clone().requires_grad_()]
    outs = fn(xs[0], xs[1], sizes)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads))
    dx, db = torch.autograd.grad(loss, xs) if x.shape[0] else (torch.zeros_like(x), torch.zeros_like(bias))
    return [o.detach() for o in outs] + [dx, db]


def _ref64(x, bias, sizes, grads):
    return _run(ref.bias_silu_split_ref, x.double(), bias.double(), sizes, [g.double() for g in grads])


@cpu_only
@pytest.mark.parametrize("T,sizes", [(0, [8, 8]), (1, [16, 16, 8, 8]), (45, [50, 50, 50, 50]),
                                     (300, [128, 128, 64, 64]), (97, [200, 56])])
def test_triton_matches_reference(T, sizes, monkeypatch):
    # small tiles so that a CPU-sized case has several row tiles, column tiles and row chunks
    monkeypatch.setattr(bias_silu, "FWD_BLOCKS", (16, 32, 4))
    monkeypatch.setattr(bias_silu, "BWD_BLOCKS", (16, 32, 4))
    x, bias, grads = _case(T, sizes)
    got = _run(bias_silu_split_triton, x, bias, sizes, grads)
    want = _ref64(x, bias, sizes, grads)
    assert len(got) == len(want) == len(sizes) + 2
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == (torch.float32), (i, a.shape, b.shape, a.dtype)
        assert _rel(a, b) < TOL, (i, _rel(a, b))
    for o in got[:len(sizes)]:
        assert o.is_contiguous()


@cpu_only
def test_tolerance_catches_broken_variants(monkeypatch):
    """What a kernel bug would look like, through the same comparison: each fails the bound."""
    monkeypatch.setattr(bias_silu, "BWD_BLOCKS", (16, 32, 4))
    sizes = [40, 24]
    x, bias, grads = _case(70, sizes, seed=3)
    want = _ref64(x, bias, sizes, grads)
    no_bias = _run(bias_silu_split_triton, x, torch.zeros_like(bias), sizes, grads)
    assert _rel(no_bias[0], want[0]) > TOL and _rel(no_bias[len(sizes)], want[len(sizes)]) > TOL
    # a backward that kept only the first row tile's column sums
    real_sum = torch.Tensor.sum

    def first_chunk(t, *a, **k):
        return t[0].clone() if t.dim() == 2 and t.dtype == torch.float32 and a == (0,) else real_sum(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "sum", first_chunk)
    dropped = bias_silu._backward(grads, x, bias, sizes)[1]
    monkeypatch.setattr(torch.Tensor, "sum", real_sum)
    assert _rel(dropped, want[-1]) > TOL


@cpu_only
def test_backward_deterministic_and_opcheck():
    sizes = [24, 24, 16]
    x, bias, grads = _case(37, sizes, seed=5)
    a = _run(bias_silu_split_triton, x, bias, sizes, grads)
    b = _run(bias_silu_split_triton, x, bias, sizes, grads)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    torch.library.opcheck(torch.ops.gemray.bias_silu_split.default,
                          (x.requires_grad_(), bias.requires_grad_(), sizes),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@cpu_only
def test_unused_split_gets_no_gradient_and_bad_inputs_are_refused():
    sizes = [8, 12]
    x, bias, _ = _case(9, sizes, seed=7)
    xs = [x.clone().requires_grad_(), bias.clone().requires_grad_()]
    outs = bias_silu_split_triton(xs[0], xs[1], sizes)
    dx, db = torch.autograd.grad(outs[1].sum(), xs)  # the first split unused: its columns get 0
    xr = [x.clone().double().requires_grad_(), bias.clone().double().requires_grad_()]
    want = torch.autograd.grad(ref.bias_silu_split_ref(xr[0], xr[1], sizes)[1].sum(), xr)
    assert torch.equal(dx[:, :8], torch.zeros(9, 8)) and _rel(dx, want[0]) < TOL and _rel(db, want[1]) < TOL
    with pytest.raises(ValueError, match="sum to W"):
        bias_silu_split_triton(x, bias, [8, 8])
    with pytest.raises(ValueError, match="sum to W"):
        ref.bias_silu_split_ref(x, bias, [8, 8])
    with pytest.raises(ValueError, match="bias_silu_split"):
        bias_silu_split_triton(x.long(), bias, sizes)


def test_dispatch_rules_and_config():
    """uvqk_projection: [z_u, silu(z_v), silu(z_q), silu(z_k)] with z = x_norm @ W + b -- u WITHOUT its SiLU (the
    block's gate applies it) -- on either backend, and its refusals."""
    g = torch.Generator().manual_seed(2)
    sizes = [3, 3, 4, 6]
    x_norm, weight, bias = torch.randn(11, 12, generator=g), torch.randn(12, 16, generator=g), torch.randn(16, generator=g)
    z = torch.split(torch.addmm(bias, x_norm, weight), sizes, 1)
    want = [z[0]] + [torch.nn.functional.silu(t) for t in z[1:]]
    got = ops.uvqk_projection(x_norm, weight, bias, sizes, backend="reference")
    assert len(got) == 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(ops.uvqk_projection(x_norm, weight, bias, sizes, backend="auto"), want):  # CPU: the reference
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        ops.uvqk_projection(x_norm, weight, bias, sizes, backend="fast")
    for bad in ([6, 10], [0, 6, 4, 6], [3, 3, 4, 5]):  # not four splits / an empty split / not summing to W
        with pytest.raises(ValueError, match="uvqk_projection: sizes"):
            ops.uvqk_projection(x_norm, weight, bias, bad, backend="reference")
    with pytest.raises(ValueError, match="uvqk_kernel"):
        ModelConfig(uvqk_kernel="fast").validate()
    ModelConfig(uvqk_kernel="triton").validate()
    assert ModelConfig().uvqk_kernel == "reference"  # until measured on a GPU
    if INTERPRET:
        got = ops.uvqk_projection(x_norm, weight, bias, sizes, backend="triton")
        z64 = torch.addmm(bias.double(), x_norm.double(), weight.double())
        want64 = [z64[:, :3]] + ref.bias_silu_split_ref(z64[:, 3:], torch.zeros(13, dtype=torch.float64), sizes[1:])
        for a, b in zip(got, want64):
            assert _rel(a, b) < TOL
        assert all(t.is_contiguous() for t in got[1:])


@cpu_only
@pytest.mark.parametrize("fp32_residual", [True, False])
def test_hstu_block_with_the_kernel_matches_reference(fp32_residual):
    """One HSTU block (jagged batch with empty and length-1 sequences) with model.uvqk_kernel = "triton" against
    "reference": output and every parameter's gradient."""
    from gemray.model.hstu import HSTUBlock

    cfg = ModelConfig(embedding_dim=32, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0,
                      attention_backend="reference", relative_bias=False, fp32_residual=fp32_residual)
    lengths = [0, 1, 7, 13, 1, 0, 5]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    T = int(offsets[-1])
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, 32, generator=g)
    ts = torch.arange(T) * 60
    results = []
    for kernel in ("reference", "triton"):
        torch.manual_seed(0)
        block = HSTUBlock(ModelConfig(**{**cfg.__dict__, "uvqk_kernel": kernel}), max_seq_len=16)
        with torch.no_grad():
            block.uvqk_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # a bias that matters
        xi = x.clone().requires_grad_()
        y = block(xi, offsets, ts)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for _, p in sorted(block.named_parameters())])
    for i, (a, b) in enumerate(zip(*results)):
        assert _rel(a, b) < 1e-5, (i, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gem_block_shape_cuda():
    sizes = [1024] * 4
    x, bias, grads = _case(131072, sizes, device="cuda", dtype=torch.bfloat16)
    got = _run(bias_silu_split_triton, x, bias, sizes, grads)
    want = _run(ref.bias_silu_split_ref, x.float(), bias, sizes, [g.float() for g in grads])
    for i, (a, b) in enumerate(zip(got, want)):
        tol = 1e-2 if i < len(sizes) + 1 else 1e-4  # bf16 outputs / dx; float32 column sums
        assert _rel(a, b) < tol, (i, _rel(a, b))


@cpu_only
def test_block_compiles_fullgraph_with_the_kernel():
    """torch.compile traces the block's kernel path as one graph (the custom ops' fakes and autograd)."""
    from gemray.model.hstu import HSTUBlock

    cfg = ModelConfig(embedding_dim=16, num_heads=2, attention_dim=16, linear_dim=16, dropout=0.0,
                      attention_backend="triton", relative_bias=False, uvqk_kernel="triton")
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
        results.append([y.detach(), *torch.autograd.grad(y.square().sum(), [xi, block.uvqk_bias])])
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-6
