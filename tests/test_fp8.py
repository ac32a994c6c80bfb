"""FP8 training GEMMs (gemray.model.fp8): scaling math exact, emulation close to bf16/fp32, the converter's
skip rules, the norm-fused HSTU path, numerics counters; GPU: torch._scaled_mm against the emulation."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemray.kernels.reference import norm_quant_ref, quantize_blocks_ref
from gemray.model.fp8 import (E4M3, E5M2, Fp8Linear, Fp8Settings, collect_fp8_stats, convert_to_fp8, fp8_eligible,
                              fp8_linear, fp8_mm, pop_fp8_stats, quantize_rowwise, quantize_tensorwise)
from gemray.model.hstu import HSTUBlock, HSTUEncoder
from model_utils import tiny_cfg

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch._scaled_mm)")


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_quantize_rowwise_scaling_is_exact():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 / 3], [0.0, 0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3, 8e-3]])
    q, s = quantize_rowwise(x)
    assert s.shape == (3, 1) and q.dtype == E4M3 and q.is_contiguous()
    assert s[0, 0] == pytest.approx(448.0 / 3 / 448.0) and s[1, 0] == 0 and s[2, 0] == pytest.approx(8e-3 / 448)
    assert torch.all(q[1].float() == 0)
    # the row's amax maps exactly to the e4m3 max; powers of two times the scale are exact
    assert q[0, 3].float() == 448.0 and q[2, 3].float() == 448.0 and q[2, 0].float() == 56.0
    # columnwise (the wgrad's contraction over M) and the same bytes as the fused norm kernel's reference
    qc, sc = quantize_rowwise(x, E4M3, 0)
    assert sc.shape == (1, 4) and torch.equal(qc.view(torch.uint8), quantize_rowwise(x.t())[0].t().view(torch.uint8))
    y = torch.randn(33, 64)
    qr, sr = quantize_blocks_ref(y, 64)
    q2, s2 = quantize_rowwise(y)
    assert torch.equal(q2.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s2, sr)
    # e5m2 keeps the range: amax -> 57344
    qe, se = quantize_rowwise(y, E5M2)
    assert float(qe.float().abs().amax(1).min()) == 57344.0
    with pytest.raises(ValueError):
        quantize_rowwise(y, torch.bfloat16)


def test_fp8_mm_emulation_is_dequantized_matmul_rounded_to_bf16():
    """The emulation models rowwise _scaled_mm: fp32 products of the dequantized operands, one rounding to bf16
    (its only output type on sm90)."""
    a, b = torch.randn(20, 32), torch.randn(48, 32)
    aq, as_ = quantize_rowwise(a)
    bq, bs = quantize_rowwise(b)
    out = fp8_mm(aq, as_, bq.t(), bs.t(), backend="emulate")
    ref = ((aq.float() * as_) @ (bq.float() * bs).t()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="CUDA"):
        fp8_mm(aq, as_, bq.t(), bs.t(), backend="scaled_mm")


def test_quantize_rowwise_pads_the_contraction_in_place_and_handles_edge_slices():
    """pad_to: zero columns appended (the wgrad's M to a multiple of 16), the scales those of the unpadded x;
    a transposed view is quantized into a row-major result; all-zero, tiny and non-finite rows."""
    g = torch.randn(37, 24)
    q, s = quantize_rowwise(g.t(), E5M2, -1, pad_to=16)
    q0, s0 = quantize_rowwise(g.t().contiguous(), E5M2, -1)
    assert q.shape == (24, 48) and q.is_contiguous() and torch.equal(s, s0)
    assert torch.equal(q[:, :37].view(torch.uint8), q0.view(torch.uint8)) and torch.all(q[:, 37:].float() == 0)
    x = torch.tensor([[0.0, 0.0], [1e-40, -1e-40], [float("inf"), 1.0], [float("nan"), 2.0], [3.0, -448.0]])
    q, s = quantize_rowwise(x)
    qf = q.float()
    assert torch.all(qf[:2] == 0) and torch.isnan(qf[2, 0]) and qf[2, 1] == 0 and torch.isnan(qf[3, 0])
    assert qf[4].tolist() == [3.0, -448.0] and s[4, 0] == 1.0
    assert quantize_rowwise(torch.zeros(0, 8))[0].shape == (0, 8)
    with pytest.raises(ValueError, match="pad_to"):
        quantize_rowwise(g, E4M3, 0, pad_to=16)


def test_weight_cache_quantizes_once_per_step_and_never_serves_a_stale_copy(monkeypatch):
    """Inside fp8_weight_cache: a forward run twice (an activation-checkpoint recompute) quantizes the weight once
    per layout; an in-place update (the optimizer) bumps its version and is quantized anew; outside, every use
    quantizes."""
    from gemray.model import fp8 as fp8mod

    calls = []
    real = fp8mod.quantize_rowwise

    def counting(x, *a, **kw):
        calls.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(fp8mod, "quantize_rowwise", counting)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    st = Fp8Settings("e4m3", "emulate")
    with fp8mod.fp8_weight_cache():
        y1 = fp8_linear(x, w, None, st)
        y2 = fp8_linear(x, w, None, st)
        assert torch.equal(y1, y2) and calls.count((16, 32)) == 1
        (y1.float().sum() + y2.float().sum()).backward()
        assert calls.count((32, 16)) == 1 and calls.count((32, 8)) == 2  # w^T once; x^T per use (not cached)
        with torch.no_grad():
            w.mul_(2.0)
        y3 = fp8_linear(x, w, None, st)
        assert calls.count((16, 32)) == 2
        torch.testing.assert_close(y3.float(), 2 * y1.float(), rtol=0, atol=0)  # powers of two: exact
    fp8_linear(x, w, None, st)
    fp8_linear(x, w, None, st)
    assert calls.count((16, 32)) == 4 and fp8mod._WCACHE is None
    # a fresh transposed view per call (HSTU's uvqk_weight.t()) still hits: keyed on its base parameter
    wk = torch.randn(32, 16, requires_grad=True)  # [K, N] storage
    calls.clear()
    with fp8mod.fp8_weight_cache():
        fp8_linear(x, wk.t(), None, st)
        fp8_linear(x, wk.t(), None, st)
        fp8_linear(x, wk.t()[:4], None, st)  # another view of it: its own copy
    assert calls.count((16, 32)) == 1 and calls.count((4, 32)) == 1


@pytest.mark.parametrize("grad", ["e4m3", "e5m2", "bf16"])
def test_fp8_linear_close_to_high_precision(grad):
    """e4m3 has 3 mantissa bits: per-element relative error <= 2^-4, so GEMM outputs land within a few
    percent (norm-relative) of fp32; FP8 gradients add their own rounding (e5m2 has 2 mantissa bits). Stated
    tolerances: output 4%; input / weight gradients 6% (e4m3), 10% (e5m2), 4% (bf16)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(45, 128), torch.randn(64, 128) * 0.05, torch.randn(64)
    xs = [t.clone().requires_grad_() for t in (x, w, b)]
    xr = [t.clone().requires_grad_() for t in (x, w, b)]
    g = torch.randn(45, 64)
    y = fp8_linear(*xs, Fp8Settings(grad, "emulate"))
    yr = F.linear(*xr)
    (y * g).sum().backward()
    (yr * g).sum().backward()
    assert _rel(y, yr) < 0.04
    tol = {"e5m2": 0.10, "e4m3": 0.06, "bf16": 0.04}[grad]
    assert _rel(xs[0].grad, xr[0].grad) < tol and _rel(xs[1].grad, xr[1].grad) < tol
    # the bias gradient is the exact sum of the gradient y (bf16, as _scaled_mm's output) received
    torch.testing.assert_close(xs[2].grad, g.to(torch.bfloat16).float().sum(0))
    assert y.dtype == torch.bfloat16 and xs[0].grad.dtype == xs[1].grad.dtype == torch.float32


def test_fp8_linear_with_given_quantized_input_and_transposed_weight():
    x, w = torch.randn(10, 64), torch.randn(64, 32)  # w stored [K, N] as HSTU's uvqk_weight
    q, s = quantize_rowwise(x)
    st = Fp8Settings("bf16", "emulate")
    a = fp8_linear(x, w.t(), None, st, x_fp8=q, x_scale=s)
    torch.testing.assert_close(a, fp8_linear(x, w.t(), None, st))
    with pytest.raises(ValueError):
        fp8_linear(x, w.t(), None, st, x_fp8=q)
    with pytest.raises(ValueError):
        fp8_linear(x, w, None, st)


def test_stats_count_underflow_and_overflow():
    x = torch.tensor([[1.0, 1e-9, 0.0, 2.0], [float("inf"), 1.0, 1.0, 1.0]])
    with collect_fp8_stats():
        quantize_rowwise(x, stats_key="l.x")
    st = pop_fp8_stats()["l.x"]
    # row 0: 1e-9 flushed (the 0.0 is not counted); row 1: the inf amax scales its finite values to 0
    assert st["underflow"] == pytest.approx(4 / 8)
    assert st["overflow"] == pytest.approx(1 / 8)  # the inf itself (NaN after scaling) is off the grid
    assert pop_fp8_stats() == {}
    quantize_rowwise(x, stats_key="l.x")  # outside the block: nothing collected
    assert pop_fp8_stats() == {}


def test_converter_skip_rules_and_shared_parameters():
    model = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 64), nn.Linear(256, 144),
                          nn.Linear(144, 130))
    w0 = model[0].weight
    report = convert_to_fp8(model, "bf16", min_dim=128)
    assert report["converted"] == ["0", "3"]
    assert [s.split(":")[0] for s in report["skipped"]] == ["2", "4"]
    assert "below min_dim" in report["skipped"][0] and "multiples of 16" in report["skipped"][1]
    assert isinstance(model[0], Fp8Linear) and model[0].weight is w0 and type(model[2]) is nn.Linear
    assert set(model.state_dict()) == {f"{i}.{p}" for i in (0, 2, 3, 4) for p in ("weight", "bias")}
    assert fp8_eligible(128, 128) is None and fp8_eligible(120, 128) and fp8_eligible(64, 128)
    with pytest.raises(ValueError):
        convert_to_fp8(model, "fp16")


def test_converter_on_meta_hstu_and_block_path(caplog):
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=16)
    enc = HSTUEncoder(cfg, 16, device="meta")
    with caplog.at_level("WARNING", logger="gemray.model.fp8"):
        rep = convert_to_fp8(enc, min_dim=16)
        assert rep["converted"] == ["blocks.0", "blocks.1"] and enc.blocks[0].fp8.name == "blocks.0"
        assert not caplog.records
        small = HSTUEncoder(tiny_cfg(), 16, device="meta")  # D=16, H*V=8: not multiples of 16 -> kept
        assert convert_to_fp8(small, min_dim=16)["converted"] == []
    # a run that asked for FP8 and would silently train in bf16 is told so
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "no GEMM was converted" in caplog.text


def _fp8_block_against_plain(settings: Fp8Settings):
    """One HSTU block (D=32, 2 heads of 16, sequences of 5 and 7) run with ``settings`` and, with the same weights
    and input, in plain fp32: (the FP8 run's counters, x, relative error of the residual branch's output, of the
    input gradient). Asserts every GEMM's x / w / grad counters were recorded."""
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=16, num_blocks=1)
    ref = HSTUBlock(cfg, 16)
    blk = HSTUBlock(cfg, 16)
    blk.load_state_dict(ref.state_dict())
    blk.fp8 = settings
    offsets = torch.tensor([0, 5, 12])
    ts = torch.arange(12) * 100
    x = torch.randn(12, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with collect_fp8_stats():
        yb = blk(xb, offsets, ts)
        yb.sum().backward()
    ya = ref(xa, offsets, ts)
    ya.sum().backward()
    st = pop_fp8_stats()
    assert {f"{settings.name}.{g}.{o}" for g in ("uvqk", "o") for o in ("x", "w", "grad")} <= set(st)
    return st, x, _rel(yb - xb, ya - xa), _rel(xb.grad, xa.grad)


def test_hstu_block_fp8_uses_fused_norm_quant_and_stays_close():
    st, x, rel_y, rel_dx = _fp8_block_against_plain(Fp8Settings("e5m2", "emulate", "b"))
    # two chained e4m3 GEMMs (uvqk, then the output projection) on the residual branch: stated 10%
    assert rel_y < 0.1 and rel_dx < 0.1
    # the uvqk input is exactly the fused norm's FP8 output (block = the whole row)
    _, q, s = norm_quant_ref(x, None, None, kind="layer", eps=1e-6, block_size=32)
    assert s.shape == (12, 1)
    torch.testing.assert_close(quantize_rowwise(F.layer_norm(x, (32,), eps=1e-6))[1], s)


_U32 = 2.0 ** -24  # fp32 unit roundoff


def _gemm_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, fast_accum: bool = False,
                bf16_partials: bool = False) -> torch.Tensor:
    """Elementwise bound on |scaled_mm - emulation| of one GEMM ref = a @ b (a [M, K], b [K, N]: the dequantized
    operands both sides multiply, identical FP8 bytes and scales): both round the same exact product to bf16,
    each to within half an ulp (<= 2^-8 of |ref| and of itself: two half-ulps = 2^-8 (|ref| + |other|), taken as
    2^-7 |ref| + slack), after fp32 accumulations in different orders, each within gamma_K = K u of
    sum_k |a_ik b_kj| (u = 2^-24, the classical recursive-summation bound). fast_accum (the forward): Hopper's
    fast FP8 accumulation keeps about 14 bits per 32-deep MMA step (DeepSeek-V3, arXiv:2412.19437 sec. 3.3.2; not
    an NVIDIA specification): ceil(K / 32) * 2^-14 of the same sum. bf16_partials: cuBLAS's bf16 GEMMs may reduce
    split-K partials in bf16 (torch's allow_bf16_reduced_precision_reduction): 2^-8 of it. No e4m3 step (2^-4)
    enters: the operands are the same bytes on both sides."""
    k = a.shape[1]
    absprod = a.abs().double() @ b.abs().double()
    c = 2 * k * _U32 + (math.ceil(k / 32) * 2.0 ** -14 if fast_accum else 0.0) + (2.0 ** -8 if bf16_partials else 0.0)
    return (2.0 ** -7 * ref.abs().double() + c * absprod).float() + 1e-30


@gpu
@needs_cuda
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("grad", ["e4m3", "e5m2", "bf16"])
def test_scaled_mm_matches_emulation(grad, recipe):
    """fp8_linear on _scaled_mm vs the CPU emulation on the same device, forward and the three gradients, fed the
    same upstream gradient (bf16-exact, so both sides quantize the same bytes): every element within
    :func:`_gemm_bound` of its GEMM (K = 256 forward, 512 dgrad, 1008 wgrad). The former comparison (loss of
    y.float() on each side) fed the scaled_mm side a bf16-rounded gradient and the emulation an fp32 one, whose
    re-quantization to FP8 differed by an e4m3 step on ~1/64 of the values: 1.3% / 1.8% (run 6, 2026-12-02).
    Tensorwise: _scaled_mm with 0-dim fp32 scales (cuBLAS's tensorwise path), the dgrad / wgrad on the forward's
    and the gradient's bytes transposed."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x, w, b = torch.randn(1000, 256, device=dev), torch.randn(512, 256, device=dev) * 0.05, torch.randn(512, device=dev)
    g = (torch.randn(1000, 512, device=dev) * 0.01).to(torch.bfloat16)
    outs = {}
    for backend in ("scaled_mm", "emulate"):
        ts = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fp8_linear(*ts, Fp8Settings(grad, backend, recipe=recipe))
        y.backward(g)
        outs[backend] = (y, *(t.grad for t in ts))
    (ya, dxa, dwa, dba), (ye, dxe, dwe, dbe) = outs["scaled_mm"], outs["emulate"]
    assert ya.dtype == ye.dtype == torch.bfloat16 and dxa.dtype == dwa.dtype == torch.float32
    gdt = {"e4m3": E4M3, "e5m2": E5M2}.get(grad)

    def deq(t, fmt, pad=1):
        q, sc = quantize_rowwise(t, fmt, -1, pad_to=pad)
        return q.float() * sc

    def deq_tw(t, fmt):
        q, sc = quantize_tensorwise(t, fmt)
        return q.float() * sc

    if recipe == "tensorwise":  # one set of bytes per tensor: the backward's operands are the forward's
        xq, wq = deq_tw(x, E4M3), deq_tw(w, E4M3)
    else:
        xq, wq = deq(x, E4M3), deq(w, E4M3)
    checks = [("y", ya, ye, xq, wq.t(), True, False)]
    if gdt is not None and recipe == "tensorwise":
        gq = deq_tw(g, gdt)
        checks += [("dx", dxa, dxe, gq, wq, False, False), ("dw", dwa, dwe, gq.t(), xq, False, False)]
    elif gdt is not None:
        checks += [("dx", dxa, dxe, deq(g, gdt), deq(w.t(), E4M3).t(), False, False),
                   ("dw", dwa, dwe, deq(g.t(), gdt, 16), deq(x.t(), E4M3, 16).t(), False, False)]
    else:
        gf, wf, xf = g.float(), w.to(torch.bfloat16).float(), x.to(torch.bfloat16).float()
        checks += [("dx", dxa, dxe, gf, wf, False, True), ("dw", dwa, dwe, gf.t(), xf, False, True)]
    for name, a, e, opa, opb, fast, partials in checks:
        ref = opa @ opb
        bound = _gemm_bound(opa, opb, ref, fast_accum=fast, bf16_partials=partials)
        if name == "y":  # + the bias in bf16 on both sides: one more rounding, an ulp of |acc| + |b| at most
            bound = bound + 2.0 ** -7 * (ref.abs() + b.to(torch.bfloat16).float().abs().view(1, -1))
        err = (a.float() - e.float()).abs()
        worst = float((err / bound).max())
        assert worst <= 1.0, f"{name}: {worst:.3f} of the bound (max abs err {float(err.max()):.3e})"
    torch.testing.assert_close(dba, dbe, rtol=0, atol=0)  # the same sum of the same gradient


@gpu
@needs_cuda
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_hstu_training_step_on_gpu(recipe):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = tiny_cfg(embedding_dim=256, num_heads=4, attention_dim=64, linear_dim=64, num_blocks=2)
    enc = HSTUEncoder(cfg, 64, device=dev)
    convert_to_fp8(enc, "e4m3", recipe=recipe)
    assert all(b.fp8 is not None and b.fp8.recipe == recipe for b in enc.blocks)
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-3)
    offsets = torch.tensor([0, 37, 101, 150], device=dev)
    ts = torch.arange(150, device=dev) * 60
    tok = torch.randn(150, 256, device=dev)
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = enc(tok, offsets, ts)
        loss = (1 - (out[:-1].float() * out[1:].float()).sum(-1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert enc.blocks[0].uvqk_weight.dtype == torch.float32  # master weights untouched


def test_emulation_under_autocast_returns_the_autocast_dtype_with_fp32_math():
    x, w = torch.randn(8, 32), torch.randn(16, 32)
    st = Fp8Settings("bf16", "emulate")
    ref = fp8_linear(x, w, None, st)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, None, st)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref.to(torch.bfloat16), rtol=0, atol=0)  # the same fp32 GEMM, rounded once


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("grad", ["e4m3", "bf16"])
def test_empty_batch_runs_forward_and_backward(grad, recipe):
    x = torch.zeros(0, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    y = fp8_linear(x, w, b, Fp8Settings(grad, "emulate", recipe=recipe))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.all(w.grad == 0) and torch.all(b.grad == 0) and x.grad.shape == (0, 32)


@gpu
@needs_cuda
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("m", [0, 1, 17])
def test_scaled_mm_odd_and_empty_token_counts(m, recipe):
    dev = torch.device("cuda")
    x = torch.randn(m, 128, device=dev, requires_grad=True)
    w = torch.randn(256, 128, device=dev, requires_grad=True)
    y = fp8_linear(x, w, None, Fp8Settings("e4m3", "scaled_mm", recipe=recipe))
    assert y.shape == (m, 256) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.shape == w.shape and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("a_layout, b_layout", [("row", "col"), ("col", "row"), ("row", "row")])
def test_scaled_mm_gets_the_layouts_it_requires_whatever_the_operands(a_layout, b_layout):
    """_scaled_mm takes a row-major a and a column-major b; traced under torch.compile, the FP8 copy of a
    transposed weight view came with the view's strides and the compiled FP8 step failed on the H200 ("mat2 must be
    col_major"). Checked on the meta device (the op's meta function makes the same layout checks, no GPU needed)."""
    from gemray.model.fp8 import fp8_mm

    M, K, N = 64, 128, 256
    a = torch.empty(M, K, dtype=E4M3, device="meta") if a_layout == "row" else \
        torch.empty(K, M, dtype=E4M3, device="meta").t()
    b = torch.empty(N, K, dtype=E4M3, device="meta").t() if b_layout == "col" else \
        torch.empty(K, N, dtype=E4M3, device="meta")
    sa, sb = torch.ones(M, 1, device="meta"), torch.ones(1, N, device="meta")
    if (a_layout, b_layout) != ("row", "col"):  # the raw op refuses these layouts
        with pytest.raises(RuntimeError, match="major"):
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    y = fp8_mm(a, sa, b, sb, backend="scaled_mm")
    assert y.shape == (M, N) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe, grad", [("rowwise", "e4m3"), ("rowwise", "bf16"), ("tensorwise", "e4m3"),
                                          ("tensorwise", "e5m2"), ("tensorwise", "bf16")])
def test_fp8_linear_compiles_as_one_graph_and_matches_eager(recipe, grad):
    """Under torch.compile the FP8 linear traces whole, forward and backward: a graph break (the weight cache's
    id / version-counter keys, an ``out=`` into a padded view) left every quantization eager, and the compiled
    FP8 GEM step took 297 ms against bf16's 165 on the H200 (2026-12-04). The traced step quantizes to the same
    bytes (same scales, same rounding) as eager, inside an open weight cache and a stats collection alike (the
    counters are eager-only: none are recorded by the traced step, and the next eager step records again).
    Tensorwise too: its whole-tensor amax, the FP8 tensors saved for the backward and the padded byte transposes
    of the wgrad trace without a break."""
    from gemray.model import fp8 as fp8mod

    torch._dynamo.reset()
    torch.manual_seed(0)
    st = Fp8Settings(grad, "emulate", "lin", recipe)
    w = torch.randn(48, 32, requires_grad=True)
    b = torch.randn(48, requires_grad=True)

    def step(x):
        y = fp8_linear(x, w, b, st)
        return (F.silu(y.float()) * torch.linspace(-1, 1, y.shape[1])).sum()

    x = torch.randn(37, 32)  # 37 tokens: the wgrad pads the contraction to 48
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    explain = torch._dynamo.explain(step)(x.clone().requires_grad_())
    assert explain.graph_break_count == 0, [str(r.reason).split("\n")[0] for r in explain.break_reasons]
    le = step(xe)
    le.backward()
    ge = (xe.grad, w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with fp8mod.fp8_weight_cache(), collect_fp8_stats():
        lc = compiled(xc)
        lc.backward()
    assert pop_fp8_stats() == {}
    torch.testing.assert_close(lc, le, rtol=0, atol=0)
    for got, want in zip((xc.grad, w.grad, b.grad), ge):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with collect_fp8_stats():
        fp8_linear(x, w, b, st)
    assert "lin.x" in pop_fp8_stats()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_compiled_wgrad_quantization_does_not_recompile_on_token_count_parity(recipe):
    """The wgrad's x^T is padded to a multiple of 16 tokens (rowwise: quantized so; tensorwise: the forward's bytes
    transposed so): under torch.compile (automatic dynamic shapes) token counts 37, 53, 48, 64, 71 compile twice
    (the first, static, then one dynamic graph), not again when a count is a multiple of 16."""
    from torch._dynamo.testing import CompileCounter

    from gemray.model.fp8 import _transpose_fp8

    def rowwise(x):
        return quantize_rowwise(x.t(), E4M3, -1, pad_to=16)

    def tensorwise(x):
        q, s = quantize_tensorwise(x)
        return _transpose_fp8(q), s

    torch._dynamo.reset()
    cnt = CompileCounter()
    f = torch.compile(rowwise if recipe == "rowwise" else tensorwise, backend=cnt, dynamic=None)
    for m in (37, 53, 48, 64, 71):
        x = torch.randn(m, 32)
        q, s = f(x)
        assert q.shape == (32, -(-m // 16) * 16) and s.shape == ((32, 1) if recipe == "rowwise" else ())
        if recipe == "tensorwise":  # the eager forward's bytes, transposed, then zero columns
            q0 = quantize_tensorwise(x)[0]
            assert torch.equal(q[:, :m].view(torch.uint8), q0.t().view(torch.uint8))
            assert torch.all(q[:, m:].view(torch.uint8) == 0)
    assert cnt.frame_count == 2


# ----------------------------------------------------------------------------------------------------------
# the tensorwise recipe
# ----------------------------------------------------------------------------------------------------------
_TW = "tensorwise"


def test_quantize_tensorwise_scaling_is_exact():
    """One 0-dim fp32 scale = amax / fp8_max for the whole tensor: the arithmetic of quantize_rowwise with the amax
    over every element (the same bytes as quantize_rowwise of the tensor laid out as one row); a bf16 x is scaled
    in fp32 (the same bytes as its fp32 copy: one rounding, by the cast); all-zero / empty tensors get scale 0."""
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 / 3], [0.0, 0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3, 8e-3]])
    q, s = quantize_tensorwise(x)
    assert s.shape == () and s.dtype == torch.float32 and q.dtype == E4M3 and q.shape == x.shape and q.is_contiguous()
    assert s == pytest.approx(448.0 / 3 / 448.0)
    assert q[0, 3].float() == 448.0 and q[0, 0].float() == 3.0 and torch.all(q[1].float() == 0)
    # the third row is on the tensor's grid, not its own: 8e-3 * 3 = 0.024 -> e4m3 0.0234375 (subnormal step 2^-9)
    assert q[2, 3].float() == 12 * 2.0 ** -9
    y = torch.randn(33, 64) * torch.logspace(-3, 1, 64)  # columns of very different magnitude
    qt, st = quantize_tensorwise(y)
    qr, sr = quantize_rowwise(y.reshape(1, -1))
    assert torch.equal(qt.view(torch.uint8).reshape(1, -1), qr.view(torch.uint8)) and st == sr.reshape(())
    qb, sb = quantize_tensorwise(y.to(torch.bfloat16))
    qf, sf = quantize_tensorwise(y.to(torch.bfloat16).float())
    assert torch.equal(qb.view(torch.uint8), qf.view(torch.uint8)) and torch.equal(sb, sf)
    assert float(quantize_tensorwise(y, E5M2)[0].float().abs().max()) == 57344.0
    for z in (torch.zeros(5, 16), torch.zeros(0, 16)):
        qz, sz = quantize_tensorwise(z)
        assert sz.shape == () and float(sz) == 0.0 and qz.shape == z.shape and torch.all(qz.float() == 0)
    with pytest.raises(ValueError, match="dtype"):
        quantize_tensorwise(y, torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        quantize_tensorwise(y[0])


def test_fp8_mm_tensorwise_emulation_and_scale_pairs():
    """The emulation of tensorwise _scaled_mm: fp32 product of the dequantized operands rounded once to bf16; a
    rowwise / tensorwise mix of scales is refused as _scaled_mm refuses it."""
    a, b = torch.randn(20, 32), torch.randn(48, 32)
    aq, as_ = quantize_tensorwise(a)
    bq, bs = quantize_tensorwise(b)
    out = fp8_mm(aq, as_, bq.t(), bs, backend="emulate")
    torch.testing.assert_close(out, ((aq.float() * as_) @ (bq.float() * bs).t()).to(torch.bfloat16), rtol=0, atol=0)
    _, rs = quantize_rowwise(b)
    with pytest.raises(ValueError, match="both rowwise or both tensorwise"):
        fp8_mm(aq, as_, bq.t(), rs.t(), backend="emulate")


_U = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3, "bf16": 2.0 ** -8}  # unit roundoff: 2^-(mantissa bits + 1)


def _rms_bound(*fmts: str) -> float:
    """Expected norm-relative error of a GEMM (or a sum of them) whose inputs carry independent round-to-nearest
    errors in the given formats: each element's relative error is at most u and, uniform within its binade step,
    has a mean square of at most u^2 / 3; the errors add in quadrature over the products of random-signed data."""
    return math.sqrt(sum(_U[f] ** 2 for f in fmts) / 3)


@pytest.mark.parametrize("m", [1, 45, 160])
@pytest.mark.parametrize("grad", ["e4m3", "e5m2", "bf16"])
def test_tensorwise_fp8_linear_close_to_high_precision(grad, m):
    """Forward, dgrad and wgrad against fp32 on random inputs, M = 1, 45 (not a multiple of 16) and 160. Stated
    tolerances from the formats' precision (:func:`_rms_bound`): the forward rounds x and w to e4m3 and its output
    (+ bias) to bf16; dgrad / wgrad round g to the grad format and w / x to e4m3 (the FP8 backward) or w / x to
    bf16 (grad "bf16"), and their bf16 output. The upstream gradient is bf16-exact (what y's bf16 receives)."""
    torch.manual_seed(m)
    x, w, b = torch.randn(m, 128), torch.randn(256, 128) * 0.05, torch.randn(256)
    g = torch.randn(m, 256).to(torch.bfloat16).float()
    xs = [t.clone().requires_grad_() for t in (x, w, b)]
    xr = [t.clone().requires_grad_() for t in (x, w, b)]
    y = fp8_linear(*xs, Fp8Settings(grad, "emulate", recipe=_TW))
    y.backward(g)
    yr = F.linear(*xr)
    yr.backward(g)
    assert y.dtype == torch.bfloat16 and xs[0].grad.dtype == xs[1].grad.dtype == torch.float32
    assert _rel(y.float() - b, yr - b) < _rms_bound("e4m3", "e4m3", "bf16")
    tol = _rms_bound(grad, "e4m3" if grad != "bf16" else "bf16", "bf16")
    assert _rel(xs[0].grad, xr[0].grad) < tol and _rel(xs[1].grad, xr[1].grad) < tol
    torch.testing.assert_close(xs[2].grad, g.sum(0))


@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_tensorwise_backward_reuses_the_forward_fp8_bytes(grad, monkeypatch):
    """Three GEMMs per step on ONE FP8 copy each of x, w and g: the dgrad multiplies the forward's w bytes, the
    wgrad the forward's x bytes and the dgrad's g bytes, transposed and zero-padded from 37 to 48 tokens, with the
    same scales; three quantizations in all (x, w, g), none rowwise. dx / dw are those dequantized operands'
    products rounded to bf16 (one ulp apart at most: the fp32 sums may run in another order)."""
    from gemray.model import fp8 as fp8mod

    calls, quants = [], []
    real_mm, real_tw, real_rw = fp8mod.fp8_mm, fp8mod.quantize_tensorwise, fp8mod.quantize_rowwise

    def mm(a_q, a_s, b_q, b_s, **kw):
        calls.append((a_q, a_s, b_q, b_s))
        return real_mm(a_q, a_s, b_q, b_s, **kw)

    def tw(x, *a, **kw):
        quants.append(tuple(x.shape))
        return real_tw(x, *a, **kw)

    def rw(*a, **kw):
        raise AssertionError("the tensorwise recipe quantized rowwise")

    monkeypatch.setattr(fp8mod, "fp8_mm", mm)
    monkeypatch.setattr(fp8mod, "quantize_tensorwise", tw)
    monkeypatch.setattr(fp8mod, "quantize_rowwise", rw)
    torch.manual_seed(0)
    m = 37
    x = torch.randn(m, 64, requires_grad=True)
    w = (torch.randn(32, 64) * 0.1).requires_grad_()
    g = torch.randn(m, 32).to(torch.bfloat16)
    fp8_linear(x, w, None, Fp8Settings(grad, "emulate", recipe=_TW)).backward(g)
    assert quants == [(m, 64), (32, 64), (m, 32)]  # x, w, g: once each
    (fx, fxs, fw, fws), (dg, dgs, dw_b, dws), (wg, wgs, wx, wxs) = calls

    def u8(t):
        return t.view(torch.uint8)

    def same(a, b):  # the very same scale tensor (storage), not only an equal value
        return a.data_ptr() == b.data_ptr() and torch.equal(a, b)

    xq, xs_ = real_tw(x.detach())
    gq, gs = real_tw(g, E5M2 if grad == "e5m2" else E4M3)
    assert torch.equal(u8(fx), u8(xq)) and torch.equal(fxs, xs_)                  # forward: x quantized once
    assert torch.equal(u8(dg), u8(gq)) and torch.equal(dgs, gs)                   # dgrad: g quantized once
    assert torch.equal(u8(dw_b), u8(fw.t())) and same(dws, fws)             # dgrad: the forward's w bytes
    assert wx.shape == (48, 64) and torch.equal(u8(wx[:m]), u8(fx)) and torch.all(u8(wx[m:]) == 0) and same(wxs, fxs)
    assert wg.shape == (32, 48) and torch.equal(u8(wg[:, :m]), u8(dg.t())) and torch.all(u8(wg[:, m:]) == 0)
    assert same(wgs, dgs)

    def deq(q, s):
        return q.float() * s

    dx_ref = (deq(dg, dgs) @ deq(fw.t(), fws)).to(torch.bfloat16).float()
    dw_ref = (deq(dg, dgs).t() @ deq(fx, fxs)).to(torch.bfloat16).float()
    torch.testing.assert_close(x.grad, dx_ref, rtol=2.0 ** -8, atol=1e-6)
    torch.testing.assert_close(w.grad, dw_ref, rtol=2.0 ** -8, atol=1e-6)


@pytest.mark.parametrize("recipe, grad, x_bytes", [("rowwise", "e4m3", 4), ("tensorwise", "e4m3", 1),
                                                   ("tensorwise", "e5m2", 1), ("tensorwise", "bf16", 4)])
def test_what_the_forward_saves_for_the_backward(recipe, grad, x_bytes):
    """Tensorwise with FP8 gradients saves x's e4m3 copy (1 byte per element) and its scale instead of x (here
    fp32, 4 bytes: what a LayerNorm's output is under autocast) -- and the weight's FP8 copy instead of the weight;
    rowwise, and grad "bf16" (its bf16 GEMMs need the high-precision x), save x itself."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape), t.element_size()))
        return t

    x = torch.randn(40, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_linear(x, w, None, Fp8Settings(grad, "emulate", recipe=recipe))
    x_saved = [s for s in saved if s[1] == (40, 64)]
    assert len(x_saved) == 1 and x_saved[0][2] == x_bytes
    if x_bytes == 1:
        assert x_saved[0][0] == E4M3 and sorted(saved, key=str) == sorted(
            [(E4M3, (40, 64), 1), (torch.float32, (), 4), (E4M3, (32, 64), 1), (torch.float32, (), 4)], key=str)
    y.float().sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_tensorwise_all_zero_tensors_give_zero_not_nan():
    """An all-zero activation: scale 0, the output is the bias alone; an all-zero gradient: dx = dw = 0; an
    all-zero weight: y = bias, dx = 0. Never NaN (fp8_max / 0 is mapped to 0)."""
    st = Fp8Settings("e4m3", "emulate", recipe=_TW)
    b = torch.randn(32)
    x = torch.zeros(17, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = fp8_linear(x, w, b, st)
    torch.testing.assert_close(y, b.to(torch.bfloat16).expand(17, 32), rtol=0, atol=0)
    y.float().sum().backward()
    assert torch.all(w.grad == 0) and torch.isfinite(x.grad).all()
    x2 = torch.randn(17, 64, requires_grad=True)
    w2 = torch.randn(32, 64, requires_grad=True)
    fp8_linear(x2, w2, None, st).backward(torch.zeros(17, 32, dtype=torch.bfloat16))
    assert torch.all(x2.grad == 0) and torch.all(w2.grad == 0)
    x3 = torch.randn(17, 64, requires_grad=True)
    y3 = fp8_linear(x3, torch.zeros(32, 64), b, st)
    torch.testing.assert_close(y3, b.to(torch.bfloat16).expand(17, 32), rtol=0, atol=0)
    y3.float().sum().backward()
    assert torch.all(x3.grad == 0)


def test_tensorwise_weight_cache_and_quantization_count(monkeypatch):
    """Per linear and step under tensorwise: x, w and g quantized once each (w through the weight cache: a
    recompute of the forward reuses its copy), nothing re-quantized for the backward."""
    from gemray.model import fp8 as fp8mod

    calls = []
    real = fp8mod.quantize_tensorwise

    def counting(x, *a, **kw):
        calls.append(tuple(x.shape))
        return real(x, *a, **kw)

    monkeypatch.setattr(fp8mod, "quantize_tensorwise", counting)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    st = Fp8Settings("e4m3", "emulate", recipe=_TW)
    with fp8mod.fp8_weight_cache():
        y1 = fp8_linear(x, w, None, st)
        y2 = fp8_linear(x, w, None, st)  # an activation-checkpoint recompute
        assert torch.equal(y1, y2) and calls.count((16, 32)) == 1 and calls.count((8, 32)) == 2
        y1.float().sum().backward()
        assert calls.count((8, 16)) == 1 and len(calls) == 4  # + g; no weight or x^T quantization
    fp8_linear(x, w, None, st)
    assert calls.count((16, 32)) == 2  # outside the cache: every use


def test_tensorwise_given_quantized_input_and_the_scale_it_takes():
    x, w = torch.randn(10, 64), torch.randn(64, 32)
    st = Fp8Settings("e4m3", "emulate", recipe=_TW)
    q, s = quantize_tensorwise(x)
    torch.testing.assert_close(fp8_linear(x, w.t(), None, st, x_fp8=q, x_scale=s), fp8_linear(x, w.t(), None, st),
                               rtol=0, atol=0)
    qr, sr = quantize_rowwise(x)
    with pytest.raises(ValueError, match=r"x_scale \[\] \(tensorwise\)"):
        fp8_linear(x, w.t(), None, st, x_fp8=qr, x_scale=sr)
    with pytest.raises(ValueError, match="rowwise"):
        fp8_linear(x, w.t(), None, Fp8Settings("e4m3", "emulate"), x_fp8=q, x_scale=s)


def test_tensorwise_settings_and_converter():
    with pytest.raises(ValueError, match="fp8 recipe"):
        Fp8Settings("e4m3", "emulate", recipe="blockwise")
    model = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))
    convert_to_fp8(model, "e5m2", recipe=_TW)
    assert model[0].fp8.recipe == model[2].fp8.recipe == _TW and "fp8_recipe=tensorwise" in repr(model[0])
    enc = HSTUEncoder(tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=16), 16, device="meta")
    convert_to_fp8(enc, min_dim=16, recipe=_TW)
    assert enc.blocks[0].fp8.recipe == _TW and enc.blocks[0]._fp8_for("o").recipe == _TW
    with pytest.raises(ValueError, match="fp8 recipe"):
        convert_to_fp8(nn.Sequential(nn.Linear(128, 128)), recipe="rowwise2")


def test_hstu_block_tensorwise_quantizes_the_norm_output_itself_and_stays_close(monkeypatch):
    """Tensorwise: the uvqk input is the LayerNorm's output quantized with one scale (the fused rowwise norm kernel
    is not called: its per-row bytes are not the tensor's), and the block stays within the rowwise test's 10% of
    fp32 (two chained e4m3 GEMMs on the residual branch)."""
    import gemray.kernels.reference as ref_mod

    def no_fused(*a, **kw):
        raise AssertionError("the rowwise norm_quant was called under tensorwise")

    monkeypatch.setattr(ref_mod, "norm_quant_ref", no_fused)
    st, x, rel_y, rel_dx = _fp8_block_against_plain(Fp8Settings("e4m3", "emulate", "b", _TW))
    assert st["b.uvqk.x"]["amax"] == pytest.approx(float(F.layer_norm(x, (32,), eps=1e-6).abs().max()))
    assert rel_y < 0.1 and rel_dx < 0.1


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("m", [0, 1, 17])
def test_every_gemm_passes_scaled_mm_checks_on_meta(recipe, m):
    """Forward, dgrad and wgrad of both recipes through the "scaled_mm" backend on the meta device: torch's meta
    function of _scaled_mm checks what the CUDA op checks before its kernel (row-major a, column-major b, K and
    both dims of b multiples of 16, fp32 scales: a 1-element pair is tensorwise), so each GEMM's shapes, layouts
    and scales -- the wgrad's padded token dim included -- are the op's, without a GPU."""
    x = torch.empty(m, 128, device="meta", requires_grad=True)
    w = torch.empty(256, 128, device="meta", requires_grad=True)
    b = torch.empty(256, device="meta", requires_grad=True)
    y = fp8_linear(x, w, b, Fp8Settings("e4m3", "scaled_mm", recipe=recipe))
    assert y.shape == (m, 256) and y.dtype == torch.bfloat16
    y.backward(torch.empty(m, 256, device="meta", dtype=torch.bfloat16))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
