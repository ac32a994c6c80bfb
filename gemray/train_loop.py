"""The function every Ray Train worker runs: build, shard, restore, train, evaluate, checkpoint.

Reads top to bottom (``train_loop_per_worker``). Collective discipline: every rank runs the same number
of steps per epoch (``HistoryStream.num_batches`` is identical on all ranks; trailing batches may be
empty, B=0, and still run forward/backward so DDP and the sharded embedding all-to-alls line up), the
same number of evaluation lookups, and the same number of ``ray.train.report`` calls.

Evaluation follows the HSTU protocol (Zhai et al. 2024, sec. 4.1.1; ``gemray.metrics``): each user's
held-out item is ranked against ALL items (ids 1..N; column 0 of the score matrix is padding), HR@K /
NDCG@K sums are all-reduced over ranks.

Reported metrics per epoch (rank 0's dict is attached to the checkpoint): ``epoch`` (completed epochs),
``train_loss``, ``samples_per_s`` / ``tokens_per_s`` (global, training steps only), ``token_imbalance``
(mean over steps of max/mean tokens across ranks, measured by all-gathering per-step counts),
``epoch_s``, ``valid_hr@K`` / ``valid_ndcg@K`` on eval epochs; the last epoch's report also carries
``test_hr@K`` / ``test_ndcg@K``, ``world_size`` and ``history`` (the per-epoch dicts, restored across
restarts). Ray Train V2's ``Result.metrics`` is the dict reported with the latest checkpoint, so the
last epoch always checkpoints.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gemray.checkpoint import report_with_checkpoint, restore_from_ray
from gemray.config import JobConfig, from_dict
from gemray.metrics import RetrievalMetrics, target_ranks
from gemray.parallel import parallelize, plan_layout

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


def build_model(cfg: JobConfig, num_items: int, device: torch.device) -> torch.nn.Module:
    """A plain GEM with dense modules on ``device`` (seeded, identical on every rank) and its
    EmbeddingCollection on ``meta`` (materialised by sharding)."""
    from gemray.model.embeddings import make_embedding_collection
    from gemray.model.gem import GEM

    torch.manual_seed(cfg.train.seed)
    model = GEM(cfg.model, num_items, device, max_seq_len=cfg.data.max_seq_len)
    model.embeddings = make_embedding_collection(cfg.model, num_items, "meta")
    return model


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + int(rank) * 104_729) % (2**63 - 1)


def train_epoch(dmp: torch.nn.Module, optimizer: Any, stream: Any, *, epoch: int, cfg: JobConfig,
                device: torch.device, rank: int, world: int) -> dict[str, float]:
    """One epoch over this rank's train batches; returns global stats (identical on every rank).

    Returns {"train_loss": target-weighted mean loss over all ranks, "samples_per_s", "tokens_per_s"
    (global, over the epoch's training wall time in seconds), "token_imbalance", "steps"}.
    """
    from gemray.pipelines.bbs import imbalance

    dmp.train()
    steps = stream.num_batches()
    if cfg.train.max_steps_per_epoch:
        steps = min(steps, cfg.train.max_steps_per_epoch)
    tokens = np.zeros(steps, np.int64)
    samples = np.zeros(steps, np.int64)
    loss_sum = 0.0
    target_sum = 0.0
    t0 = time.perf_counter()
    t_log, n_log, tok_log = t0, 0, 0
    for step, batch in enumerate(stream.iter_epoch(epoch)):
        if step >= steps:
            break
        batch = batch.to(device)
        loss, stats = dmp(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        n_t = float(stats.get("num_targets", 0)) if isinstance(stats, dict) else 0.0
        loss_sum += float(loss.detach()) * n_t
        target_sum += n_t
        tokens[step], samples[step] = batch.num_tokens, batch.batch_size
        n_log += batch.batch_size
        tok_log += batch.num_tokens
        if rank == 0 and (step + 1) % cfg.train.log_every == 0:
            dt = max(time.perf_counter() - t_log, 1e-9)
            log.info("epoch %d step %d/%d loss %.4f rank0 %.0f samples/s %.0f tokens/s", epoch + 1, step + 1,
                     steps, float(loss.detach()), n_log / dt, tok_log / dt)
            t_log, n_log, tok_log = time.perf_counter(), 0, 0
    wall = time.perf_counter() - t0
    # Exact global figures: gather the per-step token counts of every rank once per epoch.
    # Collectives run on the process group's device (NCCL has no CPU tensors), results come back to CPU.
    local = torch.from_numpy(np.stack([tokens, samples])).to(device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    gathered = [g.cpu() for g in gathered]
    per_rank_tokens = torch.stack([g[0] for g in gathered], dim=1).numpy()  # [steps, world]
    total_samples = int(sum(int(g[1].sum()) for g in gathered))
    sums = torch.tensor([loss_sum, target_sum, wall], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    sums = sums.cpu()
    wall_max = torch.tensor([wall], dtype=torch.float64, device=device)
    dist.all_reduce(wall_max, op=dist.ReduceOp.MAX)
    w = max(float(wall_max), 1e-9)
    return {"train_loss": float(sums[0] / sums[1]) if float(sums[1]) else 0.0,
            "samples_per_s": total_samples / w, "tokens_per_s": float(per_rank_tokens.sum()) / w,
            "token_imbalance": imbalance(per_rank_tokens) if steps else 1.0, "steps": steps,
            "train_s": w}


@torch.no_grad()
def evaluate(dmp: torch.nn.Module, stream: Any, *, num_items: int, ks: list[int],
             device: torch.device) -> dict[str, float]:
    """HR@K / NDCG@K over every rank's users of ``stream`` (valid or test split), full item ranking.

    Item table: ``item_embeddings(arange(0, N+1))`` -> [N+1, D] (same ids on every rank; column 0 is the
    padding id, excluded by ``target_ranks``). Per batch: users [B, D] @ items.T -> scores [B, N+1].
    Returns {"hr@K", "ndcg@K", "num_users"} from all-reduced sums (identical on every rank).
    """
    model = dmp.module
    dmp.eval()
    items = model.item_embeddings(torch.arange(0, num_items + 1, device=device))  # [N+1, D]
    metrics = RetrievalMetrics(ks)
    for batch in stream.iter_epoch(0):
        batch = batch.to(device)
        users = model.user_embeddings(batch)  # [B, D]
        if batch.batch_size:
            metrics.update(target_ranks(users @ items.T, batch.targets))
    sums = metrics.sums().to(device)
    dist.all_reduce(sums)
    dmp.train()
    return metrics.compute(sums.cpu())


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``JobConfig.to_dict()`` with absolute data paths."""
    import ray.train

    from gemray.pipelines.movielens import load_manifest
    from gemray.pipelines.stream import HistoryStream

    # 1. Who am I, where do I run.
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
    log.info("rank %d/%d on %s (%s); job %s", rank, world, device, layout.backend, cfg.name)

    # 2. Data and model.
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    manifest = load_manifest(cfg.data.prepared_dir)
    num_items = int(manifest["counts"]["items"])
    streams = {split: HistoryStream.from_config(cfg.data, split, rank=rank, world_size=world,
                                                seed=cfg.train.seed) for split in ("train", "valid", "test")}
    model = build_model(cfg, num_items, device)
    dmp, optimizer = parallelize(model, layout=layout, cfg=cfg, device=device)

    # 3. Restore (Ray hands back the latest committed checkpoint after a failure or a resize).
    trainer = restore_from_ray(dmp, optimizer) or {"epoch": 0, "step": 0, "global_step": 0, "history": []}
    start_epoch, history = int(trainer["epoch"]), list(trainer.get("history", []))
    global_step = int(trainer.get("global_step", 0))
    if start_epoch:
        log.info("resuming at epoch %d (global step %d), checkpoint saved by %s ranks, now %d", start_epoch,
                 global_step, trainer.get("world_size"), world)

    # 4. Epochs.
    ks = list(cfg.train.eval_ks)
    for epoch in range(start_epoch, cfg.train.epochs):
        t0 = time.perf_counter()
        torch.manual_seed(_epoch_seed(cfg.train.seed, epoch, rank))  # dropout
        dmp.module.seed_sampling(_epoch_seed(cfg.train.seed + 1, epoch, rank))  # negatives
        stats = train_epoch(dmp, optimizer, streams["train"], epoch=epoch, cfg=cfg, device=device,
                            rank=rank, world=world)
        global_step += stats.pop("steps")
        done = epoch + 1
        metrics: dict[str, Any] = {"epoch": done, "global_step": global_step, **stats}
        if done % cfg.train.eval_every == 0 or done == cfg.train.epochs:
            valid = evaluate(dmp, streams["valid"], num_items=num_items, ks=ks, device=device)
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
            test = evaluate(dmp, streams["test"], num_items=num_items, ks=ks, device=device)
            log.info("test: %s", ", ".join(f"{k}={v:.4f}" for k, v in test.items()))
            metrics.update({f"test_{k}": v for k, v in test.items()})
            metrics.update({"final": True, "world_size": world, "history": list(history)})
        state = {"epoch": done, "step": 0, "global_step": global_step, "history": history}
        if done % cfg.checkpoint.every_epochs == 0 or done == cfg.train.epochs:
            report_with_checkpoint(metrics, dmp, optimizer, state)
        else:
            ray.train.report(metrics)
    if start_epoch >= cfg.train.epochs:
        log.info("all %d epochs already done in the restored checkpoint; nothing to train",
                 cfg.train.epochs)
