"""Controller events (failure detected, resize, checkpoint restored/saved, steps) and recovery figures.

Rank 0 of every attempt appends :class:`Event` dicts as JSON lines to ``train.events_path`` (``fit``
sets it to ``<output_dir>/events.jsonl``) and logs each one; :func:`summarize_recovery` turns the log
into seconds-from-failure-to-first-resumed-step and steps lost per restart (metrics.json
``recovery``). Pure except :class:`EventLog` (a file appender).

Epoch numbers in event details (:func:`epoch_fields`): ``epoch`` is 1-based, the epoch being trained, as
the log lines print it ("epoch 3 step 5", "epoch 3 done", "resuming at epoch 3"); ``epochs_completed``
counts the epochs finished (what a checkpoint's trainer state stores as ``epoch``). A checkpoint taken
mid-way through the third epoch: ``epoch`` 3, ``epochs_completed`` 2; the one at its end: 3 and 3.
``checkpoint_saved``, ``preempted`` and ``checkpoint_restored`` carry both (``checkpoint_restored``: the
epoch training resumes in), ``step`` only ``epoch``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gemray.events")

__all__ = ["EVENT_KINDS", "PLANNED_END", "Event", "EventLog", "epoch_fields", "failure_events",
           "interrupted_checkpoint", "preempted_step", "read_events", "summarize_recovery"]

EVENT_KINDS = ("attempt_start", "failure_detected", "resize", "checkpoint_restored", "checkpoint_fallback",
               "checkpoint_uncommitted", "startup", "first_step", "step", "checkpoint_begin", "checkpoint_saved",
               "preempted", "finished")
#: Kinds that end an attempt on purpose: the next attempt is a planned resume, not a failure (after "preempted"
#: it is still a ``recovery`` row, of kind "preemption").
PLANNED_END = ("finished", "preempted")


def epoch_fields(epochs_completed: int, *, in_progress: bool) -> dict[str, int]:
    """``{"epoch", "epochs_completed"}`` for an event detail (see the module docstring): ``in_progress`` True
    for a point inside an epoch (its ``epoch`` is the next one, epochs_completed + 1), False at an epoch's end
    (``epoch`` = epochs_completed, the epoch just finished)."""
    done = int(epochs_completed)
    return {"epoch": done + 1 if in_progress else done, "epochs_completed": done}


@dataclass
class Event:
    """One controller event: ``kind`` in EVENT_KINDS, ``t`` unix seconds, ``attempt`` id, details."""

    kind: str
    t: float = field(default_factory=time.time)
    attempt: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"Event.kind: expected one of {EVENT_KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EventLog:
    """Append events of one attempt to a JSONL file (rank 0 only writes; every rank may call ``emit``)."""

    def __init__(self, path: str | Path | None, *, attempt: int, write: bool):
        self.path = Path(path) if path else None
        self.attempt, self.write = int(attempt), bool(write)
        if self.path and self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, quiet: bool = False, **detail: Any) -> Event:
        """Record one event (``quiet``: file only, no log line: used for per-step heartbeats)."""
        ev = Event(kind, attempt=self.attempt, detail=detail)
        if self.write:
            if not quiet:
                log.info("event %s: %s", kind, json.dumps(detail, sort_keys=True, default=str))
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps(ev.to_dict(), default=str) + "\n")
        return ev


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events in ``path`` (a missing file gives []; a torn last line is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def failure_events(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a new attempt can tell about the previous one from the event log (dicts of :class:`Event`).

    Returns None when there is no previous attempt or it ended on purpose (finished, or stopped after a
    preemption notice); else ``{"attempt", "last_global_step", "last_step_t", "world_size",
    "last_checkpoint_begun", "last_checkpoint_saved"}`` of the attempt that died (the global steps of
    its newest checkpoint write started / reported, None if none).
    """
    starts = [e for e in events if e["kind"] == "attempt_start"]
    if not starts:
        return None
    prev = starts[-1]["attempt"]
    mine = [e for e in events if e["attempt"] == prev]
    if any(e["kind"] in PLANNED_END for e in mine):
        return None
    steps = [e for e in mine if e["kind"] == "step"]
    last = steps[-1] if steps else starts[-1]

    def newest(kind: str) -> int | None:
        return max((e["detail"]["global_step"] for e in mine if e["kind"] == kind), default=None)

    return {"attempt": prev, "last_global_step": last["detail"].get("global_step"), "last_step_t": last["t"],
            "world_size": starts[-1]["detail"].get("world_size"),
            "last_checkpoint_begun": newest("checkpoint_begin"), "last_checkpoint_saved": newest("checkpoint_saved")}


def preempted_step(events: list[dict[str, Any]]) -> int | None:
    """The global step of the emergency checkpoint the previous attempt stopped at (its ``preempted`` event:
    the checkpoint was reported, which Ray commits unless the driver dies first, e.g. on a second
    SIGTERM); None when the previous attempt did not stop on a preemption notice, or there is none."""
    starts = [e for e in events if e["kind"] == "attempt_start"]
    if not starts:
        return None
    prev = starts[-1]["attempt"]
    return max((e["detail"]["global_step"] for e in events if e["attempt"] == prev and e["kind"] == "preempted"),
               default=None)


def interrupted_checkpoint(failed: dict[str, Any] | None, restored_step: int,
                           stopped_at: int | None = None) -> dict[str, Any] | None:
    """What became of the previous attempt's newest checkpoint, if it is not the one restored.

    failed: :func:`failure_events` of the log (None when the previous attempt ended on purpose);
    restored_step: global step of the checkpoint this attempt restored (0 on a fresh start); stopped_at: the
    step an attempt that stopped on a preemption notice reported its emergency checkpoint at
    (:func:`preempted_step`). Returns ``{"global_step", "state"}`` with state "interrupted_write" (begun, never
    reported: killed while writing), "not_committed" (reported, but Ray had not committed it before the
    failure) or "stop_not_committed" (the emergency checkpoint was reported but the run ended before Ray
    committed it); None when the newest checkpoint is the restored one or there is none.
    """
    if not failed:
        if stopped_at is not None and stopped_at > restored_step:
            return {"global_step": stopped_at, "state": "stop_not_committed"}
        return None
    if failed.get("last_checkpoint_begun") is None:
        return None
    begun, saved = failed["last_checkpoint_begun"], failed.get("last_checkpoint_saved")
    if begun <= restored_step:
        return None
    return {"global_step": begun, "state": "interrupted_write" if saved != begun else "not_committed"}


def summarize_recovery(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per restart after a failure or resume after a preemption: how long it took, how much work
    was lost.

    ``kind``: "failure" (Ray Train restarted the worker group: a worker or node lost, or an elastic resize,
    the attempts that ``failure_detected`` events name) or "preemption" (a new run resumed where an attempt
    stopped on a preemption notice; its seconds include the time the job was stopped). An attempt that
    finished is followed by a planned resume (more epochs), not listed.
    ``failed_attempt`` (the attempt that ended) / ``attempt``; ``world_size_before`` / ``world_size_after``;
    ``last_step`` (the last global step the failed attempt finished) and ``restored_step`` (of the
    checkpoint restored); ``steps_lost`` = last_step - restored_step; ``seconds_to_first_step`` = time of
    the first step of the new attempt minus time of the failed attempt's last step (an upper bound on
    failure -> first resumed step; the failure itself happened in between); ``restore_s`` = restored -
    attempt start. Attempts without a step yet are reported with ``seconds_to_first_step`` None.
    Where the seconds go: ``to_train_fn_s`` = last step -> the new train function starting (Ray Train
    detects the failure, stops the old group, starts new worker processes, sets up torch.distributed);
    ``phases`` = the new attempt's ``startup`` event (process_to_train_fn_s, setup_and_data_s,
    build_and_shard_s, restore_s), when it logged one.
    """
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    order: list[int] = []
    for e in events:
        if e["attempt"] not in by_attempt:
            order.append(e["attempt"])
        by_attempt.setdefault(e["attempt"], []).append(e)
    out = []
    for prev, cur in zip(order, order[1:]):
        p, c = by_attempt[prev], by_attempt[cur]
        if any(e["kind"] == "finished" for e in p):
            continue  # a planned resume of a finished run (new fit with more epochs): nothing to recover
        kind = "preemption" if any(e["kind"] == "preempted" for e in p) else "failure"
        steps = [e for e in p if e["kind"] == "step"]
        start_p = next((e for e in p if e["kind"] == "attempt_start"), p[0])
        start_c = next((e for e in c if e["kind"] == "attempt_start"), c[0])
        restored = next((e for e in c if e["kind"] == "checkpoint_restored"), None)
        first = next((e for e in c if e["kind"] in ("first_step", "step")), None)
        startup = next((e for e in c if e["kind"] == "startup"), None)
        t_fn = start_c["detail"].get("t_start")
        last_t = steps[-1]["t"] if steps else start_p["t"]
        last_step = steps[-1]["detail"]["global_step"] if steps else start_p["detail"].get("global_step", 0)
        restored_step = restored["detail"]["global_step"] if restored else 0
        out.append({"kind": kind, "failed_attempt": prev, "attempt": cur,
                    "world_size_before": start_p["detail"].get("world_size"),
                    "world_size_after": start_c["detail"].get("world_size"),
                    "last_step": last_step, "restored_step": restored_step,
                    "steps_lost": max(0, last_step - restored_step),
                    "seconds_to_first_step": (first["t"] - last_t) if first else None,
                    "restore_s": (restored["t"] - start_c["t"]) if restored else None,
                    "to_train_fn_s": (t_fn - last_t) if t_fn else None,
                    "phases": dict(startup["detail"]) if startup else None})
    return out
