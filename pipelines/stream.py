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
``targets`` empty for valid/test) so that collective ops (the sharded embedding lookups of evaluation) never
hang; the model must accept B=0. Training does not use these per-rank batches: :class:`ElasticTrainStream` plans
the train split step by step from one global order (see there).

The rank's split-eligible histories are held in memory as flat Arrow buffers (ML-1M: ~1M tokens,
~17 MB in all, less per rank); batches are collated straight from them with ``pyarrow.compute``
(``list_value_length`` / ``list_flatten``) and numpy index gathers: no per-row Python objects, no
padding. Per-row truncation to ``max_seq_len`` is a gather (``pc.list_slice`` only takes one start/stop
for the whole array).

GEM-style folders (``gemray prepare synthetic``; manifest ``features`` / ``ranking``, see
:mod:`gemray.pipelines.schema`) carry more columns, collated the same way: per-token side features ride with
item_ids through the same gather, request context is a per-row pick, and each row's candidates and labels are
a second jagged gather (flat buffers + the rows' candidate offsets), so BBS moves a request's candidates with
its row. A split's batches carry the candidates of the rows whose ``request_split`` is that split only (the
other rows get 0 candidates): no label is read in two splits. Folders without them give batches whose
optional fields are None, as before.

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
import pyarrow.parquet as pq
import torch

from gemray.config import DataConfig
from gemray.jagged import JaggedBatch, lengths_to_offsets

from .bbs import global_epoch_order, global_steps_left, plan_epoch, plan_global_step
from .movielens import load_manifest
from .schema import (CANDIDATE_CLICK, CANDIDATE_CONVERT, CANDIDATE_ITEMS, HISTORY_SCHEMA, ITEMS_FILE,
                     REQUEST_SPLIT, SPLITS, check_features, check_split, history_schema,
                     split_input_bounds)
from .shards import _by_user, _check_rank, _eligible, assign_shards, damaged_file_error, num_batches_for

log = logging.getLogger(__name__)

__all__ = ["ElasticTrainStream", "HistoryStream", "item_feature_tables"]


# Streams of the same rank (train / valid / test) share one read: (folder, manifest mtime, shards) -> table.
_READ_CACHE: dict[tuple, pa.Table] = {}
_READ_CACHE_SIZE = 4


def _read_rank_table(manifest: dict[str, Any], shards: list[dict[str, Any]], reader: str = "ray_data") -> pa.Table:
    """Read this rank's shards (cached per process); a table of ``history_schema(manifest)`` (HISTORY_SCHEMA plus
    the manifest's feature / ranking columns) by user_id.

    reader: "ray_data" (``ray.data.read_parquet`` tasks) or "arrow" (pyarrow in this process). Raises
    ValueError for another reader, a file without a declared column, or when the rows read differ from the
    manifest's count."""
    if reader not in ("ray_data", "arrow"):
        raise ValueError(f"reader: expected 'ray_data' or 'arrow', got {reader!r}")
    if not shards:
        return history_schema(manifest).empty_table()
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
    schema = history_schema(manifest)
    for path in paths[:1] if schema == HISTORY_SCHEMA else paths:  # a declared column must be in every file
        try:
            have = pq.read_schema(path)
        except (pa.ArrowException, OSError) as e:
            raise damaged_file_error(path, e) from e
        for f in schema:
            if have.get_field_index(f.name) < 0 or not have.field(f.name).type.equals(f.type):
                got = have.field(f.name).type if have.get_field_index(f.name) >= 0 else "no such column"
                raise ValueError(f"{path}: column {f.name!r} expected {f.type} (declared by manifest.json), got "
                                 f"{got}")
    user = pc.field("user_id")
    expr = None
    for s in shards:
        term = (user >= s["first_user_id"]) & (user <= s["last_user_id"])
        expr = term if expr is None else expr | term
    try:
        if reader == "arrow":
            import pyarrow.dataset as pads

            log.info("reading shards %s of %s with pyarrow", [s["index"] for s in shards], root)
            read = pads.dataset(paths, format="parquet").to_table(columns=schema.names, filter=expr)
            parts = [read] if read.num_rows else []
        else:
            parts = _read_with_ray_data(paths, expr, root, shards, schema.names)
    except Exception as e:  # pyarrow's / Ray Data's error names no file: find the one that cannot be read
        bad = _first_unreadable(paths, schema.names)
        if bad is None:
            raise
        raise damaged_file_error(*bad) from e
    table = pa.concat_tables(parts).select(schema.names).cast(schema) if parts else schema.empty_table()
    want = sum(s["rows"] for s in shards)
    if table.num_rows != want:
        raise ValueError(f"{root}: read {table.num_rows} rows for shards {[s['index'] for s in shards]}, "
                         f"manifest says {want}; the prepared folder changed since its manifest was written")
    return _by_user(table)


def _first_unreadable(paths: list[str], columns: list[str]) -> tuple[str, BaseException] | None:
    """The first of ``paths`` pyarrow cannot read whole (footer, then every row group of ``columns``), with its
    error; None when all read. Only on the error path of a read that failed without naming its file."""
    for path in paths:
        try:
            f = pq.ParquetFile(path)
            for g in range(f.num_row_groups):
                f.read_row_group(g, columns=columns)
        except (pa.ArrowException, OSError) as e:
            return path, e
    return None


def _read_with_ray_data(paths: list[str], expr: Any, root: Path, shards: list[dict[str, Any]],
                        columns: list[str] = HISTORY_SCHEMA.names) -> list[pa.Table]:
    import ray
    import ray.data

    if not ray.is_initialized():
        raise RuntimeError("HistoryStream reads with Ray Data: call ray.init(...) first "
                           "(inside Ray Train workers Ray is already initialised)")
    ray.data.DataContext.get_current().use_datasource_v2 = False
    log.info("reading shards %s of %s with Ray Data", [s["index"] for s in shards], root)
    # Small CPU ask per read task: inside Ray Train the workers hold most CPUs, and read tasks that wait
    # for a whole free CPU can stall the step (NOTES.md: 2 workers + a read on 2 CPUs hung).
    ds = ray.data.read_parquet(paths, columns=list(columns), filter=expr, num_cpus=0.25)
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
        train only. shuffle: seeded permutation by (seed, epoch, rank); train only. These shape this stream's
        own train plan (:meth:`plan`, :meth:`iter_epoch`), which training does not use: it reads the train split
        through :class:`ElasticTrainStream`, which plans each global step itself (no window).
    Valid and test are never shuffled nor BBS'd: batches follow ascending user_id.
    reader: "ray_data" (``ray.data.read_parquet`` tasks; needs Ray initialised) or "arrow" (pyarrow in
        this process; no Ray tasks): same table either way.

    Yields :class:`gemray.jagged.JaggedBatch` on CPU: user_ids [B], offsets [B+1], item_ids / ratings
    (half stars) / timestamps [T], all int64; targets and target_timestamps (the target's unix seconds)
    [B] int64 for valid/test. When the manifest declares them (GEM-style data): ``features`` {name: [T]
    int64} (level "token"), ``context`` {name: [B] int64} (level "request"), and with a ``ranking`` entry
    ``candidate_offsets`` [B+1] int64, ``candidate_ids`` [C] int64, ``labels`` [C, 2] float32 (click,
    convert) holding the candidates of the rows whose request is in this split (the other rows: none);
    otherwise these fields are None. Raises ValueError for bad arguments or for data that breaks the
    schema (a column of the wrong type or list lengths, feature values outside 0..cardinality, labels not
    0/1, a conversion without a click), FileNotFoundError when the folder is not prepared.
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
                return _flat_int64(table.column(col))

            self._data = {"user_ids": table.column("user_id").to_numpy().astype(np.int64),
                          "row_start": row_start, "start": start, "stop": stop,
                          "item_ids": flat("item_ids"), "ratings": flat("ratings"),
                          "timestamps": flat("timestamps"), **self._load_gem_columns(table, n)}
            if n.size != self.num_samples():
                raise ValueError(f"rank {self.rank}: {n.size} split users read, manifest says "
                                 f"{self.num_samples()}")
            log.debug("rank %d/%d %s: %d users, %d tokens", self.rank, self.world_size, self.split,
                      n.size, int((stop - start).sum()))
        return self._data

    def _load_gem_columns(self, table: pa.Table, n: np.ndarray) -> dict[str, Any]:
        """Flat numpy buffers of the manifest's feature and ranking columns, checked once here (vectorised) so
        that collation is only gathers: {"features": {name: [sum n] int64}, "context": {name: [S] int64},
        "cand": {"start" [S], "len" [S] (0 unless the row's request is in this split), "ids", "click",
        "convert"} or None}."""
        root = self.manifest["prepared_dir"]
        out: dict[str, Any] = {"features": {}, "context": {}, "cand": None}
        for name, spec in check_features(self.manifest.get("features")).items():
            col, card = table.column(spec["column"]), spec["cardinality"]
            if spec["level"] == "token":
                if not np.array_equal(_list_lengths(col), n):
                    raise ValueError(f"{root}: column {spec['column']!r} has lists of other lengths than item_ids "
                                     "(a token feature needs one value per history item)")
                values = _flat_int64(col)
            else:
                values = _int64(col, root, spec["column"])
            if values.size and (int(values.min()) < 0 or int(values.max()) > card):
                raise ValueError(f"{root}: column {spec['column']!r} holds values outside 0..{card} (the "
                                 f"cardinality manifest.json declares; 0 = missing): {int(values.min())}.."
                                 f"{int(values.max())}")
            out["features" if spec["level"] == "token" else "context"][name] = values
        if self.manifest.get("ranking") is None:
            return out
        clen = _list_lengths(table.column(CANDIDATE_ITEMS))
        for col in (CANDIDATE_CLICK, CANDIDATE_CONVERT):
            if not np.array_equal(_list_lengths(table.column(col)), clen):
                raise ValueError(f"{root}: column {col!r} has lists of other lengths than {CANDIDATE_ITEMS!r}")
        code = _int64(table.column(REQUEST_SPLIT), root, REQUEST_SPLIT)
        if code.size and (int(code.min()) < 0 or int(code.max()) >= len(SPLITS)):
            raise ValueError(f"{root}: column {REQUEST_SPLIT!r} holds values outside 0..{len(SPLITS) - 1} "
                             f"(0 train, 1 valid, 2 test)")
        ids = _flat_int64(table.column(CANDIDATE_ITEMS))
        num_items = int(self.manifest["counts"]["items"])
        if ids.size and (int(ids.min()) < 1 or int(ids.max()) > num_items):
            raise ValueError(f"{root}: column {CANDIDATE_ITEMS!r} holds item ids outside 1..{num_items}")
        click = pc.list_flatten(table.column(CANDIDATE_CLICK)).to_numpy()
        convert = pc.list_flatten(table.column(CANDIDATE_CONVERT)).to_numpy()
        if click.size and (int(click.min()) < 0 or int(click.max()) > 1 or int(convert.min()) < 0
                           or int(convert.max()) > 1):
            raise ValueError(f"{root}: {CANDIDATE_CLICK!r} / {CANDIDATE_CONVERT!r} hold values other than 0 and 1")
        if bool((convert > click).any()):
            raise ValueError(f"{root}: {CANDIDATE_CONVERT!r} is 1 where {CANDIDATE_CLICK!r} is 0 (a conversion "
                             "without a click)")
        start = np.zeros(clen.size, np.int64)
        np.cumsum(clen[:-1], out=start[1:])
        out["cand"] = {"start": start, "len": np.where(code == SPLITS.index(self.split), clen, 0),
                       "ids": ids, "click": click, "convert": convert}
        return out

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
        gem: dict[str, Any] = {}
        if d["features"]:
            gem["features"] = {k: torch.from_numpy(v[gather]) for k, v in d["features"].items()}
        if d["context"]:
            gem["context"] = {k: torch.from_numpy(v[idx]) for k, v in d["context"].items()}
        cand = d["cand"]
        if cand is not None:  # the rows' candidates: a second jagged gather, labels as one [C, 2] float32 block
            clen = cand["len"][idx]
            coff = lengths_to_offsets(torch.from_numpy(clen))
            ctotal = int(coff[-1])
            cg = np.repeat(cand["start"][idx] - coff[:-1].numpy(), clen) + np.arange(ctotal, dtype=np.int64)
            labels = np.empty((ctotal, 2), np.float32)
            labels[:, 0] = cand["click"][cg]
            labels[:, 1] = cand["convert"][cg]
            gem.update(candidate_offsets=coff, candidate_ids=torch.from_numpy(cand["ids"][cg]),
                       labels=torch.from_numpy(labels))
        return JaggedBatch(
            user_ids=torch.from_numpy(d["user_ids"][idx]), offsets=offsets,
            item_ids=torch.from_numpy(d["item_ids"][gather]), ratings=torch.from_numpy(d["ratings"][gather]),
            timestamps=torch.from_numpy(d["timestamps"][gather]), targets=targets,
            target_timestamps=target_ts, **gem)


def _list_lengths(col: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _flat_int64(col: pa.ChunkedArray) -> np.ndarray:
    """The values of a list<int64> column as one int64 array (no copy when it is one chunk)."""
    flat = pc.list_flatten(col)
    arr = flat.chunk(0) if flat.num_chunks == 1 else flat.combine_chunks()
    return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _int64(col: pa.ChunkedArray, root: str, name: str) -> np.ndarray:
    """A scalar integer column as int64; nulls raise ValueError naming the column."""
    if col.null_count:
        raise ValueError(f"{root}: column {name!r} has {col.null_count} nulls (use 0 for a missing feature value)")
    return col.to_numpy().astype(np.int64, copy=False)


def item_feature_tables(manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-item side features for lookups (candidates, sampled negatives): {name: [num_items + 1] int64}, row i the
    value of item i (row 0, the padding id, holds 0 = missing), for each manifest feature with ``"per_item": true``.

    Reads ``items.parquet`` (columns item_id and ``feat_<name>``). Returns {} when no feature is per item.
    Raises ValueError when items.parquet lacks a column or its item ids are not 1..num_items in order.
    """
    feats = {k: v for k, v in check_features(manifest.get("features")).items() if v.get("per_item")}
    if not feats:
        return {}
    path = Path(manifest["prepared_dir"]) / manifest.get("items_file", ITEMS_FILE)
    have = pq.read_schema(path).names
    missing = [v["column"] for v in feats.values() if v["column"] not in have]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)} (declared per item by manifest.json)")
    table = pq.read_table(path, columns=["item_id"] + [v["column"] for v in feats.values()])
    n = int(manifest["counts"]["items"])
    if not np.array_equal(table.column("item_id").to_numpy(), np.arange(1, n + 1)):
        raise ValueError(f"{path}: item_id is not 1..{n} in order")
    out = {}
    for name, spec in feats.items():
        arr = np.zeros(n + 1, np.int64)
        arr[1:] = table.column(spec["column"]).to_numpy()
        out[name] = arr
    return out


class ElasticTrainStream:
    """The train split as one global, world-size-independent plan: exactly-once data across restarts.

    Every rank holds all split-eligible train samples (read once through :class:`HistoryStream` with
    world_size 1, so all Parquet row groups; ML-1M: ~17 MB per rank). The epoch's order is
    :func:`gemray.pipelines.bbs.global_epoch_order` (seed, epoch); each step consumes the next
    ``world_size * batch_size`` samples of it and BBS deals them to the ranks
    (:func:`gemray.pipelines.bbs.plan_global_step`). The data position is therefore one integer per
    epoch, ``consumed`` (a prefix of the order); a checkpoint storing (epoch, consumed) resumes at any
    world size with every sample trained exactly once per epoch.

    Yields ``(batch, consumed_after)`` pairs: the rank's :class:`gemray.jagged.JaggedBatch` and the global
    prefix consumed once this step is done (same on every rank). B = ``batch_size`` on every step but the
    epoch's last when N is not a multiple of world_size * batch_size: that step's n samples are spread over all
    ranks (B about n / world_size each, sizes within ``sub_batch_size`` with BBS, within 1 without), and a
    rank's B is 0 only when n < world_size.
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

    def check_position(self, epoch: int, consumed: int) -> None:
        """Raises ValueError for epoch < 0 or ``consumed`` outside 0..N (reads the data, as iter_epoch does)."""
        if epoch < 0:
            raise ValueError(f"iter_epoch: epoch must be >= 0, got {epoch}")
        n = self.base._load()["user_ids"].size
        if not 0 <= consumed <= n:
            raise ValueError(f"iter_epoch: consumed={consumed} outside 0..{n}")

    def iter_epoch(self, epoch: int, consumed: int = 0, *,
                   part: tuple[int, int] = (0, 1)) -> Iterator[tuple[JaggedBatch, int]]:
        """Yield this rank's batch and the new global position for each remaining step of ``epoch``.

        part (w, n): plan every step but collate and yield only the steps i (0-based from ``consumed``) with
        i % n == w (loader worker w of n, :mod:`gemray.pipelines.loader`); default all of them."""
        self.check_position(epoch, consumed)
        w, n = part
        if not 0 <= w < n:
            raise ValueError(f"iter_epoch: part (w, n) needs 0 <= w < n, got {part}")
        d = self.base._load()
        lengths = d["stop"] - d["start"]
        order = global_epoch_order(lengths.size, seed=self.base.seed, epoch=epoch, shuffle=self.base.shuffle)
        i = 0
        while consumed < order.size:
            parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=self.world_size,
                                               batch_size=self.base.batch_size, bbs=self.base.bbs,
                                               sub_batch_size=self.base.sub_batch_size, seed=self.base.seed,
                                               epoch=epoch)
            if i % n == w:
                yield self.base._collate(parts[self.rank]), consumed
            i += 1
