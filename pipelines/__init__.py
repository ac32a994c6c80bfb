"""gemray.pipelines: MovieLens -> Parquet histories -> Ray Data jagged batches with base batch shuffling.

    prepare_movielens(src, out, *, on_bad_rows="error", num_files=8) -> manifest dict
    load_manifest(prepared_dir) -> manifest dict
    HistoryStream(prepared_dir, split, *, rank, world_size, batch_size, max_seq_len, ...)  (Ray Data)
    loader.TrainLoader(stream, *, workers, prefetch, pin_memory)  (train batches from DataLoader worker processes)
    assign_shards(manifest, world_size, rank) -> list of shard dicts
    form_batches / imbalance / simulate_imbalance                                          (BBS, numpy)

Layout, units and the leave-one-out split: :mod:`gemray.pipelines.schema`. ``stream`` (torch, Ray) is
imported lazily so that preparing data needs only pyarrow and numpy.
"""

from .bbs import form_batches, imbalance, plan_epoch, simulate_imbalance
from .movielens import FORMATS, format_summary, load_manifest, prepare_movielens
from .schema import HISTORY_SCHEMA, ITEMS_SCHEMA, SPLITS, BadRowError
from .shards import assign_shards, num_batches_for

__all__ = ["prepare_movielens", "load_manifest", "format_summary", "FORMATS", "BadRowError",
           "HISTORY_SCHEMA", "ITEMS_SCHEMA", "SPLITS", "form_batches", "imbalance", "plan_epoch",
           "simulate_imbalance", "HistoryStream", "assign_shards"]

_LAZY = {"HistoryStream"}


def __getattr__(name):
    if name in _LAZY:
        from . import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'gemray.pipelines' has no attribute {name!r}")
