"""Preemption notices: how a whole job is told to checkpoint now and stop, and how workers agree on it.

Inside Ray Train V2 a worker cannot catch SIGTERM itself (Ray's worker process has its own SIGTERM
handling, which exits the worker, and the train function runs off the main thread, where
``signal.signal`` is impossible). So the notice travels as a *file* that every worker polls:

* ``gemray train`` / ``gemray.fit`` catch SIGTERM in the driver (main thread) and write the notice;
* ``gemray preempt --output DIR`` (or a node agent / a Kubernetes preStop hook on the shared volume)
  writes it from outside;
* every ``checkpoint.preempt_poll_steps`` global steps each worker looks for the file, and the ranks
  all-reduce their votes (the vote completing is the proof that the group is still healthy); on a
  "stop" vote they take an emergency checkpoint, which Ray Train commits, and return. Re-running the
  same command resumes at that exact step.

Ray's own preemption signal (a node being drained, ``ray.train.get_preemption_info()``) gives a "drain"
vote instead: checkpoint now and keep training; Ray Train restarts the group from that checkpoint once
the node is gone.

The notice file: ``<output_dir>/PREEMPT`` (``checkpoint.preempt_notice``), one JSON object
``{"reason", "t", "pid", "host"}``. Pure except the small file helpers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped on a preemption notice; re-run the same command to resume
NOTICE_NAME = "PREEMPT"
#: What :func:`preemption_action` may decide.
ACTIONS = ("stop", "checkpoint")


def write_notice(path: str | Path, reason: str) -> Path:
    """Write a preemption notice to ``path`` atomically (temp file + rename); returns the path.

    Raises OSError when the folder does not exist or is not writable."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"reason": str(reason), "t": time.time(), "pid": os.getpid(),
                               "host": socket.gethostname()}))
    os.replace(tmp, path)
    return path


def read_notice(path: str | Path | None) -> dict[str, Any] | None:
    """The notice at ``path`` as a dict, or None when there is none. A file that is not JSON (e.g. made
    with ``touch``) still counts as a notice: ``{"reason": "notice file"}``."""
    if not path:
        return None
    p = Path(path)
    try:
        text = p.read_text()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        data = json.loads(text)
        return data if isinstance(data, dict) else {"reason": "notice file"}
    except json.JSONDecodeError:
        return {"reason": "notice file"}


def clear_notice(path: str | Path | None) -> bool:
    """Remove the notice at ``path``; True if one was there."""
    if not path:
        return False
    try:
        Path(path).unlink()
        return True
    except FileNotFoundError:
        return False


def preemption_action(stop_votes: int, drain_votes: int, world_size: int) -> str | None:
    """Pure decision after the preemption vote (all-reduced sums of per-rank flags).

    Returns "stop" (some rank saw a job preemption notice: emergency checkpoint, then end the run),
    "checkpoint" (only Ray's node-drain notice: emergency checkpoint, keep training until Ray restarts
    the group) or None. Raises ValueError when a vote count is outside 0..world_size.
    """
    for name, v in (("stop_votes", stop_votes), ("drain_votes", drain_votes)):
        if not 0 <= v <= world_size:
            raise ValueError(f"preemption_action: {name}={v} outside 0..{world_size}")
    if stop_votes:
        return "stop"
    if drain_votes:
        return "checkpoint"
    return None


def install_driver_sigterm(notice_path: str | Path) -> Callable[[], None]:
    """In the driver: SIGTERM -> write the preemption notice (the workers checkpoint and stop at their
    next poll step); a second SIGTERM falls back to the previous handler (default: exit at once).

    Returns a function that restores the previous handler. A no-op off the main thread (where Python
    cannot install signal handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    seen = {"n": 0}

    def handler(signum, frame):  # noqa: ARG001
        seen["n"] += 1
        if seen["n"] == 1:
            write_notice(notice_path, "SIGTERM to the driver")
            log.warning("SIGTERM: preemption notice written to %s; the workers take an emergency checkpoint "
                        "at their next poll step (checkpoint.preempt_poll_steps) and stop. Send SIGTERM "
                        "again to exit at once.", notice_path)
            return
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return restore
