"""On-disk layout of a prepared MovieLens folder, and the leave-one-out split rules shared by the pipeline.

A prepared folder (written by :func:`gemray.pipelines.movielens.prepare_movielens`)::

    <out>/
      manifest.json               what was converted, from which checksummed source, counts, shards
      items.parquet               item_id int64 (dense 1..num_items), raw_item_id int64 (MovieLens movieId)
      histories/part-00000.parquet  one row per user (HISTORY_SCHEMA), users in ascending user_id order,
      histories/part-00001.parquet  each file a contiguous range of users, a few row groups per file
      ...
      quarantine.jsonl            only with on_bad_rows="quarantine": one JSON object per bad source line

Units (HISTORY_SCHEMA):

- ``user_id``: the raw MovieLens user id (1..2**31-1), unchanged.
- ``item_ids``: dense item ids 1..num_items, assigned in ascending raw movie id order; 0 is never used
  (reserved for padding). ``items.parquet`` maps them back to raw ids.
- ``ratings``: **half-star units** stored as int8, i.e. ``round(stars * 2)``: ML-1M / ML-100K integer
  stars 1..5 become 2, 4, 6, 8, 10 (4 stars -> 8); ml-latest-small 0.5..5.0 becomes 1..10 (3.5 -> 7).
- ``timestamps``: unix seconds (int64, >= 0).
- Each history is sorted by timestamp, stable: interactions with equal timestamps keep their source
  file order.

Split protocol (HSTU / SASRec leave-one-out; Kang & McAuley 2018, Zhai et al. 2024 "Actions Speak Louder
than Words"), for a user with time-ordered items h[0..n-1]:

- train:  sequence h[:-2] (every position predicts the next item; length-1 sequences are kept: they
  simply carry no next-item loss)
- valid:  input h[:-2], target h[-2]
- test:   input h[:-1], target h[-1]

Inputs keep the most recent ``max_seq_len`` items. Users with fewer than :data:`MIN_HISTORY_FOR_SPLITS`
(3) interactions stay in the Parquet files but are excluded from all three splits (counted in the
manifest as ``splits.too_short_users``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
HISTORIES_DIR = "histories"
ITEMS_FILE = "items.parquet"
QUARANTINE_FILE = "quarantine.jsonl"

#: One row per user. Exactly these fields, in this order.
HISTORY_SCHEMA = pa.schema([
    pa.field("user_id", pa.int64()),
    pa.field("item_ids", pa.list_(pa.int64())),
    pa.field("ratings", pa.list_(pa.int8())),
    pa.field("timestamps", pa.list_(pa.int64())),
])

#: Dense item id -> raw MovieLens movie id.
ITEMS_SCHEMA = pa.schema([
    pa.field("item_id", pa.int64()),
    pa.field("raw_item_id", pa.int64()),
])

MAX_ID = 2**31 - 1
MIN_HISTORY_FOR_SPLITS = 3
SPLITS = ("train", "valid", "test")

SPLIT_PROTOCOL = (
    "leave-one-out (HSTU/SASRec): per user with time-ordered items h[0..n-1], n >= 3: "
    "train sequence = h[:-2]; valid = input h[:-2], target h[-2]; test = input h[:-1], target h[-1]; "
    "inputs truncated to the most recent max_seq_len items; users with n < 3 are excluded from all splits."
)


class BadRowError(ValueError):
    """A source row that cannot be converted.

    Attributes: ``file`` (source path as given), ``line`` (1-based line number), ``field`` (field name,
    or ``"row"`` / ``"bytes"`` when the row as a whole is bad), ``reason`` (a short key used for
    quarantine counts: ``field_count``, ``non_numeric``, ``encoding``, ``out_of_range``, ``header``,
    ``truncated``: the last line of a file that does not end with a newline),
    ``problem`` (human-readable detail). The message reads ``<file>:<line>: field <field>: <problem>``.
    """

    def __init__(self, file: str, line: int, field: str, reason: str, problem: str):
        self.file, self.line, self.field, self.reason, self.problem = file, line, field, reason, problem
        super().__init__(f"{file}:{line}: field {field!r}: {problem} [{reason}]")


def check_split(split: str) -> str:
    """Return ``split`` if it is one of :data:`SPLITS`, else raise ValueError naming it."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return split


def split_input_bounds(history_lengths: np.ndarray, split: str, max_seq_len: int, *,
                       train_includes_valid: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Where each user's model input lies inside its full history, for one split.

    history_lengths: [U] int, full history lengths n (every n must be >= 3, i.e. split-eligible).
    Returns (start [U] int64, stop [U] int64): the input is h[start:stop] with stop = n-2 (train, valid)
    or n-1 (test) and start = max(0, stop - max_seq_len). The target of valid/test is h[stop].
    train_includes_valid: train on h[:n-1] instead (generative-recommenders' ML-1M training data keeps the
    validation item; the test item stays held out, but validation metrics then score trained targets).
    Raises ValueError for an unknown split, max_seq_len < 1, or a history shorter than 3.
    """
    check_split(split)
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len: expected >= 1, got {max_seq_len}")
    n = np.asarray(history_lengths, dtype=np.int64)
    if n.size and int(n.min()) < MIN_HISTORY_FOR_SPLITS:
        raise ValueError(f"history_lengths: split inputs need n >= {MIN_HISTORY_FOR_SPLITS}, "
                         f"got a history of length {int(n.min())}")
    stop = n - (1 if split == "test" or (split == "train" and train_includes_valid) else 2)
    start = np.maximum(stop - max_seq_len, 0)
    return start, stop


def split_input_lengths(history_lengths: np.ndarray, split: str, max_seq_len: int, *,
                        train_includes_valid: bool = False) -> np.ndarray:
    """[U] full history lengths (n >= 3) -> [U] int64 input token counts for ``split`` (see above)."""
    start, stop = split_input_bounds(history_lengths, split, max_seq_len,
                                     train_includes_valid=train_includes_valid)
    return stop - start
