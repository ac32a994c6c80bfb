"""GEM ranking building blocks: ops.cross_attention / ops.pma, the input layer, the candidate tower and the
multi-task head, against plain PyTorch references on random jagged batches (empty histories, empty candidate
lists, length-1 sequences and the longest allowed history)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the Triton-branch test runs the kernels in the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model_utils import random_batch, tiny_cfg  # noqa: E402
from torchrec import EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from gemray import ops  # noqa: E402
from gemray.config import ModelConfig  # noqa: E402
from gemray.jagged import lengths_to_offsets  # noqa: E402
from gemray.kernels import reference as ref  # noqa: E402
from gemray.model import GEM  # noqa: E402
from gemray.model.embeddings import make_embedding_collection  # noqa: E402
from gemray.model.features import feature_names, sparse_features  # noqa: E402
from gemray.model.inputs import (InputLayer, embedding_configs, extra_feature_names,  # noqa: E402
                                 extra_sparse_features)
from gemray.model.ranking import CandidateTower, MultiTaskHead  # noqa: E402

ACTIVATIONS = ("softmax", "silu", "gelu", "none")
# (history lengths, candidate counts): empty histories, empty candidate lists, length 1, the max length (12)
BATCHES = [
    ([3, 0, 1, 12, 5, 1], [2, 3, 0, 4, 1, 1]),
    ([0, 0], [1, 0]),
    ([1], [1]),
    ([12, 7, 0], [0, 0, 0]),
]
MAX_LEN = 12


def _offsets(lengths):
    return lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))


def _rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


# ---------------------------------------------------------------------------------------------- ops


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("lengths,cands", BATCHES)
def test_cross_attention_and_pma_match_reference_fwd_bwd(activation, lengths, cands):
    """The custom ops (explicit padded backward) against autograd through kernels.reference."""
    ko, qo = _offsets(lengths), _offsets(cands)
    H, D, Dv = 2, 5, 3
    q, k, v = _rand(int(qo[-1]), H, D, seed=1), _rand(int(ko[-1]), H, D, seed=2), _rand(int(ko[-1]), H, Dv, seed=3)
    seeds = _rand(3, H, D, seed=4)
    out = ops.cross_attention(q, qo, k, v, ko, max(cands), MAX_LEN, activation=activation, backend="reference")
    exp = ref.jagged_cross_attention_ref(q, qo, k, v, ko, max(cands), MAX_LEN, activation=activation)
    torch.testing.assert_close(out, exp)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(exp, (q, k, v), g)):
        torch.testing.assert_close(a, b)
    out = ops.pma(seeds, k, v, ko, MAX_LEN, activation=activation, alpha=0.7, backend="reference")
    exp = ref.pma_ref(seeds, k, v, ko, MAX_LEN, activation=activation, alpha=0.7)
    assert out.shape == (len(lengths), 3, H, Dv)
    torch.testing.assert_close(out, exp)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (seeds, k, v), g), torch.autograd.grad(exp, (seeds, k, v), g)):
        torch.testing.assert_close(a, b)
    if lengths == [3, 0, 1, 12, 5, 1] and activation == "softmax":
        assert out[1].abs().max() == 0  # an empty history pools to 0
        assert float(exp.detach().abs().sum()) > 0


def test_ops_empty_batch_keeps_inputs_in_graph():
    o = torch.zeros(1, dtype=torch.int64)
    q, k, v, s = (torch.zeros(0, 2, 4, requires_grad=True), torch.zeros(0, 2, 4, requires_grad=True),
                  torch.zeros(0, 2, 3, requires_grad=True), torch.randn(2, 2, 4, requires_grad=True))
    out = ops.cross_attention(q, o, k, v, o, 0, 8, backend="reference").sum() + \
        ops.pma(s, k, v, o, 8, backend="reference").sum()
    out.backward()
    assert all(t.grad is not None for t in (q, k, v, s)) and s.grad.abs().sum() == 0


def test_ops_backend_rules():
    o = _offsets([2])
    q = torch.randn(2, 1, 4)
    # the rule behind every op's backend (cross / PMA included): TRITON forced where it cannot run raises
    with pytest.raises(RuntimeError, match="tensors are on cpu"):
        ops.choose_backend(ops.AttentionBackend.TRITON, "cpu", None, interpreting=False)
    with pytest.raises(ValueError, match="backend"):
        ops.pma(q[:1], q, q, o, 2, backend="cuda")
    with pytest.raises(ValueError, match="batch|B="):
        ops.cross_attention(q, o, q, q, _offsets([1, 1]), 2, 2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("strided_kv", [False, True])
def test_ops_triton_branch_matches_reference(monkeypatch, activation, strided_kv):
    """The Triton branch of the custom ops (forward with its lse, and the backward op that runs the kernels'
    backward on them) against the reference branch, on CPU in the Triton interpreter, float32: sequences of 0,
    1 and the longest length; with strided_kv, k and v are column splits of one [T, H*(Dqk + Dv)] projection (the
    candidate tower's), read in place by the kernels and differentiated through the split."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(ops, "_gdpa_backend", lambda b, device, name: "reference" if b == "reference" else "triton")
    ko, qo = _offsets([4, 0, 1, 10, 0]).to(dev), _offsets([0, 3, 1, 2, 1]).to(dev)
    q = _rand(int(qo[-1]), 2, 16, seed=1, dtype=torch.float32).detach().to(dev).requires_grad_()
    if strided_kv:
        kv = _rand(int(ko[-1]), 2 * 16 + 2 * 8, 1, seed=2, dtype=torch.float32).detach().to(dev).view(-1, 48)
        kv.requires_grad_()
        k, v = (t.reshape(-1, 2, d) for t, d in zip(torch.split(kv, [32, 16], dim=1), (16, 8)))
        assert k.stride(0) == 48 and not k.is_contiguous()
        leaves = (q, kv)
    else:
        k = _rand(int(ko[-1]), 2, 16, seed=2, dtype=torch.float32).detach().to(dev).requires_grad_()
        v = _rand(int(ko[-1]), 2, 8, seed=3, dtype=torch.float32).detach().to(dev).requires_grad_()
        leaves = (q, k, v)
    for call in (lambda b: ops.cross_attention(q, qo, k, v, ko, 3, 10, activation=activation, backend=b),
                 lambda b: ops.pma(q[:3], k, v, ko, 10, activation=activation, backend=b)):
        got, exp = call("triton"), call("reference")
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-4)
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, leaves, g)
        assert all(x.abs().sum() > 0 for x in grads)
        for a, b in zip(grads, torch.autograd.grad(exp, leaves, g)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_custom_ops_pass_opcheck_on_the_triton_branch(monkeypatch):
    """Schema, fakes (the lse's [H, T_out] shape on the Triton softmax branch) and autograd registration of the
    four ops with the Triton kernels behind them (interpreter on CPU, float32)."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(ops, "_gdpa_backend", lambda b, device, name: "reference" if b == "reference" else "triton")
    ko, qo = _offsets([4, 0, 1]).to(dev), _offsets([2, 1, 0]).to(dev)
    q, k, v = (_rand(n, 2, d, seed=i, dtype=torch.float32).detach().to(dev).requires_grad_()
               for i, (n, d) in enumerate([(3, 16), (5, 16), (5, 8)]))
    s = _rand(2, 2, 16, seed=4, dtype=torch.float32).detach().to(dev).requires_grad_()
    out, lse = torch.ops.gemray.cross_attention(q, qo, k, v, ko, 2, 8, "softmax", None, "triton")
    pout, plse = torch.ops.gemray.pma(s, k, v, ko, 8, "softmax", None, "triton")
    assert lse.shape == (2, 3) and plse.shape == (2, 3 * 2) and pout.shape == (3, 2, 2, 8)  # [H, B * S]
    cases = [
        (torch.ops.gemray.cross_attention.default, (q, qo, k, v, ko, 2, 8, "softmax", None, "triton")),
        (torch.ops.gemray.pma.default, (s, k, v, ko, 8, "softmax", None, "triton")),
        (torch.ops.gemray.cross_attention_backward.default,
         (torch.randn_like(out), q.detach(), qo, k.detach(), v.detach(), ko, 2, 8, "softmax", None, "triton",
          out.detach(), lse)),
        (torch.ops.gemray.pma_backward.default,
         (torch.randn_like(pout), s.detach(), k.detach(), v.detach(), ko, 8, "softmax", None, "triton",
          pout.detach(), plse)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                             "test_autograd_registration"))
        assert all(r == "SUCCESS" for r in result.values()), (op, result)


# ---------------------------------------------------------------------------------------------- tower


def _tower_cfg(**kw):
    base = dict(embedding_dim=8, num_blocks=1, num_heads=2, attention_dim=4, linear_dim=3, dropout=0.0,
                pma_seeds=2, mlp_dims=[16, 8], tasks=["retrieval", "ctr", "cvr"], attention_backend="reference")
    base.update(kw)
    return ModelConfig(**base)


def _tower_reference(t: CandidateTower, hist, offsets, cand, cand_offsets, ctx):
    """Loop over requests, plain attention on dense per-request tensors, the tower's own weights."""
    d, H, A, V = t.d, t.h, t.a, t.v
    rows = []
    for b in range(offsets.numel() - 1):
        h = F.layer_norm(hist[offsets[b]:offsets[b + 1]], (d,), eps=1e-6)
        c_raw = cand[cand_offsets[b]:cand_offsets[b + 1]]
        if c_raw.shape[0] == 0:
            continue
        c = F.layer_norm(c_raw, (d,), eps=1e-6)
        kv = h @ t.kv.weight.T + t.kv.bias
        k, v = kv[:, :H * A].reshape(-1, H, A), kv[:, H * A:].reshape(-1, H, V)
        q = (c @ t.q.weight.T + t.q.bias).reshape(-1, H, A)

        def attend(qh, kh, vh):  # [m, A], [n, A], [n, V]
            if t.activation == "softmax":
                p = torch.softmax(qh @ kh.T / A ** 0.5, dim=-1)
            else:
                p = F.silu(qh @ kh.T) / t.max_seq_len
            return p @ vh

        x = torch.cat([attend(q[:, i], k[:, i], v[:, i]) for i in range(H)], dim=1)
        x = x @ t.out.weight.T + t.out.bias
        u = torch.stack([attend(t.seeds[:, i], k[:, i], v[:, i]) for i in range(H)], dim=1)  # [S, H, V]
        u = u.reshape(1, -1) @ t.pool.weight.T + t.pool.bias
        parts = [x, c_raw, u.expand(c.shape[0], d)]
        if ctx is not None:
            parts.append(ctx[b].expand(c.shape[0], d))
        rows.append(t.mlp(torch.cat(parts, dim=1)))
    return torch.cat(rows) if rows else cand.new_zeros((0, t.num_tasks)) + 0 * cand.sum()


@pytest.mark.parametrize("activation,context", [("softmax", True), ("silu", False)])
@pytest.mark.parametrize("lengths,cands", BATCHES)
def test_tower_matches_dense_reference_fwd_bwd(activation, context, lengths, cands):
    cfg = _tower_cfg(tower_activation=activation, context_features=["hour"] if context else [])
    torch.manual_seed(0)
    tower = CandidateTower(cfg, MAX_LEN).double()
    with torch.no_grad():  # non-zero biases and seeds large enough for non-uniform attention
        for p in tower.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    off, coff = _offsets(lengths), _offsets(cands)
    B, T, C, d = len(lengths), int(off[-1]), int(coff[-1]), cfg.width
    hist, cand = _rand(T, d, seed=1), _rand(C, d, seed=2)
    ctx = _rand(B, d, seed=3) if context else None
    got = tower(hist, off, cand, coff, ctx)
    exp = _tower_reference(tower, hist, off, cand, coff, ctx)
    assert got.shape == (C, 2)
    torch.testing.assert_close(got, exp)
    inputs = [hist, cand] + ([ctx] if context else []) + list(tower.parameters())
    g = torch.randn_like(got)
    ga = torch.autograd.grad(got, inputs, g, allow_unused=True)
    gb = torch.autograd.grad(exp, inputs, g, allow_unused=True)
    for a, b in zip(ga, gb):
        assert a is not None
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b)
    if C and T:
        assert float(ga[0].abs().sum()) > 0  # the history reaches the logits


@pytest.mark.parametrize("lengths,cands", [([], []), ([4, 0, 2], [0, 0, 0]), ([0, 0], [1, 2])])
def test_empty_requests_and_empty_batch_give_zero_loss_connected_to_every_parameter(lengths, cands):
    cfg = _tower_cfg(context_features=["user_id"])
    tower, head = CandidateTower(cfg, MAX_LEN), MultiTaskHead.from_config(cfg)
    off, coff = _offsets(lengths), _offsets(cands)
    B, T, C = len(lengths), int(off[-1]), int(coff[-1])
    hist, cand, ctx = torch.randn(T, 8), torch.randn(C, 8), torch.randn(B, 8)
    labels = torch.zeros(C, 2)  # no clicks: CVR's population is empty
    loss, stats = head(tower(hist, off, cand, coff, ctx), labels)
    loss.backward()
    assert all(p.grad is not None for p in tower.parameters())
    if C == 0:
        assert float(loss.detach()) == 0.0 and stats["count_ctr"] == 0
    else:
        assert float(loss.detach()) > 0 and stats["count_cvr"] == 0 and stats["loss_cvr"] == 0


def test_tower_refuses_bad_inputs():
    cfg = _tower_cfg()
    tower = CandidateTower(cfg, MAX_LEN)
    off, coff = _offsets([2, 1]), _offsets([1, 1])
    with pytest.raises(ValueError, match="context"):
        tower(torch.randn(3, 8), off, torch.randn(2, 8), coff, torch.randn(2, 8))
    with pytest.raises(ValueError, match="candidate_offsets"):
        tower(torch.randn(3, 8), off, torch.randn(2, 8), _offsets([2]))
    with pytest.raises(ValueError, match="ranking task"):
        CandidateTower(_tower_cfg(tasks=["retrieval"]), MAX_LEN)


def test_meta_build_then_init_weights_equals_direct_build():
    cfg = _tower_cfg(context_features=["hour"], token_features=["category"], combiner="concat", model_dim=12)
    torch.manual_seed(3)
    direct = [CandidateTower(cfg, MAX_LEN), InputLayer(cfg)]
    later = [CandidateTower(cfg, MAX_LEN, device="meta"), InputLayer(cfg, device="meta")]
    for m_direct, m in zip(direct, later):
        m.to_empty(device="cpu")
    torch.manual_seed(3)
    for m in later:
        m.init_weights()
    for a, b in zip(direct, later):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and len(sa) > 0
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_task_base_rates_start_the_predictions_at_the_rates():
    """model.task_base_rates: the output bias starts at logit(rate) per task, on a real build and after a meta
    build + init_weights alike (no RNG draw: the other parameters equal a build without rates), so the mean
    prediction of a fresh tower is near each rate; without rates it is near 0.5."""
    rates = [0.05, 0.3]
    cfg = _tower_cfg(task_base_rates=rates, context_features=["hour"], token_features=["category"], model_dim=12)
    torch.manual_seed(5)
    with_rates = CandidateTower(cfg, MAX_LEN)
    torch.manual_seed(5)
    plain = CandidateTower(_tower_cfg(context_features=["hour"], token_features=["category"], model_dim=12), MAX_LEN)
    bias = with_rates.mlp[-1].bias.detach()
    assert torch.allclose(bias.double(), torch.logit(torch.tensor(rates, dtype=torch.float64)), atol=1e-6)
    for (name, a), (_, b) in zip(with_rates.state_dict().items(), plain.state_dict().items()):
        if name != "mlp.4.bias":
            assert torch.equal(a, b), name
    later = CandidateTower(cfg, MAX_LEN, device="meta").to_empty(device="cpu")
    torch.manual_seed(5)
    later.init_weights()
    for key, v in with_rates.state_dict().items():
        assert torch.equal(v, later.state_dict()[key]), key
    lengths, cands = [5, 0, 12, 3] * 8, [6, 2, 0, 9] * 8
    off, coff = _offsets(lengths), _offsets(cands)
    g = torch.Generator().manual_seed(0)
    h, c = torch.randn(sum(lengths), 12, generator=g), torch.randn(sum(cands), 12, generator=g)
    ctx = torch.randn(len(lengths), 12, generator=g)
    with torch.no_grad():
        p_rates = torch.sigmoid(with_rates(h, off, c, coff, ctx)).mean(0)
        p_plain = torch.sigmoid(plain(h, off, c, coff, ctx)).mean(0)
    assert torch.allclose(p_rates, torch.tensor(rates), atol=0.03), p_rates
    assert torch.allclose(p_plain, torch.tensor([0.5, 0.5]), atol=0.15), p_plain


# ---------------------------------------------------------------------------------------------- head


def test_multitask_head_by_hand():
    logits = torch.tensor([[2.0, -1.0], [-0.5, 0.3], [0.1, 1.5], [1.0, -2.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])

    def bce(z, y):
        return -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(1 - torch.sigmoid(z)))

    ctr = bce(logits[:, 0], labels[:, 0]).mean()
    cvr_clicked = bce(logits[[0, 2], 1], labels[[0, 2], 1]).mean()
    cvr_all = bce(logits[:, 1], labels[:, 1]).mean()
    loss, stats = MultiTaskHead(["ctr", "cvr"], [1.0, 0.5])(logits, labels)
    torch.testing.assert_close(loss, ctr + 0.5 * cvr_clicked)
    assert stats["count_cvr"] == 2 and stats["count_ctr"] == 4
    loss, _ = MultiTaskHead(["cvr", "ctr"], [2.0, 1.0], cvr_population="all")(logits.flip(1), labels)
    torch.testing.assert_close(loss, 2.0 * cvr_all + ctr)
    targets, pop = MultiTaskHead(["ctr", "cvr"]).targets_and_populations(labels)
    assert pop[:, 1].tolist() == [True, False, True, False] and torch.equal(targets, labels)
    cfg = _tower_cfg(tasks=["cvr", "retrieval", "ctr"], task_weights=[0.25, 1.0, 2.0], cvr_population="all")
    h = MultiTaskHead.from_config(cfg)
    assert h.tasks == ["cvr", "ctr"] and h.weights == [0.25, 2.0] and h.cvr_population == "all"


# ---------------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("rating,time", [(True, True), (False, True), (False, False)])
def test_sum_path_reproduces_gem_token_embeddings_exactly(rating, time):
    cfg = tiny_cfg(use_rating_feature=rating, use_time_feature=time)
    torch.manual_seed(0)
    model = GEM(cfg, num_items=40, max_seq_len=20).eval()
    batch = random_batch([5, 0, 1, 20, 3], seed=4)
    seen = []
    hook = model.encoder.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        model.user_embeddings(batch)
        emb = model.embeddings(sparse_features(batch, neg_ids=None, cfg=cfg))
        mine = InputLayer(cfg).token_embeddings(emb)
    hook.remove()
    assert list(InputLayer(cfg).parameters()) == []
    assert torch.equal(seen[0], mine) and mine.abs().sum() > 0


def test_default_tables_are_todays():
    cfg = tiny_cfg()
    ours = embedding_configs(cfg, 40)
    today = make_embedding_collection(cfg, 40).embedding_configs()
    assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.weight_init_min, t.weight_init_max)
            for t in ours] == \
           [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.weight_init_min, t.weight_init_max)
            for t in today]
    assert extra_feature_names(cfg) == []
    assert extra_sparse_features(random_batch([2, 1]), cfg) == []


@dataclass
class _GemBatch:
    """The fields of a JaggedBatch with the synthetic generator's optional GEM fields."""
    user_ids: torch.Tensor
    offsets: torch.Tensor
    item_ids: torch.Tensor
    ratings: torch.Tensor
    timestamps: torch.Tensor
    features: dict
    context: dict
    candidate_offsets: torch.Tensor
    candidate_ids: torch.Tensor
    labels: torch.Tensor

    batch_size = property(lambda self: self.offsets.numel() - 1)
    num_tokens = property(lambda self: int(self.offsets[-1]))
    lengths = property(lambda self: self.offsets[1:] - self.offsets[:-1])


def _gem_batch(lengths, cands, seed=0):
    base = random_batch(lengths, num_items=30, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    T, B = base.num_tokens, base.batch_size
    coff = _offsets(cands)
    C = int(coff[-1])
    click = (torch.rand(C, generator=g) < 0.5).float()
    return _GemBatch(base.user_ids, base.offsets, base.item_ids, base.ratings, base.timestamps,
                     {"category": torch.randint(0, 6, (T,), generator=g)},
                     {"hour": torch.randint(0, 25, (B,), generator=g)}, coff,
                     torch.randint(1, 31, (C,), generator=g), torch.stack([click, click * (torch.rand(C) < 0.5)], 1))


@pytest.mark.parametrize("combiner", ["sum", "concat"])
def test_input_layer_end_to_end_through_one_embedding_collection(combiner):
    """Tables + KJT parts + combiners: each output row is the combination of the right table rows."""
    cfg = tiny_cfg(token_features=["category"], candidate_features=["category"], combiner=combiner,
                   context_features=["user_id", "hour"], tasks=["retrieval", "ctr", "cvr"],
                   table_rows=["user=1000"], model_dim=0 if combiner == "sum" else 12)
    batch = _gem_batch([3, 0, 1, 4], [2, 1, 0, 3])
    cand_cat = torch.randint(0, 6, (batch.candidate_ids.numel(),))
    tables = embedding_configs(cfg, 30, cardinalities={"category": 5, "hour": 24})
    assert {t.name: t.num_embeddings for t in tables}["user"] == 1000
    ec = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
    base = sparse_features(batch, neg_ids=None, cfg=cfg)
    extra = extra_sparse_features(batch, cfg, {"category": cand_cat})
    assert [k for k, _, _ in extra] == extra_feature_names(cfg) == \
        ["category", "cand_item_id", "cand_category", "user_id", "ctx_hour"]
    kjt = KeyedJaggedTensor(keys=feature_names(cfg) + [k for k, _, _ in extra],
                            values=torch.cat([base.values()] + [v for _, v, _ in extra]),
                            lengths=torch.cat([base.lengths()] + [n for _, _, n in extra]), stride=batch.batch_size)
    emb = ec(kjt)
    layer = InputLayer(cfg)
    W = {name: ec.embeddings[name].weight for name in ("item", "rating", "time_gap", "category", "user", "hour")}
    tok = [W["item"][batch.item_ids], W["rating"][batch.ratings], W["time_gap"][kjt["time_gap"].values()],
           W["category"][batch.features["category"]]]
    cand = [W["item"][batch.candidate_ids], W["category"][cand_cat]]
    ctx = [W["user"][batch.user_ids], W["hour"][batch.context["hour"]]]

    def combine(xs, comb):
        if combiner == "sum":
            out = xs[0]
            for x in xs[1:]:
                out = out + x
            return out
        return comb.proj(torch.cat(xs, 1))

    with torch.no_grad():
        torch.testing.assert_close(layer.token_embeddings(emb), combine(tok, layer.tokens))
        torch.testing.assert_close(layer.candidate_embeddings(emb), combine(cand, layer.candidates))
        torch.testing.assert_close(layer.context_embeddings(emb), combine(ctx, layer.context))
    assert layer.token_embeddings(emb).shape == (batch.num_tokens, cfg.width)


def test_input_layer_refusals():
    cfg = tiny_cfg(token_features=["category"], tasks=["ctr"], context_features=["hour"])
    with pytest.raises(ValueError, match="needs a size"):
        embedding_configs(cfg, 30, cardinalities={"category": 5})
    with pytest.raises(ValueError, match="smaller"):
        embedding_configs(tiny_cfg(table_rows=["item=10"]), 30)
    with pytest.raises(ValueError, match="features"):
        extra_sparse_features(random_batch([2]), cfg)
    with pytest.raises(ValueError, match="missing"):
        InputLayer(cfg).token_embeddings({"item_id": torch.zeros(2, 16)})


@pytest.mark.parametrize("kw,needle", [
    (dict(tasks=["ctr", "ctr"]), "model.tasks"), (dict(tasks=[]), "model.tasks"),
    (dict(tasks=["retrieval", "ctr"], task_weights=[1.0]), "task_weights"),
    (dict(task_weights=[0.0]), "task_weights"), (dict(combiner="mean"), "combiner"),
    (dict(candidate_features=["category"]), "candidate_features"),
    (dict(token_features=["rating"]), "token_features"), (dict(token_features=["Cat"]), "token_features"),
    (dict(attention_window=64, attention_block=64), "not wired"), (dict(attention_window=64), "not wired"),
    (dict(attention_block=64), "not wired"), (dict(attention_window=-1), "attention_window"),
    (dict(model_dim=-1), "model_dim"),
    (dict(table_rows=["item"]), "table_rows"), (dict(table_rows=["author=5"]), "no table"),
    (dict(mlp_dims=[8, 0]), "mlp_dims"), (dict(pma_seeds=0), "pma_seeds"),
    (dict(token_features=["hour"], context_features=["hour"]), "also token"),
    (dict(tasks=["ctr", "cvr"], task_base_rates=[0.05]), "task_base_rates"),
    (dict(tasks=["ctr"], task_base_rates=[1.0]), "task_base_rates"),
    (dict(tasks=["ctr"], task_base_rates=[0.0]), "task_base_rates"),
    (dict(tasks=["retrieval"], task_base_rates=[0.05]), "no ranking task"),
])
def test_config_refuses(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**kw).validate()


def test_tower_runs_in_bf16_close_to_fp32():
    cfg = _tower_cfg(mlp_dims=[8])
    torch.manual_seed(0)
    t16 = CandidateTower(cfg, MAX_LEN).to(torch.bfloat16)
    t32 = CandidateTower(cfg, MAX_LEN)
    t32.load_state_dict({k: v.float() for k, v in t16.state_dict().items()})
    off, coff = _offsets([3, 0, 12]), _offsets([2, 1, 0])
    h, c = torch.randn(15, 8), torch.randn(3, 8)
    h16, c16 = h.bfloat16().requires_grad_(), c.bfloat16().requires_grad_()
    logits = t16(h16, off, c16, coff)
    loss, _ = MultiTaskHead.from_config(cfg)(logits, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    loss.backward()
    assert logits.dtype == torch.bfloat16 and h16.grad.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in t16.parameters())
    with torch.no_grad():
        ref32 = t32(h.bfloat16().float(), off, c.bfloat16().float(), coff)
    torch.testing.assert_close(logits.detach().float(), ref32, atol=3e-2, rtol=3e-2)


def test_custom_ops_pass_opcheck():
    """Schema, autograd registration, fake (meta) kernels and AOT dispatch of the four gemray ops."""
    ko, qo = _offsets([4, 0, 1]), _offsets([2, 1, 0])
    q, k, v, s = _rand(3, 2, 4, seed=1), _rand(5, 2, 4, seed=2), _rand(5, 2, 3, seed=3), _rand(2, 2, 4, seed=4)
    cases = [
        (torch.ops.gemray.cross_attention.default, (q, qo, k, v, ko, 2, 8, "softmax", None, "reference")),
        (torch.ops.gemray.pma.default, (s, k, v, ko, 8, "silu", 0.5, "reference")),
        (torch.ops.gemray.cross_attention_backward.default,
         (torch.randn(3, 2, 3, dtype=torch.float64), q.detach(), qo, k.detach(), v.detach(), ko, 2, 8, "gelu", None,
          "reference", torch.randn(3, 2, 3, dtype=torch.float64), torch.empty(0))),
        (torch.ops.gemray.pma_backward.default,
         (torch.randn(3, 2, 2, 3, dtype=torch.float64), s.detach(), k.detach(), v.detach(), ko, 8, "softmax", None,
          "reference", torch.randn(3, 2, 2, 3, dtype=torch.float64), torch.empty(0))),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(r == "SUCCESS" for r in result.values()), (op, result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_gpu_tower_attention_ops_bf16_strided_kv(activation):
    """The custom ops' Triton branch on CUDA in bf16 at GEM-like sizes (4 heads of 256, histories to 2048 with
    empty and length-1 ones, 64 candidates a request), k / v column splits of one projection as in the candidate
    tower: forward and gradients against the reference branch in float32."""
    torch.manual_seed(5)
    lens = [2048, 0, 1, 700, 1500, 33, 2048, 9]
    ko, qo = _offsets(lens).cuda(), _offsets([64, 64, 0, 64, 1, 64, 64, 64]).cuda()
    kv = (torch.randn(sum(lens), 2048, device="cuda") * 0.5).bfloat16().requires_grad_()
    q = (torch.randn(int(qo[-1]), 4, 256, device="cuda") * 0.5).bfloat16().requires_grad_()
    s = (torch.randn(4, 4, 256, device="cuda") * 0.5).bfloat16().requires_grad_()

    def run(backend, dtype):
        kv_, q_, s_ = (x.detach().to(dtype).requires_grad_() for x in (kv, q, s))
        k, v = (t.reshape(-1, 4, 256) for t in torch.split(kv_, [1024, 1024], dim=1))
        x = ops.cross_attention(q_, qo, k, v, ko, 64, 2048, activation=activation, backend=backend)
        u = ops.pma(s_, k, v, ko, 2048, activation=activation, backend=backend)
        torch.manual_seed(6)
        gx, gu = torch.randn(x.shape, device="cuda"), torch.randn(u.shape, device="cuda")
        grads = torch.autograd.grad((x.float() * gx).sum() + (u.float() * gu).sum(), (kv_, q_, s_))
        return [x.float(), u.float(), *(g.float() for g in grads)]

    for name, a, b in zip(("cross out", "pma out", "d kv", "d q", "d seeds"), run("triton", torch.bfloat16),
                          run("reference", torch.float32)):
        assert b.abs().sum() > 0, name
        err = ((a - b).norm() / b.norm()).item()  # bf16 inputs and kernels against a float32 reference
        assert err < 2e-2, (name, err)
