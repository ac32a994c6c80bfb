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

Optional columns (GEM-style data: ``gemray prepare synthetic``, ``gemray prepare interactions``). A history
file may carry, after the four HISTORY_SCHEMA columns and in this order, any of:

- side features, declared in the manifest as ``"features": {<name>: {"level": "token" | "request",
  "cardinality": C, "column": <column>}}`` (names: lowercase letters, digits, ``_``; values dense 1..C,
  0 = missing):

  - ``level "token"``: column ``feat_<name>`` list<int64>, one value per history item, aligned with
    ``item_ids`` (e.g. the item's category or author at that event);
  - ``level "request"``: column ``ctx_<name>`` int64, one value per row, describing the row's request
    (e.g. hour-of-day bucket, device type).

  Item-level features (a fixed function of the item) may also be in ``items.parquet`` under the same column
  name; the entry then has ``"per_item": true`` (the lookup a model needs for candidates and negatives).
- a ranking request, declared in the manifest as ``"ranking": {...}`` (see :data:`RANKING_PROTOCOL`):
  ``request_split`` int8 (the request's split, an index into :data:`SPLITS`), ``cand_item_ids``
  list<int64> (the items shown at the request, dense ids), ``cand_click`` list<int8> and ``cand_convert``
  list<int8> (0/1 labels aligned with ``cand_item_ids``; convert == 1 only where click == 1).

:func:`history_schema` gives the full schema of a prepared folder from its manifest.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pyarrow as pa

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
#: Run-time facts of one preparation (when, how long, workers, memory): beside the manifest, never in it, so that
#: preparing the same source twice gives an identical manifest.json.
RUN_FILE = "prepare_run.json"
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


# ------------------------------------------------------------------ optional GEM columns (see the module doc)

FEATURE_PREFIX = "feat_"  #: per-token side feature column: ``feat_<name>`` list<int64> aligned with item_ids
CONTEXT_PREFIX = "ctx_"  #: per-request context column: ``ctx_<name>`` int64
FEATURE_LEVELS = ("token", "request")
FEATURE_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
REQUEST_SPLIT = "request_split"  #: int8, index into SPLITS: which split the row's request (candidates) is in
CANDIDATE_ITEMS = "cand_item_ids"  #: list<int64> dense item ids shown at the request
CANDIDATE_CLICK = "cand_click"  #: list<int8> 0/1
CANDIDATE_CONVERT = "cand_convert"  #: list<int8> 0/1, 1 only where clicked
LABEL_NAMES = ("click", "convert")  #: order of the label columns (JaggedBatch.labels[:, k])
LABEL_COLUMNS = (CANDIDATE_CLICK, CANDIDATE_CONVERT)

RANKING_FIELDS = [
    pa.field(REQUEST_SPLIT, pa.int8()),
    pa.field(CANDIDATE_ITEMS, pa.list_(pa.int64())),
    pa.field(CANDIDATE_CLICK, pa.list_(pa.int8())),
    pa.field(CANDIDATE_CONVERT, pa.list_(pa.int8())),
]

RANKING_PROTOCOL = (
    "one ranking request per row, in one split (request_split: 0 train, 1 valid, 2 test); it comes right after "
    "the retrieval input of that split: train and valid requests after h[:n-2] (request time = timestamps[n-2]), "
    "test requests after h[:n-1] (request time = timestamps[n-1]); the candidates are the items shown at the "
    "request (the retrieval target h[stop] is not among them by construction), with click and convert labels "
    "(convert only when clicked). A split's stream yields the candidates of its own requests only (the other "
    "rows carry none), so no label is read in two splits."
)


def feature_column(name: str, level: str) -> str:
    """The Parquet column of a declared feature: ``feat_<name>`` (level "token") or ``ctx_<name>``
    ("request"). Raises ValueError for a bad name or level."""
    if not isinstance(name, str) or not FEATURE_NAME_RE.fullmatch(name):
        raise ValueError(f"feature name {name!r}: expected lowercase letters, digits and '_', starting with a "
                         "letter (at most 64 characters)")
    if level not in FEATURE_LEVELS:
        raise ValueError(f"feature {name!r}: level expected one of {FEATURE_LEVELS}, got {level!r}")
    return (FEATURE_PREFIX if level == "token" else CONTEXT_PREFIX) + name


def check_features(features: Any) -> dict[str, dict[str, Any]]:
    """Validate a manifest's ``"features"`` entry and return it (``{}`` for None).

    Each value must be ``{"level": "token"|"request", "cardinality": int >= 1, "column": feature_column(name,
    level)}`` (extra keys allowed). Raises ValueError naming the feature and the bad key.
    """
    if features is None:
        return {}
    if not isinstance(features, dict):
        raise ValueError(f"manifest features: expected an object, got {type(features).__name__}")
    for name, spec in features.items():
        if not isinstance(spec, dict):
            raise ValueError(f"manifest features.{name}: expected an object, got {type(spec).__name__}")
        col = feature_column(name, spec.get("level"))
        card = spec.get("cardinality")
        if not isinstance(card, int) or isinstance(card, bool) or card < 1:
            raise ValueError(f"manifest features.{name}.cardinality: expected an int >= 1, got {card!r}")
        if spec.get("column") != col:
            raise ValueError(f"manifest features.{name}.column: expected {col!r}, got {spec.get('column')!r}")
    return features


def history_fields(manifest: dict[str, Any]) -> list[pa.Field]:
    """The optional columns a prepared folder's history files carry after HISTORY_SCHEMA, in file order:
    token features (``feat_*``, in manifest order), request features (``ctx_*``), then the ranking columns
    when the manifest has a ``"ranking"`` entry. [] for MovieLens. Raises ValueError for bad declarations."""
    feats = check_features(manifest.get("features"))
    out = [pa.field(s["column"], pa.list_(pa.int64())) for s in feats.values() if s["level"] == "token"]
    out += [pa.field(s["column"], pa.int64()) for s in feats.values() if s["level"] == "request"]
    if manifest.get("ranking") is not None:
        out += RANKING_FIELDS
    return out


def history_schema(manifest: dict[str, Any]) -> pa.Schema:
    """HISTORY_SCHEMA followed by :func:`history_fields`: the full schema of a prepared folder's histories."""
    return pa.schema(list(HISTORY_SCHEMA) + history_fields(manifest))


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


def no_split_users_message(splits: dict[str, Any]) -> str | None:
    """Pure: why prepared data whose manifest ``splits`` (``users``, ``too_short_users``, ``min_history``) counts no
    user in the leave-one-out splits gives nothing to train or evaluate on, or None when some user is in them."""
    if int(splits.get("users", 1)) > 0:
        return None
    short, need = int(splits.get("too_short_users", 0)), int(splits.get("min_history", MIN_HISTORY_FOR_SPLITS))
    return (f"all {short} users have fewer than {need} interactions, the fewest the leave-one-out split needs (the "
            f"last item is the test target, the one before it the validation target, the rest the training sequence)")


def warn_if_no_split_users(log: logging.Logger, out: Any, manifest: dict[str, Any]) -> None:
    """The WARNING of a preparation whose users are all too short for the splits (:func:`no_split_users_message`):
    it wrote the data, and ``gemray train`` refuses it (was: "0 users in the splits" in the summary and nothing
    else; a run on it trained 0 steps and exited 0)."""
    why = no_split_users_message(manifest.get("splits") or {})
    if why:
        log.warning("%s: no user is in the train/valid/test splits: %s; a run on this data has nothing to train or "
                    "test on (gemray train refuses it): give each user at least %d interactions", out, why,
                    int(manifest["splits"].get("min_history", MIN_HISTORY_FOR_SPLITS)))


def log_capped_files(log: logging.Logger, out: Any, written: int, asked: int | str, users: int,
                     name: str = "--num-files") -> None:
    """The INFO line of a preparation that writes fewer history files than asked for (``asked``: the count, or
    how it was chosen; ``name``: the flag or config key it came from, "--num-files 8" or "data.num_files = 8"):
    a file holds whole users' histories, so there are at most as many files as users. Logs nothing when
    ``written`` is not below the count asked for. Said, not silent (was: the cap went unmentioned)."""
    wanted = asked if isinstance(asked, str) else f"{name} {asked}" if name.startswith("--") else f"{name} = {asked}"
    if isinstance(asked, int) and written >= asked:
        return
    log.info("%s: writing %d history files, not %s: a file holds whole users' histories and the data has %d users",
             out, written, wanted, users)
