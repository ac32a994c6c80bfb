"""FP8 training GEMMs (gemray.model.fp8): scaling math exact, emulation close to bf16/fp32, the converter's
skip rules, the norm-fused HSTU path, numerics counters; GPU: torch._scaled_mm against the emulation."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemray.kernels.reference import norm_quant_ref, quantize_blocks_ref
from gemray.model.fp8 import (E4M3, E5M2, Fp8Linear, Fp8Settings, collect_fp8_stats, convert_to_fp8, fp8_eligible,
                              fp8_linear, fp8_mm, pop_fp8_stats, quantize_rowwise)
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


def test_converter_on_meta_hstu_and_block_path():
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=16)
    enc = HSTUEncoder(cfg, 16, device="meta")
    rep = convert_to_fp8(enc, min_dim=16)
    assert rep["converted"] == ["blocks.0", "blocks.1"] and enc.blocks[0].fp8.name == "blocks.0"
    small = HSTUEncoder(tiny_cfg(), 16, device="meta")  # D=16, H*V=8: not multiples of 16 -> kept
    assert convert_to_fp8(small, min_dim=16)["converted"] == []


def test_hstu_block_fp8_uses_fused_norm_quant_and_stays_close():
    torch.manual_seed(0)
    cfg = tiny_cfg(embedding_dim=32, num_heads=2, attention_dim=16, linear_dim=16, num_blocks=1)
    ref = HSTUBlock(cfg, 16)
    blk = HSTUBlock(cfg, 16)
    blk.load_state_dict(ref.state_dict())
    blk.fp8 = Fp8Settings("e5m2", "emulate", "b")
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
    assert {f"b.{g}.{o}" for g in ("uvqk", "o") for o in ("x", "w", "grad")} <= set(st)
    # two chained e4m3 GEMMs (uvqk, then the output projection) on the residual branch: stated 10%
    assert _rel(yb - xb, ya - xa) < 0.1 and _rel(xb.grad, xa.grad) < 0.1
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
@pytest.mark.parametrize("grad", ["e4m3", "e5m2", "bf16"])
def test_scaled_mm_matches_emulation(grad):
    """fp8_linear on _scaled_mm vs the CPU emulation on the same device, forward and the three gradients, fed the
    same upstream gradient (bf16-exact, so both sides quantize the same bytes): every element within
    :func:`_gemm_bound` of its GEMM (K = 256 forward, 512 dgrad, 1008 wgrad). The former comparison (loss of
    y.float() on each side) fed the scaled_mm side a bf16-rounded gradient and the emulation an fp32 one, whose
    re-quantization to FP8 differed by an e4m3 step on ~1/64 of the values: 1.3% / 1.8% (run 6, 2026-12-02)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x, w, b = torch.randn(1000, 256, device=dev), torch.randn(512, 256, device=dev) * 0.05, torch.randn(512, device=dev)
    g = (torch.randn(1000, 512, device=dev) * 0.01).to(torch.bfloat16)
    outs = {}
    for backend in ("scaled_mm", "emulate"):
        ts = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fp8_linear(*ts, Fp8Settings(grad, backend))
        y.backward(g)
        outs[backend] = (y, *(t.grad for t in ts))
    (ya, dxa, dwa, dba), (ye, dxe, dwe, dbe) = outs["scaled_mm"], outs["emulate"]
    assert ya.dtype == ye.dtype == torch.bfloat16 and dxa.dtype == dwa.dtype == torch.float32
    gdt = {"e4m3": E4M3, "e5m2": E5M2}.get(grad)

    def deq(t, fmt, pad=1):
        q, sc = quantize_rowwise(t, fmt, -1, pad_to=pad)
        return q.float() * sc

    xq, wq = deq(x, E4M3), deq(w, E4M3)
    checks = [("y", ya, ye, xq, wq.t(), True, False)]
    if gdt is not None:
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
def test_fp8_hstu_training_step_on_gpu():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = tiny_cfg(embedding_dim=256, num_heads=4, attention_dim=64, linear_dim=64, num_blocks=2)
    enc = HSTUEncoder(cfg, 64, device=dev)
    convert_to_fp8(enc, "e4m3")
    assert all(b.fp8 is not None for b in enc.blocks)
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


@pytest.mark.parametrize("grad", ["e4m3", "bf16"])
def test_empty_batch_runs_forward_and_backward(grad):
    x = torch.zeros(0, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    y = fp8_linear(x, w, b, Fp8Settings(grad, "emulate"))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.all(w.grad == 0) and torch.all(b.grad == 0) and x.grad.shape == (0, 32)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [0, 1, 17])
def test_scaled_mm_odd_and_empty_token_counts(m):
    dev = torch.device("cuda")
    x = torch.randn(m, 128, device=dev, requires_grad=True)
    w = torch.randn(256, 128, device=dev, requires_grad=True)
    y = fp8_linear(x, w, None, Fp8Settings("e4m3", "scaled_mm"))
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


@pytest.mark.parametrize("grad", ["e4m3", "bf16"])
def test_fp8_linear_compiles_as_one_graph_and_matches_eager(grad):
    """Under torch.compile the FP8 linear traces whole, forward and backward: a graph break (the weight cache's
    id / version-counter keys, an ``out=`` into a padded view) left every quantization eager, and the compiled
    FP8 GEM step took 297 ms against bf16's 165 on the H200 (2026-12-04). The traced step quantizes to the same
    bytes (same scales, same rounding) as eager, inside an open weight cache and a stats collection alike (the
    counters are eager-only: none are recorded by the traced step, and the next eager step records again)."""
    from gemray.model import fp8 as fp8mod

    torch._dynamo.reset()
    torch.manual_seed(0)
    st = Fp8Settings(grad, "emulate", "lin")
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


def test_compiled_wgrad_quantization_does_not_recompile_on_token_count_parity():
    """The wgrad quantizes x^T padded to a multiple of 16 tokens: under torch.compile (automatic dynamic shapes)
    token counts 37, 53, 48, 64, 71 compile twice (the first, static, then one dynamic graph), not again when
    a count is a multiple of 16."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    cnt = CompileCounter()
    f = torch.compile(lambda x: quantize_rowwise(x.t(), E4M3, -1, pad_to=16), backend=cnt, dynamic=None)
    for m in (37, 53, 48, 64, 71):
        q, s = f(torch.randn(m, 32))
        assert q.shape == (32, -(-m // 16) * 16) and s.shape == (32, 1)
    assert cnt.frame_count == 2
