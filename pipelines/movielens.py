"""MovieLens raw ratings -> per-user history Parquet (+ items map + manifest), atomically.

Supported sources (detected by which file the source folder holds; exactly one must be present):

| format            | file          | row layout                                   | ratings          |
|-------------------|---------------|----------------------------------------------|------------------|
| ``ml-1m``         | ratings.dat   | ``UserID::MovieID::Rating::Timestamp``       | integer 1..5     |
| ``ml-100k``       | u.data        | ``user id<TAB>item id<TAB>rating<TAB>timestamp`` | integer 1..5 |
| ``ml-latest-small`` | ratings.csv | header ``userId,movieId,rating,timestamp``   | 0.5..5.0 by 0.5  |

The output layout, units and split protocol are documented in :mod:`gemray.pipelines.schema`.

Parsing: a fast path hands the whole file to ``pyarrow.csv`` (multi-threaded) with strict types and
checks the value ranges vectorised; if anything at all is off (a conversion error, a bad field count,
a value out of range, a byte that is not ASCII) the file is re-read line by line by a strict Python
parser that finds every bad row with its 1-based line number. The two paths accept exactly the same
rows (tested), so the fast path is only an optimisation. Bad rows either stop the conversion
(``on_bad_rows="error"`` -> :class:`BadRowError`) or go to ``quarantine.jsonl`` with their counts in the
manifest (``"quarantine"``); the manifest checks ``data lines == interactions + quarantined``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gemray.config import check_num_files

from .schema import (log_capped_files, CANDIDATE_ITEMS, HISTORIES_DIR, HISTORY_SCHEMA, ITEMS_FILE, ITEMS_SCHEMA, MANIFEST_FILE,
                     MANIFEST_VERSION, MAX_ID, MIN_HISTORY_FOR_SPLITS, QUARANTINE_FILE, RUN_FILE, SPLIT_PROTOCOL,
                     BadRowError, warn_if_no_split_users)

log = logging.getLogger(__name__)

__all__ = ["BadRowError", "FORMATS", "prepare_movielens", "load_manifest", "detect_format", "format_summary"]

ROW_GROUPS_PER_FILE = 4
_BOM = b"\xef\xbb\xbf"
_INT_RE = re.compile(r"-?[0-9]+")
_DEC_RE = re.compile(r"-?[0-9]+(\.[0-9]+)?")
_HEADERISH_RE = re.compile(r"[A-Za-z_][A-Za-z_ ]*")
_MAX_TS = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class MovieLensFormat:
    """One raw MovieLens ratings layout: file name, separator, header, field names, rating scale."""

    name: str
    filename: str
    delimiter: str
    fields: tuple[str, str, str, str]  # names as the source documents them, for error messages
    header: str | None  # the exact first line (csv) or None (no header allowed)
    half_stars: bool  # ratings given in 0.5 steps (csv) rather than integer stars


FORMATS: dict[str, MovieLensFormat] = {
    f.name: f for f in (
        MovieLensFormat("ml-1m", "ratings.dat", "::", ("UserID", "MovieID", "Rating", "Timestamp"),
                        None, False),
        MovieLensFormat("ml-100k", "u.data", "\t", ("user id", "item id", "rating", "timestamp"),
                        None, False),
        MovieLensFormat("ml-latest-small", "ratings.csv", ",", ("userId", "movieId", "rating", "timestamp"),
                        "userId,movieId,rating,timestamp", True),
    )
}


def detect_format(src: str | Path) -> tuple[MovieLensFormat, Path]:
    """Find the ratings file in ``src`` (a folder, or the ratings file itself).

    Returns (format, path of the ratings file). Raises FileNotFoundError when ``src`` does not exist or
    holds none of ratings.dat / u.data / ratings.csv, ValueError when it holds several.
    """
    src = Path(src)
    if src.is_file():
        for fmt in FORMATS.values():
            if src.name == fmt.filename:
                return fmt, src
        raise ValueError(f"{src}: not a MovieLens ratings file (expected one of "
                         f"{[f.filename for f in FORMATS.values()]})")
    if not src.is_dir():
        raise FileNotFoundError(f"MovieLens source {src} does not exist")
    found = [(fmt, src / fmt.filename) for fmt in FORMATS.values() if (src / fmt.filename).is_file()]
    if not found:
        raise FileNotFoundError(f"{src}: no MovieLens ratings file found (looked for "
                                f"{', '.join(f.filename for f in FORMATS.values())})")
    if len(found) > 1:
        raise ValueError(f"{src}: several MovieLens ratings files found ({', '.join(p.name for _, p in found)}); "
                         f"point --src at a folder with exactly one")
    return found[0]


# --------------------------------------------------------------------------------------------- parsing

@dataclasses.dataclass
class _Parsed:
    users: np.ndarray  # [N] int64
    items: np.ndarray  # [N] int64 raw ids
    ratings: np.ndarray  # [N] int8 half stars
    timestamps: np.ndarray  # [N] int64
    data_lines: int  # lines that are not the (line-1, csv) header
    bad: list[dict[str, Any]]  # quarantined rows


def _strip_bom(data: bytes) -> bytes:
    """``data`` without a leading UTF-8 byte-order mark (an editor's save): no byte of line 1, in any format."""
    return data[len(_BOM):] if data.startswith(_BOM) else data


def _parse_fast(data: bytes, fmt: MovieLensFormat) -> _Parsed | None:
    """Vectorised parse with pyarrow.csv. Returns None whenever anything is off (the slow path decides)."""
    data = _strip_bom(data)
    if data and not data.endswith(b"\n"):
        return None  # a possibly truncated last line: the strict parser reports it
    if fmt.header is not None:
        first, _, _ = data.partition(b"\n")
        if first.rstrip(b"\r") != fmt.header.encode():
            return None
    # Only the bytes a well-formed file can hold: pyarrow's converters are laxer than _parse_line
    # (they trim spaces and take "0x1", "4e0", "4.", ".5"); anything unusual goes to the strict parser.
    allowed = b"0123456789-\r\n" + fmt.delimiter[0].encode() + (b"." if fmt.half_stars else b"")
    body = data.partition(b"\n")[2] if fmt.header is not None else data
    if body.translate(None, allowed) or data.count(b"\r") != data.count(b"\r\n"):
        return None
    if fmt.half_stars and (b",." in body or b".," in body):
        return None
    names = ["u", "i", "r", "t"]
    delim, columns = fmt.delimiter, names
    if delim == "::":
        # Split on ":" (pyarrow takes one-byte delimiters): a good row has empty fields between the
        # pairs of colons; anything else (":::", a lone ":") changes the field count or fills a gap.
        delim, columns = ":", ["u", "_1", "i", "_2", "r", "_3", "t"]
    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=columns, skip_rows=1 if fmt.header else 0),
            parse_options=pacsv.ParseOptions(delimiter=delim, quote_char=False, double_quote=False,
                                             escape_char=False, newlines_in_values=False,
                                             ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types={"u": pa.int64(), "i": pa.int64(), "t": pa.int64(),
                              "r": pa.float64() if fmt.half_stars else pa.int64(),
                              **{c: pa.string() for c in columns if c not in names}},
                null_values=[], strings_can_be_null=False, quoted_strings_can_be_null=False),
        )
    except (pa.ArrowException, ValueError):
        return None
    if any(table.column(n).null_count for n in names):
        return None
    for gap in set(columns) - set(names):
        col = table.column(gap)
        if col.num_chunks and pc.max(pc.binary_length(col)).as_py() not in (None, 0):
            return None
    u, i, t = (table.column(n).to_numpy() for n in ("u", "i", "t"))
    r = table.column("r").to_numpy()
    if u.size and ((u < 1).any() or (u > MAX_ID).any() or (i < 1).any() or (i > MAX_ID).any()
                   or (t < 0).any()):
        return None
    if fmt.half_stars:
        r2 = r * 2.0
        if r.size and (not np.isfinite(r2).all() or (r2 != np.round(r2)).any() or (r2 < 1).any()
                       or (r2 > 10).any()):
            return None
        half = r2.astype(np.int8)
    else:
        if r.size and ((r < 1).any() or (r > 5).any()):
            return None
        half = (r * 2).astype(np.int8)
    # Lines the file holds: the csv reader would have rejected blank lines, so rows == data lines.
    return _Parsed(u.astype(np.int64), i.astype(np.int64), half, t.astype(np.int64), table.num_rows, [])


def _check_int(text: str, field: str, lo: int, hi: int, where: tuple[str, int]) -> int:
    if not _INT_RE.fullmatch(text):
        raise BadRowError(*where, field, "non_numeric", f"{text!r} is not an integer")
    v = int(text)
    if not lo <= v <= hi:
        raise BadRowError(*where, field, "out_of_range", f"{v} outside {lo}..{hi}")
    return v


def _parse_line(raw: bytes, lineno: int, fmt: MovieLensFormat, fname: str) -> tuple[int, int, int, int]:
    """Strict parse of one source line (without its newline). Raises BadRowError."""
    where = (fname, lineno)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as e:
        raise BadRowError(*where, "bytes", "encoding",
                          f"undecodable byte 0x{raw[e.start]:02x} at column {e.start + 1} "
                          f"(MovieLens ratings files are plain ASCII)") from None
    parts = text.split(fmt.delimiter)
    if (fmt.header is not None and text.strip().lower() == fmt.header.lower()) or (
            len(parts) > 1 and all(_HEADERISH_RE.fullmatch(p.strip()) for p in parts)):
        raise BadRowError(*where, "row", "header",
                          f"header line {text!r} "
                          + ("repeated after line 1" if fmt.header else f"not allowed in {fmt.filename}"))
    if len(parts) != 4:
        raise BadRowError(*where, "row", "field_count",
                          f"expected 4 fields separated by {fmt.delimiter!r}, got {len(parts)}: {text!r}")
    fu, fi, fr, ft = fmt.fields
    u = _check_int(parts[0], fu, 1, MAX_ID, where)
    i = _check_int(parts[1], fi, 1, MAX_ID, where)
    if fmt.half_stars:
        if not _DEC_RE.fullmatch(parts[2]):
            raise BadRowError(*where, fr, "non_numeric", f"{parts[2]!r} is not a number")
        r2 = float(parts[2]) * 2.0
        if r2 != round(r2) or not 1 <= r2 <= 10:
            raise BadRowError(*where, fr, "out_of_range", f"{parts[2]} is not one of 0.5, 1.0, ..., 5.0")
        r = int(r2)
    else:
        r = 2 * _check_int(parts[2], fr, 1, 5, where)
    t = _check_int(parts[3], ft, 0, _MAX_TS, where)
    return u, i, r, t


def _parse_slow(data: bytes, fmt: MovieLensFormat, fname: str, quarantine: bool) -> _Parsed:
    """Line-by-line strict parse; raises the first BadRowError, or collects bad rows when quarantining."""
    data = _strip_bom(data)
    us: list[int] = []
    it: list[int] = []
    rs: list[int] = []
    ts: list[int] = []
    bad: list[dict[str, Any]] = []
    data_lines = 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file's final newline
    # A last line without its newline is where a copy or download that stopped early ends: "6040::1::4::9787"
    # cut from "...::978765432" still parses, with a wrong timestamp. It is a bad row, not data.
    cut = len(lines) if data and not data.endswith(b"\n") else 0
    for lineno, raw in enumerate(lines, 1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if lineno == 1 and fmt.header is not None:
            if raw == fmt.header.encode():
                continue
            # A missing header is a bad first line, not silently data.
            err = BadRowError(fname, 1, "row", "header", f"line 1 must be the header {fmt.header!r}, got "
                              f"{raw.decode('ascii', 'backslashreplace')!r}")
            data_lines += 1
            if not quarantine:
                raise err
            bad.append(_bad_record(err, raw))
            continue
        data_lines += 1
        try:
            if lineno == cut:
                raise BadRowError(fname, lineno, "row", "truncated",
                                  f"the file ends inside this line (no final newline), so it may be cut short: "
                                  f"{raw.decode('ascii', 'backslashreplace')!r}; re-download the file, or add "
                                  f"the newline if the line is whole")
            u, i, r, t = _parse_line(raw, lineno, fmt, fname)
        except BadRowError as err:
            if not quarantine:
                raise
            bad.append(_bad_record(err, raw))
            continue
        us.append(u)
        it.append(i)
        rs.append(r)
        ts.append(t)
    return _Parsed(np.array(us, dtype=np.int64), np.array(it, dtype=np.int64), np.array(rs, dtype=np.int8),
                   np.array(ts, dtype=np.int64), data_lines, bad)


def _bad_record(err: BadRowError, raw: bytes) -> dict[str, Any]:
    return {"file": err.file, "line": err.line, "field": err.field, "reason": err.reason,
            "problem": err.problem, "raw": raw.decode("utf-8", "backslashreplace")}


# --------------------------------------------------------------------------------------------- writing

def _sha256_check(path: Path, digest: str) -> str:
    """'matched' / 'not listed' / 'no SHA256SUMS'; a mismatch raises ValueError naming the file."""
    sums = path.parent / "SHA256SUMS"
    if not sums.is_file():
        return "no SHA256SUMS"
    for n, line in enumerate(sums.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == path.name:
            if parts[0].lower() != digest:
                raise ValueError(f"{path}: sha256 {digest} does not match {parts[0]} listed in {sums}:{n}; "
                                 f"the file is corrupt or not the GroupLens original (to prepare an edited copy "
                                 f"anyway, remove {sums.name} from its folder)")
            return "matched"
    return "not listed"


def write_run_file(folder: Path, run: dict[str, Any]) -> None:
    """Write ``folder/prepare_run.json`` (:data:`~pipelines.schema.RUN_FILE`): the run-time facts of one
    preparation (``created_unix``, ``seconds``, ...), kept out of manifest.json so that two preparations of
    the same source give identical manifests. Durable (fsynced) like the manifest."""
    with open(folder / RUN_FILE, "w", encoding="utf-8") as f:
        json.dump(run, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _list_array(offsets: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), pa.array(values, typ))


def prepare_movielens(src: str | Path, out: str | Path, *, on_bad_rows: str = "error", num_files: int = 8,
                      row_groups_per_file: int = ROW_GROUPS_PER_FILE,
                      num_files_name: str = "--num-files") -> dict[str, Any]:
    """Convert a MovieLens ratings file to per-user history Parquet; returns the manifest (also written).

    src: folder holding exactly one of ratings.dat (ML-1M), u.data (ML-100K), ratings.csv
        (ml-latest-small), or that file itself. If the folder has a ``SHA256SUMS`` file listing it, the
        checksum must match (ValueError naming the file otherwise).
    out: output folder (a symlink: the folder it points to), built in a temp folder next to it, fsynced, then
        renamed into place; an existing prepared folder (a gemray manifest.json and only the files it lists) is
        replaced (with a logged warning naming the old data when it came from another source file); any other
        non-empty folder, one holding files its manifest does not list, or one holding the source, is refused.
    on_bad_rows: "error" raises :class:`BadRowError` (a ValueError: ``<file>:<line>: field <name>:
        <problem>``) at the first bad row; "quarantine" writes each bad row to ``quarantine.jsonl``
        ({file, line, field, reason, problem, raw}) and counts them by reason in the manifest.
    num_files: history files (users split into contiguous user-id ranges; capped at the user count, logged at
        INFO when it is); num_files_name: where it came from, for that line and its refusal (``data.num_files``
        when a config's).
    row_groups_per_file: Parquet row groups per file; each row group is one logical shard for
        :func:`gemray.pipelines.shards.assign_shards`.

    Output layout and units: see :mod:`gemray.pipelines.schema` (ratings in half stars, int8; item ids
    dense 1..num_items in ascending raw-id order). Raises ValueError for bad arguments or when no valid
    row is left, FileNotFoundError for a missing source.
    """
    t0 = time.perf_counter()
    if on_bad_rows not in ("error", "quarantine"):
        raise ValueError(f"on_bad_rows: expected 'error' or 'quarantine', got {on_bad_rows!r}")
    check_num_files(num_files, num_files_name)
    if row_groups_per_file < 1:
        raise ValueError(f"row_groups_per_file: expected >= 1, got {row_groups_per_file}")
    fmt, path = detect_format(src)
    out = Path(out)
    if out.is_symlink():  # replace the folder it points to, not the link
        out = out.resolve()
    prev_manifest = check_replaceable(out, [(path, str(path))])

    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    sha_status = _sha256_check(path, digest)
    quarantine = on_bad_rows == "quarantine"
    parsed = _parse_fast(data, fmt)
    fast = parsed is not None
    if parsed is None:
        parsed = _parse_slow(data, fmt, str(path), quarantine)
    del data
    n_rows = int(parsed.users.size)
    if n_rows + len(parsed.bad) != parsed.data_lines:  # invariant: nothing silently dropped
        raise AssertionError(f"{path}: {parsed.data_lines} data lines != {n_rows} rows + {len(parsed.bad)} bad")
    if n_rows == 0:
        why = f"{len(parsed.bad)} bad rows quarantined" if parsed.bad else "the file holds no data rows"
        raise ValueError(f"{path}: no valid rating rows ({why})")

    # Sort by (user, timestamp), stable: equal timestamps keep file order.
    order = np.lexsort((parsed.timestamps, parsed.users))  # lexsort is stable
    users = parsed.users[order]
    raw_items = parsed.items[order]
    ratings = parsed.ratings[order]
    stamps = parsed.timestamps[order]
    item_vocab, inverse = np.unique(raw_items, return_inverse=True)
    dense = inverse.reshape(-1).astype(np.int64) + 1
    user_ids, user_start, user_len = np.unique(users, return_index=True, return_counts=True)
    n_users = int(user_ids.size)
    # Rows that repeat a (user, item) pair: kept (each is an interaction in the history), but counted and
    # reported, since the published MovieLens files hold one rating per pair (a repeat usually means an
    # edited or concatenated file).
    pair = users.astype(np.int64) * (int(dense.max()) + 1) + dense
    repeated_pairs = n_rows - int(np.unique(pair).size)
    offsets = np.concatenate([user_start, [n_rows]]).astype(np.int64)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / HISTORIES_DIR).mkdir(parents=True)
        files, shards = [], []
        n_files = min(num_files, n_users)
        log_capped_files(log, out, n_files, num_files, n_users, num_files_name)
        for k, rows in enumerate(np.array_split(np.arange(n_users), n_files)):
            a, b = int(rows[0]), int(rows[-1]) + 1
            lo, hi = int(offsets[a]), int(offsets[b])
            o = offsets[a:b + 1] - lo
            table = pa.Table.from_arrays([
                pa.array(user_ids[a:b], pa.int64()),
                _list_array(o, dense[lo:hi], pa.int64()),
                _list_array(o, ratings[lo:hi], pa.int8()),
                _list_array(o, stamps[lo:hi], pa.int64()),
            ], schema=HISTORY_SCHEMA)
            rel = f"{HISTORIES_DIR}/part-{k:05d}.parquet"
            rg_rows = -(-(b - a) // row_groups_per_file)
            pq.write_table(table, tmp / rel, row_group_size=rg_rows)
            _fsync_path(tmp / rel)
            lens = user_len[a:b]
            for g, s in enumerate(range(0, b - a, rg_rows)):
                gl = lens[s:s + rg_rows]
                shards.append({
                    "index": len(shards), "file": rel, "row_group": g, "rows": int(gl.size),
                    "tokens": int(gl.sum()), "first_user_id": int(user_ids[a + s]),
                    "last_user_id": int(user_ids[a + s + gl.size - 1]),
                    "split_users": int((gl >= MIN_HISTORY_FOR_SPLITS).sum()),
                })
            files.append({"path": rel, "rows": b - a, "tokens": hi - lo, "sha256": _file_sha256(tmp / rel),
                          "row_groups": pq.ParquetFile(tmp / rel).num_row_groups,
                          "first_user_id": int(user_ids[a]), "last_user_id": int(user_ids[b - 1])})
            if files[-1]["row_groups"] != sum(1 for s in shards if s["file"] == rel):
                raise AssertionError(f"{rel}: row groups written differ from the shard plan")

        items = pa.Table.from_arrays([pa.array(np.arange(1, item_vocab.size + 1), pa.int64()),
                                      pa.array(item_vocab, pa.int64())], schema=ITEMS_SCHEMA)
        pq.write_table(items, tmp / ITEMS_FILE)
        _fsync_path(tmp / ITEMS_FILE)

        reasons: dict[str, int] = {}
        if quarantine:
            with open(tmp / QUARANTINE_FILE, "w", encoding="utf-8") as f:
                for rec in parsed.bad:
                    reasons[rec["reason"]] = reasons.get(rec["reason"], 0) + 1
                    f.write(json.dumps(rec, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())

        from importlib.metadata import version  # the installed gemray's (the gemray package sits above pipelines)
        too_short = int((user_len < MIN_HISTORY_FOR_SPLITS).sum())
        manifest: dict[str, Any] = {
            "manifest_version": MANIFEST_VERSION,
            "gemray_version": version("gemray"),
            "format": fmt.name,
            "on_bad_rows": on_bad_rows,
            "source": {"dir": str(path.parent.resolve()), "files": [{
                "name": path.name, "sha256": digest, "bytes": path.stat().st_size,
                "sha256sums": sha_status}]},
            "counts": {"users": n_users, "items": int(item_vocab.size), "interactions": n_rows,
                       "source_data_lines": parsed.data_lines, "quarantined": len(parsed.bad),
                       "repeated_user_item_rows": repeated_pairs,
                       "rows_per_file": [f["rows"] for f in files],
                       "tokens_per_file": [f["tokens"] for f in files]},
            "vocab": {"num_items": int(item_vocab.size), "max_item_id": int(item_vocab.size),
                      "max_raw_item_id": int(item_vocab[-1]), "max_user_id": int(user_ids[-1]),
                      "rating_unit": "half-star (int8, stars*2)",
                      "rating_values": [int(v) for v in np.unique(ratings)]},
            "history_length": {"min": int(user_len.min()), "median": float(np.median(user_len)),
                               "max": int(user_len.max())},
            "splits": {"protocol": SPLIT_PROTOCOL, "min_history": MIN_HISTORY_FOR_SPLITS,
                       "users": n_users - too_short, "too_short_users": too_short},
            "quarantine": {"file": QUARANTINE_FILE if quarantine else None, "total": len(parsed.bad),
                           "by_reason": dict(sorted(reasons.items()))},
            "files": files,
            "items_file": ITEMS_FILE,
            "items_sha256": _file_sha256(tmp / ITEMS_FILE),
            "shards": shards,
            "conversion": {"parser": "pyarrow.csv" if fast else "python-strict"},
            "run_file": RUN_FILE,
        }
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        write_run_file(tmp, {"created_unix": int(time.time()), "seconds": round(time.perf_counter() - t0, 3)})
        for d in (tmp / HISTORIES_DIR, tmp):
            _fsync_path(d)

        warn_if_replacing(out, prev_manifest, manifest)
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    warn_if_no_split_users(log, out, manifest)
    log.debug("%s", format_summary(manifest, out))  # the CLI prints it; callers get the manifest
    return manifest


def check_replaceable(out: Path, sources: list[tuple[Path, str]]) -> dict[str, Any] | None:
    """Refuse (ValueError naming the folder and what is in the way) to prepare into ``out`` unless replacing it
    loses nothing but an earlier preparation: ``out`` is missing or empty, or holds a gemray manifest and only the
    files that manifest lists (:func:`listed_files`: histories, items, quarantine, id maps, the run file). A
    folder with other files (notes, a source copy, another program's manifest.json) is refused, as is an ``out``
    that contains one of the local ``sources`` ((path, name to show) pairs). Used by every ``prepare`` command.
    An ``out`` that cannot be created there is refused too (:func:`check_creatable`), before any work.
    Returns the manifest of the preparation that will be replaced, or None (nothing to replace)."""
    out_abs = out.resolve()
    for src, shown in sources:
        src_abs = src.resolve()
        if out_abs == src_abs or out_abs in src_abs.parents:
            raise ValueError(f"{out}: holds the source {shown}; replacing it would delete the source: choose "
                             "another --out")
    check_creatable(out)
    if not out.exists():
        return None
    if not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder; refusing to replace it")
    if not any(out.iterdir()):
        return None
    refuse = f"{out}: exists and is not a prepared gemray folder"
    if not (out / MANIFEST_FILE).is_file():
        raise ValueError(f"{refuse} (no {MANIFEST_FILE}); refusing to replace it")
    try:
        prev = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
        listed = set(listed_files(prev))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{refuse} (its {MANIFEST_FILE} is not a gemray manifest); refusing to replace it") from None
    listed |= {str(Path(p).parent) for p in listed} - {"."} | {HISTORIES_DIR}
    extra = sorted(str(p.relative_to(out)) for p in out.rglob("*") if str(p.relative_to(out)) not in listed)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"{out}: holds files its {MANIFEST_FILE} does not list ({', '.join(extra[:5])}{more}); "
                         "replacing the folder would delete them: move them out or choose another --out")
    return prev


def check_creatable(out: Path) -> None:
    """Refuse (ValueError naming ``out``, the folder in the way and why) an ``out`` that this process
    cannot create or replace: the preparation is written to a temporary sibling folder of ``out`` and renamed into place,
    so the nearest existing folder on ``out``'s path (its parent, or an ancestor that the preparation creates
    the missing folders below) must accept a new folder. Probed with a temporary folder removed at once
    (``os.access`` says yes to root on a read-only mount); without it the failure came after the source was
    parsed, as an errno line naming the internal temporary folder."""
    import tempfile

    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{out}: cannot create it: {parent} is not a folder; choose another --out")
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".gemray-write-probe-"))
    except OSError as e:
        raise ValueError(f"{out}: cannot create it: {parent} does not accept a new folder "
                         f"({e.strerror or e}); choose another --out") from e


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """Every file a prepared folder's manifest accounts for (MovieLens, interactions or synthetic). Raises
    KeyError for a dict that is not a gemray manifest."""
    if "manifest_version" not in manifest:
        raise KeyError("manifest_version")
    listed = [f["path"] for f in manifest["files"]] + [manifest.get("items_file", ITEMS_FILE), MANIFEST_FILE]
    if (manifest.get("quarantine") or {}).get("file"):
        listed.append(manifest["quarantine"]["file"])
    maps = manifest.get("id_maps") or {}
    listed += [maps[k] for k in ("users", "items") if k in maps]
    listed += list((maps.get("features") or {}).values())
    if manifest.get("run_file"):
        listed.append(manifest["run_file"])
    return [str(Path(p)) for p in listed]


def swap_into_place(tmp: Path, out: Path) -> None:
    """Make the finished preparation ``tmp`` (a sibling folder of ``out``, fsynced) the folder ``out``: the old
    ``out`` is renamed aside, ``tmp`` renamed into place, the parent fsynced, then the old folder deleted -- a
    reader sees the old preparation or the new one, never a mix."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def data_identity(manifest: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a prepared folder holds, for telling one dataset from another: (format, synthetic parameters' sha256)
    for ``prepare synthetic``, else (format, its source files' (name, sha256) pairs, sorted); None for a manifest
    that names no source."""
    try:
        src = manifest["source"]
        if src.get("params_sha256"):
            return manifest["format"], src["params_sha256"]
        return manifest["format"], tuple(sorted((f["name"], f["sha256"]) for f in src["files"]))
    except (KeyError, TypeError, AttributeError):
        return None


def describe_data(manifest: dict[str, Any]) -> str:
    """``manifest``'s data in a few words for a log line: format, first source file (and how many more),
    interaction count and sha256 prefix; seed and parameters' sha256 prefix for synthetic data."""
    fmt = manifest.get("format", "unknown") if isinstance(manifest, dict) else "unknown"
    if data_identity(manifest) is None:
        return f"a prepared folder of {fmt} data whose manifest names no source"
    src = manifest["source"]
    count = manifest.get("counts", {}).get("interactions")
    count = f"{count} interactions, " if count is not None else ""
    if src.get("params_sha256"):
        return f"{fmt} data ({count}seed {src.get('seed', '?')}, parameters sha256 {src['params_sha256'][:12]}...)"
    if not src["files"]:
        return f"{fmt} data from no source file"
    first = src["files"][0]
    more = f" and {len(src['files']) - 1} more files" if len(src["files"]) > 1 else ""
    return f"{fmt} data from {first['name']}{more} ({count}sha256 {first['sha256'][:12]}...)"


def warn_if_replacing(out: Path, prev: dict[str, Any] | None, new: dict[str, Any],
                      logger: logging.Logger = log) -> None:
    """Log a warning when the prepared folder ``out`` about to be replaced (its manifest ``prev``, as
    :func:`check_replaceable` returned it; None: nothing to replace) holds other data than ``new`` (a manifest, or
    the part of one that :func:`data_identity` reads): re-preparing the same data into a folder is quiet,
    silently swapping one dataset for another under a training run's configured path is not. Used by every
    ``prepare`` command, each with its own ``logger``."""
    was = None if prev is None else data_identity(prev)
    if prev is None or (was is not None and was == data_identity(new)):
        return
    logger.warning("%s: replacing %s with %s; checkpoints of the old data will not resume on it", out,
                   describe_data(prev), describe_data(new))


def format_summary(manifest: dict[str, Any], out: str | Path | None = None) -> str:
    """One-paragraph human summary of a prepare run (what the CLI prints), incl. the quarantine count."""
    c, q, s = manifest["counts"], manifest["quarantine"], manifest["splits"]
    where = f" -> {out}" if out is not None else ""
    text = (f"prepared {manifest['format']}{where}: {c['users']} users, {c['items']} items, "
            f"{c['interactions']} interactions in {len(manifest['files'])} files; "
            f"{s['users']} users in the splits, {s['too_short_users']} too short (< {s['min_history']}); "
            f"{q['total']} bad rows quarantined")
    if q["by_reason"]:
        text += " (" + ", ".join(f"{k}: {v}" for k, v in q["by_reason"].items()) + f"; see {q['file']})"
    if c.get("repeated_user_item_rows"):
        text += (f"; {c['repeated_user_item_rows']} rows repeat the (user, item) pair of another row (kept as "
                 "interactions; the published MovieLens files have none)")
    return text


def raw_folder_error(folder: str | Path, option: str, pass_as: str | None = None) -> str | None:
    """The error for a folder of raw MovieLens ratings (ratings.dat, u.data or ratings.csv and no
    manifest.json) given where prepared data is expected, or None for any other folder. ``option`` names where
    it was given (``--data``, ``data.prepared_dir``), ``pass_as`` how to give the prepared folder instead
    (``{option}``, ``{out}`` and ``{src}``, the raw folder, are filled in; default ``"{option} {out}"``). The
    message gives the ``gemray prepare movielens`` command that prepares it into a folder of its own,
    ``data/<folder name>`` under the working directory (``data/<name>-prepared`` when that is the raw folder
    itself; never beside it: the raw data may sit in a read-only shared tree such as ../shared/data/ml-1m). Used
    by ``gemray evaluate`` / ``recommend`` (--data) and ``gemray train`` / ``fit`` (data.prepared_dir)."""
    d = Path(folder).expanduser()
    raw = [f.filename for f in FORMATS.values() if (d / f.filename).is_file()]
    if not raw or (d / MANIFEST_FILE).is_file():
        return None
    out = Path("data") / d.resolve().name
    if out.resolve() == d.resolve():
        out = out.with_name(f"{out.name}-prepared")
    then = (pass_as or "{option} {out}").format(option=option, out=out, src=d)
    return (f"{option} {folder} holds raw MovieLens ratings ({', '.join(raw)}), not prepared data ({MANIFEST_FILE} "
            f"and Parquet histories); prepare it into a folder of its own with `gemray prepare movielens --src {d} "
            f"--out {out}` and pass {then}")


#: The ``format`` of a manifest written by ``gemray prepare interactions`` (its Amazon inputs keep their own name:
#: ``amazon-ratings`` / ``amazon-seq``) and by ``gemray prepare synthetic``.
INTERACTIONS_FORMATS = ("interactions", "amazon-ratings", "amazon-seq")
SYNTHETIC_FORMAT = "synthetic"


def prepared_format(prepared_dir: str | Path) -> str | None:
    """The manifest ``format`` of the prepared folder ``prepared_dir`` -- which ``gemray prepare`` made it -- read
    from its manifest.json, or from what is left of it when that is damaged: the ``"format"`` entry of an unreadable
    (e.g. truncated) manifest's text, else the folder's files (``users.parquet``: ``prepare interactions``; history
    files with candidate columns: ``prepare synthetic``). None when none tells (no folder, an empty one, a MovieLens
    folder without its manifest)."""
    d = Path(prepared_dir)
    try:
        text = (d / MANIFEST_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    try:
        fmt = json.loads(text).get("format") if text else None
    except (ValueError, AttributeError):
        m = re.search(r'"format"\s*:\s*"([^"]+)"', text)
        fmt = m.group(1) if m else None
    if isinstance(fmt, str):
        return fmt
    if (d / "users.parquet").is_file():  # interactions.USERS_FILE (its raw user ids): no other preparation has one
        return INTERACTIONS_FORMATS[0]
    for part in sorted((d / HISTORIES_DIR).glob("*.parquet")) if (d / HISTORIES_DIR).is_dir() else []:
        try:
            names = pq.read_schema(part).names
        except Exception:  # noqa: BLE001 - a damaged file tells nothing; the next may
            continue
        return SYNTHETIC_FORMAT if CANDIDATE_ITEMS in names else None
    return None


def remake_hint(prepared_dir: str | Path, fmt: str | None, manifest: dict[str, Any] | None = None, *,
                again: bool = False) -> str:
    """Pure: how to prepare ``prepared_dir`` (again, with ``again``: its files are damaged) with the command that
    made data of its format ``fmt`` (:func:`prepared_format`; None: unknown, MovieLens assumed, the data
    ``gemray train`` prepares itself): ``gemray prepare interactions --src ...`` (its recorded sources from
    ``manifest`` where known), ``gemray prepare synthetic --out ... --users U --items N --seed S`` (its recorded
    parameters), or ``gemray prepare movielens``. Was: advice to run ``prepare movielens`` whatever had made it."""
    d = Path(prepared_dir)
    src = (manifest or {}).get("source") if isinstance(manifest, dict) else None
    src = src if isinstance(src, dict) else {}
    if fmt in INTERACTIONS_FORMATS:
        uris = [u for u in src.get("uris") or [] if isinstance(u, str)]
        given = " ".join(f"--src {u}" for u in uris) if uris else "--src <your interaction files>"
        how = f"`gemray prepare interactions {given} --out {d}` with the options it was prepared with"
        return (f"prepare it again ({how}; `gemray train` does not make it from data.raw_dir)" if again
                else f"run {how} first")
    if fmt == SYNTHETIC_FORMAT:
        params = src.get("params") if isinstance(src.get("params"), dict) else {}
        flags = " ".join(f"--{k} {params[k]}" if k in params else f"--{k} {v}"
                         for k, v in (("users", "U"), ("items", "N"), ("seed", "S")))
        how = f"`gemray prepare synthetic --out {d} {flags}` with the other parameters it was made with"
        if again:
            return f"prepare it again ({how}, or delete {d}: `gemray train` generates it from data.synthetic)"
        return f"run {how} first"
    how = f"`gemray prepare movielens --src <MovieLens folder> --out {d}`"
    if again:
        return f"prepare it again ({how}, or delete {d}: `gemray train` prepares it from data.raw_dir)"
    return f"run {how} first"


def load_manifest(prepared_dir: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """Read ``<prepared_dir>/manifest.json`` and check that every file it lists exists. With ``verify``
    (``gemray train`` / ``fit`` before Ray starts: once per run, it reads every byte) also that each Parquet
    file (histories, items) has the sha256 recorded when it was prepared (manifests that record none: not
    checked), a readable footer and the recorded row / row-group counts, so a damaged folder is refused
    before any worker reads it.

    Returns the manifest dict (with ``"prepared_dir"`` set to the resolved folder). Raises
    FileNotFoundError when the folder, the manifest or a listed file is missing, ValueError for an unreadable or
    newer-version manifest or a file that is not what was prepared (naming it); each says which command prepares
    the folder again, the one that made data of its format (:func:`remake_hint`, :func:`prepared_format`).
    """
    d = Path(prepared_dir)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        fmt = prepared_format(d)
        what = "not a prepared data folder" if fmt is None else f"its {fmt} data is not usable without it"
        raise FileNotFoundError(f"{d}: no {MANIFEST_FILE}, {what}; {remake_hint(d, fmt, again=fmt is not None)}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath}: unreadable manifest ({e}); {remake_hint(d, prepared_format(d), again=True)}"
                         ) from None
    hint = remake_hint(d, manifest.get("format") if isinstance(manifest, dict) else None,
                       manifest if isinstance(manifest, dict) else None, again=True)
    version = manifest.get("manifest_version")
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise ValueError(f"{mpath}: manifest_version {version!r} not supported (this gemray reads "
                         f"<= {MANIFEST_VERSION}); {hint}")
    for key in ("files", "shards", "counts", "splits"):
        if key not in manifest:
            raise ValueError(f"{mpath}: missing key {key!r}; {hint}")
    listed = [f["path"] for f in manifest["files"]] + [manifest.get("items_file", ITEMS_FILE)]
    if manifest.get("quarantine", {}).get("file"):
        listed.append(manifest["quarantine"]["file"])
    for rel in listed:
        if not (d / rel).is_file():
            raise FileNotFoundError(f"{d}: manifest lists {rel} but it is missing; {hint}")
    items_rel = manifest.get("items_file", ITEMS_FILE)
    checks = [(f["path"], f.get("sha256"), f.get("rows"), f.get("row_groups")) for f in manifest["files"]]
    if not verify:
        checks = []
    checks.append((items_rel, manifest.get("items_sha256"), manifest.get("counts", {}).get("items"), None))
    for rel, digest, rows, row_groups in checks:
        _verify_parquet(d / rel, digest, rows, row_groups, hint)
    manifest["prepared_dir"] = str(d.resolve())
    return manifest


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify_parquet(path: Path, digest: str | None, rows: int | None, row_groups: int | None, hint: str) -> None:
    """A prepared Parquet file is what prepare_movielens wrote: its sha256 where the manifest records one
    (manifests from before it did: not checked), a readable footer, and the manifest's row and row-group
    counts. Raises ValueError naming the file and what differs."""
    if digest is not None and _file_sha256(path) != digest:
        raise ValueError(f"{path}: sha256 differs from the one manifest.json recorded when it was prepared (the "
                         f"file was changed or damaged); {hint}")
    try:
        meta = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e}); {hint}") from None
    if rows is not None and meta.num_rows != rows:
        raise ValueError(f"{path}: {meta.num_rows} rows, manifest.json says {rows}; {hint}")
    if row_groups is not None and meta.num_row_groups != row_groups:
        raise ValueError(f"{path}: {meta.num_row_groups} row groups, manifest.json says {row_groups}; {hint}")
