"""The parallel layout of one job as degrees of named mesh dimensions: a pure decision, then one DeviceMesh.

torchtitan's ``ParallelDims`` pattern (``torchtitan/distributed/parallel_dims.py``): a frozen record of
degrees, one of which may be -1 ("fill the rest of the world"), validated up front so that a size that
does not divide fails with an error naming it, before any process group or model exists. gemray's
dimensions:

- ``dp_replicate`` x ``dp_shard`` = world size: the dense part (DDP: replicate = world; FSDP2: shard =
  world; HSDP: replicate across groups x shard inside a group of ``dp_shard`` ranks, typically one node);
- ``ep``: expert parallelism, borrowed from ``dp_shard`` (torchtitan's EP over the data-parallel shard
  ranks): the mesh splits ``dp_shard`` into ``dp_shard_out_ep`` x ``ep``;
- ``sparse_group``: TorchRec 2D parallel (``DMPCollection``): embedding tables sharded inside groups of
  that many ranks and replicated across the world / sparse_group groups (0 = plain: one group, the world).

:func:`from_config` maps the ``[parallel]`` config section to degrees; :func:`nearest_valid` is the
elastic resize hook: for a world size the configured degrees do not divide it returns the layout with the
fixed degrees moved to the nearest divisor (the fill dimension absorbing the rest) and says what changed;
:func:`largest_valid_world` gives the largest world <= W at which the configured layout holds unchanged.
:func:`build_mesh` acts on a decision: one ``torch.distributed`` DeviceMesh with the named dimensions.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

DENSE_KINDS = ("ddp", "fsdp", "hsdp")
SPARSE_KINDS = ("auto", "table_wise", "row_wise", "column_wise", "table_row_wise")
# TorchRec ShardingType values the planner may choose from under "auto", per device type. Measured on the
# CPU stack (gloo): TW, RW and CW work for EmbeddingCollection; data-parallel EC fails; TWRW needs CUDA.
AUTO_SHARDING = {"cpu": ("row_wise", "table_wise", "column_wise"),
                 "cuda": ("row_wise", "table_wise", "column_wise", "table_row_wise")}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the job's mesh dimensions; validated (and the -1 fill resolved) on construction.

    world_size: ranks. dp_replicate, dp_shard: dense data-parallel degrees, dp_replicate * dp_shard =
    world_size; at most one of them -1 (= world_size / the other). dense: "ddp" (needs dp_shard 1),
    "fsdp" (needs dp_replicate 1) or "hsdp". ep: expert-parallel degree (1 = off), must divide dp_shard.
    sparse_group: ranks of one TorchRec sharding group (0 or world_size = no 2D), must divide world_size.
    sparse_sharding: one of ``SPARSE_KINDS``. device_type: "cpu" or "cuda". num_experts: the experts of the
    model's MoE layers (``model.moe_experts``; 0 = not known here / none), which ep must divide when > 1.

    Raises ValueError naming the field and the sizes when the degrees do not multiply to / divide the
    world size, or a choice is unknown or unsupported on the device.
    """

    world_size: int
    dp_replicate: int = -1
    dp_shard: int = 1
    ep: int = 1
    sparse_group: int = 0
    dense: str = "ddp"
    sparse_sharding: str = "auto"
    device_type: str = "cpu"
    num_experts: int = 0

    def __post_init__(self) -> None:
        w = self.world_size
        if not isinstance(w, int) or w < 1:
            raise ValueError(f"ParallelDims: world_size must be >= 1, got {w!r}")
        if self.device_type not in AUTO_SHARDING:
            raise ValueError(f"ParallelDims: device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if self.dense not in DENSE_KINDS:
            raise ValueError(f"parallel.dense: expected one of {DENSE_KINDS}, got {self.dense!r}")
        if self.sparse_sharding not in SPARSE_KINDS:
            raise ValueError(f"parallel.sparse_sharding: expected one of {SPARSE_KINDS}, got "
                             f"{self.sparse_sharding!r}")
        if self.sparse_sharding not in ("auto",) + AUTO_SHARDING[self.device_type]:
            raise ValueError(f"parallel.sparse_sharding={self.sparse_sharding!r} is not supported on "
                             f"{self.device_type} (supported: {AUTO_SHARDING[self.device_type]})")
        rep, shard = self.dp_replicate, self.dp_shard
        for name, v in (("dp_replicate", rep), ("dp_shard", shard)):
            if v == 0 or v < -1:
                raise ValueError(f"ParallelDims: {name} must be >= 1 or -1 (fill), got {v}")
        if rep == -1 and shard == -1:
            raise ValueError("ParallelDims: at most one of dp_replicate / dp_shard may be -1 (fill)")
        if rep == -1 or shard == -1:
            fixed_name, fixed = ("dp_shard", shard) if rep == -1 else ("dp_replicate", rep)
            if w % fixed:
                raise ValueError(f"parallel: {fixed_name}={fixed} does not divide world size {w} "
                                 f"(ranks = dp_replicate x dp_shard)")
            rep, shard = (w // fixed, fixed) if rep == -1 else (fixed, w // fixed)
        if rep * shard != w:
            raise ValueError(f"parallel: dp_replicate={rep} x dp_shard={shard} = {rep * shard} != world size {w}")
        if self.dense == "ddp" and shard != 1:
            raise ValueError(f"parallel.dense='ddp' replicates the dense part: dp_shard must be 1, got {shard}")
        if self.dense == "fsdp" and rep != 1:
            raise ValueError(f"parallel.dense='fsdp' shards over every rank: dp_replicate must be 1, got {rep}")
        if self.ep < 1:
            raise ValueError(f"parallel.expert_parallel: expected >= 1 (1 = off), got {self.ep}")
        if shard % self.ep:
            raise ValueError(f"parallel.expert_parallel={self.ep} does not divide dp_shard={shard} (experts are "
                             f"spread over the dense shard ranks; world size {w})")
        if self.ep > 1 and self.num_experts and self.num_experts % self.ep:
            raise ValueError(f"parallel.expert_parallel={self.ep} does not divide model.moe_experts="
                             f"{self.num_experts} (each rank of an ep group holds moe_experts / ep experts)")
        g = self.sparse_group
        if g < 0:
            raise ValueError(f"parallel.sparse_2d_group: expected >= 0, got {g}")
        if g and w % g:
            raise ValueError(f"parallel.sparse_2d_group={g} does not divide world size {w} (tables are sharded "
                             f"inside groups of that size, replicated across world/group groups)")
        if g and g != w and self.device_type != "cuda":
            raise ValueError(f"parallel.sparse_2d_group={g} needs CUDA: TorchRec's DMPCollection (2D parallel) "
                             f"supports CUDA / MTIA only")
        object.__setattr__(self, "dp_replicate", rep)
        object.__setattr__(self, "dp_shard", shard)
        object.__setattr__(self, "sparse_group", 0 if g == w else g)

    # -- derived facts ------------------------------------------------------------------------------------
    @property
    def fsdp_enabled(self) -> bool:
        """The dense part is wrapped by FSDP2 (``fully_shard``): dense is "fsdp" or "hsdp"."""
        return self.dense in ("fsdp", "hsdp")

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def sparse_2d(self) -> bool:
        """TorchRec 2D parallel: tables sharded inside groups smaller than the world."""
        return self.sparse_group > 0

    @property
    def sparse_group_size(self) -> int:
        """Ranks one table's shards span: ``sparse_group`` for 2D, else the world size."""
        return self.sparse_group or self.world_size

    @property
    def sparse_replicas(self) -> int:
        """Copies of every embedding shard (world size / sparse group size; 1 without 2D)."""
        return self.world_size // self.sparse_group_size

    @property
    def sharding_types(self) -> tuple[str, ...]:
        """TorchRec ShardingType values every table is constrained to (the planner picks among them)."""
        if self.sparse_sharding == "auto":
            return AUTO_SHARDING[self.device_type]
        return (self.sparse_sharding,)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, names) of the device mesh: ("dp_replicate", "dp_shard") or, with EP,
        ("dp_replicate", "dp_shard_out_ep", "ep") (their product is the world size; rank-major order)."""
        if self.ep_enabled:
            return ((self.dp_replicate, self.dp_shard // self.ep, self.ep),
                    ("dp_replicate", "dp_shard_out_ep", "ep"))
        return (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")

    def mesh_fields(self) -> dict[str, object]:
        """The layout as plain values for events (``attempt_start``, ``resize``): {"dense", "dp_replicate",
        "dp_shard", "ep", "sparse_group" (0 = one group over the world)}."""
        return {"dense": self.dense, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "ep": self.ep,
                "sparse_group": self.sparse_group}

    def describe(self) -> str:
        """One line for logs and events."""
        s = (f"world {self.world_size}: dense {self.dense} (dp_replicate {self.dp_replicate} x dp_shard "
             f"{self.dp_shard}), sparse {self.sparse_sharding}")
        if self.sparse_2d:
            s += f" 2D (groups of {self.sparse_group}, {self.sparse_replicas} replicas)"
        if self.ep_enabled:
            s += f", ep {self.ep}"
        return s


# -- decisions from the config ----------------------------------------------------------------------------
def detect_gpus_per_node(pcfg, device_type: str) -> int:
    """``parallel.gpus_per_node``, or when 0: the node's visible CUDA devices (1 on CPU or without CUDA)."""
    if pcfg.gpus_per_node:
        return int(pcfg.gpus_per_node)
    if device_type != "cuda":
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def from_config(pcfg, world_size: int, device_type: str, gpus_per_node: int = 1, num_experts: int = 0
                ) -> ParallelDims:
    """Pure decision: the ParallelDims the ``[parallel]`` section asks for at ``world_size`` ranks.

    pcfg: ``gemray.config.ParallelConfig``. gpus_per_node: devices per node (HSDP's default shard size,
    capped at the world size). num_experts: ``model.moe_experts`` (expert parallelism must divide it).
    Raises ValueError naming the sizes when they do not divide.
    """
    dense = pcfg.dense
    if dense == "ddp":
        rep, shard = -1, 1
    elif dense == "fsdp":
        rep, shard = 1, -1
    else:
        shard = int(pcfg.dp_shard) or min(max(1, int(gpus_per_node)), world_size)
        rep = -1
    return ParallelDims(world_size=world_size, dp_replicate=rep, dp_shard=shard,
                        ep=max(1, int(pcfg.expert_parallel)), sparse_group=int(pcfg.sparse_2d_group),
                        dense=dense, sparse_sharding=pcfg.sparse_sharding, device_type=device_type,
                        num_experts=int(num_experts))


def _divisor_at_least(n: int, want: int) -> int:
    """Smallest divisor of n that is >= want (n itself at worst)."""
    for d in range(max(1, want), n + 1):
        if n % d == 0:
            return d
    return n


def _common_divisor_near(a: int, b: int, want: int) -> int:
    """The common divisor of a and b (b = 0: any divisor of a) nearest ``want``: the smallest >= want, else
    the largest below it."""
    common = [d for d in range(1, a + 1) if a % d == 0 and (not b or b % d == 0)]
    above = [d for d in common if d >= want]
    return above[0] if above else common[-1]


def nearest_valid(pcfg, world_size: int, device_type: str, gpus_per_node: int = 1, num_experts: int = 0
                  ) -> tuple[ParallelDims, list[str]]:
    """Elastic resize: the layout for exactly ``world_size`` ranks closest to the configured one.

    Returns (dims, changes): ``changes`` is [] when the configured layout is valid at this size, else one
    line per degree that moved. A fixed degree that does not divide the new world goes to the smallest
    divisor >= the configured degree (each rank then holds at most the share of dense parameters,
    experts and table rows the configured layout gave it, so a shrink cannot run out of memory for
    layout reasons); the fill dimension (HSDP's dp_replicate) takes the rest. E.g. HSDP dp_shard=2 at
    3 ranks -> dp_shard 3 x dp_replicate 1; sparse_2d_group=2 at 3 ranks -> one group of 3 (plain).
    expert_parallel must divide both dp_shard and ``num_experts`` (``model.moe_experts``): it goes to the
    smallest common divisor >= the configured degree, else the largest below it (FSDP over 3 ranks with 4
    experts: ep 2 -> 1, every rank holding all experts).
    Raises ValueError for choices that are wrong at any size (unknown kinds, TWRW on CPU).
    """
    try:
        return from_config(pcfg, world_size, device_type, gpus_per_node, num_experts), []
    except ValueError:
        pass
    changes: list[str] = []
    shard = int(pcfg.dp_shard) or min(max(1, int(gpus_per_node)), world_size)
    if pcfg.dense == "hsdp" and world_size % shard:
        new = _divisor_at_least(world_size, shard)
        changes.append(f"parallel.dp_shard {shard} -> {new} (does not divide world size {world_size})")
        shard = new
    elif pcfg.dense == "fsdp":
        shard = world_size
    elif pcfg.dense == "ddp":
        shard = 1
    ep = max(1, int(pcfg.expert_parallel))
    if shard % ep or (ep > 1 and num_experts and num_experts % ep):
        new = _common_divisor_near(shard, int(num_experts), ep)
        changes.append(f"parallel.expert_parallel {ep} -> {new} (must divide dp_shard {shard}"
                       + (f" and model.moe_experts {num_experts})" if num_experts else ")"))
        ep = new
    group = int(pcfg.sparse_2d_group)
    if group and world_size % group:
        new = _divisor_at_least(world_size, group)
        changes.append(f"parallel.sparse_2d_group {group} -> {new} (does not divide world size {world_size})")
        group = new
    pc = dataclasses.replace(pcfg, dp_shard=shard if pcfg.dense == "hsdp" else 0, expert_parallel=ep,
                             sparse_2d_group=group)
    return from_config(pc, world_size, device_type, gpus_per_node, num_experts), changes


def largest_valid_world(pcfg, world_size: int, device_type: str, gpus_per_node: int = 1, num_experts: int = 0
                        ) -> int:
    """The largest world size <= ``world_size`` at which the configured layout holds unchanged (0 if none)."""
    for w in range(world_size, 0, -1):
        try:
            from_config(pcfg, w, device_type, gpus_per_node, num_experts)
            return w
        except ValueError:
            continue
    return 0


def resolve(pcfg, world_size: int, device_type: str, *, elastic: bool, gpus_per_node: int | None = None,
            num_experts: int = 0) -> ParallelDims:
    """The layout this attempt runs: the configured one or, for an elastic job whose new world size it does
    not divide, :func:`nearest_valid` (each change logged as a WARNING, with the largest world size at
    which the configured layout would have held). A fixed-size job gets the ValueError instead.
    num_experts: ``model.moe_experts`` (expert parallelism must divide it)."""
    gpn = detect_gpus_per_node(pcfg, device_type) if gpus_per_node is None else gpus_per_node
    if not elastic:
        return from_config(pcfg, world_size, device_type, gpn, num_experts)
    dims, changes = nearest_valid(pcfg, world_size, device_type, gpn, num_experts)
    if changes:
        log.warning("elastic resize to %d ranks: the configured layout does not fit (it holds at %d ranks); "
                    "nearest valid layout: %s (%s)", world_size,
                    largest_valid_world(pcfg, world_size, device_type, gpn, num_experts), dims.describe(),
                    "; ".join(changes))
    return dims


# -- acting on a decision ---------------------------------------------------------------------------------
def build_mesh(dims: ParallelDims):
    """One ``torch.distributed`` DeviceMesh over every rank with the dims' named dimensions
    (:meth:`ParallelDims.mesh_shape`); with EP, ("dp_shard_out_ep", "ep") is also flattened to
    "dp_shard" so FSDP can take ``mesh["dp_replicate", "dp_shard"]``. Needs an initialised default process
    group of ``dims.world_size`` ranks (raises ValueError otherwise)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
        raise ValueError(f"build_mesh: needs an initialised process group of {dims.world_size} ranks, got "
                         f"{dist.get_world_size() if dist.is_initialized() else 'none'}")
    shape, names = dims.mesh_shape()
    mesh = init_device_mesh(dims.device_type, shape, mesh_dim_names=names)
    if dims.ep_enabled:
        mesh["dp_shard_out_ep", "ep"]._flatten("dp_shard")
    return mesh


def dense_mesh(mesh, dims: ParallelDims):
    """The sub-mesh FSDP2 shards the dense part over: 1D ``mesh["dp_shard"]`` for "fsdp", 2D
    ``mesh["dp_replicate", "dp_shard"]`` (HSDP: replicate x shard) for "hsdp"."""
    if dims.dense == "hsdp":
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
