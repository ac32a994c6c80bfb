"""Dense FSDP2 / HSDP inside TorchRec's DistributedModelParallel.

TorchRec's ``DistributedModelParallel`` shards the embedding tables and hands the rest of the model to a
``DataParallelWrapper`` (torchrec/distributed/model_parallel.py; the default wraps it in DDP).
:class:`FullyShardWrapper` is that hook applying FSDP2 instead (``torch.distributed.fsdp.fully_shard``,
torchtitan's recipe ``torchtitan/models/llama3/infra/parallelize.py``): one FSDP unit per transformer block
(every ``HSTUBlock``), then the root over the remaining dense parameters, the sharded TorchRec modules'
parameters ignored (they are TorchRec's). The mesh is 1D (FSDP: shard over the dp_shard ranks) or 2D
(HSDP: replicate x shard). Explicit prefetch: block i+1's all-gather is issued at block i's forward and
block i-1's at block i's backward (FSDP2's ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``). Mixed precision (``MixedPrecisionPolicy``): bf16 parameters and fp32
gradient reduction when ``train.precision`` is "bf16"; fp32 otherwise.

Gradients of FSDP parameters are ``DTensor`` shards of the gradient averaged over the dense data-parallel
ranks (``grad.full_tensor()`` is what DDP would hold on every rank).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)


def _block_types() -> tuple[type, ...]:
    from gemray.model.hstu import HSTUBlock

    return (HSTUBlock,)


def mixed_precision_policy(precision: str):
    """FSDP2 ``MixedPrecisionPolicy`` for ``train.precision``: "bf16" -> bf16 parameters in compute, fp32
    gradient reduce-scatter; anything else (default "fp32") -> parameters kept in their dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _sharded_module_params(module: nn.Module) -> set[nn.Parameter]:
    """Parameters owned by TorchRec's sharded modules (and anything left inside ``module.embeddings``)."""
    from torchrec.distributed.types import ShardedModule

    out: set[nn.Parameter] = set()
    for m in module.modules():
        if isinstance(m, ShardedModule):
            out.update(m.parameters())
    emb = getattr(module, "embeddings", None)
    if isinstance(emb, nn.Module):
        out.update(emb.parameters())
    return out


def apply_fully_shard(module: nn.Module, mesh, *, precision: str = "fp32", reshard_after_forward: bool = True,
                      prefetch: bool = True, ignored_params: set[nn.Parameter] | None = None,
                      collectives: str = "nccl") -> list[nn.Module]:
    """FSDP2 on the dense part of ``module`` in place; returns the block units in forward order.

    module: the (TorchRec-sharded) model; its transformer blocks (``HSTUBlock``) become one FSDP unit each,
    the root takes the remaining dense parameters; TorchRec's sharded parameters are ignored.
    mesh: 1D (FSDP) or 2D (HSDP: ``("dp_replicate", "dp_shard")``) DeviceMesh.
    precision: ``train.precision`` ("bf16" -> bf16 compute, fp32 reduce). reshard_after_forward: free each
    block's gathered parameters after its forward (the root keeps its own until backward: it is needed first
    in backward). prefetch: explicit forward / backward prefetch of the neighbouring block.
    ignored_params: further parameters FSDP must leave alone (expert-parallel experts, which
    ``gemray.parallel.expert`` shards and reduces itself). collectives: ``parallel.collectives``
    (``gemray.parallel.collectives``: symmetric-memory all-gather buffers on every unit unless "nccl").
    """
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(precision)
    ignored = _sharded_module_params(module) | set(ignored_params or ())
    blocks = [m for m in module.modules() if isinstance(m, _block_types())]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    root_mp = type(mp)(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, output_dtype=mp.output_dtype,
                       cast_forward_inputs=False)  # the root's input is a JaggedBatch of ids
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp, ignored_params=ignored)
    from gemray.parallel.collectives import configure_fsdp_units

    configure_fsdp_units([*blocks, module], collectives)
    if prefetch and len(blocks) > 1:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return blocks


class FullyShardWrapper:
    """TorchRec ``DataParallelWrapper`` applying :func:`apply_fully_shard` to the DMP's module (instead of
    DDP). mesh / precision / reshard_after_forward / prefetch: as :func:`apply_fully_shard`."""

    def __init__(self, mesh, *, precision: str = "fp32", reshard_after_forward: bool = True, prefetch: bool = True,
                 ignored_params: set[nn.Parameter] | None = None, collectives: str = "nccl"):
        self.mesh, self.precision, self.collectives = mesh, precision, collectives
        self.ignored_params = set(ignored_params or ())
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.blocks: list[nn.Module] = []

    def wrap(self, dmp, env, device: torch.device) -> None:
        module = dmp._dmp_wrapped_module
        self.blocks = apply_fully_shard(module, self.mesh, precision=self.precision,
                                        reshard_after_forward=self.reshard_after_forward, prefetch=self.prefetch,
                                        ignored_params=self.ignored_params, collectives=self.collectives)
        log.info("FSDP2 over mesh %s: %d block units + root (%s, reshard_after_forward=%s, prefetch=%s)",
                 tuple(self.mesh.shape), len(self.blocks), self.precision, self.reshard_after_forward,
                 self.prefetch)


def data_parallel_wrapper(mesh, *, precision: str, reshard_after_forward: bool, prefetch: bool,
                          ignored_params: set[nn.Parameter] | None = None, collectives: str = "nccl"):
    """A :class:`FullyShardWrapper` that is also a ``torchrec...DataParallelWrapper`` (its abstract base)."""
    from torchrec.distributed.model_parallel import DataParallelWrapper

    cls = type("TorchRecFullyShardWrapper", (FullyShardWrapper, DataParallelWrapper), {})
    return cls(mesh, precision=precision, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
               ignored_params=ignored_params, collectives=collectives)


@contextlib.contextmanager
def dense_unsharded(module: nn.Module) -> Iterator[None]:
    """Keep every FSDP2 unit of ``module`` gathered inside the block (no-op without FSDP).

    For calls that reach the dense parameters other than through the root's ``forward`` (evaluation's
    ``user_embeddings``): FSDP2 gathers a unit's parameters only in its own forward hooks. Collective:
    every rank must enter it.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
