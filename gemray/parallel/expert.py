"""Expert parallelism: the experts of every ``MoEFFN`` sharded over the mesh's "ep" dimension, tokens
dispatched to them and combined back with all-to-all.

torchtitan's recipe (``torchtitan/distributed/expert_parallel.py``, ``ExpertParallel``; the EP mesh
borrowed from the data-parallel shard ranks, ``gemray.parallel.dims``), applied like the other
parallelisms to the model while it is still on the meta device (:func:`apply_expert_parallel`, called by
``gemray.parallel.sharding.parallelize`` before the dense part is materialised):

- weights: each of W1 / b1 / W2 / b2 ([E, ...]) becomes a DTensor on the whole mesh ("dp_replicate",
  "dp_shard_out_ep", "ep") with placements (Replicate, Replicate, Shard(0)): rank j of an ep group holds
  experts [j E/ep, (j+1) E/ep); ``MoEFFN.reset_parameters`` draws the full tensors and keeps that slice (the
  values of one unsharded build). DCP saves the shards once (replicas deduplicated) and restores them into
  any other layout, the plain full tensors of an EP-off model included.
- dispatch / combine (:class:`AllToAllDispatcher`): the kept assignments, sorted by expert, go to the rank of
  their expert with ``all_to_all_single`` (split sizes from a first all-to-all of the per-expert counts), are
  regrouped by local expert, run through the local experts, and return by the inverse all-to-all. Both
  all-to-alls are differentiable (:class:`_AllToAll`: the backward is the reverse all-to-all of the gradient).
- gradients: the expert weights are not FSDP / DDP parameters (``expert_parameters`` are given to FSDP2 as
  ignored parameters): each one's gradient already sums the contributions of every rank of its ep group
  (their tokens came to it), so it is summed over the other data-parallel ranks (those holding the same
  experts: the flattened ("dp_replicate", "dp_shard_out_ep") group) and divided by the world size, once it is
  accumulated (:func:`register_expert_grad_reduction`, a post-accumulate-grad hook): the mean over ranks of
  the per-rank losses' gradients, as FSDP / DDP give the other parameters, with no all-reduce over ep.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from gemray.model.moe import MoEFFN

log = logging.getLogger(__name__)


def moe_modules(model: nn.Module) -> list[MoEFFN]:
    """Every mixture-of-experts layer of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFFN)]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The batched expert weights of every MoE layer (what EP shards and reduces itself)."""
    return {p for m in moe_modules(model) for p in m.expert_parameters()}


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Raise ValueError where ``parallel.expert_parallel = ep`` (> 1) cannot apply: the model has no MoE
    layer (``model.moe_experts`` = 0), or ep does not divide a layer's expert count."""
    if ep <= 1:
        return
    layers = moe_modules(model)
    if not layers:
        raise ValueError(f"parallel.expert_parallel={ep}: {type(model).__name__} has no mixture-of-experts layers "
                         f"to spread over the 'ep' mesh dimension (set model.moe_experts > 0 with a ranking task, "
                         f"or parallel.expert_parallel=0)")
    for m in layers:
        if m.num_experts % ep:
            raise ValueError(f"parallel.expert_parallel={ep} does not divide model.moe_experts={m.num_experts} "
                             f"(every rank of an ep group holds moe_experts / expert_parallel experts)")


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` over rows: x [sum(in_splits), ...] -> [sum(out_splits), ...];
    the backward sends each gradient row back where its input came from (splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware all-to-all of rows (:class:`_AllToAll`)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class AllToAllDispatcher:
    """``MoEFFN.dispatcher`` for an ep group of P ranks, E_l = E / P experts each (rank j: experts
    [j E_l, (j+1) E_l)). Per call: one all-to-all of the [E] counts (P x E_l), two host reads of split sizes,
    the token all-to-all, the local experts, the inverse all-to-all. Collective over ``group``: every rank of
    it calls it once per MoE forward (with 0 tokens too)."""

    def __init__(self, group, ep_size: int, local_experts: int):
        self.group, self.ep_size, self.local_experts = group, int(ep_size), int(local_experts)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
        P, El = self.ep_size, self.local_experts
        if counts.numel() != P * El:
            raise ValueError(f"AllToAllDispatcher: counts has {counts.numel()} experts, expected {P} x {El}")
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)   # [P * E_l]: source s, expert e
        send_splits = counts.view(P, El).sum(1).tolist()
        recv_counts = recv.view(P, El)
        recv_splits = recv_counts.sum(1).tolist()
        xr = all_to_all(x, recv_splits, send_splits, self.group)               # grouped (source, expert)
        # regroup by local expert (expert-major, sources in rank order), and back afterwards
        seg = torch.repeat_interleave(torch.arange(P * El, device=x.device), recv.to(x.device))
        key = (seg % El) * P + seg // El
        perm = torch.argsort(key, stable=True)
        y = compute(xr[perm], recv_counts.sum(0).tolist())
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return all_to_all(y[back], send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, mesh, *, ep: int) -> list[MoEFFN]:
    """Shard every MoE layer's experts over ``mesh["ep"]`` (module docstring) in place, before the model is
    materialised; returns the layers. ``mesh``: ``gemray.parallel.dims.build_mesh`` with EP (dimensions
    ("dp_replicate", "dp_shard_out_ep", "ep")). Collective (sub-group creation). Raises ValueError as
    :func:`check_expert_parallel`, or when the mesh's ep size differs from ``ep``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    check_expert_parallel(model, ep)
    if ep <= 1:
        return []
    if mesh.mesh_dim_names is None or "ep" not in mesh.mesh_dim_names or mesh["ep"].size() != ep:
        raise ValueError(f"apply_expert_parallel: mesh {mesh} has no 'ep' dimension of size {ep}")
    ep_mesh = mesh["ep"]
    j = ep_mesh.get_local_rank()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    layers = moe_modules(model)
    for m in layers:
        El = m.num_experts // ep
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(m, name)
            local = torch.empty((El,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                                    stride=torch.empty(p.shape, device="meta").stride())
            setattr(m, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        m.expert_start = j * El
        m.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep, El)
    log.info("expert parallel over %d ranks: %d MoE layer(s), experts [%d, %d) of %d on this rank", ep,
             len(layers), layers[0].expert_start, layers[0].expert_start + layers[0].local_experts,
             layers[0].num_experts)
    return layers


def register_expert_grad_reduction(model: nn.Module, mesh, world_size: int) -> int:
    """Hook every (DTensor) expert weight of ``model``: once its gradient is accumulated, sum the local
    gradient over the ranks holding the same experts (the flattened ("dp_replicate", "dp_shard_out_ep")
    group; none when that is 1 rank) and divide by ``world_size`` (module docstring). Call once, after the
    model is materialised. Collective (group creation). Returns the number of hooked parameters."""
    params = [p for m in moe_modules(model) for p in m.expert_parameters()]
    if not params:
        return 0
    names = [n for n in mesh.mesh_dim_names if n != "ep"]
    other = mesh[tuple(names)]
    group = None
    if other.size() > 1:
        group = (other._flatten("dp_mod_ep") if other.ndim > 1 else other).get_group()
    scale = 1.0 / float(world_size)

    def hook(p: torch.Tensor) -> None:
        g = p.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        if group is not None:
            dist.all_reduce(local, group=group)
        local.mul_(scale)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return len(params)
