"""Fused norm + FP8 quantize (kernels/norm_quant.py): Triton vs the PyTorch reference, forward and backward.

On CPU the Triton kernels run in the interpreter; TRITON_INTERPRET must be set before triton decorates the
kernels (i.e. before gemray.kernels.norm_quant is imported), hence the setdefault at the top.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gemray.bench.norm_quant import bench_norm_quant  # noqa: E402
from gemray.kernels.norm_quant import _round_to_e4m3, norm_quant  # noqa: E402
from gemray.kernels.reference import (  # noqa: E402
    NORM_QUANT_FP8_DTYPE as FP8_DTYPE,
    NORM_QUANT_FP8_MAX as FP8_MAX,
    norm_quant_ref,
    quantize_blocks_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB = 2.0**-10  # half the subnormal step (2^-9), in units of the block scale


def _inputs(n, d, *, affine, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Offset + spread per row so mean and variance both matter; a few outliers per row for the amax.
    x = torch.randn(n, d, generator=g) * (1 + 3 * torch.rand(n, 1, generator=g)) + torch.randn(n, 1, generator=g)
    if n and d:
        x[:, :: max(1, d // 3)] *= 8
    w = (1 + 0.5 * torch.randn(d, generator=g)) if affine in ("w", "wb") else None
    b = 0.3 * torch.randn(d, generator=g) if affine == "wb" else None
    cast = lambda t: None if t is None else t.to(DEVICE, dtype).requires_grad_(True)  # noqa: E731
    return cast(x), cast(w), cast(b)


def _dequant(q, s, block_size):
    return q.float() * s.repeat_interleave(block_size, dim=1)


def _assert_quant_consistent(y, q, s, block_size):
    """The fp8 copy dequantises to y within e4m3 rounding, and scales are amax / 448."""
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == y.shape and s.shape == (y.shape[0], y.shape[1] // block_size)
    yf = y.detach().float()
    amax = yf.view(y.shape[0], y.shape[1] // block_size, block_size).abs().amax(-1)
    torch.testing.assert_close(s, amax / FP8_MAX, rtol=1e-6, atol=0)
    err = (_dequant(q, s, block_size) - yf).abs()
    bound = E4M3_REL * yf.abs() + E4M3_SUB * s.repeat_interleave(block_size, dim=1) + 1e-12
    assert bool((err <= bound * (1 + 1e-5)).all()), f"max excess {(err - bound).max().item()}"
    # Each block's largest element maps onto +-448 exactly (saturating scale choice).
    if y.numel():
        qmax = q.float().view(y.shape[0], y.shape[1] // block_size, block_size).abs().amax(-1)
        assert bool(((qmax == FP8_MAX) | (amax == 0)).all())


SHAPES = [  # (N, D, block_size)
    (0, 128, 128),
    (1, 128, 128),
    (3, 384, 128),  # G = 3 groups: padded to 4 inside the kernel
    (5, 256, 32),
    (4, 1024, 128),
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("n,d,bs", SHAPES)
def test_forward_backward_match_reference(n, d, bs, kind, affine):
    x, w, b = _inputs(n, d, affine=affine, seed=n * 1000 + d)
    y, q, s = norm_quant(x, w, b, kind=kind, block_size=bs, backend="triton")
    xr, wr, br = (None if t is None else t.detach().clone().requires_grad_(True) for t in (x, w, b))
    yr, qr, sr = norm_quant_ref(xr, wr, br, kind=kind, block_size=bs)

    assert y.dtype == x.dtype and y.shape == (n, d)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    _assert_quant_consistent(y, q, s, bs)
    # Same bytes as the reference wherever y agrees (fp32 sums in another order may move a rare tie).
    same = (q.view(torch.uint8) == qr.view(torch.uint8)).float()
    assert n == 0 or same.mean().item() >= 0.999
    assert not q.requires_grad and not s.requires_grad

    params = [t for t in (x, w, b) if t is not None]
    params_r = [t for t in (xr, wr, br) if t is not None]
    dy = torch.randn(n, d, generator=torch.Generator().manual_seed(7)).to(DEVICE, x.dtype)
    grads = torch.autograd.grad(y, params, dy)
    grads_r = torch.autograd.grad(yr, params_r, dy)
    for name, gk, gr in zip(["x", "weight", "bias"], grads, grads_r):
        assert gk.shape == gr.shape and gk.dtype == gr.dtype, name
        scale = max(gr.abs().max().item(), 1e-6) if gr.numel() else 1.0
        err = (gk - gr).abs().max().item() / scale if gr.numel() else 0.0
        assert err < 1e-5, f"d{name}: rel err {err}"
    if n == 0:
        for gk in grads[1:]:
            assert bool((gk == 0).all())


def test_bf16_forward_backward():
    x, w, b = _inputs(6, 256, affine="wb", dtype=torch.bfloat16, seed=3)
    y, q, s = norm_quant(x, w, b, kind="layer", backend="triton")
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    yr, qr, sr = norm_quant_ref(xr, wr, br, kind="layer")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), yr.float(), rtol=1.6e-2, atol=1e-2)  # 1 bf16 ulp
    _assert_quant_consistent(y, q, s, 128)
    dy = torch.randn_like(y)
    for gk, gr in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(yr, (xr, wr, br), dy)):
        assert gk.dtype == torch.bfloat16
        torch.testing.assert_close(gk.float(), gr.float(), rtol=2e-2, atol=2e-2 * gr.float().abs().max().item())


def test_constant_row_gives_zero_scale_not_nan():
    """A constant row normalizes to 0 (LayerNorm, no bias): scale 0, fp8 zeros, no NaN/inf."""
    x, w, _ = _inputs(3, 256, affine="w", seed=11)
    with torch.no_grad():
        x[1] = 2.5
    y, q, s = norm_quant(x, w, None, kind="layer", block_size=128, backend="triton")
    assert bool((s[1] == 0).all()) and bool((q[1].float() == 0).all())
    assert bool(torch.isfinite(q.float()).all()) and bool(torch.isfinite(s).all())
    assert bool((s[0] > 0).all()) and bool((s[2] > 0).all())
    _assert_quant_consistent(y, q, s, 128)


def test_strided_input_and_auto_backend():
    base, w, b = _inputs(4, 512, affine="wb", seed=5)
    x = base.detach()[:, :256]  # row stride 512, unit column stride
    w, b = w.detach()[:256], b.detach()[:256]
    assert x.stride() == (512, 1)
    y, q, s = norm_quant(x, w, b, kind="rms", backend="triton")
    yr, qr, sr = norm_quant_ref(x.contiguous(), w, b, kind="rms")
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    ya, qa, sa = norm_quant(x, w, b, kind="rms")  # auto
    if DEVICE == "cpu":  # auto -> reference on CPU: bit-identical to it
        assert torch.equal(ya, yr) and torch.equal(qa.view(torch.uint8), qr.view(torch.uint8))


@triton.jit
def _cast_kernel(X, Q, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(Q + offs, _round_to_e4m3(tl.load(X + offs, mask=m, other=0.0)).to(Q.dtype.element_ty), mask=m)


def test_round_to_e4m3_matches_torch_cast_incl_ties():
    """Every finite e4m3 value, every midpoint (ties -> even), and values near them cast like torch."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = torch.unique(grid[torch.isfinite(grid)])  # sorted, 253 values incl. +-448 and 0
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids * (1 + 1e-6), mids * (1 - 1e-6), grid * (1 + 1e-3)])
    rnd = (torch.rand(4000, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 448
    tiny = (torch.rand(1000, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 0.03
    v = torch.cat([grid, mids, near, rnd, tiny, torch.tensor([-0.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-11])])
    v = v.clamp(-FP8_MAX, FP8_MAX).to(DEVICE)
    q = torch.empty(v.numel(), dtype=FP8_DTYPE, device=DEVICE)
    _cast_kernel[(triton.cdiv(v.numel(), 1024),)](v, q, v.numel(), BLOCK=1024)
    want = v.to(FP8_DTYPE)
    bad = q.view(torch.uint8) != want.view(torch.uint8)
    assert not bool(bad.any()), list(zip(v[bad][:5].tolist(), q.float()[bad][:5].tolist()))


def test_quantize_blocks_ref_roundtrip():
    y = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)) * torch.tensor([[1e-3], [1.0], [1e3]])
    q, s = quantize_blocks_ref(y, 64)
    assert s.shape == (3, 4)
    _assert_quant_consistent(y, q, s, 64)


@pytest.mark.parametrize(
    "kwargs,x_shape,match",
    [
        (dict(block_size=128), (2, 200), "not a multiple of block_size"),
        (dict(block_size=96), (2, 192), "power of two"),
        (dict(kind="group"), (2, 128), "kind"),
        (dict(backend="cuda"), (2, 128), "backend"),
        (dict(eps=0.0), (2, 128), "eps"),
        (dict(), (128,), "2-D"),
        (dict(), (2, 0), "D == 0"),
    ],
)
def test_bad_input_raises(kwargs, x_shape, match):
    x = torch.randn(*x_shape)
    with pytest.raises(ValueError, match=match):
        norm_quant(x, None, **kwargs)


def test_bad_weight_raises():
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\]"):
        norm_quant(x, torch.ones(64), backend="triton")
    with pytest.raises(ValueError, match="bias"):
        norm_quant(x, torch.ones(128), torch.ones(128, dtype=torch.int64))


def test_bench_rows_smoke(monkeypatch, capsys):
    """The benchmark's bookkeeping on tiny shapes (do_bench stubbed to run once; real timing needs CUDA)."""
    import triton.testing

    calls = []

    def fake_do_bench(fn, return_mode="median"):
        fn()
        calls.append(return_mode)
        return 0.5

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    rows = bench_norm_quant(((3, 256),), ("layer", "rms"), block_size=64, dtype=torch.float32,
                            warps_sweep=(2,), device=DEVICE)
    assert [r["kind"] for r in rows] == ["layer", "rms"] and set(calls) == {"median"}
    for r in rows:
        assert r["max_abs_err_y"] < 1e-4 and r["fp8_match"] > 0.99 and r["bwd_max_rel_err"] < 1e-4
        assert r["speedup"] == 1.0 and "ms_w2" in r
        nbytes = 3 * 256 * 4 * 2 + 3 * 256 + 3 * 4 * 4 + 256 * 4 * (2 if r["kind"] == "layer" else 1)
        assert abs(r["GB/s_fused"] - nbytes / 0.5e6) < 1e-9
    out = capsys.readouterr().out
    assert "speedup" in out and out.count("\n") == 3
