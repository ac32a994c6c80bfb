"""The input layer of GEM: embeddings of each history token, candidate and request, combined to width d.

Shape key: B requests (rows), T history tokens, C candidates, E = ``cfg.embedding_dim`` (every table: one
width, an EmbeddingCollection requirement), d = ``cfg.width`` (``model_dim``, or E when it is 0), F = the
number of embeddings one combiner combines.

Tables of the one EmbeddingCollection (``embedding_configs``) and their KeyedJaggedTensor keys; lengths [B]::

    table      rows (default; ``cfg.table_rows`` overrides)    keys
    item       num_items + 1 (row 0 = padding)                 item_id [T], neg_item_id, cand_item_id [C] (*)
    rating     11                                              rating [T]      (use_rating_feature)
    time_gap   num_time_buckets                                time_gap [T]    (use_time_feature)
    <f>        cardinality(f) + 1 (0 = missing)                <f> [T], cand_<f> [C] (*) (f in token_features;
                                                               cand_<f> when f is in candidate_features)
    user       num_users + 1                                   user_id [B] (*) ("user_id" in context_features)
    <c>        cardinality(c) + 1 (0 = missing)                ctx_<c> [B] (*) (c in context_features)

(*) only with a ranking task ("ctr" / "cvr" in ``cfg.tasks``): the candidate tower is what reads them. The first
three rows are today's tables (``gemray.model.embeddings``), unchanged: the defaults add nothing.

Combining (``FeatureCombiner``), for the tokens (item, rating, time_gap, token features, in that order), the
candidates (item, candidate features) and the request (user id, context features):

    "sum":    e_1 + e_2 + ... + e_F, added left to right   [N, E]   (today's ML-1M item + rating + time_gap,
              bit for bit), then Linear(E, d) when d != E;
    "concat": [e_1 | e_2 | ... | e_F]                      [N, F*E], then Linear(F*E, d) when F*E != d.

A projection exists exactly when the combined width differs from d, so the defaults (sum, model_dim 0) have
no parameters here and ``InputLayer.token_embeddings`` is what ``GEM._encode`` feeds the encoder today.

Example (E = 4, d = 8, token_features ["category"], combiner "concat")::

    layer = InputLayer(cfg)
    emb = embedding_collection(kjt)                 # {key: JaggedTensor}
    x = layer.token_embeddings(emb)                 # [T, 8] = Linear(12, 8)([item | rating | time_gap]) ...
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingConfig

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE, JaggedBatch
from gemray.model.embeddings import table_config_kwargs
from gemray.model.features import NEG_ITEM_FEATURE, NUM_RATINGS

CANDIDATE_ITEM_FEATURE = "cand_item_id"
USER_FEATURE = ModelConfig.USER_ID_FEATURE
CANDIDATE_PREFIX = "cand_"
CONTEXT_PREFIX = "ctx_"
COMBINERS = ("sum", "concat")


def token_feature_names(cfg: ModelConfig) -> list[str]:
    """KJT keys combined into each history token, in combining order: item_id, rating, time_gap (when
    used), then ``cfg.token_features``."""
    names = [ITEM_FEATURE]
    if cfg.use_rating_feature:
        names.append(RATING_FEATURE)
    if cfg.use_time_feature:
        names.append(TIME_FEATURE)
    return names + list(cfg.token_features)


def candidate_feature_names(cfg: ModelConfig) -> list[str]:
    """KJT keys combined into each candidate: cand_item_id, then cand_<f> for ``cfg.candidate_features``;
    [] without a ranking task."""
    if not cfg.ranking_tasks:
        return []
    return [CANDIDATE_ITEM_FEATURE] + [CANDIDATE_PREFIX + f for f in cfg.candidate_features]


def context_feature_names(cfg: ModelConfig) -> list[str]:
    """KJT keys combined into the request vector: user_id and/or ctx_<c>, in ``cfg.context_features`` order;
    [] without a ranking task or context features."""
    if not cfg.ranking_tasks:
        return []
    return [USER_FEATURE if c == USER_FEATURE else CONTEXT_PREFIX + c for c in cfg.context_features]


def extra_feature_names(cfg: ModelConfig) -> list[str]:
    """The KJT keys this layer adds to ``gemray.model.features.feature_names(cfg)``: token features, then the
    candidate keys, then the context keys (the order of ``extra_sparse_features``). [] for the defaults."""
    names = list(cfg.token_features)
    cands = candidate_feature_names(cfg)
    return names + cands + context_feature_names(cfg)


def embedding_configs(cfg: ModelConfig, num_items: int, *, cardinalities: Mapping[str, int] | None = None,
                      num_users: int | None = None) -> list[EmbeddingConfig]:
    """The EmbeddingCollection's tables for ``cfg`` (see the module docstring), all E wide, stored in
    ``cfg.table_dtype`` and initialised uniform in +-0.02*sqrt(3) (``gemray.model.embeddings.table_config_kwargs``).

    Args:
        num_items: N (item ids 1..N).
        cardinalities: {feature name: C} of every token / context feature (ids 0..C, 0 = missing), e.g. a
            prepared folder's manifest ``features``; not needed for a table that ``cfg.table_rows`` sizes.
        num_users: U (user ids 0..U) when "user_id" is a context feature and ``table_rows`` has no "user".
    Returns:
        list[EmbeddingConfig]; for the defaults the same tables as ``make_embedding_collection``.
    Raises:
        ValueError: num_items < 1, a size that is missing, or a ``table_rows`` override smaller than the ids
        the data holds.
    """
    if num_items < 1:
        raise ValueError(f"num_items: expected >= 1, got {num_items}")
    cardinalities = dict(cardinalities or {})
    overrides = cfg.table_rows_map()

    def rows(table: str, needed: int | None) -> int:
        n = overrides.get(table)
        if n is None:
            if needed is None:
                raise ValueError(f"embedding_configs: table {table!r} needs a size: give its cardinality (or "
                                 f"num_users) or model.table_rows '{table}=ROWS'")
            return needed
        if needed is not None and n < needed:
            raise ValueError(f"model.table_rows: {table}={n} is smaller than the {needed} rows its ids need")
        return n

    kw = table_config_kwargs(cfg)
    ranking = bool(cfg.ranking_tasks)
    item_features = [ITEM_FEATURE, NEG_ITEM_FEATURE] + ([CANDIDATE_ITEM_FEATURE] if ranking else [])
    tables = [EmbeddingConfig(name="item", num_embeddings=rows("item", num_items + 1),
                              feature_names=item_features, **kw)]
    if cfg.use_rating_feature:
        tables.append(EmbeddingConfig(name="rating", num_embeddings=rows("rating", NUM_RATINGS),
                                      feature_names=[RATING_FEATURE], **kw))
    if cfg.use_time_feature:
        tables.append(EmbeddingConfig(name="time_gap", num_embeddings=rows("time_gap", cfg.num_time_buckets),
                                      feature_names=[TIME_FEATURE], **kw))

    def card(name: str) -> int | None:
        c = cardinalities.get(name)
        if c is not None and int(c) < 1:
            raise ValueError(f"cardinalities[{name!r}]: expected >= 1, got {c}")
        return None if c is None else int(c) + 1

    for f in cfg.token_features:
        keys = [f] + ([CANDIDATE_PREFIX + f] if ranking and f in cfg.candidate_features else [])
        tables.append(EmbeddingConfig(name=f, num_embeddings=rows(f, card(f)), feature_names=keys, **kw))
    if ranking:
        for c in cfg.context_features:
            if c == USER_FEATURE:
                need = None if num_users is None else int(num_users) + 1
                tables.append(EmbeddingConfig(name="user", num_embeddings=rows("user", need),
                                              feature_names=[USER_FEATURE], **kw))
            else:
                tables.append(EmbeddingConfig(name=c, num_embeddings=rows(c, card(c)),
                                              feature_names=[CONTEXT_PREFIX + c], **kw))
    return tables


def extra_sparse_features(batch: JaggedBatch, cfg: ModelConfig,
                          candidate_features: Mapping[str, torch.Tensor] | None = None
                          ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(key, values int64, lengths [B] int64) for each of ``extra_feature_names(cfg)``, in that order, to append
    to the KJT of ``gemray.model.features.sparse_features``.

    Token features: ``batch.features[f]`` [T] (lengths = history lengths); candidate keys:
    ``batch.candidate_ids`` [C] and ``candidate_features[f]`` [C] (the item-level feature of each candidate,
    e.g. looked up in the items table) with lengths = candidate counts; context keys: ``batch.user_ids`` /
    ``batch.context[c]`` [B] with lengths 1. With B = 0 every entry is empty with lengths [0] (one zero) as
    ``sparse_features``' empty-batch KJT (stride 1).

    Raises ValueError when a configured feature is missing from the batch or has the wrong length.
    """
    B = batch.batch_size
    dev = batch.offsets.device
    names = extra_feature_names(cfg)
    if B == 0:
        return [(n, torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
                for n in names]
    out = []
    T = batch.item_ids.numel()  # = offsets[-1] (validated batches); a shape, not a device read
    feats = getattr(batch, "features", None) or {}  # the optional GEM fields of JaggedBatch
    for f in cfg.token_features:
        if f not in feats or feats[f].numel() != T:
            raise ValueError(f"batch.features[{f!r}]: expected [T={T}] int64 (model.token_features), got "
                             f"{None if f not in feats else tuple(feats[f].shape)}")
        out.append((f, feats[f].to(torch.int64), batch.lengths))
    if cfg.ranking_tasks:
        cand_off, cand_ids = getattr(batch, "candidate_offsets", None), getattr(batch, "candidate_ids", None)
        if cand_off is None or cand_ids is None:
            raise ValueError("batch.candidate_offsets / candidate_ids: None, but model.tasks has ranking tasks "
                             f"{cfg.ranking_tasks}")
        c_len = cand_off[1:] - cand_off[:-1]
        C = cand_ids.numel()  # = candidate_offsets[-1]; a shape, not a device read
        out.append((CANDIDATE_ITEM_FEATURE, cand_ids.to(torch.int64), c_len))
        cf = candidate_features or {}
        for f in cfg.candidate_features:
            if f not in cf or cf[f].numel() != C:
                raise ValueError(f"candidate_features[{f!r}]: expected [C={C}] int64 (model.candidate_features), "
                                 f"got {None if f not in cf else tuple(cf[f].shape)}")
            out.append((CANDIDATE_PREFIX + f, cf[f].to(torch.int64).reshape(-1), c_len))
        ones = torch.ones(B, dtype=torch.int64, device=dev)
        ctx = getattr(batch, "context", None) or {}
        for c in cfg.context_features:
            if c == USER_FEATURE:
                out.append((USER_FEATURE, batch.user_ids.to(torch.int64).reshape(-1), ones))
                continue
            if c not in ctx or ctx[c].numel() != B:
                raise ValueError(f"batch.context[{c!r}]: expected [B={B}] int64 (model.context_features), got "
                                 f"{None if c not in ctx else tuple(ctx[c].shape)}")
            out.append((CONTEXT_PREFIX + c, ctx[c].to(torch.int64), ones))
    return out


def _values(x) -> torch.Tensor:
    """A JaggedTensor's (or KeyedJaggedTensor row's) values, or a tensor as is."""
    return x if isinstance(x, torch.Tensor) else x.values()


class FeatureCombiner(nn.Module):
    """Combines F embeddings of the same rows, each [N, E], into [N, d] ("sum" or "concat", module docstring).

    Args:
        names: the F keys to read from the embedding dict, in combining order.
        embedding_dim: E. out_dim: d. combiner: "sum" | "concat".
    ``proj``: nn.Linear(W, d) when the combined width W (E for sum, F*E for concat) differs from d, else None.
    Raises ValueError on an empty ``names`` or an unknown combiner.
    """

    def __init__(self, names: list[str], embedding_dim: int, out_dim: int, combiner: str = "sum", device=None):
        super().__init__()
        if not names:
            raise ValueError("FeatureCombiner: names must not be empty")
        if combiner not in COMBINERS:
            raise ValueError(f"FeatureCombiner: combiner must be one of {COMBINERS}, got {combiner!r}")
        self.names = list(names)
        self.embedding_dim = embedding_dim
        self.out_dim = out_dim
        self.combiner = combiner
        width = embedding_dim * (len(names) if combiner == "concat" else 1)
        self.proj = nn.Linear(width, out_dim, device=device) if width != out_dim else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.proj is not None:
            self.proj.reset_parameters()

    def forward(self, emb: Mapping) -> torch.Tensor:
        """emb: {key: [N, E] tensor or JaggedTensor} with every key of ``names`` -> [N, d] (same dtype).

        Raises ValueError when a key is missing or a width / row count disagrees.
        """
        xs = []
        for n in self.names:
            if n not in emb:
                raise ValueError(f"FeatureCombiner: embedding {n!r} missing (have {sorted(emb)})")
            x = _values(emb[n])
            if x.dim() != 2 or x.shape[1] != self.embedding_dim or (xs and x.shape[0] != xs[0].shape[0]):
                raise ValueError(f"FeatureCombiner: {n!r} expected [{xs[0].shape[0] if xs else 'N'}, "
                                 f"{self.embedding_dim}], got {tuple(x.shape)}")
            xs.append(x)
        if self.combiner == "sum":
            out = xs[0]
            for x in xs[1:]:
                out = out + x
        else:
            out = torch.cat(xs, dim=1) if len(xs) > 1 else xs[0]
        return F.linear(out, self.proj.weight, self.proj.bias) if self.proj is not None else out


class InputLayer(nn.Module):
    """The three combiners of a GEM model (module docstring): ``tokens`` (always), ``candidates`` and
    ``context`` (None without a ranking task / without context features).

    Build on any device ("meta" included: materialise with ``to_empty`` then ``init_weights``).
    """

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        cfg.validate()
        E, d = cfg.embedding_dim, cfg.width
        self.tokens = FeatureCombiner(token_feature_names(cfg), E, d, cfg.combiner, device=device)
        cand = candidate_feature_names(cfg)
        self.candidates = FeatureCombiner(cand, E, d, cfg.combiner, device=device) if cand else None
        ctx = context_feature_names(cfg)
        self.context = FeatureCombiner(ctx, E, d, cfg.combiner, device=device) if ctx else None

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter anew in construction order (tokens, candidates, context), as construction does."""
        for m in (self.tokens, self.candidates, self.context):
            if m is not None:
                m.reset_parameters()

    def token_embeddings(self, emb: Mapping) -> torch.Tensor:
        """emb: the EmbeddingCollection's output {key: JaggedTensor} -> [T, d] history token embeddings."""
        return self.tokens(emb)

    def candidate_embeddings(self, emb: Mapping) -> torch.Tensor:
        """-> [C, d] candidate embeddings. Raises ValueError without a ranking task."""
        if self.candidates is None:
            raise ValueError("InputLayer: no candidate embeddings without a ranking task in model.tasks")
        return self.candidates(emb)

    def context_embeddings(self, emb: Mapping) -> torch.Tensor | None:
        """-> [B, d] request embeddings, or None when the model has no context features."""
        return None if self.context is None else self.context(emb)
