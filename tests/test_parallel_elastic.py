"""The elastic controller re-lays the parallel layout at every resize: tests/test_elastic.py's 2 -> 1 -> 2
node removal / addition scenario (ledger exact: 0 lost, 0 duplicated; DCP restores across world sizes) run
with an HSDP dense part sharded over 2 ranks. At 1 worker ``parallel.dp_shard = 2`` does not divide the world:
the Trainer takes the nearest valid layout (``gemray.parallel.dims.resolve``: dp_shard 1), restoring the
FSDP-sharded checkpoint of 2 ranks; back at 2 workers, HSDP over 2 again."""

from __future__ import annotations

import pytest
import test_elastic as te


def test_resize_two_one_two_hsdp(tmp_path, monkeypatch):
    base = te._overrides
    monkeypatch.setattr(te, "_overrides", lambda *a, **k: base(*a, **k) + ["parallel.dense=hsdp",
                                                                            "parallel.dp_shard=2"])
    te.test_resize_two_one_two(tmp_path)
