"""The Trainer every Ray Train worker runs: one method per phase, and ``train_loop_per_worker`` calling them.

Phases (torchtitan's order, ``torchtitan/trainer.py``): :meth:`Trainer.setup` (device, ranks, logging,
the attempt id, data streams) -> :meth:`Trainer.build` (the whole model on the meta device ->
``gemray.parallel.parallelize``: shard the embeddings, materialise the dense part seeded identically on every
rank, DDP or FSDP2 / HSDP over the ``[parallel]`` layout's device mesh -> optimizer) -> :meth:`Trainer.restore` -> per epoch :meth:`Trainer.train_epoch` (steps:
:meth:`Trainer.train_step`, the preemption vote, :meth:`Trainer.maybe_checkpoint`) and
:meth:`Trainer.evaluate` -> :meth:`Trainer.finish`. Decisions live apart from the code that acts on them:
``CheckpointPolicy`` (when to checkpoint), ``gemray.preemption.preemption_action`` (what a vote means),
``gemray.events`` (what the previous attempt left).

Collective discipline: every rank runs the same number of steps per epoch, the same number of evaluation
lookups, and the same number of ``ray.train.report`` calls. Training reads the train split through
``gemray.pipelines.stream.ElasticTrainStream`` (via ``gemray.pipelines.loader.TrainLoader``): every rank holds
all train samples and plans each step from the same next ``world_size * batch_size`` samples of one seeded,
world-size-independent epoch order (``gemray.pipelines.bbs.plan_global_step``), so the steps left,
``num_steps(consumed)`` = ceil((N - consumed) / (world_size * batch_size)), are the same on every rank without
communication. Every step but the epoch's last has B = ``batch_size`` on every rank; the last, partial one is
spread over all ranks, and a rank's batch is empty (B=0) only when fewer samples than ranks are left: it still
runs forward/backward, so DDP and the sharded embedding all-to-alls line up. Evaluation reads ``HistoryStream``s
(each rank its own shards, unshuffled, no BBS), whose ``num_batches`` is identical on all ranks; a rank with
fewer users gets empty trailing batches, evaluated all the same.

Evaluation follows the HSTU protocol (Zhai et al. 2024, sec. 4.1.1; ``gemray.metrics``,
``gemray.train.evaluation``): each user's held-out item is ranked against ALL items, HR@K / NDCG@K sums are
all-reduced over ranks.

Reported metrics per epoch (rank 0's dict is attached to the checkpoint): ``epoch`` (the epoch just
completed, 1-based, = completed epochs), ``global_step``, ``train_loss``, ``samples_per_s`` /
``tokens_per_s`` (global, training steps only), ``model_tflops_per_s``, ``local_mfu`` (with the sums behind it,
``mfu_flops`` / ``mfu_rank_s``, and the device's ``peak_flops``: gemray.train.throughput), ``token_imbalance`` (mean
over steps of max/mean tokens across ranks, measured by all-gathering per-step counts), ``train_s``,
``train_loss_<task>`` (several ``model.tasks``: each task's mean loss), ``train_moe_aux_loss`` /
``train_moe_dropped`` (``model.moe_experts`` > 0: the experts' load-balancing loss and share of assignments
over capacity, means over steps and ranks), ``valid_hr@K`` / ``valid_ndcg@K``
(retrieval) and ``valid_<task>_ne`` / ``_auc`` ... (ranking tasks, ``RankingEvaluator``) on eval epochs,
``epoch_s``; the last epoch's report also carries ``test_hr@K`` / ``test_ndcg@K``, ``final``,
``world_size`` and ``history`` (the per-epoch dicts, restored across restarts). Ray Train V2's
``Result.metrics`` is the dict reported with the latest checkpoint, so the last epoch always checkpoints. A
checkpoint inside an epoch reports ``epoch`` (the one in progress, as the log lines number it),
``epochs_completed``, ``global_step``, ``checkpoint`` (the reason) and ``preempted``
(gemray.events.epoch_fields).
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import closing, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from gemray.checkpoint import data_record, report_with_checkpoint, restore_from_ray
from gemray.config import JobConfig, compile_options, from_dict
from gemray.events import epoch_fields
from gemray.model.fp8 import collect_fp8_stats, fp8_weight_cache, log_fp8_stats, pop_fp8_stats
from gemray.model.lr_scaling import warmup_factor
from gemray.parallel import (build_optimizer, dense_lr_scales, dense_unsharded, parallelize, plan_layout, resolve,
                             set_dense_lr, set_sparse_step_counts, sparse_step_counts, sparse_steps_kept,
                             sync_sparse_replicas)
from gemray.parallel.activation_checkpoint import ActivationCheckpointer
from gemray.preemption import read_notice
from gemray.train.checkpoint_policy import CheckpointPolicy
from gemray.train.gc import GarbageCollection
from gemray.train.evaluation import build_evaluators, evaluation_metrics, evaluation_sums, split_summary
from gemray.train.precision import autocast
from gemray.train.preemption_vote import PreemptionVote
from gemray.train.recorder import RecoveryRecorder
from gemray.train.stats import EpochStats, ThroughputMeter, epoch_summary, progress_line
from gemray.train.task_stats import MoEStats, TaskLosses
from gemray.train.throughput import StepClock, batch_flops, device_peak_flops

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


def apply_determinism(enabled: bool, device: torch.device) -> None:
    """``train.deterministic``: set this process's ``torch.use_deterministic_algorithms`` to ``enabled`` (warn_only:
    an op without a deterministic kernel warns once instead of failing the run). Call before the model is built.

    What it changes here: FBGEMM's TBE backward on CUDA reads the flag and no longer splits an embedding row that
    occurs more than 1024 times in a batch over several thread blocks whose partial gradients are added with
    atomics (fbgemm_gpu ``embedding_backward_split_template.cu``: ``max_segment_length_per_cta``); PyTorch's CPU
    index backward (``index_put_`` with accumulate, e.g. the position embedding) sorts instead of adding in
    thread order. Enabled, it also turns off ``torch.utils.deterministic.fill_uninitialized_memory`` (NaN-filling
    every ``torch.empty``: a cost, and no part of the determinism of a correct program) and, on CUDA, sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless given (cuBLAS's reproducibility setting; read when the first cuBLAS
    handle is made)."""
    if enabled:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(bool(enabled), warn_only=True)


def step_seed(seed: int, global_step: int, rank: int) -> int:
    """Seed for dropout / negative sampling at one global step of one rank: a function of (seed, step,
    rank) only, so a run resumed mid-epoch draws exactly what an uninterrupted run would have drawn."""
    return (int(seed) * 1_000_003 + int(global_step) * 7_919 + int(rank) * 104_729) % (2**63 - 1)


def forward_backward_step(model: torch.nn.Module, optimizer: Any, batch: Any, device: torch.device, *,
                          precision: str = "fp32", stats_out: dict | None = None, read_loss: bool = True,
                          pipeline: Any = None, sampling_seed: int = 0, next_batch: Any = None,
                          next_sampling_seed: int = 0) -> tuple[Any, float]:
    """Forward (under ``gemray.train.precision.autocast(precision, device)``), backward (the fused sparse
    optimizer steps inside), dense step. Returns (loss, targets).

    model(batch) must return (loss scalar, stats dict with "num_targets", a CPU value); ``stats_out``, when
    given, is updated with that dict (e.g. the per-task "loss_<task>" / "count_<task>"). The batch goes to
    ``device`` through pinned memory, asynchronously, on CUDA (a pageable copy blocks the host per tensor); a batch
    the loader pinned already (``data.loader_workers``) is not pinned again.

    read_loss True (default): the loss is read on the host (a float; on CUDA a host sync) and checked: raises
    FloatingPointError, before any weight moves, when it is NaN or infinite (a diverged run must fail, not go
    on to report metrics of NaN scores). read_loss False: returns the detached 0-d loss tensor unread (no sync;
    the caller reads and checks it later: ``Trainer`` every ``train.log_every`` steps). precision "bf16" /
    "fp8": the forward under bf16 autocast (fp8's GEMMs are the converted modules', ``gemray.model.fp8``).
    pipeline: a ``gemray.train.pipeline.SparseDistPipeline`` (``parallel.train_pipeline = "sparse_dist"``):
    this batch comes from it (its negatives drawn with ``sampling_seed`` if it was not prefetched), and
    ``next_batch`` (the next step's host batch, None at the last step) is prefetched with
    ``next_sampling_seed`` while this one computes.
    """
    if pipeline is None:
        with record_function("gemray.to_device"):
            if device.type == "cuda" and batch.offsets.device.type == "cpu":  # pinned already by the loader's thread?
                batch = (batch if batch.is_pinned() else batch.pin_memory()).to(device, non_blocking=True)
            else:
                batch = batch.to(device)
        with autocast(precision, device), record_function("gemray.forward"):
            loss, stats = model(batch)
    else:
        with record_function("gemray.to_device"):
            batch, sparse, served = pipeline.take(batch, sampling_seed)
            if next_batch is not None:
                pipeline.prefetch(next_batch, next_sampling_seed)
        with autocast(precision, device), served, record_function("gemray.forward"):
            loss, stats = model(batch, sparse=sparse)
        pipeline.advance()
    if stats_out is not None and isinstance(stats, dict):
        stats_out.update(stats)
    if read_loss:
        value = float(loss.detach())
        check_finite_loss([value])
    else:
        value = loss.detach()
    with record_function("gemray.backward"):
        loss.backward()
    with record_function("gemray.optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    n_t = float(stats.get("num_targets", 0)) if isinstance(stats, dict) else 0.0
    return value, n_t


def check_finite_loss(values: list[float], first_step: int | None = None) -> None:
    """Raise FloatingPointError naming the first non-finite loss of ``values`` (the losses of consecutive
    steps; ``first_step``: the global step of ``values[0]`` when they were read late, None: just computed, no
    weight updated yet)."""
    for i, v in enumerate(values):
        if not math.isfinite(v):
            where = ("no weights were updated by this step" if first_step is None else
                     f"read at a log step: global step {first_step + i + 1} is the first non-finite one, and "
                     f"the weights were updated by the steps since")
            raise FloatingPointError(f"training loss is {v}: the model diverged (check train.lr, "
                                     f"train.sparse_lr, model.temperature); {where}")


def model_data_args(cfg: JobConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """What ``GEM`` needs from a prepared folder beyond num_items: ``cardinalities`` {feature: C} (manifest
    ``features``), ``num_users`` (with "user_id" as a context feature) and ``item_features`` {name: [N+1]
    int64} for ``model.candidate_features`` (items.parquet, ``gemray.pipelines.stream.item_feature_tables``).
    The defaults (ML-1M) need none of them: {}. Raises ValueError when the data lacks a configured feature."""
    m = cfg.model
    needed = list(m.token_features) + [c for c in m.context_features if c != m.USER_ID_FEATURE]
    if not needed and not m.candidate_features and m.USER_ID_FEATURE not in m.context_features:
        return {}
    feats = manifest.get("features") or {}
    missing = [f for f in needed if f not in feats and f not in m.table_rows_map()]
    if missing:
        raise ValueError(f"{cfg.data.prepared_dir}: the data has no feature {missing} (model.token_features / "
                         f"model.context_features; manifest features: {sorted(feats)})")
    out: dict[str, Any] = {"cardinalities": {k: int(v["cardinality"]) for k, v in feats.items()}}
    if m.USER_ID_FEATURE in m.context_features:
        out["num_users"] = int(manifest.get("vocab", {}).get("max_user_id", manifest["counts"]["users"]))
    if m.candidate_features:
        from gemray.pipelines.stream import item_feature_tables

        tables = item_feature_tables(manifest)
        out["item_features"] = {f: torch.from_numpy(tables[f]) for f in m.candidate_features if f in tables}
    return out


def agree_attempt(rank: int, device: torch.device) -> int:
    """Collective: one id for this start of the worker group, rank 0's clock in ns, shared with every rank."""
    t = torch.tensor([time.time_ns() if rank == 0 else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.cpu())


def rank_load(tokens: int, step_s: float, device: torch.device) -> tuple[list[int], list[float]]:
    """Collective: every rank's tokens and wall seconds of its last step (``all_gather``), in rank order,
    for the per-rank load log line (with BBS the token counts are balanced; without, they show the skew)."""
    mine = torch.tensor([float(tokens), float(step_s)], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    rows = torch.stack(out).cpu()
    return [int(t) for t in rows[:, 0].tolist()], [float(t) for t in rows[:, 1].tolist()]


class Trainer:
    """One attempt of one worker: call the phases in order (see the module docstring).

    cfg: the validated job config; t_start: unix time the train function started (startup timings).
    State after :meth:`restore`: ``start_epoch`` (completed epochs), ``global_step``, ``history``; while an
    epoch runs: ``epoch`` (0-based = completed epochs), ``consumed`` (samples of the epoch's global order),
    ``epoch_step``; ``stopped`` once a preemption notice ended the attempt.
    """

    def __init__(self, cfg: JobConfig, *, t_start: float | None = None):
        self.cfg = cfg
        self.t_start = time.time() if t_start is None else t_start
        self.stopped = False
        self.task_losses: TaskLosses | None = None  # per-task loss sums of the epoch (several tasks only)
        self.moe_stats: MoEStats | None = None  # routing figures of the epoch (model.moe_experts > 0 only)
        self.pipeline = None  # gemray.train.pipeline.SparseDistPipeline with parallel.train_pipeline="sparse_dist"
        self.gc: GarbageCollection | None = None  # train.gc_every_steps, acted on from the first step on

    # -- setup: who am I, where do I run, what data ------------------------------------------------------
    def setup(self, context: tuple[int, int, torch.device] | None = None, *, sigterm: bool = True) -> None:
        """Device and process-group facts, logging, the layout for this world size, the attempt id
        (collective), the event recorder and preemption vote, then the data streams.

        context: None = Ray Train's (world rank, world size, its device); or (rank, world_size, device) for a
        process outside Ray Train whose caller made the default process group (``gemray bench train``: world
        size 1, gloo). The device's dense bf16 peak (``peak_flops``, None on CPU) is looked up here.
        sigterm: install the vote's SIGTERM handler (an emergency checkpoint at the next poll step); False for a
        caller that never polls the vote (``gemray bench train``: SIGTERM must end it, as ``timeout`` expects)."""
        cfg = self.cfg
        # parallel.collectives: NCCL's environment before this process's first NCCL communicator (the
        # controller already put it in the workers' runtime_env; this covers processes started without it)
        from gemray.parallel.collectives import apply_collectives_env

        apply_collectives_env(cfg.parallel.collectives)
        if context is None:
            import ray.train

            ctx = ray.train.get_context()
            self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
            if cfg.ray.use_gpu:
                import ray.train.torch as rtt

                self.device = rtt.get_device()
            else:
                self.device = torch.device("cpu")
        else:
            self.rank, self.world, self.device = int(context[0]), int(context[1]), torch.device(context[2])
        if context is None:  # a Ray Train worker; in-process callers (gemray bench train) keep their own logging
            _setup_logging(self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        apply_determinism(cfg.train.deterministic, self.device)  # before anything is built or warmed up
        self.device_name, self.peak_flops = device_peak_flops(self.device)
        # CUDA: losses stay on the device and are read every train.log_every steps (train_step)
        self.defer_loss = self.device.type == "cuda"
        self.attempt_steps = 0  # steps of this attempt: the first train.mfu_warmup_steps are left out of local MFU
        # The mesh degrees for this world size ([parallel]); an elastic job resized to a size they do not
        # divide runs the nearest valid layout (logged), a fixed-size job stops with the sizes named.
        elastic = bool(cfg.ray.min_workers or cfg.ray.max_workers)
        self.dims = resolve(cfg.parallel, self.world, self.device.type, elastic=elastic,
                            num_experts=cfg.model.moe_experts)
        self.layout = plan_layout(self.world, self.device.type, self.dims)
        self.attempt = agree_attempt(self.rank, self.device)
        self.recorder = RecoveryRecorder(cfg.train.events_path, attempt=self.attempt, rank=self.rank,
                                         t_start=self.t_start)
        self.recorder.attempt_started(self.world, list(self.layout.sharding_types), self.dims.mesh_fields())
        log.info("rank %d/%d on %s (%s); job %s; layout %s", self.rank, self.world, self.device,
                 self.layout.backend, cfg.name, self.dims.describe())
        self.vote = PreemptionVote(cfg.checkpoint.preempt_notice, self.device, self.world,
                                   cfg.checkpoint.preempt_poll_steps)
        if sigterm:
            self.vote.install_sigterm_handler()
        self._open_data()
        self.recorder.phase_done("setup_and_data_s")

    def _open_data(self) -> None:
        import ray.data

        from gemray.pipelines.movielens import load_manifest
        from gemray.pipelines.loader import TrainLoader
        from gemray.pipelines.stream import HistoryStream

        cfg = self.cfg
        ray.data.DataContext.get_current().enable_progress_bars = False
        manifest = load_manifest(cfg.data.prepared_dir)
        self.num_items = int(manifest["counts"]["items"])
        self.model_data = model_data_args(cfg, manifest)
        self.trained_on = data_record(manifest, item_table_rows=cfg.model.table_rows_map().get("item"))  # in every checkpoint: a resume on other data is refused up front
        self.train_stream = TrainLoader.from_config(cfg.data, rank=self.rank, world_size=self.world,
                                                    seed=cfg.train.seed, device_type=self.device.type)
        if self.rank == 0:
            log.info("train batches: %s (data.loader_workers = %s)", self.train_stream.describe(),
                     cfg.data.loader_workers)
        self.streams = {split: HistoryStream.from_config(cfg.data, split, rank=self.rank, world_size=self.world,
                                                         seed=cfg.train.seed) for split in ("valid", "test")}

    # -- build: meta model -> parallelize (shard + materialise) -> optimizer --------------------------------
    def build(self) -> None:
        """The whole GEM on the meta device (nothing allocated), sharded and materialised by
        ``gemray.parallel.parallelize`` (a fresh TorchRec plan for this world size; the dense part seeded
        with ``train.seed`` on every rank), then the optimizer, the evaluators and the checkpoint policy."""
        from gemray.model.gem import GEM

        cfg = self.cfg
        model = GEM(cfg.model, self.num_items, "meta", max_seq_len=cfg.data.max_seq_len, **self.model_data)
        if cfg.train.precision == "fp8":  # a model converter, before parallelize (torchtitan's order)
            from gemray.model.fp8 import convert_to_fp8

            convert_to_fp8(model, cfg.train.fp8_grad, min_dim=cfg.train.fp8_min_dim,
                           recipe=cfg.train.fp8_recipe)
            if cfg.train.compile and cfg.train.fp8_stats and self.rank == 0:
                log.info("fp8: the per-layer amax / overflow / underflow counters are not collected under "
                         "train.compile (they are eager code); a run with train.compile=false logs them")
        self.dmp = parallelize(model, layout=self.layout, cfg=cfg, device=self.device)
        self.checkpointer = ActivationCheckpointer.from_config(cfg.train)
        self.checkpointer.setup(self.dmp)
        self.compiled = self.compile_dense()
        self.optimizer = build_optimizer(self.dmp, cfg)
        self.lr_scales = dense_lr_scales(self.optimizer)  # per dense group; the warm-up multiplies train.lr
        if cfg.parallel.train_pipeline == "sparse_dist":
            from gemray.train.pipeline import SparseDistPipeline

            self.pipeline = SparseDistPipeline(self.dmp, self.device)
        self.evaluators = build_evaluators(cfg, self.num_items)
        self.policy = CheckpointPolicy.from_config(cfg)
        self.warm_up_kernels()
        self.recorder.phase_done("build_and_shard_s")

    def compile_dense(self) -> list[str]:
        """``train.compile``: torch.compile every HSTU block, the retrieval head (and the candidate tower,
        ``train.compile_tower``) in place, after parallelize and the activation-checkpointing setup
        (``gemray.parallel.compile``: one path with mode "torch"; blocks that mode compiled already are skipped).
        Returns the names compiled here; logs the choice once (also when off)."""
        tc = self.cfg.train
        if not tc.compile:
            log.info("torch.compile: off (train.compile = false)%s",
                     "; the HSTU blocks are compiled by activation_checkpointing = 'torch'"
                     if tc.activation_checkpointing == "torch" else "")
            return []
        from gemray import ops
        from gemray.parallel.compile import compile_dense_modules

        device = getattr(self, "device", torch.device("cpu"))
        attn = self.cfg.model.attention_backend
        if ops.resolve_backend(attn, device) is ops.AttentionBackend.REFERENCE:
            # measured by a new user (gem-tiny, 2 CPU cores): 151 s for the run against 23 s eager, same metrics
            log.warning("train.compile with the reference attention (model.attention_backend = %r -> reference on "
                        "%s): its per-length-group code reads lengths on the host and caches per length, so the "
                        "compiled blocks break their graphs and recompile batch after batch -- slower than eager "
                        "(gem-tiny on a 2-core CPU: 151 s against 23 s). train.compile is for the Triton kernels on "
                        "CUDA; set train.compile = false here", attn, device.type)
        return compile_dense_modules(self.dmp, backend=tc.compile_backend, tower=tc.compile_tower,
                                     dynamic=tc.compile_dynamic,
                                     optimize_ddp=tc.compile_optimize_ddp, mode=tc.compile_mode,
                                     options=compile_options(tc.compile_options))

    def warm_up_kernels(self) -> None:
        """On CUDA with the Triton attention backend: compile the attention kernels for every length regime
        the config can reach, before step 1 (``gemray.train.warmup``; logged, a fixed number of calls, no
        weight changes). The result is kept in ``warmup_compile``."""
        from gemray.train.warmup import triton_in_use, warm_up_attention

        self.warmup_compile = None
        if self.device.type != "cuda" or not triton_in_use(self.cfg, self.device):
            return
        with closing(self.train_stream.iter_epoch(0, 0)) as batches:  # closed: its loader workers stop here
            template = next((b for b, _ in batches if b.batch_size), None)
        self.warmup_compile = warm_up_attention(self.cfg, self.device, self.dmp.module, template)

    # -- restore: the newest good committed checkpoint, or a fresh start ---------------------------------
    def restore(self, from_ray: bool = True) -> None:
        """Ray hands back the latest committed checkpoint after a failure or a resize (a corrupt one is
        skipped for the previous good one; DCP reshards to this world size); continue at its global data
        position. Records what became of the previous attempt, the startup timings and a resize; opens the
        sample ledger. ``from_ray`` False: a fresh start without asking Ray (a process outside Ray Train)."""
        from gemray.ledger import LedgerWriter

        cfg = self.cfg
        state = restore_from_ray(self.dmp, self.optimizer) if from_ray else None
        self.recorder.phase_done("restore_s")
        fresh = state is None
        state = state or {"epoch": 0, "consumed": 0, "epoch_step": 0, "global_step": 0, "history": []}
        self.start_epoch, self.history = int(state["epoch"]), list(state.get("history", []))
        self.global_step = int(state.get("global_step", 0))
        self._resume = {"consumed": int(state.get("consumed", 0)), "epoch_step": int(state.get("epoch_step", 0)),
                        "partial": state.get("partial")}
        if not fresh:
            # the fused embedding optimizer's step count (FBGEMM keeps it outside the checkpointed state; its Adam
            # bias correction reads it): the saved one, or for an older checkpoint the global step it was saved at
            set_sparse_step_counts(self.dmp.module, int(state.get("sparse_steps", self.global_step)))
            self.recorder.restored(state, world_size=self.world)
            log.info("resuming at epoch %d, sample %d of its order (global step %d), checkpoint saved by %s "
                     "ranks, now %d", self.start_epoch + 1, self._resume["consumed"], self.global_step,
                     state.get("world_size"), self.world)
        self.recorder.uncommitted(self.global_step, state.get("restored_from"))
        self.recorder.startup()
        self.recorder.resize(self.world, None if fresh else state.get("world_size"),
                             list(self.layout.sharding_types), self.dims.mesh_fields())
        self.ledger = (LedgerWriter(cfg.train.ledger_dir, attempt=self.attempt, rank=self.rank,
                                    world_size=self.world, restored_global_step=self.global_step)
                       if cfg.train.ledger_dir else None)

    # -- training ----------------------------------------------------------------------------------------
    def train_epoch(self, epoch: int) -> dict[str, float] | None:
        """Train 0-based ``epoch`` from its saved position (the restored one for the first epoch of a
        resumed attempt): steps, preemption votes, mid-epoch checkpoints. Returns ``EpochStats.result()``
        (global, identical on every rank), or None when a preemption notice stopped the attempt (its
        emergency checkpoint reported; ``stopped`` is then True)."""
        cfg = self.cfg
        pos = self._resume if epoch == self.start_epoch else {"consumed": 0, "epoch_step": 0, "partial": None}
        self.begin_epoch(epoch, pos)
        steps = self.train_stream.num_steps(self.consumed)
        if cfg.train.max_steps_per_epoch:
            steps = min(steps, max(0, cfg.train.max_steps_per_epoch - self.epoch_step))
        meter = ThroughputMeter(self.peak_flops)
        # closed when the loop ends, breaks or returns: with data.loader_workers its worker processes stop there
        with closing(self.train_stream.iter_epoch(epoch, self.consumed)) as batches:
            epoch_steps, t_loop = self.epoch_step + steps, time.perf_counter()
            ahead = None  # with the sparse-dist pipeline: the next step's (batch, consumed), prefetched by this step
            for i in range(steps):
                batch, self.consumed = ahead if ahead is not None else next(batches)
                ahead = next(batches) if self.pipeline is not None and i + 1 < steps else None
                loss = self.train_step(batch, next_batch=None if ahead is None else ahead[0])
                meter.add(batch.batch_size, batch.num_tokens, self.last_step_flops)
                log_now = self.epoch_step % cfg.train.log_every == 0
                if log_now:  # per-rank load (collective: every rank takes part); to the run's log file (debug)
                    tokens, step_s = rank_load(batch.num_tokens, self.last_step_s, self.device)
                    if self.rank == 0:
                        log.debug("epoch %d step %d: per-rank tokens %s step_s %s", epoch + 1, self.epoch_step, tokens,
                                  [round(s, 4) for s in step_s])
                if loss is None and i == steps - 1:
                    loss = self.flush_losses()
                if self.rank == 0 and (log_now or i == steps - 1):
                    r = meter.rates_full()
                    log.info(progress_line(epoch + 1, self.epoch_step, epoch_steps, self.global_step, loss,
                                           r["samples_per_s"], r["tokens_per_s"], done=i + 1,
                                           elapsed_s=time.perf_counter() - t_loop, tflops_per_s=r["tflops_per_s"],
                                           mfu=r["mfu"], lr=self.last_lr))
                # Without a notice the epoch-end checkpoint covers the last step; with one, the emergency checkpoint
                # is taken here (a resumed run then has 0 steps left of this epoch and goes straight to its end).
                last = i == steps - 1
                action = self.vote.poll(self.global_step, last)
                if last and action is None:
                    break
                reason = self.maybe_checkpoint(self.global_step, epoch_end=False, preempt=action)
                if action == "stop":
                    if self.pipeline is not None:
                        self.pipeline.reset()
                    self._stop()
                    return None
                if reason == "emergency":
                    self.vote.emergency_checkpoint_taken()
        self.flush_losses()
        if self.pipeline is not None:
            self.pipeline.reset()  # a batch prefetched past a break (last step with a notice) is not trained
        self.stats.reduce(self.device, self.world)
        out = self.stats.result(self.peak_flops)
        if self.task_losses is not None:
            out.update(self.task_losses.reduce(self.device))
        if self.moe_stats is not None:  # collective, as the per-task losses
            out.update(self.moe_stats.reduce(self.device))
        return out

    def begin_epoch(self, epoch: int, pos: dict[str, Any] | None = None) -> None:
        """The state :meth:`train_step` works on, for 0-based ``epoch`` from position ``pos`` ({"consumed",
        "epoch_step", "partial"}; None = the epoch's start): position counters, fresh epoch statistics (the
        saved partial ones on resume), per-task losses, the step clock; the model in training mode. Called by
        :meth:`train_epoch` and by callers that drive the steps themselves (``gemray bench train``)."""
        pos = pos or {"consumed": 0, "epoch_step": 0, "partial": None}
        self._epoch_t0 = time.perf_counter()
        self.epoch, self.consumed, self.epoch_step = epoch, int(pos["consumed"]), int(pos["epoch_step"])
        self.stats = EpochStats(pos.get("partial"))
        self.task_losses = TaskLosses(self.cfg.model.tasks) if len(self.cfg.model.tasks) > 1 else None
        self.moe_stats = MoEStats() if self.cfg.model.moe_experts else None
        self.dmp.train()
        self.clock = StepClock()
        self._pending: list[tuple] = []  # steps whose loss is not read yet (train_step)

    def train_step(self, batch: Any, next_batch: Any = None) -> float | None:
        """One global step of this rank: dropout and negative sampling seeded from (seed, global step, rank),
        forward / backward / optimizer step, then the bookkeeping (statistics with the step's model FLOPs
        ``last_step_flops`` and its wall seconds ``last_step_s`` -- since the previous step's end, the batch
        wait included -- counters, ledger, step event). ``last_lr``: the step's base dense learning rate,
        ``train.lr`` x the warm-up factor of its global step (the groups get it x their ``lr_base_fan_in``
        multiplier); shown in the progress line and kept in the step event. Returns the loss (this rank's mean
        over its predicted positions), or None when it is not read yet. ``next_batch``: the next step's host batch, prefetched
        during this step by the sparse-dist pipeline (``parallel.train_pipeline``; ignored without it).

        On CUDA the loss stays on the device (reading it is a host sync that stalls the launch queue every
        step): the losses of the steps since the last read are read together (:meth:`flush_losses`) at every
        ``train.log_every``-th step of the epoch, at the attempt's first step and before statistics are
        reduced; only then are they checked for NaN / inf (FloatingPointError naming the first bad step), added
        to the epoch statistics and written as step events. On the CPU every step reads its loss as before."""
        seed = self.cfg.train.seed
        if self.gc is None:
            self.gc = GarbageCollection(self.cfg.train.gc_every_steps)
        self.gc.step(self.global_step)
        self.last_step_flops = batch_flops(self.cfg.model, batch)  # host arithmetic on the offsets
        torch.manual_seed(step_seed(seed, self.global_step, self.rank))  # dropout
        self.dmp.module.seed_sampling(step_seed(seed + 1, self.global_step, self.rank))  # negatives
        tc = self.cfg.train
        fp8_stats = (tc.precision == "fp8" and tc.fp8_stats and not tc.compile
                     and self.epoch_step % tc.log_every == 0)
        step_stats: dict = {}
        # the base dense rate of this step, before the per-group lr_base_fan_in multipliers (logged, step events)
        self.last_lr = tc.lr * warmup_factor(self.global_step, tc.lr_warmup_steps)
        if tc.lr_warmup_steps:
            set_dense_lr(self.optimizer, self.last_lr, self.lr_scales)
        defer = self.defer_loss
        fp8 = tc.precision == "fp8"  # the weights' FP8 copies once per step (recomputes reuse them)
        n_tokens = batch.num_tokens  # read once: the checkpointing planner's design batch and the step statistics
        with self.checkpointer.step(self.dmp, self.device, tokens=n_tokens), \
                (collect_fp8_stats() if fp8_stats else nullcontext()), (fp8_weight_cache() if fp8 else nullcontext()):
            loss, n_t = forward_backward_step(
                self.dmp, self.optimizer, batch, self.device, precision=tc.precision, stats_out=step_stats,
                read_loss=not defer, pipeline=self.pipeline,
                sampling_seed=step_seed(seed + 1, self.global_step, self.rank), next_batch=next_batch,
                next_sampling_seed=step_seed(seed + 1, self.global_step + 1, self.rank))
        self.checkpointer.after_step()
        if fp8_stats and self.rank == 0:
            log_fp8_stats(pop_fp8_stats())
        sync_sparse_replicas(self.dmp)  # TorchRec 2D: average the table replicas (no-op otherwise)
        if self.task_losses is not None:
            self.task_losses.add(step_stats)
        if self.moe_stats is not None:
            self.moe_stats.add(step_stats)
        self.last_step_s = self.clock.lap()
        self.attempt_steps += 1
        measured = self.attempt_steps > tc.mfu_warmup_steps
        self._pending.append((loss, n_t, n_tokens, batch.batch_size, self.last_step_flops,
                              self.last_step_s if measured else None, self.global_step, self.epoch, self.consumed,
                              self.last_lr))
        self.global_step += 1
        self.epoch_step += 1
        if self.ledger is not None:
            self.ledger.step(self.epoch, self.global_step, batch.user_ids.tolist())
        if not defer or self.epoch_step % tc.log_every == 0 or self.attempt_steps == 1:
            return self.flush_losses()
        return None

    def flush_losses(self) -> float | None:
        """Read the losses of the steps not read yet (one host sync for all of them on CUDA), check them
        (FloatingPointError at the first NaN / inf), add those steps to the epoch statistics and emit their
        step events. Returns the last step's loss (None when nothing was pending)."""
        pending = getattr(self, "_pending", None)
        if not pending:
            return None
        self._pending = []
        raw = [p[0] for p in pending]
        if any(isinstance(v, torch.Tensor) for v in raw):
            values = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(self.device).reshape(())
                                  for v in raw]).cpu().tolist()
        else:
            values = [float(v) for v in raw]
        check_finite_loss(values, first_step=pending[0][6])
        for v, (_, n_t, tokens, samples, flops, seconds, step, epoch, consumed, lr) in zip(values, pending):
            self.stats.add(v, n_t, tokens, samples, flops, seconds)
            self.recorder.step(step + 1, epoch, consumed, loss=v, lr=lr)
        return values[-1]

    def epoch_seconds(self) -> float:
        """Collective: seconds since the current epoch started, the max over ranks (so the history, which
        DCP keeps one copy of, is identical on every rank)."""
        t = torch.tensor([time.perf_counter() - self._epoch_t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def _stop(self) -> None:
        notice = read_notice(self.cfg.checkpoint.preempt_notice) or {"reason": "SIGTERM to a worker"}
        log.warning("preemption notice (%s): emergency checkpoint of global step %d reported; stopping. Re-run "
                    "the same command to resume at this step.", notice.get("reason"), self.global_step)
        self.recorder.preempted(self.global_step, epochs_completed=self.epoch, consumed=self.consumed,
                                notice=notice)
        self.stopped = True

    # -- checkpoints -------------------------------------------------------------------------------------
    def maybe_checkpoint(self, step: int, *, epoch_end: bool, preempt: str | None = None,
                         metrics: dict[str, Any] | None = None) -> str | None:
        """Ask the policy whether to checkpoint after global step ``step``; if so, save and report. Returns
        the reason, or None (then nothing was reported: at an epoch end the caller reports ``metrics``).

        Inside an epoch (``epoch_end`` False): ``preempt`` is the vote's verdict; the report carries the
        position (``epoch_fields``, ``global_step``, ``checkpoint`` reason, ``preempted``) and the state the
        epoch's statistics so far (a collective reduce). At an epoch's end: ``metrics`` are the epoch's
        report and the state points at the next epoch's start. Collective when it saves.
        """
        done = self.epoch + 1 if epoch_end else self.epoch
        reason = self.policy.reason(step, epoch_end=epoch_end, epochs_done=done, preempt=preempt is not None)
        if reason is None:
            return None
        sparse_steps = max(sparse_step_counts(self.dmp.module), default=0)  # restored by restore()
        if epoch_end:
            state = {"epoch": done, "consumed": 0, "epoch_step": 0, "global_step": step,
                     "history": self.history, "partial": None, "sparse_steps": sparse_steps}
            report = dict(metrics or {})
        else:
            self.flush_losses()
            state = {"epoch": done, "consumed": self.consumed, "epoch_step": self.epoch_step, "global_step": step,
                     "history": self.history, "partial": self.stats.reduce(self.device, self.world),
                     "sparse_steps": sparse_steps}
            report = {**epoch_fields(done, in_progress=True), "global_step": step, "checkpoint": reason,
                      "preempted": preempt == "stop"}
        self.save(reason, report, state, in_progress=not epoch_end)
        return reason

    def save(self, reason: str, metrics: dict[str, Any], state: dict[str, Any], *, in_progress: bool) -> None:
        """Collective: DCP-save ``state`` with the model and optimizer and report it with ``metrics`` to Ray
        Train (``gemray.checkpoint.report_with_checkpoint``), between ``checkpoint_begin`` / ``_saved`` events;
        ``checkpoint_saved`` carries rank 0's save figures (seconds, bytes, host RSS before/after/peak)."""
        self.recorder.checkpoint_begin(reason, state["global_step"])
        saved = report_with_checkpoint(metrics, self.dmp, self.optimizer, state, data=self.trained_on)
        self.recorder.checkpoint_saved(reason, state["global_step"], epochs_completed=state["epoch"],
                                       in_progress=in_progress, consumed=state["consumed"], save=saved)

    def report(self, metrics: dict[str, Any]) -> None:
        """Collective: report ``metrics`` to Ray Train without a checkpoint."""
        import ray.train

        ray.train.report(metrics)

    # -- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        """Every evaluator's metrics over every rank's users of ``split`` ("valid" or "test"): one pass over
        the split, per-batch sums added up, one all-reduce. Returns the evaluators' metrics merged
        (identical on every rank). Raises ValueError for an unknown split."""
        if split not in self.streams:
            raise ValueError(f"Trainer.evaluate: split must be one of {sorted(self.streams)}, got {split!r}")
        if self.gc is not None:
            self.gc.full(f"before evaluating {split}")
        model = self.dmp.module
        self.dmp.eval()
        # dense_unsharded: FSDP2, evaluation reaches the dense part outside forward; sparse_steps_kept: its embedding
        # lookups do not count as optimizer steps (FBGEMM's TBE counts one per forward, its Adam reads the count)
        with dense_unsharded(model), sparse_steps_kept(model):
            sums = evaluation_sums(model, self.evaluators, self.streams[split].iter_epoch(0), self.device,
                                   self.cfg.train.precision)
        total = torch.cat(sums).to(self.device)
        dist.all_reduce(total)
        self.dmp.train()
        return evaluation_metrics(self.evaluators, total)

    # -- the end -----------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Close the ledger; unless stopped on a preemption notice, record ``finished``. (Python's garbage collection
        is given back by train_loop_per_worker's ``finally``, also when training raises.)"""
        if self.ledger is not None:
            self.ledger.close()
        if self.stopped:
            return  # the run ends here; Ray Train commits the emergency checkpoint as the run's latest
        if self.start_epoch >= self.cfg.train.epochs:
            log.info("the restored checkpoint has %d epoch(s) done, train.epochs is %d: nothing to train",
                     self.start_epoch, self.cfg.train.epochs)
        self.recorder.finished(self.global_step)


def _prefixed(prefix: str, metrics: dict[str, float], skip: tuple[str, ...] = ()) -> dict[str, float]:
    return {f"{prefix}_{k}": v for k, v in metrics.items() if k not in skip}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config``: ``JobConfig.to_dict()`` with absolute data paths.

    Elastic contract (Ray Train V2 restarts the whole worker group on a failure or a resize): on every
    (re)start, derive the layout from the current world size, shard anew, restore the newest good committed checkpoint (DCP reshards it),
    continue the epoch at the saved global data position (``consumed`` samples of the epoch's global
    order: ElasticTrainStream), checkpoint every ``checkpoint.every_steps`` global steps, at epoch ends,
    and on a preemption notice agreed by all ranks (polled every ``checkpoint.preempt_poll_steps``
    steps): a job notice (gemray.preemption) -> emergency checkpoint, then return, so that Ray Train ends
    the run with that checkpoint committed; Ray's node-drain notice -> emergency checkpoint, go on.
    Every attempt logs a ``startup`` event with its phase timings.
    """
    trainer = Trainer(from_dict(config), t_start=time.time())
    try:
        _train(trainer)
    finally:
        if trainer.gc is not None:  # automatic garbage collection back even when training raised
            trainer.gc.close()


def _train(trainer: "Trainer") -> None:
    """train_loop_per_worker's body: set up, restore, the epochs, :meth:`Trainer.finish`."""
    trainer.setup()
    trainer.build()
    trainer.restore()
    cfg = trainer.cfg
    for epoch in range(trainer.start_epoch, cfg.train.epochs):
        stats = trainer.train_epoch(epoch)
        if stats is None:
            break  # stopped on a preemption notice, its emergency checkpoint reported
        done = epoch + 1
        metrics: dict[str, Any] = {"epoch": done, "global_step": trainer.global_step, **stats}
        if done % cfg.train.eval_every == 0 or done == cfg.train.epochs:
            metrics.update(_prefixed("valid", trainer.evaluate("valid"), skip=("num_users",)))
        metrics["epoch_s"] = trainer.epoch_seconds()
        trainer.history.append(dict(metrics))
        log.info("%s", epoch_summary(cfg.train.epochs, metrics))  # every field: metrics.json's history
        if done == cfg.train.epochs:
            # The test split once, at the end; reported with the last checkpoint so Ray's Result carries it.
            test = trainer.evaluate("test")
            log.info("%s", split_summary("test", test))
            metrics.update(_prefixed("test", test))
            metrics.update({"final": True, "world_size": trainer.world, "history": list(trainer.history)})
        if trainer.maybe_checkpoint(trainer.global_step, epoch_end=True, metrics=metrics) is None:
            trainer.report(metrics)
    trainer.finish()
