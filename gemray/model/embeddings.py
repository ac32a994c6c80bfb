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


@torch.no_grad()
def init_embedding_tables(ec: EmbeddingCollection) -> None:
    """Draw the tables of an unsharded ``ec`` anew, exactly as ``EmbeddingCollection(...)`` on a real device
    does: table by table in config order, ``nn.Embedding``'s own reset (normal) and then the table's
    ``init_fn`` (uniform in +-weight_init bounds). Both draws, so that ``torch.manual_seed(s)`` before either
    gives equal tables and leaves the global RNG in the same state for what is initialised next.

    Tables whose weight is on the meta device are skipped: they wait for TorchRec's sharding, whose FBGEMM
    kernels initialise each shard from ``weight_init_min/max``. Raises ValueError for anything but a plain
    (unsharded) EmbeddingCollection.
    """
    if not isinstance(ec, EmbeddingCollection):
        raise ValueError(f"init_embedding_tables: expected an unsharded torchrec EmbeddingCollection, got "
                         f"{type(ec).__name__} (a sharded collection is initialised by TorchRec)")
    for config in ec.embedding_configs():
        table = ec.embeddings[config.name]
        if table.weight.is_meta:
            continue
        table.reset_parameters()
        config.init_fn(table.weight)
