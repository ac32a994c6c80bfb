"""The FP8 numerics guard: a bf16 and an fp8 run of the same config, data and seed must agree on quality.

``gemray bench numerics --config CFG --steps N [--rtol R] [--set k=v ...]`` trains the job twice through
``gemray.fit`` (one epoch of N steps each, ``train.precision`` bf16 then fp8, everything else equal) and
compares the final test metrics with :func:`compare_quality`; it prints both runs and exits 1 when any
compared metric differs by more than ``rtol`` relative (default 1e-3 = the issue's 0.1%). Compared metrics:
NE and AUC of every ranking task (keys ``test_ne*`` / ``test_auc*`` / ``ne*`` / ``auc*`` in the run's metrics)
when the run has them, else retrieval HR@10 (``hr@10``). This module only decides; the CLI runs the fits
(bench sits beside the controller in the layers, so it cannot call ``fit`` itself).
"""

from __future__ import annotations

import math
import re
from typing import Any

RANKING_KEY = re.compile(r"^(test_)?(ne|auc)(_[a-z]+)?$")
RETRIEVAL_KEYS = ("hr@10", "test_hr@10")


def quality_keys(metrics: dict[str, Any]) -> list[str]:
    """The metrics the guard compares: every NE / AUC key (ranking) if any, else HR@10 (retrieval).
    Raises ValueError when the run reported neither (e.g. it was preempted)."""
    keys = sorted(k for k, v in metrics.items() if RANKING_KEY.match(k) and isinstance(v, (int, float)))
    if not keys:
        keys = [k for k in RETRIEVAL_KEYS if isinstance(metrics.get(k), (int, float))][:1]
    if not keys:
        raise ValueError(f"numerics guard: the run reported no NE / AUC / hr@10 metric (keys: {sorted(metrics)})")
    return keys


def compare_quality(reference: dict[str, Any], candidate: dict[str, Any], rtol: float = 1e-3
                    ) -> tuple[bool, list[tuple[str, float, float, float]]]:
    """(ok, rows): rows are (metric, reference, candidate, relative difference |c - r| / |r|) for
    :func:`quality_keys` of the reference; ok when every difference <= rtol (a non-finite value fails).
    Raises ValueError for rtol < 0 or a metric missing from the candidate."""
    if rtol < 0:
        raise ValueError(f"rtol: expected >= 0, got {rtol}")
    rows = []
    ok = True
    for k in quality_keys(reference):
        if k not in candidate:
            raise ValueError(f"numerics guard: the fp8 run did not report {k}")
        r, c = float(reference[k]), float(candidate[k])
        rel = abs(c - r) / abs(r) if r else (0.0 if c == r else math.inf)
        if not (math.isfinite(r) and math.isfinite(c)) or not rel <= rtol:
            ok = False
        rows.append((k, r, c, rel))
    return ok, rows


def format_rows(rows: list[tuple[str, float, float, float]], rtol: float, names=("bf16", "fp8")) -> str:
    lines = [f"{'metric':<16}{names[0]:>12}{names[1]:>12}{'rel diff':>12}  (rtol {rtol:g})"]
    for k, r, c, rel in rows:
        lines.append(f"{k:<16}{r:>12.6f}{c:>12.6f}{rel:>12.2e}  {'ok' if rel <= rtol else 'FAIL'}")
    return "\n".join(lines)
