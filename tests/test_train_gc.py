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


def test_gc_pauses_count_collections_while_entered():
    import gc

    from gemray.train.gc import GcPauses

    junk = [[i] for i in range(20000)]  # tracked objects: the full collection has something to walk
    with GcPauses() as p:
        gc.collect()
        gc.collect(0)
    assert p.full == 1 and p.seconds > 0 and 0 < p.longest <= p.seconds
    seconds = p.seconds
    gc.collect()  # after exit: not counted, the callback is gone
    assert p.seconds == seconds and p._callback not in gc.callbacks
    del junk


def test_bench_summary_adds_up_the_steps_gc_pauses():
    from gemray.bench.train import summarize

    recs = [{"data_s": 0.0, "step_s": 0.1, "flops": 1.0, "tokens": 1, "samples": 1, "gc_s": 0.002, "gc_full": 0},
            {"data_s": 0.0, "step_s": 0.6, "flops": 1.0, "tokens": 1, "samples": 1, "gc_s": 0.45, "gc_full": 1},
            {"data_s": 0.0, "step_s": 0.1, "flops": 1.0, "tokens": 1, "samples": 1}]        # an older record
    g = summarize(recs, None)["gc"]
    assert g == {"seconds": 0.452, "full_collections": 1, "max_step_s": 0.45}


def test_full_collection_frees_a_cycle_generation_1_keeps(monkeypatch):
    """With automatic collection off, a garbage cycle that was alive at a generation-1 collection sits in the oldest
    generation (which generation-1 collections never walk) until :meth:`GarbageCollection.full`, which the Trainer
    calls before each evaluation; with every = 0 ``full`` leaves collection to Python."""
    import weakref

    class Node:
        pass

    g = GarbageCollection(2)
    try:
        a, b = Node(), Node()
        a.peer, b.peer = b, a
        ref = weakref.ref(a)
        gc.collect(1)
        gc.collect(1)  # survived two collections: promoted to generation 2
        del a, b
        g.step(2)  # generation 1 only
        assert ref() is not None
        g.full("test")
        assert ref() is None
    finally:
        g.close()
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    GarbageCollection(0).full("test")
    assert calls == []
