"""Per-position uniform negatives (generative-recommenders' LocalNegativesSampler) vs per-sequence sharing.

Covers: the sampler's shapes/rows, the "neg_item_id" KJT lengths (rows * R per sequence), the head's loss
against an explicit loop, equivalence with "uniform_shared" when every position repeats its sequence's
row, gradients reaching items drawn only as negatives, empty / length-1 batches, and dropout placement.
"""


import pytest
import torch
import torch.nn.functional as F

from gemray.jagged import lengths_to_offsets, segment_ids
from gemray.model import GEM, sparse_features
from gemray.model.heads import RetrievalHead, next_item_index, sample_uniform_per_position
from gemray.model.hstu import HSTUBlock
from model_utils import random_batch, tiny_cfg


def test_sampler_rows_range_and_seed():
    offsets = lengths_to_offsets(torch.tensor([3, 0, 1, 5]))
    ids, rows = sample_uniform_per_position(offsets, 6, 9, torch.Generator().manual_seed(0))
    assert rows.tolist() == [2, 0, 0, 4]
    assert ids.shape == (6, 6) and ids.dtype == torch.int64
    assert int(ids.min()) >= 1 and int(ids.max()) <= 9
    again, _ = sample_uniform_per_position(offsets, 6, 9, torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)
    # each position has its own row (36 draws from 9 ids: the rows are not all one row)
    assert len({tuple(r) for r in ids.tolist()}) > 1
    # a long run covers 1..N uniformly-ish
    many, _ = sample_uniform_per_position(lengths_to_offsets(torch.tensor([101])), 50, 5,
                                          torch.Generator().manual_seed(1))
    counts = torch.bincount(many.view(-1), minlength=6)
    assert counts[0] == 0 and int(counts[1:].min()) > 800
    empty_ids, empty_rows = sample_uniform_per_position(lengths_to_offsets(torch.tensor([], dtype=torch.int64)),
                                                        4, 9)
    assert empty_ids.shape == (0, 4) and empty_rows.numel() == 0
    with pytest.raises(ValueError, match="num_negatives"):
        sample_uniform_per_position(offsets, 0, 9)


def test_sparse_features_per_position_lengths():
    cfg = tiny_cfg(use_rating_feature=False, use_time_feature=False)
    b = random_batch([3, 1, 0, 2])
    ids = torch.arange(1, 3 * 2 + 1).view(3, 2)       # rows: seq0 x2, seq3 x1 (R = 2)
    kjt = sparse_features(b, neg_ids=ids, cfg=cfg, neg_rows=torch.tensor([2, 0, 0, 1]))
    d = kjt.to_dict()
    assert d["neg_item_id"].lengths().tolist() == [4, 0, 0, 2]
    assert d["neg_item_id"].values().tolist() == [1, 2, 3, 4, 5, 6]
    assert d["item_id"].lengths().tolist() == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="neg_rows"):
        sparse_features(b, neg_ids=ids, cfg=cfg, neg_rows=torch.tensor([2, 0, 0, 2]))
    with pytest.raises(ValueError, match="neg_rows"):
        sparse_features(b, neg_ids=ids, cfg=cfg, neg_rows=torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="neg_ids"):
        sparse_features(b, neg_ids=ids.view(-1), cfg=cfg, neg_rows=torch.tensor([2, 0, 0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_per_position_loss_matches_loop(dtype):
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 3, 4, 6])           # lengths 3, 0, 1, 2 -> next-item positions 0, 1, 4
    item_ids = torch.tensor([5, 6, 7, 8, 9, 5])
    states = F.normalize(torch.randn(6, 4, generator=g, dtype=dtype), dim=-1)
    item_emb = torch.randn(6, 4, generator=g, dtype=dtype)
    neg_ids = torch.tensor([[6, 1], [2, 7], [4, 4]])   # position 0 draws its target 6, position 1 its 7
    neg_emb = torch.randn(6, 4, generator=g, dtype=dtype, requires_grad=True)
    head = RetrievalHead("uniform", 2, temperature=0.5)
    loss, stats = head(states, offsets, item_ids, item_emb, neg_ids=neg_ids, neg_emb=neg_emb)
    e = F.normalize(item_emb, dim=-1)
    en = F.normalize(neg_emb, dim=-1).view(3, 2, 4)
    terms = []
    for m, t in enumerate([0, 1, 4]):
        logits = [states[t] @ e[t + 1]]
        for r in range(2):
            if int(neg_ids[m, r]) != int(item_ids[t + 1]):
                logits.append(states[t] @ en[m, r])
        logits = torch.stack(logits) / 0.5
        terms.append(torch.logsumexp(logits, 0) - logits[0])
    exp = torch.stack(terms).mean()
    torch.testing.assert_close(loss, exp)
    assert float(stats["num_targets"]) == 3
    (ga,) = torch.autograd.grad(loss, neg_emb)
    (gb,) = torch.autograd.grad(exp, neg_emb)
    torch.testing.assert_close(ga, gb)
    assert float(ga[0].abs().sum()) == 0.0 and float(ga[1].abs().sum()) > 0   # the masked negative
    with pytest.raises(ValueError, match="uniform"):
        head(states, offsets, item_ids, item_emb, neg_ids=neg_ids[:2], neg_emb=neg_emb[:4])


def test_per_position_equals_shared_when_rows_repeat():
    g = torch.Generator().manual_seed(2)
    offsets = lengths_to_offsets(torch.tensor([4, 1, 3]))
    T, D, R = 8, 6, 5
    item_ids = torch.randint(1, 12, (T,), generator=g)
    states = F.normalize(torch.randn(T, D, generator=g, dtype=torch.float64), dim=-1)
    item_emb = torch.randn(T, D, generator=g, dtype=torch.float64)
    shared_ids = torch.randint(1, 12, (3, R), generator=g)
    shared_emb = torch.randn(3 * R, D, generator=g, dtype=torch.float64)
    seq = segment_ids(offsets)[next_item_index(offsets)]
    per_ids = shared_ids[seq]
    per_emb = shared_emb.view(3, R, D)[seq].reshape(-1, D)
    a, _ = RetrievalHead("uniform_shared", R, 0.05)(states, offsets, item_ids, item_emb,
                                                     neg_ids=shared_ids, neg_emb=shared_emb)
    b, _ = RetrievalHead("uniform", R, 0.05)(states, offsets, item_ids, item_emb,
                                              neg_ids=per_ids, neg_emb=per_emb)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gem_per_position_lookup_and_gradients():
    torch.manual_seed(0)
    cfg = tiny_cfg(negatives="uniform", num_negatives=4)
    model = GEM(cfg, num_items=200, max_seq_len=12)
    batch = random_batch([5, 1, 3], num_items=10)      # history ids only in 1..10
    seen = {}
    orig = model.embeddings.forward

    def spy(kjt):
        seen["neg"] = kjt.to_dict()["neg_item_id"]
        return orig(kjt)

    model.embeddings.forward = spy
    loss, stats = model(batch, generator=torch.Generator().manual_seed(5))
    assert float(stats["num_targets"]) == 6
    assert seen["neg"].lengths().tolist() == [16, 0, 8]           # (L - 1) * R
    neg = seen["neg"].values()
    expect, _ = sample_uniform_per_position(batch.offsets, 4, 200, torch.Generator().manual_seed(5))
    assert torch.equal(neg, expect.view(-1))
    loss.backward()
    grad = model.embeddings.embeddings["item"].weight.grad
    only_neg = sorted(set(neg.tolist()) - set(batch.item_ids.tolist()))
    assert only_neg and all(float(grad[i].abs().sum()) > 0 for i in only_neg)
    untouched = sorted(set(range(1, 201)) - set(neg.tolist()) - set(batch.item_ids.tolist()))
    assert float(grad[untouched].abs().sum()) == 0.0
    assert torch.isfinite(loss) and float(loss.detach()) > 0


def test_block_dropout_is_applied_before_output_projection():
    cfg = tiny_cfg(dropout=0.5, num_position_buckets=8, attention_backend="reference")
    torch.manual_seed(0)
    blk = HSTUBlock(cfg, max_seq_len=6).double()
    with torch.no_grad():
        blk.o_bias.normal_(std=0.3)
    offsets = lengths_to_offsets(torch.tensor([4, 2]))
    x = torch.randn(6, 16, dtype=torch.float64)
    ts = torch.arange(6) * 100
    blk.eval()
    # y (pre-projection) recovered from the eval output: out - x = y @ W_o^T + b_o
    y = torch.linalg.lstsq(blk.o_weight.detach(), (blk(x, offsets, ts) - x - blk.o_bias).detach().T).solution.T
    blk.train()
    torch.manual_seed(11)
    out = blk(x, offsets, ts)
    torch.manual_seed(11)
    exp = x + F.linear(F.dropout(y, 0.5, training=True), blk.o_weight, blk.o_bias)
    torch.testing.assert_close(out, exp, rtol=1e-8, atol=1e-8)
    # dropping after the projection would zero whole output coordinates instead
    torch.manual_seed(11)
    after = x + F.dropout(F.linear(y, blk.o_weight, blk.o_bias), 0.5, training=True)
    assert not torch.allclose(out, after)
