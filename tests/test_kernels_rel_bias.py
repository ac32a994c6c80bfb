"""The HSTU relative position / time bias computed inside the Triton GDPA kernels (``RelBias``, issue 17).

The kernels take the bias ingredients (per-token query / key times [T] int64, pos_w [P], ts_w [NT]) and never a
dense [B, n, n] bias. CPU: Triton's interpreter (TRITON_INTERPRET=1), float32, against the reference backend of
``gemray.ops.attention`` (grouped reference with the same ingredients): forward and dq / dk / dv / d pos_w /
d ts_w; the bucket indices bit for bit (read back through an identity attention); window / block attention with
the bias against the dense-bias kernels; the custom ops' opcheck; no [B, n, n] allocation. GPU (@pytest.mark.gpu):
n = 1024 .. 4096 in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray import ops  # noqa: E402
from gemray.jagged import query_timestamps  # noqa: E402
from gemray.kernels import jagged_attention as ja  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.config import DEFAULT  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (compiled)")

N_POS, N_TIME = 16, 64  # P < max_len: the position buckets' log range is exercised too


def _offsets(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _inputs(lengths, h, d, seed, device="cpu", dtype=torch.float32, n_pos=N_POS, n_time=N_TIME):
    g = torch.Generator().manual_seed(seed)
    off = _offsets(lengths, device)
    t = int(off[-1])
    qkv = [(torch.randn(t, h, d, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_(True)
           for _ in range(3)]
    gaps = torch.exp(torch.rand(t, generator=g) * 16).long()  # 1 s .. ~100 days between events
    ts = (1_000_000_000 + torch.cumsum(gaps, 0)).to(device)
    # weights far from the model's init scale and never zero, so a wrong bucket shows
    pos_w = ((torch.rand(n_pos, generator=g) + 0.5) * torch.randn(n_pos, generator=g).sign()).to(device)
    ts_w = ((torch.rand(n_time, generator=g) + 0.5) * torch.randn(n_time, generator=g).sign()).to(device)
    return off, qkv, ts, pos_w.requires_grad_(True), ts_w.requires_grad_(True)


def _compare(lengths, max_len, activation, query_mode, tol, seed=3, h=2, d=16, device="cpu",
             dtype=torch.float32):
    """ops.attention(rel_bias=..., TRITON) vs the REFERENCE backend (float32 copies): forward and the five grads."""
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, h, d, seed, device, dtype)
    tq = query_timestamps(ts, off) if query_mode == "next" else None
    rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, max_len, query_timestamps=tq)
    out = ops.attention(q, k, v, off, max_len, activation=activation, causal=True, rel_bias=rel,
                        backend=ops.AttentionBackend.TRITON)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    rel_ref = ops.RelativeBiasInputs(ts, leaves[3], leaves[4], max_len, query_timestamps=tq)
    expect = ops.attention(*leaves[:3], off, max_len, activation=activation, causal=True, rel_bias=rel_ref,
                           backend=ops.AttentionBackend.REFERENCE)
    assert out.shape == expect.shape and out.dtype == dtype
    assert _rel(out, expect) < tol, f"forward rel err {_rel(out, expect):.2e}"
    do = torch.randn_like(expect)
    grads = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), do.to(out.dtype))
    ref_grads = torch.autograd.grad(expect, leaves, do)
    for name, gk, gr in zip(("q", "k", "v", "pos_w", "ts_w"), grads, ref_grads):
        assert gr.norm() > 0, name
        assert gk.dtype == gr.dtype or name in "qkv"
        assert _rel(gk, gr) < tol, f"d{name} rel err {_rel(gk, gr):.2e}"


@cpu_only
@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("query_mode", ["next", "self"])
def test_rel_bias_in_kernel_matches_reference(activation, query_mode):
    """Empty, length-1 and max-length (= max_len, several tiles) sequences; HSTU's next-item query times or the
    keys' own."""
    _compare([40, 0, 1, 7, 23], 40, activation, query_mode, 1e-4)


def _bias_readback(tq, ts, off, max_len, pos_w, ts_w, window=0):
    """The bias matrix the kernel adds, read back through an identity attention: activation "none", q = 0
    (logits = bias), v = one-hot per key position, N = 1 -> out[i, j] = bias(i, j) for valid j."""
    n = int((off[1:] - off[:-1]).max())
    t = int(off[-1])
    pos = torch.arange(t) - off[:-1].repeat_interleave(off[1:] - off[:-1])
    q = torch.zeros(t, 1, 16)
    v = torch.nn.functional.one_hot(pos, n).float().view(t, 1, n)
    rb = ja.RelBias(tq, ts, pos_w, ts_w, max_len)
    out = ja.gdpa_triton(q, q.clone(), v, off, off, max_len, max_len, activation="none", causal=True, norm=1.0,
                         rel_bias=rb, window=window)
    return out.view(t, n), pos


@cpu_only
@pytest.mark.parametrize("n_time", [64, 128])
def test_bucket_indices_are_the_references_bit_for_bit(n_time):
    """pos_w[p] = 1000 p, ts_w[b] = b (exact in fp32): the kernel's bias is 1000 * position bucket + time bucket,
    compared exactly with ops.relative_bias_buckets at time differences on and next to every bucket threshold
    (0, 1, thr - 1, thr, thr + 1), random ones and ones past 2^31 - 2 (where the int32 search saturates), both
    signs. 64 time buckets: the kernels' int32 bucket search (every threshold < 2^31); 128: the int64 one."""
    n_pos, max_len = 8, 30
    thr = ja._time_thresholds(n_time, torch.device("cpu"))
    assert ja._kernel_thresholds(n_time, torch.device("cpu")).dtype == (torch.int32 if n_time == 64 else torch.int64)
    edges = [int(x) for x in thr[1:-1] if x < 2 ** 40]
    far = {2 ** 31 - 3, 2 ** 31 - 2, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 5, 2 ** 45}
    dts = sorted({0, 1, 2} | {e + o for e in edges for o in (-1, 0, 1)} | far
                 | set(torch.randint(0, 10 ** 9, (40,)).tolist()))
    # sequences of length 2: key 0 at time 0 and query 1 at time +-dt (tq of the query = its own time)
    m = len(dts)
    lengths = [2] * m + [max_len]
    off = _offsets(lengths)
    ts = torch.zeros(int(off[-1]), dtype=torch.int64)
    sign = torch.tensor([1 if i % 2 else -1 for i in range(m)])
    ts[1:2 * m:2] = torch.tensor(dts) * sign
    ts[2 * m:] = torch.cumsum(torch.randint(0, 10 ** 6, (max_len,)), 0)
    pos_w = torch.arange(n_pos, dtype=torch.float32) * 1000
    ts_w = torch.arange(n_time, dtype=torch.float32)
    got, pos = _bias_readback(ts, ts, off, max_len, pos_w, ts_w)
    pb, tb = ops.relative_bias_buckets(ts, off, max_len, n_pos, n_time, max_len)
    seg = torch.arange(len(lengths)).repeat_interleave(off[1:] - off[:-1])
    cols = torch.arange(max_len)
    valid = cols.view(1, -1) <= pos.view(-1, 1)
    want = (pb[pos] * 1000 + tb[seg, pos]).float()[:, :max_len]
    got_full = torch.zeros(got.shape[0], max_len)
    got_full[:, :got.shape[1]] = got
    assert torch.equal(got_full[valid], want[valid])
    # every time bucket whose threshold is below 2^40 is hit, both sides of each threshold
    hit = set(tb[:m, 1, 0].tolist())
    assert len(hit & set(ref.time_bucket_ref(torch.tensor(edges), n_time).tolist())) == len(set(edges))


@cpu_only
def test_time_thresholds_are_exact():
    """thr[b] is the smallest |dt| with time_bucket_ref(|dt|) >= b: bucket(thr[b]) >= b > bucket(thr[b] - 1)."""
    thr = ja._time_thresholds(N_TIME, torch.device("cpu"))
    assert thr.shape == (N_TIME + 1,) and thr[0] == 0 and thr[-1] == 2 ** 63 - 1
    assert bool((thr[1:] >= thr[:-1]).all())
    real = thr[1:-1][thr[1:-1] < 2 ** 62]
    b = torch.arange(1, 1 + real.numel())
    assert torch.equal(ref.time_bucket_ref(real, N_TIME) >= b, torch.ones_like(b, dtype=torch.bool))
    assert torch.equal(ref.time_bucket_ref(real - 1, N_TIME) < b, torch.ones_like(b, dtype=torch.bool))


@cpu_only
@pytest.mark.parametrize("mode", ["window", "block"])
def test_rel_bias_with_window_and_block_attention(mode):
    """Sliding-window / block attention with the in-kernel bias equals the same kernels with the dense bias
    (rel_bias.dense, itself checked against the reference elsewhere), forward and all gradients."""
    lengths, max_len = [37, 0, 1, 12], 40
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 2, 16, 5)
    tq = query_timestamps(ts, off)
    kw = dict(window=9) if mode == "window" else dict(block_size=16)
    args = (off, off, max_len, max_len)
    out = ja.gdpa_triton(q, k, v, *args, activation="silu", causal=True,
                         rel_bias=ja.RelBias(tq, ts, pos_w, ts_w, max_len), **kw)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    dense = ops.RelativeBiasInputs(ts, leaves[3], leaves[4], max_len, query_timestamps=tq).dense(off, max(lengths))
    expect = ja.gdpa_triton(*leaves[:3], *args, activation="silu", causal=True, attn_bias=dense, **kw)
    assert _rel(out, expect) < 1e-5
    do = torch.randn_like(expect)
    for name, gk, gr in zip("qkvpt", torch.autograd.grad(out, (q, k, v, pos_w, ts_w), do),
                            torch.autograd.grad(expect, leaves, do)):
        assert gr.norm() > 0 and _rel(gk, gr) < 1e-4, name


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest numel of a tensor an op returns (except the interpreter's own byte-storage copies of
    the kernels' arguments: uint8 set_ / copy_)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:
                self.largest = max(self.largest, t.numel())
        return out


@cpu_only
def test_triton_rel_bias_allocates_no_dense_bias(monkeypatch):
    """ops.attention(rel_bias=..., TRITON) forward + backward: no dense builder runs and no tensor of B * n * n
    elements (or more) is made -- every allocation is O(T) or a bucket table."""
    lengths, max_len = [40, 1, 0, 3, 40, 2, 5, 1], 40
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 2, 16, 9)

    def boom(*a, **kw):
        raise AssertionError("dense relative bias built on the Triton path")

    monkeypatch.setattr(ops.RelativeBiasInputs, "dense", boom)
    monkeypatch.setattr(ops, "relative_bias_buckets", boom)
    monkeypatch.setattr(ref, "relative_bias_ref", boom)
    rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, max_len, query_timestamps=query_timestamps(ts, off))
    ja._time_thresholds(N_TIME, torch.device("cpu"))  # the cached tables are O(NT) / O(max_len) anyway
    with _Shapes() as spy:
        out = ops.attention(q, k, v, off, max_len, activation="silu", rel_bias=rel,
                            backend=ops.AttentionBackend.TRITON)
        out.backward(torch.randn_like(out))
    dense = len(lengths) * max(lengths) ** 2
    assert spy.largest < dense // 4, (spy.largest, dense)
    assert pos_w.grad is not None and ts_w.grad is not None and pos_w.grad.norm() > 0


def _op_args(act, grad):
    lengths, max_len = [9, 0, 1, 5], 9
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 1, 16, 11)
    q, k, v, pos_w, ts_w = (x.detach().requires_grad_(grad) for x in (q, k, v, pos_w, ts_w))
    tq = query_timestamps(ts, off)
    alpha = 0.25 if act == "softmax" else 1.0
    return (q, k, v, off, off, None, None, max_len, max_len, act, True, alpha, 1.0 / max_len, 0, 0, False, 0,
            DEFAULT.name, tq, ts, pos_w, ts_w, max_len)


@cpu_only
@pytest.mark.parametrize("act", ["silu", "softmax"])
def test_opcheck_gdpa_ops_with_rel_bias(act):
    """opcheck of gemray::gdpa_fwd (schema, fake, autograd registration incl. d pos_w / d ts_w) and gdpa_bwd with
    the in-kernel bias arguments."""
    args = _op_args(act, grad=True)
    torch.library.opcheck(ja.gdpa_fwd_op, args)
    args = _op_args(act, grad=False)
    o, lse = ja.gdpa_fwd_op(*args)
    softmax = act == "softmax"
    bwd = (torch.randn_like(o), *args[:3], o if softmax else None, lse if softmax else None, *args[3:17], False,
           args[17], *args[18:])
    torch.library.opcheck(ja.gdpa_bwd_op, bwd)


@cpu_only
def test_custom_op_path_equals_eager_path():
    """The dispatcher path (gdpa_fwd_op with its autograd formula) gives the eager autograd.Function's outputs and
    grads, d pos_w / d ts_w included."""
    args = _op_args("silu", grad=True)
    q, k, v, pos_w, ts_w = args[0], args[1], args[2], args[20], args[21]
    o, _ = ja.gdpa_fwd_op(*args)
    do = torch.randn_like(o)
    g_op = torch.autograd.grad(o, (q, k, v, pos_w, ts_w), do)
    rb = ja.RelBias(args[18], args[19], pos_w, ts_w, args[22])
    o2 = ja.jagged_attention_triton(q, k, v, args[3], args[7], activation="silu", rel_bias=rb)
    g_eager = torch.autograd.grad(o2, (q, k, v, pos_w, ts_w), do)
    assert torch.equal(o, o2)
    for a, b in zip(g_op, g_eager):
        assert torch.equal(a, b)


@cpu_only
def test_rel_bias_bad_arguments():
    off, (q, k, v), ts, pos_w, ts_w = _inputs([3, 2], 1, 16, 1)
    with pytest.raises(ValueError, match="query_times"):
        ja.jagged_attention_triton(q, k, v, off, 4, rel_bias=ja.RelBias(ts.int(), ts, pos_w, ts_w, 4))
    with pytest.raises(ValueError, match="not both"):
        ja.jagged_attention_triton(q, k, v, off, 4, attn_bias=torch.zeros(2, 3, 3),
                                   rel_bias=ja.RelBias(ts, ts, pos_w, ts_w, 4))


# ------------------------------------------------------------------------------------------------ GPU (H200)
@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1024, 2048, 4096])
@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_rel_bias_long_sequences_bf16(n, activation, d):
    """bf16 on CUDA at n = 1024 .. 4096 (one max-length sequence, shorter ones, an empty and a length-1 one: the
    medium regime at n <= 2048, the long one at 4096), HSTU widths (H=2, D=128 or the GEM config's 256, P=128
    position buckets, NT=64 time buckets), next-item query times: the in-kernel bias against the reference
    backend in fp32. n = 4096 at D = 128 failed to launch before the tiles were fitted to shared memory (run 7 of
    benchmarks/reports/gem_h200_2026-12-02.md; tests/test_kernels_smem.py)."""
    lengths = [n, n // 3, 1, 0, n // 2 + 7]
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 2, d, 21, device="cuda", dtype=torch.bfloat16,
                                              n_pos=128, n_time=64)
    tq = query_timestamps(ts, off)
    rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, n, query_timestamps=tq)
    out = ops.attention(q, k, v, off, n, activation=activation, rel_bias=rel, backend=ops.AttentionBackend.TRITON)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v, pos_w, ts_w)]
    rel_ref = ops.RelativeBiasInputs(ts, leaves[3], leaves[4], n, query_timestamps=tq)
    expect = ops.attention(*leaves[:3], off, n, activation=activation, rel_bias=rel_ref,
                           backend=ops.AttentionBackend.REFERENCE)
    assert _rel(out, expect) < 2e-2
    do = torch.randn_like(expect)
    grads = torch.autograd.grad(out, (q, k, v, pos_w, ts_w), do.to(out.dtype))
    # d pos_w / d ts_w sum millions of bf16-rounded dS terms (softmax: row sums cancel): a looser bound
    for name, gk, gr, tol in zip("qkvpt", grads, torch.autograd.grad(expect, leaves, do),
                                 (3e-2, 3e-2, 3e-2, 5e-2, 5e-2)):
        assert gr.norm() > 0 and _rel(gk, gr) < tol, f"d{name} rel err {_rel(gk, gr):.2e}"


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_gpu_rel_bias_grads_are_bit_reproducible(activation):
    """Two backward calls on the same inputs give the same bits for every gradient, d pos_w / d ts_w included: the
    dQ programs write their per-bucket sums to rows the host adds up in order (fp32 atomics, as before, summed in
    the programs' finishing order: a different last bit from run to run, which a 12-epoch run amplified). ML-1M-like
    shape: 128 sequences up to 200 long, H=2, D=25, P=128, NT=64, bf16."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 201, (128,), generator=g).tolist()
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 2, 25, 9, device="cuda", dtype=torch.bfloat16,
                                              n_pos=128, n_time=64)
    tq = query_timestamps(ts, off)
    do = torch.randn(q.shape, generator=g).to(device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(5):
        rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, 200, query_timestamps=tq)
        out = ops.attention(q, k, v, off, 200, activation=activation, rel_bias=rel,
                            backend=ops.AttentionBackend.TRITON)
        runs.append(torch.autograd.grad(out, (q, k, v, pos_w, ts_w), do))
    for other in runs[1:]:
        for name, a, b in zip("qkvpt", runs[0], other):
            assert torch.equal(a, b), f"d{name} differs between two identical backward calls"


@cpu_only
def test_rel_bias_grads_are_per_program_rows_summed_in_order(monkeypatch):
    """The backward plan holds one d pos_w / d ts_w row per dQ program (grid items x heads) and the weights'
    gradients are exactly the in-order sums of those rows: nothing is added with atomics."""
    lengths = [37, 1, 80, 0, 19]
    off, (q, k, v), ts, pos_w, ts_w = _inputs(lengths, 2, 16, 4)
    tq = query_timestamps(ts, off)
    rows = []
    real_sum = torch.Tensor.sum

    def spy_sum(t, *a, **kw):  # the host's reduction of the rows
        if t.dim() == 2 and a == (0,) and t.shape[1] in (ja._pad_buckets(N_POS), ja._pad_buckets(N_TIME)):
            rows.append(t.clone())
        return real_sum(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "sum", spy_sum)
    rel = ops.RelativeBiasInputs(ts, pos_w, ts_w, 80, query_timestamps=tq)
    out = ops.attention(q, k, v, off, 80, activation="silu", rel_bias=rel, backend=ops.AttentionBackend.TRITON)
    dpw, dtw = torch.autograd.grad(out, (pos_w, ts_w), torch.randn_like(out))
    monkeypatch.undo()
    assert len(rows) == 2
    p_rows, t_rows = rows
    n_prog = p_rows.shape[0]
    assert n_prog == t_rows.shape[0] and n_prog >= 2 * (1 + 80 // 64)  # programs of every sequence and head
    assert (p_rows != 0).any(1).sum() > 1  # several programs contributed
    assert torch.equal(dpw, p_rows.sum(0)[:N_POS]) and torch.equal(dtw, t_rows.sum(0)[:N_TIME])
    assert not p_rows[:, N_POS:].any() and not t_rows[:, N_TIME:].any()  # the padding buckets stay empty


@cpu_only
def test_hstu_encoder_triton_equals_reference_and_builds_no_buckets(monkeypatch):
    """HSTUEncoder (2 blocks, next-item query times) on the Triton backend equals the same weights on the reference
    backend, output and every parameter's gradient (the per-block pos_w / ts_w included); the Triton encoder never
    calls ops.relative_bias_buckets (its [B, n, n] indices)."""
    from gemray.config import ModelConfig
    from gemray.model.hstu import HSTUEncoder

    lengths = [12, 0, 1, 7]
    off = _offsets(lengths)
    t = int(off[-1])
    g = torch.Generator().manual_seed(4)
    ts = 1_000_000_000 + torch.cumsum(torch.exp(torch.rand(t, generator=g) * 14).long(), 0)
    tq = query_timestamps(ts, off)
    tok = torch.randn(t, 16, generator=g)
    encs = {}
    for backend in ("reference", "triton"):
        cfg = ModelConfig(embedding_dim=16, num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0,
                          num_position_buckets=8, num_time_buckets=64, attention_backend=backend)
        torch.manual_seed(0)
        encs[backend] = HSTUEncoder(cfg, max_seq_len=12)
        with torch.no_grad():
            for blk in encs[backend].blocks:  # bias weights far from their 0.02 init so that they matter
                blk.rel_bias.pos_w.copy_(torch.linspace(-1, 1, 8))
                blk.rel_bias.ts_w.copy_(torch.sin(torch.arange(64.0)))
    ref_out = encs["reference"](tok, off, ts, tq)
    ref_out.sum().backward()

    def boom(*a, **kw):
        raise AssertionError("bucket indices built on the Triton path")

    monkeypatch.setattr(ops, "relative_bias_buckets", boom)
    out = encs["triton"](tok, off, ts, tq)
    out.sum().backward()
    assert _rel(out, ref_out) < 1e-5
    for (name, p), (_, pr) in zip(encs["triton"].named_parameters(), encs["reference"].named_parameters()):
        assert pr.grad is not None and _rel(p.grad, pr.grad) < 1e-4, name
