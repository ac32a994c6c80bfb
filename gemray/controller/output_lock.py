"""One run per output folder: the driver claims the folder before Ray starts and releases it when the run ends.

The claim is the active marker beside the preemption notice (``<notice>.active``,
:mod:`gemray.preemption`: pid and host, its modification time refreshed by a heartbeat while the driver
lives). Two runs in one folder would train from the same checkpoints, interleave their events and exceed
``checkpoint.keep``; the marker is also what `gemray preempt --wait` (a Kubernetes preStop hook) watches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gemray.controller.preflight import preflight_active
from gemray.preemption import active_path, claim_active, clear_active

log = logging.getLogger(__name__)


def claim_output(notice_path: str | Path) -> bool:
    """Make this driver the output folder's one active run before Ray starts: create the active marker beside
    ``notice_path`` atomically (:func:`gemray.preemption.claim_active`); where one is there already,
    :func:`gemray.controller.preflight.preflight_active` refuses (a live run) or the marker is dropped as
    abandoned and the claim retried. Returns False (with a warning) when the marker cannot be written at all:
    the run goes on without it, and `gemray preempt --wait` returns at once. Raises FileExistsError for a
    folder in use."""
    for _ in range(3):
        try:
            if claim_active(notice_path):
                return True
        except OSError as e:
            log.warning("could not write the run's active marker beside %s (%s): another run into this folder "
                        "will not be refused and `gemray preempt --wait` will return at once", notice_path, e)
            return False
        preflight_active(notice_path)  # raises while that run is alive
        active_path(notice_path).unlink(missing_ok=True)
    raise FileExistsError(f"could not claim the output folder of {notice_path}: other runs are starting in it "
                          "at the same time")


def release_output(notice_path: str | Path) -> None:
    """Drop this driver's claim (stop the heartbeat, remove the marker); nothing to do when there is none
    (a preempted run drops it itself, right after marking its notice handled)."""
    clear_active(notice_path)


@contextmanager
def output_claimed(notice_path: str | Path) -> Iterator[bool]:
    """``with output_claimed(notice):`` the folder is this run's (:func:`claim_output`; yields whether the
    marker could be written) until the block ends, however it ends."""
    claimed = claim_output(notice_path)
    try:
        yield claimed
    finally:
        if claimed:
            release_output(notice_path)
