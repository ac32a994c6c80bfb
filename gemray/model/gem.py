"""GEM-like generative retrieval model: TorchRec embeddings -> jagged HSTU encoder -> sampled softmax.

Shape key: B sequences, T tokens, D = embedding_dim, N = num_items (ids 1..N), R = num_negatives.

All sparse lookups go through ``self.embeddings`` (a ``torchrec.EmbeddingCollection``), which
DistributedModelParallel shards in place (``gemray.parallel.parallelize``); everything else is dense.

Every part is built on the ``device`` given, embeddings included. On a real device the constructors
initialise it; a model built on ``"meta"`` (no memory, no RNG draws) is materialised later: the dense part
with ``to_empty(device=...)`` + :meth:`GEM.init_weights`, the embedding tables by TorchRec's sharding.

Example::

    torch.manual_seed(cfg.train.seed)
    model = GEM(cfg.model, num_items=3706, device="cpu", max_seq_len=cfg.data.max_seq_len)
    model.seed_sampling(cfg.train.seed)
    loss, stats = model(train_batch)            # every position predicts the next item
    users = model.user_embeddings(eval_batch)   # [B, D], unit norm
    items = model.item_embeddings(torch.arange(1, 3707))  # [N, D], unit norm
    scores = users @ items.T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE, JaggedBatch, query_timestamps
from gemray.model.embeddings import init_embedding_tables, make_embedding_collection
from gemray.model.features import NEG_ITEM_FEATURE, item_id_features, sparse_features
from gemray.model.heads import RetrievalHead, sample_uniform, sample_uniform_per_position
from gemray.model.hstu import HSTUEncoder


class GEM(nn.Module):
    """The model. ``embeddings``: EmbeddingCollection; ``encoder``: HSTUEncoder; ``head``: RetrievalHead.

    Args:
        cfg: ModelConfig (validated here).
        num_items: N; the item table has N+1 rows (row 0 = padding id, never looked up).
        device: where every parameter is built ("cpu", "cuda", or "meta": nothing allocated or drawn, to be
            sharded / materialised later, see :meth:`init_weights`).
        max_seq_len: longest history the encoder accepts (positional table size and the HSTU 1/N
            normaliser); pass ``cfg.data.max_seq_len``.
    """

    def __init__(self, cfg: ModelConfig, num_items: int, device: torch.device | str = "cpu", *,
                 max_seq_len: int = 200):
        super().__init__()
        cfg.validate()
        if num_items < 1:
            raise ValueError(f"num_items: expected >= 1, got {num_items}")
        self.cfg = cfg
        self.num_items = num_items
        self.max_seq_len = max_seq_len
        self.embeddings = make_embedding_collection(cfg, num_items, device)
        self.encoder = HSTUEncoder(cfg, max_seq_len, device=device)
        self.head = RetrievalHead(cfg.negatives, cfg.num_negatives, cfg.temperature)
        self._generator = torch.Generator()

    def init_weights(self) -> None:
        """Draw every local parameter anew, in construction order and with the same global-RNG draws as
        construction on a real device: the embedding tables (``init_embedding_tables``), then the encoder
        (``HSTUEncoder.init_weights``); the head has none. Tables still on meta (before TorchRec shards them)
        are not allocated, but their draws are skipped on the encoder's device, so the dense part gets the
        values of a real-device build whether or not the tables are materialised here.

        So ``torch.manual_seed(s); GEM(..., device="cpu")`` equals ``GEM(..., device="meta")`` followed by
        ``to_empty(device="cpu")`` (or ``gemray.parallel.materialize_dense``: the dense part only),
        ``torch.manual_seed(s)`` and ``init_weights()``, parameter for parameter, leaving the RNG in the
        same state. Call after ``to_empty`` (on meta parameters the draws are no-ops). Raises ValueError when
        ``self.embeddings`` is already sharded (TorchRec owns those tables: re-initialise before sharding).
        """
        init_embedding_tables(self.embeddings, device=self.encoder.pos_emb.device)
        self.encoder.init_weights()

    def seed_sampling(self, seed: int) -> None:
        """Seed the CPU generator used for negative sampling when ``forward`` gets no generator."""
        self._generator.manual_seed(int(seed))

    def _encode(self, batch: JaggedBatch, neg_ids: torch.Tensor | None, neg_rows: torch.Tensor | None = None):
        kjt = sparse_features(batch, neg_ids=neg_ids, cfg=self.cfg, neg_rows=neg_rows)
        emb = self.embeddings(kjt)
        item_emb = emb[ITEM_FEATURE].values()                       # [T, D]
        tok = item_emb
        if self.cfg.use_rating_feature:
            tok = tok + emb[RATING_FEATURE].values()
        if self.cfg.use_time_feature:
            tok = tok + emb[TIME_FEATURE].values()
        tq = None
        if self.cfg.time_bias_query == "next":   # HSTU: bias by the time of the item being predicted
            tq = query_timestamps(batch.timestamps, batch.offsets, batch.target_timestamps)
        states = self.encoder(tok, batch.offsets, batch.timestamps, tq)  # [T, D], unit norm
        return states, item_emb, emb[NEG_ITEM_FEATURE].values()

    def forward(self, batch: JaggedBatch, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training step: (loss scalar, stats {"num_targets", "pos_logit"}).

        Every position with a next item in its sequence predicts that item (``batch.targets`` is not
        used). An empty batch (B=0) or one without any next item gives loss 0 connected to all parameters.
        Negatives are drawn from ``generator`` (default: the model's, see ``seed_sampling``): "uniform"
        draws R ids per position with a next item (M*R lookups of the "neg_item_id" feature),
        "uniform_shared" R ids per sequence (B*R lookups), "in_batch" reuses the batch's targets.
        """
        g = generator if generator is not None else self._generator
        neg_ids = neg_rows = None
        if batch.batch_size > 0:
            if self.cfg.negatives == "uniform":
                neg_ids, neg_rows = sample_uniform_per_position(batch.offsets, self.cfg.num_negatives,
                                                                self.num_items, g)
            elif self.cfg.negatives == "uniform_shared":
                neg_ids = sample_uniform(batch.batch_size, self.cfg.num_negatives, self.num_items, g,
                                         batch.offsets.device)
        states, item_emb, neg_emb = self._encode(batch, neg_ids, neg_rows)
        return self.head(states, batch.offsets, batch.item_ids, item_emb,
                         neg_ids=neg_ids, neg_emb=neg_emb if neg_ids is not None else None, generator=g)

    def user_embeddings(self, batch: JaggedBatch) -> torch.Tensor:
        """[B, D] unit-norm state at each sequence's last position (zeros for an empty sequence).

        Call under ``model.eval()`` and ``torch.no_grad()`` for evaluation; ``batch.targets`` is ignored.
        """
        states, _, _ = self._encode(batch, None)
        lengths = batch.lengths
        out = states.new_zeros((batch.batch_size, states.shape[1]))
        has = lengths > 0
        out[has] = states[batch.offsets[1:][has] - 1]
        return out

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> [N, D] unit-norm item embeddings, looked up through ``self.embeddings``.

        Sharded use: every rank must call this with the same ids (the lookup is collective).
        """
        emb = self.embeddings(item_id_features(ids, self.cfg))[ITEM_FEATURE].values()
        return F.normalize(emb, dim=-1, eps=1e-6)
