"""TrainLoader (data.loader_workers): batches made in DataLoader worker processes are the in-process ones, in the same
order with the same data position; early exits leave no process behind; a worker's error reaches the caller."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import torch

from gemray.jagged import JaggedBatch
from gemray.pipelines.loader import TrainLoader
from gemray.pipelines.stream import ElasticTrainStream, HistoryStream

BATCH = 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """GEM-style data (token features, request context, candidates with labels): every JaggedBatch field is set."""
    from gemray.pipelines.synthetic import SyntheticSpec, prepare_synthetic

    out = tmp_path_factory.mktemp("loader") / "syn"
    spec = SyntheticSpec(users=86, items=120, seed=5, max_len=32, min_len=4, mean_len=10.0, candidates=5)
    prepare_synthetic(out, spec, num_files=2, progress=False, workers=1)
    return out


def _stream(prepared, rank: int = 2, world_size: int = 3) -> ElasticTrainStream:
    """Rank 2 of 3 by default: 86 train users at 3 x 4 a step end on a step of 2 samples, which go to ranks 0 and 1,
    so this rank's last batch is empty (B=0) and the tests below see one."""
    base = HistoryStream(prepared, "train", rank=0, world_size=1, batch_size=BATCH, max_seq_len=24, sub_batch_size=2,
                         seed=7, reader="arrow")
    return ElasticTrainStream(base, rank=rank, world_size=world_size)


def _tensors(b: JaggedBatch) -> dict[str, torch.Tensor | None]:
    out = {}
    for name in ("user_ids", "offsets", "item_ids", "ratings", "timestamps", "targets", "target_timestamps",
                 "candidate_offsets", "candidate_ids", "labels"):
        out[name] = getattr(b, name)
    for group in ("features", "context"):
        for k, v in (getattr(b, group) or {}).items():
            out[f"{group}.{k}"] = v
    return out


def _same_sequence(a: list[tuple[JaggedBatch, int]], b: list[tuple[JaggedBatch, int]]) -> None:
    assert [c for _, c in a] == [c for _, c in b]
    for (x, _), (y, _) in zip(a, b):
        tx, ty = _tensors(x), _tensors(y)
        assert tx.keys() == ty.keys()
        for k in tx:
            if tx[k] is None:
                assert ty[k] is None, k
            else:
                assert tx[k].dtype == ty[k].dtype and torch.equal(tx[k], ty[k]), k


def _no_children(timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on the 2-core box
def test_workers_yield_the_in_process_sequence(prepared):
    """Worker counts 0, 1, 2, 3: the same (batch, consumed) sequence, every tensor equal, empty batches included,
    from the epoch's start and from mid-epoch positions (a step boundary and one that is not)."""
    stream = _stream(prepared)
    ref = list(stream.iter_epoch(2, 0))
    assert len(ref) > 4 and any(b.batch_size == 0 for b, _ in ref)  # the epoch's end: empty on this rank (_stream)
    assert any(b.features for b, _ in ref) and any(b.num_candidates for b, _ in ref)
    mid = ref[2][1]
    rng = torch.get_rng_state()
    for consumed in (0, mid, mid + 5):
        want = list(stream.iter_epoch(2, consumed))
        for workers in (0, 1, 2, 3):
            got = list(TrainLoader(stream, workers=workers, prefetch=1 + workers % 2).iter_epoch(2, consumed))
            _same_sequence(got, want)
    assert torch.equal(torch.get_rng_state(), rng)  # the loader draws nothing from the training's global RNG
    assert _no_children()
    assert list(TrainLoader(stream, workers=2).iter_epoch(2, ref[-1][1])) == []  # nothing left: no worker starts


def test_an_early_exit_leaves_no_process(prepared):
    """Closing the epoch's generator after two batches, or dropping it, ends the worker processes at once; so does
    a full epoch."""
    loader = TrainLoader(_stream(prepared), workers=2, prefetch=2)
    gen = loader.iter_epoch(0, 0)
    next(gen), next(gen)
    assert len(multiprocessing.active_children()) == 2
    gen.close()
    assert _no_children()
    gen = loader.iter_epoch(1, 0)
    next(gen)
    assert multiprocessing.active_children()
    del gen
    assert _no_children()
    for _ in loader.iter_epoch(0, 0):
        pass
    assert _no_children()


def test_a_worker_error_reaches_the_caller_with_its_message(prepared):
    stream = _stream(prepared, rank=0, world_size=1)
    collate = stream.base._collate
    calls = {"n": 0}

    def failing(idx):
        calls["n"] += 1
        if calls["n"] == 2:  # the worker's second step (step 2 with two workers: worker 0)
            raise ValueError("histories/part-00001.parquet: row 17 is bad")
        return collate(idx)

    stream.base._collate = failing
    seen = []
    with pytest.raises(ValueError, match="row 17 is bad") as err:
        for batch, consumed in TrainLoader(stream, workers=2).iter_epoch(0, 0):
            seen.append(consumed)
    assert str(err.value) == "histories/part-00001.parquet: row 17 is bad"
    assert any("loader worker 0" in n for n in getattr(err.value, "__notes__", []))
    assert seen == [BATCH, 2 * BATCH]  # raised in step order: steps 0 and 1 (workers 0, 1), then step 2's error
    assert _no_children()


def test_bad_positions_are_refused_before_any_worker(prepared):
    loader = TrainLoader(_stream(prepared), workers=2)
    with pytest.raises(ValueError, match="consumed=10000 outside"):
        next(loader.iter_epoch(0, 10_000))
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        next(loader.iter_epoch(-1, 0))
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="workers >= 0"):
        TrainLoader(loader.stream, workers=-1)


def test_is_pinned_on_pageable_batches(prepared):
    batch, _ = next(iter(_stream(prepared).iter_epoch(0, 0)))
    assert batch.batch_size and not batch.is_pinned()  # pageable CPU memory: forward_backward_step pins it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_cuda_loader_pins_in_its_thread(prepared):
    """pin_memory (the CUDA default): the DataLoader's pin thread pins every batch, empty ones included (their empty
    tensors are skipped by is_pinned), and the sequence is still the in-process one."""
    stream = _stream(prepared)
    want = list(stream.iter_epoch(1, 0))
    got = list(TrainLoader(stream, workers=1, pin_memory=True).iter_epoch(1, 0))
    _same_sequence(got, want)
    assert all(b.is_pinned() for b, _ in got) and any(b.batch_size == 0 for b, _ in got)
    assert not any(b.is_pinned() for b, _ in want if b.batch_size)
    assert _no_children()


def test_training_batches_do_not_depend_on_bbs_window_batches(prepared):
    """data.bbs_window_batches has no effect on training (its docs say so): the train loader the trainer builds
    from the config plans each global step itself, with no window. The key only sizes the windows of
    HistoryStream's own per-rank train plan, which does change with it."""
    from gemray.config import DataConfig

    def config(window: int) -> DataConfig:
        return DataConfig(prepared_dir=str(prepared), max_seq_len=24, batch_size=BATCH, sub_batch_size=2,
                          bbs_window_batches=window, reader="arrow", loader_workers=0)

    def batches(window: int) -> list[tuple[JaggedBatch, int]]:
        loader = TrainLoader.from_config(config(window), rank=1, world_size=3, seed=7, device_type="cpu")
        return list(loader.iter_epoch(1, 0))

    _same_sequence(batches(1), batches(8))
    plans = [HistoryStream.from_config(config(w), "train", rank=0, world_size=1, seed=7).plan(1) for w in (1, 8)]
    assert any(not np.array_equal(a, b) for a, b in zip(*plans))  # the window is live there, not in training
