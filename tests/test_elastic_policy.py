"""Pure elastic decisions (no Ray): checkpoint choice and timing, preemption votes, the world-size-independent
data plan (exactly once across resizes), the ledger audit and recovery figures. Ray Train V2 itself sizes
the group (``min(available, max_workers)``) and the layout per world size is gemray.parallel.plan_layout
(tests/test_train_layout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemray.checkpoint import choose_checkpoint
from gemray.events import Event, failure_events, preempted_step, summarize_recovery
from gemray.ledger import LedgerWriter, audit
from gemray.pipelines.bbs import global_epoch_order, global_steps_left, plan_global_step
from gemray.preemption import preemption_action




def test_choose_checkpoint_falls_back(tmp_path):
    dirs = [tmp_path / n for n in ("c3", "c2", "c1")]
    bad = {"c3": "file __1_7_0.distcp is corrupted", "c2": "missing manifest for rank(s) [1]"}

    def verify(p):
        if p.name in bad:
            raise ValueError(bad[p.name])

    chosen, skipped = choose_checkpoint(dirs, verify)
    assert chosen == dirs[2]
    assert [(p.name, w) for p, w in skipped] == [("c3", bad["c3"]), ("c2", bad["c2"])]
    assert choose_checkpoint(dirs[:2], verify)[0] is None
    assert choose_checkpoint([], verify) == (None, [])


def _run_plan(n, lengths, epoch, worlds_per_step, batch_size, bbs):
    """Consume one epoch with the world size changing per step; returns per-step per-rank index arrays."""
    order = global_epoch_order(n, seed=7, epoch=epoch, shuffle=True)
    consumed, steps, w_iter = 0, [], iter(worlds_per_step)
    while consumed < n:
        w = next(w_iter)
        parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=w, batch_size=batch_size,
                                           bbs=bbs, sub_batch_size=2, seed=7, epoch=epoch)
        assert len(parts) == w
        steps.append(parts)
    return steps


@pytest.mark.parametrize("bbs", [True, False])
def test_global_plan_exactly_once_across_resizes(bbs):
    rng = np.random.default_rng(0)
    n = 53
    lengths = rng.integers(1, 40, n)
    lengths[0] = 1  # a length-1 sequence
    for worlds in ([2] * 20, [2, 2, 1, 1, 3, 2, 1, 2] + [2] * 20, [1] * 30):
        steps = _run_plan(n, lengths, 0, worlds, 4, bbs)
        flat = np.concatenate([p for parts in steps for p in parts])
        assert np.array_equal(np.sort(flat), np.arange(n))  # every sample once: 0 lost, 0 duplicated
        assert all(p.size <= 4 for parts in steps for p in parts)
    # the plan up to a resize is the uninterrupted plan: a same-size restart replays the same batches
    a = _run_plan(n, lengths, 0, [2] * 20, 4, bbs)
    b = _run_plan(n, lengths, 0, [2, 2, 2] + [2] * 20, 4, bbs)
    assert all(np.array_equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))
    # another epoch: another order
    assert not np.array_equal(global_epoch_order(n, seed=7, epoch=1, shuffle=True),
                              global_epoch_order(n, seed=7, epoch=0, shuffle=True))
    assert np.array_equal(global_epoch_order(5, seed=7, epoch=0, shuffle=False), np.arange(5))


def test_global_plan_edges():
    order = global_epoch_order(0, seed=0, epoch=0, shuffle=True)
    assert order.size == 0 and global_steps_left(0, 0, 2, 4) == 0
    assert global_steps_left(9, 0, 2, 4) == 2 and global_steps_left(9, 8, 2, 4) == 1
    parts, c = plan_global_step(np.arange(1), np.array([1]), consumed=0, world_size=3, batch_size=4, bbs=True,
                                sub_batch_size=2, seed=0, epoch=0)
    assert c == 1 and [p.tolist() for p in parts] == [[0], [], []]  # one sample, two empty ranks
    with pytest.raises(ValueError, match="consumed=5 outside 0..1"):
        plan_global_step(np.arange(1), np.array([1]), consumed=5, world_size=1, batch_size=4, bbs=False,
                         sub_batch_size=2, seed=0, epoch=0)
    # BBS balances the ranks of a step: sorted lengths would give 2 very unequal halves without it
    lengths = np.arange(1, 17) ** 2
    parts, _ = plan_global_step(np.arange(16), lengths, consumed=0, world_size=2, batch_size=8, bbs=True,
                                sub_batch_size=2, seed=0, epoch=0)
    tok = [int(lengths[p].sum()) for p in parts]
    plain, _ = plan_global_step(np.arange(16), lengths, consumed=0, world_size=2, batch_size=8, bbs=False,
                                sub_batch_size=2, seed=0, epoch=0)
    tok_plain = [int(lengths[p].sum()) for p in plain]
    assert max(tok) / min(tok) < 1.1 < max(tok_plain) / min(tok_plain)


@pytest.mark.parametrize("bbs", [True, False])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_global_plan_tail_spreads_over_every_rank(world, bbs):
    """The epoch's last, partial step spreads its n samples over all ranks (was: rank 0 got batch_size, the next
    ranks the rest, later ranks nothing: ML-1M, 2 ranks, batch 128 ended on 128 / 24): part sizes within
    sub_batch_size (BBS) or 1 (slices) of each other, no rank empty once n >= world_size, each sample once."""
    batch, sub = 8, 2
    lengths = np.random.default_rng(world).integers(1, 200, world * batch)
    for n in range(1, world * batch):  # every partial chunk size
        order = np.random.default_rng(n).permutation(world * batch)[:n]
        parts, consumed = plan_global_step(order, lengths, consumed=0, world_size=world, batch_size=batch, bbs=bbs,
                                           sub_batch_size=sub, seed=3, epoch=0)
        sizes = [p.size for p in parts]
        assert consumed == n and len(parts) == world and all(p.dtype == np.int64 for p in parts)
        assert sorted(np.concatenate(parts).tolist()) == sorted(order.tolist())  # every sample of the chunk once
        assert max(sizes) - min(sizes) <= (sub if bbs else 1), (n, sizes)
        assert min(sizes) > 0 or n < world, (n, sizes)
        if n >= world * sub:
            assert min(sizes) > 0, (n, sizes)
    # BBS also balances the tail's tokens: 12 samples sorted by length over 2 ranks (slices: 6 light, 6 heavy)
    lengths = np.arange(1, 13) ** 2
    parts, _ = plan_global_step(np.arange(12), lengths, consumed=0, world_size=2, batch_size=8, bbs=True,
                                sub_batch_size=2, seed=0, epoch=0)
    plain, _ = plan_global_step(np.arange(12), lengths, consumed=0, world_size=2, batch_size=8, bbs=False,
                                sub_batch_size=2, seed=0, epoch=0)
    tok, tok_plain = ([int(lengths[p].sum()) for p in ps] for ps in (parts, plain))
    assert [p.size for p in parts] == [6, 6] and [p.size for p in plain] == [6, 6]
    assert max(tok) / min(tok) < 1.05 < 3 < max(tok_plain) / min(tok_plain)


@pytest.mark.parametrize("bbs", [True, False])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_global_plan_epoch_exactly_once_with_an_even_tail(world, bbs):
    """A whole epoch with random lengths: every sample once, global_steps_left steps, every step but the last
    batch_size per rank, the last one spread evenly over all ranks."""
    batch, sub = 8, 4
    n = 5 * world * batch + 3 * world + 1  # 5 full steps, then a tail of 3 * world + 1 samples
    lengths = np.random.default_rng(100 + world).integers(1, 300, n)
    order = global_epoch_order(n, seed=9, epoch=2, shuffle=True)
    consumed, steps = 0, []
    while consumed < n:
        parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=world, batch_size=batch,
                                           bbs=bbs, sub_batch_size=sub, seed=9, epoch=2)
        steps.append(parts)
    assert len(steps) == global_steps_left(n, 0, world, batch) == 6
    flat = np.concatenate([p for parts in steps for p in parts])
    assert np.array_equal(np.sort(flat), np.arange(n))  # every sample once: 0 lost, 0 duplicated
    assert all(p.size == batch for parts in steps[:-1] for p in parts)
    tail = [p.size for p in steps[-1]]
    assert sum(tail) == 3 * world + 1 and min(tail) >= 3 and max(tail) - min(tail) <= (sub if bbs else 1), tail


def test_global_plan_pinned():
    """A seeded epoch's plan, pinned: its full steps are the plan before the tail was spread (form_batches /
    slices of batch_size, rng seeded by (seed, epoch, consumed)); only the last, partial step changed
    (was [[11, 19, 12, 13], [4]] with BBS, [[19, 11, 13, 4], [12]] without)."""
    lengths = np.array([8, 8, 48, 30, 35, 36, 43, 2, 29, 9, 24, 55, 33, 5, 33, 8, 45, 56, 58, 37, 52])
    want = {True: [[[18, 20, 1, 7], [16, 5, 3, 0]], [[6, 14, 8, 10], [17, 2, 9, 15]], [[19, 4, 13], [11, 12]]],
            False: [[[1, 20, 7, 0], [5, 16, 3, 18]], [[15, 10, 8, 6], [14, 17, 9, 2]], [[19, 11, 13], [4, 12]]]}
    for bbs, steps in want.items():
        order = global_epoch_order(21, seed=5, epoch=1, shuffle=True)
        consumed, got = 0, []
        while consumed < 21:
            parts, consumed = plan_global_step(order, lengths, consumed=consumed, world_size=2, batch_size=4,
                                               bbs=bbs, sub_batch_size=2, seed=5, epoch=1)
            got.append([p.tolist() for p in parts])
        assert got == steps, bbs


def test_ledger_audit_drops_rolled_back_steps(tmp_path):
    ids = list(range(100, 110))
    # attempt 1 (2 ranks) trains steps 1..3; checkpoint committed at step 2; crash after step 3
    w = [LedgerWriter(tmp_path, attempt=1, rank=r, world_size=2, restored_global_step=0) for r in range(2)]
    w[0].step(0, 1, [100, 101]), w[1].step(0, 1, [102, 103])
    w[0].step(0, 2, [104]), w[1].step(0, 2, [105])
    w[0].step(0, 3, [106]), w[1].step(0, 3, [107])  # rolled back
    # attempt 2 (1 rank) restores step 2 and finishes the epoch
    w2 = LedgerWriter(tmp_path, attempt=2, rank=0, world_size=1, restored_global_step=2)
    w2.step(0, 3, [106, 107]), w2.step(0, 4, [108, 109])
    for x in w + [w2]:
        x.close()
    with open(w2.path, "a") as f:
        f.write('{"e": 0, "g": 5, "ids": [1')  # torn line from a kill mid-write: ignored
    rep = audit(tmp_path, ids, epochs=1)
    assert rep["attempts"] == 2 and rep["rolled_back_steps"] == 2
    assert rep["epochs"][0] == {"trained": 10, "lost": [], "duplicated": [], "unexpected": []}
    # without the rollback rule 106/107 would be duplicated; a missing step shows up as lost
    (tmp_path / "attempt-00000000000000000002" / "rank0.jsonl").write_text(
        json.dumps({"header": True, "rank": 0, "restored_global_step": 3}) + "\n")
    rep = audit(tmp_path, ids, epochs=1)
    assert rep["epochs"][0]["lost"] == [108, 109] and rep["epochs"][0]["duplicated"] == []


def _ev(kind, t, attempt, **d):
    return Event(kind, t=t, attempt=attempt, detail=d).to_dict()


def test_summarize_recovery_and_failure_events():
    events = [_ev("attempt_start", 0.0, 1, world_size=2), _ev("step", 1.0, 1, global_step=1),
              _ev("checkpoint_saved", 1.1, 1, global_step=1), _ev("step", 2.0, 1, global_step=2),
              _ev("step", 3.0, 1, global_step=3)]
    assert failure_events(events) == {"attempt": 1, "last_global_step": 3, "last_step_t": 3.0, "world_size": 2,
                                      "last_checkpoint_begun": None, "last_checkpoint_saved": 1}
    events += [_ev("failure_detected", 10.0, 2), _ev("attempt_start", 10.0, 2, world_size=1, t_start=9.0),
               _ev("checkpoint_restored", 14.0, 2, global_step=1),
               _ev("startup", 14.0, 2, process_to_train_fn_s=3.0, restore_s=1.5),
               _ev("first_step", 15.5, 2, global_step=2),
               _ev("step", 15.5, 2, global_step=2), _ev("finished", 20.0, 2)]
    rec = summarize_recovery(events)
    assert rec == [{"kind": "failure", "failed_attempt": 1, "attempt": 2, "world_size_before": 2, "world_size_after": 1,
                    "last_step": 3, "restored_step": 1, "steps_lost": 2, "seconds_to_first_step": 12.5,
                    "restore_s": 4.0, "to_train_fn_s": 6.0,
                    "phases": {"process_to_train_fn_s": 3.0, "restore_s": 1.5}}]
    assert failure_events(events) is None  # the last attempt finished
    # a planned resume of a finished run is not a failure
    events += [_ev("attempt_start", 30.0, 3, world_size=2), _ev("step", 31.0, 3, global_step=3)]
    assert len(summarize_recovery(events)) == 1
    assert summarize_recovery([]) == [] and failure_events([]) is None
    with pytest.raises(ValueError, match="Event.kind"):
        Event("exploded")


def _preempt_worker(rank: int, port: int, root: str) -> None:
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    from gemray.config import load_config
    from gemray.train.preemption_vote import PreemptionVote
    from gemray.preemption import clear_notice, write_notice

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = load_config(None)
        cfg.checkpoint.preempt_notice = str(Path(root) / "PREEMPT")
        cpu = torch.device("cpu")
        vote = PreemptionVote(cfg.checkpoint.preempt_notice, cpu, 2)
        assert vote.install_sigterm_handler()  # spawned process: the main thread may install it
        votes = [vote.agree()]
        if rank == 0:
            write_notice(cfg.checkpoint.preempt_notice, "test")  # the job's notice, seen by rank 0 at least
        votes.append(vote.agree())
        dist.barrier()
        if rank == 0:
            clear_notice(cfg.checkpoint.preempt_notice)
        dist.barrier()
        votes.append(vote.agree())
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to one rank only
            time.sleep(0.2)
        votes.append(vote.agree())
        (Path(root) / f"votes{rank}.json").write_text(json.dumps(votes))
    finally:
        dist.destroy_process_group()


def test_preemption_notice_or_sigterm_on_one_rank_stops_every_rank(tmp_path):
    """A notice file (as `gemray preempt` / the driver's SIGTERM handler write it) or a SIGTERM to rank 1
    alone: at the next poll both ranks agree (all_reduce) on "stop" (emergency checkpoint, end the run);
    the process survived the signal (the handler replaced the default)."""
    from proc_utils import free_port, spawn_ranks

    spawn_ranks(_preempt_worker, (free_port(), str(tmp_path)), 2, [tmp_path / f"votes{r}.json" for r in (0, 1)])
    for r in (0, 1):
        assert json.loads((tmp_path / f"votes{r}.json").read_text()) == [None, "stop", None, "stop"]


def test_preemption_action_and_notice_files(tmp_path):
    from gemray.cli import main
    from gemray.preemption import NOTICE_NAME, clear_notice, read_notice

    assert preemption_action(0, 0, 2) is None
    assert preemption_action(1, 0, 2) == "stop" and preemption_action(2, 2, 2) == "stop"
    assert preemption_action(0, 1, 2) == "checkpoint"  # Ray's node drain: checkpoint, keep going
    with pytest.raises(ValueError, match="stop_votes=3 outside 0..2"):
        preemption_action(3, 0, 2)
    assert read_notice(tmp_path / NOTICE_NAME) is None and read_notice("") is None
    assert main(["preempt", "--output", str(tmp_path), "--reason", "spot reclaim"]) == 0
    assert read_notice(tmp_path / NOTICE_NAME)["reason"] == "spot reclaim"
    assert clear_notice(tmp_path / NOTICE_NAME) and not clear_notice(tmp_path / NOTICE_NAME)
    (tmp_path / NOTICE_NAME).touch()  # a node agent's plain `touch` counts too
    assert read_notice(tmp_path / NOTICE_NAME) == {"reason": "notice file"}
    assert main(["preempt", "--output", str(tmp_path / "missing")]) == 2


def test_failure_events_know_planned_stops_and_interrupted_writes():
    from gemray.events import interrupted_checkpoint

    def ev(kind, t, **d):
        return Event(kind, t=t, attempt=1, detail=d).to_dict()

    died = [ev("attempt_start", 0, world_size=2), ev("step", 1, global_step=5), ev("checkpoint_begin", 1, global_step=5),
            ev("checkpoint_saved", 2, global_step=5), ev("step", 3, global_step=10),
            ev("checkpoint_begin", 3, global_step=10)]
    f = failure_events(died)
    assert f["last_checkpoint_begun"] == 10 and f["last_checkpoint_saved"] == 5 and f["last_global_step"] == 10
    assert interrupted_checkpoint(f, 5) == {"global_step": 10, "state": "interrupted_write"}
    reported = died + [ev("checkpoint_saved", 4, global_step=10)]
    assert interrupted_checkpoint(failure_events(reported), 5) == {"global_step": 10, "state": "not_committed"}
    assert interrupted_checkpoint(failure_events(reported), 10) is None
    # an attempt stopped by a preemption notice is a planned end: no failure; its resume is a "preemption" row
    stopped = reported + [ev("preempted", 5, global_step=10)]
    assert failure_events(stopped) is None
    # ... whose emergency checkpoint Ray committed (restored at 10), or did not (the run ended first, e.g. a
    # second SIGTERM to the driver: restored at 5)
    assert preempted_step(stopped) == 10 and preempted_step(reported) is None and preempted_step([]) is None
    assert interrupted_checkpoint(None, 10, preempted_step(stopped)) is None
    assert interrupted_checkpoint(None, 5, preempted_step(stopped)) == {"global_step": 10,
                                                                         "state": "stop_not_committed"}
    nxt = [Event("attempt_start", t=9, attempt=2, detail={"world_size": 2}).to_dict(),
           Event("checkpoint_restored", t=11, attempt=2, detail={"global_step": 10}).to_dict(),
           Event("first_step", t=12, attempt=2, detail={"global_step": 11}).to_dict()]
    (resumed,) = summarize_recovery(stopped + nxt)
    assert (resumed["kind"], resumed["restored_step"], resumed["steps_lost"]) == ("preemption", 10, 0)
    assert resumed["seconds_to_first_step"] == 9  # from the last step (t=3), the stopped time included
    assert [r["kind"] for r in summarize_recovery(reported + nxt)] == ["failure"]


def test_epoch_fields_number_epochs_as_the_log_lines_do():
    """Mid-way through the third epoch (2 completed): epoch 3, as "epoch 3 step 5"; at its end: 3 and 3."""
    from gemray.events import epoch_fields

    assert epoch_fields(2, in_progress=True) == {"epoch": 3, "epochs_completed": 2}
    assert epoch_fields(3, in_progress=False) == {"epoch": 3, "epochs_completed": 3}
    assert epoch_fields(0, in_progress=True) == {"epoch": 1, "epochs_completed": 0}
