"""The train stream's batches made off the training thread: ``torch.utils.data.DataLoader`` worker processes.

:class:`TrainLoader` has the interface the Trainer and ``gemray bench train`` use of
:class:`gemray.pipelines.stream.ElasticTrainStream` (``iter_epoch(epoch, consumed)`` yielding ``(batch,
consumed_after)``, ``num_steps``, ``num_samples``, ``sample_ids``) and delegates to it. With ``workers`` N = 0 it
is that stream, in the calling thread. With N >= 1 each epoch's batches come from a DataLoader over
:class:`EpochSteps` (an IterableDataset) with N forked worker processes: every worker walks the whole epoch's
plan (:func:`gemray.pipelines.bbs.plan_global_step`, cheap) and collates only the steps i with i % N == w, its
own; the DataLoader takes one item from each worker in turn, so the batches arrive in step order and are exactly
the in-process ones, ``consumed`` included (tests/test_pipelines_loader.py). Workers keep ``prefetch`` batches
each ready ahead; with ``pin_memory`` (on CUDA) the DataLoader's pin thread calls ``JaggedBatch.pin_memory()``
so the training step copies to the device without pinning (``JaggedBatch.is_pinned``).

The rank's histories are read (``HistoryStream._load``) in the parent before the workers fork: they share the
buffers copy-on-write and read no file. The fork start method is used also when the parent has CUDA initialised:
a worker touches no CUDA (collation is numpy and CPU torch; ``torch.set_num_threads(1)`` there). An exception in
a worker is raised in the caller as the same type with the same message, the worker's traceback added as a note
(``_WorkerFailure``). Leaving an epoch early (``close()`` on the generator, or dropping it) shuts its worker
processes down at once.
"""

from __future__ import annotations

import traceback
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gemray.config import DataConfig
from gemray.jagged import JaggedBatch

from .stream import ElasticTrainStream


class _WorkerFailure:
    """An exception raised in a loader worker, sent to the caller as an item (type, message, traceback) so that
    the caller raises the same type with the same message (DataLoader's own re-raise prefixes the message)."""

    def __init__(self, exc: BaseException, worker: int):
        self.exc_type, self.message, self.worker = type(exc), str(exc), worker
        self.traceback = "".join(traceback.format_exception(exc))

    def raise_(self) -> None:
        try:
            err = self.exc_type(self.message)
        except Exception:  # a type that does not take one message
            err = RuntimeError(f"{self.exc_type.__name__}: {self.message}")
        err.add_note(f"(raised in data loader worker {self.worker}; its traceback:\n{self.traceback.rstrip()})")
        raise err


class EpochSteps(IterableDataset):
    """One epoch of an :class:`ElasticTrainStream` from position ``consumed``, as a DataLoader dataset: in worker w
    of N it yields ``(batch, consumed_after)`` of the steps i (0-based from ``consumed``) with i % N == w; outside
    a worker all of them."""

    def __init__(self, stream: ElasticTrainStream, epoch: int, consumed: int):
        self.stream, self.epoch, self.consumed = stream, epoch, consumed

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        try:
            yield from self.stream.iter_epoch(self.epoch, self.consumed, part=(worker, workers))
        except Exception as e:  # to the caller as an item: same type, same message
            yield _WorkerFailure(e, worker)


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    torch.set_num_threads(1)  # a worker gathers into small buffers: the parent's cores are for the step


def _identity(item: Any) -> Any:
    return item


def describe_workers(workers: int) -> str:
    """Pure: ``in-process`` for 0 loader workers, else ``N worker process(es)``."""
    n = int(workers)
    return "in-process" if n == 0 else f"{n} worker process{'es' if n > 1 else ''}"


class TrainLoader:
    """:class:`ElasticTrainStream` with its batches made by ``workers`` background processes (module docstring).

    stream: the rank's train stream. workers: 0 = in the calling thread (the stream itself), N >= 1 = N
    DataLoader worker processes. prefetch: batches each worker keeps ready (DataLoader's prefetch_factor).
    pin_memory: pin each batch in the DataLoader's pin thread (needs CUDA; only with workers >= 1).
    Raises ValueError for workers < 0 or prefetch < 1.
    """

    def __init__(self, stream: ElasticTrainStream, *, workers: int = 0, prefetch: int = 2, pin_memory: bool = False):
        if workers < 0 or prefetch < 1:
            raise ValueError(f"TrainLoader: expected workers >= 0 and prefetch >= 1, got {workers}, {prefetch}")
        self.stream, self.workers, self.prefetch = stream, int(workers), int(prefetch)
        self.pin_memory = bool(pin_memory and workers)

    @classmethod
    def from_config(cls, data_cfg: DataConfig, *, rank: int, world_size: int, seed: int,
                    device_type: str) -> "TrainLoader":
        """The train stream of ``data_cfg`` with ``data.loader_workers`` resolved for ``device_type`` ("auto": 1
        on "cuda", 0 elsewhere), ``data.prefetch_batches``, pinning on CUDA."""
        stream = ElasticTrainStream.from_config(data_cfg, rank=rank, world_size=world_size, seed=seed)
        return cls(stream, workers=data_cfg.resolved_loader_workers(device_type), prefetch=data_cfg.prefetch_batches,
                   pin_memory=device_type == "cuda")

    # the stream's interface, delegated
    @property
    def base(self):
        return self.stream.base

    @property
    def rank(self) -> int:
        return self.stream.rank

    @property
    def world_size(self) -> int:
        return self.stream.world_size

    def num_samples(self) -> int:
        return self.stream.num_samples()

    def sample_ids(self) -> np.ndarray:
        return self.stream.sample_ids()

    def num_steps(self, consumed: int = 0) -> int:
        return self.stream.num_steps(consumed)

    def describe(self) -> str:
        """``in-process`` or ``N worker process(es)``: for logs and the bench table (:func:`describe_workers`)."""
        return describe_workers(self.workers)

    def iter_epoch(self, epoch: int, consumed: int = 0) -> Iterator[tuple[JaggedBatch, int]]:
        """Yield this rank's batch and the new global position for each remaining step of ``epoch``: the
        stream's own sequence. With workers the worker processes start at the first ``next()`` and stop when the
        epoch ends, the generator is closed or it is dropped. Raises ValueError (before any worker starts) for
        epoch < 0 or a position outside the epoch."""
        if not self.workers:
            yield from self.stream.iter_epoch(epoch, consumed)
            return
        self.stream.check_position(epoch, consumed)  # the caller's error here, not a worker's
        steps = self.stream.num_steps(consumed)
        if steps == 0:
            return
        workers = min(self.workers, steps)  # a worker without a step would only fork
        self.stream.base._load()  # read in this process: the workers fork with it (copy-on-write)
        loader = DataLoader(EpochSteps(self.stream, epoch, consumed), batch_size=None, collate_fn=_identity,
                            num_workers=workers, prefetch_factor=self.prefetch, pin_memory=self.pin_memory,
                            worker_init_fn=_worker_init, multiprocessing_context="fork",
                            generator=torch.Generator())  # its worker seed draw leaves the global RNG alone
        it = iter(loader)
        try:
            for item in it:
                if isinstance(item, _WorkerFailure):
                    item.raise_()
                yield item
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)  # at once, not when the iterator is collected
            if shutdown is not None:
                shutdown()
            del it
