"""Users' own interaction logs -> per-user history Parquet (+ id maps + manifest), out of core and atomically.

    gemray prepare interactions --src PATH|GLOB|URI [--src ...] --out DIR \\
        [--format auto|parquet|csv|amazon-ratings|amazon-seq] \\
        [--user-col C] [--item-col C] [--time-col C] [--rating-col C] [--feature-cols C1,C2] \\
        [--id-type auto|string|int] [--time-unit s|ms|us|ns] [--delimiter C] [--k-core K] \\
        [--on-bad-rows error|quarantine] [--num-files N] [--memory-budget 1GiB] [--workers N]

Input: Parquet or CSV files (optionally .gz / .bz2 / .zst / .lz4 compressed CSV), or the two Amazon layouts of
:mod:`gemray.pipelines.amazon`; one or more ``--src``, each a file, a folder (every file below it whose name
does not start with ``.`` or ``_``; with ``--format auto`` only ``*.parquet`` / ``*.pq`` / ``*.csv`` / ``*.tsv``,
possibly compressed), a glob (``*``, ``?``, ``[...]``, ``**`` for any depth; names starting with ``.`` or ``_``
are skipped, as in a folder) or a URI: every scheme of
``pyarrow.fs`` (``file://``, ``s3://``, ``gs://``, ``hdfs://``; options in the query string as pyarrow reads
them) and, for the other schemes, every fsspec filesystem that is installed (``memory://``, ``http(s)://``, ...).
Files are read in ascending path order, whatever order the shell or the object store lists them in.

Output (the layout of :mod:`gemray.pipelines.schema`, which ``pipelines/stream.py`` streams unchanged)::

    <out>/manifest.json            content only: two preparations of the same input compare equal byte for byte
    <out>/prepare_run.json         run-time facts (when, how long, memory budget, workers, peak RSS); not content
    <out>/histories/part-*.parquet HISTORY_SCHEMA's four columns, then one list<int64> ``feat_<name>`` column per
                                   --feature-cols column, aligned with item_ids (dense ids 1..C_name, 0 = missing)
    <out>/items.parquet            item_id int64 (dense 1..N), raw_item_id (int64 or string, as the input)
    <out>/users.parquet            user_id int64 (dense 1..U), raw_user_id (int64 or string)
    <out>/features/<name>.parquet  id int64 (dense 1..C_name), raw (int64 or string)
    <out>/quarantine.jsonl         only with --on-bad-rows quarantine

Units: ``ratings`` in half stars (int8, ``round(stars * 2)``, 0..10) as for MovieLens; the rating column holds
stars 0..5 in steps of 0.5; no rating column, or a null rating: 0. ``timestamps``: unix seconds (int64,
>= 0): integer or decimal columns are taken in ``--time-unit`` (floored to seconds), Parquet timestamp / date
columns are converted, strings are integers / decimals or ISO 8601 (``2024-01-31``, ``2024-01-31 12:00:00``,
``...T12:00:00Z``, ``...+02:00``; without a zone: UTC). A number that comes out at or past 2200 in
``--time-unit`` is a bad row (``out_of_range``) whose message names the unit it most likely is (milliseconds
read as seconds: around the year 55,000) and the ``--time-unit`` to pass. When most numbers in a ``--time-unit``
other than ``s`` come out before 1990 (seconds read as milliseconds: January 1970), the rows are kept as read
but a WARNING (and the summary, beside the dates) names an example row and the unit they likely are
(:func:`time_unit_warning`). The manifest records the times' range (``time_range``: ISO 8601 UTC and unix
seconds; the summary prints its dates). ``amazon-seq`` files carry no times: the position in the user's
sequence (0, 1, ...) is the timestamp (``manifest["time_unit"] == "position"``, ``time_range`` null).

Ids. Raw ids are integers or strings (CSV: always the exact text unless ``--id-type int``; Parquet: the column's
type; ``--id-type string`` turns integer columns into their decimal text). Dense ids, in a fixed, documented
order that does not depend on how the input is split into files, on the memory budget or on the workers:

- items: 1..N in ascending raw id order (numeric for integer ids, UTF-8 byte order for strings), as MovieLens;
- feature values: 1..C in ascending raw value order, 0 = missing (null or empty);
- users: 1..U in ascending order of ``(hash_ids(raw user id), raw user id)`` (:func:`hash_ids`: splitmix64 of an
  integer id, FNV-1a of a string id's UTF-8 bytes then splitmix64). Hash order is what lets the conversion
  group each user's rows without a global sort (users are partitioned by hash range), and it spreads users of
  every kind evenly over the history files and shards. ``users.parquet`` maps them back.

Each history is sorted by timestamp, stable: equal timestamps keep input order (files by path, rows by
position). Rows that repeat the (user, item) pair of another row are kept, each an interaction, as by
``prepare movielens``; the manifest counts them (``counts.repeated_user_item_rows``; ``exact_duplicate_rows``:
those with the same timestamp too) and the summary names both. ``--k-core K`` keeps, iteratively until
nothing changes, only users and items with at least K interactions (the "5-core" of the Amazon literature:
``--k-core 5``); what it removed is counted in the manifest (``k_core``). Users with fewer than 3
interactions stay in the files but are outside the splits.

Bad rows: a row whose user, item or time is missing or cannot be converted, whose rating is not a star value,
a CSV line with the wrong number of fields, bytes that are not UTF-8 -> ``--on-bad-rows error`` (default):
:class:`~gemray.pipelines.schema.BadRowError` naming file, line (CSV / text: 1-based line in the file, header
included; Parquet: 1-based row) and field; ``quarantine``: the row goes to ``quarantine.jsonl`` and is counted
by reason in the manifest (``source_rows == good rows + quarantined``). Bad input as a whole (a missing
column, an id column that is integer in one file and text in another, a type that cannot be an id, a source
that does not exist or cannot be reached) raises :class:`InputError` (a ValueError) naming the file and the
column; a CSV header that lacks a column and reads as one column holding ``;``, a tab, ``|`` or ``,`` names that
separator and the ``--delimiter`` to pass, one that reads as data says the file has no header row
(:func:`header_hint`). Nothing is written to ``--out`` until everything succeeded: the output is built in a temporary folder
beside it, fsynced, and renamed into place.

Memory and parallelism: ``--memory-budget`` (default 1 GiB, at least 256 MiB) bounds the peak RSS of the
process(es) whatever the input size: each process is allowed :data:`PROCESS_BASELINE` (~176 MiB: interpreter,
numpy, pyarrow, allocator slack) and the rest sizes the working set. Pass 1 reads every file in blocks of
whole lines (CSV: ``pyarrow.csv`` on each block, ~work/64; Parquet: ``ParquetFile.iter_batches``), converts
and checks the rows, and appends them to spill files partitioned by the hash range of their user (Arrow IPC,
in the temporary folder: about 1.3x the CSV's size on disk). Pass 2 reads one partition at a time (~work/8;
one that came out larger is split again by hash range first), sorts it by (user hash, user, time, input
position) and encodes it; ``--k-core`` repeats a cheap pass over the encoded partitions; pass 3 writes the
history files one row group at a time (~256k interactions by default, planned from the counts alone). The
item and feature vocabularies stay in memory (~30 bytes per distinct value plus its text): their size follows
the catalogue, not the number of interactions. ``--workers N`` runs passes 1 (files) and 2 (partitions) in N
spawned processes; the result is identical for every N and budget (tested byte for byte; BENCHMARKS.md: 20M
rows on 2 cores, 224 MiB peak at a 256 MiB budget).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import difflib
import fnmatch
import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import resource
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.ipc as paipc
import pyarrow.parquet as pq

from gemray.config import check_num_files

from . import amazon
from .movielens import _file_sha256, _fsync_path, check_replaceable, swap_into_place, warn_if_replacing
from .schema import (log_capped_files, FEATURE_NAME_RE, HISTORIES_DIR, HISTORY_SCHEMA, ITEMS_FILE, MANIFEST_FILE,
                     MANIFEST_VERSION, MIN_HISTORY_FOR_SPLITS, QUARANTINE_FILE, SPLIT_PROTOCOL, BadRowError,
                     warn_if_no_split_users)

log = logging.getLogger(__name__)

__all__ = ["InputError", "prepare_interactions", "hash_ids", "parse_memory_budget", "format_summary",
           "FORMATS", "USERS_FILE", "FEATURES_DIR", "RUN_FILE", "FEATURE_PREFIX"]

# Defined here rather than in schema.py (another branch adds constants there); the integrator may move them.
USERS_FILE = "users.parquet"
FEATURES_DIR = "features"
RUN_FILE = "prepare_run.json"
FEATURE_PREFIX = "feat_"
FORMATS = ("auto", "parquet", "csv", *amazon.FORMATS)
ID_TYPES = ("auto", "string", "int")
TIME_UNITS = {"s": 1, "ms": 1000, "us": 10**6, "ns": 10**9}
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
#: 2200-01-01T00:00:00Z in unix seconds. A number in --time-unit at or past it is a bad row (``out_of_range``)
#: whose message names the unit it most likely is: milliseconds read as seconds land ~54,000 years ahead.
MAX_UNIX_SECONDS = 7258118400
#: 1990-01-01T00:00:00Z in unix seconds. When most numbers in a --time-unit other than s come out before it, the
#: unit is likely too fine (seconds read as milliseconds land in January 1970): a warning (:func:`time_unit_warning`)
#: naming the likely unit, not an error (logs this old exist).
MIN_PLAUSIBLE_UNIX_SECONDS = 631152000
_SECONDS_PER_YEAR = 31556952  # the mean Gregorian year
_YEAR_10000 = 253402300800  # 10000-01-01T00:00:00Z: datetime's limit
DEFAULT_MEMORY_BUDGET = "1GiB"
MIN_MEMORY_BUDGET = 256 << 20
#: Memory every process needs before it holds any rows (interpreter, numpy, pyarrow, allocator slack; measured
#: ~80 MiB after imports, ~150-170 MiB once pyarrow and numpy have run): not part of the working set.
PROCESS_BASELINE = 176 << 20
MIN_WORK_BYTES = 48 << 20
ROW_GROUPS_PER_FILE = 4
DEFAULT_NUM_FILES = 8
TOKENS_PER_FILE_AUTO = 1 << 20  # --num-files 0 (auto): max(8, ceil(interactions / 1Mi)); row groups of ~256k tokens

_FILE_SHIFT = 40  # input position = file index << 40 | row (or token) number in the file
_EXT_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv"}
_COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
_INT_RE = r"^-?[0-9]+$"
_DEC_RE = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


class InputError(ValueError):
    """Bad input as a whole (not one row): a missing column, mixed id types across files, an unusable column
    type, a source that does not exist or cannot be reached. The message names the file and the column."""


# ------------------------------------------------------------------------------------------------ sizes

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*", re.IGNORECASE)


def parse_memory_budget(text: str | int) -> int:
    """``"1GiB"``, ``"512M"``, ``"2.5GB"``, ``"800MiB"`` or a byte count -> bytes (K/M/G/T are powers of 1024
    with or without ``i``/``B``). Raises ValueError for anything else or a budget under 256 MiB."""
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise ValueError(f"--memory-budget {text!r}: expected a size such as 512MiB, 1GiB or 2G")
        n = int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))
    if n < MIN_MEMORY_BUDGET:
        raise ValueError(f"--memory-budget {text!r}: at least {MIN_MEMORY_BUDGET >> 20} MiB")
    return n


def _bound_allocators() -> None:
    """Keep freed memory from piling up in this process: glibc raises its mmap threshold after a large free (up
    to 32 MiB), after which numpy's big temporaries come from the heap and fragment it (measured: +100 MiB RSS
    over 6M rows); a fixed 128 KiB threshold gives them back at once. Arrow's pool is asked to return cached
    pages at each spill flush (``_release``)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (setting it also turns off the dynamic adjustment)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _release() -> None:
    """Return memory Arrow's allocator keeps cached (mimalloc / jemalloc) to the OS, and trim glibc's heap."""
    pa.default_memory_pool().release_unused()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss() -> dict[str, int]:
    """Peak resident set size of this process (VmHWM) and of its largest finished child, in bytes."""
    own = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                own = int(line.split()[1]) * 1024
    except OSError:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"self": own, "largest_child": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


# ------------------------------------------------------------------------------------------------ hashing

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def hash_ids(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """[N] ids (int64, or string / binary) -> [N] uint64: the key that orders dense user ids.

    Integers: the splitmix64 finalizer of the id's two's-complement bits (a bijection: distinct ids never
    collide). Strings: 64-bit FNV-1a over the UTF-8 bytes, xor the splitmix64 of the byte length, through
    splitmix64 again. Pure numpy over the Arrow buffers (no per-row Python): ~0.1 s per million short ids.
    Nulls hash like the empty string (callers pass no nulls for ids). The values are part of the on-disk
    contract (tested against fixed values): changing them renumbers every user.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_integer(arr.type):
        return _splitmix64(arr.cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64))
    if not (pa.types.is_string(arr.type) or pa.types.is_binary(arr.type)
            or pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)):
        raise TypeError(f"hash_ids: expected integer or string ids, got {arr.type}")
    n = len(arr)
    if n == 0:
        return np.empty(0, np.uint64)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    width = 8 if large else 4
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32, count=n + 1,
                        offset=arr.offset * width).astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(1, np.uint8)
    starts, lens = off[:-1], np.diff(off)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    maxlen = int(lens.max())
    if maxlen:
        order = _argsort_small(maxlen - lens)  # longest first: the strings longer than j are a prefix
        longer = n - np.cumsum(np.bincount(lens, minlength=maxlen + 1))  # longer[j] = #strings with len > j
        with np.errstate(over="ignore"):
            for j in range(maxlen):
                k = int(longer[j])
                if k == n:
                    h ^= data[starts + j]
                    h *= _FNV_PRIME
                else:
                    idx = order[:k]
                    h[idx] = (h[idx] ^ data[starts[idx] + j]) * _FNV_PRIME
    return _splitmix64(h ^ _splitmix64(lens.astype(np.uint64)))


def _dict_hash(arr: pa.Array) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """[N] values (nulls allowed) -> (row hashes [N] uint64 (0 where null), distinct values [U], their hashes
    [U]): one Arrow dictionary encoding, then :func:`hash_ids` over the distinct values only."""
    d = pc.dictionary_encode(arr)
    if isinstance(d, pa.ChunkedArray):
        d = d.combine_chunks()
    uniq = d.dictionary
    uh = hash_ids(uniq)
    idx = d.indices
    rows = uh[_np(idx, np.int64)] if len(uniq) else np.zeros(len(arr), np.uint64)
    if idx.null_count:
        rows[_nullmask(idx)] = 0
    return rows, uniq, uh


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values by sorting (numpy 2.4's hash-based ``np.unique`` takes ~6 s per million distinct
    int64 here)."""
    s = np.sort(x)
    if s.size:
        s = s[np.concatenate([[True], s[1:] != s[:-1]])]
    return s


def _argsort_small(x: np.ndarray) -> np.ndarray:
    """Stable argsort of small non-negative ints (radix sort through uint16 where they fit)."""
    if x.size and int(x.max()) < 1 << 16 and int(x.min()) >= 0:
        return np.argsort(x.astype(np.uint16), kind="stable")
    return np.argsort(x, kind="stable")


# ------------------------------------------------------------------------------------------------ vocabularies

class _Vocab:
    """The distinct raw values of one id / feature column, keyed by :func:`hash_ids`.

    ``add`` takes a batch's (hashes, raw values); ``finalize`` sorts the raw values ascending (the dense id
    order) and builds the hash -> rank lookup. Two distinct string values with the same 64-bit hash raise
    InputError naming both (integers cannot collide)."""

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.h = np.empty(0, np.uint64)
        self.raw: pa.Array = pa.array([], pa.int64() if kind == "int" else pa.string())
        self._pending: list[tuple[np.ndarray, pa.Array]] = []
        self._pending_n = 0
        self.rank_by_h: np.ndarray | None = None  # [V] int64: rank (0-based dense order) of self.h[i]
        self.sorted_raw: pa.Array | None = None

    def __len__(self) -> int:
        self._merge()
        return int(self.h.size)

    def add(self, h: np.ndarray, raw: pa.Array) -> None:
        """Record the values ``raw`` (no nulls) whose hashes are ``h``."""
        if h.size == 0:
            return
        u, first = np.unique(h, return_index=True)
        self._pending.append((u, raw.take(pa.array(first))))
        self._pending_n += u.size
        if self._pending_n > max(self.h.size, 1 << 16):
            self._merge()

    def _merge(self) -> None:
        """Fold the pending batches in: dedupe them among themselves, then append only the hashes not yet
        known (transient memory ~ the pending values plus one argsort of the vocabulary)."""
        if not self._pending:
            return
        hs = np.concatenate([p[0] for p in self._pending])
        raws = pa.concat_arrays([p[1].cast(self.raw.type) for p in self._pending])
        self._pending, self._pending_n = [], 0
        u, first, inv = np.unique(hs, return_index=True, return_inverse=True)
        kept = raws.take(pa.array(first))
        if self.kind != "int" and u.size < hs.size:
            self._check_same(raws, kept.take(pa.array(inv.reshape(-1))))
        pos = np.minimum(np.searchsorted(self.h, u), max(self.h.size - 1, 0))
        known = self.h[pos] == u if self.h.size else np.zeros(u.size, bool)
        if self.kind != "int" and known.any():
            self._check_same(kept.filter(pa.array(known)), self.raw.take(pa.array(pos[known])))
        new = ~known
        h = np.concatenate([self.h, u[new]])
        raw = pa.concat_arrays([self.raw, kept.filter(pa.array(new))])
        order = np.argsort(h, kind="stable")
        self.h, self.raw = h[order], raw.take(pa.array(order))

    def _check_same(self, a: pa.Array, b: pa.Array) -> None:
        """Values paired by equal hash must be equal: else two distinct values collide (InputError)."""
        same = pc.equal(a, b).to_numpy(zero_copy_only=False)
        if not same.all():
            i = int(np.flatnonzero(~same)[0])
            raise InputError(f"column {self.name!r}: the values {a[i].as_py()!r} and {b[i].as_py()!r} have the same "
                             "64-bit hash; gemray cannot tell them apart (please report this)")

    def finalize(self) -> None:
        """Sort the values ascending (dense order) and build the lookup; call once, after the last add."""
        self._merge()
        order = pc.sort_indices(self.raw).to_numpy()
        self.sorted_raw = self.raw.take(pa.array(order))
        rank = np.empty(order.size, np.int64)
        rank[order] = np.arange(order.size)
        self.rank_by_h = rank

    def state(self) -> tuple[np.ndarray, pa.Array]:
        """(hashes, raw values) for merging into another vocabulary (a worker's result)."""
        self._merge()
        return self.h, self.raw

    def lookup(self, h: np.ndarray) -> np.ndarray:
        """[N] hashes of values that were added -> [N] int64 ranks (0-based dense order)."""
        pos = np.searchsorted(self.h, h)
        pos = np.minimum(pos, max(self.h.size - 1, 0))
        if h.size and not np.array_equal(self.h[pos], h):
            raise AssertionError(f"{self.name}: a value missing from its vocabulary")
        return self.rank_by_h[pos]


# ------------------------------------------------------------------------------------------------ sources

@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One input file: its filesystem, path on it, display name (the URI or local path), size, format and
    compression (CSV / text only)."""

    fs: Any
    path: str
    display: str
    size: int
    fmt: str
    compression: str | None


def _filesystem(src: str) -> tuple[Any, str, str]:
    """--src -> (filesystem, path on it, prefix to display a path of it). pyarrow.fs first, fsspec for the
    schemes pyarrow does not know. Raises InputError for an unknown scheme or bad URI options."""
    if "://" not in src:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(src)), ""
    scheme = src.split("://", 1)[0].lower()
    try:
        fs, path = pafs.FileSystem.from_uri(src)
        return fs, path, "" if scheme == "file" else f"{scheme}://"
    except pa.ArrowInvalid as e:
        if "Unrecognized filesystem type" not in str(e):
            raise InputError(f"--src {src}: {_one_line(e)}") from None
    except OSError as e:
        raise InputError(f"--src {src}: cannot reach it ({_one_line(e)})") from None
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        ffs, path = fsspec.core.url_to_fs(src)
    except (ValueError, ImportError) as e:
        raise InputError(f"--src {src}: no filesystem for scheme {scheme!r} (pyarrow.fs knows file, s3, gs, hdfs; "
                         f"fsspec said: {_one_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types for bad URIs / credentials
        raise InputError(f"--src {src}: cannot open it ({type(e).__name__}: {_one_line(e)})") from None
    return PyFileSystem(FSSpecHandler(ffs)), path, f"{scheme}://"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _split_ext(name: str) -> tuple[str, str | None]:
    """file name -> (format-bearing extension, compression or None): 'a.csv.gz' -> ('.csv', 'gzip')."""
    base, ext = os.path.splitext(name.lower())
    comp = _COMPRESSION.get(ext)
    if comp:
        ext = os.path.splitext(base)[1]
    return ext, comp


def _glob_match(path: str, pattern: str) -> bool:
    """Segment-wise glob: ``*`` / ``?`` / ``[...]`` stay inside one path segment, ``**`` spans any number."""
    p, q = path.strip("/").split("/"), pattern.strip("/").split("/")

    def rec(i: int, j: int) -> bool:
        if j == len(q):
            return i == len(p)
        if q[j] == "**":
            return any(rec(k, j + 1) for k in range(i, len(p) + 1))
        return i < len(p) and fnmatch.fnmatchcase(p[i], q[j]) and rec(i + 1, j + 1)

    return rec(0, 0)


def resolve_sources(srcs: list[str] | str, fmt: str = "auto") -> list[SourceFile]:
    """Expand every --src (file, folder, glob, URI) into input files, sorted by display path.

    Raises FileNotFoundError when a --src matches nothing, InputError when it cannot be reached or its files'
    formats cannot be told (``--format auto`` with files of unknown or mixed extensions)."""
    if isinstance(srcs, str):
        srcs = [srcs]
    if not srcs:
        raise ValueError("--src: at least one source is required")
    found: dict[str, SourceFile] = {}
    for src in srcs:
        fs, path, prefix = _filesystem(src)
        magic = any(c in path for c in "*?[")
        try:
            if magic:
                segs = path.split("/")
                k = next(i for i, s in enumerate(segs) if any(c in s for c in "*?["))
                base = "/".join(segs[:k]) or "/"
                infos = [i for i in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
                         if i.type == pafs.FileType.File and _glob_match(i.path, path) and not _hidden(i.path, base)]
            else:
                info = fs.get_file_info(path)
                if info.type == pafs.FileType.NotFound:
                    _raise_unreachable(fs, path, src)
                    raise FileNotFoundError(f"--src {src}: no such file or folder")
                if info.type == pafs.FileType.Directory:
                    infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                             if i.type == pafs.FileType.File and not _hidden(i.path, path)]
                    if fmt == "auto":
                        infos = [i for i in infos if _split_ext(i.base_name)[0] in _EXT_FORMAT]
                else:
                    infos = [info]
        except FileNotFoundError:
            raise
        except OSError as e:
            raise InputError(f"--src {src}: cannot reach it ({_one_line(e)})") from None
        if not infos:
            raise FileNotFoundError(f"--src {src}: matches no input file"
                                    + (" (with --format auto: *.parquet, *.pq, *.csv, *.tsv, possibly compressed)"
                                       if fmt == "auto" and not magic else ""))
        for i in infos:
            ext, comp = _split_ext(i.base_name)
            f = fmt
            if fmt == "auto":
                f = _EXT_FORMAT.get(ext)
                if f is None:
                    raise InputError(f"{prefix}{i.path}: cannot tell its format from the name; pass --format")
            if f == "parquet" and comp:
                raise InputError(f"{prefix}{i.path}: a compressed Parquet file; Parquet compresses inside the file")
            display = prefix + i.path
            found[display] = SourceFile(fs, i.path, display, int(i.size or 0), f, comp)
    files = [found[k] for k in sorted(found)]
    kinds = sorted({f.fmt for f in files})
    if len(kinds) > 1:
        raise InputError(f"--src holds files of several formats ({', '.join(kinds)}): e.g. "
                         f"{next(f.display for f in files if f.fmt == kinds[0])} and "
                         f"{next(f.display for f in files if f.fmt == kinds[1])}; prepare one format at a time")
    return files


def _raise_unreachable(fs: Any, path: str, src: str) -> None:
    """fsspec filesystems (e.g. http) report a host they cannot reach as a missing file, the connection error
    as the exception's cause: raise InputError with that cause instead of 'no such file'."""
    handler = getattr(fs, "handler", None)
    ffs = getattr(handler, "fs", None)
    if ffs is None:
        return
    try:
        ffs.info(path)
    except FileNotFoundError as e:
        cause = e.__cause__ or e.__context__
        if cause is not None and not isinstance(cause, FileNotFoundError):
            raise InputError(f"--src {src}: cannot reach it ({type(cause).__name__}: {_one_line(cause)})") from None
    except Exception as e:  # noqa: BLE001 - whatever the backend raises for a host it cannot reach
        raise InputError(f"--src {src}: cannot reach it ({type(e).__name__}: {_one_line(e)})") from None


def _hidden(path: str, base: str) -> bool:
    rel = path[len(base):].strip("/")
    return any(s.startswith((".", "_")) for s in rel.split("/"))


# ------------------------------------------------------------------------------------------------ column spec

@dataclasses.dataclass
class _Spec:
    """What to read from every file and how (picklable: sent to the workers)."""

    fmt: str
    user: str
    item: str
    time: str | None  # None: amazon-seq (positions)
    rating: str | None
    features: list[str]
    kinds: dict[str, str]  # user / item / feature column -> "int" | "string"
    id_type: str
    time_unit: str
    delimiter: str
    quarantine: bool
    header: bool  # CSV: the first line names the columns

    @property
    def columns(self) -> list[str]:
        return [c for c in (self.user, self.item, self.time, self.rating, *self.features) if c is not None]

    def role(self, col: str) -> str:
        flags = {self.user: "--user-col", self.item: "--item-col", self.time: "--time-col",
                 self.rating: "--rating-col"}
        return flags.get(col, "--feature-cols")


#: CSV field separators a header read as one column is checked for (:func:`header_hint`), with their names.
_DELIMITER_NAMES = {",": "commas (',')", ";": "semicolons (';')", "\t": "tabs", "|": "pipes ('|')"}
_DATA_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]{4}-[0-9]{2}-[0-9]{2}([ T].*)?")


def _delimiter_arg(d: str) -> str:
    """``--delimiter X`` as typed in a shell (a tab as ``'\\t'``, which --delimiter reads as a tab)."""
    return "--delimiter '\\t'" if d == "\t" else f"--delimiter {d!r}" if d in ";|" else f"--delimiter {d}"


def _near_column(col: str, names: list[str]) -> str | None:
    """The file's column a wanted name was most likely meant as: one that differs only in letter case, else a close
    spelling (difflib ratio >= 0.8, e.g. 'ratings' for 'rating'); None when there is none. Column names are
    case-sensitive (Arrow, Parquet), so a --rating-col Rating for a 'rating' column is refused, with this name."""
    same = [n for n in names if n.lower() == col.lower()]
    if same:
        return same[0]
    close = difflib.get_close_matches(col, names, n=1, cutoff=0.8)
    return close[0] if close else None


def header_hint(names: list[str], delimiter: str, expected: list[str]) -> str:
    """Pure: why a CSV header (``names``, read with ``delimiter``) may lack the ``expected`` columns, or "".

    One name holding another separator (``user;item;timestamp``): the file looks delimited by it, with the
    --delimiter to pass. Names that read as data (numbers, ISO dates: ``1,31,1700000000``): the file seems to
    have no header row, and its first line must name the ``expected`` columns (there is no option for a headerless
    CSV). The missing-column error adds it, in parentheses."""
    if len(names) == 1:
        for d, what in _DELIMITER_NAMES.items():
            if d != delimiter and d in names[0]:
                return (f"one column: the file looks delimited by {what}, not "
                        f"{_DELIMITER_NAMES.get(delimiter, repr(delimiter))}; pass {_delimiter_arg(d)}")
    if any(_DATA_RE.fullmatch(n.strip()) for n in names):
        return ("data, not names: the file seems to have no header row; its first line must name the columns: "
                f"{', '.join(expected)} (--user-col, --item-col, --time-col name others)")
    return ""


def _type_kind(t: pa.DataType) -> str | None:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "string"
    return None


def _inspect(files: list[SourceFile], spec: _Spec) -> dict[str, int]:
    """Check every file's columns and types before any row is read; fill ``spec.kinds``.

    Returns {display: estimated spill bytes}. Raises InputError naming the file and the column."""
    est: dict[str, int] = {}
    first_kind: dict[str, tuple[str, str]] = {}  # column -> (kind, file)
    for f in files:
        try:
            if f.fmt == "parquet":
                with f.fs.open_input_file(f.path) as fh:
                    pf = pq.ParquetFile(fh)
                    schema, meta = pf.schema_arrow, pf.metadata
                names = schema.names
                types = {n: schema.field(n).type for n in names}
                raw_bytes = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
                est[f.display] = int(raw_bytes * 1.5) + meta.num_rows * 32
            elif f.fmt == "csv" and spec.header:
                with _open_text(f) as (stream, _):
                    first = next(_line_blocks(stream, 1 << 16), b"").partition(b"\n")[0]
                if first.startswith(_BOM):
                    first = first[len(_BOM):]
                if not first.strip():
                    if f.size == 0:  # an empty part file holds no rows (and no header to check)
                        est[f.display] = 0
                        continue
                    raise InputError(f"{f.display}: line 1 is empty, not a CSV header")
                names = _csv_header(first, spec.delimiter, f.display)
                types = {n: pa.string() for n in names}
                est[f.display] = f.size * (4 if f.compression else 1) * 2
            else:  # headerless: amazon-ratings, amazon-seq
                names = spec.columns
                types = {n: pa.string() for n in names}
                est[f.display] = f.size * (4 if f.compression else 1) * 3
        except pa.ArrowInvalid as e:
            raise InputError(f"{f.display}: not a readable {f.fmt} file ({_one_line(e)})") from None
        except OSError as e:
            raise InputError(f"{f.display}: cannot read it ({_one_line(e)})") from None
        for col in spec.columns:
            if col not in types:
                shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
                hint = header_hint(names, spec.delimiter, spec.columns) if f.fmt == "csv" and spec.header else ""
                near = _near_column(col, names)
                raise InputError(f"{f.display}: no column {col!r} ({spec.role(col)}); the file has: {shown}"
                                 + (f" ({hint})" if hint else "") + (f"; did you mean {near!r}?" if near else ""))
        for col in (spec.user, spec.item, *spec.features):
            kind = _type_kind(types[col])
            if kind is None:
                raise InputError(f"{f.display}: column {col!r} ({spec.role(col)}) has type {types[col]}; ids and "
                                 "categorical features must be integers or strings")
            if f.fmt != "parquet":
                kind = "string"
            if col in (spec.user, spec.item) and spec.id_type != "auto":
                kind = spec.id_type
            prev = first_kind.setdefault(col, (kind, f.display))
            if prev[0] != kind:
                raise InputError(f"column {col!r} ({spec.role(col)}) has mixed types: {kind} ids in {f.display} "
                                 f"({types[col]}) but {prev[0]} ids in {prev[1]}; make them one type, or pass "
                                 "--id-type string")
        for col, what in ((spec.time, "--time-col"), (spec.rating, "--rating-col")):
            if col is None:
                continue
            t = types[col]
            ok = (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
                  or _type_kind(t) == "string" or pa.types.is_null(t)
                  or (col == spec.time and (pa.types.is_timestamp(t) or pa.types.is_date(t))))
            if not ok:
                raise InputError(f"{f.display}: column {col!r} ({what}) has type {t}, which cannot be "
                                 + ("a time" if col == spec.time else "a rating"))
    if not first_kind:  # every file was skipped above as an empty part file: no header to take the columns from
        where = files[0].display if len(files) == 1 else f"all {len(files)} files ({files[0].display}, ...)"
        raise InputError(f"{where}: empty (0 bytes), no CSV header and no rows")
    spec.kinds = {c: k for c, (k, _) in first_kind.items()}
    return est


class _HashingReader:
    """A read-only binary stream that feeds every byte it returns to a sha256 (the source's checksum is taken
    in the same read as the parse)."""

    def __init__(self, raw):
        self.raw, self.sha, self.nbytes = raw, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n) if n is not None and n >= 0 else self.raw.read()
        data = bytes(data)
        self.sha.update(data)
        self.nbytes += len(data)
        return data

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


class _open_text:
    """Context manager: (decompressed stream for pyarrow, _HashingReader of the raw bytes) of a CSV/text file."""

    def __init__(self, f: SourceFile):
        self.f = f

    def __enter__(self):
        self.raw = self.f.fs.open_input_stream(self.f.path, compression=None)
        self.hasher = _HashingReader(self.raw)
        stream: Any = pa.PythonFile(self.hasher, mode="r")
        if self.f.compression:
            stream = pa.CompressedInputStream(stream, self.f.compression)
        return stream, self.hasher

    def __exit__(self, *exc):
        self.raw.close()
        return False


def _drain(hasher: _HashingReader) -> None:
    """Read what the parser left unread (the checksum covers the whole file)."""
    while hasher.read(1 << 20):
        pass


def _sha256_stream(f: SourceFile) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with f.fs.open_input_stream(f.path, compression=None) as s:
        while True:
            block = s.read(1 << 20)
            if not block:
                break
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


# ------------------------------------------------------------------------------------------------ readers

@dataclasses.dataclass
class _Chunk:
    """A block of raw rows of one file: columns by name, their 1-based line (row) numbers, the input position
    of each row, and rows already found bad by the reader (CSV field counts, empty sequence lines)."""

    cols: dict[str, pa.Array]
    lines: np.ndarray
    seq: np.ndarray
    bad: list[dict[str, Any]]


def _read_parquet(f: SourceFile, idx: int, spec: _Spec, batch_rows: int) -> Iterator[_Chunk]:
    with f.fs.open_input_file(f.path) as fh:
        pf = pq.ParquetFile(fh)
        row = 0
        for batch in pf.iter_batches(batch_size=batch_rows, columns=spec.columns, use_threads=False):
            n = batch.num_rows
            lines = np.arange(row + 1, row + n + 1, dtype=np.int64)
            row += n
            yield _Chunk({c: batch.column(c) for c in spec.columns}, lines, (idx << _FILE_SHIFT) + lines, [])


def _block(f: SourceFile, block_bytes: int) -> int:
    """Read block size for a text file: the budget's block, or less for a small file (1 MiB at least)."""
    return int(min(block_bytes, max(1 << 16, f.size * (8 if f.compression else 1) + 1)))


def _line_blocks(stream, block_bytes: int) -> Iterator[bytes]:
    """Whole lines of a binary stream, about ``block_bytes`` at a time (each block ends with a newline, but the
    file's last one may not; a line longer than a block makes a longer block). Memory: ~2 blocks."""
    carry = b""
    while True:
        data = stream.read(block_bytes)
        if not data:
            break
        buf = carry + bytes(data)
        cut = buf.rfind(b"\n")
        if cut < 0:
            carry = buf
            continue
        carry = buf[cut + 1:]
        yield buf[:cut + 1]
    if carry:
        yield carry


_BOM = b"\xef\xbb\xbf"


def _csv_header(line: bytes, delimiter: str, display: str) -> list[str]:
    """Column names of a CSV header line (quotes allowed)."""
    try:
        t = pacsv.read_csv(pa.py_buffer(line.rstrip(b"\r\n") + b"\n"),
                           read_options=pacsv.ReadOptions(use_threads=False),
                           parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=False))
    except pa.ArrowInvalid as e:
        raise InputError(f"{display}: line 1 is not a CSV header ({_one_line(e)})") from None
    return t.schema.names


def _read_csv(f: SourceFile, idx: int, spec: _Spec, block_bytes: int, hasher_out: list) -> Iterator[_Chunk]:
    """Parse a CSV file block by block of whole lines (pyarrow.csv on each block, single-threaded): memory is a
    few blocks whatever the file's size, and every row's 1-based file line is exact (newlines inside quoted
    values are not supported). Rows with the wrong number of fields come back as bad records."""
    block_bytes = _block(f, block_bytes)
    names = None if spec.header else list(amazon.RATINGS_COLUMNS if spec.fmt == "amazon-ratings" else spec.columns)
    conv = pacsv.ConvertOptions(include_columns=spec.columns, column_types={c: pa.binary() for c in spec.columns},
                                strings_can_be_null=True, quoted_strings_can_be_null=True, null_values=[""])
    line0 = 1  # file line of the block's first line
    with _open_text(f) as (stream, hasher):
        hasher_out.append(hasher)
        for k, block in enumerate(_line_blocks(stream, block_bytes)):
            nlines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
            start = line0
            line0 += nlines
            if k == 0:
                if block.startswith(_BOM):
                    block = block[len(_BOM):]
                if names is None:
                    first, _, block = block.partition(b"\n")
                    names = _csv_header(first, spec.delimiter, f.display)
                    start += 1
                    if not block:
                        continue
            skipped: list[tuple[int, str, int, int]] = []

            def on_invalid(row, skipped=skipped) -> str:
                skipped.append((row.number, row.text, row.expected_columns, row.actual_columns))
                return "skip"

            try:
                t = pacsv.read_csv(pa.py_buffer(block),
                                   read_options=pacsv.ReadOptions(use_threads=False, column_names=names,
                                                                  block_size=len(block) + 1),
                                   parse_options=pacsv.ParseOptions(delimiter=spec.delimiter, newlines_in_values=False,
                                                                    ignore_empty_lines=False,
                                                                    invalid_row_handler=on_invalid),
                                   convert_options=conv)
            except pa.ArrowInvalid as e:
                raise InputError(f"{f.display}: CSV parse error in lines {start}-{start + nlines - 1} "
                                 f"({_one_line(e)})") from None
            lines = _kept_lines(0, t.num_rows, skipped, 0) + (start - 1)
            bad = [_bad(f.display, start - 1 + num, "row", "field_count",
                        f"expected {exp} fields separated by {spec.delimiter!r}, got {act}", text)
                   for num, text, exp, act in skipped]
            yield _Chunk({c: t.column(c).combine_chunks() for c in spec.columns}, lines,
                         (idx << _FILE_SHIFT) + lines, bad)
        _drain(hasher)


def _kept_lines(k0: int, n: int, skipped: list, header: int) -> np.ndarray:
    """1-based file lines of kept rows k0..k0+n-1, given the physical lines of the skipped (invalid) rows."""
    k = np.arange(k0, k0 + n, dtype=np.int64)
    if not skipped:
        return k + header + 1
    s = np.array([x[0] for x in skipped], dtype=np.int64)
    adj = s - np.arange(s.size) - (header + 1)  # kept rows before each skipped line
    return k + header + 1 + np.searchsorted(adj, k, side="right")


def _read_seq(f: SourceFile, idx: int, spec: _Spec, block_bytes: int, hasher_out: list) -> Iterator[_Chunk]:
    token0 = 0
    block_bytes = _block(f, block_bytes)
    with _open_text(f) as (stream, hasher):
        hasher_out.append(hasher)
        for lines_bin, linenos in amazon.iter_seq_lines(stream, block_bytes):
            text, enc_bad = _cast_or_null(lines_bin, pa.string())
            bad = [_bad(f.display, int(linenos[i]), "row", "encoding", "the line is not valid UTF-8",
                        lines_bin[i].as_py()) for i in np.flatnonzero(enc_bad)]
            users, items, line_of = amazon.split_seq_lines(text)
            per = np.bincount(line_of, minlength=len(text)) if line_of.size else np.zeros(len(text), np.int64)
            valid = ~enc_bad
            for i in np.flatnonzero(valid & (per == 0)):
                what = "an empty line" if not users[int(i)].as_py() else "a user with no items"
                bad.append(_bad(f.display, int(linenos[i]), "row", "field_count",
                                f"{what}: expected 'user item1 item2 ...'", text[int(i)].as_py()))
            bad.sort(key=lambda r: r["line"])
            n = line_of.size
            tok = np.arange(token0, token0 + n, dtype=np.int64)
            token0 += n
            user_tok = users.take(pa.array(line_of)) if n else pa.array([], pa.string())
            yield _Chunk({spec.user: user_tok, spec.item: items}, linenos[line_of],
                         (idx << _FILE_SHIFT) + tok, bad)
        _drain(hasher)


def _bad(file: str, line: int, field: str, reason: str, problem: str, raw: Any) -> dict[str, Any]:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "backslashreplace")
    return {"file": file, "line": int(line), "field": field, "reason": reason, "problem": problem, "raw": raw}


# ------------------------------------------------------------------------------------------------ conversion

def _cast_or_null(arr: pa.Array, typ: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Cast ``arr`` to ``typ``; elements that fail become null. Returns (result, [N] bool failed). Finds the
    failing elements by bisection, so a clean array costs one cast."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    try:
        return pc.cast(arr, typ), np.zeros(len(arr), bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        pass
    if len(arr) <= 16:
        out, bad = [], np.zeros(len(arr), bool)
        for i in range(len(arr)):
            try:
                out.append(pc.cast(arr.slice(i, 1), typ))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
                out.append(pa.nulls(1, typ))
                bad[i] = True
        return pa.concat_arrays(out), bad
    mid = len(arr) // 2
    a, ba = _cast_or_null(arr.slice(0, mid), typ)
    b, bb = _cast_or_null(arr.slice(mid), typ)
    return pa.concat_arrays([a, b]), np.concatenate([ba, bb])


def _np(arr: pa.Array, dtype, fill=0) -> np.ndarray:
    return pc.fill_null(arr, fill).to_numpy(zero_copy_only=False).astype(dtype, copy=False) if arr.null_count \
        else arr.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _nullmask(arr: pa.Array) -> np.ndarray:
    return arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(len(arr), bool)


class _Problems:
    """Per-row failures of one batch: the first failing field of each row wins (fields in column order)."""

    def __init__(self, n: int):
        self.bad = np.zeros(n, bool)
        self.groups: list[tuple[np.ndarray, str, str, Callable[[int], str]]] = []

    def add(self, mask: np.ndarray, field: str, reason: str, problem: Callable[[int], str]) -> None:
        new = mask & ~self.bad
        if new.any():
            self.groups.append((new, field, reason, problem))
            self.bad |= new

    def records(self, file: str, lines: np.ndarray, raw_of: Callable[[int], Any], limit: int | None = None
                ) -> list[dict[str, Any]]:
        rows = np.flatnonzero(self.bad)
        if limit is not None:
            rows = rows[:limit]
        out = []
        for i in rows:
            for mask, field, reason, problem in self.groups:
                if mask[i]:
                    out.append(_bad(file, int(lines[i]), field, reason, problem(int(i)), raw_of(int(i))))
                    break
        return out


def _text(arr: pa.Array, col: str, probs: _Problems) -> pa.Array:
    """binary / string column -> valid UTF-8 string column; bad bytes are problems ('encoding')."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        return arr.cast(pa.string())
    out, failed = _cast_or_null(arr, pa.string())
    probs.add(failed, col, "encoding", lambda i: "not valid UTF-8")
    return out


def _conv_id(arr: pa.Array, col: str, kind: str, probs: _Problems, *, nullable: bool) -> pa.Array:
    """An id / feature column -> int64 or string (``kind``); nulls are problems unless ``nullable``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if not nullable:
        probs.add(_nullmask(arr), col, "missing", lambda i: "missing value")
    if pa.types.is_integer(arr.type):
        if kind == "int":
            out, failed = _cast_or_null(arr, pa.int64())
            probs.add(failed, col, "out_of_range", lambda i: f"{arr[i].as_py()} does not fit in int64")
            return out
        return arr.cast(pa.string())
    s = _text(arr, col, probs)
    if kind == "string":
        return s
    fast = _fast_int(s)
    if fast is not None:
        return fast
    ok = pc.fill_null(pc.match_substring_regex(s, _INT_RE), True).to_numpy(zero_copy_only=False)
    probs.add(~ok, col, "non_numeric", lambda i: f"{s[i].as_py()!r} is not an integer (--id-type int)")
    out, failed = _cast_or_null(pc.if_else(pa.array(ok), s, pa.scalar(None, pa.string())), pa.int64())
    probs.add(failed, col, "out_of_range", lambda i: f"{s[i].as_py()} does not fit in int64")
    return out


def _fast_int(s: pa.Array) -> pa.Array | None:
    """Decimal integer strings -> int64 in one cast, or None when any value is not one (then the strict,
    per-row path decides). Arrow's cast also takes hex ('0x1f'), which the strict path refuses."""
    try:
        out = pc.cast(s, pa.int64())
    except (pa.ArrowInvalid, OverflowError):
        return None
    if pc.any(pc.match_substring(s, "x", ignore_case=True)).as_py():
        return None
    return out


def _conv_time(arr: pa.Array, col: str, unit: str, probs: _Problems) -> tuple[np.ndarray, np.ndarray]:
    """A time column -> ([N] int64 unix seconds (>= 0), [N] bool: the row's time is a number in ``unit``);
    failures are problems, and so are numbers in ``unit`` that come out at or past 2200 (:data:`MAX_UNIX_SECONDS`:
    most likely another unit, named by :func:`_late_problem`). Parquet timestamps / dates and ISO text state their
    time: not checked, and not numbers in ``unit``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    n = len(arr)
    probs.add(_nullmask(arr), col, "missing", lambda i: "missing value")
    factor = TIME_UNITS[unit]
    t = arr.type
    numeric: np.ndarray | bool = False  # rows whose time is a number in --time-unit
    if pa.types.is_integer(t):
        v = _np(arr.cast(pa.int64()), np.int64)
        secs = np.floor_divide(v, factor)
        numeric = True
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        v = _np(arr.cast(pa.float64()), np.float64)
        finite = np.isfinite(v)
        probs.add(~finite, col, "non_numeric", lambda i: f"{arr[i].as_py()} is not a finite number")
        secs = np.floor(np.where(finite, v, 0) / factor)
        too_big = np.abs(secs) >= 2.0**62
        probs.add(too_big, col, "out_of_range", lambda i: f"{arr[i].as_py()} is out of range")
        secs = np.where(too_big, 0, secs).astype(np.int64)
        numeric = True
    elif pa.types.is_timestamp(t):
        per_s = TIME_UNITS[t.unit]
        secs = np.floor_divide(_np(arr.cast(pa.int64()), np.int64), per_s)
    elif pa.types.is_date32(t):
        secs = _np(arr.cast(pa.int32()), np.int64) * 86400
    elif pa.types.is_date64(t):
        secs = np.floor_divide(_np(arr.cast(pa.int64()), np.int64), 1000)
    elif pa.types.is_null(t):
        secs = np.zeros(n, np.int64)
    else:  # text
        s = _text(arr, col, probs)
        secs, numeric = _parse_time_text(s, col, factor, probs)
    probs.add(secs < 0, col, "out_of_range", lambda i: f"{_show(arr, i)} is before 1970 (unix seconds < 0)")
    late = numeric & (secs >= MAX_UNIX_SECONDS)
    if late.any():
        probs.add(late, col, "out_of_range", lambda i: _late_problem(_show(arr, i), int(secs[i]), unit))
    return secs, np.broadcast_to(np.asarray(numeric, bool), (n,))


def _late_problem(shown: str, secs: int, unit: str) -> str:
    """The problem of a number ``shown`` in ``unit`` that is ``secs`` unix seconds, at or past 2200: the time (or
    year) it reads as and the first larger unit in which it is a time before 2200 (with that time and the option to
    pass), e.g. milliseconds for 1700000000000 read as seconds."""
    when = _iso(secs) if secs < _YEAR_10000 else f"around the year {1970 + secs // _SECONDS_PER_YEAR}"
    text = f"{shown} in --time-unit {unit} is {when}, 2200 or later"
    raw = secs * TIME_UNITS[unit]  # the number as given, floored to whole seconds
    for u, factor in TIME_UNITS.items():
        if factor > TIME_UNITS[unit] and raw // factor < MAX_UNIX_SECONDS:
            return f"{text}: it looks like {_UNIT_NAMES[u]} ({_iso(raw // factor)}); pass --time-unit {u}"
    return f"{text}: check the column's unit (--time-unit {'|'.join(TIME_UNITS)})"


def _show(arr: pa.Array, i: int) -> str:
    v = arr[i].as_py()
    return repr(v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v)


def _parse_time_text(s: pa.Array, col: str, factor: int, probs: _Problems) -> tuple[np.ndarray, np.ndarray]:
    """Time text -> ([N] int64 unix seconds, [N] bool: the text is a number in --time-unit, not ISO 8601)."""
    n = len(s)
    fast = _fast_int(s)
    if fast is not None:
        return np.floor_divide(_np(fast, np.int64), factor), np.ones(n, bool)
    secs = np.zeros(n, np.int64)
    is_int = pc.fill_null(pc.match_substring_regex(s, _INT_RE), False).to_numpy(zero_copy_only=False)
    is_dec = pc.fill_null(pc.match_substring_regex(s, _DEC_RE), False).to_numpy(zero_copy_only=False) & ~is_int
    other = ~(is_int | is_dec) & ~_nullmask(s)
    if is_int.any():
        idx = np.flatnonzero(is_int)
        v, failed = _cast_or_null(s.take(pa.array(idx)), pa.int64())
        m = np.zeros(n, bool)
        m[idx[failed]] = True
        probs.add(m, col, "out_of_range", lambda i: f"{s[i].as_py()} does not fit in int64")
        secs[idx] = np.floor_divide(_np(v, np.int64), factor)
    if is_dec.any():
        idx = np.flatnonzero(is_dec)
        v = _np(s.take(pa.array(idx)).cast(pa.float64()), np.float64)
        ok = np.isfinite(v) & (np.abs(v / factor) < 2.0**62)
        m = np.zeros(n, bool)
        m[idx[~ok]] = True
        probs.add(m, col, "out_of_range", lambda i: f"{s[i].as_py()} is out of range")
        secs[idx] = np.floor(np.where(ok, v, 0) / factor).astype(np.int64)
    if other.any():
        idx = np.flatnonzero(other)
        us, failed = _parse_iso(s.take(pa.array(idx)))
        m = np.zeros(n, bool)
        m[idx[failed]] = True
        probs.add(m, col, "bad_time", lambda i: f"{s[i].as_py()!r} is not a time (an integer or decimal in "
                                                "--time-unit, or ISO 8601 such as 2024-01-31T12:00:00Z)")
        secs[idx] = np.floor_divide(us, 10**6)
    return secs, is_int | is_dec


def _parse_iso(s: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """ISO 8601 strings -> ([N] int64 microseconds since the epoch, [N] bool failed); zone-less = UTC."""
    for typ in (pa.timestamp("us"), pa.timestamp("us", tz="UTC")):
        try:
            return _np(pc.cast(s, typ).cast(pa.int64()), np.int64), np.zeros(len(s), bool)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    if len(s) == 1:
        return np.zeros(1, np.int64), np.ones(1, bool)
    mid = len(s) // 2
    a, fa = _parse_iso(s.slice(0, mid))
    b, fb = _parse_iso(s.slice(mid))
    return np.concatenate([a, b]), np.concatenate([fa, fb])


def _conv_rating(arr: pa.Array, col: str, probs: _Problems) -> np.ndarray:
    """Stars 0..5 in steps of 0.5 -> [N] int8 half stars; null -> 0 (no rating)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    n = len(arr)
    if pa.types.is_null(arr.type):
        return np.zeros(n, np.int8)
    orig = arr
    if _type_kind(arr.type) == "string":
        s = _text(arr, col, probs)
        try:
            arr = pc.cast(s, pa.float64())  # accepts nan / inf: the range check below refuses them
        except pa.ArrowInvalid:
            arr = None
    if arr is None:
        ok = pc.fill_null(pc.match_substring_regex(s, _DEC_RE), True).to_numpy(zero_copy_only=False)
        arr, failed = _cast_or_null(pc.if_else(pa.array(ok), s, pa.scalar(None, pa.string())), pa.float64())
        probs.add(~ok | failed, col, "non_numeric", lambda i: f"{s[i].as_py()!r} is not a number")
    v = _np(arr.cast(pa.float64()), np.float64, fill=0.0)
    with np.errstate(invalid="ignore"):
        r2 = v * 2.0
        ok = np.isfinite(r2) & (r2 >= 0) & (r2 <= 10) & (r2 == np.round(r2))
    probs.add(~ok, col, "out_of_range", lambda i: f"{_show(orig, i)} is not a star rating 0, 0.5, ..., 5")
    return np.where(ok, r2, 0).astype(np.int8)


@dataclasses.dataclass
class _Converted:
    user: pa.Array
    item: pa.Array
    ts: np.ndarray
    rating: np.ndarray
    seq: np.ndarray
    features: dict[str, pa.Array]
    rows: int
    numeric_times: int = 0  # good rows whose time is a number in --time-unit
    early_times: int = 0  # ... of them before 1990 (MIN_PLAUSIBLE_UNIX_SECONDS)
    early_example: dict[str, Any] | None = None  # the first such row: file, line, value as shown, number


def _convert(chunk: _Chunk, spec: _Spec, display: str) -> tuple[_Converted, list[dict[str, Any]]]:
    """Check and convert one chunk. Returns (good rows, bad-row records in line order, reader's included);
    in error mode only the first bad record is built."""
    n = len(chunk.lines)
    probs = _Problems(n)
    user = _conv_id(chunk.cols[spec.user], spec.user, spec.kinds[spec.user], probs, nullable=False)
    item = _conv_id(chunk.cols[spec.item], spec.item, spec.kinds[spec.item], probs, nullable=False)
    ts, numeric = (_conv_time(chunk.cols[spec.time], spec.time, spec.time_unit, probs) if spec.time is not None
                   else (np.zeros(n, np.int64), np.zeros(n, bool)))
    rating = _conv_rating(chunk.cols[spec.rating], spec.rating, probs) if spec.rating else np.zeros(n, np.int8)
    feats = {c: _conv_id(chunk.cols[c], c, spec.kinds[c], probs, nullable=True) for c in spec.features}
    bad = list(chunk.bad)
    if probs.bad.any():
        def raw_of(i: int) -> dict[str, Any]:
            out = {}
            for c in spec.columns:
                v = chunk.cols[c][i].as_py() if c in chunk.cols else None
                out[c] = v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v
                if not isinstance(out[c], (str, int, float, type(None))):
                    out[c] = str(out[c])
            return out

        if spec.fmt == "amazon-seq":  # one bad token spoils its line: drop every token of that line
            bad_lines = _distinct(chunk.lines[probs.bad])
            recs = probs.records(display, chunk.lines, raw_of)
            firsts = {}
            for r in recs:
                firsts.setdefault(r["line"], r)
            bad.extend(firsts[int(x)] for x in bad_lines)
            probs.bad |= np.isin(chunk.lines, bad_lines)
        else:
            bad.extend(probs.records(display, chunk.lines, raw_of, None if spec.quarantine else 1))
        bad.sort(key=lambda r: r["line"])
    keep = ~probs.bad
    numeric = numeric & keep
    early = np.flatnonzero(numeric & (ts < MIN_PLAUSIBLE_UNIX_SECONDS))
    example = None
    if early.size and spec.time_unit != "s":
        i = int(early[0])
        v = chunk.cols[spec.time][i].as_py()
        example = {"file": display, "line": int(chunk.lines[i]), "value": _show(chunk.cols[spec.time], i),
                   "number": float(v.decode("utf-8") if isinstance(v, bytes) else v)}
    if not keep.all():
        k = pa.array(keep)
        user, item = user.filter(k), item.filter(k)
        feats = {c: a.filter(k) for c, a in feats.items()}
        ts, rating = ts[keep], rating[keep]
    return _Converted(user, item, ts, rating, chunk.seq[keep], feats, int(keep.sum()), int(numeric.sum()),
                      int(early.size), example), bad


# ------------------------------------------------------------------------------------------------ pass 1: spill

def _spill_schema(spec: _Spec) -> pa.Schema:
    raw = pa.int64() if spec.kinds[spec.user] == "int" else pa.string()
    return pa.schema([("uh", pa.uint64()), ("user", raw), ("ih", pa.uint64()), ("rating", pa.int8()),
                      ("ts", pa.int64()), ("seq", pa.int64())]
                     + [(f"f{k}", pa.uint64()) for k in range(len(spec.features))])


def _partition_of(h: np.ndarray, lows: np.ndarray) -> np.ndarray:
    """Hash -> partition index; partitions are ascending hash ranges (their lower bounds ``lows``)."""
    return np.searchsorted(lows, h, side="right") - 1


def _lows(lo: int, hi: int, k: int) -> np.ndarray:
    """Lower bounds of k even sub-ranges of the hash range [lo, hi)."""
    return np.array([lo + (hi - lo) * j // k for j in range(k)], dtype=np.uint64)


class _Spiller:
    """Rows -> one Arrow IPC file per hash-range partition, buffered up to ``flush_bytes``."""

    def __init__(self, folder: Path, schema: pa.Schema, lows: np.ndarray, flush_bytes: int):
        self.folder, self.schema, self.lows, self.flush_bytes = folder, schema, lows, flush_bytes
        self.buffers: dict[int, list[pa.Table]] = {}
        self.buffered = 0
        self.writers: dict[int, Any] = {}
        self.sinks: dict[int, Any] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        part = _partition_of(table.column("uh").to_numpy(), self.lows)
        if len(self.lows) == 1:
            self.buffers.setdefault(0, []).append(table)
            self.buffered += table.nbytes
            if self.buffered >= self.flush_bytes:
                self.flush()
            return
        order = _argsort_small(part)
        ps = part[order]
        table = table.take(pa.array(order))
        cuts = np.searchsorted(ps, np.arange(len(self.lows) + 1))
        for p in _distinct(ps):
            a, b = int(cuts[p]), int(cuts[p + 1])
            self.buffers.setdefault(int(p), []).append(table.slice(a, b - a))
        self.buffered += table.nbytes
        if self.buffered >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        for p, parts in sorted(self.buffers.items()):
            if p not in self.writers:
                self.sinks[p] = pa.OSFile(str(self.folder / f"p{p:05d}.arrow"), "wb")
                self.writers[p] = paipc.new_file(self.sinks[p], self.schema)
            self.writers[p].write_table(pa.concat_tables(parts).combine_chunks())
        self.buffers, self.buffered = {}, 0
        _release()

    def close(self) -> dict[int, str]:
        """Flush and close; returns {partition: spill file path}."""
        self.flush()
        for p in self.writers:
            self.writers[p].close()
            self.sinks[p].close()
        return {p: str(self.folder / f"p{p:05d}.arrow") for p in self.writers}


def _scan_task(task: dict[str, Any]) -> dict[str, Any]:
    """Pass 1 over some files (one worker): read, check, convert, hash, spill by user-hash range, and collect
    the item / feature vocabularies. Returns per-file facts, vocabularies, spill files, bad rows (quarantine:
    written to a per-task JSONL) or the first BadRowError as a dict (error mode)."""
    _bound_allocators()
    spec: _Spec = task["spec"]
    files: list[tuple[int, SourceFile]] = task["files"]
    folder = Path(task["folder"])
    spiller = _Spiller(folder, _spill_schema(spec), task["lows"], task["flush_bytes"])
    items = _Vocab(spec.item, spec.kinds[spec.item])
    feats = {c: _Vocab(c, spec.kinds[c]) for c in spec.features}
    qfile = None
    out: dict[str, Any] = {"files": [], "error": None}
    try:
        for idx, f in files:
            facts = {"index": idx, "rows": 0, "good": 0, "bad": 0, "by_reason": {}, "quarantine": None,
                     "numeric_times": 0, "early_times": 0, "early_example": None}
            hashers: list[_HashingReader] = []
            try:
                if f.fmt == "parquet":
                    chunks = _read_parquet(f, idx, spec, task["batch_rows"])
                elif f.fmt == "amazon-seq":
                    chunks = _read_seq(f, idx, spec, task["block_bytes"], hashers)
                else:
                    chunks = _read_csv(f, idx, spec, task["block_bytes"], hashers)
                for chunk in chunks:
                    conv, bad = _convert(chunk, spec, f.display)
                    if bad and not spec.quarantine:
                        out["error"] = bad[0]
                        return out
                    if bad and qfile is None:
                        facts["quarantine"] = str(folder / f"q{idx:06d}.jsonl")
                        qfile = open(facts["quarantine"], "w", encoding="utf-8")
                    for r in bad:
                        facts["by_reason"][r["reason"]] = facts["by_reason"].get(r["reason"], 0) + 1
                        qfile.write(json.dumps(r, sort_keys=True) + "\n")
                    facts["bad"] += len(bad)
                    facts["good"] += conv.rows
                    facts["numeric_times"] += conv.numeric_times
                    facts["early_times"] += conv.early_times
                    facts["early_example"] = facts["early_example"] or conv.early_example
                    facts["rows"] += (len(_distinct(chunk.lines)) if spec.fmt == "amazon-seq" else len(chunk.lines)) \
                        + len(chunk.bad)
                    if conv.rows == 0:
                        continue
                    uh = _dict_hash(conv.user)[0]
                    ih, iu, iuh = _dict_hash(conv.item)
                    items.add(iuh, iu)
                    cols = {"uh": pa.array(uh), "user": conv.user, "ih": pa.array(ih),
                            "rating": pa.array(conv.rating), "ts": pa.array(conv.ts), "seq": pa.array(conv.seq)}
                    for k, c in enumerate(spec.features):
                        a = conv.features[c]
                        fh, fu, fuh = _dict_hash(a)
                        feats[c].add(fuh, fu)
                        cols[f"f{k}"] = pa.array(fh, mask=_nullmask(a))
                    spiller.add(pa.table(cols, schema=spiller.schema))
            except InputError:
                raise
            except pa.ArrowInvalid as e:
                raise InputError(f"{f.display}: cannot read it ({_one_line(e)})") from None
            except OSError as e:
                raise InputError(f"{f.display}: cannot read it ({_one_line(e)})") from None
            if hashers:
                facts["sha256"], facts["bytes"] = hashers[0].sha.hexdigest(), hashers[0].nbytes
            else:
                facts["sha256"], facts["bytes"] = _sha256_stream(f)
            if qfile is not None:
                qfile.close()
                qfile = None
            if spec.fmt == "amazon-seq":  # rows = lines (the bad-row unit); good = lines that gave tokens
                facts["good_lines"] = facts["rows"] - facts["bad"]
            out["files"].append(facts)
    finally:
        if qfile is not None:
            qfile.close()
        out["spill"] = spiller.close()
    out["items"] = items.state()
    out["features"] = {c: v.state() for c, v in feats.items()}
    out["peak_rss"] = _peak_rss()["self"]
    return out


# ------------------------------------------------------------------------------------------------ pass 2: encode

def _read_ipc(paths: list[str], columns: list[str] | None = None) -> pa.Table:
    tables = [paipc.open_file(pa.memory_map(p)).read_all() for p in paths]
    if columns is not None:
        tables = [t.select(columns) for t in tables]
    return pa.concat_tables(tables) if tables else None


def _split_partition(paths: list[str], lo: int, hi: int, k: int, folder: Path, schema: pa.Schema
                     ) -> list[tuple[int, int, list[str]]]:
    """Re-partition an oversized partition [lo, hi) into k hash sub-ranges, streaming its spill files batch by
    batch. Returns [(lo, hi, [file])] in hash order (empty ranges dropped)."""
    lows = _lows(lo, hi, k)
    folder.mkdir(parents=True, exist_ok=True)
    sp = _Spiller(folder, schema, lows, 1 << 26)
    for p in paths:
        r = paipc.open_file(pa.memory_map(p))
        for i in range(r.num_record_batches):
            sp.add(pa.Table.from_batches([r.get_batch(i)]))
            sp.flush()
    files = sp.close()
    bounds = [int(x) for x in lows] + [hi]
    return [(bounds[j], bounds[j + 1], [files[j]]) for j in range(k) if j in files]


def _encode_task(task: dict[str, Any]) -> dict[str, Any]:
    """Pass 2 for one partition: sort its rows by (user hash, user, time, input position), map items and
    feature values to vocabulary ranks, and write two IPC files (rows; users with their lengths)."""
    _bound_allocators()
    spec: _Spec = task["spec"]
    vocabs: dict[str, _Vocab] = task["vocabs"] if "vocabs" in task else _load_vocabs(task["vocab_file"], spec)
    t = _read_ipc(task["files"])
    uh = _np(t.column("uh"), np.uint64)
    ts = _np(t.column("ts"), np.int64)
    seq = _np(t.column("seq"), np.int64)
    user = t.column("user")
    order = np.lexsort((seq, ts, uh))
    uh_s = uh[order]
    new = np.empty(uh_s.size, bool)
    new[:1] = True
    np.not_equal(uh_s[1:], uh_s[:-1], out=new[1:])
    if spec.kinds[spec.user] == "string" and pc.count_distinct(user).as_py() != int(new.sum()):
        # two users share a 64-bit hash: order by (hash, raw id, time, position) instead
        order = pc.sort_indices(pa.table({"uh": uh, "user": user, "ts": ts, "seq": seq}),
                                sort_keys=[("uh", "ascending"), ("user", "ascending"), ("ts", "ascending"),
                                           ("seq", "ascending")]).to_numpy()
        uh_s, us = uh[order], user.take(pa.array(order))
        new[1:] = (uh_s[1:] != uh_s[:-1]) | ~pc.equal(us.slice(1), us.slice(0, len(us) - 1)).to_numpy(
            zero_copy_only=False)
    starts = np.flatnonzero(new)
    lengths = np.diff(np.append(starts, uh_s.size)).astype(np.int64)
    cols = {"item": pa.array(vocabs["__item__"].lookup(_np(t.column("ih"), np.uint64)[order]).astype(np.int32)),
            "rating": pa.array(_np(t.column("rating"), np.int8)[order]), "ts": pa.array(ts[order])}
    for k, c in enumerate(spec.features):
        a = t.column(f"f{k}")
        valid = ~_nullmask(a)[order]
        fh = _np(a, np.uint64)[order]
        r = np.full(fh.size, -1, np.int32)
        r[valid] = vocabs[c].lookup(fh[valid]).astype(np.int32)
        cols[f"f{k}"] = pa.array(r)
    rows = pa.table(cols)
    users = pa.table({"user": user.take(pa.array(order[starts])), "length": pa.array(lengths)})
    j = task["index"]
    folder = Path(task["folder"])
    rpath, upath = folder / f"rows{j:05d}.arrow", folder / f"users{j:05d}.arrow"
    for path, table in ((rpath, rows), (upath, users)):
        with pa.OSFile(str(path), "wb") as sink, paipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    del t, rows, users, cols
    _release()
    return {"index": j, "rows_file": str(rpath), "users_file": str(upath), "users": int(starts.size),
            "rows": int(uh.size), "peak_rss": _peak_rss()["self"]}


def _save_vocabs(vocabs: dict[str, _Vocab], spec: _Spec, path: Path) -> None:
    cols = {}
    for name, v in vocabs.items():
        cols[name] = (v.h, v.rank_by_h)
    with open(path, "wb") as f:
        np.savez(f, **{f"h_{i}": cols[n][0] for i, n in enumerate(cols)},
                 **{f"r_{i}": cols[n][1] for i, n in enumerate(cols)})
    (path.with_suffix(".json")).write_text(json.dumps(list(cols)))


def _load_vocabs(path: str, spec: _Spec) -> dict[str, _Vocab]:
    names = json.loads(Path(path).with_suffix(".json").read_text())
    data = np.load(path)
    out = {}
    for i, n in enumerate(names):
        v = _Vocab(n, "int")
        v.h, v.rank_by_h = data[f"h_{i}"], data[f"r_{i}"]
        out[n] = v
    return out


# ------------------------------------------------------------------------------------------------ k-core

def _kcore_task(task: dict[str, Any]) -> dict[str, Any]:
    """One k-core pass over one encoded partition: with the items still kept, which users keep >= k rows, and
    how many kept rows each item (and, on request, each feature value) has."""
    rows = paipc.open_file(pa.memory_map(task["rows_file"])).read_all()
    lengths = paipc.open_file(pa.memory_map(task["users_file"])).read_all().column("length").to_numpy()
    item = rows.column("item").to_numpy()
    row_ok = task["item_ok"][item]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    kept = np.add.reduceat(row_ok.astype(np.int64), starts) if lengths.size else np.zeros(0, np.int64)
    user_ok = kept >= task["k"]
    keep = row_ok & np.repeat(user_ok, lengths)
    out = {"index": task["index"], "item_counts": np.bincount(item[keep], minlength=task["num_items"]),
           "users": int(user_ok.sum()), "rows": int(keep.sum())}
    if task["features"]:
        out["feature_counts"] = {}
        for k, (name, size) in enumerate(task["features"]):
            f = rows.column(f"f{k}").to_numpy()[keep]
            out["feature_counts"][name] = np.bincount(f[f >= 0], minlength=size)
    return out


# ------------------------------------------------------------------------------------------------ pass 3: write

class _Assembler:
    """Per-user rows in dense-id order -> history files of planned row groups (+ users.parquet alongside)."""

    def __init__(self, tmp: Path, schema: pa.Schema, users_schema: pa.Schema, plan: list[list[int]],
                 max_rg_bytes: int, features: list[str]):
        self.tmp, self.schema, self.users_schema, self.plan = tmp, schema, users_schema, plan
        self.rg_sizes = [(fi, g, n) for fi, groups in enumerate(plan) for g, n in enumerate(groups)]
        self.pos = 0  # next row group
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.next_user = 1
        self.writer = None
        self.users_writer = pq.ParquetWriter(str(tmp / USERS_FILE), users_schema)
        self.files: list[dict[str, Any]] = []
        self.shards: list[dict[str, Any]] = []
        self.max_rg_bytes = max_rg_bytes
        self.features = features
        self.bytes_per_token = 17 + 8 * len(features)

    def add(self, table: pa.Table) -> None:
        """table: user_raw + list columns, users in dense order (any number)."""
        while table.num_rows:
            fi, g, need = self.rg_sizes[self.pos]
            take = min(need - self.pending_rows, table.num_rows)
            self.pending.append(table.slice(0, take))
            self.pending_rows += take
            table = table.slice(take)
            if self.pending_rows == need:
                self._write_group()

    def _write_group(self) -> None:
        fi, g, n = self.rg_sizes[self.pos]
        rg = pa.concat_tables(self.pending).combine_chunks()
        self.pending, self.pending_rows = [], 0
        lens = pc.list_value_length(rg.column("item_ids")).to_numpy().astype(np.int64)
        tokens = int(lens.sum())
        if tokens * self.bytes_per_token > self.max_rg_bytes:
            raise ValueError(f"a history row group would hold {tokens} interactions (~{tokens * self.bytes_per_token >> 20}"
                             f" MiB), more than the memory budget allows; pass a larger --num-files or "
                             "--memory-budget")
        ids = np.arange(self.next_user, self.next_user + n, dtype=np.int64)
        self.next_user += n
        rel = f"{HISTORIES_DIR}/part-{fi:05d}.parquet"
        if g == 0:
            self.writer = pq.ParquetWriter(str(self.tmp / rel), self.schema)
            self.files.append({"path": rel, "rows": 0, "tokens": 0, "first_user_id": int(ids[0])})
        hist = pa.Table.from_arrays([pa.array(ids)] + [rg.column(c) for c in self.schema.names[1:]],
                                    schema=self.schema)
        self.writer.write_table(hist, row_group_size=n)
        users = pa.Table.from_arrays([pa.array(ids), rg.column("user_raw")], schema=self.users_schema)
        self.users_writer.write_table(users, row_group_size=n)
        f = self.files[-1]
        f["rows"] += n
        f["tokens"] += tokens
        f["last_user_id"] = int(ids[-1])
        self.shards.append({"index": len(self.shards), "file": rel, "row_group": g, "rows": n, "tokens": tokens,
                            "first_user_id": int(ids[0]), "last_user_id": int(ids[-1]),
                            "split_users": int((lens >= MIN_HISTORY_FOR_SPLITS).sum())})
        self.pos += 1
        if g == len(self.plan[fi]) - 1:
            self.writer.close()
            self.writer = None
            _fsync_path(self.tmp / rel)
            f["sha256"] = _file_sha256(self.tmp / rel)
            f["row_groups"] = pq.ParquetFile(self.tmp / rel).num_row_groups
            if f["row_groups"] != len(self.plan[fi]):
                raise AssertionError(f"{rel}: row groups written differ from the shard plan")
            self.files[-1] = {k: f[k] for k in ("path", "rows", "tokens", "sha256", "row_groups", "first_user_id",
                                                "last_user_id")}

    def close(self) -> None:
        if self.pos != len(self.rg_sizes) or self.pending:
            raise AssertionError("histories: users written differ from the plan")
        self.users_writer.close()
        _fsync_path(self.tmp / USERS_FILE)


def _row_group_plan(n_users: int, num_files: int, row_groups_per_file: int) -> list[list[int]]:
    """Users per row group of each history file: as prepare_movielens (array_split over files, then
    ceil(rows / row_groups_per_file) per group)."""
    plan = []
    for rows in np.array_split(np.arange(n_users), min(num_files, n_users)):
        m = int(rows.size)
        rg = -(-m // row_groups_per_file)
        plan.append([min(rg, m - s) for s in range(0, m, rg)])
    return plan


def _list(lengths: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
    off = np.zeros(lengths.size + 1, np.int32)
    np.cumsum(lengths, out=off[1:])
    return pa.ListArray.from_arrays(pa.array(off), pa.array(values, typ))


# ------------------------------------------------------------------------------------------------ driver

class _Pool:
    """Runs task functions in ``workers`` spawned processes, or in this process for workers == 1."""

    def __init__(self, workers: int):
        self.workers = workers
        self.ex = (cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
                   if workers > 1 else None)

    def map(self, fn: Callable, tasks: list, progress=None) -> list:
        if self.ex is None:
            out = []
            for t in tasks:
                out.append(fn(t))
                if progress is not None:
                    progress.update(1)
            return out
        futs = [self.ex.submit(fn, t) for t in tasks]
        try:
            for fut in cf.as_completed(futs):
                fut.result()
                if progress is not None:
                    progress.update(1)
        except BaseException:
            for fut in futs:
                fut.cancel()
            raise
        return [fut.result() for fut in futs]

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown(wait=True, cancel_futures=True)


def _bar(progress: bool, **kw):
    from tqdm import tqdm

    return tqdm(disable=not progress or None, leave=False, **kw)


def _check_replaceable(out: Path, files: list[SourceFile]) -> dict[str, Any] | None:
    """:func:`pipelines.movielens.check_replaceable` with this preparation's local source files."""
    return check_replaceable(out, [(Path(f.path), f.display) for f in files
                                   if isinstance(f.fs, pafs.LocalFileSystem)])


def prepare_interactions(src: str | list[str], out: str | Path, *, fmt: str = "auto", user_col: str | None = None,
                         item_col: str | None = None, time_col: str | None = None, rating_col: str | None = None,
                         feature_cols: list[str] | tuple[str, ...] = (), id_type: str = "auto",
                         time_unit: str = "s", delimiter: str | None = None, k_core: int = 0,
                         on_bad_rows: str = "error", num_files: int = 0,
                         row_groups_per_file: int = ROW_GROUPS_PER_FILE,
                         memory_budget: str | int = DEFAULT_MEMORY_BUDGET, workers: int = 1,
                         progress: bool = True, _tuning: dict[str, int] | None = None) -> dict[str, Any]:
    """Convert interaction logs to a prepared folder; returns the manifest (also written). See the module
    docstring for the formats, units, id order, bad-row policy and memory bound.

    src: one or more files / folders / globs / URIs. out: the prepared folder (replaced atomically when it holds
    an earlier preparation; any other non-empty folder is refused). fmt: one of :data:`FORMATS`.
    user_col / item_col / time_col (defaults user_id / item_id / timestamp; fixed for the Amazon formats),
    rating_col (stars 0..5; default none: ratings 0), feature_cols: categorical columns carried as
    ``feat_<name>``. id_type: "auto" (Parquet: the column type; CSV: text), "string" or "int". time_unit: unit of
    numeric times. delimiter: CSV field separator (default ",", "\\t" for .tsv; the two characters ``\\t``: a
    tab). k_core: 0 (off) or K >= 2.
    on_bad_rows: "error" | "quarantine". num_files: history files (0: max(8, ceil(interactions / 2**20)); capped
    at the user count, logged at INFO when it is). memory_budget: bytes or a size string (>= 256 MiB). workers:
    processes for passes 1-2. progress: tqdm bars on stderr. _tuning: tests only: overrides of the sizes derived from the budget
    (``part_bytes``, ``block_bytes``, ``flush_bytes``, ``split_bytes``) to force many partitions on small input.

    Raises BadRowError (a ValueError) at the first bad row in error mode, InputError (a ValueError) for bad
    input as a whole, FileNotFoundError for a source that matches nothing, ValueError for bad arguments or when
    no valid row is left.
    """
    t0 = time.perf_counter()
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if on_bad_rows not in ("error", "quarantine"):
        raise ValueError(f"--on-bad-rows: expected 'error' or 'quarantine', got {on_bad_rows!r}")
    if id_type not in ID_TYPES:
        raise ValueError(f"--id-type {id_type!r}: expected one of {', '.join(ID_TYPES)}")
    if time_unit not in TIME_UNITS:
        raise ValueError(f"--time-unit {time_unit!r}: expected one of {', '.join(TIME_UNITS)}")
    if k_core < 0 or k_core == 1:
        raise ValueError(f"--k-core {k_core}: expected 0 (off) or >= 2")
    check_num_files(num_files, auto=True)
    if row_groups_per_file < 1:
        raise ValueError(f"row_groups_per_file: expected >= 1, got {row_groups_per_file}")
    if workers < 1:
        raise ValueError(f"--workers {workers}: expected >= 1")
    budget = parse_memory_budget(memory_budget)
    feature_cols = [c for c in feature_cols if c]
    if fmt in amazon.FORMATS:
        given = [n for n, v in (("--user-col", user_col), ("--item-col", item_col), ("--time-col", time_col),
                                ("--rating-col", rating_col), ("--feature-cols", feature_cols)) if v]
        if given:
            raise ValueError(f"--format {fmt} has fixed columns; {', '.join(given)} cannot be set")
        user_col, item_col = "user", "item"
        time_col, rating_col = ("timestamp", "rating") if fmt == "amazon-ratings" else (None, None)
    else:
        user_col, item_col, time_col = user_col or "user_id", item_col or "item_id", time_col or "timestamp"
    named = [c for c in (user_col, item_col, time_col, rating_col, *feature_cols) if c]
    dup = sorted({c for c in named if named.count(c) > 1})
    if dup:
        raise ValueError(f"column {dup[0]!r} is named for more than one role (--user-col, --item-col, --time-col, "
                         "--rating-col, --feature-cols must be distinct)")
    for c in feature_cols:  # the model's rule (schema.feature_column): checked here, not a minute into training
        if not FEATURE_NAME_RE.fullmatch(c):
            hint = re.sub(r"[^a-z0-9_]", "_", c.lower()).lstrip("_0123456789")[:64] or "f"
            raise ValueError(f"--feature-cols {c!r}: a feature name must be lowercase letters, digits and _, starting "
                             f"with a letter (at most 64 characters): it names the {FEATURE_PREFIX}<name> column the "
                             f"model reads and features/<name>.parquet; rename the source column (e.g. to {hint!r})")

    files = resolve_sources(src, "csv" if fmt == "amazon-ratings" else fmt)
    input_fmt = fmt if fmt in amazon.FORMATS else files[0].fmt
    if delimiter is None:
        delimiter = "\t" if input_fmt == "csv" and all(_split_ext(f.path)[0] == ".tsv" for f in files) else ","
    if delimiter == "\\t":  # typed as backslash-t (a shell passes it unchanged): a tab
        delimiter = "\t"
    if len(delimiter) != 1:
        raise ValueError(f"--delimiter {delimiter!r}: expected one character (a tab: '\\t')")
    spec = _Spec(fmt=input_fmt, user=user_col, item=item_col, time=time_col, rating=rating_col,
                 features=list(feature_cols), kinds={}, id_type=id_type, time_unit=time_unit, delimiter=delimiter,
                 quarantine=on_bad_rows == "quarantine", header=input_fmt == "csv")
    if input_fmt in amazon.FORMATS:
        files = [dataclasses.replace(f, fmt="amazon-seq" if input_fmt == "amazon-seq" else "csv") for f in files]
    out = Path(out)
    if out.is_symlink():
        out = out.resolve()
    prev_manifest = _check_replaceable(out, files)
    est = _inspect(files, spec)

    # The budget covers every process: each needs PROCESS_BASELINE, the rest is the rows' working set.
    procs = workers + (1 if workers > 1 else 0)
    per_worker = (budget - procs * PROCESS_BASELINE) // workers
    if per_worker < MIN_WORK_BYTES:
        raise ValueError(f"--memory-budget {budget >> 20} MiB is too small for {workers} worker(s): each process "
                         f"needs ~{PROCESS_BASELINE >> 20} MiB before any rows plus {MIN_WORK_BYTES >> 20} MiB to work "
                         f"in; give at least {(procs * PROCESS_BASELINE + workers * MIN_WORK_BYTES) >> 20} MiB or "
                         "fewer --workers")
    part_bytes = max(per_worker // 8, 4 << 20)
    n_parts = int(min(1024, max(1, math.ceil(sum(est.values()) / part_bytes))))
    lows = _lows(0, 1 << 64, n_parts)
    # pyarrow's streaming CSV reader keeps several blocks in flight (measured ~10 x block_size of RSS)
    block_bytes = int(min(max(per_worker // 64, 1 << 20), 64 << 20))
    tune = dict(_tuning or {})
    if tune:
        part_bytes = tune.get("part_bytes", part_bytes)
        n_parts = int(min(1024, max(1, math.ceil(sum(est.values()) / part_bytes))))
        lows = _lows(0, 1 << 64, n_parts)
        block_bytes = tune.get("block_bytes", block_bytes)
    log.info("preparing %d file(s) (%s) into %s: budget %d MiB, %d worker(s), %d partitions", len(files),
             input_fmt, out, budget >> 20, workers, n_parts)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = None
    try:
        work = tmp / "_work"
        work.mkdir(parents=True)
        pool = _Pool(workers)
        # ---- pass 1: read, check, spill by user-hash range
        order = sorted(range(len(files)), key=lambda i: -files[i].size)
        n_tasks = min(len(files), 4 * workers) if workers > 1 else 1
        groups: list[list[int]] = [[] for _ in range(n_tasks)]
        loads = [0] * n_tasks
        for i in order:  # largest first onto the least loaded task
            j = loads.index(min(loads))
            groups[j].append(i)
            loads[j] += files[i].size
        tasks = [{"spec": spec, "files": [(i, files[i]) for i in sorted(g)], "folder": str(work / f"t{j:04d}"),
                  "lows": lows, "flush_bytes": tune.get("flush_bytes", per_worker // 6), "block_bytes": block_bytes,
                  "batch_rows": max(4096, block_bytes // 64)} for j, g in enumerate(groups) if g]
        with _bar(progress, total=len(tasks), desc="read", unit="task") as bar:
            scans = pool.map(_scan_task, tasks, bar)
        errors = [s["error"] for s in scans if s["error"]]
        if errors:
            first = min(errors, key=lambda r: (next(i for i, f in enumerate(files) if f.display == r["file"]),
                                               r["line"]))
            raise BadRowError(first["file"], first["line"], first["field"], first["reason"], first["problem"])
        facts = sorted((f for s in scans for f in s["files"]), key=lambda f: f["index"])
        items = _Vocab(spec.item, spec.kinds[spec.item])
        fvocab = {c: _Vocab(c, spec.kinds[c]) for c in spec.features}
        for s in scans:
            items.add(*s["items"])
            for c in spec.features:
                fvocab[c].add(*s["features"][c])
        items.finalize()
        for v in fvocab.values():
            v.finalize()
        good_rows = sum(f["good"] for f in facts)
        n_bad = sum(f["bad"] for f in facts)
        source_rows = sum(f["rows"] for f in facts)
        if good_rows == 0:
            why = (f"{n_bad} bad rows quarantined{_first_bad(facts)}" if n_bad
                   else "the files hold a header and no data rows")
            raise ValueError(f"{', '.join(files[i].display for i in range(min(3, len(files))))}"
                             f"{' ...' if len(files) > 3 else ''}: no valid interaction rows ({why})")
        vocab_bytes = items.h.nbytes * 2 + items.raw.nbytes + sum(v.h.nbytes * 2 + v.raw.nbytes for v in fvocab.values())
        unit_check = None if spec.time is None else time_unit_warning(
            spec.time_unit, sum(f["numeric_times"] for f in facts), sum(f["early_times"] for f in facts),
            next((f["early_example"] for f in facts if f["early_example"]), None), spec.time)

        _phase("pass 1 (read, check, spill)", t0, f"{source_rows} rows, {n_bad} bad, {len(items.h)} items")
        # ---- pass 2: per partition (split again where it came out too large): sort, encode
        parts: list[tuple[int, int, list[str]]] = []
        bounds = [int(x) for x in lows] + [1 << 64]
        schema = _spill_schema(spec)
        limit = tune.get("split_bytes", max(per_worker - vocab_bytes, per_worker // 2) // 5)
        for p in range(n_parts):
            paths = [s["spill"][p] for s in scans if p in s["spill"]]
            if not paths:
                continue
            queue = [(bounds[p], bounds[p + 1], paths)]
            while queue:
                lo, hi, ps = queue.pop(0)
                size = sum(os.path.getsize(x) for x in ps)
                if size > limit and hi - lo > 1 and len(parts) < 1 << 16:
                    k = min(256, math.ceil(size / limit) * 2)
                    sub = _split_partition(ps, lo, hi, k, work / f"split{len(parts):05d}_{lo:x}", schema)
                    if len(sub) > 1:
                        queue = sub + queue
                        continue
                    ps = sub[0][2] if sub else ps
                parts.append((lo, hi, ps))
        spill_bytes = sum(os.path.getsize(x) for _, _, ps in parts for x in ps)
        vocab_map = {"__item__": items, **fvocab}
        enc_dir = work / "enc"
        enc_dir.mkdir()
        etasks = [{"spec": spec, "files": ps, "index": j, "folder": str(enc_dir)} for j, (lo, hi, ps) in
                  enumerate(parts)]
        if workers > 1:
            _save_vocabs(vocab_map, spec, work / "vocab.npz")
            for t in etasks:
                t["vocab_file"] = str(work / "vocab.npz")
        else:
            for t in etasks:
                t["vocabs"] = vocab_map
        with _bar(progress, total=len(etasks), desc="group", unit="part") as bar:
            encs = sorted(pool.map(_encode_task, etasks, bar), key=lambda e: e["index"])
        for lo, hi, ps in parts:  # spill files are no longer needed
            for x in ps:
                os.remove(x)

        _phase("pass 2 (group users)", t0, f"{len(parts)} partitions, {sum(e['users'] for e in encs)} users")
        # ---- k-core: iterate cheap passes over the encoded partitions
        n_vocab = len(items.h)
        item_ok = np.ones(n_vocab, bool)
        feat_used = {c: np.ones(len(v.h), bool) for c, v in fvocab.items()}
        user_counts = [e["users"] for e in encs]
        kcore_facts = None
        if k_core:
            it = 0
            with _bar(progress, desc=f"{k_core}-core", unit="pass") as bar:
                while True:
                    it += 1
                    ktasks = [{"index": e["index"], "rows_file": e["rows_file"], "users_file": e["users_file"],
                               "item_ok": item_ok, "k": k_core, "num_items": n_vocab,
                               "features": [(c, len(fvocab[c].h)) for c in spec.features]} for e in encs]
                    res = sorted(pool.map(_kcore_task, ktasks), key=lambda r: r["index"])
                    counts = np.sum([r["item_counts"] for r in res], axis=0)
                    new_ok = item_ok & (counts >= k_core)
                    bar.update(1)
                    if np.array_equal(new_ok, item_ok):
                        break
                    item_ok = new_ok
            user_counts = [r["users"] for r in res]
            for c in spec.features:
                feat_used[c] = np.sum([r["feature_counts"][c] for r in res], axis=0) > 0
            kept_rows = sum(r["rows"] for r in res)
            kcore_facts = {"k": k_core, "iterations": it, "interactions_before": good_rows,
                           "users_before": sum(e["users"] for e in encs), "items_before": n_vocab,
                           "removed_interactions": good_rows - kept_rows,
                           "removed_users": sum(e["users"] for e in encs) - sum(user_counts),
                           "removed_items": n_vocab - int(item_ok.sum())}
            if kept_rows == 0:
                raise ValueError(f"--k-core {k_core}: no interactions are left (every user or item has fewer than "
                                 f"{k_core}); lower --k-core")
        pool.close()
        pool = None

        # ---- pass 3: dense ids, history files, id maps
        n_users = int(sum(user_counts))
        item_dense = np.cumsum(item_ok).astype(np.int64)  # rank -> dense id (valid where item_ok)
        n_items = int(item_ok.sum())
        feat_dense = {c: np.cumsum(u).astype(np.int64) for c, u in feat_used.items()}
        feat_card = {c: int(u.sum()) for c, u in feat_used.items()}
        tokens_total = good_rows if not k_core else kcore_facts["interactions_before"] - kcore_facts["removed_interactions"]
        auto = num_files == 0
        if auto:
            num_files = max(DEFAULT_NUM_FILES, math.ceil(tokens_total / TOKENS_PER_FILE_AUTO))
        plan = _row_group_plan(n_users, num_files, row_groups_per_file)
        if len(plan) < num_files:
            log_capped_files(log, out, len(plan), f"{num_files} (--num-files 0 = auto)" if auto else num_files, n_users)
        raw_user_t = pa.int64() if spec.kinds[spec.user] == "int" else pa.string()
        hist_schema = pa.schema(list(HISTORY_SCHEMA) + [pa.field(FEATURE_PREFIX + c, pa.list_(pa.int64()))
                                                        for c in spec.features])
        users_schema = pa.schema([("user_id", pa.int64()), ("raw_user_id", raw_user_t)])
        (tmp / HISTORIES_DIR).mkdir()
        asm = _Assembler(tmp, hist_schema, users_schema, plan, (budget - PROCESS_BASELINE - vocab_bytes) // 4,
                         spec.features)
        len_hist: dict[int, int] = {}
        rating_values: set[int] = set()
        repeated = duplicates = 0
        t_min, t_max = None, None
        with _bar(progress, total=len(encs), desc="write", unit="part") as bar:
            for e in encs:
                rows = paipc.open_file(pa.memory_map(e["rows_file"])).read_all().combine_chunks()
                users = paipc.open_file(pa.memory_map(e["users_file"])).read_all()
                lengths = users.column("length").to_numpy()
                rank = rows.column("item").to_numpy()
                user_raw = users.column("user").combine_chunks()
                if k_core:
                    row_ok = item_ok[rank]
                    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
                    kept = np.add.reduceat(row_ok.astype(np.int64), starts) if lengths.size else lengths
                    user_ok = kept >= k_core
                    keep = row_ok & np.repeat(user_ok, lengths)
                    rows = rows.filter(pa.array(keep))
                    rank = rank[keep]
                    lengths = kept[user_ok]
                    user_raw = user_raw.filter(pa.array(user_ok))
                if not lengths.size:
                    bar.update(1)
                    continue
                dense = item_dense[rank]
                ts = rows.column("ts").to_numpy()
                if spec.time is None:  # positions in each user's sequence
                    starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
                    ts = np.arange(ts.size, dtype=np.int64) - starts
                if spec.time is not None:
                    lo, hi = int(ts.min()), int(ts.max())
                    t_min, t_max = lo if t_min is None else min(t_min, lo), hi if t_max is None else max(t_max, hi)
                ratings = rows.column("rating").to_numpy()
                uid = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
                repeated += int(dense.size - _distinct(uid * (n_items + 1) + dense).size)
                # rows are in (user, time) order: number each run of one user's equal times, then count repeats
                # of (run, item), i.e. of (user, item, time)
                run_id = np.cumsum(np.concatenate([[True], (uid[1:] != uid[:-1]) | (ts[1:] != ts[:-1])]))
                duplicates += int(dense.size - _distinct(run_id * (n_items + 1) + dense).size)
                rating_values.update(int(v) for v in np.flatnonzero(np.bincount(ratings.astype(np.int64), minlength=11)))
                lv, lc = np.unique(lengths, return_counts=True)  # sort-based (return_counts)
                for v, c in zip(lv.tolist(), lc.tolist()):
                    len_hist[v] = len_hist.get(v, 0) + c
                arrays = [user_raw, _list(lengths, dense, pa.int64()), _list(lengths, ratings, pa.int8()),
                          _list(lengths, ts, pa.int64())]
                for k, c in enumerate(spec.features):
                    r = rows.column(f"f{k}").to_numpy()
                    fv = np.where(r >= 0, feat_dense[c][np.maximum(r, 0)], 0)
                    arrays.append(_list(lengths, fv, pa.int64()))
                asm.add(pa.Table.from_arrays(arrays, names=["user_raw", *hist_schema.names[1:]]))
                del rows, users, arrays
                _release()
                bar.update(1)
        asm.close()

        _phase("pass 3 (write histories)", t0, f"{n_users} users in {len(asm.files)} files")
        keep_items = pa.array(item_ok)
        raw_items = items.sorted_raw.filter(keep_items) if k_core else items.sorted_raw
        items_t = pa.table({"item_id": pa.array(np.arange(1, n_items + 1), pa.int64()), "raw_item_id": raw_items})
        pq.write_table(items_t, tmp / ITEMS_FILE)
        _fsync_path(tmp / ITEMS_FILE)
        feature_files = {}
        if spec.features:
            (tmp / FEATURES_DIR).mkdir()
        for c in spec.features:
            raw = fvocab[c].sorted_raw.filter(pa.array(feat_used[c]))
            rel = f"{FEATURES_DIR}/{c}.parquet"
            pq.write_table(pa.table({"id": pa.array(np.arange(1, feat_card[c] + 1), pa.int64()), "raw": raw}),
                           tmp / rel)
            _fsync_path(tmp / rel)
            feature_files[c] = rel

        reasons: dict[str, int] = {}
        for f in facts:
            for k, v in f["by_reason"].items():
                reasons[k] = reasons.get(k, 0) + v
        if spec.quarantine:
            with open(tmp / QUARANTINE_FILE, "wb") as qf:  # per-file records, in file order
                for f in facts:
                    if f["quarantine"]:
                        with open(f["quarantine"], "rb") as src_q:
                            shutil.copyfileobj(src_q, qf)
                qf.flush()
                os.fsync(qf.fileno())
        if source_rows != (sum(f.get("good_lines", f["good"]) for f in facts) + n_bad):
            raise AssertionError(f"source rows {source_rows} != good + quarantined")

        from importlib.metadata import version  # the installed gemray's (the gemray package sits above pipelines)

        lengths_sorted = sorted(len_hist.items())
        too_short = sum(c for v, c in lengths_sorted if v < MIN_HISTORY_FOR_SPLITS)
        manifest: dict[str, Any] = {
            "manifest_version": MANIFEST_VERSION,
            "gemray_version": version("gemray"),
            "format": "interactions" if input_fmt in ("csv", "parquet") else input_fmt,
            "input_format": input_fmt,
            "on_bad_rows": on_bad_rows,
            "source": {"uris": [str(s) for s in ([src] if isinstance(src, str) else src)],
                       "dir": _common_dir(files),
                       "files": [{"name": _rel_name(files[f["index"]], files), "uri": files[f["index"]].display,
                                  "sha256": f["sha256"], "bytes": f["bytes"]} for f in facts]},
            "columns": {"user": spec.user, "item": spec.item, "time": spec.time, "rating": spec.rating,
                        "features": spec.features, "user_id_type": spec.kinds[spec.user],
                        "item_id_type": spec.kinds[spec.item], "time_unit": spec.time_unit if spec.time else None,
                        "delimiter": spec.delimiter if input_fmt == "csv" else None},
            "time_unit": "position" if spec.time is None else "unix seconds",
            "time_range": None if t_min is None else {"min": _iso(t_min), "max": _iso(t_max), "min_unix": t_min,
                                                      "max_unix": t_max},
            "counts": {"users": n_users, "items": n_items, "interactions": tokens_total,
                       "source_rows": source_rows, "quarantined": n_bad, "repeated_user_item_rows": repeated,
                       "exact_duplicate_rows": duplicates,
                       "rows_per_file": [f["rows"] for f in asm.files],
                       "tokens_per_file": [f["tokens"] for f in asm.files]},
            "vocab": {"num_items": n_items, "max_item_id": n_items, "max_user_id": n_users,
                      "rating_unit": "half-star (int8, stars*2); 0 = no rating",
                      "rating_values": sorted(rating_values)},
            "history_length": {"min": lengths_sorted[0][0], "median": _hist_median(lengths_sorted, n_users),
                               "max": lengths_sorted[-1][0]},
            "splits": {"protocol": SPLIT_PROTOCOL, "min_history": MIN_HISTORY_FOR_SPLITS,
                       "users": n_users - too_short, "too_short_users": too_short},
            "quarantine": {"file": QUARANTINE_FILE if spec.quarantine else None, "total": n_bad,
                           "by_reason": dict(sorted(reasons.items()))},
            "k_core": kcore_facts,
            "features": {c: {"level": "token", "cardinality": feat_card[c], "column": FEATURE_PREFIX + c}
                         for c in spec.features},
            "id_maps": {"users": USERS_FILE, "items": ITEMS_FILE, "features": feature_files},
            "id_order": {"items": "ascending raw id (numeric for integer ids, UTF-8 byte order for strings)",
                         "features": "ascending raw value; 0 = missing",
                         "users": "ascending (hash_ids(raw id), raw id): splitmix64 of integer ids, FNV-1a of "
                                  "string ids then splitmix64 (gemray.pipelines.interactions.hash_ids)"},
            "files": asm.files,
            "items_file": ITEMS_FILE,
            "items_sha256": _file_sha256(tmp / ITEMS_FILE),
            "checksums": {rel: _file_sha256(tmp / rel) for rel in [USERS_FILE, *feature_files.values()]
                          + ([QUARANTINE_FILE] if spec.quarantine else [])},
            "shards": asm.shards,
            "conversion": {"reader": "pyarrow " + ("parquet" if input_fmt == "parquet" else "csv" if input_fmt != "amazon-seq"
                                                   else "text lines"), "out_of_core": "user-hash partitions"},
            "run_file": RUN_FILE,
        }
        shutil.rmtree(work)
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        peak = _peak_rss()
        run = {"created_unix": int(time.time()), "seconds": round(time.perf_counter() - t0, 3),
               "memory_budget_bytes": budget, "workers": workers, "partitions": len(parts),
               "spill_partitions_planned": n_parts, "spill_bytes": spill_bytes,
               "peak_rss_bytes": {"driver": peak["self"], "largest_worker": max(
                   [s.get("peak_rss", 0) for s in scans] + [e.get("peak_rss", 0) for e in encs]) if workers > 1
                   else peak["self"]}}
        with open(tmp / RUN_FILE, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for d in ([tmp / HISTORIES_DIR] + ([tmp / FEATURES_DIR] if spec.features else []) + [tmp]):
            _fsync_path(d)
        warn_if_replacing(out, prev_manifest, manifest, log)
        swap_into_place(tmp, out)
    except BaseException:
        if pool is not None:
            pool.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    warn_if_no_split_users(log, out, manifest)
    manifest["run"] = run  # for the caller (format_summary); not in the content manifest on disk
    if unit_check:
        log.warning("%s: %s", out, unit_check["message"])
        manifest["time_unit_check"] = unit_check  # for the caller (format_summary), as "run"
    return manifest


def time_unit_warning(unit: str, numeric: int, early: int, example: dict[str, Any] | None,
                      col: str) -> dict[str, Any] | None:
    """Pure: the warning for a --time-unit that looks too fine, or None.

    unit: --time-unit; numeric: good rows whose time was a number in it; early: those before 1990
    (:data:`MIN_PLAUSIBLE_UNIX_SECONDS`); example: the first of them (``file``, ``line``, ``value`` as shown,
    ``number``); col: the time column. A warning when the unit is not ``s`` and most (more than half) of the
    numeric times fall before 1990 (seconds read as milliseconds all land in January 1970): it names the rows, an
    example and the coarser unit in which the example is a time from 1990 to 2200 (``likely_unit``, None when
    none is). Not an error: logs this old exist. Returns {"early", "numeric", "unit", "likely_unit", "message"}."""
    if unit == "s" or numeric <= 0 or 2 * early <= numeric:
        return None
    share = f"all {numeric}" if early == numeric else f"{early} of {numeric}"
    text = f"{share} times in column {col!r} (numbers in --time-unit {unit}) are before 1990"
    likely = None
    if example is not None:
        number = example["number"]
        text += (f", e.g. {example['file']}:{example['line']}: {example['value']} is "
                 f"{_iso(int(number // TIME_UNITS[unit]))}")
        for u, factor in sorted(TIME_UNITS.items(), key=lambda x: -x[1]):  # the finest coarser unit first
            if factor < TIME_UNITS[unit] and MIN_PLAUSIBLE_UNIX_SECONDS <= number // factor < MAX_UNIX_SECONDS:
                likely = u
                text += (f"; they look like {_UNIT_NAMES[u]} ({example['value']} in {u} is "
                         f"{_iso(int(number // factor))}): prepare again with --time-unit {u}")
                break
    if likely is None:
        text += f"; check the column's unit (--time-unit {'|'.join(TIME_UNITS)})"
    text += " (the times are kept as read: logs this old exist)"
    return {"early": early, "numeric": numeric, "unit": unit, "likely_unit": likely, "message": text}


def _iso(secs: int) -> str:
    """Unix seconds -> ``2023-11-14T22:13:20Z``."""
    from datetime import datetime, timezone

    return datetime.fromtimestamp(secs, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _first_bad(facts: list[dict[str, Any]]) -> str:
    """``; the first: <file>:<line>: field <f>: <problem> [<reason>]`` from pass 1's quarantine files (they are
    deleted with the temporary folder when nothing is left to prepare), or "" when there is none."""
    for f in facts:
        if f["quarantine"]:
            with open(f["quarantine"], encoding="utf-8") as q:
                r = json.loads(q.readline())
            return f"; the first: {BadRowError(r['file'], r['line'], r['field'], r['reason'], r['problem'])}"
    return ""


def _phase(name: str, t0: float, what: str) -> None:
    log.info("%s done at %.1f s: %s; peak RSS so far %.0f MiB", name, time.perf_counter() - t0, what,
             _peak_rss()["self"] / 2**20)


def _hist_median(hist: list[tuple[int, int]], n: int) -> float:
    """Median of n values given as sorted (value, count) pairs (np.median's convention for even n)."""
    def at(k: int) -> int:
        seen = 0
        for v, c in hist:
            seen += c
            if seen > k:
                return v
        raise AssertionError("median index outside the histogram")
    return float(at((n - 1) // 2) + at(n // 2)) / 2.0


def _common_dir(files: list[SourceFile]) -> str:
    """The deepest folder holding every input file (display form; a local path for local files)."""
    parts = [f.display.split("/")[:-1] for f in files]
    common = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return "/".join(common) or "/"


def _rel_name(f: SourceFile, files: list[SourceFile]) -> str:
    base = _common_dir(files)
    return f.display[len(base):].lstrip("/") if f.display.startswith(base) else f.display


def format_summary(manifest: dict[str, Any], out: str | Path | None = None) -> str:
    """One paragraph for the CLI: counts, the times' dates (with the --time-unit warning of
    :func:`time_unit_warning` when the run gave one), quarantine, repeated (user, item) rows, features, k-core,
    time and peak memory of the run."""
    c, q, s = manifest["counts"], manifest["quarantine"], manifest["splits"]
    where = f" -> {out}" if out is not None else ""
    text = (f"prepared {manifest['input_format']} interactions{where}: {c['users']} users, {c['items']} items, "
            f"{c['interactions']} interactions in {len(manifest['files'])} files; ")
    if manifest.get("time_range"):
        t, check = manifest["time_range"], manifest.get("time_unit_check")
        text += f"times from {t['min'][:10]} to {t['max'][:10]} (UTC"
        if check:  # most numbers in --time-unit before 1990 (time_unit_warning): say it where the dates are
            share = f"all {check['early']}" if check["early"] == check["numeric"] else \
                f"{check['early']} of {check['numeric']}"
            text += (f"; WARNING: {share} before 1990 in --time-unit {check['unit']}"
                     + (f": they look like {_UNIT_NAMES[check['likely_unit']]}, pass --time-unit "
                        f"{check['likely_unit']}" if check["likely_unit"] else ": check the unit"))
        text += "); "
    text += (f"{s['users']} users in the splits, {s['too_short_users']} too short (< {s['min_history']}); "
             f"{q['total']} bad rows quarantined")
    if q["by_reason"]:
        text += " (" + ", ".join(f"{k}: {v}" for k, v in q["by_reason"].items()) + f"; see {q['file']})"
    rep, dup = c.get("repeated_user_item_rows", 0), c.get("exact_duplicate_rows", 0)
    if rep:
        text += (f"; {rep} row{'s repeat' if rep > 1 else ' repeats'} the (user, item) pair of another row"
                 + (f", {dup} of them with its timestamp too (exact duplicates; kept as interactions: remove them "
                    "from the source if it logs events twice)" if dup else
                    f" (kept as {'interactions' if rep > 1 else 'an interaction'})"))
    if manifest.get("features"):
        text += "; features " + ", ".join(f"{k} ({v['cardinality']} values)" for k, v in manifest["features"].items())
    if manifest.get("k_core"):
        k = manifest["k_core"]
        text += (f"; {k['k']}-core ({k['iterations']} pass{'es' if k['iterations'] > 1 else ''}) removed {k['removed_interactions']} interactions, "
                 f"{k['removed_users']} users, {k['removed_items']} items")
    run = manifest.get("run")
    if run:
        text += (f"; {run['seconds']:.1f} s, peak RSS {run['peak_rss_bytes']['driver'] / 2**20:.0f} MiB "
                 f"(budget {run['memory_budget_bytes'] / 2**20:.0f} MiB)")
    return text
