"""Parallelism for a GEM model: a pure layout decision, then TorchRec sharding + DDP + optimizers.

Follows the TorchRec recipe (torchrec.distributed docs, "DistributedModelParallel"): build the model with
its EmbeddingCollection on the ``meta`` device, attach the fused sparse optimizer *before* sharding
(``apply_optimizer_in_backward``), let ``EmbeddingShardingPlanner`` choose a plan for the world size, wrap
with ``DistributedModelParallel`` (embeddings sharded, dense part DDP), then optimise the dense parameters
with AdamW and combine both optimizers in one ``CombinedOptimizer``.

Measured on the CPU stack (see ../shared/NOTES.md): with gloo, EmbeddingCollection tables are sharded
row-wise automatically; table-wise and column-wise also work; data-parallel EC fails, so it is never
allowed here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from gemray.config import JobConfig

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
    """

    world_size: int
    device_type: str
    backend: str
    sharding_types: tuple[str, ...]


def plan_layout(world_size: int, device_type: str) -> Layout:
    """Pure decision: the layout for ``world_size`` ranks on ``device_type`` ("cpu" or "cuda").

    Raises ValueError for world_size < 1 or an unknown device type.
    """
    if world_size < 1:
        raise ValueError(f"plan_layout: world_size must be >= 1, got {world_size}")
    if device_type == "cpu":
        return Layout(world_size, "cpu", "gloo", _CPU_SHARDING)
    if device_type == "cuda":
        return Layout(world_size, "cuda", "nccl", _GPU_SHARDING)
    raise ValueError(f"plan_layout: device_type must be 'cpu' or 'cuda', got {device_type!r}")


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


def parallelize(model: nn.Module, *, layout: Layout, cfg: JobConfig, device: torch.device,
                pg: "torch.distributed.ProcessGroup | None" = None):
    """Shard ``model`` over the default process group; returns ``(dmp, optimizer)``.

    model: a plain module (e.g. ``gemray.model.gem.GEM``) with an ``embeddings`` attribute holding a
        TorchRec ``EmbeddingCollection`` built on ``device="meta"``; other parameters are dense.
    layout: from :func:`plan_layout`; its world size must match the process group's.
    cfg: the job config; uses ``train.lr``, ``train.adam_betas``, ``train.weight_decay`` (dense AdamW),
        ``train.sparse_optimizer`` and ``train.sparse_lr`` (the embedding optimizer, fused into the FBGEMM
        backward; the Adam kinds also take ``train.adam_betas``).
    device: this rank's device (``cuda:<local_rank>`` or ``cpu``).
    Returns ``(DistributedModelParallel, CombinedOptimizer)``: call ``optimizer.step()`` after backward
    (the sparse part has already stepped inside backward); the combined state_dict names parameters
    ``"sparse.<fqn>"`` (fused embedding optimizer) and ``"dense.<fqn>"`` (AdamW).
    Raises ValueError if model.embedding_dim is not a multiple of 4 (FBGEMM), the process group is not
    initialised, its size differs from the layout, or the
    model has no ``embeddings`` EmbeddingCollection.
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    check_shardable(cfg.model)
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

    # 1. Fused sparse optimizer, applied in backward, before sharding.
    sparse_cls, kernels = _sparse_optimizer(layout, cfg.train.sparse_optimizer)
    apply_optimizer_in_backward(sparse_cls, ec.parameters(), sparse_optimizer_kwargs(sparse_cls, cfg))

    # 2. Planner over the topology; constrain every table to the layout's sharding types.
    constraints = {t.name: ParameterConstraints(sharding_types=list(layout.sharding_types),
                                                compute_kernels=kernels)
                   for t in ec.embedding_configs()}
    topology = Topology(world_size=layout.world_size, compute_device=layout.device_type)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, pg=pg)
    if dist.get_rank(pg) == 0:
        log.info("sharding plan (%d ranks, %s): %s", layout.world_size, layout.device_type,
                 _describe_plan(plan))

    # 3. DMP: EC sharded per plan, the dense remainder wrapped in DDP.
    dmp = DistributedModelParallel(module=model, device=device, plan=plan)

    # 4. Dense AdamW over what the in-backward optimizer does not own; combine both.
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(
        dense_params,
        lambda params: torch.optim.AdamW(params, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas),
                                         weight_decay=cfg.train.weight_decay))
    optimizer = CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense_opt)])
    return dmp, optimizer


def _describe_plan(plan) -> str:
    """One compact line per sharded module: ``module: table=sharding_type/kernel[ranks]``."""
    parts = []
    for module_path, params in plan.plan.items():
        for name, ps in params.items():
            ranks = sorted(set(ps.ranks or []))
            parts.append(f"{module_path or '<root>'}.{name}={ps.sharding_type}/{ps.compute_kernel}"
                         f"{ranks}")
    return "; ".join(parts) or "<empty>"
