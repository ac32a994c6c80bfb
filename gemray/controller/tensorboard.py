"""TensorBoard event files (and, optionally, MLflow metrics) of a run, from the values that go into metrics.json.

``tensorboard --logdir runs/`` shows every run whose output folder is under ``runs/``: the driver writes
``<output>/tensorboard/events.out.tfevents.*`` with :class:`torch.utils.tensorboard.SummaryWriter` when the
run ends (trained to the end or preempted), rewritten in full from the run's record, so a resumed run shows
one curve over all its invocations. Tags (:func:`scalars`):

* ``step/train_loss``: rank 0's loss per global step (its ``step`` events in events.jsonl);
* ``step/lr``: the base dense learning rate of each global step (``train.lr`` x the ``lr_warmup_steps``
  factor, before the per-group ``lr_base_fan_in`` multipliers), from the same events;
* ``epoch/<key>``: each numeric per-epoch field of metrics.json's ``history`` at x = the epoch (1-based):
  ``train_loss``, ``samples_per_s``, ``tokens_per_s``, ``token_imbalance``, ``valid_hr@K``, ``valid_ndcg@K``,
  ``epoch_s``, ``train_s``, and MFU fields when the history has them;
* ``test/<key>``: metrics.json's test ``hr@K`` / ``ndcg@K`` (and ``_unfiltered``) and
  ``targets_in_history``, and each numeric ranking-task test metric ``test_<task>_<metric>`` as
  ``test/<task>_<metric>`` (``test/ctr_ne``, ``test/ctr_auc``, ``test/cvr_calibration``, ...) at x = the last
  epoch (a NaN, e.g. the AUC of a task with no positives, is left out, as in the other groups);
* ``run/<key>``: ``samples_per_s``, ``tokens_per_s``, ``model_tflops_per_s``, ``local_mfu``, ``e2e_mfu``,
  ``scaling_ratio`` (those measured: a null MFU is left out), ``wall_s``, ``bbs_imbalance`` at x = the last epoch.

MLflow: with ``GEMRAY_MLFLOW=1`` in the driver's environment and ``mlflow`` importable, the same scalars are
logged to an MLflow run named after the job (MLflow's own ``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_NAME``
choose where), ``@`` spelled ``_at_`` (MLflow metric names allow no ``@``). Neither library is required: a
missing one is one warning, never a failed run.

:func:`scalars` is pure; :func:`write_tensorboard`, :func:`log_mlflow` and :func:`export` act.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TB_DIR = "tensorboard"  #: relative to the run's output folder
_EPOCH_SKIP = ("epoch", "global_step", "final", "world_size")
_TEST_KEYS = ("hr@", "ndcg@", "targets_in_history")
_RUN_KEYS = ("samples_per_s", "tokens_per_s", "model_tflops_per_s", "local_mfu", "e2e_mfu", "scaling_ratio", "wall_s",
             "bbs_imbalance")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(metrics: Mapping[str, Any], events: list[Mapping[str, Any]] = ()) -> list[tuple[str, float, int]]:
    """Pure: ``(tag, value, step)`` for TensorBoard from a run's metrics.json dict and its events (dicts of
    gemray.events.Event; the ``step`` events with a ``loss`` / ``lr`` give ``step/train_loss`` / ``step/lr`` at
    their global step, the last event of a step wins: a restarted attempt repeats steps). See the module
    docstring for the tags."""
    out: list[tuple[str, float, int]] = []
    per_step: dict[str, dict[int, float]] = {"loss": {}, "lr": {}}
    for e in events:
        d = e.get("detail", {})
        if e.get("kind") != "step":
            continue
        for key, values in per_step.items():
            if _number(d.get(key)):
                values[int(d["global_step"])] = float(d[key])
    out += [("step/train_loss", v, s) for s, v in sorted(per_step["loss"].items())]
    out += [("step/lr", v, s) for s, v in sorted(per_step["lr"].items())]
    history = metrics.get("history") or []
    for i, h in enumerate(history):
        x = int(h.get("epoch", i + 1))
        out += [(f"epoch/{k}", float(v), x) for k, v in sorted(h.items()) if k not in _EPOCH_SKIP and _number(v)]
    last = int(metrics.get("epochs") or (history[-1].get("epoch", len(history)) if history else 0))
    test = {f"test/{k}": v for k, v in metrics.items() if k.startswith(_TEST_KEYS) and _number(v)}
    # the ranking tasks' test metrics, kept in metrics.json under their reported names (test_ctr_ne, ...)
    test.update({f"test/{k[len('test_'):]}": v for k, v in metrics.items() if k.startswith("test_") and _number(v)})
    out += [(tag, float(v), last) for tag, v in sorted(test.items())]
    out += [(f"run/{k}", float(metrics[k]), last) for k in _RUN_KEYS if _number(metrics.get(k))]
    return out


def write_tensorboard(out: Path, points: list[tuple[str, float, int]]) -> Path | None:
    """Write ``points`` to ``out/tensorboard`` (event files written there before are replaced); returns the
    folder, or None (with a warning) when TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        log.warning("no TensorBoard event files: %s (pip install tensorboard)", e)
        return None
    tb = Path(out) / TB_DIR
    tb.mkdir(parents=True, exist_ok=True)
    for old in tb.glob("events.out.tfevents.*"):  # ours, from an earlier invocation: rewritten in full below
        old.unlink()
    writer = SummaryWriter(log_dir=str(tb))
    try:
        for tag, value, step in points:
            writer.add_scalar(tag, value, global_step=step)
    finally:
        writer.close()
    return tb


def log_mlflow(run_name: str, points: list[tuple[str, float, int]], environ: Mapping[str, str] = os.environ) -> bool:
    """Log ``points`` to MLflow when ``GEMRAY_MLFLOW`` is 1/true/yes and mlflow imports; True if logged."""
    if environ.get("GEMRAY_MLFLOW", "").lower() not in ("1", "true", "yes"):
        return False
    try:
        import mlflow
    except ImportError:
        log.warning("GEMRAY_MLFLOW is set but mlflow is not installed (pip install mlflow): not logging to MLflow")
        return False
    with mlflow.start_run(run_name=run_name):
        for tag, value, step in points:
            mlflow.log_metric(tag.replace("@", "_at_"), value, step=step)
    return True


def export(run_name: str, out: Path, metrics: Mapping[str, Any], events: list[Mapping[str, Any]]) -> None:
    """The run's scalars (:func:`scalars`) to TensorBoard and, when asked for, MLflow. Best effort: an error
    is one warning; the run's results are already written."""
    try:
        points = scalars(metrics, events)
        tb = write_tensorboard(out, points)
        if tb is not None:
            log.info("TensorBoard: tensorboard --logdir %s", tb.parent)
        log_mlflow(run_name, points)
    except Exception as e:  # never fail a finished run over its dashboards
        log.warning("could not write the TensorBoard / MLflow metrics: %s: %s", type(e).__name__, e)
