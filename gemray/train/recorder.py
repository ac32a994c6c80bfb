"""The attempt's recovery bookkeeping: what it learns of the previous attempt and what it records for the next.

Wraps ``gemray.events.EventLog`` (rank 0 writes ``train.events_path``; every rank may call, so the trainer
never branches on rank). One :class:`RecoveryRecorder` per attempt (one start of the worker group):

- at the start: the previous attempt's failure forensics (``failure_detected``), ``attempt_start``;
- after the restore: ``checkpoint_fallback`` / ``checkpoint_restored``, the previous attempt's checkpoint
  that Ray never committed (``checkpoint_uncommitted``, with a log line), the ``startup`` phase timings,
  a ``resize``;
- while training: ``step`` heartbeats, ``first_step`` of a resumed attempt, ``checkpoint_begin`` /
  ``checkpoint_saved``, ``preempted``; ``finished`` at the end.

``gemray.events.summarize_recovery`` turns these into metrics.json's ``recovery`` rows.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from gemray.events import EventLog, epoch_fields, failure_events, interrupted_checkpoint, preempted_step, read_events

log = logging.getLogger("gemray.train")

#: Startup phases in order (the ``startup`` event's keys; BENCHMARKS.md quotes them).
PHASES = ("process_to_train_fn_s", "setup_and_data_s", "build_and_shard_s", "restore_s")

_WHY_UNCOMMITTED = {
    "interrupted_write": "was killed while writing it (its report never completed, so Ray never committed it)",
    "not_committed": "reported it, but Ray had not committed it before the failure",
    "stop_not_committed": "stopped on a preemption notice and reported it as its emergency checkpoint, but the "
                          "run ended before Ray committed it (e.g. a second SIGTERM)",
}


def process_start_time() -> float:
    """Unix time this worker process started (Ray starts a fresh process per worker-group start).

    From Linux's /proc (boot time + the process's start in clock ticks; psutil is not in the pinned stack);
    elsewhere the current time, so the phase reads 0.
    """
    try:
        btime = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        stat = open("/proc/self/stat").read()
        ticks = float(stat.rsplit(")", 1)[1].split()[19])  # field 22 (starttime); fields 1-2 end at ")"
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _uncommitted_note(restored_from: str | None) -> str:
    """Names the checkpoint folders next to the restored one that Ray never committed (partial writes)."""
    if not restored_from:
        return ""
    from gemray.checkpoint import uncommitted_checkpoints

    left = uncommitted_checkpoints(Path(restored_from).parent)
    return f"; ignoring uncommitted folder(s) {[p.name for p in left]}" if left else ""


class RecoveryRecorder:
    """Events of one attempt, plus what the event log tells about the previous one.

    events_path: ``train.events_path`` ("" = no file; events are still logged on rank 0); attempt: the id
    all ranks agreed on; rank: only rank 0 reads the previous events and writes; t_start: unix time the
    train function started (seconds since then in ``first_step``; the process-start phase).
    ``failed``: :func:`gemray.events.failure_events` of the previous attempt (None on rank != 0, after a
    planned end, or on a first start). The startup phase clock starts here.
    """

    def __init__(self, events_path: str, *, attempt: int, rank: int, t_start: float):
        self.t_start = t_start
        self.phases: dict[str, float] = {"process_to_train_fn_s": t_start - process_start_time()}
        self._t_phase = time.time()
        previous = read_events(events_path) if events_path and rank == 0 else []
        self.events = EventLog(events_path, attempt=attempt, write=rank == 0)
        self.failed = failure_events(previous)
        self._stopped_at = preempted_step(previous)
        self._first_step_pending = False

    # -- the start of the attempt ------------------------------------------------------------------------
    def attempt_started(self, world_size: int, sharding_types: list[str],
                        layout: dict[str, Any] | None = None) -> None:
        """``failure_detected`` (when the previous attempt died) and ``attempt_start`` (with ``layout``: the mesh
        degrees this attempt runs, ``ParallelDims.mesh_fields()`` -- after an elastic resize the nearest valid
        layout, which may not be the configured one)."""
        if self.failed:
            self.events.emit("failure_detected", **self.failed)
        self.events.emit("attempt_start", world_size=world_size, t_start=self.t_start,
                         sharding_types=list(sharding_types), **({} if layout is None else {"layout": dict(layout)}))

    def phase_done(self, name: str) -> None:
        """Close startup phase ``name`` (one of PHASES): seconds since the previous phase ended."""
        if name not in PHASES:
            raise ValueError(f"RecoveryRecorder.phase_done: unknown phase {name!r} (known: {PHASES})")
        now = time.time()
        self.phases[name], self._t_phase = now - self._t_phase, now

    # -- after the restore -------------------------------------------------------------------------------
    def restored(self, state: dict[str, Any], *, world_size: int) -> None:
        """A checkpoint was restored (``state``: ``gemray.checkpoint.restore_from_ray``'s trainer dict):
        ``checkpoint_fallback`` per skipped one, ``checkpoint_restored``; the first step will be recorded."""
        for path, why in state.get("skipped_checkpoints", []):
            self.events.emit("checkpoint_fallback", skipped=path, reason=why, used=state.get("restored_from"))
        self.events.emit("checkpoint_restored", global_step=int(state.get("global_step", 0)),
                         **epoch_fields(int(state["epoch"]), in_progress=True),
                         consumed=int(state.get("consumed", 0)), saved_world_size=state.get("world_size"),
                         world_size=world_size, path=state.get("restored_from"))
        self._first_step_pending = True

    def uncommitted(self, restored_step: int, restored_from: str | None) -> dict[str, Any] | None:
        """The previous attempt's newest checkpoint when it is not the restored one: a warning and a
        ``checkpoint_uncommitted`` event; returns ``gemray.events.interrupted_checkpoint``'s verdict."""
        lost = interrupted_checkpoint(self.failed, restored_step, self._stopped_at)
        if lost:
            log.warning("the previous attempt's checkpoint of global step %d is not used: the attempt %s; resuming "
                        "from the last committed checkpoint (global step %d)%s", lost["global_step"],
                        _WHY_UNCOMMITTED[lost["state"]], restored_step, _uncommitted_note(restored_from))
            self.events.emit("checkpoint_uncommitted", restored_global_step=restored_step, **lost)
        return lost

    def startup(self) -> None:
        """The ``startup`` event: the phase timings so far, rounded to ms."""
        self.events.emit("startup", **{k: round(v, 3) for k, v in self.phases.items()})

    def resize(self, world_size: int, restored_world_size: int | None, sharding_types: list[str],
               layout: dict[str, Any] | None = None) -> None:
        """A ``resize`` event when the previous attempt (from the event log) or the restored checkpoint
        (``restored_world_size``; None on a fresh start) ran at another world size. ``dense_mesh``: [dp_replicate,
        dp_shard] of the new layout (``layout``: ``ParallelDims.mesh_fields()``; None: plain DDP, [world, 1])."""
        prev = (self.failed or {}).get("world_size") or restored_world_size
        if prev is not None and prev != world_size:
            mesh = [world_size, 1] if layout is None else [int(layout["dp_replicate"]), int(layout["dp_shard"])]
            self.events.emit("resize", from_world_size=prev, to_world_size=world_size,
                             resharded_from=restored_world_size, sharding_types=list(sharding_types),
                             dense_mesh=mesh, **({} if layout is None else {"layout": dict(layout)}))

    # -- while training ----------------------------------------------------------------------------------
    def step(self, global_step: int, epoch: int, consumed: int, loss: float | None = None,
             lr: float | None = None) -> None:
        """A ``step`` heartbeat (file only) after global step ``global_step`` of 0-based ``epoch``, with rank 0's
        ``loss`` of the step and the step's base dense learning rate ``lr`` (``train.lr`` x the warm-up factor)
        when given (TensorBoard's per-step curves); the ``first_step`` event after the first step of a resumed
        attempt."""
        extra = {} if loss is None else {"loss": float(loss)}
        if lr is not None:
            extra["lr"] = float(lr)
        self.events.emit("step", quiet=True, global_step=global_step, epoch=epoch + 1, consumed=consumed, **extra)
        if self._first_step_pending:
            self.events.emit("first_step", global_step=global_step, since_start_s=time.time() - self.t_start)
            self._first_step_pending = False

    def checkpoint_begin(self, reason: str, global_step: int) -> None:
        self.events.emit("checkpoint_begin", quiet=True, reason=reason, global_step=global_step)

    def checkpoint_saved(self, reason: str, global_step: int, *, epochs_completed: int, in_progress: bool,
                         consumed: int, save: dict[str, Any] | None = None) -> None:
        """``save``: :func:`gemray.checkpoint.save_checkpoint`'s figures of this rank's save; the event (and its
        log line) carries ``save`` = ``{"seconds", "bytes", "files", "rss_before", "rss_after", "rss_peak",
        "maxrss_before", "maxrss_after"}`` (bytes) and ``save_summary``, the same in words."""
        extra: dict[str, Any] = {}
        if save:
            from gemray.checkpoint import save_summary

            keys = ("seconds", "bytes", "files", "rss_before", "rss_after", "rss_peak", "maxrss_before",
                    "maxrss_after")
            extra = {"save": {k: (round(save[k], 3) if k == "seconds" else save[k]) for k in keys if k in save},
                     "save_summary": save_summary(save)}
        self.events.emit("checkpoint_saved", reason=reason, global_step=global_step,
                         **epoch_fields(epochs_completed, in_progress=in_progress), consumed=consumed, **extra)

    def preempted(self, global_step: int, *, epochs_completed: int, consumed: int, notice: dict[str, Any]) -> None:
        self.events.emit("preempted", global_step=global_step, **epoch_fields(epochs_completed, in_progress=True),
                         consumed=consumed, notice=notice)

    def finished(self, global_step: int) -> None:
        self.events.emit("finished", global_step=global_step)
