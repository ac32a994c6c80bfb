"""Evaluators: per-batch metric sums that the trainer adds up and all-reduces over ranks.

An evaluator (the :class:`Evaluator` protocol) knows one task's metrics and nothing of ranks or streams:

    ctx = ev.prepare(model, device)              # once per pass (collective lookups allowed), e.g. item table
    s = ev.batch_sums(model, batch, ctx)         # [S] float64 on CPU, additive over batches and ranks
    out = ev.compute(summed)                     # {"name": value}

The trainer runs one pass over a split, feeding every batch to each evaluator (:func:`evaluation_sums`),
all-reduces the concatenated sums once and hands each evaluator its slice (:func:`evaluation_metrics`;
``gemray.train.trainer.Trainer.evaluate``). ``gemray evaluate`` (``gemray.serve``) runs the same two functions
over the evaluators of :func:`build_evaluators` on one process, so it reproduces the trainer's figures. Collective
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
from gemray.train.precision import autocast


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


def build_evaluators(cfg: Any, num_items: int, ks: list[int] | None = None) -> list[Evaluator]:
    """The evaluators a job's config implies, in the order their metrics are merged: next-item retrieval
    (:class:`RetrievalEvaluator`, HR@K / NDCG@K at ``ks``, default ``cfg.train.eval_ks``, with
    ``cfg.train.eval_exclude_history``) when "retrieval" is in ``cfg.model.tasks``, then the ranking tasks'
    (:class:`RankingEvaluator`, NE / AUC per task) when it has "ctr" / "cvr". cfg: a
    ``gemray.config.JobConfig``; num_items: N."""
    evaluators: list[Evaluator] = []
    if "retrieval" in cfg.model.tasks:
        evaluators.append(RetrievalEvaluator(num_items, list(ks if ks is not None else cfg.train.eval_ks),
                                             exclude_history=cfg.train.eval_exclude_history))
    if cfg.model.ranking_tasks:
        evaluators.append(RankingEvaluator.from_config(cfg.model))
    return evaluators


def evaluation_sums(model: torch.nn.Module, evaluators: list[Evaluator], batches: Any,
                    device: torch.device, precision: str = "fp32") -> list[torch.Tensor]:
    """One pass of ``evaluators`` over ``batches`` (an iterable of JaggedBatch on CPU): each evaluator's
    ``prepare`` once, then ``batch_sums`` added up batch by batch. Returns one [S_e] float64 CPU tensor per
    evaluator (this process's sums; the trainer all-reduces their concatenation). Call under ``no_grad`` with
    the model in eval mode; collective when the model is sharded (every rank the same number of batches).
    precision: ``train.precision``; the forward passes run under its autocast (``gemray.train.precision``)."""
    with autocast(precision, device):
        ctxs = [ev.prepare(model, device) for ev in evaluators]
    sums = [torch.zeros(ev.num_sums(), dtype=torch.float64) for ev in evaluators]
    for batch in batches:
        batch = batch.to(device)
        for ev, ctx, s in zip(evaluators, ctxs, sums):
            with autocast(precision, device):
                s += ev.batch_sums(model, batch, ctx)
    return sums


def evaluation_metrics(evaluators: list[Evaluator], total: torch.Tensor) -> dict[str, float]:
    """The evaluators' metrics, merged in order, from ``total``: [sum of S_e] float64, the concatenation of
    their (summed over batches and ranks) sums. Raises ValueError when its length is not sum of S_e."""
    sizes = [ev.num_sums() for ev in evaluators]
    if total.numel() != sum(sizes):
        raise ValueError(f"evaluation_metrics: expected {sum(sizes)} sums for evaluators of sizes {sizes}, got "
                         f"{total.numel()}")
    out: dict[str, float] = {}
    for ev, part in zip(evaluators, torch.split(total.cpu(), sizes)):
        out.update(ev.compute(part))
    return out


def ranking_summary(metrics: dict[str, Any]) -> list[str]:
    """Pure: one line per ranking task of ``metrics`` (:class:`RankingEvaluator`'s unprefixed names, e.g.
    ``ctr_ne``; tasks in ``ModelConfig.RANKING_TASKS`` order, those without ``<task>_ne`` left out), e.g.
    ``ctr: NE 0.9300, AUC 0.6100 +/- 0.0040, calibration 1.0700, log loss 0.5200, base rate 0.2000, 640
    examples``. The AUC's ``+/- bound`` (its binning error bound) and each other figure appear when present; a NaN
    (e.g. the AUC of a task without positives) is printed as ``nan``. What ``gemray train`` logs as its test
    line and ``gemray evaluate`` prints under its table."""
    lines = []
    for task in ModelConfig.RANKING_TASKS:
        if f"{task}_ne" not in metrics:
            continue
        m = {k[len(task) + 1:]: v for k, v in metrics.items() if k.startswith(f"{task}_")}
        parts = [f"NE {m['ne']:.4f}"]
        if "auc" in m:
            bound = m.get("auc_error_bound")
            parts.append(f"AUC {m['auc']:.4f}" + ("" if bound is None else f" +/- {bound:.4f}"))
        parts += [f"{label} {m[k]:.4f}" for k, label in (("calibration", "calibration"), ("logloss", "log loss"),
                                                         ("base_rate", "base rate")) if k in m]
        if "num_examples" in m:
            parts.append(f"{m['num_examples']:.0f} examples")
        lines.append(f"{task}: " + ", ".join(parts))
    return lines


def split_summary(split: str, metrics: dict[str, Any]) -> str:
    """Pure: the trainer's log line of a split's metrics (:func:`evaluation_metrics`), e.g. ``test: hr@10=0.3000,
    ndcg@10=0.2000, num_users=32.0000; ctr: NE 0.9300, AUC 0.6100 +/- 0.0040, ...; cvr: ...``: the retrieval
    figures as ``key=value``, then each ranking task as :func:`ranking_summary` writes it."""
    prefixes = tuple(f"{t}_" for t in ModelConfig.RANKING_TASKS)
    rest = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if not k.startswith(prefixes))
    return f"{split}: " + "; ".join(([rest] if rest else []) + ranking_summary(metrics))


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
