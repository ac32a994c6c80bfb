"""kernels.reference.jagged_attention_ref against a per-sequence Python loop (forward and gradients)."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from gemray.jagged import lengths_to_offsets
from gemray.kernels.reference import (jagged_attention_grouped_ref, jagged_attention_ref, length_groups, position_bucket_ref, relative_bias_ref,
                                      time_bucket_ref, valid_attn_mask_ref)
from gemray import ops


def loop_attention(q, k, v, offsets, max_len, activation, causal, bias, alpha, num_targets):
    """One sequence at a time, masks spelled out pair by pair."""
    outs = []
    H, D = q.shape[1], q.shape[2]
    if alpha is None:
        alpha = 1 / math.sqrt(D) if activation == "softmax" else 1.0
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        L = e - s
        if L == 0:
            continue
        nt = int(num_targets[b]) if num_targets is not None else 0
        mask = torch.zeros(L, L, dtype=torch.bool)
        for i in range(L):
            for j in range(L):
                if i == j:
                    ok = True
                elif nt and i >= L - nt and j >= L - nt:
                    ok = False  # targets don't see each other
                elif nt and j >= L - nt:
                    ok = not causal  # history sees targets only without causality (as generative-recommenders)
                else:
                    ok = (j < i) if causal else True
                mask[i, j] = ok
        for_heads = []
        for h in range(H):
            logits = alpha * q[s:e, h] @ k[s:e, h].T
            if bias is not None:
                logits = logits + (bias[b, :L, :L] if bias.dim() == 3 else bias[b, h, :L, :L])
            if activation == "softmax":
                a = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
            else:
                f = {"silu": F.silu, "gelu": F.gelu, "none": lambda x: x}[activation]
                a = f(logits) / max_len * mask
            for_heads.append(a @ v[s:e, h])
        outs.append(torch.stack(for_heads, 1))
    return torch.cat(outs) if outs else v * 0


def make_batch(lengths, H=2, Dqk=5, Dv=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    offsets = lengths_to_offsets(lengths)
    T = int(offsets[-1])
    q = torch.randn(T, H, Dqk, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(T, H, Dqk, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(T, H, Dv, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v, offsets, g


CASES = [
    [3, 0, 1, 12, 5],      # empty, length-1 and a max-length sequence (max_len=12)
    [1],
    [12, 12],
    [0, 7, 2, 0, 9, 1, 4],
]


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("activation", ["silu", "softmax", "gelu", "none"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bias_kind", [None, "shared", "per_head"])
def test_matches_loop_fwd_bwd(lengths, activation, causal, bias_kind):
    max_len = 12
    q, k, v, offsets, g = make_batch(lengths, seed=len(lengths) * 7 + len(activation))
    B, H = len(lengths), q.shape[1]
    bias = None
    if bias_kind == "shared":
        bias = torch.randn(B, max_len, max_len, generator=g, dtype=q.dtype, requires_grad=True)
    elif bias_kind == "per_head":
        bias = torch.randn(B, H, max_len, max_len, generator=g, dtype=q.dtype, requires_grad=True)
    alpha = 0.7 if activation != "softmax" else None
    inputs = [q, k, v] + ([bias] if bias is not None else [])

    out = jagged_attention_ref(q, k, v, offsets, max_len, activation=activation, causal=causal,
                               attn_bias=bias, alpha=alpha)
    exp = loop_attention(q, k, v, offsets, max_len, activation, causal, bias, alpha, None)
    assert out.shape == (q.shape[0], H, v.shape[2])
    torch.testing.assert_close(out, exp, rtol=1e-10, atol=1e-12)
    assert out.abs().sum() > 0

    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    g1 = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
    g2 = torch.autograd.grad((exp * w).sum(), inputs, allow_unused=True)
    for a, b in zip(g1, g2):
        if b is None:
            continue
        assert a is not None and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_num_targets(causal, activation):
    lengths = [5, 1, 0, 8, 3]
    q, k, v, offsets, g = make_batch(lengths, seed=3)
    nt = torch.tensor([2, 1, 0, 3, 0])
    out = jagged_attention_ref(q, k, v, offsets, 8, activation=activation, causal=causal, num_targets=nt)
    exp = loop_attention(q, k, v, offsets, 8, activation, causal, None, None, nt)
    torch.testing.assert_close(out, exp, rtol=1e-10, atol=1e-12)
    ga = torch.autograd.grad(out.square().sum(), [q, k, v])
    gb = torch.autograd.grad(exp.square().sum(), [q, k, v])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_many_length_groups_match_loop(activation):
    # 40 sequences -> several length groups (min_group 16 -> 2 groups; min_group 4 -> 8 groups)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 13, (40,), generator=g)
    lengths[3], lengths[7] = 12, 1
    q, k, v, offsets, g = make_batch(lengths.tolist(), seed=9)
    bias = torch.randn(40, 12, 12, generator=g, dtype=q.dtype, requires_grad=True)
    nt = torch.minimum(lengths, torch.randint(0, 3, (40,), generator=g))
    exp = loop_attention(q, k, v, offsets, 12, activation, True, bias, None, nt)
    gb = torch.autograd.grad(exp.square().sum(), [q, k, v, bias])
    for min_group in (16, 4, 1):
        alpha = 1 / math.sqrt(5) if activation == "softmax" else 1.0
        bias_fn = lambda seqs, m: bias[:, :m, :m][seqs].unsqueeze(1)  # noqa: E731
        out = jagged_attention_grouped_ref(q, k, v, offsets, 12, activation=activation, causal=True,
                                           alpha=alpha, num_targets=nt, bias_fn=bias_fn, min_group=min_group)
        torch.testing.assert_close(out, exp, rtol=1e-10, atol=1e-12)
        ga = torch.autograd.grad(out.square().sum(), [q, k, v, bias])
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert len(length_groups(lengths, 4)) >= 7


def test_causal_output_ignores_future_tokens():
    q, k, v, offsets, _ = make_batch([6], seed=1)
    out = jagged_attention_ref(q, k, v, offsets, 6)
    v2 = v.detach().clone()
    v2[4:] += 5.0
    out2 = jagged_attention_ref(q, k, v2, offsets, 6)
    torch.testing.assert_close(out[:4], out2[:4])
    assert not torch.allclose(out[4:], out2[4:])


def test_empty_batch_keeps_graph():
    q, k, v, offsets, _ = make_batch([], seed=0)
    bias = torch.zeros(0, 4, 4, dtype=q.dtype, requires_grad=True)
    out = jagged_attention_ref(q, k, v, offsets, 4, attn_bias=bias)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert all(t.grad is not None for t in (q, k, v, bias))


def test_all_empty_sequences():
    q, k, v, offsets, _ = make_batch([0, 0, 0])
    out = jagged_attention_ref(q, k, v, offsets, 4)
    assert out.shape == (0, 2, 3)


def test_bad_inputs_raise():
    q, k, v, offsets, _ = make_batch([3, 2])
    with pytest.raises(ValueError, match="max_len"):
        jagged_attention_ref(q, k, v, offsets, 2)
    with pytest.raises(ValueError, match="activation"):
        jagged_attention_ref(q, k, v, offsets, 4, activation="relu")
    with pytest.raises(ValueError, match="offsets"):
        jagged_attention_ref(q, k, v, offsets.int(), 4)
    with pytest.raises(ValueError, match="attn_bias"):
        jagged_attention_ref(q, k, v, offsets, 4, attn_bias=torch.zeros(2, 2, 2, dtype=q.dtype))
    with pytest.raises(ValueError, match="num_targets"):
        jagged_attention_ref(q, k, v, offsets, 4, num_targets=torch.tensor([4, 0]))
    with pytest.raises(ValueError, match=r"offsets\[0\] must be 0, got 1"):
        jagged_attention_ref(q, k, v, torch.tensor([1, 3, 5]), 4)
    with pytest.raises(ValueError, match="must not decrease: sequence 1 has length -1"):
        jagged_attention_ref(q, k, v, torch.tensor([0, 6, 5]), 8)  # was "repeats can not be negative"
    with pytest.raises(ValueError, match="offsets.*!= T"):
        jagged_attention_ref(q, k, v, torch.tensor([0, 3, 4]), 4)


def test_float32_matches_float64():
    q, k, v, offsets, _ = make_batch([7, 1, 0, 4], dtype=torch.float64)
    o64 = jagged_attention_ref(q, k, v, offsets, 8)
    o32 = jagged_attention_ref(q.float(), k.float(), v.float(), offsets, 8)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, rtol=1e-5, atol=1e-6)


def test_mask_by_hand():
    # one sequence of 4 with 2 targets (positions 2, 3), padded to 5:
    # row 0: {0}; row 1: {0,1}; row 2 (target): {0,1,2}; row 3 (target): {0,1,3}; row 4 (padding): {4}
    m = valid_attn_mask_ref(torch.tensor([4]), 5, causal=True, num_targets=torch.tensor([2]))[0]
    exp = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0],
                        [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(m, exp)


def test_buckets_and_relative_bias():
    # time buckets: floor(ln(max(|s|,1)) / 0.301): 0 s -> 0, 1 s -> 0, 2 s -> 2 (ln2=0.693), 1 day -> 37
    tb = time_bucket_ref(torch.tensor([0, 1, -2, 86400, 10**12]), 64)
    assert tb.tolist() == [0, 0, 2, 37, 63]
    # positions: exact below 4 (num_buckets 8 // 2), then log-spaced up to max_len 64, monotone
    pb = position_bucket_ref(torch.arange(0, 100), 8, 64)
    assert pb[:4].tolist() == [0, 1, 2, 3] and int(pb.max()) == 7
    assert bool((pb[1:] >= pb[:-1]).all())
    assert position_bucket_ref(torch.tensor([-5, 5]), 200, 200).tolist() == [5, 5]

    offsets = torch.tensor([0, 3, 3, 5])
    ts = torch.tensor([100, 100, 186500, 7, 8])
    pw = torch.arange(8, dtype=torch.float64) / 10
    tw = torch.arange(64, dtype=torch.float64) * 100
    bias = relative_bias_ref(ts, offsets, 3, pw, tw, 64)
    assert bias.shape == (3, 3, 3)
    # seq 0: (2,0): |2-0| -> pos bucket 2 (0.2); 186400 s -> floor(ln(186400)/0.301)=40 -> 4000
    assert bias[0, 2, 0].item() == pytest.approx(0.2 + 100 * int(math.log(186400) / 0.301))
    assert bias[0, 1, 0].item() == pytest.approx(0.1)   # same timestamp: bucket 0
    assert bias[2, 1, 0].item() == pytest.approx(0.1)   # 1 s apart: bucket 0


def test_ops_dispatch_reference_and_forced_triton():
    """AUTO on CPU tensors runs the reference; an unknown backend raises; TRITON on CPU tensors runs Triton's
    interpreter when it is on (TRITON_INTERPRET=1 when triton was imported) and otherwise raises saying why."""
    q, k, v, offsets, _ = make_batch([3, 0, 2])
    want = jagged_attention_ref(q, k, v, offsets, 4)
    torch.testing.assert_close(ops.attention(q, k, v, offsets, 4, backend="auto"), want)
    torch.testing.assert_close(ops.attention(q, k, v, offsets, 4, backend=ops.AttentionBackend.REFERENCE), want)
    assert ops.resolve_backend("auto", torch.device("cpu")) is ops.AttentionBackend.REFERENCE
    with pytest.raises(ValueError, match="backend"):
        ops.attention(q, k, v, offsets, 4, backend="cuda")
    mod, err = ops._triton_module()
    if mod is not None and mod.interpreting():
        out = ops.attention(q.float(), k.float(), v.float(), offsets, 4, backend=ops.AttentionBackend.TRITON)
        torch.testing.assert_close(out, want.float(), rtol=1e-4, atol=1e-5)
    else:
        with pytest.raises(RuntimeError, match="tensors are on cpu|not importable"):
            ops.attention(q, k, v, offsets, 4, backend="triton")

def test_ops_rel_bias_ingredients_equal_dense_bias():
    q, k, v, offsets, g = make_batch([3, 0, 4])
    ts = torch.tensor([5, 9, 900, 1, 2, 3000, 3001])
    pw = torch.randn(6, generator=g, dtype=q.dtype, requires_grad=True)
    tw = torch.randn(16, generator=g, dtype=q.dtype, requires_grad=True)
    rb = ops.RelativeBiasInputs(ts, pw, tw, max_len=4)
    a = ops.attention(q, k, v, offsets, 4, rel_bias=rb, backend="reference")
    b = ops.attention(q, k, v, offsets, 4, attn_bias=relative_bias_ref(ts, offsets, 4, pw, tw, 4))
    torch.testing.assert_close(a, b)
    ga = torch.autograd.grad(a.square().sum(), [pw, tw, q])
    gb = torch.autograd.grad(b.square().sum(), [pw, tw, q])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)
    assert ga[1].abs().sum() > 0
    # precomputed buckets give the same bias and gradients (bincount backward)
    bk = ops.relative_bias_buckets(ts, offsets, 4, 6, 16, 4)
    dense = ops.RelativeBiasInputs(ts, pw, tw, 4, bk).dense(offsets, 4)
    torch.testing.assert_close(dense, relative_bias_ref(ts, offsets, 4, pw, tw, 4))
    w = torch.randn(dense.shape, dtype=dense.dtype)
    g1 = torch.autograd.grad((dense * w).sum(), [pw, tw])
    g2 = torch.autograd.grad((relative_bias_ref(ts, offsets, 4, pw, tw, 4) * w).sum(), [pw, tw])
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y)
    with pytest.raises(ValueError, match="not both"):
        ops.attention(q, k, v, offsets, 4, rel_bias=rb, attn_bias=torch.zeros(3, 4, 4))


def test_backend_enum_and_choice_rules():
    """AttentionBackend parses its members and their config strings only; choose_backend (the pure rule behind
    resolve_backend): AUTO takes Triton on CUDA when the kernels import (never the CPU interpreter), else the
    reference with the reason; an explicit TRITON that cannot run raises with the reason; REFERENCE always runs."""
    B = ops.AttentionBackend
    assert [B.parse(x) for x in ("auto", "triton", "reference", B.TRITON)] == [B.AUTO, B.TRITON, B.REFERENCE, B.TRITON]
    assert ops.BACKENDS == ("auto", "triton", "reference")
    for bad in ("cuda", None, 1, "Triton"):
        with pytest.raises(ValueError, match="backend"):
            B.parse(bad)
    choose = ops.choose_backend
    assert choose(B.AUTO, "cuda", None, False) == (B.TRITON, "the tensors are on cuda")
    assert choose(B.AUTO, "cuda", "triton is not importable (x)", False) == (B.REFERENCE, "triton is not importable (x)")
    assert choose(B.AUTO, "cpu", None, True)[0] is B.REFERENCE
    assert choose(B.AUTO, "cpu", None, False) == (B.REFERENCE, 'the tensors are on cpu, and "auto" takes Triton on '
                                                               "cuda only")
    assert choose(B.REFERENCE, "cuda", None, False) == (B.REFERENCE, "")  # an explicit value needs no reason
    assert choose(B.TRITON, "cuda", None, False) == (B.TRITON, "")
    assert choose(B.TRITON, "cpu", None, True)[0] is B.TRITON  # the interpreter takes CPU tensors
    with pytest.raises(RuntimeError, match="not importable"):
        choose(B.TRITON, "cuda", "gemray.kernels.jagged_attention is not importable (no triton)", False)
    with pytest.raises(RuntimeError, match="tensors are on cpu.*TRITON_INTERPRET"):
        choose(B.TRITON, "cpu", None, False)
    with pytest.raises(RuntimeError, match="tensors are on cuda"):
        choose(B.TRITON, "cuda", None, True)


def test_backend_choice_is_logged_once(caplog):
    """Each (op, backend, device type) is logged once, naming the setting, its value and what "auto" saw; a value
    taken as given (the retrieval kernel's default "reference" included) is not said to be "requested" (the line
    was "(reference: requested)" for a setting the user never wrote)."""
    ops._CHOSEN.clear()
    with caplog.at_level(logging.INFO, logger="gemray.ops"):
        for _ in range(3):
            assert ops.resolve_backend("auto", torch.device("cpu")) is ops.AttentionBackend.REFERENCE
            chosen = ops.resolve_sampled_softmax_backend("reference", torch.device("cpu"))
            assert chosen is ops.AttentionBackend.REFERENCE
    lines = [r.getMessage() for r in caplog.records if r.name == "gemray.ops"]
    assert lines == ['gemray.ops.attention: reference backend on cpu (model.attention_backend = "auto": the tensors '
                     'are on cpu, and "auto" takes Triton on cuda only)',
                     'gemray.ops.sampled_softmax_lse: reference backend on cpu (model.retrieval_kernel = "reference")']
    B = ops.AttentionBackend
    assert (ops.choice_message("attention", B.AUTO, "cuda", B.TRITON, "the tensors are on cuda") ==
            'gemray.ops.attention: triton backend on cuda (model.attention_backend = "auto": the tensors are on cuda)')
    assert (ops.choice_message("attention", B.TRITON, "cuda", B.TRITON, "")
            == 'gemray.ops.attention: triton backend on cuda (model.attention_backend = "triton")')
    assert "requested" not in " ".join(lines)


def test_dense_relative_bias_and_the_triton_ingredients():
    """RelativeBiasInputs.dense: [B, n, n] equal to relative_bias_ref, from precomputed buckets of a wider n too,
    differentiable in the weights. The Triton path takes no dense bias: ops._triton_rel_bias hands the kernels the
    ingredients (query times = query_timestamps, else the keys' own timestamps; int64, contiguous; the weights
    themselves, so their gradients flow)."""
    _, _, _, offsets, g = make_batch([3, 0, 4])
    ts = torch.tensor([5, 9, 900, 1, 2, 3000, 3001])
    pw = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    tw = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    plain = ops.RelativeBiasInputs(ts, pw, tw, 4).dense(offsets, 4)
    torch.testing.assert_close(plain, relative_bias_ref(ts, offsets, 4, pw, tw, 4))
    bk = ops.relative_bias_buckets(ts, offsets, 6, 6, 16, 4)  # buckets for n = 6 > the longest (4)
    wide = ops.RelativeBiasInputs(ts, pw, tw, 4, bk).dense(offsets, 6)
    assert wide.shape == (3, 6, 6)
    torch.testing.assert_close(wide[:, :4, :4], plain)
    assert torch.autograd.grad(wide.sum(), tw)[0].abs().sum() > 0
    mod, err = ops._triton_module()
    if mod is None:
        pytest.skip(err)
    rb = ops._triton_rel_bias(mod, ops.RelativeBiasInputs(ts.int(), pw, tw, 4))
    assert torch.equal(rb.query_times, ts) and torch.equal(rb.key_times, ts) and rb.key_times.dtype == torch.int64
    assert rb.pos_w is pw and rb.ts_w is tw and rb.max_len == 4
    tq = ts + 7
    rb = ops._triton_rel_bias(mod, ops.RelativeBiasInputs(ts, pw, tw, 4, bk, query_timestamps=tq))
    assert torch.equal(rb.query_times, tq) and torch.equal(rb.key_times, ts)
