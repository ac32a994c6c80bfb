"""Elastic-controller decisions, pure (no Ray, no torch.distributed): unit-testable on their own.

The code that acts on them is elsewhere: Ray Train V2 (``ScalingConfig(num_workers=(min, max))``,
``FailureConfig``) restarts the worker group after a failure or a resize; every (re)started worker
(``gemray.train_loop``) derives its layout with :func:`decide_layout`, builds a fresh TorchRec plan,
restores the newest good committed checkpoint (``gemray.checkpoint.choose_checkpoint``; DCP reshards to
the new world size) and continues the epoch at the saved data position
(``gemray.pipelines.stream.ElasticTrainStream``). Events go to ``events.jsonl``; :func:`summarize_recovery`
turns them into the figures reported in metrics.json and BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemray.checkpoint import checkpoint_reason, choose_checkpoint
from gemray.events import EVENT_KINDS, Event, failure_events, summarize_recovery
from gemray.parallel.sharding import Layout, plan_layout
from gemray.preemption import preemption_action

__all__ = ["EVENT_KINDS", "Event", "ParallelPlan", "checkpoint_reason", "choose_checkpoint", "decide_layout",
           "decide_world_size", "failure_events", "preemption_action", "should_emergency_checkpoint",
           "summarize_recovery"]


@dataclass(frozen=True)
class ParallelPlan:
    """The parallel layout for one world size.

    sparse: the TorchRec layout (sharding types the planner may use over ``world_size`` ranks; the
    plan itself is built by ``gemray.parallel.parallelize``). dense_mesh: (data-parallel replicas,
    FSDP shard size): dense parameters are replicated with DDP over all ranks, so (world_size, 1).
    """

    world_size: int
    sparse: Layout
    dense_mesh: tuple[int, int]


def decide_world_size(available: int, min_workers: int, max_workers: int) -> int:
    """World size for ``available`` worker slots: ``min(available, max)``; Ray Train's elastic rule.

    Raises ValueError if ``available < min_workers`` (the job must wait, not run) or the bounds are bad.
    """
    if min_workers < 1 or max_workers < min_workers:
        raise ValueError(f"decide_world_size: need 1 <= min_workers ({min_workers}) <= max_workers ({max_workers})")
    if available < min_workers:
        raise ValueError(f"decide_world_size: {available} worker slot(s) available, fewer than "
                         f"min_workers={min_workers}: wait for resources")
    return min(int(available), int(max_workers))


def decide_layout(world_size: int, device_type: str) -> ParallelPlan:
    """The parallel plan for ``world_size`` ranks on ``device_type`` ("cpu"/"cuda"); see ParallelPlan."""
    return ParallelPlan(world_size, plan_layout(world_size, device_type), (world_size, 1))


def should_emergency_checkpoint(votes: int, world_size: int, *, healthy: bool = True) -> bool:
    """Emergency checkpoint iff at least one rank got a preemption notice (``votes`` = all-reduced sum of
    per-rank flags) and the group is still healthy (the vote itself completed on all ranks)."""
    if not 0 <= votes <= world_size:
        raise ValueError(f"should_emergency_checkpoint: votes={votes} outside 0..{world_size}")
    return healthy and votes > 0
