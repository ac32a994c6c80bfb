"""When to checkpoint: a pure decision (torchtitan's ``CheckpointManager._should_save`` pattern).

The trainer asks :meth:`CheckpointPolicy.reason` after every step that may checkpoint and at every epoch's
end; a reason means "save now, and record why", None means "not now". The policy holds no state and does
no I/O, so every rank, given the same global step and epoch, reaches the same answer (a checkpoint is
collective).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The reasons :meth:`CheckpointPolicy.reason` gives (recorded in checkpoint events and reports).
REASONS = ("final", "epoch", "emergency", "periodic")


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoint every ``every_steps`` global steps (0 = never by step count), every ``every_epochs``
    epochs, after the last of ``epochs`` epochs, and on a preemption notice the ranks agreed on.

    Raises ValueError naming the config field for every_steps < 0, every_epochs < 1 or epochs < 0.
    """

    every_steps: int
    every_epochs: int = 1
    epochs: int = 1

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps: expected >= 0 (0 = off), got {self.every_steps}")
        if self.every_epochs < 1:
            raise ValueError(f"checkpoint.every_epochs: expected >= 1, got {self.every_epochs}")
        if self.epochs < 0:
            raise ValueError(f"train.epochs: expected >= 0, got {self.epochs}")

    @classmethod
    def from_config(cls, cfg) -> "CheckpointPolicy":
        """From a ``JobConfig``: ``checkpoint.every_steps``, ``checkpoint.every_epochs``, ``train.epochs``."""
        return cls(int(cfg.checkpoint.every_steps), int(cfg.checkpoint.every_epochs), int(cfg.train.epochs))

    def reason(self, global_step: int, *, epoch_end: bool, epochs_done: int = 0, preempt: bool = False
               ) -> str | None:
        """Why to checkpoint now, or None. First match wins:

        "final" (an epoch end with ``epochs_done == epochs``), "epoch" (an epoch end with ``epochs_done`` a
        multiple of ``every_epochs``), "emergency" (``preempt``: some rank has a preemption notice and the
        vote completed on every rank), "periodic" (``global_step`` a multiple of ``every_steps``; also at an
        epoch end that is not an "epoch" one).

        global_step: steps done so far over the whole run (1 after the first step); epoch_end: called after
        an epoch's last step and its evaluation; epochs_done: completed epochs, counting this one when
        ``epoch_end``.
        """
        if epoch_end and epochs_done == self.epochs:
            return "final"
        if epoch_end and epochs_done % self.every_epochs == 0:
            return "epoch"
        if preempt:
            return "emergency"
        if self.every_steps and global_step % self.every_steps == 0:
            return "periodic"
        return None
