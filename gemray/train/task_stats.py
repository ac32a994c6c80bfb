"""Per-task training losses of a multi-task GEM (retrieval / ctr / cvr), reduced over ranks at epoch ends."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TaskLosses:
    """Running per-task loss sums of one epoch: each step's ``loss_<task>`` (the task's mean over its
    population on this rank) weighted by ``count_<task>`` (that population's size), as ``GEM.forward``'s stats
    give them.

    tasks: the task names (``cfg.model.tasks``). :meth:`reduce` (collective) -> {"train_loss_<task>": global
    mean over the epoch's populations (0.0 where a task saw none)}. A single-task model has nothing to add
    (``train_loss`` is its loss), so the trainer only keeps one for several tasks. Counts restart with an
    attempt: after a mid-epoch restore the epoch's per-task figures cover the steps since the restore.
    """

    def __init__(self, tasks: list[str]):
        self.tasks = list(tasks)
        self._sums: list = [0.0] * (2 * len(self.tasks))

    def add(self, stats: dict) -> None:
        """One step's stats dict (tensors or floats); tasks absent from it add nothing. Tensors are summed as
        tensors, on their device (float64): nothing is read on the host until :meth:`reduce` (a read per step
        and task would be a host sync each on CUDA)."""
        for j, t in enumerate(self.tasks):
            n = stats.get(f"count_{t}")
            if n is None:
                continue
            loss = stats[f"loss_{t}"]
            if isinstance(n, torch.Tensor) or isinstance(loss, torch.Tensor):
                # a CPU 0-d count beside a device loss (retrieval's num_targets) multiplies as a scalar: no copy
                n = torch.as_tensor(n).detach().to(torch.float64)
                loss = torch.as_tensor(loss).detach().to(torch.float64)
            else:
                n, loss = float(n), float(loss)
            self._sums[2 * j] = self._sums[2 * j] + loss * n
            self._sums[2 * j + 1] = self._sums[2 * j + 1] + n

    def reduce(self, device: torch.device) -> dict[str, float]:
        """Collective: sum over ranks, return the per-task means and restart the sums."""
        s = torch.stack([torch.as_tensor(v).detach().to(device=device, dtype=torch.float64).reshape(())
                         for v in self._sums])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(s)
        s = s.cpu()
        self._sums = [0.0] * (2 * len(self.tasks))
        return {f"train_loss_{t}": float(s[2 * j] / s[2 * j + 1]) if float(s[2 * j + 1]) > 0 else 0.0
                for j, t in enumerate(self.tasks)}


class MoEStats:
    """Mixture-of-experts routing figures of one epoch: the mean over steps and ranks of each step's
    ``moe_aux_loss`` (Switch's load-balancing loss, 1.0 = balanced) and ``moe_dropped`` (share of the
    token-expert assignments over capacity), as ``GEM.forward``'s stats give them. :meth:`reduce`
    (collective) -> {"train_moe_aux_loss", "train_moe_dropped"} and restarts the sums."""

    KEYS = ("moe_aux_loss", "moe_dropped")

    def __init__(self):
        self._sums = [0.0] * (len(self.KEYS) + 1)

    def add(self, stats: dict) -> None:
        """One step's stats dict; a step without the keys adds nothing."""
        if self.KEYS[0] not in stats:
            return
        for j, k in enumerate(self.KEYS):
            self._sums[j] += float(stats[k])
        self._sums[-1] += 1.0

    def reduce(self, device: torch.device) -> dict[str, float]:
        s = torch.tensor(self._sums, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(s)
        s = s.cpu()
        self._sums = [0.0] * (len(self.KEYS) + 1)
        n = float(s[-1])
        return {f"train_{k}": float(s[j]) / n if n else 0.0 for j, k in enumerate(self.KEYS)}
