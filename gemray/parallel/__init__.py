"""Parallelism: ``plan_layout`` (pure decision from world size), ``parallelize`` (meta model -> TorchRec DMP,
materialised) and ``build_optimizer`` (fused sparse + dense AdamW)."""

from gemray.parallel.sharding import (Layout, build_optimizer, check_shardable, materialize_dense, parallelize,
                                      plan_layout)

__all__ = ["Layout", "build_optimizer", "check_shardable", "materialize_dense", "parallelize", "plan_layout"]
