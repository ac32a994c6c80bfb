"""Parallelism for a GEM model: a pure layout decision, then TorchRec sharding + DDP, then the optimizer.

Follows the TorchRec recipe (torchrec.distributed docs, "DistributedModelParallel") on a model built wholly
on the ``meta`` device: attach the fused sparse optimizer *before* sharding (``apply_optimizer_in_backward``),
let ``EmbeddingShardingPlanner`` choose a plan for the world size, materialise the dense part
(``to_empty`` + the model's seeded ``init_weights``), wrap with ``DistributedModelParallel`` (embeddings
sharded and materialised per shard, dense part DDP) (:func:`parallelize`); then optimise the dense
parameters with AdamW, combined with the fused one in a ``CombinedOptimizer`` (:func:`build_optimizer`).

Measured on the CPU stack (see ../shared/NOTES.md): with gloo, EmbeddingCollection tables are sharded
row-wise automatically; table-wise and column-wise also work; data-parallel EC fails, so it is never
allowed here.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from gemray.config import JobConfig
from gemray.parallel.dims import ParallelDims

log = logging.getLogger(__name__)

# Sharding types (torchrec.distributed.types.ShardingType values) allowed per device type.
_CPU_SHARDING = ("row_wise", "table_wise", "column_wise")
_GPU_SHARDING = ("row_wise", "table_wise", "column_wise", "table_row_wise")


@dataclass(frozen=True)
class Layout:
    """How one job is laid out over its ranks.

    world_size: number of ranks (Ray Train workers). device_type: "cpu" or "cuda".
    backend: process-group backend ("gloo" on CPU, "nccl" on CUDA).
    sharding_types: TorchRec ShardingType values the planner may choose from for every table.
    dims: the mesh degrees (``gemray.parallel.dims.ParallelDims``), None = plain DDP (see ``parallel``).
    """

    world_size: int
    device_type: str
    backend: str
    sharding_types: tuple[str, ...]
    dims: ParallelDims | None = None

    @property
    def parallel(self) -> ParallelDims:
        """The mesh degrees; a layout planned without any is plain DDP with every table sharded over the world."""
        return self.dims or ParallelDims(self.world_size, device_type=self.device_type)


def plan_layout(world_size: int, device_type: str, dims: ParallelDims | None = None) -> Layout:
    """Pure decision: the layout for ``world_size`` ranks on ``device_type`` ("cpu" or "cuda").

    dims: the mesh degrees (``gemray.parallel.dims.resolve``); default: dense DDP, every table sharded over
    the world by the planner's choice among the device's sharding types. Raises ValueError for
    world_size < 1, an unknown device type, or dims of another world size / device.
    """
    if world_size < 1:
        raise ValueError(f"plan_layout: world_size must be >= 1, got {world_size}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"plan_layout: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if dims is not None and (dims.world_size, dims.device_type) != (world_size, device_type):
        raise ValueError(f"plan_layout: dims are for {dims.world_size} ranks on {dims.device_type}, not "
                         f"{world_size} on {device_type}")
    types = dims.sharding_types if dims is not None else (_CPU_SHARDING if device_type == "cpu" else _GPU_SHARDING)
    return Layout(world_size, device_type, "gloo" if device_type == "cpu" else "nccl", tuple(types), dims)


def check_shardable(model_cfg) -> None:
    """Raise ValueError if ``model_cfg`` cannot be sharded by TorchRec/FBGEMM.

    FBGEMM's table-batched embedding kernels (CPU and CUDA) need every table's width to be a multiple
    of 4 (they assert ``embedding_dim % 4 == 0``); all gemray tables are ``model.embedding_dim`` wide.
    """
    d = int(model_cfg.embedding_dim)
    if d % 4:
        lo, hi = d - d % 4, d - d % 4 + 4
        raise ValueError(f"model.embedding_dim={d}: sharded TorchRec/FBGEMM embedding tables need a "
                         f"multiple of 4 (try {lo} or {hi})")


def _sparse_optimizer(layout: Layout, name: str = "auto") -> tuple[type[torch.optim.Optimizer], list[str]]:
    """(optimizer class, allowed compute kernels) for the embedding tables, from ``train.sparse_optimizer``.

    "auto": CUDA -> FBGEMM's partial row-wise Adam (one second-moment scalar per row); CPU -> exact
    row-wise Adagrad, because FBGEMM's CPU TBE implements only SGD/Adagrad variants (fbgemm_gpu 1.8
    asserts so) and TorchRec allows the non-fused "dense" kernel only for data-parallel tables, which
    EmbeddingCollection cannot use. "adam"/"rowwise_adam" on CPU raise ValueError.
    """
    from torchrec.optim import optimizers as trec_optim
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if name == "auto":
        name = "rowwise_adam" if layout.device_type == "cuda" else "rowwise_adagrad"
    # TorchRec's placeholders for the Adam kinds: their kwargs go to FBGEMM's TBE unchanged (beta1/beta2),
    # which torch.optim.Adam's constructor would reject.
    table = {"rowwise_adam": trec_optim.PartialRowWiseAdam, "adam": trec_optim.Adam,
             "rowwise_adagrad": RowWiseAdagrad, "adagrad": torch.optim.Adagrad}
    if name not in table:
        raise ValueError(f"train.sparse_optimizer: unknown {name!r} (known: auto, {', '.join(table)})")
    if layout.device_type != "cuda" and name in ("rowwise_adam", "adam"):
        raise ValueError(f"train.sparse_optimizer={name!r} needs CUDA (FBGEMM's CPU kernels have no Adam); "
                         f"use 'rowwise_adagrad' or 'auto' on CPU")
    return table[name], ["fused"]


def table_constraints(configs, layout: Layout, kernels: list[str]) -> dict:
    """Pure: the planner's ``ParameterConstraints`` per table name: the layout's sharding types, ``kernels``,
    and for every table stored below float32 (``model.table_dtype = "fp16"``) ``stochastic_rounding=True``,
    which TorchRec passes to FBGEMM's TBE as a fused parameter.

    Why explicit: FBGEMM's default is already on, but it is what keeps an fp16 table learning -- the fused
    optimizer computes each update in float32 and rounds the new row into float16; to nearest, every update
    under half an ulp (2^-12 to 2^-11 of the weight) is dropped, so rows whose updates are small (rare ids, late in
    training, row-wise Adagrad's shrinking steps) stop moving. Stochastic rounding keeps each update's expected
    value. Float32 tables get no such constraint (their fused params stay as they were)."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import DataType

    out = {}
    for t in configs:
        extra = {} if t.data_type == DataType.FP32 else {"stochastic_rounding": True}
        out[t.name] = ParameterConstraints(sharding_types=list(layout.sharding_types), compute_kernels=kernels,
                                           **extra)
    return out


def half_table_warning(configs, layout: Layout) -> str | None:
    """Pure: the warning for float16 tables trained on the CPU, or None (float32 tables, or CUDA).

    FBGEMM's CPU TBE backward (fbgemm_gpu 1.8, ``embedding_backward_split_cpu_template.cpp``) writes the
    optimizer's update straight into the float16 row (``host_weights_data[...] -= ...``): round to nearest,
    ``stochastic_rounding`` is a parameter of the CUDA kernels only. tests/test_table_dtype.py checks both."""
    from torchrec.modules.embedding_configs import DataType

    half = [t.name for t in configs if t.data_type != DataType.FP32]
    if not half or layout.device_type == "cuda":
        return None
    return (f"model.table_dtype: tables {half} are float16 on the CPU, where FBGEMM's TBE rounds every fused "
            "update to nearest (stochastic rounding exists only in its CUDA kernels): updates under half a float16 "
            "ulp (2^-12 to 2^-11 of the weight) are lost, so rows stop learning sooner than on a GPU. Use "
            "model.table_dtype = \"fp32\" for CPU training runs")


def sparse_optimizer_kwargs(sparse_cls: type, cfg: JobConfig) -> dict:
    """Keyword arguments of the fused embedding optimizer, in FBGEMM TBE's names (TorchRec passes them on
    as fused params, renaming only ``lr`` to ``learning_rate``): ``lr`` = ``train.sparse_lr``, plus
    ``beta1``/``beta2`` = ``train.adam_betas`` for the Adam kinds.
    """
    from torchrec.optim import optimizers as trec_optim

    kwargs: dict = {"lr": cfg.train.sparse_lr}
    if sparse_cls in (trec_optim.Adam, trec_optim.PartialRowWiseAdam):
        kwargs.update(beta1=float(cfg.train.adam_betas[0]), beta2=float(cfg.train.adam_betas[1]))
    return kwargs


#: TorchRec's top logger: its planner's and DistributedModelParallel's INFO records are :func:`torchrec_logs_at_debug`'s
TORCHREC_LOGGER = "torchrec"


class _LibraryRecords(logging.Handler):
    """While :func:`torchrec_logs_at_debug` is open: keeps TorchRec's messages below WARNING in the order first seen
    (``lines``: [message, count]; a message its logger sent before adds to that one's count -- the planner sends
    two per proposal, interleaved -- except the rows of the planner's statistics table, kept as they come) and
    hands WARNING and above to the loggers above TorchRec's, as if it propagated."""

    TABLE_LOGGER = "torchrec.distributed.planner.stats"

    def __init__(self, above: logging.Logger):
        super().__init__(logging.NOTSET)
        self.above = above
        self.lines: list[list] = []
        self._seen: dict[tuple[str, str], int] = {}  # (logger, message) -> its index in lines

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.above.handle(record)
            return
        msg = record.getMessage().rstrip()
        key = (record.name, msg)
        if record.name != self.TABLE_LOGGER and key in self._seen:
            self.lines[self._seen[key]][1] += 1
            return
        self._seen[key] = len(self.lines)
        self.lines.append([msg, 1])


@contextmanager
def torchrec_logs_at_debug() -> Iterator[None]:
    """``with torchrec_logs_at_debug():`` around the sharding planner and DistributedModelParallel: TorchRec's INFO
    chatter -- the planner's "GreedyPerfPartitioner - sort_by: ..." once per proposal it evaluates (6,561 for
    gem-tiny's 8 tables), "EmbeddingPerfEstimatorFactory is creating ...", "Total 0 feature processor." and its
    statistics table; the sharded collection's "EC index dedup enabled: ..." -- no longer reaches the console or
    the run's log at INFO (Ray's workers log the root logger at INFO, so ``gemray.fit`` from Python printed all of
    it and logs/gemray.log kept it). Where gemray's DEBUG is on (e.g. ``gemray evaluate -v``) those records are
    logged again on exit, on this module's logger at DEBUG ("torchrec: <message>"; a message its logger sent N > 1
    times once, with "(xN)", at its first place; the statistics table row by row); elsewhere (the training
    workers log gemray at INFO) TorchRec's logger is raised to WARNING for the call, so they are not even made.
    TorchRec's warnings pass as before; FBGEMM's "[TBE=...]" lines, logged on the root logger, are not touched.
    TorchRec's logger's level and propagation are restored on exit."""
    lib = logging.getLogger(TORCHREC_LOGGER)
    keep = _LibraryRecords(lib.parent or logging.getLogger())
    level, propagate = lib.level, lib.propagate
    if not log.isEnabledFor(logging.DEBUG):
        lib.setLevel(max(lib.getEffectiveLevel(), logging.WARNING))
    lib.addHandler(keep)
    lib.propagate = False
    try:
        yield
    finally:
        lib.removeHandler(keep)
        lib.propagate = propagate
        lib.setLevel(level)
        for msg, n in keep.lines:
            log.debug("torchrec: %s%s", msg, "" if n == 1 else f" (x{n})")


_RECAT_CACHE_SIZE = 64
_NOT_CACHED = object()


def cache_torchrec_recat() -> bool:
    """Make TorchRec's input distribution build its recat index once per shape instead of once per step.

    Why: every KJT all-to-all of a step (one per sharding type: 3-4 a step at configs/gem-h200.toml) constructs a
    ``KJTAllToAllTensorsAwaitable`` whose ``__init__`` calls ``torchrec.distributed.dist_data._get_recat``, which
    returns ``torch.tensor(recat_list, device=cuda)``: a pageable host-to-device copy, after which PyTorch waits for
    the stream, i.e. for every kernel queued so far (torchrec 1.6.1 ``dist_data.py:145``, 1.8 the same). On the H200
    that was the step's one host synchronisation (``gemray bench train --sync-debug`` listed it on 2026-12-02 beside
    the bench's own per-step synchronize, removed since; cProfile 38-50 ms of waiting a step in ``torch.tensor``,
    benchmarks/reports/gem_h200_2026-12-03.md): the launch queue drains every
    step and the GPU idles while the host enqueues the next kernels (6 ms of idle gaps a step, 2026-12-04). At world
    size 1 the index is not even used (the awaitable returns before any all-to-all). Its value depends only on the
    host ints it is called with (local split, number of splits, stagger, device, batch size per rank), and its
    consumers only read it (``permute_2D_sparse_data``), so one tensor per distinct call serves every step.

    This wraps ``_get_recat`` in ``dist_data``'s namespace (where the awaitable looks it up) with a bounded cache
    keyed by those arguments (``_RECAT_CACHE_SIZE`` entries, oldest evicted; a None result is cached too); under
    torch.compile tracing it calls the original. Idempotent: returns True when this call installed it, False when it
    was already installed."""
    from torchrec.distributed import dist_data

    if getattr(dist_data._get_recat, "_gemray_cached", False):
        return False
    original = dist_data._get_recat
    cache: dict = {}

    def _get_recat(local_split, num_splits, stagger=1, device=None, batch_size_per_rank=None):
        if torch.compiler.is_compiling():
            return original(local_split, num_splits, stagger, device, batch_size_per_rank)
        key = (int(local_split), int(num_splits), int(stagger), None if device is None else str(torch.device(device)),
               None if batch_size_per_rank is None else tuple(int(b) for b in batch_size_per_rank))
        recat = cache.get(key, _NOT_CACHED)
        if recat is _NOT_CACHED:
            recat = original(local_split, num_splits, stagger, device, batch_size_per_rank)
            if len(cache) >= _RECAT_CACHE_SIZE:
                cache.pop(next(iter(cache)))
            cache[key] = recat
        return recat

    _get_recat._gemray_cached = True
    _get_recat.__wrapped__ = original
    _get_recat.cache = cache
    dist_data._get_recat = _get_recat
    return True


def parallelize(model: nn.Module, *, layout: Layout, cfg: JobConfig, device: torch.device,
                pg: "torch.distributed.ProcessGroup | None" = None):
    """Shard and materialise a model built on the meta device; returns its ``DistributedModelParallel``.

    torchtitan's order (parallelism is applied to a model that holds no memory yet), with TorchRec for the
    sparse part:

    1. fused sparse optimizer attached to the EmbeddingCollection's parameters
       (``apply_optimizer_in_backward``; TorchRec fuses it into the sharded kernels, so it comes first);
    2. sharding plan: ``EmbeddingShardingPlanner.collective_plan``, every table constrained to
       ``layout.sharding_types`` (``parallel.sparse_sharding``), float16 tables (``model.table_dtype``) to
       stochastic rounding of their fused updates (:func:`table_constraints`; on the CPU FBGEMM rounds to
       nearest: :func:`half_table_warning` is logged); the planner sizes shards by the tables' own element
       size; for TorchRec 2D (``parallel.sparse_2d_group``) the plan is for one sharding group;
    3. expert parallelism (``parallel.expert_parallel`` > 1, ``gemray.parallel.expert``): every MoE layer's
       experts sharded over the mesh's "ep" dimension (DTensors), all-to-all dispatch installed; then the
       dense part materialised: ``torch.manual_seed(cfg.train.seed)``, every module outside
       ``model.embeddings`` ``to_empty(device=device)``, then ``model.init_weights()``: the same values on
       every rank (DDP's broadcast from rank 0 then changes nothing); GEM's are those of a direct
       real-device build with that seed (its init_weights skips the draws of the tables left on meta);
    4. ``DistributedModelParallel``: shards the EmbeddingCollection per the plan and materialises each
       rank's shards (FBGEMM initialises them from the tables' ``weight_init_min/max``, continuing the RNG
       stream of step 3), then wraps the dense remainder in DDP (``parallel.dense="ddp"``; at world size 1
       nothing, :class:`SingleRankWrapper`, unless ``parallel.ddp_at_world_size_1``) or FSDP2 /
       HSDP over the layout's device mesh (``gemray.parallel.fsdp.FullyShardWrapper``); with
       ``parallel.sparse_2d_group`` > 0 a ``DMPCollection`` (tables sharded inside groups of that size,
       replicated across; :func:`sync_sparse_replicas` after each step).

    model: a plain module (e.g. ``gemray.model.gem.GEM(..., device="meta")``) whose every parameter is on
        the meta device, with an ``embeddings`` attribute holding a TorchRec ``EmbeddingCollection`` and an
        ``init_weights()`` method that initialises its dense parameters (embedding tables left on meta).
    layout: from :func:`plan_layout`; its world size must match the process group's.
    cfg: the job config; uses ``train.seed`` (dense initialisation), ``train.sparse_optimizer`` and
        ``train.sparse_lr`` (the embedding optimizer, fused into the FBGEMM backward; the Adam kinds also take
        ``train.adam_betas``).
    device: this rank's device (``cuda:<local_rank>`` or ``cpu``).
    Returns the ``DistributedModelParallel``; :func:`build_optimizer` adds the dense optimizer to its fused one.
    Raises ValueError if parallel.expert_parallel > 1 cannot apply (no MoE layer, or it does not divide
    ``model.moe_experts``: ``gemray.parallel.expert``), model.embedding_dim is not a multiple of 4 (FBGEMM),
    the process group is not
    initialised, its size differs from the layout, the model has no ``embeddings`` EmbeddingCollection or
    no ``init_weights``, or a parameter is not on the meta device.
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from gemray.model.embeddings import describe_tables

    check_shardable(cfg.model)
    from gemray.parallel.collectives import check_collectives

    check_collectives(str(getattr(getattr(cfg, "parallel", None), "collectives", "nccl")), layout.backend)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("parallelize: torch.distributed is not initialised (run inside Ray Train)")
    pg = pg or dist.GroupMember.WORLD
    if dist.get_world_size(pg) != layout.world_size:
        raise ValueError(f"parallelize: layout.world_size={layout.world_size} but the process group has "
                         f"{dist.get_world_size(pg)} ranks")
    ec = getattr(model, "embeddings", None)
    if not isinstance(ec, EmbeddingCollection):
        raise ValueError(f"parallelize: model.embeddings must be a torchrec EmbeddingCollection, got "
                         f"{type(ec).__name__}")
    if not callable(getattr(model, "init_weights", None)):
        raise ValueError(f"parallelize: {type(model).__name__} has no init_weights() to materialise its dense part")
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"parallelize: every parameter must be on the meta device (build the model with "
                         f"device='meta'); {len(real)} are not, e.g. {real[0]}")

    # 1. Fused sparse optimizer, applied in backward, before sharding.
    sparse_cls, kernels = _sparse_optimizer(layout, cfg.train.sparse_optimizer)
    apply_optimizer_in_backward(sparse_cls, ec.parameters(), sparse_optimizer_kwargs(sparse_cls, cfg))

    # 2. Planner over the topology; constrain every table to the layout's sharding types (and round the fused
    # updates of fp16 tables stochastically: table_constraints).
    constraints = table_constraints(ec.embedding_configs(), layout, kernels)
    if dist.get_rank(pg) == 0:
        log.info("embedding tables: %s", describe_tables(ec.embedding_configs()))
        warning = half_table_warning(ec.embedding_configs(), layout)
        if warning:
            log.warning("%s", warning)
    dims = layout.parallel
    from gemray.parallel.expert import apply_expert_parallel, check_expert_parallel, expert_parameters

    check_expert_parallel(model, dims.ep)
    group = dims.sparse_group_size  # 2D: the plan is for one sharding group, repeated across replicas
    # on CUDA the GPU's real HBM, not TorchRec's 32 GB default (GEM-scale tables)
    hbm = {"hbm_cap": torch.cuda.get_device_properties(device).total_memory} if layout.device_type == "cuda" else {}
    with torchrec_logs_at_debug():  # the planner's thousands of INFO lines: DEBUG, not the console
        topology = Topology(world_size=group, local_world_size=group if dims.sparse_2d else None,
                            compute_device=layout.device_type, **hbm)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
        plan = planner.collective_plan(model, pg=pg)
    if dist.get_rank(pg) == 0:
        log.info("layout %s; sharding plan (%d ranks per group, %s): %s", dims.describe(), group,
                 layout.device_type, _describe_plan(plan))

    # 3. Expert parallelism on the meta model (experts sharded over the mesh's "ep" dimension, all-to-all
    # dispatch); then the dense part: real memory, the same seeded draws on every rank (experts: the slice).
    mesh = None
    if dims.fsdp_enabled or dims.ep_enabled:
        from gemray.parallel.dims import build_mesh

        mesh = build_mesh(dims)
    apply_expert_parallel(model, mesh, ep=dims.ep)
    torch.manual_seed(cfg.train.seed)
    materialize_dense(model, device)

    # 4. DMP: EC sharded per plan (shards materialised by TorchRec), the dense remainder wrapped in DDP, or
    # by FSDP2 over the mesh's dp dims; DMPCollection for TorchRec 2D (shard in a group, replicate across).
    wrapper = None
    pcfg = getattr(cfg, "parallel", None)
    if not dims.fsdp_enabled and dims.world_size == 1 and not bool(getattr(pcfg, "ddp_at_world_size_1", False)):
        wrapper = SingleRankWrapper()
    if dims.fsdp_enabled:
        from gemray.parallel.dims import dense_mesh
        from gemray.parallel.fsdp import data_parallel_wrapper

        wrapper = data_parallel_wrapper(
            dense_mesh(mesh, dims), precision=str(getattr(cfg.train, "precision", "fp32")),
            reshard_after_forward=bool(getattr(pcfg, "reshard_after_forward", True)),
            prefetch=bool(getattr(pcfg, "prefetch", True)),
            ignored_params=expert_parameters(model) if dims.ep_enabled else set(),
            collectives=str(getattr(pcfg, "collectives", "nccl")))
    cache_torchrec_recat()  # no host sync per step in TorchRec's input distribution
    with torchrec_logs_at_debug():
        if dims.sparse_2d:
            from torchrec.distributed.model_parallel import DMPCollection

            dmp = DMPCollection(module=model, device=device, plan=plan, world_size=dims.world_size,
                                sharding_group_size=dims.sparse_group, global_pg=pg, data_parallel_wrapper=wrapper)
        else:
            dmp = DistributedModelParallel(module=model, device=device, plan=plan, data_parallel_wrapper=wrapper)
    if dims.ep_enabled:  # expert gradients: summed over the ranks holding the same experts, not over ep
        from gemray.parallel.expert import register_expert_grad_reduction

        register_expert_grad_reduction(dmp.module, mesh, dims.world_size)
    return dmp


class SingleRankWrapper:
    """TorchRec ``DataParallelWrapper`` for a world of one rank with dense "ddp": leaves the dense part unwrapped.

    DDP over one rank changes no gradient but costs every step its forward pre-hook, one autograd hook per
    parameter, the bucket bookkeeping and one-rank all-reduce launches (the GEM-scale step on an H100: 150.0 ms
    median without, 151.3 with, one run each: benchmarks/reports/gem_h200_2026-12-06.md). The state dict is the
    same either way (``DistributedModelParallel.state_dict`` strips DDP's "module." prefix), so checkpoints move
    between world sizes as before. ``parallel.ddp_at_world_size_1 = true`` restores DDP (for comparisons)."""

    def wrap(self, dmp: nn.Module, env, device: torch.device) -> None:
        log.info("world size 1: the dense part is not wrapped in DDP (parallel.ddp_at_world_size_1 = false)")


def sync_sparse_replicas(dmp: nn.Module) -> None:
    """TorchRec 2D parallel: average the embedding shards (and their optimizer state) across the replica
    groups (``DMPCollection.sync``); call after every optimizer step. No-op for a plain DMP."""
    from torchrec.distributed.model_parallel import DMPCollection

    if isinstance(dmp, DMPCollection):
        dmp.sync()


def sparse_step_modules(model: nn.Module) -> list[nn.Module]:
    """The FBGEMM table-batched embedding (TBE) modules of ``model``: every module with an int64 tensor ``iter``
    (the fused optimizer's step count, on the table's device) and a CPU copy ``iter_cpu``
    (``SplitTableBatchedEmbeddingBagsCodegen``). TorchRec's sharded modules keep their lookups in a plain list
    (``_lookups``), which ``nn.Module.modules()`` does not enter, so those are walked too. Returns [] for a model
    without TBE (an unsharded one)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(root: nn.Module) -> None:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            if isinstance(getattr(m, "iter", None), torch.Tensor) and \
                    isinstance(getattr(m, "iter_cpu", None), torch.Tensor):
                out.append(m)
            for lookup in getattr(m, "_lookups", None) or ():
                if isinstance(lookup, nn.Module):
                    visit(lookup)

    visit(model)
    return out


def sparse_step_counts(model: nn.Module) -> list[int]:
    """The step count (``iter``) of each of ``model``'s TBE modules (:func:`sparse_step_modules`), in their order."""
    return [int(m.iter.detach().reshape(-1)[0]) for m in sparse_step_modules(model)]


def set_sparse_step_counts(model: nn.Module, count: int) -> int:
    """Set the step count (``iter`` and its CPU copy ``iter_cpu``) of every TBE module of ``model``
    (:func:`sparse_step_modules`) to ``count``: a restore's, since TorchRec's checkpoints (the sharded tables and the
    fused optimizer's moments) do not hold it and FBGEMM's Adam would restart its bias correction at 1 with the
    restored moments. Returns the number of modules set. Raises ValueError for count < 0."""
    if count < 0:
        raise ValueError(f"set_sparse_step_counts: count must be >= 0, got {count}")
    mods = sparse_step_modules(model)
    with torch.no_grad():
        for m in mods:
            m.iter.fill_(int(count))
            m.iter_cpu.fill_(int(count))
    return len(mods)


@contextmanager
def sparse_steps_kept(model: nn.Module) -> Iterator[int]:
    """Forward passes that are not training steps (the kernel warm-up, evaluation) leave the fused embedding
    optimizer's step counts as they found them. Yields the number of TBE modules covered.

    Why: FBGEMM's TBE counts a step in every *forward* (``iter`` / ``iter_cpu`` += 1, train or eval mode, with or
    without grad; fbgemm_gpu 1.6-1.8 ``SplitTableBatchedEmbeddingBagsCodegen.forward``), not in its fused update,
    and its Adam kinds use that count in the bias correction ``1 - beta^iter``. A forward that trains nothing
    therefore shrinks the next updates as if steps had been taken: 2 warm-up forwards before step 1 (the Triton
    path only) made step 1's Adam update of every row it touched ~0.64x the reference path's, and every
    validation pass (1 + one per batch) shifted the rest of the run. The Adagrad kinds ignore the count.
    Restores ``iter``, ``iter_cpu`` and the reporting counter ``step`` on exit (also on an error)."""
    saved = [(m, m.iter.detach().clone(), m.iter_cpu.detach().clone(), getattr(m, "step", None))
             for m in sparse_step_modules(model)]
    try:
        yield len(saved)
    finally:
        with torch.no_grad():
            for m, it, it_cpu, step in saved:
                m.iter.copy_(it)
                m.iter_cpu.copy_(it_cpu)
                if isinstance(step, int):
                    m.step = step


def materialize_dense(model: nn.Module, device: torch.device | str) -> None:
    """Give every module outside ``model.embeddings`` real, uninitialised memory on ``device``
    (``to_empty``), then call ``model.init_weights()``, which draws from the global RNG (seed it first).

    The EmbeddingCollection stays on meta: allocating it whole on one device is what sharding avoids.
    """
    sparse = set(model.embeddings.modules())
    for module in model.modules():
        if module not in sparse:
            module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        model.init_weights()


def build_optimizer(dmp: nn.Module, cfg: JobConfig):
    """The job's optimizer over a model from :func:`parallelize`: its fused embedding optimizer (stepping
    inside backward) combined with AdamW over every other parameter (``train.lr``, ``train.adam_betas``,
    ``train.weight_decay``). With ``train.lr_base_fan_in`` > 0 the dense parameters form one AdamW param group
    per learning-rate multiplier (``gemray.model.lr_scaling``: ``min(1, base / fan-in)`` for the weight
    matrices); each group carries its multiplier as ``"lr_scale"`` and its ``lr`` = ``train.lr`` x that.
    ``train.dense_optimizer_impl`` picks AdamW's implementation ("auto": fused with the parameters on CUDA).

    Returns a TorchRec ``CombinedOptimizer``: call ``step()`` after backward; its state_dict names parameters
    ``"sparse.<fqn>"`` (fused embedding optimizer) and ``"dense.<fqn>"`` (AdamW). :func:`dense_lr_scales` /
    :func:`set_dense_lr` read and set the dense groups' rates (the trainer's warm-up).
    """
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from gemray.model.lr_scaling import lr_scales, parameter_fan_ins

    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    scales = lr_scales(parameter_fan_ins(dmp), cfg.train.lr_base_fan_in)
    groups: dict[float, list[str]] = {}
    for name in dense_params:
        groups.setdefault(scales.get(name, 1.0), []).append(name)
    if len(groups) > 1:
        log.info("dense learning rates (train.lr_base_fan_in=%d): %s", cfg.train.lr_base_fan_in, "; ".join(
            f"lr x {sc:.4g}: {len(names)} tensor{'' if len(names) == 1 else 's'}, "
            f"{sum(dense_params[n].numel() for n in names):,} values"
            for sc, names in sorted(groups.items(), reverse=True)))

    impl = str(getattr(cfg.train, "dense_optimizer_impl", "auto"))
    if impl == "auto":
        cuda = any(p.device.type == "cuda" for p in dense_params.values())
        impl = "fused" if cuda else "foreach"

    def make(_params):
        return torch.optim.AdamW(
            [{"params": [dense_params[n] for n in names], "lr": cfg.train.lr * sc, "lr_scale": sc}
             for sc, names in sorted(groups.items(), reverse=True)],
            lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay,
            fused=impl == "fused", foreach=impl == "foreach")

    dense_opt = KeyedOptimizerWrapper(dense_params, make)
    return CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense_opt)])


def _dense_groups(optimizer) -> list[dict]:
    for name, opt in optimizer.optimizers:
        if name == "dense":
            return opt.param_groups
    raise ValueError("dense learning rates: the optimizer has no 'dense' part (expected build_optimizer's)")


def dense_lr_scales(optimizer) -> list[float]:
    """The learning-rate multiplier of each dense AdamW param group of :func:`build_optimizer`'s optimizer, in
    group order (read once after building: a restored optimizer state may not carry them)."""
    return [float(g.get("lr_scale", 1.0)) for g in _dense_groups(optimizer)]


def set_dense_lr(optimizer, lr: float, scales: list[float]) -> None:
    """Set the dense param groups' ``lr`` to ``lr x scales[i]`` (``scales`` from :func:`dense_lr_scales`).
    Raises ValueError when the group count differs from ``scales``."""
    groups = _dense_groups(optimizer)
    if len(groups) != len(scales):
        raise ValueError(f"set_dense_lr: {len(groups)} dense param groups, {len(scales)} scales")
    for g, sc in zip(groups, scales):
        g["lr"] = lr * sc


def _describe_plan(plan) -> str:
    """One compact line per sharded module: ``module: table=sharding_type/kernel[ranks]``."""
    parts = []
    for module_path, params in plan.plan.items():
        for name, ps in params.items():
            ranks = sorted(set(ps.ranks or []))
            parts.append(f"{module_path or '<root>'}.{name}={ps.sharding_type}/{ps.compute_kernel}"
                         f"{ranks}")
    return "; ".join(parts) or "<empty>"
