"""The ranks' preemption vote: every ``checkpoint.preempt_poll_steps`` global steps each rank looks for a
notice and all ranks all-reduce what they saw (``gemray.preemption`` describes the notices and decides).

Sources of a notice on one rank: the job's notice file (``checkpoint.preempt_notice``, written by the
driver's SIGTERM handler or ``gemray preempt``), a SIGTERM to this process (only where a handler can be
installed: plain torch.distributed processes, not Ray Train workers, whose train function runs off the main
thread), and Ray Train's node-drain notice (``ray.train.get_preemption_info``).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from gemray.preemption import preemption_action, read_notice

log = logging.getLogger("gemray.train")

# This process got SIGTERM (process-wide: a signal handler has no object to talk to).
_SIGTERM = threading.Event()


def _ray_preemption_info() -> Any:
    """Ray Train's node-drain notice for this worker group (None outside Ray Train or when none)."""
    try:
        import ray.train

        get = getattr(ray.train, "get_preemption_info", None)
        return get() if get is not None else None
    except Exception:  # no Ray Train context (plain torch.distributed processes)
        return None


class PreemptionVote:
    """The collective vote of one attempt.

    notice_path: the job's notice file ("" = none); device: where the vote tensor lives (the process
    group's device); world_size: ranks voting; poll_steps: vote every this many global steps (0 = never).
    Creating one forgets a SIGTERM flag left by an earlier attempt in this process.
    """

    def __init__(self, notice_path: str, device: torch.device, world_size: int, poll_steps: int = 0):
        if poll_steps < 0:
            raise ValueError(f"checkpoint.preempt_poll_steps: expected >= 0 (0 = off), got {poll_steps}")
        self.notice_path, self.device, self.world_size = notice_path, device, int(world_size)
        self.poll_steps = int(poll_steps)
        self.drain_handled = False  # Ray's drain notice is answered with one checkpoint, then ignored
        _SIGTERM.clear()

    @staticmethod
    def install_sigterm_handler() -> bool:
        """SIGTERM -> this rank votes "stop" at the next poll (the first SIGTERM only; the previous handler
        comes back for a second one). Only possible from the main thread: returns False elsewhere (Ray
        Train V2 runs the train function in a thread; its notice comes as a file)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):  # noqa: ARG001
            log.warning("SIGTERM received: emergency checkpoint at the next poll step, then stop")
            _SIGTERM.set()
            signal.signal(signal.SIGTERM, previous if callable(previous) else signal.SIG_DFL)

        signal.signal(signal.SIGTERM, handler)
        return True

    def agree(self) -> str | None:
        """Collective: every rank calls it at the same global step. Returns ``preemption_action``'s
        verdict: "stop" if any rank sees the job's notice file or got SIGTERM, "checkpoint" if any rank has
        Ray Train's node-drain notice (ignored once handled), else None. The all-reduce completing on every
        rank is what shows the group is still healthy."""
        stop = _SIGTERM.is_set() or read_notice(self.notice_path) is not None
        drain = not self.drain_handled and _ray_preemption_info() is not None
        votes = torch.tensor([int(stop), int(drain)], dtype=torch.int64, device=self.device)
        dist.all_reduce(votes)
        votes = votes.cpu()
        return preemption_action(int(votes[0]), int(votes[1]), self.world_size)

    def poll(self, global_step: int, epoch_last_step: bool) -> str | None:
        """The vote at a poll step, None elsewhere (collective at poll steps, identical on every rank).

        Poll steps: every ``poll_steps`` global steps and each epoch's last step (were the last step skipped,
        a poll interval that divides the steps per epoch would never vote: each of its steps would be an
        epoch's last). A "checkpoint" verdict marks Ray's drain notice handled.
        """
        if not self.poll_steps or not (global_step % self.poll_steps == 0 or epoch_last_step):
            return None
        action = self.agree()
        self.drain_handled = self.drain_handled or action == "checkpoint"
        return action

    def emergency_checkpoint_taken(self) -> None:
        """After the emergency checkpoint of a "checkpoint" verdict: forget this process's SIGTERM flag."""
        _SIGTERM.clear()
