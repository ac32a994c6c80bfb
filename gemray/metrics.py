"""Retrieval metrics, HSTU protocol: leave-one-out, full ranking over all items, HR@K and NDCG@K.

Shape key: B users, N items (ids 1..N; id 0 is padding).

Protocol (Zhai et al. 2024, arXiv:2402.17152, sec. 4.1.1; generative-recommenders ``eval.py``): each user's
held-out next item is ranked against every item; ``rank`` = how many other real items score at least as
high as the target (0 = top). generative-recommenders, which produced the published ML-1M numbers, removes
the items of the user's history (the model's input) from the ranking first (``eval_metrics_v2_from_tensors``
with its default ``filter_invalid_ids=True``): ``target_ranks(..., exclude=history_mask(...))`` does the
same, and a target that is itself in the history then counts as a miss (ranked last), as there. Ties
count against the target (pessimistic), and so does a NaN score: a collapsed model whose scores are all
equal, or NaN, ranks last instead of first. With float scores from
distinct embeddings exact ties are rare. HR@K = mean(rank < K), NDCG@K = mean(1 / log2(rank + 2) if
rank < K else 0) (one relevant item, so IDCG = 1).

Distributed use: every rank ``update``s with its users, ``all_reduce``s ``sums()`` and calls
``compute(summed)``.
"""

from __future__ import annotations

import torch


def history_mask(item_ids: torch.Tensor, offsets: torch.Tensor, num_items: int) -> torch.Tensor:
    """[B, N+1] bool, True at (b, j) when item id j occurs in sequence b of a jagged batch.

    item_ids: [T] int64 in 0..N (the model's input histories), offsets: [B+1] int64.
    Raises ValueError on an id outside 0..N or offsets that do not cover item_ids.
    """
    B = offsets.numel() - 1
    if B < 0 or int(offsets[-1]) != item_ids.numel():
        raise ValueError(f"history_mask: offsets must end at len(item_ids) = {item_ids.numel()}")
    if item_ids.numel() and (int(item_ids.min()) < 0 or int(item_ids.max()) > num_items):
        raise ValueError(f"history_mask: item ids must lie in 0..{num_items}, got range "
                         f"[{int(item_ids.min())}, {int(item_ids.max())}]")
    lengths = offsets[1:] - offsets[:-1]
    seg = torch.repeat_interleave(torch.arange(B, device=item_ids.device), lengths)
    mask = torch.zeros(B, num_items + 1, dtype=torch.bool, device=item_ids.device)
    mask[seg, item_ids] = True
    return mask


def target_ranks(scores: torch.Tensor, targets: torch.Tensor,
                 exclude: torch.Tensor | None = None) -> torch.Tensor:
    """0-based rank of each target among all real items (minus the ``exclude``d ones).

    Args:
        scores: [B, N+1] float, column j = score of item id j; column 0 (padding id) is excluded.
        targets: [B] int64 in 1..N.
        exclude: optional [B, N+1] bool, True = item not ranked for that user (e.g. ``history_mask``).
    Returns:
        [B] int64: number of other ranked real items (ids 1..N) that score >= the target or NaN (a NaN
        target score ranks N-1, last). An excluded target ranks N-1 (a miss at every K < N).
    Raises:
        ValueError: shape mismatch or a target outside 1..N.
    """
    if scores.dim() != 2 or targets.dim() != 1 or scores.shape[0] != targets.shape[0]:
        raise ValueError(f"target_ranks: expected scores [B, N+1] and targets [B], got "
                         f"{tuple(scores.shape)} and {tuple(targets.shape)}")
    if exclude is not None and (exclude.shape != scores.shape or exclude.dtype != torch.bool):
        raise ValueError(f"target_ranks: exclude must be a bool mask shaped like scores {tuple(scores.shape)}, "
                         f"got {exclude.dtype} {tuple(exclude.shape)}")
    n_items = scores.shape[1] - 1
    if targets.numel() and (int(targets.min()) < 1 or int(targets.max()) > n_items):
        raise ValueError(f"target_ranks: targets must be item ids in 1..{n_items}, got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")
    tgt = scores.gather(1, targets.view(-1, 1))  # [B, 1]
    # not (s < t) is true for s >= t and for NaN on either side; minus 1 for the target itself
    at_least = ~(scores[:, 1:] < tgt)
    if exclude is None:
        return (at_least.sum(dim=1) - 1).to(torch.int64)
    ranks = (at_least & ~exclude[:, 1:]).sum(dim=1) - 1
    missed = exclude.gather(1, targets.view(-1, 1)).view(-1)
    return torch.where(missed, torch.full_like(ranks, n_items - 1), ranks).to(torch.int64)


class RetrievalMetrics:
    """Accumulates HR@K / NDCG@K over batches of ranks.

    ``ks``: cut-offs, e.g. [10, 50, 200]. ``sums()`` is a float64 vector
    [num_users, hits@k..., ndcg@k...] (sum over users) that can be all-reduced across ranks.
    """

    def __init__(self, ks: list[int] | tuple[int, ...]):
        ks = [int(k) for k in ks]
        if not ks or any(k <= 0 for k in ks):
            raise ValueError(f"RetrievalMetrics: ks must be positive cut-offs, got {ks}")
        self.ks = ks
        self._sums = torch.zeros(1 + 2 * len(ks), dtype=torch.float64)

    def reset(self) -> None:
        self._sums.zero_()

    def update(self, ranks: torch.Tensor) -> None:
        """Add a batch: ranks [B] int64 (from ``target_ranks``), >= 0."""
        r = ranks.detach().to("cpu", torch.float64).view(-1)
        if r.numel() and float(r.min()) < 0:
            raise ValueError("RetrievalMetrics.update: ranks must be >= 0")
        self._sums[0] += r.numel()
        gain = 1.0 / torch.log2(r + 2.0)
        for i, k in enumerate(self.ks):
            hit = r < k
            self._sums[1 + i] += hit.sum()
            self._sums[1 + len(self.ks) + i] += (gain * hit).sum()

    def sums(self) -> torch.Tensor:
        """[1 + 2*len(ks)] float64 copy: num_users, hits per k, ndcg sums per k."""
        return self._sums.clone()

    def compute(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        """{"hr@K": .., "ndcg@K": .., "num_users": ..} from ``sums`` (e.g. all-reduced) or the local ones.

        With zero users every metric is 0.0.
        """
        s = (self._sums if sums is None else sums).to(torch.float64).cpu()
        if s.numel() != self._sums.numel():
            raise ValueError(f"RetrievalMetrics.compute: sums must have {self._sums.numel()} entries")
        n = float(s[0])
        out: dict[str, float] = {}
        for i, k in enumerate(self.ks):
            out[f"hr@{k}"] = float(s[1 + i]) / n if n else 0.0
            out[f"ndcg@{k}"] = float(s[1 + len(self.ks) + i]) / n if n else 0.0
        out["num_users"] = n
        return out
