"""The Amazon review formats of the sequential-recommendation literature, as inputs of ``prepare interactions``.

Two layouts, both without a header, chosen with ``--format``:

| format           | one line holds                       | used by                                        |
|------------------|--------------------------------------|------------------------------------------------|
| ``amazon-ratings`` | ``user,item,rating,timestamp``     | McAuley et al.'s "ratings only" files (``ratings_Beauty.csv``, 2014; ``Beauty.csv``, 2018): string ids (reviewer id, ASIN), stars 1.0..5.0, unix seconds |
| ``amazon-seq``   | ``user item1 item2 ...`` (whitespace) | the preprocessed ``sequential_data.txt`` / ``Beauty.txt`` files of S3-Rec, CL4SRec and followers: one time-ordered sequence per line, no ratings, no times |

``amazon-ratings`` is a CSV with fixed column names (:data:`RATINGS_COLUMNS`) read by the CSV path of
:mod:`gemray.pipelines.interactions`. ``amazon-seq`` is read here (:func:`iter_seq_lines`): every line is one
bad-row unit (an empty line, a line with a user but no item, undecodable bytes: the whole line is bad, with
its 1-based line number), every item token one interaction. The files carry no timestamps: the item's
position in its user's sequence (0, 1, 2, ...) stands in for one, and a user found on several lines gets
them concatenated in file order (``manifest["time_unit"] == "position"``). Ratings are 0 (none).

The usual 5-core filtering (every kept user and item has at least 5 interactions, applied until nothing
changes) is ``--k-core 5``; it is generic, implemented in :mod:`gemray.pipelines.interactions`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["RATINGS_COLUMNS", "FORMATS", "iter_seq_lines"]

#: Column names given to the four unnamed fields of an ``amazon-ratings`` line.
RATINGS_COLUMNS = ("user", "item", "rating", "timestamp")

#: --format values this module defines, with a one-line description each (the CLI's help).
FORMATS = {
    "amazon-ratings": "headerless CSV user,item,rating,timestamp (McAuley's ratings-only files)",
    "amazon-seq": "one sequence per line: user item1 item2 ... (S3-Rec style sequential_data.txt)",
}


def iter_seq_lines(stream, block_size: int) -> Iterator[tuple[pa.Array, np.ndarray]]:
    """Read an ``amazon-seq`` file in blocks of about ``block_size`` bytes.

    stream: a readable binary stream (``read(n) -> bytes``), already decompressed.
    Yields (lines [L] binary, line_numbers [L] int64, 1-based), in file order; lines lose their ``\\n`` and a
    trailing ``\\r``; a final line without a newline is a line too. Memory: one block plus the longest line.
    """
    carry = b""
    lineno = 0
    while True:
        block = stream.read(block_size)
        if not block:
            break
        data = carry + block
        cut = data.rfind(b"\n")
        if cut < 0:
            carry = data
            continue
        carry = data[cut + 1:]
        lines = data[:cut].split(b"\n")
        yield _lines_array(lines), np.arange(lineno + 1, lineno + 1 + len(lines), dtype=np.int64)
        lineno += len(lines)
    if carry:
        yield _lines_array([carry]), np.array([lineno + 1], dtype=np.int64)


def _lines_array(lines: list[bytes]) -> pa.Array:
    # strip one trailing \r (CRLF files) without touching other bytes
    return pa.array([x[:-1] if x.endswith(b"\r") else x for x in lines], pa.binary())


def split_seq_lines(lines: pa.StringArray) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """Valid-UTF-8 lines -> (users [L] string, items [T] string, line_of_token [T] int64 index into lines).

    A line with no token gives a null user; one with a user only gives no items (both are bad lines: the
    caller finds them from ``pc.list_value_length``-style counts it gets back through ``line_of_token``).
    """
    tokens = pc.utf8_split_whitespace(lines)
    n = pc.fill_null(pc.list_value_length(tokens), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    users = pc.list_element(pc.if_else(pa.array(n > 0), tokens, pa.scalar([None], tokens.type)), 0)
    rest = pc.list_slice(tokens, 1)
    items = pc.list_flatten(rest)
    per = np.maximum(n - 1, 0)
    line_of_token = np.repeat(np.arange(len(lines), dtype=np.int64), per)
    return users, items, line_of_token
