"""Reap the embedded Ray cluster when its driver dies without shutting it down (SIGKILL, OOM killer).

``ray.init(address="local")`` starts the cluster's processes as children of the driver (GCS, raylet, the
dashboard, log monitor); the raylet starts the dashboard and runtime-env agents and the workers. Killed with
SIGKILL, the driver cannot run ``ray.shutdown()``: the GCS and raylet notice and exit, but the agents linger for
90 s and more. :func:`start` spawns this module as a small process in its own session that keeps a list of the
cluster's processes (the driver's children whose command line names the Ray session, and their descendants,
with their start times so a reused pid is never touched) while the driver lives; when the driver is gone
(its pipe to the watchdog closes: death, or the normal end of the session) it sends SIGTERM, then SIGKILL,
to those still alive. Linux only (``/proc``); elsewhere :func:`start` does nothing.

    python -m gemray.controller.watchdog --driver PID --session session_2026-...   (stdin: the driver's pipe)
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

ProcTable = dict[int, tuple[int, str, int]]  # pid -> (ppid, command line, start time in clock ticks)


def read_procs(proc: Path = Path("/proc")) -> ProcTable:
    """Every process this user can see: ``{pid: (ppid, cmdline, starttime)}`` from ``/proc/<pid>/stat`` and
    ``cmdline`` (processes that vanish while being read are skipped)."""
    table: ProcTable = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... starttime (field 22)
        table[int(d.name)] = (int(fields[1]), cmd, int(fields[19]))
    return table


def session_processes(table: ProcTable, driver_pid: int, session: str, exclude: int | None = None) -> dict[int, int]:
    """The embedded cluster's processes in ``table``: children of ``driver_pid`` whose command line contains
    the session name (``session_<date>_<pid>``), and all their descendants, but not ``exclude`` (the watchdog,
    whose own command line names the session). Returns ``{pid: starttime}``."""
    return descendants(table, [p for p, (ppid, cmd, _) in table.items()
                               if ppid == driver_pid and session in cmd and p != exclude])


def descendants(table: ProcTable, roots: "list[int] | dict[int, int]") -> dict[int, int]:
    """``roots`` that are in ``table`` and all their descendants there: ``{pid: starttime}``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [p for p in roots if p in table]
    found: dict[int, int] = {}
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = table[pid][2]
        todo.extend(children.get(pid, []))
    return found


def still_running(known: dict[int, int], table: ProcTable) -> dict[int, int]:
    """Those of ``known`` (``{pid: starttime}``) still alive as the same process (same start time)."""
    return {pid: st for pid, st in known.items() if pid in table and table[pid][2] == st}


def _reap(known: dict[int, int], grace_s: float = 2.0) -> int:
    alive = still_running(known, read_procs())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = still_running(alive, read_procs())
        if not alive:
            break
    return len(known)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemray.controller.watchdog")
    ap.add_argument("--driver", type=int, required=True)
    ap.add_argument("--session", required=True)
    ap.add_argument("--poll", type=float, default=1.0)
    ns = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the driver (a preemption notice)
    known: dict[int, int] = {}
    while True:
        table = read_procs()
        if ns.driver not in table:
            break
        known = {**still_running(known, table), **session_processes(table, ns.driver, ns.session, os.getpid())}
        ready, _, _ = select.select([sys.stdin], [], [], ns.poll)
        if ready and not os.read(sys.stdin.fileno(), 4096):  # EOF: the driver closed it or died
            break
    # a last look: what the cluster's surviving processes started since the last poll (the raylet starts its agents
    # and workers at any time; one started within the poll before the driver died was not known yet and lingered)
    table = read_procs()
    known = descendants(table, still_running(known, table))  # the survivors (same pid, same start) and below
    _reap(known)
    return 0


_watchdog: subprocess.Popen | None = None


def start(session_dir: str) -> None:
    """Start the watchdog for this driver's embedded cluster of ``session_dir`` (Ray's session folder);
    nothing without ``/proc``. :func:`stop` ends it."""
    global _watchdog
    if not Path("/proc/self/stat").exists() or _watchdog is not None:
        return
    _watchdog = subprocess.Popen(
        [sys.executable, "-m", "gemray.controller.watchdog", "--driver", str(os.getpid()),
         "--session", Path(session_dir).name], stdin=subprocess.PIPE, start_new_session=True)


def stop(timeout_s: float = 10.0) -> None:
    """After ``ray.shutdown()``: close the watchdog's pipe (it reaps what is left of the cluster) and wait."""
    global _watchdog
    w, _watchdog = _watchdog, None
    if w is None:
        return
    w.stdin.close()
    try:
        w.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        w.kill()


if __name__ == "__main__":
    sys.exit(main())
