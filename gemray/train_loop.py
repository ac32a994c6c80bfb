"""The function every Ray Train worker runs: build, shard, restore, train, evaluate, checkpoint.

Reads top to bottom (``train_loop_per_worker``). Collective discipline: every rank runs the same number
of steps per epoch (``HistoryStream.num_batches`` is identical on all ranks; trailing batches may be
empty, B=0, and still run forward/backward so DDP and the sharded embedding all-to-alls line up), the
same number of evaluation lookups, and the same number of ``ray.train.report`` calls.

Evaluation follows the HSTU protocol (Zhai et al. 2024, sec. 4.1.1; ``gemray.metrics``): each user's
held-out item is ranked against ALL items (ids 1..N; column 0 of the score matrix is padding), HR@K /
NDCG@K sums are all-reduced over ranks.

Reported metrics per epoch (rank 0's dict is attached to the checkpoint): ``epoch`` (the epoch just completed,
1-based, = completed epochs),
``train_loss``, ``samples_per_s`` / ``tokens_per_s`` (global, training steps only), ``token_imbalance``
(mean over steps of max/mean tokens across ranks, measured by all-gathering per-step counts),
``epoch_s``, ``valid_hr@K`` / ``valid_ndcg@K`` on eval epochs; the last epoch's report also carries
``test_hr@K`` / ``test_ndcg@K``, ``world_size`` and ``history`` (the per-epoch dicts, restored across
restarts). Ray Train V2's ``Result.metrics`` is the dict reported with the latest checkpoint, so the
last epoch always checkpoints. A checkpoint inside an epoch reports ``epoch`` (the one in progress, as the
log lines number it), ``epochs_completed``, ``global_step``, ``checkpoint`` (the reason) and ``preempted``
(gemray.events.epoch_fields).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemray.checkpoint import checkpoint_reason, data_record, report_with_checkpoint, restore_from_ray
from gemray.config import JobConfig, from_dict
from gemray.events import EventLog, epoch_fields, failure_events, preempted_step, read_events
from gemray.metrics import RetrievalMetrics, history_mask, target_ranks
from gemray.parallel import build_optimizer, parallelize, plan_layout
from gemray.preemption import preemption_action, read_notice

log = logging.getLogger("gemray.train")


def _setup_logging(rank: int) -> None:
    """INFO from gemray on rank 0, WARNING elsewhere, to stderr (Ray forwards it to the driver)."""
    level = logging.INFO if rank == 0 else logging.WARNING
    root = logging.getLogger("gemray")
    root.setLevel(level)
    if not any(getattr(h, "_gemray", False) for h in root.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
        h._gemray = True  # type: ignore[attr-defined]
        root.addHandler(h)
        root.propagate = False


def build_model(cfg: JobConfig, num_items: int) -> torch.nn.Module:
    """The whole GEM on the meta device (``parallelize`` shards and materialises it)."""
    from gemray.model.gem import GEM

    return GEM(cfg.model, num_items, "meta", max_seq_len=cfg.data.max_seq_len)


def _step_seed(seed: int, global_step: int, rank: int) -> int:
    """Seed for dropout / negative sampling at one global step of one rank: a function of (seed, step,
    rank) only, so a run resumed mid-epoch draws exactly what an uninterrupted run would have drawn."""
    return (int(seed) * 1_000_003 + int(global_step) * 7_919 + int(rank) * 104_729) % (2**63 - 1)


# This process got SIGTERM (only where a handler can be installed: plain torch.distributed processes, not
# Ray Train workers; inside Ray the notice comes as a file, see gemray.preemption).
_PREEMPT = threading.Event()


def _install_sigterm_handler() -> bool:
    """SIGTERM -> set the preemption flag (the step loop takes an emergency checkpoint). Only possible
    from the main thread (Ray Train V2 runs the train function in a thread: then it returns False)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):  # noqa: ARG001
        log.warning("SIGTERM received: emergency checkpoint at the next poll step, then stop")
        _PREEMPT.set()
        signal.signal(signal.SIGTERM, previous if callable(previous) else signal.SIG_DFL)

    signal.signal(signal.SIGTERM, handler)
    return True


class _EpochStats:
    """Running global statistics of one epoch, reducible at any step boundary (for mid-epoch checkpoints).

    Local part: per-step token and sample counts of this rank, loss and target sums, wall seconds.
    ``reduce()`` (collective) folds them into the global part ``g``: {"loss_sum", "target_sum",
    "samples", "tokens", "imb_sum", "imb_steps", "train_s"}, which is identical on every rank and is
    what a checkpoint stores.
    """

    KEYS = ("loss_sum", "target_sum", "samples", "tokens", "imb_sum", "imb_steps", "train_s")

    def __init__(self, saved: dict[str, float] | None = None):
        self.g = {k: float((saved or {}).get(k, 0.0)) for k in self.KEYS}
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self.samples: list[int] = []
        self.loss_sum = self.target_sum = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: float, num_targets: float, tokens: int, samples: int) -> None:
        self.loss_sum += loss * num_targets
        self.target_sum += num_targets
        self.tokens.append(tokens)
        self.samples.append(samples)

    def reduce(self, device: torch.device, world: int) -> dict[str, float]:
        """Collective: fold this rank's steps since the last reduce into the global sums; returns them."""
        wall = time.perf_counter() - self.t0
        local = torch.tensor([self.tokens, self.samples], dtype=torch.int64, device=device).reshape(2, -1)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        per_rank = torch.stack([g[0].cpu() for g in gathered], dim=1).to(torch.float64)  # [steps, world]
        mean = per_rank.mean(dim=1)
        busy = mean > 0
        sums = torch.tensor([self.loss_sum, self.target_sum], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        wall_t = torch.tensor([wall], dtype=torch.float64, device=device)
        dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
        sums = sums.cpu()
        self.g["loss_sum"] += float(sums[0])
        self.g["target_sum"] += float(sums[1])
        self.g["samples"] += float(sum(int(g[1].sum()) for g in gathered))
        self.g["tokens"] += float(per_rank.sum())
        self.g["imb_sum"] += float((per_rank[busy].max(dim=1).values / mean[busy]).sum()) if bool(busy.any()) else 0.0
        self.g["imb_steps"] += float(busy.sum())
        self.g["train_s"] += float(wall_t.cpu())
        self._clear()
        return dict(self.g)

    def result(self) -> dict[str, float]:
        g, w = self.g, max(self.g["train_s"], 1e-9)
        return {"train_loss": g["loss_sum"] / g["target_sum"] if g["target_sum"] else 0.0,
                "samples_per_s": g["samples"] / w, "tokens_per_s": g["tokens"] / w,
                "token_imbalance": g["imb_sum"] / g["imb_steps"] if g["imb_steps"] else 1.0, "train_s": w}


def train_step(dmp: torch.nn.Module, optimizer: Any, batch: Any, device: torch.device) -> tuple[float, float]:
    """Forward, backward (the fused sparse optimizer steps inside), dense step. Returns (loss, targets).

    Raises FloatingPointError, before any weight moves, when the loss is NaN or infinite (a diverged run
    must fail, not go on to report metrics of NaN scores).
    """
    batch = batch.to(device)
    loss, stats = dmp(batch)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"training loss is {value}: the model diverged (check train.lr, "
                                 f"train.sparse_lr, model.temperature); no weights were updated by this step")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n_t = float(stats.get("num_targets", 0)) if isinstance(stats, dict) else 0.0
    return value, n_t


@torch.no_grad()
def evaluate(dmp: torch.nn.Module, stream: Any, *, num_items: int, ks: list[int],
             device: torch.device, exclude_history: bool = True) -> dict[str, float]:
    """HR@K / NDCG@K over every rank's users of ``stream`` (valid or test split), full item ranking.

    Item table: ``item_embeddings(arange(0, N+1))`` -> [N+1, D] (same ids on every rank; column 0 is the
    padding id, excluded by ``target_ranks``). Per batch: users [B, D] @ items.T -> scores [B, N+1].
    With ``exclude_history`` the items of each user's input history are not ranked (``history_mask``,
    generative-recommenders' protocol) and the all-items figures come back too, as ``hr@K_unfiltered``.
    Returns {"hr@K", "ndcg@K", ["hr@K_unfiltered", "ndcg@K_unfiltered", "targets_in_history"],
    "num_users"} from all-reduced sums (identical on every rank).
    """
    model = dmp.module
    dmp.eval()
    items = model.item_embeddings(torch.arange(0, num_items + 1, device=device))  # [N+1, D]
    metrics, unfiltered = RetrievalMetrics(ks), RetrievalMetrics(ks)
    in_history = torch.zeros(1, dtype=torch.float64)
    for batch in stream.iter_epoch(0):
        batch = batch.to(device)
        users = model.user_embeddings(batch)  # [B, D]
        if not batch.batch_size:
            continue
        scores = users @ items.T
        if exclude_history:
            seen = history_mask(batch.item_ids, batch.offsets, num_items)
            metrics.update(target_ranks(scores, batch.targets, seen))
            unfiltered.update(target_ranks(scores, batch.targets))
            in_history += float(seen.gather(1, batch.targets.view(-1, 1)).sum())
        else:
            metrics.update(target_ranks(scores, batch.targets))
    sums = torch.cat([metrics.sums(), unfiltered.sums(), in_history]).to(device)
    dist.all_reduce(sums)
    dmp.train()
    sums = sums.cpu()
    n = metrics.sums().numel()
    out = metrics.compute(sums[:n])
    if exclude_history:
        out.update({f"{k}_unfiltered": v for k, v in unfiltered.compute(sums[n:2 * n]).items()
                    if k != "num_users"})
        out["targets_in_history"] = float(sums[2 * n])
    return out


def _process_start_time() -> float:
    """Unix time this worker process started (Ray starts a fresh process per worker-group start).

    From Linux's /proc (boot time + the process's start in clock ticks; psutil is not in the pinned stack);
    elsewhere the current time, so the phase reads 0.
    """
    try:
        import os

        btime = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        stat = open("/proc/self/stat").read()
        ticks = float(stat.rsplit(")", 1)[1].split()[19])  # field 22 (starttime); fields 1-2 end at ")"
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _uncommitted_note(restored_from: str | None) -> str:
    """Names the checkpoint folders next to the restored one that Ray never committed (partial writes)."""
    if not restored_from:
        return ""
    from gemray.checkpoint import uncommitted_checkpoints

    left = uncommitted_checkpoints(Path(restored_from).parent)
    return f"; ignoring uncommitted folder(s) {[p.name for p in left]}" if left else ""


def _agree_attempt(rank: int, device: torch.device) -> int:
    """One id for this start of the worker group: rank 0's clock in ns, shared with every rank."""
    t = torch.tensor([time.time_ns() if rank == 0 else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.cpu())


def _ray_preemption_info() -> Any:
    """Ray Train's node-drain notice for this worker group (None outside Ray Train or when none)."""
    try:
        import ray.train

        get = getattr(ray.train, "get_preemption_info", None)
        return get() if get is not None else None
    except Exception:  # no Ray Train context (plain torch.distributed processes)
        return None


def _agree_preempt(cfg: JobConfig, device: torch.device, world: int, *, drain_handled: bool = False
                   ) -> str | None:
    """Collective preemption vote (every rank calls it at the same global step; the loop calls it every
    ``checkpoint.preempt_poll_steps`` steps). Returns ``gemray.preemption.preemption_action``'s verdict:
    "stop" if any rank sees the job's notice file (``checkpoint.preempt_notice``) or got SIGTERM itself,
    "checkpoint" if any rank has Ray Train's node-drain notice (ignored once ``drain_handled``), else
    None. The all-reduce completing on every rank is what shows the group is still healthy."""
    stop = _PREEMPT.is_set() or read_notice(cfg.checkpoint.preempt_notice) is not None
    drain = not drain_handled and _ray_preemption_info() is not None
    votes = torch.tensor([int(stop), int(drain)], dtype=torch.int64, device=device)
    dist.all_reduce(votes)
    votes = votes.cpu()
    return preemption_action(int(votes[0]), int(votes[1]), world)


def _interrupted_checkpoint(failed: dict[str, Any] | None, restored_step: int,
                            stopped_at: int | None = None) -> dict[str, Any] | None:
    """What became of the previous attempt's newest checkpoint, if it is not the one restored: ``{"global_step",
    "state"}`` with state "interrupted_write" (begun, never reported: killed while writing), "not_committed"
    (reported, but Ray had not committed it before the failure) or, for an attempt that stopped on a
    preemption notice at global step ``stopped_at`` (``gemray.events.preempted_step``), "stop_not_committed"
    (its emergency checkpoint was reported but the run ended before Ray committed it). None otherwise."""
    if not failed:
        if stopped_at is not None and stopped_at > restored_step:
            return {"global_step": stopped_at, "state": "stop_not_committed"}
        return None
    if failed.get("last_checkpoint_begun") is None:
        return None
    begun, saved = failed["last_checkpoint_begun"], failed.get("last_checkpoint_saved")
    if begun <= restored_step:
        return None
    return {"global_step": begun, "state": "interrupted_write" if saved != begun else "not_committed"}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``JobConfig.to_dict()`` with absolute data paths.

    Elastic contract (see gemray.controller.policy): on every (re)start, derive the layout from the
    current world size, shard anew, restore the newest good committed checkpoint (DCP reshards it),
    continue the epoch at the saved global data position (``consumed`` samples of the epoch's global
    order: ElasticTrainStream), checkpoint every ``checkpoint.every_steps`` global steps, at epoch ends,
    and on a preemption notice agreed by all ranks (polled every ``checkpoint.preempt_poll_steps``
    steps): a job notice (gemray.preemption) -> emergency checkpoint, then return, so that Ray Train ends
    the run with that checkpoint committed; Ray's node-drain notice -> emergency checkpoint, go on.
    Every attempt logs a ``startup`` event with its phase timings.
    """
    import ray.train

    from gemray.ledger import LedgerWriter
    from gemray.pipelines.movielens import load_manifest
    from gemray.pipelines.stream import ElasticTrainStream, HistoryStream

    t_start = time.time()
    # 1. Who am I, where do I run; this attempt's id and event log.
    cfg = from_dict(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _setup_logging(rank)
    if cfg.ray.use_gpu:
        import ray.train.torch as rtt

        device = rtt.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    layout = plan_layout(world, device.type)
    attempt = _agree_attempt(rank, device)
    phases = {"process_to_train_fn_s": t_start - _process_start_time()}
    t_phase = time.time()
    previous = read_events(cfg.train.events_path) if cfg.train.events_path and rank == 0 else []
    events = EventLog(cfg.train.events_path, attempt=attempt, write=rank == 0)
    failed = failure_events(previous)
    if failed:
        events.emit("failure_detected", **failed)
    events.emit("attempt_start", world_size=world, t_start=t_start, sharding_types=list(layout.sharding_types))
    log.info("rank %d/%d on %s (%s); job %s", rank, world, device, layout.backend, cfg.name)
    _PREEMPT.clear()
    _install_sigterm_handler()

    # 2. Data and model (a fresh TorchRec plan for this world size).
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    manifest = load_manifest(cfg.data.prepared_dir)
    num_items = int(manifest["counts"]["items"])
    trained_on = data_record(manifest)  # recorded in every checkpoint: a resume on other data is refused up front
    train_stream = ElasticTrainStream.from_config(cfg.data, rank=rank, world_size=world, seed=cfg.train.seed)
    streams = {split: HistoryStream.from_config(cfg.data, split, rank=rank, world_size=world,
                                                seed=cfg.train.seed) for split in ("valid", "test")}
    phases["setup_and_data_s"], t_phase = time.time() - t_phase, time.time()
    dmp = parallelize(build_model(cfg, num_items), layout=layout, cfg=cfg, device=device)
    optimizer = build_optimizer(dmp, cfg)
    phases["build_and_shard_s"], t_phase = time.time() - t_phase, time.time()

    # 3. Restore (Ray hands back the latest committed checkpoint after a failure or a resize; a corrupt
    #    one is skipped for the previous good one).
    trainer = restore_from_ray(dmp, optimizer)
    phases["restore_s"] = time.time() - t_phase
    fresh = trainer is None
    trainer = trainer or {"epoch": 0, "consumed": 0, "epoch_step": 0, "global_step": 0, "history": []}
    start_epoch, history = int(trainer["epoch"]), list(trainer.get("history", []))
    global_step = int(trainer.get("global_step", 0))
    position = {"consumed": int(trainer.get("consumed", 0)), "epoch_step": int(trainer.get("epoch_step", 0)),
                "partial": trainer.get("partial")}
    if not fresh:
        saved_world = trainer.get("world_size")
        for path, why in trainer.get("skipped_checkpoints", []):
            events.emit("checkpoint_fallback", skipped=path, reason=why, used=trainer.get("restored_from"))
        events.emit("checkpoint_restored", global_step=global_step, **epoch_fields(start_epoch, in_progress=True),
                    consumed=position["consumed"], saved_world_size=saved_world, world_size=world,
                    path=trainer.get("restored_from"))
        log.info("resuming at epoch %d, sample %d of its order (global step %d), checkpoint saved by %s "
                 "ranks, now %d", start_epoch + 1, position["consumed"], global_step, saved_world, world)
    lost = _interrupted_checkpoint(failed, global_step, preempted_step(previous))
    if lost:
        how = {"interrupted_write": "was killed while writing it (its report never completed, so Ray never "
                                    "committed it)",
               "not_committed": "reported it, but Ray had not committed it before the failure",
               "stop_not_committed": "stopped on a preemption notice and reported it as its emergency "
                                     "checkpoint, but the run ended before Ray committed it (e.g. a second "
                                     "SIGTERM)"}[lost["state"]]
        log.warning("the previous attempt's checkpoint of global step %d is not used: the attempt %s; resuming "
                    "from the last committed checkpoint (global step %d)%s", lost["global_step"], how,
                    global_step, _uncommitted_note(trainer.get("restored_from")))
        events.emit("checkpoint_uncommitted", restored_global_step=global_step, **lost)
    events.emit("startup", **{k: round(v, 3) for k, v in phases.items()})
    # A resize: the previous attempt (from the event log) or the restored checkpoint ran at another size.
    prev_world = (failed or {}).get("world_size") or (None if fresh else trainer.get("world_size"))
    if prev_world is not None and prev_world != world:
        events.emit("resize", from_world_size=prev_world, to_world_size=world,
                    resharded_from=None if fresh else trainer.get("world_size"),
                    sharding_types=list(layout.sharding_types), dense_mesh=[world, 1])
    ledger = (LedgerWriter(cfg.train.ledger_dir, attempt=attempt, rank=rank, world_size=world,
                           restored_global_step=global_step) if cfg.train.ledger_dir else None)

    # 4. Epochs, step by step.
    ks = list(cfg.train.eval_ks)
    first_step_logged = fresh
    poll, drain_handled, stopped = cfg.checkpoint.preempt_poll_steps, False, False
    for epoch in range(start_epoch, cfg.train.epochs):
        t0 = time.perf_counter()
        pos = position if epoch == start_epoch else {"consumed": 0, "epoch_step": 0, "partial": None}
        consumed, epoch_step = int(pos["consumed"]), int(pos["epoch_step"])
        acc = _EpochStats(pos["partial"])
        steps = train_stream.num_steps(consumed)
        if cfg.train.max_steps_per_epoch:
            steps = min(steps, max(0, cfg.train.max_steps_per_epoch - epoch_step))
        dmp.train()
        t_log, n_log, tok_log = time.perf_counter(), 0, 0
        batches = train_stream.iter_epoch(epoch, consumed)
        for i in range(steps):
            batch, consumed = next(batches)
            torch.manual_seed(_step_seed(cfg.train.seed, global_step, rank))  # dropout
            dmp.module.seed_sampling(_step_seed(cfg.train.seed + 1, global_step, rank))  # negatives
            loss, n_t = train_step(dmp, optimizer, batch, device)
            acc.add(loss, n_t, batch.num_tokens, batch.batch_size)
            global_step += 1
            epoch_step += 1
            if ledger is not None:
                ledger.step(epoch, global_step, batch.user_ids.tolist())
            events.emit("step", quiet=True, global_step=global_step, epoch=epoch + 1, consumed=consumed)
            if not first_step_logged:
                events.emit("first_step", global_step=global_step, since_start_s=time.time() - t_start)
                first_step_logged = True
            n_log += batch.batch_size
            tok_log += batch.num_tokens
            if rank == 0 and epoch_step % cfg.train.log_every == 0:
                dt = max(time.perf_counter() - t_log, 1e-9)
                log.info("epoch %d step %d (global %d) loss %.4f rank0 %.0f samples/s %.0f tokens/s",
                         epoch + 1, epoch_step, global_step, loss, n_log / dt, tok_log / dt)
                t_log, n_log, tok_log = time.perf_counter(), 0, 0
            # The preemption vote: every `poll` global steps and at each epoch's last step (were the last step
            # skipped, a poll interval that divides the steps per epoch would never vote: each of its steps
            # would be an epoch's last). Without a notice, the epoch-end checkpoint below covers the last step;
            # with one, the emergency checkpoint is taken here (a resumed run then has 0 steps left of this
            # epoch and goes straight to its end).
            last = i == steps - 1
            action = (_agree_preempt(cfg, device, world, drain_handled=drain_handled)
                      if poll and (global_step % poll == 0 or last) else None)
            if last and action is None:
                break
            drain_handled = drain_handled or action == "checkpoint"
            reason = checkpoint_reason(global_step, cfg.checkpoint.every_steps, preempt=action is not None,
                                       epoch_end=False)
            if reason:
                partial = acc.reduce(device, world)
                state = {"epoch": epoch, "consumed": consumed, "epoch_step": epoch_step,
                         "global_step": global_step, "history": history, "partial": partial}
                events.emit("checkpoint_begin", quiet=True, reason=reason, global_step=global_step)
                report_with_checkpoint({**epoch_fields(epoch, in_progress=True), "global_step": global_step,
                                        "checkpoint": reason, "preempted": action == "stop"}, dmp, optimizer,
                                       state, data=trained_on)
                events.emit("checkpoint_saved", reason=reason, global_step=global_step,
                            **epoch_fields(epoch, in_progress=True), consumed=consumed)
                if action == "stop":
                    notice = read_notice(cfg.checkpoint.preempt_notice) or {"reason": "SIGTERM to a worker"}
                    log.warning("preemption notice (%s): emergency checkpoint of global step %d reported; "
                                "stopping. Re-run the same command to resume at this step.",
                                notice.get("reason"), global_step)
                    events.emit("preempted", global_step=global_step, **epoch_fields(epoch, in_progress=True),
                                consumed=consumed, notice=notice)
                    stopped = True
                    break
                if reason == "emergency":
                    _PREEMPT.clear()
        if stopped:
            break
        acc.reduce(device, world)
        stats = acc.result()
        done = epoch + 1
        metrics: dict[str, Any] = {"epoch": done, "global_step": global_step, **stats}
        if done % cfg.train.eval_every == 0 or done == cfg.train.epochs:
            valid = evaluate(dmp, streams["valid"], num_items=num_items, ks=ks, device=device,
                             exclude_history=cfg.train.eval_exclude_history)
            metrics.update({f"valid_{k}": v for k, v in valid.items() if k != "num_users"})
        # History must be identical on every rank (DCP keeps one copy of the trainer state): max over ranks.
        epoch_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(epoch_s, op=dist.ReduceOp.MAX)
        metrics["epoch_s"] = float(epoch_s)
        history.append(dict(metrics))
        log.info("epoch %d done: %s", done, ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                      f"{k}={v}" for k, v in metrics.items()))
        if done == cfg.train.epochs:
            # Test split once, at the end; reported with the last checkpoint so Ray's Result carries it.
            test = evaluate(dmp, streams["test"], num_items=num_items, ks=ks, device=device,
                            exclude_history=cfg.train.eval_exclude_history)
            log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in test.items()))
            metrics.update({f"test_{k}": v for k, v in test.items()})
            metrics.update({"final": True, "world_size": world, "history": list(history)})
        state = {"epoch": done, "consumed": 0, "epoch_step": 0, "global_step": global_step, "history": history,
                 "partial": None}
        reason = checkpoint_reason(global_step, cfg.checkpoint.every_steps, preempt=False, epoch_end=True,
                                   done_epochs=done, every_epochs=cfg.checkpoint.every_epochs,
                                   last_epoch=done == cfg.train.epochs)
        if reason:
            events.emit("checkpoint_begin", quiet=True, reason=reason, global_step=global_step)
            report_with_checkpoint(metrics, dmp, optimizer, state, data=trained_on)
            events.emit("checkpoint_saved", reason=reason, global_step=global_step,
                        **epoch_fields(done, in_progress=False), consumed=0)
        else:
            ray.train.report(metrics)
    if ledger is not None:
        ledger.close()
    if stopped:
        return  # the run ends here; Ray Train commits the emergency checkpoint as the run's latest
    if start_epoch >= cfg.train.epochs:
        log.info("the restored checkpoint has %d epoch(s) done, train.epochs is %d: nothing to train",
                 start_epoch, cfg.train.epochs)
    events.emit("finished", global_step=global_step)
