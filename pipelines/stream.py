"""Prepared MovieLens histories -> per-rank streams of :class:`gemray.jagged.JaggedBatch`, via Ray Data.

Shape key: B samples in a batch, T tokens in a batch, S samples on a rank, R ranks (world_size).

Sharding is deterministic and independent of Ray's dynamic splitting: the logical shards are the
Parquet row groups listed in the manifest (``manifest["shards"]``, each a contiguous user-id range of
one file) and :func:`assign_shards` deals them round-robin to ranks (shard k -> rank k % R). A rank
reads only its shards with ``ray.data.read_parquet`` (a user-id range filter per shard, so Parquet
statistics skip the other row groups), sorts them by user_id, and from then on plans every epoch from
the token counts alone (:func:`gemray.pipelines.bbs.plan_epoch`). A (world_size, rank, epoch, batch)
tuple therefore names exactly which samples were consumed: the hook for exactly-once elastic resume.

Every rank yields exactly :meth:`HistoryStream.num_batches` batches per epoch, the same number on every
rank, computed from the manifest alone (ceil(max over ranks of the rank's split users / batch_size)).
A rank with fewer samples yields **empty trailing batches** (B=0, ``offsets == [0]``, empty tensors,
``targets`` empty for valid/test) so that collective ops in the training step never hang; the model must
accept B=0.

The rank's split-eligible histories are held in memory as flat Arrow buffers (ML-1M: ~1M tokens,
~17 MB in all, less per rank); batches are collated straight from them with ``pyarrow.compute``
(``list_value_length`` / ``list_flatten``) and numpy index gathers: no per-row Python objects, no
padding. Per-row truncation to ``max_seq_len`` is a gather (``pc.list_slice`` only takes one start/stop
for the whole array).

Needs Ray to be initialised by the caller (Ray Train workers are). Sets
``DataContext.get_current().use_datasource_v2 = False`` (the 2.60 default reader spends ~10 s starting).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gemray.config import DataConfig
from gemray.jagged import JaggedBatch, lengths_to_offsets

from .bbs import global_epoch_order, global_steps_left, plan_epoch, plan_global_step
from .movielens import load_manifest
from .schema import HISTORY_SCHEMA, check_split, split_input_bounds
from .shards import _check_rank, _eligible, assign_shards, num_batches_for

log = logging.getLogger(__name__)

__all__ = ["ElasticTrainStream", "HistoryStream"]


# Streams of the same rank (train / valid / test) share one read: (folder, manifest mtime, shards) -> table.
_READ_CACHE: dict[tuple, pa.Table] = {}
_READ_CACHE_SIZE = 4


def _read_rank_table(manifest: dict[str, Any], shards: list[dict[str, Any]], reader: str = "ray_data") -> pa.Table:
    """Read this rank's shards (cached per process); a HISTORY_SCHEMA table by user_id.

    reader: "ray_data" (``ray.data.read_parquet`` tasks) or "arrow" (pyarrow in this process). Raises
    ValueError for another reader or when the rows read differ from the manifest's count."""
    if reader not in ("ray_data", "arrow"):
        raise ValueError(f"reader: expected 'ray_data' or 'arrow', got {reader!r}")
    if not shards:
        return HISTORY_SCHEMA.empty_table()
    root = Path(manifest["prepared_dir"])
    key = (str(root), (root / "manifest.json").stat().st_mtime_ns, tuple(s["index"] for s in shards))
    if key not in _READ_CACHE:
        while len(_READ_CACHE) >= _READ_CACHE_SIZE:
            _READ_CACHE.pop(next(iter(_READ_CACHE)))
        _READ_CACHE[key] = _read_rank_table_uncached(manifest, shards, reader)
    return _READ_CACHE[key]


def _read_rank_table_uncached(manifest: dict[str, Any], shards: list[dict[str, Any]],
                              reader: str = "ray_data") -> pa.Table:
    root = Path(manifest["prepared_dir"])
    paths = [str(root / f) for f in sorted({s["file"] for s in shards})]
    user = pc.field("user_id")
    expr = None
    for s in shards:
        term = (user >= s["first_user_id"]) & (user <= s["last_user_id"])
        expr = term if expr is None else expr | term
    if reader == "arrow":
        import pyarrow.dataset as pads

        log.info("reading shards %s of %s with pyarrow", [s["index"] for s in shards], root)
        read = pads.dataset(paths, format="parquet").to_table(columns=HISTORY_SCHEMA.names, filter=expr)
        parts = [read] if read.num_rows else []
    else:
        parts = _read_with_ray_data(paths, expr, root, shards)
    table = pa.concat_tables(parts).select(HISTORY_SCHEMA.names).cast(HISTORY_SCHEMA) if parts \
        else HISTORY_SCHEMA.empty_table()
    want = sum(s["rows"] for s in shards)
    if table.num_rows != want:
        raise ValueError(f"{root}: read {table.num_rows} rows for shards {[s['index'] for s in shards]}, "
                         f"manifest says {want}; the prepared folder changed since its manifest was written")
    return table.sort_by("user_id")


def _read_with_ray_data(paths: list[str], expr: Any, root: Path, shards: list[dict[str, Any]]) -> list[pa.Table]:
    import ray
    import ray.data

    if not ray.is_initialized():
        raise RuntimeError("HistoryStream reads with Ray Data: call ray.init(...) first "
                           "(inside Ray Train workers Ray is already initialised)")
    ray.data.DataContext.get_current().use_datasource_v2 = False
    log.info("reading shards %s of %s with Ray Data", [s["index"] for s in shards], root)
    # Small CPU ask per read task: inside Ray Train the workers hold most CPUs, and read tasks that wait
    # for a whole free CPU can stall the step (NOTES.md: 2 workers + a read on 2 CPUs hung).
    ds = ray.data.read_parquet(paths, columns=HISTORY_SCHEMA.names, filter=expr, num_cpus=0.25)
    return [b for b in ds.iter_batches(batch_format="pyarrow", batch_size=None) if b.num_rows]


class HistoryStream:
    """One rank's stream of jagged batches for one split (train / valid / test) of a prepared folder.

    prepared_dir: output of ``prepare_movielens`` (checked with ``load_manifest``).
    split: "train" (sequence h[:-2], ``targets`` None), "valid" (input h[:-2], target h[-2]) or "test"
        (input h[:-1], target h[-1]); inputs keep the most recent ``max_seq_len`` items
        (see :mod:`gemray.pipelines.schema`). Users with < 3 interactions are never yielded.
    rank / world_size: this rank's place; shards via :func:`assign_shards`.
    batch_size: samples per batch (B <= batch_size).
    bbs / sub_batch_size / bbs_window_batches: base batch shuffling (:mod:`gemray.pipelines.bbs`);
        train only. shuffle: seeded permutation by (seed, epoch, rank); train only.
    Valid and test are never shuffled nor BBS'd: batches follow ascending user_id.
    reader: "ray_data" (``ray.data.read_parquet`` tasks; needs Ray initialised) or "arrow" (pyarrow in
        this process; no Ray tasks): same table either way.

    Yields :class:`gemray.jagged.JaggedBatch` on CPU: user_ids [B], offsets [B+1], item_ids / ratings
    (half stars) / timestamps [T], all int64; targets and target_timestamps (the target's unix seconds)
    [B] int64 for valid/test. Raises ValueError for
    bad arguments, FileNotFoundError when the folder is not prepared.
    """

    def __init__(self, prepared_dir: str | Path, split: str, *, rank: int, world_size: int,
                 batch_size: int, max_seq_len: int, bbs: bool = True, sub_batch_size: int = 16,
                 bbs_window_batches: int = 8, shuffle: bool = True, seed: int = 0, reader: str = "ray_data",
                 train_includes_valid: bool = False):
        check_split(split)
        _check_rank(world_size, rank)
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_seq_len ({max_seq_len}) must be >= 1")
        self.split, self.rank, self.world_size = split, rank, world_size
        self.batch_size, self.max_seq_len, self.seed = batch_size, max_seq_len, seed
        train = split == "train"
        self.bbs, self.shuffle = bool(bbs and train), bool(shuffle and train)
        self.sub_batch_size, self.bbs_window_batches = sub_batch_size, bbs_window_batches
        if self.bbs and (sub_batch_size < 1 or bbs_window_batches < 1 or batch_size % sub_batch_size):
            raise ValueError(f"bbs: batch_size ({batch_size}) must be a positive multiple of sub_batch_size "
                             f"({sub_batch_size}) and bbs_window_batches ({bbs_window_batches}) >= 1")
        if reader not in ("ray_data", "arrow"):
            raise ValueError(f"reader: expected 'ray_data' or 'arrow', got {reader!r}")
        self.reader = reader
        self.train_includes_valid = bool(train_includes_valid)
        self.manifest = load_manifest(prepared_dir)
        self.shards = assign_shards(self.manifest, world_size, rank)
        self._num_batches = num_batches_for(self.manifest, world_size, batch_size)
        self._data: dict[str, np.ndarray] | None = None

    @classmethod
    def from_config(cls, data_cfg: DataConfig, split: str, *, rank: int, world_size: int,
                    seed: int) -> "HistoryStream":
        """Build from ``DataConfig``: train uses ``batch_size``, valid/test ``eval_batch_size``."""
        return cls(data_cfg.prepared_dir, split, rank=rank, world_size=world_size,
                   batch_size=data_cfg.batch_size if split == "train" else data_cfg.eval_batch_size,
                   max_seq_len=data_cfg.max_seq_len, bbs=data_cfg.bbs, sub_batch_size=data_cfg.sub_batch_size,
                   bbs_window_batches=data_cfg.bbs_window_batches, shuffle=data_cfg.shuffle, seed=seed,
                   reader=data_cfg.reader, train_includes_valid=data_cfg.train_includes_valid)

    def num_batches(self) -> int:
        """Batches per epoch, identical on every rank (from the manifest alone; trailing ones may be empty)."""
        return self._num_batches

    def num_samples(self) -> int:
        """Split-eligible users on this rank (from the manifest)."""
        return sum(s["split_users"] for s in self.shards)

    def _load(self) -> dict[str, np.ndarray]:
        if self._data is None:
            table = _eligible(_read_rank_table(self.manifest, self.shards, self.reader))
            n = pc.list_value_length(table.column("item_ids")).to_numpy().astype(np.int64)
            start, stop = split_input_bounds(n, self.split, self.max_seq_len,
                                             train_includes_valid=self.train_includes_valid)
            row_start = np.zeros(n.size, np.int64)
            np.cumsum(n[:-1], out=row_start[1:])

            def flat(col: str) -> np.ndarray:
                return pc.list_flatten(table.column(col)).to_numpy().astype(np.int64)

            self._data = {"user_ids": table.column("user_id").to_numpy().astype(np.int64),
                          "row_start": row_start, "start": start, "stop": stop,
                          "item_ids": flat("item_ids"), "ratings": flat("ratings"),
                          "timestamps": flat("timestamps")}
            if n.size != self.num_samples():
                raise ValueError(f"rank {self.rank}: {n.size} split users read, manifest says "
                                 f"{self.num_samples()}")
            log.debug("rank %d/%d %s: %d users, %d tokens", self.rank, self.world_size, self.split,
                      n.size, int((stop - start).sum()))
        return self._data

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as index arrays into this rank's users (ascending user_id order)."""
        d = self._load()
        return plan_epoch(d["stop"] - d["start"], num_batches=self._num_batches, batch_size=self.batch_size,
                          bbs=self.bbs, sub_batch_size=self.sub_batch_size,
                          window_batches=self.bbs_window_batches, shuffle=self.shuffle, seed=self.seed,
                          epoch=epoch, rank=self.rank)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[JaggedBatch]:
        """Yield batches ``start_batch .. num_batches()-1`` of ``epoch`` (deterministic: resume skips).

        Raises ValueError for epoch < 0 or start_batch outside 0..num_batches().
        """
        if epoch < 0 or not 0 <= start_batch <= self._num_batches:
            raise ValueError(f"iter_epoch: expected epoch >= 0 and 0 <= start_batch <= {self._num_batches}, "
                             f"got epoch={epoch}, start_batch={start_batch}")
        plan = self.plan(epoch)
        for b in range(start_batch, self._num_batches):
            yield self._collate(plan[b])

    def _collate(self, idx: np.ndarray) -> JaggedBatch:
        d = self._load()
        start, stop = d["start"][idx], d["stop"][idx]
        lens = stop - start
        offsets = lengths_to_offsets(torch.from_numpy(lens))
        base = d["row_start"][idx] + start
        total = int(lens.sum())
        gather = np.repeat(base - offsets[:-1].numpy(), lens) + np.arange(total, dtype=np.int64)
        targets = target_ts = None
        if self.split != "train":
            targets = torch.from_numpy(d["item_ids"][d["row_start"][idx] + stop])
            target_ts = torch.from_numpy(d["timestamps"][d["row_start"][idx] + stop])
        return JaggedBatch(
            user_ids=torch.from_numpy(d["user_ids"][idx]), offsets=offsets,
            item_ids=torch.from_numpy(d["item_ids"][gather]), ratings=torch.from_numpy(d["ratings"][gather]),
            timestamps=torch.from_numpy(d["timestamps"][gather]), targets=targets,
            target_timestamps=target_ts)


class ElasticTrainStream:
    """The train split as one global, world-size-independent plan: exactly-once data across restarts.

    Every rank holds all split-eligible train samples (read once through :class:`HistoryStream` with
    world_size 1, so all Parquet row groups; ML-1M: ~17 MB per rank). The epoch's order is
    :func:`gemray.pipelines.bbs.global_epoch_order` (seed, epoch); each step consumes the next
    ``world_size * batch_size`` samples of it and BBS deals them to the ranks
    (:func:`gemray.pipelines.bbs.plan_global_step`). The data position is therefore one integer per
    epoch, ``consumed`` (a prefix of the order); a checkpoint storing (epoch, consumed) resumes at any
    world size with every sample trained exactly once per epoch.

    Yields ``(batch, consumed_after)`` pairs: the rank's :class:`gemray.jagged.JaggedBatch` (B may be 0
    at the epoch's end) and the global prefix consumed once this step is done (same on every rank).
    """

    def __init__(self, base: "HistoryStream", *, rank: int, world_size: int):
        _check_rank(world_size, rank)
        if base.split != "train" or base.world_size != 1:
            raise ValueError("ElasticTrainStream: base must be the train HistoryStream of world_size 1")
        self.base, self.rank, self.world_size = base, rank, world_size

    @classmethod
    def from_config(cls, data_cfg: DataConfig, *, rank: int, world_size: int, seed: int) -> "ElasticTrainStream":
        """Build from ``DataConfig`` (batch_size per rank, bbs, sub_batch_size, shuffle)."""
        base = HistoryStream.from_config(data_cfg, "train", rank=0, world_size=1, seed=seed)
        return cls(base, rank=rank, world_size=world_size)

    def num_samples(self) -> int:
        """N: split-eligible train users (all ranks together)."""
        return self.base.num_samples()

    def sample_ids(self) -> np.ndarray:
        """[N] int64 user ids in canonical (ascending) order: what a per-sample ledger should cover."""
        return self.base._load()["user_ids"].copy()

    def num_steps(self, consumed: int = 0) -> int:
        """Steps left in an epoch from position ``consumed`` at this world size (same on every rank)."""
        return global_steps_left(self.num_samples(), consumed, self.world_size, self.base.batch_size)

    def iter_epoch(self, epoch: int, consumed: int = 0) -> Iterator[tuple[JaggedBatch, int]]:
        """Yield this rank's batch and the new global position for each remaining step of ``epoch``."""
        if epoch < 0:
            raise ValueError(f"iter_epoch: epoch must be >= 0, got {epoch}")
        d = self.base._load()
        lengths = d["stop"] - d["start"]
        order = global_epoch_order(lengths.size, seed=self.base.seed, epoch=epoch, shuffle=self.base.shuffle)
        if not 0 <= consumed <= order.size:
            raise ValueError(f"iter_epoch: consumed={consumed} outside 0..{order.size}")
        while consumed < order.size:
            parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=self.world_size,
                                               batch_size=self.base.batch_size, bbs=self.base.bbs,
                                               sub_batch_size=self.base.sub_batch_size, seed=self.base.seed,
                                               epoch=epoch)
            yield self.base._collate(parts[self.rank]), consumed
