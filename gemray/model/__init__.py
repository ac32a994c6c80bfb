"""The GEM-like model as plain nn.Modules (no Ray, no torch.distributed).

    GEM(cfg.model, num_items, device, max_seq_len=...)   gemray.model.gem (GEM.init_weights)
    HSTUEncoder / HSTUBlock / RelativeBucketedBias       gemray.model.hstu
    RetrievalHead                                        gemray.model.heads
    make_embedding_collection, init_embedding_tables,    gemray.model.embeddings
    skip_table_draws
    sparse_features -> KeyedJaggedTensor                 gemray.model.features
"""

from gemray.model.embeddings import init_embedding_tables, make_embedding_collection, skip_table_draws
from gemray.model.features import NEG_ITEM_FEATURE, feature_names, sparse_features
from gemray.model.gem import GEM
from gemray.model.heads import RetrievalHead
from gemray.model.hstu import HSTUBlock, HSTUEncoder, RelativeBucketedBias

__all__ = ["GEM", "HSTUBlock", "HSTUEncoder", "RelativeBucketedBias", "RetrievalHead",
           "init_embedding_tables", "make_embedding_collection", "skip_table_draws", "sparse_features",
           "feature_names", "NEG_ITEM_FEATURE"]
