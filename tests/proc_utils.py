"""Process helpers shared by the tests that start Ray heads or process groups outside pytest's process."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, args: tuple, nprocs: int, done: list[Path]) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` for tests whose workers write ``done`` files as the
    last step of their work (after every check in them passed). A rank that dies by SIGABRT once all those
    files exist crashed in process-group teardown at exit (seen once under load: "terminate called without an
    active exception" from a gloo thread after destroy_process_group); that is accepted, with a warning, as
    it is not what the tests check. Any other failure, or an abort before the work was done, is raised."""
    import warnings

    import torch.multiprocessing as mp

    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessExitedException as e:
        if e.signal_name != "SIGABRT" or not all(p.exists() for p in done):
            raise
        warnings.warn(f"rank {e.error_index} aborted after its work was done (teardown): {e}")


def pids_with(marker: str) -> list[int]:
    """Pids (not this process) whose command line contains ``marker`` (e.g. a private Ray temp dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:  # the process ended meanwhile
                pass
    return out


def kill_marked(marker: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line contains ``marker``."""
    for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        pids = pids_with(marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(pause)
