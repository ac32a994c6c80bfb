"""The fused sampled-softmax kernels (gemray.kernels.sampled_softmax) against the reference and the head.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set below when no CUDA device is present), float32, relative error
(max |a - b| / max |b|) of the lse and of every gradient (dh, dpos, de_neg) < 1e-4 against a float64 reference.
Batches have sequences with 0 rows (empty and length-1 histories), one much longer than the rest, tiles that
divide neither R nor the row counts, negatives equal to the target (masked) and a row whose negatives are all
masked (lse = pos / temperature). ``test_tolerance_catches_broken_variants`` shows the bound is tight enough to
fail a kernel that forgot the mask, the last partial R chunk or 0.1 % of the temperature.
GPU (@pytest.mark.gpu): GEM shapes (B = 128, R = 512, E = 64, histories up to 4096) in fp32 and bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gemray import ops  # noqa: E402
from gemray.config import ModelConfig  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.kernels.sampled_softmax import sampled_softmax_lse_triton  # noqa: E402
from gemray.jagged import next_item_index  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU tests need TRITON_INTERPRET=1")
TEMP = 0.05
TOL = 1e-4
# rows per sequence: two sequences without rows, one row, one much longer sequence (several 16-row tiles)
ROWS = [0, 3, 0, 37, 1, 20, 0]


def _head_cls():
    """gemray.model.heads.RetrievalHead, imported on use: gemray.model needs TorchRec, which the kernel-only GPU
    test does not (the lent GPU machine has no TorchRec / FBGEMM unless staged)."""
    from gemray.model.heads import RetrievalHead

    return RetrievalHead


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _case(rows, R=40, E=24, num_ids=8, seed=0, device="cpu", dtype=torch.float32):
    """Random inputs: few distinct ids, so many negatives equal their row's target; sequence 1's negatives are all
    one id and its row 0 targets it (every negative masked)."""
    g = torch.Generator().manual_seed(seed)
    B, M = len(rows), sum(rows)
    row_offsets = torch.tensor([0] + list(rows)).cumsum(0)
    h = F.normalize(torch.randn(M, E, generator=g), dim=-1)
    e_neg = F.normalize(torch.randn(B, R, E, generator=g), dim=-1)
    pos = (h * F.normalize(torch.randn(M, E, generator=g), dim=-1)).sum(-1)
    neg_ids = torch.randint(1, num_ids + 1, (B, R), generator=g)
    target_ids = torch.randint(1, num_ids + 1, (M,), generator=g)
    if B > 1 and rows[1] > 0:
        neg_ids[1] = 5
        target_ids[row_offsets[1]] = 5
    grad = torch.randn(M, generator=g)
    cast = dict(device=device)
    return (h.to(dtype).to(**cast), pos.to(**cast), e_neg.to(dtype).to(**cast), neg_ids.to(**cast),
            target_ids.to(**cast), row_offsets.to(**cast), max(rows, default=0), grad.to(**cast))


def _run(fn, h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, grad, **kw):
    h, pos, e_neg = (x.detach().clone().requires_grad_() for x in (h, pos, e_neg))
    lse = fn(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, TEMP, **kw)
    dh, dpos, de = torch.autograd.grad(lse, (h, pos, e_neg), grad, allow_unused=True)
    return lse.detach(), dh, dpos, de


def _ref64(h, pos, e_neg, *rest):
    return _run(ref.sampled_softmax_lse_ref, h.double(), pos.double(), e_neg.double(), *rest)


@cpu_only
@pytest.mark.parametrize("block_m,block_r", [(16, 32), (32, 16), (16, 16), (64, 64)])
def test_triton_matches_reference(block_m, block_r):
    case = _case(ROWS)
    got = _run(sampled_softmax_lse_triton, *case, block_m=block_m, block_r=block_r)
    want = _ref64(*case)
    for name, a, b in zip(("lse", "dh", "dpos", "de"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert _rel(a, b) < TOL, (name, _rel(a, b))
    # the fp32 reference (the CPU path) agrees as well
    for a, b in zip(_run(ref.sampled_softmax_lse_ref, *case), want):
        assert _rel(a, b) < TOL


@cpu_only
def test_masking_all_masked_row_and_zero_rows():
    h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, grad = case = _case(ROWS)
    same = neg_ids[torch.repeat_interleave(torch.arange(len(ROWS)), torch.tensor(ROWS))] == target_ids[:, None]
    assert same.any(1).float().mean() > 0.5  # many rows have a masked negative
    lse, dh, dpos, de = _run(sampled_softmax_lse_triton, *case, block_m=16, block_r=16)
    i = int(row_offsets[1])  # every negative of this row is its target
    assert bool(same[i].all())
    torch.testing.assert_close(lse[i], pos[i] / TEMP, rtol=1e-6, atol=0)
    torch.testing.assert_close(dpos[i], grad[i] / TEMP, rtol=1e-6, atol=0)
    assert float(dh[i].abs().max()) == 0.0
    # negatives of sequences without rows get no gradient
    for b in (0, 2, 6):
        assert float(de[b].abs().max()) == 0.0
    # unmasking changes the result (the mask is exercised)
    other = _run(sampled_softmax_lse_triton, h, pos, e_neg, neg_ids, torch.zeros_like(target_ids), row_offsets,
                 max_rows, grad)[0]
    assert _rel(other, lse) > 1e-2


@cpu_only
def test_no_rows():
    for rows in ([], [0, 0, 0]):
        case = _case(rows)
        lse, dh, dpos, de = _run(sampled_softmax_lse_triton, *case)
        assert lse.shape == (0,) and dh.shape == (0, 24) and dpos.shape == (0,)
        assert de.shape == (len(rows), 40, 24) and float(de.abs().sum()) == 0.0


@cpu_only
def test_tolerance_catches_broken_variants():
    """What a kernel bug would look like, through the same comparison: each fails the 1e-4 bound."""
    h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, grad = case = _case(ROWS)
    want = _ref64(*case)
    no_mask = _run(sampled_softmax_lse_triton, h, pos, e_neg, neg_ids, torch.zeros_like(target_ids), row_offsets,
                   max_rows, grad)
    short = _run(sampled_softmax_lse_triton, h, pos, e_neg[:, :-8].contiguous(), neg_ids[:, :-8].contiguous(),
                 target_ids, row_offsets, max_rows, grad, block_r=16)  # R = 32: the partial chunk dropped
    lse_t = sampled_softmax_lse_triton(h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, TEMP * 1.001)
    assert _rel(no_mask[0], want[0]) > TOL and _rel(no_mask[1], want[1]) > TOL
    assert _rel(short[0], want[0]) > TOL and _rel(short[1], want[1]) > TOL
    assert _rel(lse_t, want[0]) > TOL


@cpu_only
def test_backward_deterministic_and_opcheck():
    case = _case(ROWS, R=20, E=16)
    a = _run(sampled_softmax_lse_triton, *case, block_m=16, block_r=16)
    b = _run(sampled_softmax_lse_triton, *case, block_m=16, block_r=16)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    h, pos, e_neg, neg_ids, target_ids, row_offsets, max_rows, _ = case
    torch.library.opcheck(torch.ops.gemray.sampled_softmax_lse.default,
                          (h.requires_grad_(), pos.requires_grad_(), e_neg.requires_grad_(), neg_ids, target_ids,
                           row_offsets, max_rows, TEMP, 16, 16),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_dispatch_rules():
    assert ops.resolve_sampled_softmax_backend("auto", torch.device("cpu")) is ops.AttentionBackend.REFERENCE
    assert ops.resolve_sampled_softmax_backend("reference", torch.device("cpu")) is ops.AttentionBackend.REFERENCE
    if INTERPRET:
        assert ops.resolve_sampled_softmax_backend("triton", torch.device("cpu")) is ops.AttentionBackend.TRITON
    with pytest.raises(ValueError):
        ops.resolve_sampled_softmax_backend("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="retrieval_kernel"):
        _head_cls()("uniform_shared", 4, TEMP, kernel="fast")
    with pytest.raises(ValueError, match="retrieval_kernel"):
        ModelConfig(retrieval_kernel="fast").validate()
    ModelConfig(retrieval_kernel="triton").validate()
    # the padded path stays the default until the fused kernel has run on a GPU
    assert _head_cls()("uniform_shared", 4, TEMP).kernel == "reference" and ModelConfig().retrieval_kernel == "reference"
    case = _case(ROWS)
    got = ops.sampled_softmax_lse(*case[:7], TEMP, backend="reference")
    torch.testing.assert_close(got, ref.sampled_softmax_lse_ref(*case[:7], TEMP), rtol=0, atol=0)


def _head_batch(lengths, R=40, D=24, num_ids=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(lengths)).cumsum(0)
    T, B = int(offsets[-1]), len(lengths)
    states = F.normalize(torch.randn(T, D, generator=g), dim=-1)
    item_ids = torch.randint(1, num_ids + 1, (T,), generator=g)
    item_emb = torch.randn(T, D, generator=g)
    neg_ids = torch.randint(1, num_ids + 1, (B, R), generator=g)
    neg_emb = torch.randn(B * R, D, generator=g)
    return states, offsets, item_ids, item_emb, neg_ids, neg_emb


def _head_loss_grads(kernel, states, offsets, item_ids, item_emb, neg_ids, neg_emb, max_len, num_next):
    xs = [x.clone().requires_grad_() for x in (states, item_emb, neg_emb)]
    head = _head_cls()("uniform_shared", neg_ids.shape[1], TEMP, kernel=kernel)
    loss, stats = head(xs[0], offsets, item_ids, xs[1], neg_ids, xs[2], max_len=max_len, num_next=num_next)
    return (loss.detach(), *torch.autograd.grad(loss, xs)), stats


@cpu_only
@pytest.mark.parametrize("host_ints", [True, False])
def test_head_triton_matches_current_head(host_ints):
    lengths = [0, 1, 2, 9, 38, 1, 0, 17]  # empty and length-1 sequences (0 rows), one long one
    batch = _head_batch(lengths)
    max_len = max(lengths) if host_ints else None
    num_next = sum(max(n - 1, 0) for n in lengths) if host_ints else None
    got, s1 = _head_loss_grads("triton", *batch, max_len, num_next)
    want, s2 = _head_loss_grads("reference", *batch, max_len, num_next)
    for name, a, b in zip(("loss", "d states", "d item_emb", "d neg_emb"), got, want):
        assert _rel(a, b) < TOL, (name, _rel(a, b))
    has_next = torch.zeros(batch[0].shape[0], dtype=torch.bool)
    has_next[next_item_index(batch[1])] = True
    assert bool((got[1][has_next].abs().sum(1) > 0).all()) and float(got[1][~has_next].abs().max()) == 0.0
    torch.testing.assert_close(s1["num_targets"], s2["num_targets"])
    torch.testing.assert_close(s1["pos_logit"], s2["pos_logit"])
    # no position has a next item: loss 0, every input still in the graph
    got0, _ = _head_loss_grads("triton", *_head_batch([1, 0, 1]), 1, 0)
    assert float(got0[0]) == 0.0 and all(float(g.abs().sum()) == 0.0 for g in got0[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gem_shapes_cuda(dtype):
    g = torch.Generator().manual_seed(0)
    B, R, E = 128, 512, 64
    lengths = torch.exp(torch.randn(B, generator=g) * 1.2 + 6.0).clamp(2, 4096).long()
    lengths[0], lengths[1], lengths[2] = 4096, 1, 0
    rows = (lengths - 1).clamp(min=0).tolist()
    case = _case(rows, R=R, E=E, num_ids=2000, device="cuda", dtype=dtype)
    got = _run(sampled_softmax_lse_triton, *case)
    h, pos, e_neg, *rest = case
    want = _run(ref.sampled_softmax_lse_ref, h.float(), pos, e_neg.float(), *rest)
    tol = {"lse": 1e-5, "grad": 1e-4} if dtype == torch.float32 else {"lse": 1e-4, "grad": 2e-2}
    assert _rel(got[0], want[0]) < tol["lse"], _rel(got[0], want[0])
    for name, a, b in zip(("dh", "dpos", "de"), got[1:], want[1:]):
        assert _rel(a, b) < tol["grad"], (name, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gem_shapes_head_cuda():
    """The head at GEM shapes: the kernel against the padded-bmm path (needs TorchRec and FBGEMM)."""
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    g = torch.Generator().manual_seed(0)
    B, R, E = 128, 512, 64
    lengths = torch.exp(torch.randn(B, generator=g) * 1.2 + 6.0).clamp(2, 4096).long()
    lengths[0], lengths[1], lengths[2] = 4096, 1, 0
    lens = lengths.tolist()
    batch = [x.cuda() for x in _head_batch(lens, R=R, D=E, num_ids=2000)]
    args = (max(lens), sum(max(n - 1, 0) for n in lens))
    a, _ = _head_loss_grads("triton", *batch, *args)
    b, _ = _head_loss_grads("reference", *batch, *args)
    for name, x, y in zip(("loss", "d states", "d item_emb", "d neg_emb"), a, b):
        assert _rel(x, y) < 1e-4, (name, _rel(x, y))


@cpu_only
def test_head_compiles_fullgraph():
    """torch.compile traces the head's kernel path as one graph (the custom op's fake impl and autograd)."""
    lengths = [0, 1, 5, 12, 3]
    states, offsets, item_ids, item_emb, neg_ids, neg_emb = _head_batch(lengths, R=24, D=16)
    head = _head_cls()("uniform_shared", 24, TEMP, kernel="triton")
    host = dict(max_len=max(lengths), num_next=sum(max(n - 1, 0) for n in lengths))

    def loss_fn(s, ie, ne):
        return head(s, offsets, item_ids, ie, neg_ids, ne, **host)[0]

    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (loss_fn, compiled):
        xs = [x.clone().requires_grad_() for x in (states, item_emb, neg_emb)]
        loss = fn(*xs)
        results.append((loss.detach(), *torch.autograd.grad(loss, xs)))
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-6


def test_float32_products_by_device(monkeypatch):
    """float32 products: tf32x3 on the tensor cores from Ampere on (and in the interpreter), "ieee" with the small
    tile before it (no TF32 tensor cores; larger fp32 tiles spill on the CUDA cores); 16-bit: Triton's default."""
    from gemray.kernels import sampled_softmax as ssm

    cuda0 = torch.device("cuda", 0)
    for cap, want in (((7, 5), "ieee"), ((8, 0), "tf32x3"), ((9, 0), "tf32x3")):
        monkeypatch.setattr(ssm, "_capability", lambda index, cap=cap: cap)
        assert ssm._dot_prec(torch.float32, cuda0) == want, cap
        assert ssm._dot_prec(torch.bfloat16, cuda0) is None
    assert ssm._dot_prec(torch.float32, torch.device("cpu")) == ssm._dot_prec(torch.float32) == "tf32x3"
    assert ssm._tile("dh", 0, 0, torch.float32, "ieee") == ssm.IEEE_TILE == (32, 32, 4)
    assert ssm._tile("dh", 0, 0, torch.float32, "tf32x3") == ssm.DEFAULT_TILES[torch.float32]["dh"]
    assert ssm._tile("de", 64, 0, torch.float32, "tf32x3") == (64, ssm.DEFAULT_TILES[torch.float32]["de"][1], 4)
    with pytest.raises(ValueError, match="block_r"):
        ssm._tile("fwd", 0, 48, torch.float32)


def test_default_tiles_compile_for_hopper_without_spills():
    """The kernels' default tiles compile for sm_90 on the CPU machine (``python -m gemray.bench.sass_check --ssm``,
    ptxas from the triton wheel) with no spill inside their loops and at most a few bytes of stack outside them
    (triton 3.6: 24 B in the float32 dE kernel at 64 x 32): float32 with tf32x3 products, bf16 on wgmma (where a
    product's rows are >= 64; dE's 32-row products take mma.sync). The float32 dE kernel at 64 x 64 spills (tens of spill loads per loop): the check can
    fail."""
    import json
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton wheel without ptxas")
    code = ("import json; from gemray.bench import sass_check as s; "
            "print(json.dumps([s.check(v) for v in s.ssm_variants()]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JITFunction, not the interpreter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    res = [json.loads(out.stdout.strip().splitlines()[-1])][0]
    assert len(res) == 7
    for r in res[:-1]:
        spills = sum(ld for _, _, _, ld in r["loops"])
        assert r["stack"] <= 32 and spills == 0, r
        if "_ssm_bwd_de fp32" not in r["name"]:
            assert r["hgmma"] > 0, r["name"]
    assert "_ssm_bwd_de fp32 E=64 64x64/4w" in res[-1]["name"]
    assert res[-1]["stack"] > 0 and sum(ld for _, _, _, ld in res[-1]["loops"]) > 0, res[-1]
