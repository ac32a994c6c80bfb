"""Which logical shards of a prepared folder each rank reads, and their history lengths. pyarrow + numpy, no Ray.

Shape key: S samples on a rank, R ranks (world_size).

The logical shards are the Parquet row groups listed in the manifest (``manifest["shards"]``, each a contiguous
user-id range of one file, written by :func:`gemray.pipelines.movielens.prepare_movielens`). Both the stream
(:mod:`gemray.pipelines.stream`, which reads them with Ray Data) and the BBS simulation
(:func:`gemray.pipelines.bbs.simulate_imbalance`, which reads only their lengths) deal them with
:func:`assign_shards`, so the simulation replays exactly what training reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .schema import MIN_HISTORY_FOR_SPLITS

__all__ = ["assign_shards", "num_batches_for", "read_shard_lengths"]


def _check_rank(world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank/world_size: expected 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")


def assign_shards(manifest: dict[str, Any], world_size: int, rank: int) -> list[dict[str, Any]]:
    """The logical shards (Parquet row groups) that ``rank`` of ``world_size`` reads: round-robin.

    manifest: as returned by :func:`gemray.pipelines.movielens.load_manifest`; its ``"shards"`` entries
        carry index, file, row_group, rows, tokens, first_user_id, last_user_id, split_users.
    Returns the shard dicts with ``index % world_size == rank``, in index order (possibly empty when
    there are more ranks than shards). Pure: the same inputs give the same answer on every rank.
    Raises ValueError for a bad rank/world_size.
    """
    _check_rank(world_size, rank)
    return [s for s in manifest["shards"] if s["index"] % world_size == rank]


def num_batches_for(manifest: dict[str, Any], world_size: int, batch_size: int) -> int:
    """Steps per epoch for every rank: ceil(max over ranks of its split-eligible users / batch_size)."""
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    most = max(sum(s["split_users"] for s in assign_shards(manifest, world_size, r)) for r in range(world_size))
    return -(-most // batch_size)


def _eligible(table: pa.Table) -> pa.Table:
    """Sort by user_id and keep users with >= 3 interactions (the split-eligible ones)."""
    table = _by_user(table)
    keep = pc.greater_equal(pc.list_value_length(table.column("item_ids")), MIN_HISTORY_FOR_SPLITS)
    return table if pc.all(keep).as_py() is not False else table.filter(keep)


def _by_user(table: pa.Table) -> pa.Table:
    """``table.sort_by("user_id")``, skipped when the rows already are (as prepared files are written): sorting
    copies every column, 13 s of a 44 s load for 18M tokens of long GEM histories."""
    u = table.column("user_id")
    if table.num_rows < 2 or pc.all(pc.greater(u[1:], u[:-1])).as_py():
        return table
    return table.sort_by("user_id")


def damaged_file_error(path: str | Path, err: BaseException, row_group: int | None = None) -> ValueError:
    """The ValueError for a prepared Parquet file pyarrow cannot read (truncated, corrupt): names the file
    (and row group), pyarrow's message, and the fix."""
    where = f" (row group {row_group})" if row_group is not None else ""
    return ValueError(f"{path}{where}: cannot read this Parquet file ({type(err).__name__}: {err}); it is "
                      "truncated or damaged: prepare the data again (gemray prepare ...)")


def read_shard_lengths(manifest: dict[str, Any], shards: list[dict[str, Any]]) -> np.ndarray:
    """[S] int64 full history lengths of the split-eligible users in ``shards``, ascending user_id.

    Reads only the ``user_id`` and ``item_ids`` columns of the listed row groups with pyarrow (no Ray):
    what :func:`gemray.pipelines.bbs.simulate_imbalance` needs to replay a rank's plan.
    """
    root = Path(manifest["prepared_dir"])
    parts = []
    for s in shards:
        path = root / s["file"]
        try:
            parts.append(pq.ParquetFile(path).read_row_group(s["row_group"], columns=["user_id", "item_ids"]))
        except (pa.ArrowException, OSError) as e:
            raise damaged_file_error(path, e, row_group=s["row_group"]) from e
    if not parts:
        return np.empty(0, np.int64)
    table = _eligible(pa.concat_tables(parts))
    return pc.list_value_length(table.column("item_ids")).to_numpy().astype(np.int64)
