"""Parallelism: ``plan_layout`` (pure decision from world size) and ``parallelize`` (TorchRec DMP)."""

from gemray.parallel.sharding import Layout, check_shardable, parallelize, plan_layout

__all__ = ["Layout", "check_shardable", "parallelize", "plan_layout"]
