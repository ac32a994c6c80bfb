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
