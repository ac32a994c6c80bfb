"""The Trainer's small parts on their own (no Ray, no process group): the retrieval evaluator's per-batch sums,
the recovery recorder's events, the preemption vote's poll steps."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from gemray.events import read_events
from gemray.metrics import RetrievalMetrics, history_mask, target_ranks
from gemray.model import GEM
from gemray.parallel.dims import ParallelDims
from gemray.train import PreemptionVote, RecoveryRecorder, RetrievalEvaluator
from model_utils import random_batch, tiny_cfg

NUM_ITEMS = 40


@pytest.mark.parametrize("exclude_history", [True, False])
def test_retrieval_evaluator_sums_add_up_to_the_metrics_of_all_batches(exclude_history):
    torch.manual_seed(0)
    model = GEM(tiny_cfg(), num_items=NUM_ITEMS, max_seq_len=12).eval()
    ev = RetrievalEvaluator(NUM_ITEMS, [1, 5, 20], exclude_history=exclude_history)
    batches = [random_batch([3, 7, 1], targets=True, seed=1), random_batch([], targets=True),
               random_batch([5, 2], targets=True, seed=2)]
    with torch.no_grad():
        items = ev.prepare(model, torch.device("cpu"))
        assert items.shape == (NUM_ITEMS + 1, 16)
        parts = [ev.batch_sums(model, b, items) for b in batches]
        assert all(p.shape == (ev.num_sums(),) and p.dtype == torch.float64 for p in parts)
        assert not parts[1].any()  # B=0: the model still ran, nothing counted
        got = ev.compute(sum(parts))
        # the same figures from all users at once
        users = torch.cat([model.user_embeddings(b) for b in batches])
        targets = torch.cat([b.targets for b in batches])
        scores = users @ items.T
    want = RetrievalMetrics([1, 5, 20])
    if exclude_history:
        seen = torch.cat([history_mask(b.item_ids, b.offsets, NUM_ITEMS) for b in batches])
        want.update(target_ranks(scores, targets, seen))
        all_items = RetrievalMetrics([1, 5, 20])
        all_items.update(target_ranks(scores, targets))
        assert got["hr@20_unfiltered"] == pytest.approx(all_items.compute()["hr@20"])
        assert got["targets_in_history"] == float(seen.gather(1, targets.view(-1, 1)).sum())
    else:
        want.update(target_ranks(scores, targets))
        assert not any(k.endswith("_unfiltered") for k in got)
    for k, v in want.compute().items():
        assert got[k] == pytest.approx(v), k
    assert got["num_users"] == 5
    with pytest.raises(ValueError, match="num_items"):
        RetrievalEvaluator(0, [10])


def _ev(kind, attempt, **detail):
    return {"kind": kind, "t": 1.0, "attempt": attempt, "detail": detail}


def test_recorder_tells_the_previous_attempts_story(tmp_path, caplog):
    """Attempt 1 (2 ranks) died while writing the step-10 checkpoint (step 5 committed); attempt 2 runs on
    one rank and restores step 5: failure, restore, the lost checkpoint with a warning, startup, resize,
    first step, finished, in that order; a rank other than 0 neither reads nor writes."""
    path = tmp_path / "events.jsonl"
    prev = [_ev("attempt_start", 1, world_size=2), _ev("step", 1, global_step=5), _ev("checkpoint_begin", 1, global_step=5),
            _ev("checkpoint_saved", 1, global_step=5), _ev("step", 1, global_step=10),
            _ev("checkpoint_begin", 1, global_step=10)]
    path.write_text("".join(json.dumps(e) + "\n" for e in prev))
    silent = RecoveryRecorder(str(path), attempt=2, rank=1, t_start=0.0)
    assert silent.failed is None
    silent.attempt_started(1, ["row_wise"])
    rec = RecoveryRecorder(str(path), attempt=2, rank=0, t_start=0.0)
    assert rec.failed["last_checkpoint_begun"] == 10 and rec.failed["world_size"] == 2
    rec.attempt_started(1, ["row_wise"])
    rec.phase_done("setup_and_data_s")
    with pytest.raises(ValueError, match="unknown phase"):
        rec.phase_done("coffee_s")
    state = {"epoch": 0, "consumed": 80, "epoch_step": 5, "global_step": 5, "world_size": 2,
             "restored_from": str(tmp_path / "ray" / "checkpoint_a"), "skipped_checkpoints": []}
    rec.restored(state, world_size=1)
    with caplog.at_level(logging.WARNING, logger="gemray.train"):
        lost = rec.uncommitted(5, state["restored_from"])
    assert lost == {"global_step": 10, "state": "interrupted_write"}
    assert "checkpoint of global step 10 is not used: the attempt was killed while writing it" in caplog.text
    rec.startup()
    rec.resize(1, 2, ["row_wise"], ParallelDims(1, dense="fsdp").mesh_fields())
    rec.step(6, 0, 96)
    rec.step(7, 0, 112)
    rec.finished(7)
    mine = [e for e in read_events(path) if e["attempt"] == 2]
    assert [e["kind"] for e in mine] == ["failure_detected", "attempt_start", "checkpoint_restored",
                                         "checkpoint_uncommitted", "startup", "resize", "step", "first_step",
                                         "step", "finished"]
    by = {e["kind"]: e["detail"] for e in mine}
    assert (by["checkpoint_restored"]["epoch"], by["checkpoint_restored"]["consumed"]) == (1, 80)
    assert by["resize"] == {"from_world_size": 2, "to_world_size": 1, "resharded_from": 2,
                            "sharding_types": ["row_wise"], "dense_mesh": [1, 1],
                            "layout": {"dense": "fsdp", "dp_replicate": 1, "dp_shard": 1, "ep": 1, "sparse_group": 0}}
    assert set(by["startup"]) == {"process_to_train_fn_s", "setup_and_data_s"}
    assert by["first_step"]["global_step"] == 6


def test_attempt_start_and_resize_carry_the_layout_the_attempt_runs(tmp_path):
    """4 -> 3 ranks with HSDP dp_shard 2 (elastic): the nearest valid layout, dp_replicate 1 x dp_shard 3, is what
    the attempt_start and resize events say (the resize event said [world, 1] whatever the layout)."""
    from gemray.config import ParallelConfig
    from gemray.parallel.dims import resolve

    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(_ev("attempt_start", 1, world_size=4)) + "\n")
    dims = resolve(ParallelConfig(dense="hsdp", dp_shard=2), 3, "cpu", elastic=True)
    rec = RecoveryRecorder(str(path), attempt=2, rank=0, t_start=0.0)
    rec.attempt_started(3, ["row_wise"], dims.mesh_fields())
    rec.resize(3, 4, ["row_wise"], dims.mesh_fields())
    by = {e["kind"]: e["detail"] for e in read_events(path) if e["attempt"] == 2}
    want = {"dense": "hsdp", "dp_replicate": 1, "dp_shard": 3, "ep": 1, "sparse_group": 0}
    assert by["attempt_start"]["layout"] == want and by["resize"]["layout"] == want
    assert by["resize"]["dense_mesh"] == [1, 3] and by["resize"]["from_world_size"] == 4


def test_vote_polls_every_n_steps_and_at_the_epoch_end(monkeypatch):
    vote = PreemptionVote("", torch.device("cpu"), 2, poll_steps=5)
    calls = []
    monkeypatch.setattr(vote, "agree", lambda: calls.append(1) or "checkpoint")
    assert [vote.poll(g, False) for g in range(1, 5)] == [None] * 4 and not calls
    assert vote.poll(5, False) == "checkpoint" and vote.drain_handled
    assert vote.poll(7, True) == "checkpoint" and len(calls) == 2  # an epoch's last step votes too
    off = PreemptionVote("", torch.device("cpu"), 2, poll_steps=0)
    assert off.poll(5, True) is None
    with pytest.raises(ValueError, match="checkpoint.preempt_poll_steps"):
        PreemptionVote("", torch.device("cpu"), 2, poll_steps=-1)
