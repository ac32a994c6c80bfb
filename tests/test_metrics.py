"""gemray.metrics on a hand-checked example."""

import math

import pytest
import torch

from gemray.metrics import RetrievalMetrics, target_ranks


def test_target_ranks_by_hand():
    # 5 items (ids 1..5), column 0 is padding and is ignored even when it scores highest.
    scores = torch.tensor([
        [9.0, 0.1, 0.9, 0.5, 0.3, 0.2],   # target 3 (0.5): only item 2 (0.9) higher -> rank 1
        [9.0, 0.8, 0.1, 0.2, 0.3, 0.4],   # target 1 (0.8): best -> rank 0
        [0.0, 0.5, 0.4, 0.3, 0.2, 0.1],   # target 5 (0.1): 4 higher -> rank 4
        [0.0, 0.3, 0.3, 0.3, 0.1, 0.2],   # target 2 (0.3): ties with 1 and 3 count against it -> rank 2
    ])
    targets = torch.tensor([3, 1, 5, 2])
    ranks = target_ranks(scores, targets)
    assert ranks.dtype == torch.int64
    assert ranks.tolist() == [1, 0, 4, 2]


def test_collapsed_or_nan_scores_rank_last():
    """A model whose scores are all equal or NaN must not look perfect (it once printed HR@10 = 1.0)."""
    nan = float("nan")
    scores = torch.tensor([
        [0.0, 0.7, 0.7, 0.7, 0.7],        # all equal: target 1 ranks behind the 3 others
        [0.0, nan, nan, nan, nan],        # all NaN
        [0.0, 0.1, nan, 0.9, 0.2],        # target 4 (0.2): item 3 higher, item 2 NaN -> rank 2
        [0.0, 0.1, nan, 0.9, 0.2],        # target 2 is NaN -> last
    ])
    assert target_ranks(scores, torch.tensor([1, 3, 4, 2])).tolist() == [3, 3, 2, 3]


def test_metrics_by_hand():
    # ranks 1, 0, 4, 0 and k in {1, 3}:
    #   HR@1 = mean([0,1,0,1]) = 0.5;  HR@3 = mean([1,1,0,1]) = 0.75
    #   NDCG@1 = (0 + 1 + 0 + 1)/4 = 0.5
    #   NDCG@3 = (1/log2(3) + 1 + 0 + 1)/4 = (0.63093 + 2)/4 = 0.65773
    m = RetrievalMetrics([1, 3])
    m.update(torch.tensor([1, 0]))
    m.update(torch.tensor([4, 0]))
    out = m.compute()
    assert out["num_users"] == 4
    assert out["hr@1"] == pytest.approx(0.5)
    assert out["hr@3"] == pytest.approx(0.75)
    assert out["ndcg@1"] == pytest.approx(0.5)
    assert out["ndcg@3"] == pytest.approx((1 / math.log2(3) + 2) / 4)
    assert out["ndcg@3"] == pytest.approx(0.657733, abs=1e-6)


def test_sums_combine_like_all_reduce():
    a, b, both = RetrievalMetrics([2]), RetrievalMetrics([2]), RetrievalMetrics([2])
    a.update(torch.tensor([0, 5]))
    b.update(torch.tensor([1]))
    both.update(torch.tensor([0, 5, 1]))
    summed = a.sums() + b.sums()
    assert a.compute(summed) == pytest.approx(both.compute())
    # HR@2 = 2/3; NDCG@2 = (1 + 1/log2(3)) / 3
    assert both.compute()["hr@2"] == pytest.approx(2 / 3)
    assert both.compute()["ndcg@2"] == pytest.approx((1 + 1 / math.log2(3)) / 3)


def test_empty_and_errors():
    m = RetrievalMetrics([10])
    m.update(torch.zeros(0, dtype=torch.int64))
    assert m.compute() == {"hr@10": 0.0, "ndcg@10": 0.0, "num_users": 0.0}
    with pytest.raises(ValueError, match="ks"):
        RetrievalMetrics([0])
    with pytest.raises(ValueError, match="targets"):
        target_ranks(torch.zeros(1, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="targets"):
        target_ranks(torch.zeros(1, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match="ranks"):
        m.update(torch.tensor([-1]))


def test_history_excluded_from_ranking_by_hand():
    """generative-recommenders' protocol: the user's history items are not ranked (filter_invalid_ids)."""
    from gemray.metrics import history_mask

    # 5 items; user 0 saw items 2 and 4, user 1 saw item 1 (its target later: a miss), user 2 saw nothing.
    item_ids = torch.tensor([2, 4, 1])
    offsets = torch.tensor([0, 2, 3, 3])
    seen = history_mask(item_ids, offsets, num_items=5)
    assert seen.tolist() == [[False, False, True, False, True, False],
                             [False, True, False, False, False, False],
                             [False] * 6]
    scores = torch.tensor([
        [9.0, 0.1, 0.9, 0.5, 0.8, 0.2],   # target 3 (0.5): 2 and 4 higher but seen -> rank 0 (unfiltered: 2)
        [0.0, 0.9, 0.1, 0.2, 0.3, 0.4],   # target 1 is in the history -> a miss, ranked last (4)
        [0.0, 0.5, 0.4, 0.3, 0.2, 0.1],   # nothing seen: target 5 -> rank 4 either way
    ])
    targets = torch.tensor([3, 1, 5])
    assert target_ranks(scores, targets).tolist() == [2, 0, 4]
    assert target_ranks(scores, targets, seen).tolist() == [0, 4, 4]
    with pytest.raises(ValueError, match="exclude"):
        target_ranks(scores, targets, seen[:, 1:])
    with pytest.raises(ValueError, match="0..5"):
        history_mask(torch.tensor([6]), torch.tensor([0, 1]), num_items=5)
    with pytest.raises(ValueError, match="offsets"):
        history_mask(item_ids, torch.tensor([0, 2]), num_items=5)


# ------------------------------------------------------------------ NE and AUC (gemray.metrics.BinaryMetrics)

from gemray.metrics import BinaryMetrics, MultiTaskMetrics  # noqa: E402


def _exact_auc(scores, labels):
    """AUC by counting every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _logit(p):
    return math.log(p / (1 - p))


def test_ne_of_the_base_rate_predictor_is_one():
    labels = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1, 0, 0], dtype=torch.float32)  # base rate 0.3
    m = BinaryMetrics()
    m.update(torch.full((10,), _logit(0.3)), labels)
    out = m.compute()
    assert out["ne"] == pytest.approx(1.0, abs=1e-12)
    assert out["base_rate"] == pytest.approx(0.3)
    assert out["calibration"] == pytest.approx(1.0)
    assert out["logloss"] == pytest.approx(-(0.3 * math.log(0.3) + 0.7 * math.log(0.7)))
    assert out["auc"] == pytest.approx(0.5)  # every pair ties


def test_ne_by_hand():
    # p = [0.9, 0.2, 0.6, 0.1], y = [1, 0, 0, 1]: logloss = -(ln .9 + ln .8 + ln .4 + ln .1) / 4; base rate 0.5
    p, y = [0.9, 0.2, 0.6, 0.1], [1.0, 0.0, 0.0, 1.0]
    m = BinaryMetrics(num_bins=8)
    m.update(torch.tensor([_logit(x) for x in p]), torch.tensor(y))
    ll = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.1)) / 4
    out = m.compute()
    assert out["logloss"] == pytest.approx(ll)
    assert out["ne"] == pytest.approx(ll / math.log(2))
    assert out["ne"] > 1.0  # worse than predicting the base rate
    # pairs (pos, neg): (.9,.2) win, (.9,.6) win, (.1,.2) loss, (.1,.6) loss -> 0.5, in distinct bins of 8
    assert out["auc"] == pytest.approx(_exact_auc(p, y)) == pytest.approx(0.5)
    assert out["auc_error_bound"] == 0.0


def test_auc_perfect_reversed_and_random():
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(500, generator=g) < 0.3).float()
    score = torch.randn(500, generator=g)
    perfect = torch.where(y > 0, 3.0 + score.abs(), -3.0 - score.abs())
    for z, expected in ((perfect, 1.0), (-perfect, 0.0)):
        m = BinaryMetrics()
        m.update(z, y)
        assert m.compute()["auc"] == expected
    m = BinaryMetrics()
    m.update(score, y)
    out = m.compute()
    exact = _exact_auc(torch.sigmoid(score.double()).tolist(), y.tolist())
    assert abs(out["auc"] - exact) <= out["auc_error_bound"] + 1e-12
    assert abs(out["auc"] - 0.5) < 0.1  # random scores


def test_auc_error_bound_holds_when_bins_are_coarse():
    g = torch.Generator().manual_seed(1)
    y = (torch.rand(300, generator=g) < 0.5).float()
    z = torch.randn(300, generator=g) + y
    exact = _exact_auc(torch.sigmoid(z.double()).tolist(), y.tolist())
    for bins in (2, 16, 1 << 16):
        m = BinaryMetrics(num_bins=bins)
        m.update(z, y)
        out = m.compute()
        assert abs(out["auc"] - exact) <= out["auc_error_bound"] + 1e-12
    coarse, fine = BinaryMetrics(num_bins=4), BinaryMetrics(num_bins=1 << 16)
    coarse.update(z, y)
    fine.update(z, y)
    assert coarse.compute()["auc_error_bound"] > 100 * fine.compute()["auc_error_bound"]


def test_binary_sums_add_like_all_reduce_and_mask_selects():
    g = torch.Generator().manual_seed(2)
    z, y = torch.randn(40, generator=g), (torch.rand(40, generator=g) < 0.4).float()
    a, b, both = BinaryMetrics(num_bins=64), BinaryMetrics(num_bins=64), BinaryMetrics(num_bins=64)
    a.update(z[:15], y[:15])
    b.update(z[15:], y[15:])
    both.update(z, y)
    assert a.compute(a.sums() + b.sums()) == pytest.approx(both.compute())
    mask = torch.arange(40) % 3 == 0
    masked, sub = BinaryMetrics(num_bins=64), BinaryMetrics(num_bins=64)
    masked.update(z, y, mask)
    sub.update(z[mask], y[mask])
    assert masked.compute() == pytest.approx(sub.compute())


def test_binary_undefined_and_bad_inputs():
    m = BinaryMetrics()
    out = m.compute()
    assert out["num_examples"] == 0 and math.isnan(out["ne"]) and math.isnan(out["auc"])
    m.update(torch.tensor([0.3, -1.0]), torch.tensor([1.0, 1.0]))  # one class only
    out = m.compute()
    assert math.isnan(out["ne"]) and math.isnan(out["auc"]) and out["num_examples"] == 2
    with pytest.raises(ValueError, match="0 or 1"):
        m.update(torch.tensor([0.0]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="finite"):
        m.update(torch.tensor([float("nan")]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="entries"):
        m.compute(torch.zeros(3))


def test_multitask_metrics_per_task_populations():
    logits = torch.tensor([[2.0, 1.0], [-1.0, 3.0], [0.5, -2.0], [-2.0, 0.0]])
    targets = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    pop = torch.tensor([[True, True], [True, False], [True, True], [True, False]])  # CVR on clicked rows
    m = MultiTaskMetrics(["ctr", "cvr"], num_bins=1024)
    m.update(logits, targets, pop)
    out = m.compute(m.sums())
    assert out["ctr_num_examples"] == 4 and out["cvr_num_examples"] == 2
    assert out["ctr_auc"] == 1.0 and out["cvr_auc"] == 1.0  # cvr: row 0 (pos, 1.0) vs row 2 (neg, -2.0)
    assert out["cvr_base_rate"] == 0.5
