"""Parallelism: ``ParallelDims`` (pure layout decision: mesh degrees from world size and ``[parallel]``),
``plan_layout``, ``parallelize`` (meta model -> TorchRec DMP / DMPCollection with DDP or FSDP2 dense,
materialised) and ``build_optimizer`` (fused sparse + dense AdamW)."""

from gemray.parallel.dims import ParallelDims, build_mesh, from_config, nearest_valid, resolve
from gemray.parallel.fsdp import dense_unsharded
from gemray.parallel.sharding import (Layout, build_optimizer, check_shardable, dense_lr_scales, materialize_dense,
                                      parallelize, set_dense_lr,
                                      plan_layout, set_sparse_step_counts, sparse_step_counts, sparse_step_modules, sparse_steps_kept,
                                      sync_sparse_replicas)

__all__ = ["Layout", "ParallelDims", "build_mesh", "build_optimizer", "check_shardable", "dense_lr_scales",
           "dense_unsharded", "set_dense_lr",
           "from_config", "materialize_dense", "nearest_valid", "parallelize", "plan_layout", "resolve",
           "set_sparse_step_counts", "sparse_step_counts", "sparse_step_modules", "sparse_steps_kept", "sync_sparse_replicas"]
