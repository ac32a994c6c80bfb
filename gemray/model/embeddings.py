"""The sparse part of the model: one TorchRec EmbeddingCollection (``gemray.parallel.parallelize`` shards
it in place with DistributedModelParallel, which also materialises a meta-built one).

Tables (all ``cfg.embedding_dim`` wide: an EmbeddingCollection needs one width):
    "item"      num_items + 1 rows (row 0 = padding id, never looked up), features item_id, neg_item_id
    "rating"    11 rows (half stars 0..10), feature rating    (if cfg.use_rating_feature)
    "time_gap"  cfg.num_time_buckets rows, feature time_gap   (if cfg.use_time_feature)
Weights start uniform in +-0.02*sqrt(3) (std 0.02, as generative-recommenders' truncated normal 0.02), set
through ``weight_init_min/max`` so unsharded (``init_fn``) and sharded (FBGEMM kernels) builds agree.
"""

from __future__ import annotations

import math

import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE
from gemray.model.features import NEG_ITEM_FEATURE, NUM_RATINGS

INIT_STD = 0.02


def make_embedding_collection(cfg: ModelConfig, num_items: int,
                              device: torch.device | str = "cpu") -> EmbeddingCollection:
    """EmbeddingCollection for ``cfg`` on ``device`` ("cpu", "cuda" or "meta" for sharding later).

    Raises ValueError when num_items < 1.
    """
    if num_items < 1:
        raise ValueError(f"num_items: expected >= 1, got {num_items}")
    bound = INIT_STD * math.sqrt(3.0)
    kw = dict(embedding_dim=cfg.embedding_dim, weight_init_min=-bound, weight_init_max=bound)
    tables = [EmbeddingConfig(name="item", num_embeddings=num_items + 1,
                              feature_names=[ITEM_FEATURE, NEG_ITEM_FEATURE], **kw)]
    if cfg.use_rating_feature:
        tables.append(EmbeddingConfig(name="rating", num_embeddings=NUM_RATINGS,
                                      feature_names=[RATING_FEATURE], **kw))
    if cfg.use_time_feature:
        tables.append(EmbeddingConfig(name="time_gap", num_embeddings=cfg.num_time_buckets,
                                      feature_names=[TIME_FEATURE], **kw))
    return EmbeddingCollection(tables=tables, device=torch.device(device))


#: Scratch elements for skipping the construction draws of a table left on meta (4 MiB of float32).
SKIP_CHUNK = 1 << 20
#: Largest table (elements) whose construction draws are replayed on CUDA, one launch per draw as a real-device
#: build makes them (a 64 MiB float32 scratch buffer at most); larger tables are not replayed there.
CUDA_REPLAY_MAX = 1 << 24


def _chunk_sizes(n: int, chunk: int) -> list[int]:
    """Chunk sizes summing to n: full chunks, the remainder as a last chunk, or merged into the last full one
    when it is under 16. CPU ``normal_`` draws one word per element plus 16 more when the size is not a
    multiple of 16 (sizes >= 16), so these chunks (chunk a multiple of 16) draw what one call on n draws."""
    full, rem = divmod(n, chunk)
    if full == 0:
        return [n] if n else []
    sizes = [chunk] * full
    if rem >= 16:
        sizes.append(rem)
    elif rem:
        sizes[-1] += rem
    return sizes


@torch.no_grad()
def skip_table_draws(config: EmbeddingConfig, device: torch.device | str) -> None:
    """Advance ``device``'s global RNG by exactly the draws ``EmbeddingCollection(...)`` makes for the table of
    ``config`` on that device (``nn.Embedding``'s normal reset, then ``config.init_fn``), without allocating
    the table: the same kernels on a scratch buffer of at most ``SKIP_CHUNK`` (+15) elements. Costs the
    table's draws in time (rows x dim twice), not in memory.

    Exact on CPU for ``make_embedding_collection``'s tables (float32, uniform ``init_fn``: one draw per
    element; the normal kernel's per-call rule is kept by ``_chunk_sizes``), which tests/test_model.py
    checks against a real construction. On CUDA the Philox offset advances per kernel launch by an amount
    that depends on the launch's size, so the draws are replayed as one launch each on a scratch buffer of the
    table's size -- exact, and what :func:`init_embedding_tables` does only up to :data:`CUDA_REPLAY_MAX`
    elements (the GPU test in tests/test_model.py checks it against a real construction).
    """
    dtype = torch.float32 if config.data_type == DataType.FP32 else torch.float16
    n_all = int(config.num_embeddings) * int(config.embedding_dim)
    sizes = [n_all] if torch.device(device).type == "cuda" and n_all else _chunk_sizes(n_all, SKIP_CHUNK)
    if not sizes:
        return
    buf = torch.empty(max(sizes), dtype=dtype, device=device)
    for n in sizes:
        buf[:n].normal_()
    for n in sizes:
        config.init_fn(buf[:n])


def _replayed(config: EmbeddingConfig, device: torch.device) -> bool:
    """Pure: whether :func:`init_embedding_tables` replays a meta table's draws on ``device`` (CPU always, CUDA up
    to :data:`CUDA_REPLAY_MAX` elements, nothing elsewhere)."""
    n = int(config.num_embeddings) * int(config.embedding_dim)
    return device.type == "cpu" or (device.type == "cuda" and n <= CUDA_REPLAY_MAX)


@torch.no_grad()
def init_embedding_tables(ec: EmbeddingCollection, device: torch.device | str | None = None) -> None:
    """Draw the tables of an unsharded ``ec`` anew, exactly as ``EmbeddingCollection(...)`` on a real device
    does: table by table in config order, ``nn.Embedding``'s own reset (normal) and then the table's
    ``init_fn`` (uniform in +-weight_init bounds). Both draws, so that ``torch.manual_seed(s)`` before either
    gives equal tables and leaves the global RNG in the same state for what is initialised next.

    A table whose weight is still on the meta device waits for TorchRec's sharding (whose FBGEMM kernels
    initialise each shard from ``weight_init_min/max``): it is not allocated, but with ``device`` (the device
    the rest of the model is initialised on; None or "meta" = nothing to skip) its draws are skipped on that
    device's RNG (:func:`skip_table_draws`), so what is initialised next gets the values it gets in a
    real-device build, wherever the tables end up. Raises ValueError for anything but a plain (unsharded)
    EmbeddingCollection.
    """
    if not isinstance(ec, EmbeddingCollection):
        raise ValueError(f"init_embedding_tables: expected an unsharded torchrec EmbeddingCollection, got "
                         f"{type(ec).__name__} (a sharded collection is initialised by TorchRec)")
    # Replayed on CPU (the test machine's baselines) and on CUDA for tables of up to CUDA_REPLAY_MAX elements:
    # one launch per draw there, which leaves Philox's offset where a real-device build does. Until 2026-12-04
    # CUDA replayed nothing, so a GPU run's dense weights (drawn after the tables) were another sample than a
    # direct GPU build's: ML-1M's curve on the H200 moved from 4.7911 to 4.8127 at epoch 1 (test HR@10 .3724
    # on 2026-11-30, .3659 / .3639 after). GEM-scale tables are not replayed on CUDA (rows x dim draws per
    # start for nothing but the sample): deterministic, the same on every rank.
    skip_on = None if device is None else torch.device(device)
    for config in ec.embedding_configs():
        table = ec.embeddings[config.name]
        if table.weight.is_meta:
            if skip_on is not None and _replayed(config, skip_on):
                skip_table_draws(config, skip_on)
            continue
        table.reset_parameters()
        config.init_fn(table.weight)
