"""The Triton kernels as torch.library custom ops (gemray::gdpa_fwd / gdpa_bwd, gemray::norm_quant_fwd / bwd).

CPU (TRITON_INTERPRET=1, set below when no CUDA device is present): ``torch.library.opcheck`` on tiny jagged
batches (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes); the fake implementations'
shapes and dtypes under FakeTensorMode and on the meta device; the eager path (an autograd.Function over the same
implementation) and the op path agree bitwise; the launch-plan cache hits inside the op; an HSTU block compiles
(aot_eager) with no graph break and one op per call. GPU (@pytest.mark.gpu): a small HSTUEncoder step in bf16
under torch.compile (inductor), forward and backward, with no graph break inside attention.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray.kernels import jagged_attention as ja  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.config import DEFAULT, TileSet  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled)")
LENGTHS = [0, 1, 5, 19, 3]  # empty, length 1, one longer than a 16-row interpreter tile


def _off(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0)


def _rand(*shape, grad=True, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, device=device).to(dtype).requires_grad_(grad)


def _fwd_args(pattern: str, grad: bool = True, device="cpu", dtype=torch.float32):
    """(op args of gemray::gdpa_fwd) for one call pattern on LENGTHS, H=1, Dqk 16, Dv 8; the scalars as
    gdpa_triton passes them."""
    torch.manual_seed(3)
    off = _off(LENGTHS, device)
    t, b, n = int(off[-1]), len(LENGTHS), max(LENGTHS)
    q, k, v = _rand(t, 1, 16, grad=grad, device=device, dtype=dtype), \
        _rand(t, 1, 16, grad=grad, device=device, dtype=dtype), _rand(t, 1, 8, grad=grad, device=device, dtype=dtype)
    nt = bias = None
    q_off, act, causal, alpha, block, window, bcast, ctx, max_q = off, "softmax", True, 0.25, 0, 0, False, 0, n
    if pattern == "silu_targets_bias":
        act, alpha = "silu", 1.0
        nt = torch.tensor([0, 1, 2, 5, 0], device=device)
        bias = _rand(b, n + 2, n + 2, grad=grad, device=device)
    elif pattern == "gelu_context_full_bias":
        act, alpha, ctx = "gelu", 0.5, 4
        bias = _rand(b, 1, n, n, grad=grad, device=device)
    elif pattern == "cross":
        q_off = _off([2, 0, 3, 1, 4], device)
        q = _rand(int(q_off[-1]), 1, 16, grad=grad, device=device, dtype=dtype)
        causal, max_q = False, 4
    elif pattern == "pma":
        q = _rand(3, 1, 16, grad=grad, device=device, dtype=dtype)
        q_off = torch.arange(b + 1, device=device) * 3
        causal, bcast, max_q = False, True, 3
    elif pattern == "block":
        block = 4
    elif pattern == "window_silu":
        act, alpha, window, causal = "silu", 1.0, 3, False
    return (q, k, v, q_off, off, nt, bias, max_q, n, act, causal, alpha, 1.0 / n, block, window, bcast, ctx,
            DEFAULT.name)


PATTERNS = ["softmax", "silu_targets_bias", "gelu_context_full_bias", "cross", "pma", "block", "window_silu"]


@cpu_only
@pytest.mark.parametrize("pattern", PATTERNS)
def test_opcheck_gdpa_fwd(pattern):
    """opcheck of gemray::gdpa_fwd (schema, autograd registration, fake tensor, AOT dispatch dynamic: the latter
    also runs the backward op) on self / cross / PMA / block / window calls with targets and dense biases."""
    torch.library.opcheck(ja.gdpa_fwd_op, _fwd_args(pattern))


@cpu_only
@pytest.mark.parametrize("pattern", ["softmax", "silu_targets_bias", "pma"])
def test_opcheck_gdpa_bwd(pattern):
    """opcheck of gemray::gdpa_bwd on the forward's outputs (no autograd formula of its own: inputs without grad)."""
    args = _fwd_args(pattern, grad=False)
    o, lse = ja.gdpa_fwd_op(*args)
    softmax = args[9] == "softmax"
    bias = args[6]
    bwd = (torch.randn_like(o), *args[:3], o if softmax else None, lse if softmax else None, *args[3:7], *args[7:17],
           bias is not None, args[17])
    torch.library.opcheck(ja.gdpa_bwd_op, bwd)


@cpu_only
@pytest.mark.parametrize("kind,affine", [("layer", "wb"), ("rms", "w"), ("layer", "none")])
def test_opcheck_norm_quant(kind, affine):
    """opcheck of gemray::norm_quant_fwd (with and without stored statistics) and gemray::norm_quant_bwd."""
    from gemray.kernels import norm_quant as nq

    torch.manual_seed(4)
    x = torch.randn(3, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True) if affine != "none" else None
    b = torch.randn(64, requires_grad=True) if affine == "wb" else None
    # with grads: not test_aot_dispatch_dynamic, which sums every output and has no CPU sum for float8_e4m3fn (the
    # y_fp8 output); it runs on the no-grad call and on the backward op below
    torch.library.opcheck(nq.norm_quant_fwd_op, (x, w, b, kind, 1e-5, 32, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    plain = (x.detach(), None if w is None else w.detach(), None if b is None else b.detach())
    torch.library.opcheck(nq.norm_quant_fwd_op, (*plain, kind, 1e-5, 32, True))
    torch.library.opcheck(nq.norm_quant_fwd_op, (x.detach(), None, None, kind, 1e-5, 32, False))
    _, _, _, mean, rstd = nq.norm_quant_fwd_op(x.detach(), w, b, kind, 1e-5, 32, True)
    torch.library.opcheck(nq.norm_quant_bwd_op, (torch.randn(3, 64), x.detach(), None if w is None else w.detach(),
                                                 mean, rstd, b is not None, kind))


def test_fake_implementations_shapes_and_dtypes():
    """Under FakeTensorMode the public entry points run the ops' fake implementations (no kernel, no data): output
    shapes and dtypes of self (bf16 too), cross, PMA and block calls, and the gradients' through the backward op's
    fake; the norm + quantize op's three outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gemray.kernels.norm_quant import norm_quant

    with FakeTensorMode():
        off = torch.tensor([0, 3, 3, 10])
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(10, 2, d, dtype=dtype, requires_grad=True) for d in (16, 16, 24))
            out = ja.jagged_attention_triton(q, k, v, off, 7, activation="softmax")
            assert out.shape == (10, 2, 24) and out.dtype == dtype
            bias = torch.randn(3, 8, 8, requires_grad=True)
            out = ja.jagged_attention_triton(q, k, v, off, 7, activation="silu", attn_bias=bias,
                                             num_targets=torch.tensor([1, 0, 2]))
            dq, dk, dv, db = torch.autograd.grad(out.float().sum(), (q, k, v, bias))
            assert [x.shape for x in (dq, dk, dv, db)] == [q.shape, k.shape, v.shape, bias.shape]
            assert dq.dtype == dtype and db.dtype == torch.float32
        qo = torch.tensor([0, 2, 6, 7])
        qc = torch.randn(7, 2, 16)
        assert ja.jagged_cross_attention_triton(qc, qo, k.float(), v.float(), off, 4, 7).shape == (7, 2, 24)
        seeds = torch.randn(5, 2, 16, requires_grad=True)
        out = ja.pma_triton(seeds, k.float(), v.float(), off, 7)
        assert out.shape == (3, 5, 2, 24)
        assert torch.autograd.grad(out.sum(), seeds)[0].shape == seeds.shape
        assert ja.jagged_block_attention_triton(q, k, v, off, 7, block_size=4).shape == (10, 2, 24)
        x = torch.randn(6, 256, dtype=torch.bfloat16, requires_grad=True)
        y, yq, s = norm_quant(x, torch.ones(256, dtype=torch.bfloat16), None, kind="rms", backend="triton")
        assert (y.shape, y.dtype, yq.dtype, s.shape, s.dtype) == ((6, 256), torch.bfloat16, torch.float8_e4m3fn,
                                                                   (6, 2), torch.float32)


def test_meta_tensors_take_the_ops():
    """Meta tensors (e.g. a model built on the meta device) go through the ops' fake implementations."""
    off = torch.tensor([0, 3, 3, 10], device="meta")
    q = torch.empty(10, 2, 16, device="meta", requires_grad=True)
    out = ja.gdpa_triton(q, q, q, off, off, 7, 7, activation="softmax", causal=True)
    assert out.shape == (10, 2, 16) and out.device.type == "meta"
    assert torch.autograd.grad(out.sum(), q)[0].shape == q.shape


@cpu_only
@pytest.mark.parametrize("pattern", ["silu_targets_bias", "softmax", "cross", "pma"])
def test_eager_path_and_op_path_agree_bitwise(pattern):
    """The eager autograd.Function and the custom ops run the same implementation: equal outputs and gradients
    (q, k, v, bias) bit for bit; both match the reference."""
    args = _fwd_args(pattern)
    q, k, v, q_off, off, nt, bias, max_q, n, act, causal, alpha, inv_n, block, window, bcast, ctx, _ = args
    leaves = [t for t in (q, k, v, bias) if t is not None]
    eager = ja.gdpa_triton(q, k, v, q_off, off, max_q, n, activation=act, causal=causal, alpha=alpha, norm=n,
                           num_targets=nt, attn_bias=bias, q_broadcast=bcast, block_size=block, window=window,
                           contextual_len=ctx)
    op, _ = ja.gdpa_fwd_op(*args)
    assert torch.equal(eager, op)
    do = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, leaves, do), torch.autograd.grad(op, leaves, do)):
        assert torch.equal(a, b)
    if pattern == "cross":
        want = ref.jagged_cross_attention_ref(q, q_off, k, v, off, max_q, n, activation=act, alpha=alpha)
    elif pattern == "pma":
        want = ref.pma_ref(q, k, v, off, n, activation=act, alpha=alpha).reshape(-1, 1, 8)
    else:
        want = ref.jagged_attention_ref(q, k, v, off, n, activation=act, causal=causal, alpha=alpha,
                                        num_targets=nt, attn_bias=bias)
    torch.testing.assert_close(op, want, rtol=1e-4, atol=1e-5)


@cpu_only
def test_a_python_dispatch_mode_sees_the_attention_as_one_op():
    """Under a TorchDispatchMode (selective activation checkpointing's, a FlopCounterMode) an eager call takes the
    custom ops, so the mode sees gemray::gdpa_fwd (and, in the backward, gdpa_bwd) -- not the eager
    autograd.Function's launches -- and gets the same values; without a mode the call stays on the eager path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gemray.kernels._eager import plain_eager

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v, q_off, off, nt, bias, max_q, n, act, causal, alpha, *_ = _fwd_args("silu_targets_bias")
    call = dict(activation=act, causal=causal, alpha=alpha, norm=n, num_targets=nt, attn_bias=bias)
    assert plain_eager(q, k, v)
    eager = ja.gdpa_triton(q, k, v, q_off, off, max_q, n, **call)
    mode = Ops()
    with mode:
        assert not plain_eager(q, k, v)
        seen = ja.gdpa_triton(q, k, v, q_off, off, max_q, n, **call)
        torch.autograd.grad(seen, (q, k, v), torch.ones_like(seen))
    assert mode.seen.count("gemray.gdpa_fwd.default") == 1 and mode.seen.count("gemray.gdpa_bwd.default") == 1
    assert torch.equal(seen, eager)


@cpu_only
def test_plan_cache_hits_inside_the_op():
    """The op's implementation finds the launch plan the first call made (keyed on the offsets object): one forward
    plan for two op calls and an eager call on the same batch and config; a new offsets object gets a new one."""
    args = list(_fwd_args("softmax"))
    off = args[4]

    def plans():
        return [p for key, (refs, p) in ja._CACHE.items() if key[0] == "fwd plan" and refs[0]() is off]

    o1, _ = ja.gdpa_fwd_op(*args)
    first = plans()
    o2, _ = ja.gdpa_fwd_op(*args)
    o1.sum().backward()
    q, k, v = args[:3]
    ja.jagged_attention_triton(q, k, v, off, args[8], activation="softmax", alpha=args[11])
    assert len(first) == 1 and plans() == first and len(first[0].bwd) == 1
    args[3] = args[4] = off.clone()
    ja.gdpa_fwd_op(*args)
    assert plans() == first  # the clone's plan is keyed on the clone


def _tiny_block(backend: str, device: str = "cpu", dtype=torch.float32):
    from gemray import ops
    from gemray.config import ModelConfig
    from gemray.model.hstu import HSTUBlock

    cfg = ModelConfig(embedding_dim=8, num_blocks=1, num_heads=1, attention_dim=8, linear_dim=8, dropout=0.0,
                      num_position_buckets=8, num_time_buckets=16, attention_backend=backend)
    torch.manual_seed(5)
    blk = HSTUBlock(cfg, max_seq_len=20, device=device).to(dtype)
    off = _off([0, 1, 5, 7], device)
    t = int(off[-1])
    x = torch.randn(t, 8, device=device, dtype=dtype, requires_grad=True)
    ts = torch.cumsum(torch.randint(1, 10 ** 5, (t,)), 0).to(device)
    buckets = ops.relative_bias_buckets(ts, off, 7, 8, 16, 20)
    return blk, (x, off, ts, buckets, {})


@cpu_only
def test_hstu_block_compiles_with_one_op_per_call_and_no_graph_break():
    """An HSTU block on the Triton backend (the interpreter here) under torch.compile (aot_eager): dynamo makes one
    graph (no break anywhere in the block, attention included), the forward graph calls gemray.gdpa_fwd once and the
    backward graph gemray.gdpa_bwd once; outputs and gradients equal eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    blk, inputs = _tiny_block("triton")
    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(str(gm.graph))
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    explained = torch._dynamo.explain(blk)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(blk, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    out = compiled(*inputs)
    want = blk(*inputs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    leaves = [inputs[0]] + list(blk.parameters())
    g_c = torch.autograd.grad(out.square().sum(), leaves)
    g_e = torch.autograd.grad(want.square().sum(), leaves)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(g.count("gemray.gdpa_fwd") for g in graphs["fw"]) == 1, graphs["fw"]
    assert sum(g.count("gemray.gdpa_bwd") for g in graphs["bw"]) == 1, graphs["bw"]


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_gpu_hstu_encoder_compiles_without_breaks_in_attention(monkeypatch, activation):
    """A small HSTUEncoder step (cuda, bf16, Triton backend) under torch.compile (inductor), forward and backward:
    no graph break is caused in gemray/ops.py or the kernels (dynamo's break reasons name neither), every block's
    attention is one gemray.gdpa_fwd in dynamo's graphs, the compiled step runs the ops' forward and backward
    once per block (counted in the implementation they share with the eager path), and its output and gradients
    match eager's (bf16 tolerance)."""
    from torch._inductor.compile_fx import compile_fx

    from gemray.config import ModelConfig
    from gemray.model.hstu import HSTUEncoder

    cfg = ModelConfig(embedding_dim=64, num_blocks=2, num_heads=2, attention_dim=32, linear_dim=32, dropout=0.0,
                      attn_activation=activation, num_position_buckets=32, num_time_buckets=64,
                      attention_backend="triton")
    torch.manual_seed(6)
    enc = HSTUEncoder(cfg, max_seq_len=128, device="cuda").to(torch.bfloat16)
    lengths = torch.randint(1, 129, (32,)).tolist() + [0, 1, 128]
    off = _off(lengths, "cuda")
    t = int(off[-1])
    tok = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ts = torch.cumsum(torch.randint(1, 10 ** 5, (t,)), 0).cuda()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(enc)(tok, off, ts)
    for reason in explained.break_reasons:
        frames = " ".join(f"{f.filename}:{f.lineno}" for f in reason.user_stack)
        assert "ops.py" not in frames and "kernels" not in frames, (reason.reason, frames)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    calls = {"fwd": 0, "bwd": 0, "eager": 0}
    real_fwd, real_bwd, real_apply = ja._forward, ja._backward, ja._GDPA.apply

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    torch._dynamo.reset()
    compiled = torch.compile(enc, backend=backend)
    out = compiled(tok, off, ts)  # compiles (the counters start after it)
    monkeypatch.setattr(ja, "_forward", count("fwd", real_fwd))
    monkeypatch.setattr(ja, "_backward", count("bwd", real_bwd))
    monkeypatch.setattr(ja._GDPA, "apply", count("eager", real_apply))
    out = compiled(tok, off, ts)
    w = torch.randn_like(out)
    leaves = [tok] + [p for p in enc.parameters() if p.requires_grad]
    g_c = torch.autograd.grad((out.float() * w).sum(), leaves, allow_unused=True)
    assert calls == {"fwd": cfg.num_blocks, "bwd": cfg.num_blocks, "eager": 0}, calls
    monkeypatch.undo()
    want = enc(tok, off, ts)
    g_e = torch.autograd.grad((want.float() * w).sum(), leaves, allow_unused=True)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g_c, g_e):
        if a is not None and b is not None:
            rel = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
            assert rel < 5e-2, rel
    assert sum(g.count("gemray.gdpa_fwd") for g in graphs) == cfg.num_blocks, graphs
