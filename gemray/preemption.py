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
``{"reason", "t", "pid", "host"}``. Once the emergency checkpoint is committed the driver rewrites it with
``"handled": {"global_step", "checkpoint", "t"}`` (:func:`mark_handled`). While a run is active the driver
keeps a marker ``<notice>.active`` beside it (:func:`mark_active`) and refreshes its modification time
every ``ACTIVE_HEARTBEAT_S`` seconds, so ``gemray preempt --wait`` (a Kubernetes preStop hook) can block
until the checkpoint is committed, return at once when no run is there to wait for, and give up on a marker
left by a driver that was killed outright (SIGKILL, OOM, node loss) once it has not been refreshed for
``ACTIVE_STALE_S`` seconds: at the first poll for a marker already that far behind the notice the waiter
just wrote, otherwise once its mtime has stood still that long on the waiter's own clock (mtimes are
compared with each other, never with the waiter's wall clock, so clock skew between pods does not matter).
:func:`marker_is_stale` is the bound. :func:`wait_outcome` decides,
:func:`wait_until_handled` polls. Pure except the small file helpers and the heartbeat thread.
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


#: Outcomes of :func:`wait_outcome` / :func:`wait_until_handled`; "stale": an active marker nobody refreshes.
WAIT_OUTCOMES = ("handled", "no_run", "stale", "timeout")
#: Seconds between the driver's refreshes of its active marker (modification time).
ACTIVE_HEARTBEAT_S = 5.0
#: Seconds a waiter watches an active marker's modification time stand still before it takes the run for
#: gone (4 heartbeats: one missed refresh on a slow shared volume is not enough).
ACTIVE_STALE_S = 20.0
_HEARTBEATS: dict[str, threading.Event] = {}  # marker path -> stop event of its heartbeat thread


def _write_json_atomic(path: Path, data: dict[str, Any]) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)
    return path


def write_notice(path: str | Path, reason: str) -> Path:
    """Write a preemption notice to ``path`` atomically (temp file + rename); returns the path.

    Raises OSError when the folder does not exist or is not writable."""
    return _write_json_atomic(Path(path), {"reason": str(reason), "t": time.time(), "pid": os.getpid(),
                                           "host": socket.gethostname()})


def mark_handled(path: str | Path, global_step: int, checkpoint: str | None, *, finished: bool = False) -> Path:
    """Rewrite the notice at ``path`` atomically with ``"handled": {"global_step", "checkpoint", "t",
    "finished"}`` (``t``: Unix time in seconds) once the emergency checkpoint of ``global_step`` is committed
    at ``checkpoint``; ``finished``: the notice came too late to stop the run, which finished and committed its
    final checkpoint instead. A missing notice is recreated with reason "unknown" so waiters still see the
    result.

    Raises OSError when the folder does not exist or is not writable."""
    data = read_notice(path) or {"reason": "unknown"}
    data["handled"] = {"global_step": int(global_step), "checkpoint": checkpoint, "t": time.time(),
                       "finished": bool(finished)}
    return _write_json_atomic(Path(path), data)


def is_handled(notice: dict[str, Any] | None) -> bool:
    """Pure: True when a notice (as :func:`read_notice` returns it) says its emergency checkpoint is
    committed."""
    return bool(notice) and isinstance(notice.get("handled"), dict)


def active_path(notice_path: str | Path) -> Path:
    """The marker that says a run polling ``notice_path`` is active: ``<notice>.active`` beside it."""
    p = Path(notice_path)
    return p.with_name(p.name + ".active")


def mark_active(notice_path: str | Path, heartbeat_s: float | None = ACTIVE_HEARTBEAT_S) -> Path:
    """Driver: record that a run polls ``notice_path`` (``{"pid", "host", "t"}``; creates the folder) and
    start a daemon thread that refreshes the marker's modification time every ``heartbeat_s`` seconds until
    :func:`clear_active` (or until the marker is gone); ``heartbeat_s=None``: no thread. Returns the marker
    path. Raises OSError when the folder cannot be created or written, ValueError for ``heartbeat_s <= 0``."""
    if heartbeat_s is not None and heartbeat_s <= 0:
        raise ValueError(f"heartbeat: expected > 0 seconds, got {heartbeat_s}")
    p = active_path(notice_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(p, {"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()})
    if heartbeat_s is not None:
        stop = threading.Event()
        old = _HEARTBEATS.pop(str(p), None)
        if old is not None:
            old.set()
        _HEARTBEATS[str(p)] = stop
        threading.Thread(target=_heartbeat, args=(p, stop, heartbeat_s), name="gemray-active-heartbeat",
                         daemon=True).start()
    return p


def claim_active(notice_path: str | Path, heartbeat_s: float = ACTIVE_HEARTBEAT_S) -> bool:
    """Driver, before Ray starts: create the active marker (as :func:`mark_active`) only if there is none,
    atomically (the complete file is hard-linked into place, which fails when the marker exists, also on
    NFS), and start its heartbeat. Returns False when a marker is already there (another run's, or a stale
    one: see ``gemray.controller.output_lock.claim_output``). Raises OSError when the folder cannot be written."""
    p = active_path(notice_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_json_atomic(p.with_name(f".{p.name}.claim.{os.getpid()}.{threading.get_ident()}"),
                             {"pid": os.getpid(), "host": socket.gethostname(), "t": time.time()})
    try:
        os.link(tmp, p)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    mark_active(notice_path, heartbeat_s)  # the same content, and the heartbeat thread
    return True


def _heartbeat(marker: Path, stop: threading.Event, period_s: float) -> None:
    """Refresh ``marker``'s modification time every ``period_s`` seconds until ``stop`` is set or the marker
    is gone; a failed refresh (e.g. a shared volume briefly unavailable) is logged and retried."""
    while not stop.wait(period_s):
        try:
            os.utime(marker)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("could not refresh the active marker %s (%s); retrying in %g s", marker, e, period_s)


def clear_active(notice_path: str | Path) -> bool:
    """Driver, when the run ends (however): stop the marker's heartbeat and remove the marker; True if one
    was there."""
    p = active_path(notice_path)
    stop = _HEARTBEATS.pop(str(p), None)
    if stop is not None:
        stop.set()
    try:
        p.unlink()
        return True
    except FileNotFoundError:
        return False


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` (an int) exists on this host; False for anything else."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def marker_owner_gone(notice_path: str | Path) -> bool:
    """True when the active marker beside ``notice_path`` was written on this host by a process that no longer
    exists (a driver killed outright): its run is over whatever the marker's age. False when there is no
    readable marker, or it names another host (its process cannot be checked from here)."""
    try:
        info = json.loads(active_path(notice_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("host") == socket.gethostname() and not pid_alive(info.get("pid"))


def marker_is_stale(marker_mtime_s: float, now_s: float, stale_s: float = ACTIVE_STALE_S) -> bool:
    """Pure: True when an active marker last refreshed at ``marker_mtime_s`` counts as abandoned at ``now_s``,
    i.e. it has gone ``stale_s`` seconds or more without a heartbeat (``ACTIVE_HEARTBEAT_S``). Both times in
    seconds on the *same* clock (e.g. two modification times on the shared volume, or two readings of the
    waiter's monotonic clock); a marker newer than ``now_s`` (clock skew) is never stale. Raises ValueError
    for ``stale_s <= 0``."""
    if stale_s <= 0:
        raise ValueError(f"stale bound: expected > 0 seconds, got {stale_s}")
    return now_s - marker_mtime_s >= stale_s


def wait_outcome(notice: dict[str, Any] | None, active: bool, elapsed_s: float, timeout_s: float,
                 unrefreshed_s: float = 0.0, stale_s: float = ACTIVE_STALE_S) -> str | None:
    """Pure decision for ``gemray preempt --wait``: "handled" (the notice records its committed emergency
    checkpoint), "no_run" (no run is active: nothing will handle it), "stale" (the active marker's
    modification time has stood still for ``unrefreshed_s >= stale_s`` seconds of waiting: its driver was
    killed without removing it), "timeout" (``elapsed_s >= timeout_s``) or None (keep waiting). All times in
    seconds. Raises ValueError for a negative timeout or a stale bound <= 0."""
    if timeout_s < 0:
        raise ValueError(f"wait timeout: expected >= 0 seconds, got {timeout_s}")
    if stale_s <= 0:
        raise ValueError(f"stale bound: expected > 0 seconds, got {stale_s}")
    if is_handled(notice):
        return "handled"
    if not active:
        return "no_run"
    if unrefreshed_s >= stale_s:
        return "stale"
    if elapsed_s >= timeout_s:
        return "timeout"
    return None


def wait_until_handled(notice_path: str | Path, timeout_s: float, poll_s: float = 0.5,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic,
                       stale_s: float | None = None) -> tuple[str, dict[str, Any] | None]:
    """Poll ``notice_path`` (and its active marker's modification time) every ``poll_s`` seconds until
    :func:`wait_outcome` decides; returns ``(outcome, notice)``. Times in seconds.

    How long the marker has gone unrefreshed is the larger of two readings, each on one clock only:
    how long its modification time has stood still across polls (the waiter's ``clock``), and how much older
    it is than the notice's modification time at the first poll (the file system's clock: the notice was just
    written by the waiter, so a marker hours old is recognised at once) plus the time waited since. Clock
    skew between the waiter's pod and the driver's never enters. Raises ValueError for a negative timeout, a
    poll interval <= 0 or a stale bound <= 0 (None: ``ACTIVE_STALE_S``)."""
    stale_s = ACTIVE_STALE_S if stale_s is None else stale_s
    if poll_s <= 0:
        raise ValueError(f"wait poll interval: expected > 0 seconds, got {poll_s}")
    t0 = clock()
    try:  # the file system's "now" at t0, for markers that were already old before the wait began
        fs_t0: float | None = Path(notice_path).stat().st_mtime
    except OSError:
        fs_t0 = None
    seen_mtime, seen_at = None, t0
    while True:
        notice = read_notice(notice_path)
        try:
            mtime: int | None = active_path(notice_path).stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        now = clock()
        if mtime != seen_mtime:
            seen_mtime, seen_at = mtime, now
        unrefreshed = now - seen_at
        if mtime is not None and fs_t0 is not None:
            unrefreshed = max(unrefreshed, fs_t0 + (now - t0) - mtime / 1e9)
        gone = mtime is not None and not is_handled(notice) and marker_owner_gone(notice_path)
        outcome = wait_outcome(notice, mtime is not None, now - t0, timeout_s,
                               max(unrefreshed, stale_s) if gone else unrefreshed, stale_s)
        if outcome == "stale" and gone:
            log.warning("the active marker %s names a process of this host that no longer exists: taking its "
                        "run for gone (killed without removing it)", active_path(notice_path))
        elif outcome == "stale":
            log.warning("the active marker %s has not been refreshed for %.1f s (bound %g s; a live driver "
                        "refreshes it every %g s): taking its run for gone (killed without removing it)",
                        active_path(notice_path), unrefreshed, stale_s, ACTIVE_HEARTBEAT_S)
        if outcome is not None:
            return outcome, notice
        sleep(max(min(poll_s, timeout_s - (clock() - t0), stale_s - unrefreshed), 0.01))


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


# A second SIGTERM sooner than this after the first is the same notice: GNU ``timeout`` signals the command and then
# its whole process group, so a driver it runs gets two within milliseconds.
SIGTERM_REPEAT_S = 1.0


def pass_sigterm_on(previous, signum, frame) -> None:
    """Give SIGTERM back to the handler ``previous`` (``signal.getsignal``'s value before ours): reinstall it and
    call it, or, when it is SIG_DFL / SIG_IGN / None, reinstall that and re-send the signal to this process (the
    default then ends it, SIG_IGN ignores it)."""
    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def install_driver_sigterm(notice_path: str | Path) -> Callable[[], None]:
    """In the driver: SIGTERM -> write the preemption notice (the workers checkpoint and stop at their
    next poll step); a second SIGTERM falls back to the previous handler (default: exit at once).

    A second SIGTERM less than ``SIGTERM_REPEAT_S`` after the first counts as the same one (``timeout 300 gemray
    train ...`` sent two: the second interrupted the first's notice write, leaving a ``.PREEMPT.*.tmp`` file and no
    notice, and the run exited without its emergency checkpoint); one that arrives while the notice is still being
    written waits for the write to finish before exiting.

    Returns a function that restores the previous handler. A no-op off the main thread (where Python
    cannot install signal handlers).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    state = {"first_at": None, "writing": False, "exit_after_write": None}

    def exit_now(signum, frame):
        log.warning("second SIGTERM: exiting at once, without waiting for the emergency checkpoint; a re-run "
                    "resumes from the last committed checkpoint")
        pass_sigterm_on(previous, signum, frame)

    def handler(signum, frame):
        now = time.monotonic()
        if state["first_at"] is None:
            state["first_at"], state["writing"] = now, True
            try:
                write_notice(notice_path, "SIGTERM to the driver")
            finally:
                state["writing"] = False
            log.warning("SIGTERM: preemption notice written to %s; the workers take an emergency checkpoint "
                        "at their next poll step (checkpoint.preempt_poll_steps) and stop. Send SIGTERM "
                        "again (a second or more later) to exit at once.", notice_path)
            if state["exit_after_write"] is not None:
                exit_now(*state["exit_after_write"])
            return
        if now - state["first_at"] < SIGTERM_REPEAT_S:
            return  # the same notice, delivered twice
        if state["writing"]:
            state["exit_after_write"] = (signum, frame)
            return
        exit_now(signum, frame)

    signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return restore


def install_driver_sigint(notice_path: str | Path) -> Callable[[], None]:
    """In the driver: Ctrl-C (SIGINT, which a terminal sends to the whole process group) is a preemption notice,
    as SIGTERM is: the first writes the notice (the workers checkpoint at their next poll step, the run exits
    75 and a re-run resumes there, a preemption, not a failure); the second raises KeyboardInterrupt at once
    (``gemray train`` exits 130), without waiting for the emergency checkpoint.

    Returns a function that restores the previous handler. A no-op off the main thread. Ray Train installs its
    own SIGINT handler in ``trainer.fit()`` on the main thread (an abort that counts as a failure), so the
    caller runs ``fit`` on another thread (:func:`gemray.controller.run._train`).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    seen = {"n": 0}

    def handler(signum, frame):  # noqa: ARG001
        seen["n"] += 1
        if seen["n"] == 1:
            write_notice(notice_path, "Ctrl-C (SIGINT) to the driver")
            log.warning("Ctrl-C: taking an emergency checkpoint at the next poll step "
                        "(checkpoint.preempt_poll_steps), then stopping (exit 75; re-run the same command to "
                        "resume). Press Ctrl-C again to stop at once, without it.")
            return
        log.warning("second Ctrl-C: stopping at once, without the emergency checkpoint; a re-run resumes from the "
                    "last committed checkpoint")
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)

    return restore
