"""Per-sample training ledger: which sample ids each rank trained at each global step, per attempt.

Written by the training workers when ``train.ledger_dir`` is set; read by tests and benchmarks to prove
exactly-once data across failures and resizes (0 samples lost, 0 duplicated per epoch).

Layout::

    <ledger_dir>/attempt-<id>/rank<r>.jsonl
        {"header": true, "attempt": id, "rank": r, "world_size": W, "restored_global_step": g, "pid": ...}
        {"e": epoch, "g": global_step, "t": unix seconds, "ids": [sample ids trained at this step]}

An attempt is one start of the worker group (``id`` = rank 0's start time in ns, shared by all ranks).
A crash rolls the model back to the last committed checkpoint, so the steps an attempt trained after
that checkpoint did not count: when reading, an attempt's lines with ``g`` greater than the *next*
attempt's ``restored_global_step`` are dropped (:func:`effective_steps`). What is left is what the
final model was trained on.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterable

__all__ = ["LedgerWriter", "read_attempts", "effective_steps", "audit"]


class LedgerWriter:
    """Append-only JSONL writer for one rank of one attempt (one line per step, flushed)."""

    def __init__(self, directory: str | Path, *, attempt: int, rank: int, world_size: int,
                 restored_global_step: int):
        d = Path(directory) / f"attempt-{int(attempt):020d}"
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"rank{rank}.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self._write({"header": True, "attempt": int(attempt), "rank": rank, "world_size": world_size,
                     "restored_global_step": int(restored_global_step), "pid": os.getpid(),
                     "host": socket.gethostname(), "t": time.time()})

    def _write(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def step(self, epoch: int, global_step: int, ids: Iterable[int]) -> None:
        """Record that this rank trained ``ids`` (sample/user ids) at ``global_step`` of ``epoch``."""
        self._write({"e": int(epoch), "g": int(global_step), "t": time.time(), "ids": [int(i) for i in ids]})

    def close(self) -> None:
        self._f.close()


def read_attempts(directory: str | Path) -> list[dict[str, Any]]:
    """All attempts, oldest first: ``[{"attempt", "restored_global_step", "ranks": {r: header},
    "steps": [line dicts of every rank]}]``. A torn last line (killed mid-write) is ignored."""
    out = []
    for d in sorted(Path(directory).glob("attempt-*")):
        att: dict[str, Any] = {"attempt": int(d.name.split("-", 1)[1]), "ranks": {}, "steps": [],
                               "restored_global_step": None}
        for f in sorted(d.glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("header"):
                    att["ranks"][rec["rank"]] = rec
                    att["restored_global_step"] = rec["restored_global_step"]
                else:
                    att["steps"].append(rec)
        out.append(att)
    return out


def effective_steps(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step lines that count: each attempt's lines up to the next attempt's restore point."""
    kept = []
    for i, att in enumerate(attempts):
        cutoff = attempts[i + 1]["restored_global_step"] if i + 1 < len(attempts) else None
        kept += [s for s in att["steps"] if cutoff is None or s["g"] <= cutoff]
    return kept


def audit(directory: str | Path, expected_ids: Iterable[int], epochs: int) -> dict[str, Any]:
    """Exactly-once check: per epoch, sample ids lost (never trained) and duplicated (trained twice).

    Returns ``{"epochs": {e: {"trained": n, "lost": [...], "duplicated": [...]}}, "attempts": k,
    "rolled_back_steps": number of step lines dropped}``; ``e`` is the 0-based epoch.
    """
    attempts = read_attempts(directory)
    steps = effective_steps(attempts)
    expected = sorted(int(i) for i in expected_ids)
    report: dict[str, Any] = {"epochs": {}, "attempts": len(attempts),
                              "rolled_back_steps": sum(len(a["steps"]) for a in attempts) - len(steps)}
    for e in range(epochs):
        seen: dict[int, int] = {}
        for s in steps:
            if s["e"] == e:
                for i in s["ids"]:
                    seen[i] = seen.get(i, 0) + 1
        report["epochs"][e] = {"trained": sum(seen.values()),
                               "lost": [i for i in expected if i not in seen],
                               "duplicated": sorted(i for i, c in seen.items() if c > 1),
                               "unexpected": sorted(set(seen) - set(expected))}
    return report
