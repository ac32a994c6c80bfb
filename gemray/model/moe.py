"""Mixture-of-experts FFN with token-choice top-k routing (the ranking tower's interaction MLP).

Shape key: N tokens (here: candidates), D input width, Hd expert hidden width, O output width, E experts,
k = ``top_k``, E_l experts held by this rank (E without expert parallelism, E / ep with it).

Routing follows the Switch Transformer (Fedus, Zoph, Shazeer 2022, arXiv:2101.03961, §2.1-2.2) generalised
to top-k as in GShard (Lepikhin et al. 2021, arXiv:2006.16668, §2.2) and torchtitan's token-choice MoE::

    p        = softmax(x @ W_r)                      [N, E]  router probabilities (fp32)
    e, g     = top-k of p                            [N, k]  expert ids, gates; k > 1: gates renormalised to
                                                             sum 1 (GShard's top-2), k = 1: g = p_e (Switch)
    capacity = ceil(capacity_factor * N * k / E)     per expert, on this rank's tokens (0 factor: no limit);
                                                     training only: in eval() mode nothing is dropped
    keep     = position of the assignment in its expert's queue < capacity, the queue ordered slot-major
               (every token's first choice before any second choice, tokens in order within a slot), so an
               overflow drops second choices first; a dropped assignment contributes nothing (no re-normalising)
    y_t      = sum over kept (t, e) of g_te * FFN_e(x_t),  FFN_e(x) = SiLU(x W1_e + b1_e) W2_e + b2_e
    aux      = E * sum_e f_e * P_e                   Switch's load-balancing loss, f_e = share of the N*k
               assignments routed to e (before capacity), P_e = mean_t p_te; 1.0 when perfectly balanced

The experts are batched weights W1 [E_l, D, Hd], b1 [E_l, Hd], W2 [E_l, Hd, O], b2 [E_l, O]. One code path
with or without expert parallelism: the kept assignments are sorted by expert and handed to
``self.dispatcher`` (None = every expert is here: compute in place; ``gemray.parallel.expert`` installs an
all-to-all dispatcher that sends each expert's tokens to the rank holding it and brings the outputs back,
differentiably); the experts run as one padded batched matmul over [E_l, max tokens of an expert, D].
The per-expert token counts are read on the host once per call (the padding / all-to-all split sizes).

Expert parallelism leaves the module's code alone: the parallel layer replaces W1 / b1 / W2 / b2 by tensors
holding experts [expert_start, expert_start + E_l) (DTensors sharded on the expert dimension; ``_local`` takes
their local part) and sets ``expert_start``; :meth:`reset_parameters` draws the full [E, ...] tensors from the
global RNG on every rank and keeps this rank's slice, so every layout gets the values of one unsharded build.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ExpertDispatcher(Protocol):
    """Moves expert-sorted tokens to the ranks holding their experts and the outputs back.

    ``__call__(x, counts, compute) -> y``: x [M, D] the kept assignments' inputs sorted by global expert id,
    counts [E] int64 (this rank's assignments per global expert, sum = M), compute(x_local [M', D],
    counts_local list[int] of length E_l) -> [M', O] runs this rank's experts on tokens grouped by local
    expert; returns y [M, O] aligned with x. Must be differentiable in x and in compute's weights.
    """

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor: ...


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local part of a parameter that the parallel layer made a DTensor; the parameter itself otherwise."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from ``num_tokens`` tokens: ceil(factor * N * k / E); with factor 0
    every assignment (N * k, the most one expert can get)."""
    if capacity_factor <= 0:
        return num_tokens * top_k
    return int(math.ceil(capacity_factor * num_tokens * top_k / num_experts))


class MoEFFN(nn.Module):
    """Token-choice top-k mixture of E two-layer SiLU FFN experts (module docstring).

    Args:
        in_dim: D. hidden_dim: Hd. out_dim: O. num_experts: E >= 1. top_k: 1 <= k <= E.
        capacity_factor: >= 0 (0 = no capacity limit: no token is dropped).
        device: where parameters are built ("meta" too).
    Parameters: router (nn.Linear(D, E, bias=False)), w1 [E, D, Hd], b1 [E, Hd], w2 [E, Hd, O], b2 [E, O]
    (E_l rows after expert parallelism). Raises ValueError on bad sizes.
    """

    # the fan-in dimension of the batched expert weights (gemray.model.lr_scaling): w1 [E, D, Hd], w2 [E, Hd, O]
    FAN_IN_DIMS = {"w1": 1, "w2": 1}

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_experts: int, top_k: int,
                 capacity_factor: float = 1.25, *, device=None):
        super().__init__()
        if min(in_dim, hidden_dim, out_dim, num_experts) < 1:
            raise ValueError(f"MoEFFN: sizes must be >= 1, got D={in_dim} Hd={hidden_dim} O={out_dim} "
                             f"E={num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEFFN: top_k must be in 1..{num_experts} (the expert count), got {top_k}")
        if capacity_factor < 0:
            raise ValueError(f"MoEFFN: capacity_factor must be >= 0, got {capacity_factor}")
        self.in_dim, self.hidden_dim, self.out_dim = in_dim, hidden_dim, out_dim
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, float(capacity_factor)
        self.router = nn.Linear(in_dim, num_experts, bias=False, device=device)
        E = num_experts
        self.w1 = nn.Parameter(torch.empty(E, in_dim, hidden_dim, device=device))
        self.b1 = nn.Parameter(torch.empty(E, hidden_dim, device=device))
        self.w2 = nn.Parameter(torch.empty(E, hidden_dim, out_dim, device=device))
        self.b2 = nn.Parameter(torch.empty(E, out_dim, device=device))
        self.expert_start = 0                       # first global expert id held here (expert parallelism)
        self.dispatcher: ExpertDispatcher | None = None
        self._reset_experts()  # the router drew its own weight on construction: same order as reset_parameters

    @property
    def local_experts(self) -> int:
        """E_l: experts whose weights this rank holds."""
        return int(_local(self.w1).shape[0])

    def expert_parameters(self) -> list[nn.Parameter]:
        """The batched expert weights (what expert parallelism shards): w1, b1, w2, b2."""
        return [self.w1, self.b1, self.w2, self.b2]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Router: nn.Linear's default; expert e's W1 / b1 ~ U(+-1/sqrt(D)) and W2 / b2 ~ U(+-1/sqrt(Hd))
        (nn.Linear's bounds per expert), drawn in that order as full [E, ...] tensors on every rank, this
        rank's experts kept. On meta parameters nothing is drawn."""
        self.router.reset_parameters()
        self._reset_experts()

    @torch.no_grad()
    def _reset_experts(self) -> None:
        lo, n = self.expert_start, self.local_experts
        for p, fan_in in ((self.w1, self.in_dim), (self.b1, self.in_dim), (self.w2, self.hidden_dim),
                          (self.b2, self.hidden_dim)):
            local = _local(p)
            if local.is_meta:
                continue
            bound = 1.0 / math.sqrt(fan_in)
            full = torch.empty((self.num_experts,) + tuple(local.shape[1:]), dtype=local.dtype,
                               device=local.device).uniform_(-bound, bound)
            local.copy_(full[lo:lo + n])

    # -- experts ---------------------------------------------------------------------------------------
    def compute_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on tokens grouped by local expert: x [M, D] (counts[e] rows for local expert
        e, in order), counts: E_l host ints -> [M, O]. One padded batched matmul over [E_l, max(counts), D]."""
        El = self.local_experts
        if len(counts) != El or sum(counts) != x.shape[0]:
            raise ValueError(f"MoEFFN.compute_experts: counts {counts} must have {El} entries summing to "
                             f"{x.shape[0]} rows")
        w1, b1, w2, b2 = (_local(p) for p in self.expert_parameters())
        m = max(counts) if counts else 0
        cnt = torch.tensor(counts, dtype=torch.int64, device=x.device)
        start = torch.cumsum(cnt, 0) - cnt                                       # [E_l]
        expert = torch.repeat_interleave(torch.arange(El, device=x.device), cnt)  # [M]
        slot = expert * m + (torch.arange(x.shape[0], device=x.device) - start[expert])
        pad = x.new_zeros((El * m, x.shape[1])).index_copy(0, slot, x)
        h = F.silu(torch.baddbmm(b1.unsqueeze(1), pad.view(El, m, x.shape[1]), w1))  # autocast: bf16 GEMMs
        y = torch.baddbmm(b2.unsqueeze(1), h, w2)                                # [E_l, m, O]
        return y.reshape(El * m, y.shape[-1])[slot]

    # -- routing ---------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [N, D] -> (y [N, O], aux) with aux = {"aux_loss": scalar fp32 in the graph (Switch's load
        balancing loss; 0 for N = 0, still connected to the router), "dropped": detached fp32 share of the
        N*k assignments over capacity, "tokens_per_expert": detached [E] int64 kept assignments per expert}.
        Raises ValueError on a wrong input width."""
        if x.dim() != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"MoEFFN: expected x [N, {self.in_dim}], got {tuple(x.shape)}")
        N, E, k = x.shape[0], self.num_experts, self.top_k
        probs = torch.softmax(self.router(x).float(), dim=-1)                   # [N, E]
        gate, expert = torch.topk(probs, k, dim=-1)                              # [N, k]
        if k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        # slot-major queue: assignment a = j * N + t (choice j of token t)
        e_flat = expert.t().reshape(-1)                                          # [k*N]
        routed = torch.bincount(e_flat, minlength=E)                             # [E] before capacity
        # place of each assignment in its expert's queue: rank among the same expert's, in queue order
        by_expert = torch.argsort(e_flat, stable=True)
        first = torch.cumsum(routed, 0) - routed                                 # [E] queue starts
        pos = torch.empty_like(e_flat)
        pos[by_expert] = torch.arange(e_flat.numel(), device=x.device) - first[e_flat[by_expert]]
        # capacity in training only: evaluation routes every assignment (Switch evaluates with a larger factor)
        keep = pos < expert_capacity(N, k, E, self.capacity_factor if self.training else 0.0)
        if N:
            frac = routed.float() / (N * k)
            aux = E * (frac * probs.mean(0)).sum()
        else:
            aux = probs.sum() * 0.0
        a_sorted = by_expert[keep[by_expert]]                                    # kept assignments by expert
        tok = a_sorted % max(N, 1)
        g_sorted = gate.t().reshape(-1)[a_sorted]
        counts = torch.bincount(e_flat[a_sorted], minlength=E)                   # [E] kept per expert
        xs = x[tok]
        if self.dispatcher is None:
            ys = self.compute_experts(xs, counts.tolist())
        else:
            ys = self.dispatcher(xs, counts, self.compute_experts)
        y = ys.new_zeros((N, self.out_dim)).index_add(0, tok, ys * g_sorted.unsqueeze(1).to(ys.dtype))
        dropped = (1.0 - keep.float().mean()) if N else torch.zeros((), device=x.device)
        return y, {"aux_loss": aux, "dropped": dropped.detach().float(), "tokens_per_expert": counts.detach()}
