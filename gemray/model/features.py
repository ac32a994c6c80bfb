"""Sparse features of a JaggedBatch as a TorchRec KeyedJaggedTensor (what the EmbeddingCollection eats).

Shape key: B sequences, T tokens, R negatives per row, K rows of negatives (K = B when each sequence
shares one row, K = M = sum(max(L_b - 1, 0)) with one row per position that has a next item).

Keys, in the EmbeddingCollection's feature order (see ``feature_names``), every one with lengths [B]:
    "item_id"      history item ids (T values, the batch's own lengths);
    "neg_item_id"  sampled negative item ids (K*R values; sequence b holds rows_b*R of them, rows_b = 1
                   for per-sequence negatives, max(L_b - 1, 0) for per-position ones; lengths 0 when none);
    "rating"       half-star ratings 0..10 (T values; only with ``use_rating_feature``);
    "time_gap"     log-bucketised seconds since the previous interaction of the same sequence, the first
                   interaction gets bucket 0 (T values; only with ``use_time_feature``).
An empty batch (B=0) is given one empty row (stride 1, all lengths 0) because TorchRec cannot split a
stride-0 KJT; lookups still run, so a sharded backward sees every rank.

Example (B=2, lengths 2, 1, R=1): item_id values [7, 3, 9] lengths [2, 1]; neg_item_id values [4, 8]
lengths [1, 1] (per sequence), or per position (rows [1, 0], R=2): values [4, 8] lengths [2, 0]; time_gap for timestamps [10, 12, 50] -> [0, 1 + bucket(2 s), 0].
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gemray.config import ModelConfig
from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE, JaggedBatch, positions
from gemray.kernels.reference import time_bucket_ref

NEG_ITEM_FEATURE = "neg_item_id"
NUM_RATINGS = 11  # half stars 0..10


def feature_names(cfg: ModelConfig) -> list[str]:
    """The KJT keys for ``cfg``, in the order of the EmbeddingCollection's tables."""
    names = [ITEM_FEATURE, NEG_ITEM_FEATURE]
    if cfg.use_rating_feature:
        names.append(RATING_FEATURE)
    if cfg.use_time_feature:
        names.append(TIME_FEATURE)
    return names


def time_gap_buckets(timestamps: torch.Tensor, offsets: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """timestamps [T] int64 seconds, offsets [B+1] -> [T] int64 buckets in [0, num_buckets).

    Bucket 0 = first interaction of a sequence; otherwise ``1 + time_bucket_ref(gap, num_buckets - 1)``
    with gap = seconds since the previous interaction (log-spaced, generative-recommenders' 0.301 divisor).
    Raises ValueError if timestamps decrease inside a sequence (checked on CPU tensors, i.e. by the data
    pipeline's batches; on CUDA the check would block the host every step).
    """
    if timestamps.numel() == 0:
        return timestamps.new_zeros(0, dtype=torch.int64)
    gap = torch.zeros_like(timestamps)
    gap[1:] = timestamps[1:] - timestamps[:-1]
    first = positions(offsets, timestamps.numel()) == 0
    if timestamps.device.type == "cpu" and bool(((gap < 0) & ~first).any()):
        t = int(torch.nonzero((gap < 0) & ~first)[0])
        raise ValueError(f"timestamps: decrease inside a sequence at token {t}")
    b = 1 + time_bucket_ref(gap, max(num_buckets - 1, 1))
    return torch.where(first, torch.zeros_like(b), b).clamp(max=num_buckets - 1)


def sparse_features(batch: JaggedBatch, *, neg_ids: torch.Tensor | None, cfg: ModelConfig,
                    neg_rows: torch.Tensor | None = None) -> KeyedJaggedTensor:
    """Build the KJT for ``batch`` (keys ``feature_names(cfg)``, lengths [B] per key, stride max(B, 1)), its
    ``length_per_key`` given from the values' shapes (host ints: no device read).

    neg_ids: optional [K, R] int64 negative item ids, rows grouped by sequence in batch order.
    neg_rows: optional [B] int64, how many of the K rows belong to each sequence (sum K); None means one
        row per sequence (K = B: negatives shared by the sequence's positions). Per-position negatives
        pass ``max(lengths - 1, 0)`` (see ``gemray.model.heads.sample_uniform_per_position``).
    Raises ValueError for ratings outside 0..10, a neg_ids that is not 2-D, or rows that do not add up (the
    value checks on CPU tensors only: on CUDA each would block the host every step; the data pipeline's batches
    are checked on the CPU, and FBGEMM's bounds check catches ids outside a table).
    """
    B = batch.batch_size
    dev = batch.offsets.device
    lengths = batch.lengths
    if B == 0:
        names = feature_names(cfg)
        return KeyedJaggedTensor(keys=names, values=torch.zeros(0, dtype=torch.int64, device=dev),
                                 lengths=torch.zeros(len(names), dtype=torch.int64, device=dev), stride=1,
                                 length_per_key=[0] * len(names))
    values = [batch.item_ids.to(torch.int64)]
    lens = [lengths]
    if neg_ids is not None:
        if neg_rows is None:
            if neg_ids.dim() != 2 or neg_ids.shape[0] != B:
                raise ValueError(f"neg_ids: expected [B={B}, R], got {tuple(neg_ids.shape)}")
            neg_lens = torch.full((B,), neg_ids.shape[1], dtype=torch.int64, device=dev)
        else:
            if neg_ids.dim() != 2:
                raise ValueError(f"neg_ids: expected [K, R], got {tuple(neg_ids.shape)}")
            if neg_rows.shape != (B,) or (neg_rows.device.type == "cpu" and (
                    int(neg_rows.sum()) != neg_ids.shape[0] or (neg_rows.numel() and int(neg_rows.min()) < 0))):
                raise ValueError(f"neg_rows: expected [B={B}] non-negative counts adding up to "
                                 f"K={neg_ids.shape[0]}, got shape {tuple(neg_rows.shape)} sum {int(neg_rows.sum())}")
            neg_lens = neg_rows.to(device=dev, dtype=torch.int64) * neg_ids.shape[1]
        values.append(neg_ids.reshape(-1).to(torch.int64))
        lens.append(neg_lens)
    else:
        values.append(batch.item_ids.new_zeros(0, dtype=torch.int64))
        lens.append(torch.zeros(B, dtype=torch.int64, device=dev))
    if cfg.use_rating_feature:
        r = batch.ratings.to(torch.int64)
        if r.device.type == "cpu" and r.numel() and (int(r.min()) < 0 or int(r.max()) >= NUM_RATINGS):
            raise ValueError(f"ratings: expected half stars in 0..{NUM_RATINGS - 1}, got range "
                             f"[{int(r.min())}, {int(r.max())}]")
        values.append(r)
        lens.append(lengths)
    if cfg.use_time_feature:
        values.append(time_gap_buckets(batch.timestamps.to(torch.int64), batch.offsets, cfg.num_time_buckets))
        lens.append(lengths)
    # length_per_key: each key's value count, host ints (shapes): TorchRec would otherwise sum the lengths on the
    # device and read them back (a host sync per lookup) to split the KJT by key
    return KeyedJaggedTensor(keys=feature_names(cfg), values=torch.cat(values),
                             lengths=torch.cat(lens).to(torch.int64), stride=B,
                             length_per_key=[v.numel() for v in values])


def item_id_features(ids: torch.Tensor, cfg: ModelConfig) -> KeyedJaggedTensor:
    """KJT that looks up item ids [N] alone: one row (stride 1), "item_id" lengths [N], others 0."""
    names = feature_names(cfg)
    lengths = torch.zeros(len(names), dtype=torch.int64, device=ids.device)
    lengths[0] = ids.numel()
    return KeyedJaggedTensor(keys=names, values=ids.to(torch.int64).reshape(-1), lengths=lengths, stride=1)
