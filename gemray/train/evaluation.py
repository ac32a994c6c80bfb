"""Evaluators: per-batch metric sums that the trainer adds up and all-reduces over ranks.

An evaluator (the :class:`Evaluator` protocol) knows one task's metrics and nothing of ranks or streams:

    ctx = ev.prepare(model, device)              # once per pass (collective lookups allowed), e.g. item table
    s = ev.batch_sums(model, batch, ctx)         # [S] float64 on CPU, additive over batches and ranks
    out = ev.compute(summed)                     # {"name": value}

The trainer runs one pass over a split, feeding every batch to each evaluator, concatenates their sums,
all-reduces once and hands each evaluator its slice (``gemray.train.trainer.Trainer.evaluate``). Collective
discipline: ``prepare`` and ``batch_sums`` run on every rank the same number of times (an empty batch,
B=0, still calls the model), so evaluators must not skip the model call for empty batches.

Retrieval (:class:`RetrievalEvaluator`) follows the HSTU protocol (``gemray.metrics``). Ranking
(:class:`RankingEvaluator`) scores the held-out requests' candidates: NE and AUC per task (CTR / CVR,
``gemray.metrics.MultiTaskMetrics``), each task on the population it is trained on.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gemray.config import ModelConfig
from gemray.metrics import DEFAULT_AUC_BINS, MultiTaskMetrics, RetrievalMetrics, history_mask, target_ranks
from gemray.model.ranking import MultiTaskHead


class Evaluator(Protocol):
    """One task's evaluation metrics as additive sums (see the module docstring)."""

    def num_sums(self) -> int:
        """S, the length of the sums vector."""

    def prepare(self, model: torch.nn.Module, device: torch.device) -> Any:
        """Per-pass context (called in eval mode under no_grad, on every rank)."""

    def batch_sums(self, model: torch.nn.Module, batch: Any, ctx: Any) -> torch.Tensor:
        """[S] float64 CPU sums of one batch (already on the model's device)."""

    def compute(self, sums: torch.Tensor) -> dict[str, float]:
        """Metrics from [S] summed sums."""


class RetrievalEvaluator:
    """HR@K / NDCG@K of next-item retrieval, each user's held-out item ranked against ALL items.

    Item table: ``model.item_embeddings(arange(0, N+1))`` -> [N+1, D] (same ids on every rank: the lookup
    is collective; column 0 is the padding id, excluded by ``target_ranks``). Per batch: users
    ``model.user_embeddings(batch)`` [B, D] @ items.T -> scores [B, N+1]. With ``exclude_history`` the items
    of each user's input history are not ranked (``history_mask``, generative-recommenders' protocol) and the
    all-items figures come too, as ``hr@K_unfiltered``.

    num_items: N; ks: cut-offs (e.g. [10, 50, 200]). Sums layout: [users, hits@K..., ndcg@K...] filtered,
    the same unfiltered, targets found in their history (with ``exclude_history``; else the first part only).
    ``compute`` -> {"hr@K", "ndcg@K", "num_users"[, "hr@K_unfiltered", "ndcg@K_unfiltered",
    "targets_in_history"]}. Raises ValueError for num_items < 1 or bad cut-offs.
    """

    def __init__(self, num_items: int, ks: list[int], *, exclude_history: bool = True):
        if num_items < 1:
            raise ValueError(f"RetrievalEvaluator: num_items must be >= 1, got {num_items}")
        self.num_items, self.ks, self.exclude_history = int(num_items), list(ks), bool(exclude_history)
        self._n = RetrievalMetrics(self.ks).sums().numel()

    def num_sums(self) -> int:
        return 2 * self._n + 1 if self.exclude_history else self._n

    def prepare(self, model: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """The item table [N+1, D], unit norm (a collective lookup through the sharded embeddings)."""
        return model.item_embeddings(torch.arange(0, self.num_items + 1, device=device))

    def batch_sums(self, model: torch.nn.Module, batch: Any, items: torch.Tensor) -> torch.Tensor:
        users = model.user_embeddings(batch)  # [B, D]; called for B=0 too (collective lookups)
        if not batch.batch_size:
            return torch.zeros(self.num_sums(), dtype=torch.float64)
        with torch.autocast(users.device.type, enabled=False):  # full-precision scores under train.precision
            scores = users.float() @ items.float().T  # [B, N+1]; bf16 scores would tie and rank pessimistically
        filtered = RetrievalMetrics(self.ks)
        if not self.exclude_history:
            filtered.update(target_ranks(scores, batch.targets))
            return filtered.sums()
        unfiltered = RetrievalMetrics(self.ks)
        seen = history_mask(batch.item_ids, batch.offsets, self.num_items)
        filtered.update(target_ranks(scores, batch.targets, seen))
        unfiltered.update(target_ranks(scores, batch.targets))
        in_history = torch.tensor([float(seen.gather(1, batch.targets.view(-1, 1)).sum())], dtype=torch.float64)
        return torch.cat([filtered.sums(), unfiltered.sums(), in_history])

    def compute(self, sums: torch.Tensor) -> dict[str, float]:
        n, metrics = self._n, RetrievalMetrics(self.ks)
        out = metrics.compute(sums[:n])
        if self.exclude_history:
            out.update({f"{k}_unfiltered": v for k, v in metrics.compute(sums[n:2 * n]).items()
                        if k != "num_users"})
            out["targets_in_history"] = float(sums[2 * n])
        return out


class RankingEvaluator:
    """NE / AUC / log loss / calibration per ranking task over the candidates of a split's requests.

    Per batch: ``model.ranking_logits(batch)`` [C, K] (called for B = 0 too: collective lookups); targets and
    populations from ``MultiTaskHead.targets_and_populations(batch.labels)`` ("ctr": click over every
    candidate; "cvr": convert over the clicked candidates, or all with ``cvr_population = "all"``), the same
    as training; sums of ``gemray.metrics.MultiTaskMetrics`` (K tasks x (4 + 2 num_bins) float64, additive).
    A split's stream carries the candidates of that split's requests only (``gemray.pipelines.stream``), so
    no label is scored twice or trained on.

    ``compute`` -> {"<task>_ne", "<task>_auc", "<task>_auc_error_bound", "<task>_logloss", "<task>_base_rate",
    "<task>_calibration", "<task>_num_examples"} (NaN where undefined, e.g. no positives); the trainer
    prefixes them with the split (``test_ctr_ne``). Raises ValueError on bad tasks / populations / bins.
    """

    def __init__(self, tasks: list[str], *, cvr_population: str = "clicked", num_bins: int = DEFAULT_AUC_BINS):
        self.head = MultiTaskHead(tasks, None, cvr_population)
        self.tasks, self.num_bins = list(tasks), int(num_bins)
        self._n = MultiTaskMetrics(self.tasks, self.num_bins).sums().numel()

    @classmethod
    def from_config(cls, cfg: ModelConfig, num_bins: int = DEFAULT_AUC_BINS) -> "RankingEvaluator":
        """The evaluator of ``cfg``'s ranking tasks and CVR population."""
        return cls(cfg.ranking_tasks, cvr_population=cfg.cvr_population, num_bins=num_bins)

    def num_sums(self) -> int:
        return self._n

    def prepare(self, model: torch.nn.Module, device: torch.device) -> None:
        return None

    def batch_sums(self, model: torch.nn.Module, batch: Any, ctx: Any) -> torch.Tensor:
        logits = model.ranking_logits(batch)  # [C, K]; called for B=0 too (collective lookups)
        metrics = MultiTaskMetrics(self.tasks, self.num_bins)
        if batch.batch_size and batch.labels is not None and logits.shape[0]:
            targets, pop = self.head.targets_and_populations(batch.labels)
            metrics.update(logits.float(), targets, pop)
        return metrics.sums()

    def compute(self, sums: torch.Tensor) -> dict[str, float]:
        return MultiTaskMetrics(self.tasks, self.num_bins).compute(sums)
