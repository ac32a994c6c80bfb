"""What ``fit`` leaves in the output folder and hands back: ``metrics.json``, ``curves.png``, the table of this
run against the published ML-1M numbers, the TensorBoard event files (gemray.controller.tensorboard), and
:class:`Result`.

Pure: :func:`run_record` (what a resumed run carries over), :func:`attempt_outcome` (finished or preempted),
:func:`final_metrics`, :func:`preempted_metrics`, :func:`comparison_table`, :func:`no_test_line`. Acting:
:func:`finish` (a run that trained to the end, or had nothing left to train) and :func:`finish_preempted` (a run
stopped on a preemption notice after its emergency checkpoint) write the files, mark the notice and return the
:class:`Result`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemray.config import JobConfig
from gemray.controller import tensorboard
from gemray.events import epoch_fields, read_events, summarize_recovery
from gemray.preemption import clear_active, mark_handled, read_notice

log = logging.getLogger(__name__)

#: Published ML-1M results (HR@10, NDCG@10), Zhai et al. 2024 (HSTU) table 2.
PUBLISHED_ML1M = {"SASRec": (0.2853, 0.1603), "HSTU": (0.3097, 0.1720), "HSTU-large": (0.3294, 0.1893)}

#: Per-step / per-write markers: kept in events.jsonl, left out of metrics.json.
QUIET_KINDS = ("step", "checkpoint_begin")


@dataclass
class Result:
    """What ``fit`` returns: final metrics (test split + throughput), the last committed checkpoint's
    path (None if none was committed) and the output folder (absolute)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: str | None = None
    output_dir: str = ""


def previous_wall(metrics_path: Path) -> tuple[float, int]:
    """(wall_s, invocations) recorded by the previous invocation of a resumed run; (0.0, 0) when it wrote no
    metrics.json (killed) or the file cannot be read."""
    try:
        m = json.loads(metrics_path.read_text())
        return float(m.get("wall_s", 0.0)), int(m.get("invocations", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0, 0


def run_record(cfg: JobConfig, out: Path, previous: JobConfig | None) -> tuple[int, float, int]:
    """``(events_from, wall_before, invocations)`` for this invocation: a run resumed in its own output folder
    (``previous``: its config.toml, same job name) keeps its record, the events of every invocation (from 0)
    and wall_s summed over the invocations that wrote metrics.json; a fresh run starts both (its events from
    the end of ``train.events_path`` as it is now)."""
    if previous is not None and previous.name == cfg.name:
        wall_before, invocations = previous_wall(out / "metrics.json")
        return 0, wall_before, invocations + 1
    return len(read_events(cfg.train.events_path)), 0.0, 1


def throughput_metrics(history: list[dict[str, Any]], world_size: int,
                       reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pure: the run's throughput figures from its per-epoch reports (``gemray.train.stats.EpochStats.result``):
    ``tokens_per_s`` (mean over epochs, global), ``model_tflops_per_s`` (mean over epochs, global),
    ``local_mfu`` (the measured steps of all epochs: their FLOPs / their seconds / the device peak; null on CPU
    or without measured steps), ``scaling_ratio`` and ``e2e_mfu`` (:func:`gemray.train.throughput.scaling_fields`
    against ``reference``, a single-GPU run's figures, or None)."""
    from gemray.train.throughput import scaling_fields

    tps = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    tf = [h["model_tflops_per_s"] for h in history if h.get("model_tflops_per_s") is not None]
    flops = sum(float(h.get("mfu_flops") or 0.0) for h in history)
    secs = sum(float(h.get("mfu_rank_s") or 0.0) for h in history)
    peak = next((h["peak_flops"] for h in reversed(history) if h.get("peak_flops")), None)
    local = flops / secs / peak if peak and secs > 0 else None
    out: dict[str, Any] = {"tokens_per_s": sum(tps) / len(tps) if tps else 0.0,
                           "model_tflops_per_s": sum(tf) / len(tf) if tf else 0.0, "local_mfu": local}
    out.update(scaling_fields(world_size=world_size, tokens_per_s=out["tokens_per_s"], local_mfu=local,
                              reference=reference))
    return out


def load_scaling_reference(path: str) -> dict[str, Any] | None:
    """The single-GPU reference of ``train.scaling_reference`` ("" = None): a metrics.json or bench JSON with
    ``tokens_per_s`` (and ``local_mfu``). Raises FileNotFoundError / ValueError naming the file."""
    if not path:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"train.scaling_reference: no such file {p}")
    try:
        ref = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"train.scaling_reference {p}: not JSON ({e})") from e
    if not isinstance(ref, dict) or "tokens_per_s" not in ref:
        raise ValueError(f"train.scaling_reference {p}: no tokens_per_s field (expected a metrics.json of "
                         "`gemray train` or the --json of `gemray bench train`)")
    return {"tokens_per_s": ref["tokens_per_s"], "local_mfu": ref.get("local_mfu")}


def attempt_outcome(reported: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """Pure: how the run's last attempt ended, ``"preempted"`` (stopped on a preemption notice after its emergency
    checkpoint: exit 75, re-run to resume) or ``"finished"`` (trained to train.epochs, or had nothing to train).

    ``reported``: the ``ray.train.Result`` metrics, which are the latest *checkpoint's* report: an attempt that
    restores an emergency checkpoint and has nothing to train (the checkpoint has train.epochs or more epochs
    done) reports nothing, so its Result still carries that checkpoint's ``preempted``; read alone, it made the
    driver say "preempted" (exit 75) on every re-run, a loop under a RayJob. ``events``: this run's event log; the
    last attempt's own end (``finished`` or ``preempted``, rank 0's, see gemray.events) decides, the report's flag
    only when that attempt recorded neither (no event log)."""
    starts = [e for e in events if e.get("kind") == "attempt_start"]
    if starts:
        last = starts[-1].get("attempt")
        ends = {e["kind"] for e in events if e.get("attempt") == last and e.get("kind") in ("finished", "preempted")}
        if "finished" in ends:
            return "finished"
        if "preempted" in ends:
            return "preempted"
    return "preempted" if reported.get("preempted") else "finished"


def final_metrics(cfg: JobConfig, reported: dict[str, Any], events: list[dict[str, Any]], *, wall_s: float,
                  invocations: int, reference: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pure: metrics.json of a run that trained to the end, from the last report of rank 0 (``reported``:
    ``test_*`` metrics, ``history``, ``epoch``, ``world_size``) and this run's controller ``events``; see
    :func:`gemray.controller.run.fit` for the keys. ``reference``: the single-GPU run behind the scaling
    fields (:func:`throughput_metrics`)."""
    reported = dict(reported)
    history = list(reported.pop("history", []))
    metrics: dict[str, Any] = {k: reported[f"test_{k}"] for k in
                               [f"{m}@{k}{s}" for s in ("", "_unfiltered") for k in cfg.train.eval_ks
                                for m in ("hr", "ndcg")] + ["targets_in_history"]
                               if f"test_{k}" in reported}
    # ranking tasks (gemray.train.evaluation.RankingEvaluator): kept under their reported names, test_ctr_ne ...
    metrics.update({k: reported[k] for k in sorted(reported)
                    if any(k.startswith(f"test_{t}_") for t in cfg.model.ranking_tasks)})
    metrics["eval_exclude_history"] = cfg.train.eval_exclude_history
    metrics["num_test_users"] = reported.get("test_num_users")
    tput = [h["samples_per_s"] for h in history if "samples_per_s" in h]
    imb = [h["token_imbalance"] for h in history if "token_imbalance" in h]
    metrics.update({
        "samples_per_s": sum(tput) / len(tput) if tput else 0.0,
        "wall_s": wall_s,
        "invocations": invocations,
        # a mid-epoch report (an emergency checkpoint a run with nothing to train ended on) numbers "epoch" as the
        # one in progress: its epochs_completed is the count; an epoch-end report has "epoch" only
        "epochs": int(reported.get("epochs_completed", reported.get("epoch", len(history)))),
        "world_size": int(reported.get("world_size", cfg.ray.num_workers)),
        "bbs": cfg.data.bbs,
        "bbs_imbalance": sum(imb) / len(imb) if imb else 1.0,
        "history": history,
    })
    metrics.update(throughput_metrics(history, metrics["world_size"], reference))
    metrics["events"] = [e for e in events if e["kind"] not in QUIET_KINDS]  # heartbeats stay in events.jsonl
    metrics["recovery"] = summarize_recovery(events)
    return metrics


def preempted_metrics(reported: dict[str, Any], events: list[dict[str, Any]], *, wall_s: float,
                      invocations: int) -> dict[str, Any]:
    """Pure: metrics.json of a run stopped on a preemption notice after its emergency checkpoint: ``preempted``
    (the notice), the checkpoint's ``global_step``, ``epoch`` (1-based, the epoch it stopped in, as the log
    lines number it) and ``epochs_completed`` (see gemray.events), the events; no test metrics."""
    stop = next((e["detail"] for e in reversed(events) if e["kind"] == "preempted"), {})
    # the emergency checkpoint's report; before epochs_completed was reported, its "epoch" counted them
    done = int(reported.get("epochs_completed", reported.get("epoch", 0)))
    return {"preempted": stop.get("notice") or True, "global_step": int(reported.get("global_step", 0)),
            **epoch_fields(done, in_progress=True), "wall_s": wall_s, "invocations": invocations,
            "events": [e for e in events if e["kind"] not in QUIET_KINDS], "recovery": summarize_recovery(events)}


def comparison_table(metrics: dict[str, Any], data_format: str | None = None) -> str:
    """Plain-text table of this run's HR@10/NDCG@10 next to the published ML-1M numbers.

    The published numbers rank each target against the items outside the user's history
    (generative-recommenders' evaluation); a run with ``train.eval_exclude_history=false`` ranks against all
    items and says so in its row. The all-items figures of a filtered run get a row of their own.
    data_format: the prepared data's manifest ``format`` ("ml-1m", "synthetic", "interactions", ...; None when
    unknown): the published rows are printed for ML-1M (and unknown) data only, since they are ML-1M's.
    """
    if "hr@10" not in metrics:
        return "(no HR@10 / NDCG@10 to compare with the published ML-1M numbers: 10 is not in train.eval_ks)"
    published = data_format in (None, "ml-1m")
    label = "this run" if metrics.get("eval_exclude_history", True) else "this run (all items)"
    rows = [(label, metrics.get("hr@10", float("nan")), metrics.get("ndcg@10", float("nan")))]
    if "hr@10_unfiltered" in metrics:
        rows.append(("this run (all items)", metrics["hr@10_unfiltered"], metrics.get("ndcg@10_unfiltered",
                                                                                     float("nan"))))
    if published:
        rows += [(name, hr, nd) for name, (hr, nd) in PUBLISHED_ML1M.items()]
    lines = [f"{'model':<22}{'HR@10':>8}{'NDCG@10':>9}", "-" * 39]
    lines += [f"{n:<22}{hr:>8.4f}{nd:>9.4f}" for n, hr, nd in rows]
    lines.append("(published rows: ML-1M, Zhai et al. 2024; compare only against an ML-1M run)" if published else
                 f"(no published rows: they are ML-1M's, this run's data is {data_format!r})")
    lines += _targets_in_history_note(metrics)
    return "\n".join(lines)


def _targets_in_history_note(metrics: dict[str, Any]) -> list[str]:
    """Pure: a line for :func:`comparison_table` when test targets are in their user's input history
    (``targets_in_history``, a count, > 0: repeat consumption, e.g. synthetic data; 0 on MovieLens): the
    history-excluded "this run" row never ranks those, so its HR@K is capped at the share of the others."""
    n_in, users = metrics.get("targets_in_history"), metrics.get("num_test_users")
    if not n_in or not metrics.get("eval_exclude_history", True):
        return []
    of = f" of {users:g} test targets" if users else " test targets"
    cap = f", so its HR@10 is at most {1 - n_in / users:.4f}" if users else ""
    return [f"(targets_in_history: {n_in:g}{of} are in their user's input history; the \"this run\" row excludes "
            f"history items from the ranking and never finds them{cap}; the all-items row ranks them)"]


def _checkpoint_path(result: Any) -> str | None:
    """The path of a ``ray.train.Result``'s latest committed checkpoint (None if none was committed)."""
    return result.checkpoint.path if result.checkpoint is not None else None


def recovery_line(r: dict[str, Any]) -> str:
    """Pure: the log line of one ``metrics["recovery"]`` record. A resumed attempt that trained no step (the
    checkpoint was at the end of the training, or it stopped again first) has no time to its first step: said so,
    not "nan s"."""
    until = "stop (the time the job was stopped included)" if r["kind"] == "preemption" else "failure"
    secs = r["seconds_to_first_step"]
    timing = (f"{secs:.1f} s from the last step before the {until} to the first resumed step" if secs is not None
              else "no step trained by the resumed attempt")
    return (f"recovery ({r['kind']}): attempt {r['failed_attempt']} -> {r['attempt']}, world "
            f"{r['world_size_before']} -> {r['world_size_after']}, {r['steps_lost']} step(s) lost, {timing}")


def finish(cfg: JobConfig, out: Path, result: Any, *, events_from: int, wall_s: float,
           invocations: int, data_format: str | None = None) -> Result:
    """A run that trained to the end, or whose last attempt had nothing left to train (``result``: the
    ``ray.train.Result`` of ``TorchTrainer.fit``): write ``metrics.json`` (:func:`final_metrics`) and
    ``curves.png``, log the recovery figures, print :func:`comparison_table` (``data_format``: the prepared data's
    manifest ``format``), or :func:`no_test_line` when the checkpoint it ended on had no final evaluation, handle a
    preemption notice that came too late (:func:`late_notice`)."""
    from gemray.plots import plot_curves

    events = read_events(cfg.train.events_path)[events_from:]
    metrics = final_metrics(cfg, result.metrics or {}, events, wall_s=wall_s, invocations=invocations,
                            reference=load_scaling_reference(cfg.train.scaling_reference))
    for r in metrics["recovery"]:
        log.info("%s", recovery_line(r))
    ckpt = _checkpoint_path(result)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    if metrics["history"]:
        plot_curves(metrics["history"], out / "curves.png")
    tensorboard.export(cfg.name, out, metrics, events)  # the same values, as TensorBoard scalars
    reported = result.metrics or {}
    if reported.get("final") or any(k.startswith("test_") for k in reported):
        print(comparison_table(metrics, data_format))
    else:  # restored a checkpoint with train.epochs or more epochs done that no final evaluation followed
        print(no_test_line(cfg, reported))
    log.info("results in %s (checkpoint %s)", out, ckpt)
    late_notice(cfg.checkpoint.preempt_notice, metrics, ckpt)
    return Result(metrics=metrics, checkpoint_path=ckpt, output_dir=str(out))


def no_test_line(cfg: JobConfig, reported: dict[str, Any]) -> str:
    """Pure: what a run that ended on a checkpoint without a final evaluation prints instead of the comparison
    table: the checkpoint (an emergency or periodic one) already has train.epochs or more epochs done, so the
    attempt trained nothing and evaluated nothing."""
    done = int(reported.get("epochs_completed", reported.get("epoch", 0)))
    return (f"nothing trained: the checkpoint restored (global step {int(reported.get('global_step', 0))}, {done} "
            f"epoch(s) done) already has train.epochs={cfg.train.epochs} or more, and no final evaluation followed "
            f"it, so there are no test metrics; raise train.epochs above {done} to train on from it")


def finish_preempted(cfg: JobConfig, out: Path, result: Any, *, events_from: int = 0, wall_s: float = 0.0,
                     invocations: int = 1) -> Result:
    """A run that stopped on a preemption notice after its emergency checkpoint (``result.metrics`` has
    ``preempted``): write metrics.json (:func:`preempted_metrics`), then mark the notice handled
    (``"handled": {"global_step", "checkpoint", "t"}``) and drop the run's active marker, which ends a
    ``gemray preempt --wait``."""
    events = read_events(cfg.train.events_path)[events_from:]
    metrics = preempted_metrics(result.metrics or {}, events, wall_s=wall_s, invocations=invocations)
    ckpt = _checkpoint_path(result)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    tensorboard.export(cfg.name, out, metrics, events)  # the steps trained so far
    notice = cfg.checkpoint.preempt_notice
    try:  # tells `gemray preempt --wait` (a Kubernetes preStop hook) that the checkpoint is committed
        mark_handled(notice, metrics["global_step"], ckpt)
    except OSError as e:
        log.warning("could not mark the preemption notice %s handled: %s", notice, e)
    finally:
        clear_active(notice)
    log.warning("preempted: emergency checkpoint of global step %d committed (%s); re-run the same command "
                "to resume there", metrics["global_step"], ckpt)
    return Result(metrics=metrics, checkpoint_path=ckpt, output_dir=str(out))


def late_notice(notice: str, metrics: dict[str, Any], ckpt: str | None) -> None:
    """A preemption notice that arrived after the workers' last vote (the final step) found the run finishing:
    say so, and mark it handled with the final checkpoint so that a `gemray preempt --wait` returns."""
    if read_notice(notice) is None:
        return
    step = int((metrics.get("history") or [{}])[-1].get("global_step", 0))
    log.warning("the preemption notice %s came after the last step's vote: the run finished instead (final "
                "checkpoint %s; nothing to resume)", notice, ckpt)
    try:
        mark_handled(notice, step, ckpt, finished=True)
    except OSError as e:
        log.warning("could not mark the preemption notice %s handled: %s", notice, e)
