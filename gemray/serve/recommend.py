"""``gemray recommend``: top-K items per user from the retrieval head, the user's history excluded.

Per user: the full history in the prepared data (every interaction, the valid and test items included; the most
recent ``data.max_seq_len`` fed to the encoder) -> ``GEM.user_embeddings`` [B, D] (the request time, the query
time of the last position's time bias, is the last interaction's) -> scores against every item embedding
(``GEM.item_embeddings``, unit norm, [N+1, D]) -> the K best items that are not the padding id and not in the
user's history.

Ids: the prepared data's dense ids (users 1..U, items 1..N) are what the model knows. A folder from
``gemray prepare interactions`` maps them to the raw ids of the log (``users.parquet``: user_id, raw_user_id;
``items.parquet``: item_id, raw_item_id); MovieLens keeps its raw user ids as user ids and maps the raw movie
ids in ``items.parquet``. Users are given and items are returned as raw ids (:class:`IdMaps`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch

from gemray.config import JobConfig
from gemray.serve.model import TrainedModel, check_data

log = logging.getLogger(__name__)

#: Columns of ``gemray recommend --out`` (Parquet or CSV), one row per (user, rank).
RECS_COLUMNS = ("user_id", "rank", "item_id", "score")

#: ``gemray recommend --out``'s file formats by suffix (case-insensitive).
RECS_FORMATS = {".parquet": "Parquet", ".csv": "CSV"}


def recs_format(path: str | Path) -> str:
    """Pure: the format ``gemray recommend --out PATH`` writes, from PATH's suffix: "Parquet" (``.parquet``) or
    "CSV" (``.csv``). Raises ValueError naming --out and the suffixes for any other (was: Parquet bytes whatever
    the name, ``recs.csv`` included)."""
    fmt = RECS_FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        what = f"suffix {Path(path).suffix!r} is neither .parquet nor .csv" if Path(path).suffix else "no suffix"
        raise ValueError(f"--out {path}: {what}; name a .parquet (Parquet) or .csv (CSV) file, the suffix picks the "
                         "format")
    return fmt


def write_recs(recs: pa.Table, path: str | Path) -> str:
    """Write :func:`recommend`'s table to ``path`` in the format of its suffix (:func:`recs_format`): Parquet, or CSV
    with a header line (pyarrow.csv). Returns the format's name."""
    fmt = recs_format(path)
    if fmt == "CSV":
        import pyarrow.csv as pacsv

        pacsv.write_csv(recs, path)
    else:
        pq.write_table(recs, path)
    return fmt


def user_id_range(manifest: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """Pure: ``(users, lowest id, highest id)`` of a prepared folder's ``manifest``, from ``counts.users`` and the
    shards' first / last user ids (dense ids); None for what the manifest does not hold."""
    shards = manifest.get("shards") or []
    n = (manifest.get("counts") or {}).get("users")
    lo = min((int(s["first_user_id"]) for s in shards if "first_user_id" in s), default=None)
    hi = max((int(s["last_user_id"]) for s in shards if "last_user_id" in s), default=None)
    return (None if n is None else int(n)), lo, hi


def _users_in_words(users: int | None, lo: int | None, hi: int | None) -> str:
    """For a refusal: ' (943 users, ids 1..943)' from :func:`user_id_range`'s values; '' when it knows nothing."""
    parts = ([f"{users} users"] if users is not None else []) + ([f"ids {lo}..{hi}"] if lo is not None else [])
    return f" ({', '.join(parts)})" if parts else ""


class IdMaps:
    """Raw <-> dense ids of a prepared folder (see the module docstring).

    ``users``: None (raw user ids are the dense ones) or (dense [U] int64, raw [U] array);
    ``items``: (dense [N] int64, raw [N] array) or None when the folder has no ``items.parquet``;
    ``root``: the folder; ``user_range``: its (users, lowest, highest dense id) (:func:`user_id_range`).
    """

    def __init__(self, manifest: dict[str, Any]):
        root = Path(manifest["prepared_dir"])
        self.root = root
        self.user_range = user_id_range(manifest)
        maps = manifest.get("id_maps") or {}
        self.users = self._read(root / maps["users"], "user_id", "raw_user_id") if "users" in maps else None
        items_file = root / (maps.get("items") or manifest.get("items_file") or "items.parquet")
        self.items = self._read(items_file, "item_id", "raw_item_id") if items_file.is_file() else None
        self._user_index = None
        if self.users is not None:
            self._user_index = {self._key(r): int(d) for d, r in zip(*self.users)}

    @staticmethod
    def _read(path: Path, dense: str, raw: str) -> tuple[np.ndarray, np.ndarray]:
        t = pq.read_table(path, columns=[dense, raw])
        return (t.column(dense).to_numpy().astype(np.int64),
                np.asarray(t.column(raw).to_pylist(), dtype=object))

    @staticmethod
    def _key(raw: Any) -> str:
        return str(raw)

    def dense_users(self, raw_ids: list[Any], where: list[str] | None = None) -> list[int]:
        """Dense user ids of ``raw_ids`` (strings or ints as given on the command line). Raises ValueError
        naming the first id that is not a user of the data (after ``where[i]``, its place in the users file, when
        given), the folder and its users (count, id range); an id outside the range is refused here, one in a gap
        of it by :func:`read_histories`. A user given twice (the same dense id, e.g. ``--user 1 --user 1``) is
        refused at its second place, naming the first (was: its rows written twice)."""
        out = []
        first: dict[int, int] = {}  # dense id -> index of its first place in raw_ids
        n, lo, hi = self.user_range
        for i, r in enumerate(raw_ids):
            at = f"{where[i]}: " if where is not None and i < len(where) else ""
            if self._user_index is None:
                try:
                    d = int(r)
                except (TypeError, ValueError):
                    raise ValueError(f"{at}user id {r!r}: the user ids of {self.root} are integers"
                                     f"{_users_in_words(n, lo, hi)}") from None
                if lo is not None and not lo <= d <= hi:
                    raise ValueError(f"{at}user id {r}: not a user of {self.root}{_users_in_words(n, lo, hi)}")
                shown = f"{r}"
            else:
                d = self._user_index.get(self._key(r))
                if d is None:
                    raise ValueError(f"{at}user id {r!r}: not a user of {self.root} (not among the raw ids of its "
                                     f"{len(self._user_index)} users in users.parquet)")
                shown = f"{r!r}"
            j = first.setdefault(d, i)
            if j != i:
                before = [f"at {where[j]}"] if at else []
                if f"{raw_ids[j]}" != f"{r}":  # another spelling of the same user, e.g. 01 and 1
                    before.append(f"as {raw_ids[j]!r}" if self._user_index is not None else f"as {raw_ids[j]}")
                said = f" (first {' '.join(before)})" if before else ""
                raise ValueError(f"{at}user id {shown}: given twice{said}; give each user once")
            out.append(d)
        return out

    def raw_users(self, dense: np.ndarray) -> list[Any]:
        if self.users is None:
            return [int(u) for u in dense]
        lookup = dict(zip(self.users[0].tolist(), self.users[1].tolist()))
        return [lookup[int(u)] for u in dense]

    def raw_items(self, dense: np.ndarray) -> list[Any]:
        if self.items is None:
            return [int(i) for i in dense.reshape(-1)]
        table = np.empty(int(self.items[0].max()) + 1, dtype=object)
        table[self.items[0]] = self.items[1]
        return table[dense.reshape(-1)].tolist()


def read_histories(manifest: dict[str, Any], user_ids: list[int]) -> pa.Table:
    """The full history rows (user_id, item_ids, ratings, timestamps) of dense ``user_ids``, in the order
    given. Raises ValueError naming the first id the prepared folder has no history for, with its users' count
    and id range (was: "dense user id; 1 missing")."""
    root = Path(manifest["prepared_dir"])
    files = sorted({str(root / s["file"]) for s in manifest["shards"]})
    wanted = pa.array(sorted(set(user_ids)), pa.int64())
    table = pads.dataset(files, format="parquet").to_table(
        columns=["user_id", "item_ids", "ratings", "timestamps"], filter=pc.field("user_id").isin(wanted))
    got = table.column("user_id").to_numpy()
    where = {int(u): i for i, u in enumerate(got)}
    missing = [u for u in user_ids if u not in where]
    if missing:
        raise ValueError(f"user id {missing[0]}: no history in {root}{_users_in_words(*user_id_range(manifest))}"
                         + (f"; {len(set(missing))} of the ids asked for have none" if len(set(missing)) > 1 else ""))
    return table.take(pa.array([where[u] for u in user_ids], pa.int64()))


def history_batch(table: pa.Table, max_seq_len: int):
    """A :class:`gemray.jagged.JaggedBatch` of the most recent ``max_seq_len`` interactions of each row of
    ``table`` (:func:`read_histories`), ``target_timestamps`` = each user's last interaction time, plus the
    full histories as (item ids [sum n] int64, offsets [B+1] int64) for excluding them from the ranking."""
    from gemray.jagged import JaggedBatch, lengths_to_offsets

    n = pc.list_value_length(table.column("item_ids")).to_numpy().astype(np.int64)
    if n.size and int(n.min()) < 1:
        raise ValueError("read_histories: a user with an empty history")
    items = pc.list_flatten(table.column("item_ids")).to_numpy().astype(np.int64)
    ratings = pc.list_flatten(table.column("ratings")).to_numpy().astype(np.int64)
    ts = pc.list_flatten(table.column("timestamps")).to_numpy().astype(np.int64)
    full_off = lengths_to_offsets(torch.from_numpy(n))
    keep = np.minimum(n, max_seq_len)
    off = lengths_to_offsets(torch.from_numpy(keep))
    ends = full_off[1:].numpy()
    gather = np.repeat(ends - keep - off[:-1].numpy(), keep) + np.arange(int(keep.sum()), dtype=np.int64)
    batch = JaggedBatch(user_ids=torch.from_numpy(table.column("user_id").to_numpy().astype(np.int64)),
                        offsets=off, item_ids=torch.from_numpy(items[gather]),
                        ratings=torch.from_numpy(ratings[gather]), timestamps=torch.from_numpy(ts[gather]),
                        targets=None, target_timestamps=torch.from_numpy(ts[ends - 1]))
    return batch, (torch.from_numpy(items), full_off)


@torch.no_grad()
def top_k(trained: TrainedModel, batch, history: tuple[torch.Tensor, torch.Tensor], k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(item ids [B, k] int64, scores [B, k] float32): the ``k`` best-scoring items per user, highest first,
    neither the padding id 0 nor an item of the user's full ``history`` (item ids, offsets). Fewer than k
    rankable items give -inf scores in the last columns (their ids are then meaningless)."""
    from gemray.metrics import history_mask

    model, dev = trained.model, trained.device
    items = model.item_embeddings(torch.arange(0, trained.num_items + 1, device=dev))  # [N+1, D]
    users = model.user_embeddings(batch.to(dev))  # [B, D]
    scores = (users @ items.T).float()
    seen = history_mask(history[0].to(dev), history[1].to(dev), trained.num_items)
    seen[:, 0] = True
    scores = scores.masked_fill(seen, float("-inf"))
    k = min(int(k), trained.num_items)
    vals, ids = torch.topk(scores, k, dim=1)
    return ids.cpu(), vals.cpu()


def check_k(k: int, num_items: int | None = None) -> None:
    """Pure: refuse a ``--k`` below 1 or above the ``num_items`` items of the catalogue (None: not checked), which
    no user can get (was: silently capped at the item count). ``gemray recommend`` checks it with the item count of
    the served data's manifest before the model loads; :func:`recommend` with the model's. K = N is accepted (every
    item outside the user's history). Raises ValueError naming ``--k`` and the count."""
    if int(k) < 1:
        raise ValueError(f"--k {k}: expected >= 1")
    if num_items is not None and int(k) > int(num_items):
        raise ValueError(f"--k {k}: more than the {num_items} items of the catalogue; give --k {num_items} or less "
                         "(each user gets at most the items outside their history)")


def check_recommendable(cfg: JobConfig) -> None:
    """Refuse, from the run's config alone (``gemray recommend`` checks it before loading the checkpoint), a model
    :func:`recommend` cannot serve: one without the retrieval task (no user embedding to rank the items by), one
    with ranking tasks (its batches would need each request's candidates), one with per-token side features
    (``model.token_features``), whose histories it cannot build from item ids. Raises ValueError naming the
    field and its value."""
    if cfg.model.token_features:
        raise ValueError(f"recommend: models with per-token side features (model.token_features = "
                         f"{list(cfg.model.token_features)}, e.g. the GEM configs) are not supported by recommend yet: "
                         "it builds each user's history from the item ids alone; `gemray evaluate` scores such "
                         "models")
    if "retrieval" not in cfg.model.tasks or cfg.model.ranking_tasks:
        raise ValueError(f"recommend: it serves the retrieval model alone (model.tasks = ['retrieval']); this model has "
                         f"model.tasks = {list(cfg.model.tasks)}; `gemray evaluate` scores it")


def recommend(trained: TrainedModel, users: list[Any], *, k: int = 10, prepared_dir: str | Path | None = None,
              batch_size: int | None = None, manifest: dict[str, Any] | None = None,
              maps: IdMaps | None = None) -> pa.Table:
    """Top-``k`` items for each of ``users`` (raw user ids as the data knows them; see :class:`IdMaps`).

    prepared_dir: the folder whose histories feed the users (default the run's ``data.prepared_dir``; another
    one must have the checkpoint's item count); batch_size: users per forward (default
    ``data.eval_batch_size``); manifest: the manifest of ``prepared_dir`` when the caller has read it already
    (``gemray recommend``: before loading the model, to refuse unknown users first), not read again; maps: its
    :class:`IdMaps` when the caller has built them already (the same reason), not read again. Returns a pyarrow
    Table of :data:`RECS_COLUMNS`: user_id (raw), rank (1..k), item_id (raw), score (cosine of user and item
    embedding, float32), users in the order given; a user with fewer than k items outside their history gets only
    those (never a history item, never the padding id 0). Raises ValueError for k < 1 or above the item count
    (:func:`check_k`), an unknown user, or data that does not fit the model.
    """
    check_k(k)
    cfg = trained.cfg
    check_recommendable(cfg)
    check_k(k, trained.num_items)
    manifest = check_data(trained, prepared_dir or cfg.data.prepared_dir,
                          manifest if prepared_dir is not None else None)
    if maps is None:
        maps = IdMaps(manifest)
    dense = maps.dense_users(list(users))
    bs = int(batch_size or cfg.data.eval_batch_size)
    cols: dict[str, list] = {c: [] for c in RECS_COLUMNS}
    for a in range(0, len(dense), bs):
        part = dense[a:a + bs]
        batch, hist = history_batch(read_histories(manifest, part), cfg.data.max_seq_len)
        ids, vals = top_k(trained, batch, hist, k)
        keep = torch.isfinite(vals)  # -inf: fewer than k items outside the user's history (history / padding ids)
        per_user = keep.sum(dim=1).tolist()
        cols["user_id"] += [u for u, m in zip(maps.raw_users(np.asarray(part)), per_user) for _ in range(m)]
        cols["rank"] += [r for m in per_user for r in range(1, m + 1)]
        cols["item_id"] += maps.raw_items(ids[keep].numpy())
        cols["score"] += vals[keep].tolist()
    return pa.table({"user_id": pa.array(cols["user_id"]), "rank": pa.array(cols["rank"], pa.int32()),
                     "item_id": pa.array(cols["item_id"]), "score": pa.array(cols["score"], pa.float32())})


def users_file_locations(path: str | Path) -> list[str]:
    """Where each id :func:`read_users_file` returns sits in ``path``, in the same order, for errors: ``"FILE:LINE"``
    (text: the line; CSV: the line, the header being line 1) or ``"FILE: row N"`` (Parquet, N from 1)."""
    p = Path(path)
    if p.suffix == ".parquet":
        return [f"{p}: row {i + 1}" for i in range(pq.read_metadata(p).num_rows)]
    if p.suffix == ".csv":
        import pyarrow.csv as pacsv

        return [f"{p}:{i + 2}" for i in range(pacsv.read_csv(p).num_rows)]
    return [f"{p}:{n}" for n, line in enumerate(p.read_text().splitlines(), 1)
            if line.strip() and not line.strip().startswith("#")]


def read_users_file(path: str | Path) -> list[Any]:
    """User ids from a file: one per line (text; blank lines and lines starting with # skipped), or the
    ``user_id`` column of a Parquet / CSV file. Raises FileNotFoundError / ValueError naming the file (an id the
    data does not have is refused later, by :meth:`IdMaps.dense_users`; :func:`users_file_locations` says where)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--users-file {p}: " + ("a folder, not a file" if p.is_dir() else "no such file"))
    if p.suffix == ".parquet":
        t = pq.read_table(p)
    elif p.suffix == ".csv":
        import pyarrow.csv as pacsv

        t = pacsv.read_csv(p)
    else:
        ids = [line.strip() for line in p.read_text().splitlines()]
        ids = [i for i in ids if i and not i.startswith("#")]
        if not ids:
            raise ValueError(f"--users-file {p}: no user ids")
        return ids
    if "user_id" not in t.column_names:
        raise ValueError(f"--users-file {p}: no user_id column (columns: {t.column_names})")
    return t.column("user_id").to_pylist()
