"""``gemray evaluate``: a checkpoint's metrics on a split, at any cut-offs, on the run's or another prepared data.

The same code path as training's evaluation (``gemray.train.trainer.Trainer.evaluate``): the evaluators the
config implies (``gemray.train.evaluation.build_evaluators``: HR@K / NDCG@K over all items, history excluded
per ``train.eval_exclude_history``; a ranking task's NE / AUC evaluator joins there), one pass over the split
(``evaluation_sums``), the sums added over ranks, ``evaluation_metrics``. The split is partitioned as the
training partitioned it (``world_size`` ranks, each one's ``HistoryStream`` in turn, their sums added in rank
order as the all-reduce adds them), so the checkpoint of a finished run reproduces the test figures of its
``metrics.json`` exactly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from gemray.config import cutoff_advice, usable_cpus
from gemray.serve.model import TrainedModel, check_data

log = logging.getLogger(__name__)

SPLITS = ("valid", "test")


def check_arguments(split: str = "test", ks: list[int] | None = None, world_size: int | None = None) -> None:
    """Pure: refuse arguments :func:`evaluate` cannot use, before any model or data is loaded (``gemray evaluate``
    calls it first): an unknown ``split``, cut-offs ``ks`` that are empty or below 1, a ``world_size`` below 1
    (None: the default). Raises ValueError naming the command-line flag (``--split``, ``--k``, ``--world-size``).
    Cut-offs above the catalogue's size are refused by :func:`check_cutoffs`, once the item count is known."""
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")
    if ks is not None:
        bad = [k for k in ks if int(k) < 1]
        if not ks or bad:
            raise ValueError(f"--k {' '.join(str(k) for k in ks) or '(none)'}: every cut-off must be >= 1"
                             + (f" (got {', '.join(str(k) for k in bad)})" if bad else ""))
    if world_size is not None and int(world_size) < 1:
        raise ValueError(f"--world-size {world_size}: expected >= 1")


def check_cutoffs(ks: list[int] | None, num_items: int) -> None:
    """Pure: refuse cut-offs ``ks`` (None: the run's ``train.eval_ks``, which ``gemray train`` checked) at or above
    the ``num_items`` items of the catalogue, which make HR@K trivially 1. ``gemray evaluate`` calls it with the item
    count of the data's manifest before the model is loaded (it was refused only after the load);
    :func:`evaluate` with the model's. Raises ValueError naming ``--k``, the count, the largest cut-off allowed and
    ``--k`` values that would pass (:func:`gemray.config.cutoff_advice`)."""
    if ks is None:
        return
    above = [int(k) for k in ks if int(k) >= num_items]
    if above:
        advice = cutoff_advice(ks, num_items, lambda kept: "--k " + " ".join(map(str, kept)))
        raise ValueError(f"--k {' '.join(str(k) for k in ks)}: a cut-off at or above the {num_items} items of the "
                         f"catalogue ({', '.join(str(k) for k in above)}) makes HR@K trivially 1 (every target ranks "
                         f"below N, a history-excluded one at N-1; as gemray train refuses it); {advice}")


def result_path(base: str | Path, split: str, prepared_dir: str | Path | None = None,
                run_prepared_dir: str | Path | None = None) -> Path:
    """Pure: where ``gemray evaluate`` writes its JSON by default, in the folder ``base`` (the run's output folder,
    or beside the checkpoint). ``evaluate_<split>.json`` for the run's own data (no ``--data``, or ``--data``
    naming ``run_prepared_dir``, the run's ``data.prepared_dir``); for other data
    ``evaluate_<split>.<data folder name>.json``, so that an evaluation of foreign data never replaces the run's
    evaluation of its own (it did: ``evaluate_test.json`` held whichever ran last). Paths are compared resolved
    (relative ones against the working directory, as :func:`evaluate` reads them)."""
    name = f"evaluate_{split}"
    if prepared_dir is not None:
        d = Path(prepared_dir).expanduser().resolve()
        if run_prepared_dir is None or d != Path(run_prepared_dir).expanduser().resolve():
            name += f".{d.name}"
    return Path(base) / f"{name}.json"


def rank_threads(cfg: Any) -> int:
    """Pure: the intra-op threads a CPU training rank of ``cfg`` (a ``JobConfig``) computes with: Ray sets each
    worker's ``OMP_NUM_THREADS`` to the floor of its CPUs, ``ray.cpus_per_worker``, at least 1."""
    return max(1, math.floor(float(cfg.ray.cpus_per_worker)))


@contextlib.contextmanager
def _intra_op_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def evaluate(trained: TrainedModel, split: str = "test", *, ks: list[int] | None = None,
             prepared_dir: str | Path | None = None, world_size: int | None = None,
             manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Metrics of ``trained`` on ``split`` ("valid" or "test").

    ks: HR@K / NDCG@K cut-offs (default the run's ``train.eval_ks``); prepared_dir: another prepared folder
    with the same item vocabulary (default the run's ``data.prepared_dir``; see
    :func:`gemray.serve.model.check_data`); world_size: how many ranks' streams to partition the split into
    (default the world size the checkpoint was saved by: the partition its training evaluated with; the
    figures do not depend on it beyond float rounding); manifest: the manifest of ``prepared_dir`` when the
    caller has read it already (``gemray evaluate --data``: before loading the model), not read again.

    On the CPU the pass computes with the intra-op threads of one training rank (:func:`rank_threads`: 1 for
    ``ray.cpus_per_worker = 1``), not torch's default pool over every core: that pass is thousands of small
    operators, each waiting for the pool's slowest thread, and with another job on the cores it took 68-135 s on
    an ML-1M checkpoint against ~20 s for the same pass inside ``gemray train`` (2 cores, 2026-12-06).

    Returns ``{"checkpoint", "split", "prepared_dir", "world_size", "epoch", "global_step", "seconds", "threads",
    "metrics": {"hr@K", "ndcg@K", "num_users", ["hr@K_unfiltered", ..., "targets_in_history"], and per ranking
    task "<task>_ne", "<task>_auc", "<task>_auc_error_bound", "<task>_calibration", ...}}``.
    Raises ValueError for an unknown split, bad cut-offs or world size (:func:`check_arguments`; cut-offs above the
    catalogue's size too: :func:`check_cutoffs`) or data that does not fit the model.
    """
    from gemray.pipelines.stream import HistoryStream
    from gemray.train.evaluation import build_evaluators, evaluation_metrics, evaluation_sums

    check_arguments(split, ks, world_size)
    check_cutoffs(ks, trained.num_items)
    cfg = trained.cfg
    data_cfg = copy.deepcopy(cfg.data)
    data_cfg.prepared_dir = str(Path(prepared_dir or data_cfg.prepared_dir).expanduser().resolve())
    data_cfg.reader = "arrow"  # the same table as Ray Data reads, in this process
    check_data(trained, data_cfg.prepared_dir, manifest if prepared_dir is not None else None)
    world = int(world_size or trained.state.get("world_size") or 1)
    evaluators = build_evaluators(cfg, trained.num_items, [int(k) for k in ks] if ks else None)
    t0 = time.perf_counter()
    total = None
    cpu = trained.device.type == "cpu"
    threads = min(rank_threads(cfg), usable_cpus()) if cpu else torch.get_num_threads()
    with torch.no_grad(), (_intra_op_threads(threads) if cpu else contextlib.nullcontext()):
        for rank in range(world):
            stream = HistoryStream.from_config(data_cfg, split, rank=rank, world_size=world, seed=cfg.train.seed)
            part = torch.cat(evaluation_sums(trained.model, evaluators, stream.iter_epoch(0), trained.device,
                                             cfg.train.precision))
            total = part if total is None else total + part
    metrics = evaluation_metrics(evaluators, total)
    return {"checkpoint": str(trained.checkpoint), "split": split, "prepared_dir": data_cfg.prepared_dir,
            "world_size": world, "epoch": trained.state.get("epoch"), "global_step": trained.state.get("global_step"),
            "seconds": time.perf_counter() - t0, "threads": threads, "metrics": metrics}


def format_metrics(result: dict[str, Any]) -> str:
    """Plain-text table of an :func:`evaluate` result: one row per cut-off (HR, NDCG, and the all-items figures
    when history is excluded; no table for a model without the retrieval task), then one line per ranking task
    (NE, AUC +/- its error bound, calibration, log loss, base rate, examples), written by
    :func:`gemray.train.evaluation.ranking_summary` as ``gemray train`` logs its test line."""
    from gemray.train.evaluation import ranking_summary

    m = result["metrics"]
    ks = sorted({int(k.split("@")[1].split("_")[0]) for k in m if k.startswith("hr@")})
    lines = [f"{result['split']} split of {result['prepared_dir']}: {int(m.get('num_users', 0))} users, "
             f"checkpoint {result['checkpoint']} (epoch {result['epoch']}, global step {result['global_step']})"]
    unf = any(k.endswith("_unfiltered") for k in m)
    if ks:
        lines.append(f"{'K':>6}{'HR@K':>10}{'NDCG@K':>10}" + (f"{'HR@K all':>11}{'NDCG@K all':>12}" if unf else ""))
    for k in ks:
        row = f"{k:>6}{m[f'hr@{k}']:>10.4f}{m[f'ndcg@{k}']:>10.4f}"
        if unf:
            row += f"{m[f'hr@{k}_unfiltered']:>11.4f}{m[f'ndcg@{k}_unfiltered']:>12.4f}"
        lines.append(row)
    lines += ranking_summary(m)
    return "\n".join(lines)
