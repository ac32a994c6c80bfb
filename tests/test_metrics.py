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
