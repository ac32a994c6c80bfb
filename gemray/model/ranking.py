"""Ranking part of GEM: a candidate tower over the encoded history and multi-task BCE heads (CTR, CVR).

Shape key: B requests, T history tokens (jagged by offsets [B+1]), C candidates (jagged by
candidate_offsets [B+1]), d = ``cfg.width``, H heads, A = ``attention_dim`` (per-head q/k), V = ``linear_dim``
(per-head v), S = ``pma_seeds``, K = number of ranking tasks (``cfg.ranking_tasks``).

``CandidateTower`` (target attention of DIN / GEM-style rankers, on the GDPA kernels)::

    h      = LayerNorm(history)                                [T, d]   (no affine, eps 1e-6)
    c      = LayerNorm(candidates)                             [C, d]
    k | v  = h @ W_kv + b_kv                                   [T, H*A] | [T, H*V]   (shared by both below)
    q      = c @ W_q + b_q                                     [C, H*A]
    x      = ops.cross_attention(q, k, v) @ W_o + b_o          [C, d]   non-causal: a candidate sees the whole
                                                                        history of its own request
    u      = ops.pma(seeds, k, v) @ W_p + b_p                  [B, d]   seeds [S, H, A]; [B, S*H*V] -> d
    logits = MLP([x | candidates | u[req] | ctx[req]])         [C, K]   ctx only with context features

req = the request of each candidate (``segment_ids(candidate_offsets)``). The MLP is Linear + SiLU per
``mlp_dims`` entry, then Linear to K. With ``moe_experts`` E > 0 its first two layers (in -> mlp_dims[0] ->
mlp_dims[1], each Linear + SiLU) are a mixture of E such FFN experts (``gemray.model.moe.MoEFFN``, token-choice
top-k over the candidates), followed by SiLU and the remaining dense layers: ``mlp = [moe, SiLU, Linear...]``. Attention: ``tower_activation`` ("softmax" default: alpha = 1/sqrt(A);
pointwise: act(q.k)/N with N = max_seq_len). A request with no history gets x = b_o and u = b_p (attention
over nothing is 0); one with no candidates contributes nothing to the logits.

``MultiTaskHead``: BCE-with-logits per task on ``labels`` [C, 2] (column 0 click, column 1 convert, as
``gemray.jagged.LABEL_NAMES``): "ctr" on click over every candidate; "cvr" on convert over the clicked
candidates (``cvr_population = "clicked"``: post-click conversion p(convert | click), the usual CVR) or over
every candidate ("all": p(click & convert), ESMM's pCTCVR, free of sample-selection bias). Loss = sum_t w_t *
mean BCE of task t over its population on this rank; an empty population (no candidates, B = 0, no clicks)
gives 0 for that task, still connected to every parameter (the distributed backward needs every rank to reach
all parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gemray import ops
from gemray.config import ModelConfig
from gemray.jagged import segment_ids
from gemray.model.moe import MoEFFN

LN_EPS = 1e-6
LABEL_COLUMN = {"ctr": 0, "cvr": 1}  # the column of JaggedBatch.labels each task reads (click, convert)


class CandidateTower(nn.Module):
    """Cross-attention of candidates to their request's history + PMA pooling + interaction MLP -> logits.

    Args:
        cfg: ModelConfig (d = ``cfg.width``, heads / dims / ``pma_seeds`` / ``mlp_dims`` /
            ``tower_activation`` / ``attention_backend``); needs at least one ranking task.
        max_seq_len: the longest history (the attention bound and the N of pointwise activations).
        has_context: whether ``forward`` gets a context vector (default: ``cfg`` has context features).
        device: where parameters are built ("meta" too: ``to_empty`` + ``init_weights`` later).
    Parameters: q / kv / out / pool (nn.Linear), seeds [S, H, A] (normal, std 0.02), mlp (nn.Sequential; its
    first entry a ``MoEFFN`` when ``cfg.moe_experts`` > 0, see ``moe``).
    Raises ValueError without a ranking task or with max_seq_len < 1.
    """

    def __init__(self, cfg: ModelConfig, max_seq_len: int, *, has_context: bool | None = None, device=None):
        super().__init__()
        cfg.validate()
        if not cfg.ranking_tasks:
            raise ValueError(f"CandidateTower: model.tasks {cfg.tasks} has no ranking task "
                             f"({ModelConfig.RANKING_TASKS})")
        if max_seq_len < 1:
            raise ValueError(f"CandidateTower: max_seq_len must be >= 1, got {max_seq_len}")
        d, H, A, V, S = cfg.width, cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.pma_seeds
        self.d, self.h, self.a, self.v, self.s = d, H, A, V, S
        self.max_seq_len = max_seq_len
        self.activation = cfg.tower_activation
        self.backend = cfg.attention_backend
        self.has_context = bool(cfg.context_features) if has_context is None else bool(has_context)
        self.num_tasks = len(cfg.ranking_tasks)
        self.q = nn.Linear(d, H * A, device=device)
        self.kv = nn.Linear(d, H * (A + V), device=device)
        self.out = nn.Linear(H * V, d, device=device)
        self.pool = nn.Linear(S * H * V, d, device=device)
        dims = [d * (4 if self.has_context else 3)] + [int(m) for m in cfg.mlp_dims]
        layers: list[nn.Module] = []
        if cfg.moe_experts:
            layers += [MoEFFN(dims[0], dims[1], dims[2], cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor,
                              device=device), nn.SiLU()]
            dims = dims[2:]
        for i, o in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(i, o, device=device), nn.SiLU()]
        layers.append(nn.Linear(dims[-1], self.num_tasks, device=device))
        self.mlp = nn.Sequential(*layers)
        self.seeds = nn.Parameter(torch.empty(S, H, A, device=device))
        self.base_rates = [float(r) for r in cfg.task_base_rates]
        self.reset_parameters()

    @property
    def moe(self) -> MoEFFN | None:
        """The mixture-of-experts layer (``mlp[0]``) with ``cfg.moe_experts`` > 0, else None."""
        first = self.mlp[0]
        return first if isinstance(first, MoEFFN) else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This module's own parameter (the PMA seeds; the nn.Linear children reset themselves), and with
        ``cfg.task_base_rates`` the output layer's bias set to logit(rate) per task (no RNG draw)."""
        nn.init.normal_(self.seeds, std=0.02)
        if self.base_rates:
            self.mlp[-1].bias.copy_(torch.logit(torch.tensor(self.base_rates, dtype=torch.float64)))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter anew in construction order (the Linears, then the seeds and the base-rate
        output bias), as construction does."""
        for m in (self.q, self.kv, self.out, self.pool, *self.mlp):
            if isinstance(m, (nn.Linear, MoEFFN)):
                m.reset_parameters()
        self.reset_parameters()

    def forward(self, history: torch.Tensor, offsets: torch.Tensor, candidates: torch.Tensor,
                candidate_offsets: torch.Tensor, context: torch.Tensor | None = None, *,
                max_candidates: int | None = None, return_aux: bool = False):
        """[C, K] logits of every candidate for every ranking task (:meth:`logits_and_aux`); with ``return_aux``
        the pair (logits, the mixture-of-experts statistics) -- what training calls, through ``__call__`` so
        that a compiled tower (``train.compile``) runs compiled."""
        logits, aux = self.logits_and_aux(history, offsets, candidates, candidate_offsets, context,
                                          max_candidates=max_candidates)
        return (logits, aux) if return_aux else logits

    def logits_and_aux(self, history: torch.Tensor, offsets: torch.Tensor, candidates: torch.Tensor,
                       candidate_offsets: torch.Tensor, context: torch.Tensor | None = None, *,
                       max_candidates: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits of every candidate for every ranking task, and the experts' routing statistics.

        Args:
            history: [T, d] float, the encoded history (e.g. the HSTU states), jagged by offsets [B+1] int64.
            candidates: [C, d] float candidate embeddings (``InputLayer.candidate_embeddings``), jagged by
                candidate_offsets [B+1] int64 (the same B).
            context: [B, d] float request embeddings; required iff ``has_context``.
            max_candidates: host int >= every request's candidate count (default: computed, one host sync on
                CUDA; ``GEM`` passes ``HostShape.max_candidates``).
        Returns:
            ([C, K] float logits, K = len(cfg.ranking_tasks), tasks in ``cfg.tasks`` order; aux: {} without
            experts, else ``MoEFFN.forward``'s {"aux_loss" (in the graph), "dropped", "tokens_per_expert"}).
        Raises:
            ValueError: mismatched shapes / batch sizes, a missing or unexpected context, a history longer
            than max_seq_len.
        """
        B = offsets.numel() - 1
        T, C = history.shape[0], candidates.shape[0]
        if history.dim() != 2 or history.shape[1] != self.d or candidates.dim() != 2 or candidates.shape[1] != self.d:
            raise ValueError(f"CandidateTower: expected history [T, {self.d}] and candidates [C, {self.d}], got "
                             f"{tuple(history.shape)} and {tuple(candidates.shape)}")
        if candidate_offsets.numel() != B + 1:
            raise ValueError(f"CandidateTower: candidate_offsets must be [B+1={B + 1}], got "
                             f"{tuple(candidate_offsets.shape)}")
        if (context is not None) != self.has_context or (context is not None and context.shape != (B, self.d)):
            raise ValueError(f"CandidateTower: context expected {'[B, d]' if self.has_context else 'None'} "
                             f"(has_context={self.has_context}), got "
                             f"{None if context is None else tuple(context.shape)}")
        _check_ends(offsets, T, candidate_offsets, C)
        if max_candidates is None:
            max_candidates = int((candidate_offsets[1:] - candidate_offsets[:-1]).max()) if B else 0
        H, A, V = self.h, self.a, self.v
        h = F.layer_norm(history, (self.d,), eps=LN_EPS)
        c = F.layer_norm(candidates, (self.d,), eps=LN_EPS)
        k, v = torch.split(self.kv(h), [H * A, H * V], dim=1)
        k, v = k.reshape(T, H, A), v.reshape(T, H, V)
        q = self.q(c).reshape(C, H, A)
        x = ops.cross_attention(q, candidate_offsets, k, v, offsets, max_candidates, self.max_seq_len,
                                activation=self.activation, backend=self.backend)
        x = self.out(x.reshape(C, H * V))                                       # [C, d]
        u = ops.pma(self.seeds.to(k.dtype), k, v, offsets, self.max_seq_len, activation=self.activation,
                    backend=self.backend)                                       # [B, S, H, V]
        u = self.pool(u.reshape(B, self.s * H * V))                             # [B, d]
        req = segment_ids(candidate_offsets, C)                                 # [C]
        parts = [x, candidates, u[req]]
        if context is not None:
            parts.append(context[req])
        z = torch.cat(parts, dim=1)
        aux: dict[str, torch.Tensor] = {}
        moe = self.moe
        if moe is not None:
            z, aux = moe(z)
            return self.mlp[1:](z), aux
        return self.mlp(z), aux


def _check_ends(offsets: torch.Tensor, T: int, candidate_offsets: torch.Tensor, C: int) -> None:
    """offsets[-1] == T and candidate_offsets[-1] == C: a ValueError on CPU tensors; on CUDA an asynchronous
    device assertion (reading the ends would block the host every step); nothing while torch.compile traces
    (the custom attention ops check their offsets themselves)."""
    if torch.compiler.is_compiling():
        return
    if offsets.device.type == "cpu" and candidate_offsets.device.type == "cpu":
        if int(offsets[-1]) != T or int(candidate_offsets[-1]) != C:
            raise ValueError(f"CandidateTower: offsets must end at T={T} and candidate_offsets at C={C}, got "
                             f"{int(offsets[-1])} and {int(candidate_offsets[-1])}")
        return
    torch._assert_async((offsets[-1] == T) & (candidate_offsets[-1] == C))


class MultiTaskHead(nn.Module):
    """Weighted BCE-with-logits over the ranking tasks (module docstring); no parameters.

    Args:
        tasks: ranking task names in logit-column order, each "ctr" or "cvr" (e.g. ``cfg.ranking_tasks``).
        weights: one weight >= 0 per task (default all 1.0).
        cvr_population: "clicked" or "all" (module docstring).
    Raises ValueError on unknown / repeated tasks, bad weights or population.
    """

    def __init__(self, tasks: Sequence[str], weights: Sequence[float] | None = None,
                 cvr_population: str = "clicked"):
        super().__init__()
        tasks = list(tasks)
        if not tasks or len(set(tasks)) != len(tasks) or any(t not in LABEL_COLUMN for t in tasks):
            raise ValueError(f"MultiTaskHead: tasks must be distinct entries of {tuple(LABEL_COLUMN)}, got {tasks}")
        weights = [1.0] * len(tasks) if weights is None else [float(w) for w in weights]
        if len(weights) != len(tasks) or any(w < 0 for w in weights):
            raise ValueError(f"MultiTaskHead: expected {len(tasks)} weights >= 0, got {weights}")
        if cvr_population not in ("clicked", "all"):
            raise ValueError(f"MultiTaskHead: cvr_population must be 'clicked' or 'all', got {cvr_population!r}")
        self.tasks, self.weights, self.cvr_population = tasks, weights, cvr_population

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "MultiTaskHead":
        """The head of ``cfg``: its ranking tasks, their ``task_weights`` and ``cvr_population``."""
        tasks = cfg.ranking_tasks
        return cls(tasks, [cfg.task_weight(t) for t in tasks], cfg.cvr_population)

    def targets_and_populations(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """labels [C, 2] float32 0/1 (click, convert) -> (targets [C, K] float, population [C, K] bool):
        the label each task's logit predicts and which candidates count for it (also what NE / AUC
        evaluation should use, ``gemray.metrics.BinaryMetrics``). Raises ValueError on a bad shape."""
        if labels.dim() != 2 or labels.shape[1] < 2:
            raise ValueError(f"MultiTaskHead: labels must be [C, 2] (click, convert), got {tuple(labels.shape)}")
        cols = [LABEL_COLUMN[t] for t in self.tasks]
        targets = torch.stack([labels[:, c] for c in cols], 1).to(torch.float32)  # no list index: no H2D copy
        pop = torch.ones_like(targets, dtype=torch.bool)
        if "cvr" in self.tasks and self.cvr_population == "clicked":
            pop[:, self.tasks.index("cvr")] = labels[:, 0] > 0.5
        return targets, pop

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logits [C, K] float (``CandidateTower``), labels [C, 2] float32 -> (loss scalar, stats).

        stats: {"loss_<task>": mean BCE of the task (0 when its population is empty), "count_<task>": its
        population size (float32 scalar on the logits' device), "num_candidates": C (CPU)}, all detached. No
        host sync: each mean is a masked sum over its population divided by its size (at least 1). Raises
        ValueError on mismatched shapes.
        """
        if logits.dim() != 2 or logits.shape[1] != len(self.tasks) or labels.shape[0] != logits.shape[0]:
            raise ValueError(f"MultiTaskHead: logits must be [C, {len(self.tasks)}] with labels [C, 2], got "
                             f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        targets, pop = self.targets_and_populations(labels)
        loss = logits.sum() * 0.0  # connects every parameter behind the logits, also when C == 0
        stats: dict[str, torch.Tensor] = {"num_candidates": torch.tensor(float(logits.shape[0]))}
        # masked means instead of logits[pop] (a boolean index reads the mask on the host: a sync per task)
        bce = F.binary_cross_entropy_with_logits(logits.float(), targets, reduction="none")     # [C, K]
        bce = torch.where(pop, bce, torch.zeros_like(bce))
        counts = pop.sum(0)                                                                    # [K] int64
        means = bce.sum(0) / counts.clamp(min=1).to(bce.dtype)                                 # [K], 0 if empty
        for j, (t, w) in enumerate(zip(self.tasks, self.weights)):
            loss = loss + w * means[j]
            stats[f"loss_{t}"] = means[j].detach()
            stats[f"count_{t}"] = counts[j].detach().to(torch.float32)
        return loss, stats
