"""GEM: TorchRec embeddings -> input layer -> jagged HSTU encoder -> retrieval head and / or ranking tower.

Shape key: B requests (sequences), T history tokens, C candidates, E = embedding_dim (every table), d =
``cfg.width`` (the residual / tower width: model_dim, or E), N = num_items (ids 1..N), R = num_negatives,
K = ranking tasks.

One model, configured by ``cfg.tasks`` (the ML-1M retrieval model is its default configuration)::

    emb     = EmbeddingCollection(kjt)                       every sparse lookup (gemray.model.inputs tables)
    tokens  = InputLayer.token_embeddings(emb)               [T, d]  item (+ rating + time_gap + side features)
    states  = HSTUEncoder(tokens, offsets, timestamps)       [T, d]  unit norm
    "retrieval": RetrievalHead(retrieval_states, ...)        sampled softmax over the item table; the states are
                 projected to E (``retrieval_proj``, Linear(d, E), then unit norm) when d != E
    "ctr"/"cvr": CandidateTower(states, candidates, ctx)     [C, K] logits -> MultiTaskHead (BCE per task)
    loss    = sum_t w_t * loss_t                             (``cfg.task_weights``; the head's own sum for ranking)

All sparse lookups go through ``self.embeddings`` (one ``torchrec.EmbeddingCollection``, tables from
``gemray.model.inputs.embedding_configs``), which DistributedModelParallel shards in place
(``gemray.parallel.parallelize``); everything else is dense. Every KeyedJaggedTensor the model builds carries
every key of the collection (lengths 0 where unused), as a sharded collection needs.

Candidate side features (``cfg.candidate_features``) are the item-level values of each candidate, looked up in
``item_features`` ({name: [N+1] int64}, e.g. ``gemray.pipelines.stream.item_feature_tables``): plain tensors
held by the model (not parameters, not in the state dict), copied once to each device they are used on.

Every part is built on the ``device`` given, embeddings included. On a real device the constructors
initialise it; a model built on ``"meta"`` (no memory, no RNG draws) is materialised later: the dense part
with ``to_empty(device=...)`` + :meth:`GEM.init_weights`, the embedding tables by TorchRec's sharding.

Example::

    torch.manual_seed(cfg.train.seed)
    model = GEM(cfg.model, num_items=3706, device="cpu", max_seq_len=cfg.data.max_seq_len)
    model.seed_sampling(cfg.train.seed)
    loss, stats = model(train_batch)            # every position predicts the next item (+ BCE per candidate)
    users = model.user_embeddings(eval_batch)   # [B, E], unit norm
    items = model.item_embeddings(torch.arange(1, 3707))  # [N, E], unit norm
    scores = users @ items.T
    logits = model.ranking_logits(eval_batch)   # [C, K] (with "ctr" / "cvr" tasks)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, JaggedBatch, query_timestamps
from gemray.model.embeddings import build_embedding_collection, init_embedding_tables
from gemray.model.features import NEG_ITEM_FEATURE, feature_names, sparse_features
from gemray.model.heads import RetrievalHead, retrieval_states, sample_uniform, sample_uniform_per_position
from gemray.model.hstu import HSTUEncoder
from gemray.model.inputs import (InputLayer, embedding_configs, extra_feature_names,
                                 extra_sparse_features)
from gemray.model.ranking import CandidateTower, MultiTaskHead


def _float_rows(jt: JaggedTensor) -> JaggedTensor:
    """``jt`` with float32 values: an unsharded EmbeddingCollection returns its tables' dtype (float16 under
    ``model.table_dtype = "fp16"``), TorchRec's sharded one float32 (FBGEMM's TBE ``output_dtype``); the dense
    model takes float32 either way. ``jt`` itself when already float32."""
    v = jt.values()
    if v.dtype == torch.float32:
        return jt
    return JaggedTensor(values=v.float(), lengths=jt.lengths(), offsets=jt.offsets())


@dataclass
class SparseInputs:
    """What one training forward looks up, prepared before it (``GEM.sparse_inputs``): ``kjt`` (the batch's
    KeyedJaggedTensor over every key of the collection), the sampled negatives ``neg_ids`` / ``neg_rows``
    (None without retrieval, or "in_batch"), and ``generator``: the sampling generator after the draws (the
    retrieval head draws on from it)."""

    kjt: KeyedJaggedTensor
    neg_ids: torch.Tensor | None
    neg_rows: torch.Tensor | None
    generator: torch.Generator


class GEM(nn.Module):
    """The model (module docstring). ``embeddings``: EmbeddingCollection; ``inputs``: InputLayer; ``encoder``:
    HSTUEncoder; ``retrieval_proj``: Linear(d, E) or None (only with retrieval and d != E); ``head``:
    RetrievalHead or None (no "retrieval" task); ``tower`` / ``ranking_head``: CandidateTower / MultiTaskHead or
    None (no ranking task).

    Args:
        cfg: ModelConfig (validated here).
        num_items: N; the item table has N+1 rows (row 0 = padding id, never looked up) unless
            ``cfg.table_rows`` sizes it larger.
        device: where every parameter is built ("cpu", "cuda", or "meta": nothing allocated or drawn, to be
            sharded / materialised later, see :meth:`init_weights`).
        max_seq_len: longest history the encoder accepts (positional table size and the HSTU 1/N
            normaliser); pass ``cfg.data.max_seq_len``.
        cardinalities: {feature: C} of the token / context features (a prepared folder's manifest
            ``features``), for the tables ``cfg.table_rows`` does not size.
        num_users: U, for the "user" table when "user_id" is a context feature (unless ``table_rows`` sizes it).
        item_features: {name: [N+1] int64} item-level values of each ``cfg.candidate_features`` entry (row 0 =
            padding); required when that list is not empty.
    Raises ValueError for num_items < 1, a table without a size, or missing / mis-shaped item features.
    """

    def __init__(self, cfg: ModelConfig, num_items: int, device: torch.device | str = "cpu", *,
                 max_seq_len: int = 200, cardinalities: Mapping[str, int] | None = None,
                 num_users: int | None = None, item_features: Mapping[str, torch.Tensor] | None = None):
        super().__init__()
        cfg.validate()
        if num_items < 1:
            raise ValueError(f"num_items: expected >= 1, got {num_items}")
        self.cfg = cfg
        self.num_items = num_items
        self.max_seq_len = max_seq_len
        self.tasks = list(cfg.tasks)
        ranking = cfg.ranking_tasks
        self._item_features: dict[str, torch.Tensor] = {}
        for f in cfg.candidate_features:
            t = None if item_features is None else item_features.get(f)
            if t is None:
                raise ValueError(f"GEM: model.candidate_features has {f!r} but item_features has no [N+1] table "
                                 f"for it (have {sorted(item_features or {})})")
            t = torch.as_tensor(t).to("cpu", torch.int64).reshape(-1)
            if t.numel() < num_items + 1:
                raise ValueError(f"GEM: item_features[{f!r}] has {t.numel()} rows, expected num_items + 1 = "
                                 f"{num_items + 1}")
            self._item_features[f] = t
        self._item_features_on: dict[tuple[str, str], torch.Tensor] = {}
        configs = embedding_configs(cfg, num_items, cardinalities=cardinalities, num_users=num_users)
        self.embeddings = build_embedding_collection(configs, device)
        self._keys = feature_names(cfg) + extra_feature_names(cfg)
        self.inputs = InputLayer(cfg, device=device)
        self.encoder = HSTUEncoder(cfg, max_seq_len, device=device)
        E, d = cfg.embedding_dim, cfg.width
        self.retrieval_proj = nn.Linear(d, E, device=device) if "retrieval" in self.tasks and d != E else None
        self.head = (RetrievalHead(cfg.negatives, cfg.num_negatives, cfg.temperature,
                                   kernel=cfg.retrieval_kernel)
                     if "retrieval" in self.tasks else None)
        self.tower = CandidateTower(cfg, max_seq_len, device=device) if ranking else None
        self.ranking_head = MultiTaskHead.from_config(cfg) if ranking else None
        self.retrieval_weight = cfg.task_weight("retrieval") if "retrieval" in self.tasks else 0.0
        self._generator = torch.Generator()

    def init_weights(self) -> None:
        """Draw every local parameter anew, in construction order and with the same global-RNG draws as
        construction on a real device: the embedding tables (``init_embedding_tables``), the input layer's
        projections, the encoder (``HSTUEncoder.init_weights``), ``retrieval_proj``, the candidate tower; the
        heads have none. Tables still on meta (before TorchRec shards them) are not allocated, but their draws
        are skipped on the encoder's device, so the dense part gets the values of a real-device build whether
        or not the tables are materialised here.

        So ``torch.manual_seed(s); GEM(..., device="cpu")`` equals ``GEM(..., device="meta")`` followed by
        ``to_empty(device="cpu")`` (or ``gemray.parallel.materialize_dense``: the dense part only),
        ``torch.manual_seed(s)`` and ``init_weights()``, parameter for parameter, leaving the RNG in the
        same state. Call after ``to_empty`` (on meta parameters the draws are no-ops). Raises ValueError when
        ``self.embeddings`` is already sharded (TorchRec owns those tables: re-initialise before sharding).
        """
        init_embedding_tables(self.embeddings, device=self.encoder.pos_emb.device)
        self.inputs.init_weights()
        self.encoder.init_weights()
        if self.retrieval_proj is not None:
            self.retrieval_proj.reset_parameters()
        if self.tower is not None:
            self.tower.init_weights()

    def seed_sampling(self, seed: int) -> None:
        """Seed the CPU generator used for negative sampling when ``forward`` gets no generator."""
        self._generator.manual_seed(int(seed))

    # -- sparse features ---------------------------------------------------------------------------------
    def _candidate_features(self, batch: JaggedBatch) -> dict[str, torch.Tensor]:
        """{f: [C] int64} item-level values of each candidate, from the device copy of ``item_features``."""
        if not self._item_features or batch.batch_size == 0:
            return {}
        ids = batch.candidate_ids
        if ids is None:
            return {}
        out = {}
        for f, table in self._item_features.items():
            key = (f, str(ids.device))
            t = self._item_features_on.get(key)
            if t is None:
                t = self._item_features_on[key] = table.to(ids.device)
            out[f] = t[ids.to(torch.int64)]
        return out

    def _kjt(self, batch: JaggedBatch, neg_ids: torch.Tensor | None, neg_rows: torch.Tensor | None
             ) -> KeyedJaggedTensor:
        """The batch's KJT over every key of the collection (``sparse_features`` + ``extra_sparse_features``)."""
        kjt = sparse_features(batch, neg_ids=neg_ids, cfg=self.cfg, neg_rows=neg_rows)
        extra = extra_sparse_features(batch, self.cfg, self._candidate_features(batch))
        if not extra:
            return kjt
        return KeyedJaggedTensor(keys=kjt.keys() + [k for k, _, _ in extra],
                                 values=torch.cat([kjt.values()] + [v for _, v, _ in extra]),
                                 lengths=torch.cat([kjt.lengths()] + [n for _, _, n in extra]).to(torch.int64),
                                 stride=kjt.stride(),
                                 # host ints from the values' shapes: TorchRec need not read the lengths back
                                 length_per_key=kjt.length_per_key() + [v.numel() for _, v, _ in extra])

    # -- forward -----------------------------------------------------------------------------------------
    def sparse_inputs(self, batch: JaggedBatch, generator: torch.Generator | None = None) -> SparseInputs:
        """The negatives (drawn from ``generator``, default: the model's, see ``seed_sampling``) and the KJT of
        one training batch: the first part of :meth:`forward`, separable so that a train pipeline can build
        batch i+1's KJT and start its sparse input distribution while batch i computes
        (``gemray.train.pipeline``). "uniform" draws R ids per position with a next item, "uniform_shared" R
        per sequence, "in_batch" none."""
        g = generator if generator is not None else self._generator
        hs = batch.host_shape()  # host ints of the layout (moved batches carry them): no host syncs below
        neg_ids = neg_rows = None
        if self.head is not None and batch.batch_size > 0:
            if self.cfg.negatives == "uniform":
                neg_ids, neg_rows = sample_uniform_per_position(batch.offsets, self.cfg.num_negatives,
                                                                self.num_items, g,
                                                                num_next=None if hs is None else hs.num_next)
            elif self.cfg.negatives == "uniform_shared":
                neg_ids = sample_uniform(batch.batch_size, self.cfg.num_negatives, self.num_items, g,
                                         batch.offsets.device)
        return SparseInputs(self._kjt(batch, neg_ids, neg_rows), neg_ids, neg_rows, g)

    def _encode(self, batch: JaggedBatch, neg_ids: torch.Tensor | None, neg_rows: torch.Tensor | None = None,
                kjt: KeyedJaggedTensor | None = None):
        """-> (states [T, d] unit norm, emb {key: JaggedTensor}) of one batch (``kjt``: the batch's, prepared; the
        longest sequence from ``batch.host_shape()`` when it has one: no host sync)."""
        if kjt is None:
            kjt = self._kjt(batch, neg_ids, neg_rows)
        out = self.embeddings(kjt)  # sharded: a LazyAwaitable of the dict
        emb = {k: _float_rows(out[k]) for k in self._keys}
        tok = self.inputs.token_embeddings(emb)                     # [T, d]
        tq = None
        if self.cfg.time_bias_query == "next":   # HSTU: bias by the time of the item being predicted
            tq = query_timestamps(batch.timestamps, batch.offsets, batch.target_timestamps)
        hs = batch.host_shape()
        states = self.encoder(tok, batch.offsets, batch.timestamps, tq,
                              max_len=None if hs is None else hs.max_len)  # [T, d], unit norm
        return states, emb

    def _retrieval_states(self, states: torch.Tensor) -> torch.Tensor:
        """[T, d] encoder states -> [T, E] unit-norm states the item table is scored against
        (``heads.retrieval_states``; the training forward has the head apply it, see :meth:`forward`)."""
        return retrieval_states(states, self.retrieval_proj)

    def _logits(self, batch: JaggedBatch, states: torch.Tensor, emb: Mapping
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """([C, K] ranking logits of the batch's candidates, the tower's mixture-of-experts aux dict: {}
        without experts). Raises ValueError without candidates."""
        if batch.candidate_offsets is None:
            raise ValueError("GEM: model.tasks has ranking tasks but the batch has no candidates (prepare the data "
                             "with `gemray prepare synthetic` or give candidate_offsets / candidate_ids / labels)")
        cands = self.inputs.candidate_embeddings(emb)               # [C, d]
        ctx = self.inputs.context_embeddings(emb)                   # [B, d] or None
        hs = batch.host_shape()
        return self.tower(states, batch.offsets, cands, batch.candidate_offsets, ctx,
                          max_candidates=None if hs is None else hs.max_candidates, return_aux=True)

    def forward(self, batch: JaggedBatch, generator: torch.Generator | None = None,
                sparse: SparseInputs | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training step: (loss scalar, stats).

        Retrieval: every position with a next item in its sequence predicts that item (``batch.targets`` is
        not used). Negatives are drawn from ``generator`` (default: the model's, see ``seed_sampling``):
        "uniform" draws R ids per position with a next item (M*R lookups of the "neg_item_id" feature),
        "uniform_shared" R ids per sequence (B*R lookups), "in_batch" reuses the batch's targets.
        Ranking: BCE of each task on the batch's candidates (``MultiTaskHead``). ``sparse``: this batch's
        :meth:`sparse_inputs`, prepared by the caller (then ``generator`` is not used).
        Loss = w_retrieval * retrieval loss + the ranking head's weighted BCE sum (+ ``moe_aux_weight`` x the
        experts' load-balancing loss with ``moe_experts``); an empty batch (B=0) or one without any target
        gives 0 connected to every parameter.

        stats: "num_targets" (retrieval: M positions with a next item; ranking only: C candidates), and per task
        "loss_<task>" (the task's unweighted mean loss) with "count_<task>" (its population); retrieval adds
        "pos_logit", ranking "num_candidates", experts "moe_aux_loss" / "moe_dropped" (share of assignments
        over capacity). All detached.
        """
        hs = batch.host_shape()  # host ints of the layout (moved batches carry them): no host syncs below
        if sparse is None:
            sparse = self.sparse_inputs(batch, generator)
        g, neg_ids = sparse.generator, sparse.neg_ids
        states, emb = self._encode(batch, neg_ids, sparse.neg_rows, sparse.kjt)
        stats: dict[str, torch.Tensor] = {}
        loss = None
        if self.head is not None:
            if self.head.negatives == "uniform_shared":
                # decided (and logged) here, eagerly: a compiled head (train.compile) then reads the choice as a
                # constant instead of importing the kernel module inside its trace (a graph break)
                self.head.uses_triton(states.device)
            # the head projects the states itself (retrieval_proj, then unit norm): compiled, that fuses with it
            loss, st = self.head(states, batch.offsets, batch.item_ids,
                                 emb[ITEM_FEATURE].values(), neg_ids=neg_ids,
                                 neg_emb=emb[NEG_ITEM_FEATURE].values() if neg_ids is not None else None,
                                 generator=g, max_len=None if hs is None else hs.max_len,
                                 num_next=None if hs is None else hs.num_next, proj=self.retrieval_proj)
            stats.update(st)
            if self.tower is None:
                return loss, stats  # the retrieval model: exactly the head's loss and stats
            stats["loss_retrieval"] = loss.detach()
            stats["count_retrieval"] = st["num_targets"]
            if self.retrieval_weight != 1.0:
                loss = loss * self.retrieval_weight
        if self.tower is not None:
            logits, moe = self._logits(batch, states, emb)
            rank_loss, st = self.ranking_head(logits, batch.labels)
            stats.update(st)
            if moe:  # Switch's load-balancing loss, weighted; the routing figures as stats
                rank_loss = rank_loss + self.cfg.moe_aux_weight * moe["aux_loss"]
                stats["moe_aux_loss"] = moe["aux_loss"].detach()
                stats["moe_dropped"] = moe["dropped"]
            if self.head is None:
                stats["num_targets"] = st["num_candidates"]
                # the retrieval-side embeddings take no part: keep them in the graph (sharded backward)
                rank_loss = rank_loss + emb[ITEM_FEATURE].values().sum() * 0.0
            loss = rank_loss if loss is None else loss + rank_loss
        return loss, stats

    @torch.no_grad()
    def ranking_logits(self, batch: JaggedBatch) -> torch.Tensor:
        """[C, K] float32 logits of every candidate of the batch for ``cfg.ranking_tasks`` (evaluation; call
        under ``model.eval()``). Every rank must call it the same number of times (collective lookups), B = 0
        included. Raises ValueError without a ranking task or without candidates in the batch."""
        if self.tower is None:
            raise ValueError(f"GEM.ranking_logits: model.tasks {self.tasks} has no ranking task")
        states, emb = self._encode(batch, None)
        return self._logits(batch, states, emb)[0].float()

    def user_embeddings(self, batch: JaggedBatch) -> torch.Tensor:
        """[B, E] float32 unit-norm state at each sequence's last position (zeros for an empty sequence), in
        the item table's space (``retrieval_proj`` applied when d != E).

        Call under ``model.eval()`` and ``torch.no_grad()`` for evaluation; ``batch.targets`` is ignored.
        """
        states, _ = self._encode(batch, None)
        lengths = batch.lengths
        has = lengths > 0
        last = self._retrieval_states(states[batch.offsets[1:][has] - 1]).float()
        out = last.new_zeros((batch.batch_size, last.shape[1]))
        out[has] = last
        return out

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> [N, E] float32 unit-norm item embeddings, looked up through ``self.embeddings``.

        Sharded use: every rank must call this with the same ids (the lookup is collective).
        """
        lengths = torch.zeros(len(self._keys), dtype=torch.int64, device=ids.device)
        lengths[0] = ids.numel()
        kjt = KeyedJaggedTensor(keys=list(self._keys), values=ids.to(torch.int64).reshape(-1), lengths=lengths,
                                stride=1)
        emb = self.embeddings(kjt)[ITEM_FEATURE].values().float()  # float16 rows of an unsharded fp16 table
        return F.normalize(emb, dim=-1, eps=1e-6)
