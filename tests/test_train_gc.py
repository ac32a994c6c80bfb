"""train.gc_every_steps (gemray.train.gc): the pure schedule, and the collector switched off / back on."""

from __future__ import annotations

import gc

import pytest

from gemray.config import TrainConfig
from gemray.train.gc import GarbageCollection, collect_now


def test_collect_now_schedule():
    assert [s for s in range(0, 11) if collect_now(s, 5)] == [5, 10]
    assert not any(collect_now(s, 0) for s in range(0, 100))  # 0: Python's automatic collection
    assert [s for s in range(0, 4) if collect_now(s, 1)] == [1, 2, 3]


def test_garbage_collection_disables_collects_and_restores(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    assert gc.isenabled()
    try:
        g = GarbageCollection(3)
        assert not gc.isenabled() and calls == [1]  # off, one collection when training starts
        for step in range(7):
            g.step(step)
        assert calls == [1, 1, 1]  # before steps 3 and 6
    finally:
        g.close()
    assert gc.isenabled()
    calls.clear()
    off = GarbageCollection(0)
    off.step(10)
    off.close()
    assert gc.isenabled() and calls == []


def test_negative_is_refused():
    with pytest.raises(ValueError, match="gc_every_steps"):
        TrainConfig(gc_every_steps=-1).validate()
    TrainConfig(gc_every_steps=50).validate()
