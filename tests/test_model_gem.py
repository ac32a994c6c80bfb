"""GEM with ranking tasks (input layer + HSTU encoder + retrieval head + candidate tower + multi-task BCE) against a
padded dense re-statement of the whole forward / backward, built from the model's own weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_utils import random_batch
from test_model_hstu import padded_encoder
from test_model_ranking import _tower_reference

from gemray.config import ModelConfig
from gemray.jagged import JaggedBatch, lengths_to_offsets
from gemray.model import GEM
from gemray.model.heads import next_item_index

NUM_ITEMS, NUM_USERS, CATS, HOURS, MAX_LEN = 40, 9, 5, 24, 12


def _cfg(**kw):
    base = dict(embedding_dim=8, model_dim=12, num_blocks=2, num_heads=2, attention_dim=4, linear_dim=3,
                dropout=0.0, num_negatives=6, temperature=0.1, num_time_buckets=32, num_position_buckets=16,
                negatives="uniform", time_bias_query="self", attention_backend="reference",
                token_features=["category"], candidate_features=["category"], context_features=["user_id", "hour"],
                combiner="concat", tasks=["retrieval", "ctr", "cvr"], task_weights=[1.0, 0.5, 2.0],
                pma_seeds=2, mlp_dims=[16])
    base.update(kw)
    return ModelConfig(**base)


def _item_category():
    g = torch.Generator().manual_seed(7)
    cat = torch.randint(1, CATS + 1, (NUM_ITEMS + 1,), generator=g)
    cat[0] = 0
    return cat


def _gem_batch(lengths, cands, seed=0):
    b = random_batch(lengths, NUM_ITEMS, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    coff = lengths_to_offsets(torch.tensor(cands, dtype=torch.int64))
    C = int(coff[-1])
    click = (torch.rand(C, generator=g) < 0.5).float()
    convert = click * (torch.rand(C, generator=g) < 0.5).float()
    return JaggedBatch(user_ids=torch.randint(1, NUM_USERS + 1, (len(lengths),), generator=g), offsets=b.offsets,
                       item_ids=b.item_ids, ratings=b.ratings, timestamps=b.timestamps,
                       features={"category": _item_category()[b.item_ids]},
                       context={"hour": torch.randint(1, HOURS + 1, (len(lengths),), generator=g)},
                       candidate_offsets=coff, candidate_ids=torch.randint(1, NUM_ITEMS + 1, (C,), generator=g),
                       labels=torch.stack([click, convert], 1)).validate()


def _model(cfg, device="cpu"):
    return GEM(cfg, NUM_ITEMS, device, max_seq_len=MAX_LEN, cardinalities={"category": CATS, "hour": HOURS},
               num_users=NUM_USERS, item_features={"category": _item_category()})


def _reference_loss(model: GEM, batch: JaggedBatch, neg_ids: torch.Tensor):
    """The whole loss, dense: tables indexed directly, concat + Linear by hand, the padded HSTU, the per-request
    tower reference, sampled softmax and BCE written out."""
    cfg, W = model.cfg, {c.name: model.embeddings.embeddings[c.name].weight for c in model.embeddings.embedding_configs()}
    cat = _item_category()

    def comb(layer, parts):
        return F.linear(torch.cat(parts, 1), layer.proj.weight, layer.proj.bias)

    from gemray.model.features import time_gap_buckets
    tg = time_gap_buckets(batch.timestamps, batch.offsets, cfg.num_time_buckets)
    tok = comb(model.inputs.tokens, [W["item"][batch.item_ids], W["rating"][batch.ratings], W["time_gap"][tg],
                                     W["category"][batch.features["category"]]])
    states = padded_encoder(model.encoder, tok, batch.offsets, batch.timestamps, MAX_LEN)
    # retrieval: project to E, unit norm, sampled softmax over [positive, negatives]
    h_all = F.normalize(F.linear(states, model.retrieval_proj.weight, model.retrieval_proj.bias), dim=-1, eps=1e-6)
    idx = next_item_index(batch.offsets)
    tgt = batch.item_ids[idx + 1]
    h = h_all[idx]
    pos = (h * F.normalize(W["item"][tgt], dim=-1, eps=1e-6)).sum(-1, keepdim=True)
    neg = (h.unsqueeze(1) * F.normalize(W["item"][neg_ids], dim=-1, eps=1e-6)).sum(-1)
    neg = neg.masked_fill(neg_ids == tgt.view(-1, 1), float("-inf"))
    logits = torch.cat([pos, neg], 1) / cfg.temperature
    retrieval = (torch.logsumexp(logits, 1) - logits[:, 0]).mean()
    # ranking
    cands = comb(model.inputs.candidates, [W["item"][batch.candidate_ids], W["category"][cat[batch.candidate_ids]]])
    ctx = comb(model.inputs.context, [W["user"][batch.user_ids], W["hour"][batch.context["hour"]]])
    z = _tower_reference(model.tower, states, batch.offsets, cands, batch.candidate_offsets, ctx)
    click, convert = batch.labels[:, 0], batch.labels[:, 1]
    ctr = F.binary_cross_entropy_with_logits(z[:, 0], click)
    m = click > 0.5
    cvr = F.binary_cross_entropy_with_logits(z[m, 1], convert[m]) if bool(m.any()) else z.sum() * 0
    w = cfg.task_weights
    return w[0] * retrieval + w[1] * ctr + w[2] * cvr, {"retrieval": retrieval, "ctr": ctr, "cvr": cvr}


@pytest.mark.parametrize("lengths,cands", [([3, 1, 12, 5], [2, 3, 0, 4]), ([6, 2], [1, 5])])
def test_gem_ranking_forward_backward_matches_padded_dense_reference(lengths, cands):
    cfg = _cfg()
    torch.manual_seed(0)
    model = _model(cfg)
    with torch.no_grad():  # non-zero biases everywhere (zero-initialised ones would hide a missing term)
        for name, p in model.named_parameters():
            if "embeddings" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    batch = _gem_batch(lengths, cands)
    model.seed_sampling(3)
    loss, stats = model(batch)
    from gemray.model.heads import sample_uniform_per_position
    neg_ids, _ = sample_uniform_per_position(batch.offsets, cfg.num_negatives, NUM_ITEMS,
                                             torch.Generator().manual_seed(3))
    exp, parts = _reference_loss(model, batch, neg_ids)
    torch.testing.assert_close(loss, exp)
    for t in ("retrieval", "ctr", "cvr"):
        torch.testing.assert_close(stats[f"loss_{t}"], parts[t].detach())
    assert float(stats["count_ctr"]) == sum(cands)
    assert float(stats["count_cvr"]) == float(batch.labels[:, 0].sum())
    params = [p for _, p in model.named_parameters()]
    ga = torch.autograd.grad(loss, params, allow_unused=True)
    gb = torch.autograd.grad(exp, params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), ga, gb):
        assert a is not None, name
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, msg=name)
    hour = [i for i, p in enumerate(params) if p is model.embeddings.embeddings["hour"].weight][0]
    assert float(ga[hour].abs().sum()) > 0  # the context reaches the loss


def test_ranking_only_and_empty_batch_stay_connected():
    cfg = _cfg(tasks=["ctr"], task_weights=[], model_dim=0, combiner="sum", context_features=[])
    torch.manual_seed(0)
    model = _model(cfg)
    assert model.head is None and model.retrieval_proj is None
    batch = _gem_batch([4, 2], [3, 1])
    loss, stats = model(batch)
    assert float(stats["num_targets"]) == 4 and "loss_ctr" in stats
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    empty = _gem_batch([], [])
    loss0, _ = model(empty)
    assert float(loss0.detach()) == 0.0
    logits = model.eval().ranking_logits(batch)
    assert logits.shape == (4, 1) and logits.dtype == torch.float32


def test_meta_build_then_init_weights_equals_direct_build():
    cfg = _cfg()
    torch.manual_seed(5)
    direct = _model(cfg)
    after = torch.rand(1)
    meta = _model(cfg, "meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    assert torch.equal(torch.rand(1), after)
    for (n, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n


def test_missing_item_features_and_candidates_raise():
    cfg = _cfg()
    with pytest.raises(ValueError, match="item_features"):
        GEM(cfg, NUM_ITEMS, "meta", max_seq_len=MAX_LEN, cardinalities={"category": CATS, "hour": HOURS},
            num_users=NUM_USERS)
    model = _model(cfg)
    with pytest.raises(ValueError, match="features"):
        model(random_batch([3, 2], NUM_ITEMS))  # MovieLens-like batch: no side features, no candidates


@pytest.mark.parametrize("negatives, fp32_residual", [("uniform", True), ("uniform_shared", True),
                                                      ("in_batch", True), ("uniform_shared", False)])
def test_bf16_autocast_forward_backward_on_cpu(negatives, fp32_residual):
    """bf16 autocast through the whole model (tower, heads; with model.fp32_residual = false the encoder's states
    bf16 too): float32 loss and gradients, within bf16 rounding of the float32 forward."""
    from gemray.train.precision import autocast
    cfg = _cfg(negatives=negatives, fp32_residual=fp32_residual)
    torch.manual_seed(0)
    model = _model(cfg)
    batch = _gem_batch([5, 3], [2, 2])
    model.seed_sampling(1)
    with autocast("bf16", "cpu"):
        loss, _ = model(batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.tower.q.weight.grad is not None and model.tower.q.weight.grad.dtype == torch.float32
    model.seed_sampling(1)  # the same negatives
    with torch.no_grad(), autocast("fp32", "cpu"):
        ref, _ = model(batch)
    assert abs(float(ref) - float(loss)) < 0.05 * abs(float(ref)) + 0.05  # bf16 rounding, same model
    with pytest.raises(ValueError, match="train.precision"):
        autocast("fp16", "cpu")


def test_ranking_evaluator_scores_each_task_on_its_population():
    from gemray.metrics import BinaryMetrics
    from gemray.train.evaluation import RankingEvaluator

    cfg = _cfg()
    torch.manual_seed(0)
    model = _model(cfg).eval()
    ev = RankingEvaluator.from_config(cfg, num_bins=64)
    batches = [_gem_batch([5, 3, 7], [4, 6, 2], seed=1), _gem_batch([2, 9], [5, 3], seed=2), _gem_batch([], [])]
    with torch.no_grad():
        sums = sum(ev.batch_sums(model, b, ev.prepare(model, torch.device("cpu"))) for b in batches)
        out = ev.compute(sums)
        ctr, cvr = BinaryMetrics(64), BinaryMetrics(64)
        for b in batches[:2]:
            z = model.ranking_logits(b)
            ctr.update(z[:, 0], b.labels[:, 0])
            cvr.update(z[:, 1], b.labels[:, 1], mask=b.labels[:, 0] > 0.5)
    assert sums.dtype == torch.float64 and sums.numel() == ev.num_sums()
    for k, v in ctr.compute().items():
        assert out[f"ctr_{k}"] == pytest.approx(v, nan_ok=True)
    for k, v in cvr.compute().items():
        assert out[f"cvr_{k}"] == pytest.approx(v, nan_ok=True)
    assert out["ctr_num_examples"] == 20 and out["cvr_num_examples"] == float(
        sum(b.labels[:, 0].sum() for b in batches[:2]))


def test_empty_batch_with_every_feature_keeps_every_parameter_in_the_graph():
    """Trailing B=0 batches of a rank still run forward / backward (collective discipline)."""
    torch.manual_seed(0)
    model = _model(_cfg())
    loss, _ = model(_gem_batch([], []))
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        model.eval()
        assert model.ranking_logits(_gem_batch([], [])).shape == (0, 2)
        assert model.user_embeddings(_gem_batch([], [])).shape == (0, 8)
        assert model.ranking_logits(_gem_batch([3, 0], [0, 2])).shape == (2, 2)  # a request without history
