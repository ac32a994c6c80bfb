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

Ranking metrics (``BinaryMetrics`` per binary task, ``MultiTaskMetrics`` for CTR / CVR): normalized entropy
(NE, He et al. 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook", ADKDD: the mean log loss
divided by the entropy of the empirical base rate, so 1.0 = no better than predicting the base rate, lower is
better) and ROC AUC from score histograms, both as sums that add across batches and ranks (same
``sums()`` / ``compute(summed)`` protocol).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


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


DEFAULT_AUC_BINS = 1 << 16


class BinaryMetrics:
    """Streaming NE, log loss, calibration and binned ROC AUC of one binary task.

    Args:
        num_bins: K >= 2 equal-width bins of the predicted probability sigmoid(logit) in [0, 1] for AUC
            (default 2^16: 1 MiB of float64 per task to all-reduce).
        device: where the sums live (the updates are moved there; e.g. the GPU, so histograms need no copy).

    ``sums()`` is a float64 vector [num_examples, positives, sum log loss (nats), sum predicted probability,
    positive counts per bin (K), negative counts per bin (K)]: every entry is a sum over examples, so batches
    and ranks combine by adding (all_reduce SUM), exactly (counts are integers below 2^53).

    AUC = P(score of a random positive > score of a random negative), ties 1/2. From the histograms:
    ``sum_k pos_k * (neg_<k + neg_k / 2) / (P * N)``. It is exact except for the (positive, negative) pairs
    that share a bin, each counted 1/2 while its true value is 0, 1/2 or 1: ``|AUC_binned - AUC_exact| <=
    sum_k pos_k * neg_k / (2 P N)``, reported as ``auc_error_bound`` (computed from the same sums, so every
    report carries its own bound; it grows when scores pile up in few bins, e.g. a saturated model, and
    shrinks with more bins: a bin holds probabilities 1/K wide). As torchmetrics' binned AUROC (thresholds
    on probabilities), with the bound made explicit.
    """

    def __init__(self, num_bins: int = DEFAULT_AUC_BINS, device: torch.device | str = "cpu"):
        if int(num_bins) < 2:
            raise ValueError(f"BinaryMetrics: num_bins must be >= 2, got {num_bins}")
        self.num_bins = int(num_bins)
        self.device = torch.device(device)
        self._sums = torch.zeros(4 + 2 * self.num_bins, dtype=torch.float64, device=self.device)

    def reset(self) -> None:
        self._sums.zero_()

    def update(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add examples: logits [N] float (pre-sigmoid), labels [N] 0/1 (float or int), mask [N] bool (only
        True rows count; e.g. CVR's clicked population). Raises ValueError on mismatched shapes, labels other
        than 0/1, or non-finite logits."""
        z = logits.detach().reshape(-1).to(self.device, torch.float64)
        y = labels.detach().reshape(-1).to(self.device, torch.float64)
        if z.shape != y.shape:
            raise ValueError(f"BinaryMetrics.update: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                             "differ in size")
        if mask is not None:
            m = mask.detach().reshape(-1).to(self.device, torch.bool)
            if m.shape != z.shape:
                raise ValueError(f"BinaryMetrics.update: mask {tuple(mask.shape)} does not match logits")
            z, y = z[m], y[m]
        if z.numel() == 0:
            return
        if bool(((y != 0) & (y != 1)).any()):
            raise ValueError("BinaryMetrics.update: labels must be 0 or 1")
        if not bool(torch.isfinite(z).all()):
            raise ValueError("BinaryMetrics.update: logits must be finite (NaN / inf scores have no rank)")
        p = torch.sigmoid(z)
        k = self.num_bins
        idx = (p * k).floor().clamp_(0, k - 1).to(torch.int64)
        pos = y > 0.5
        s = self._sums
        s[0] += z.numel()
        s[1] += y.sum()
        s[2] += F.binary_cross_entropy_with_logits(z, y, reduction="sum")
        s[3] += p.sum()
        s[4:4 + k] += torch.bincount(idx[pos], minlength=k).to(torch.float64)
        s[4 + k:] += torch.bincount(idx[~pos], minlength=k).to(torch.float64)

    def sums(self) -> torch.Tensor:
        """[4 + 2K] float64 copy on ``device`` (see the class docstring); all-reduce it with SUM."""
        return self._sums.clone()

    def compute(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        """{"ne", "logloss", "base_rate", "calibration", "auc", "auc_error_bound", "num_examples"} from ``sums``
        (e.g. all-reduced) or the local ones.

        ne = (logloss / n) / H(base_rate), H(p) = -p ln p - (1-p) ln(1-p); calibration = sum p / positives.
        Undefined values are NaN: everything with 0 examples, NE with a base rate of 0 or 1, AUC without both
        classes, calibration without positives.
        """
        s = (self._sums if sums is None else sums).to("cpu", torch.float64)
        if s.numel() != self._sums.numel():
            raise ValueError(f"BinaryMetrics.compute: sums must have {self._sums.numel()} entries, got {s.numel()}")
        n, npos, loss, psum = (float(x) for x in s[:4])
        nan = float("nan")
        k = self.num_bins
        hp, hn = s[4:4 + k], s[4 + k:]
        nneg = n - npos
        out = {"num_examples": n, "logloss": loss / n if n else nan, "base_rate": npos / n if n else nan,
               "calibration": psum / npos if npos else nan}
        rate = out["base_rate"]
        ent = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if n and 0 < rate < 1 else 0.0
        out["ne"] = out["logloss"] / ent if ent > 0 else nan
        if npos > 0 and nneg > 0:
            below = torch.cumsum(hn, 0) - hn  # negatives in lower bins
            out["auc"] = float((hp * (below + 0.5 * hn)).sum()) / (npos * nneg)
            out["auc_error_bound"] = float((hp * hn).sum()) / (2 * npos * nneg)
        else:
            out["auc"] = out["auc_error_bound"] = nan
        return out


class MultiTaskMetrics:
    """One ``BinaryMetrics`` per ranking task (e.g. ["ctr", "cvr"]); sums concatenated in task order.

    ``compute`` returns "<task>_<metric>" keys (``ctr_ne``, ``cvr_auc``, ...). Feed it the targets and
    populations of ``gemray.model.ranking.MultiTaskHead.targets_and_populations`` so evaluation scores
    each task on the candidates it is trained on.
    """

    def __init__(self, tasks: Sequence[str], num_bins: int = DEFAULT_AUC_BINS, device: torch.device | str = "cpu"):
        self.tasks = list(tasks)
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"MultiTaskMetrics: tasks must be distinct names, got {self.tasks}")
        self.metrics = [BinaryMetrics(num_bins, device) for _ in self.tasks]

    def reset(self) -> None:
        for m in self.metrics:
            m.reset()

    def update(self, logits: torch.Tensor, targets: torch.Tensor, populations: torch.Tensor | None = None) -> None:
        """logits [N, K], targets [N, K] 0/1, populations [N, K] bool or None (all count); K = len(tasks)."""
        K = len(self.tasks)
        if logits.dim() != 2 or logits.shape[1] != K or targets.shape != logits.shape or (
                populations is not None and populations.shape != logits.shape):
            raise ValueError(f"MultiTaskMetrics.update: expected logits, targets (and populations) [N, {K}], got "
                             f"{tuple(logits.shape)}, {tuple(targets.shape)}"
                             f"{'' if populations is None else ', ' + str(tuple(populations.shape))}")
        for j, m in enumerate(self.metrics):
            m.update(logits[:, j], targets[:, j], None if populations is None else populations[:, j])

    def sums(self) -> torch.Tensor:
        return torch.cat([m.sums() for m in self.metrics])

    def compute(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        size = self.metrics[0]._sums.numel()
        if sums is not None and sums.numel() != size * len(self.tasks):
            raise ValueError(f"MultiTaskMetrics.compute: sums must have {size * len(self.tasks)} entries")
        out: dict[str, float] = {}
        for j, (t, m) in enumerate(zip(self.tasks, self.metrics)):
            part = None if sums is None else sums.reshape(-1)[j * size:(j + 1) * size]
            out.update({f"{t}_{k}": v for k, v in m.compute(part).items()})
        return out
