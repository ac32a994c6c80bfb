"""Retrieval head: next-item sampled softmax over L2-normalised states and item embeddings.

Shape key: T tokens, B sequences, D width, M = positions that have a next item (sum of max(L_b - 1, 0)),
R = number of negatives.

As generative-recommenders' ``SampledSoftmaxLoss`` (arXiv:2402.17152 sec. 4.1.1): for each position t
with a next item p = item_ids[t+1] of the same sequence, logits are
``[<h_t, e_p>, <h_t, e_n1>, ..., <h_t, e_nR>] / temperature`` with h, e unit-norm, and the loss is the
cross-entropy of the positive, averaged over the M positions. A negative equal to the positive is
masked out (-inf).

Negatives:
    "uniform":  as generative-recommenders' ``LocalNegativesSampler``: every one of the M positions gets
                its own R = num_negatives ids drawn uniformly from 1..num_items
                (``sample_uniform_per_position``: neg_ids [M, R]); their embeddings [M*R, D] come from the
                caller's lookup (the "neg_item_id" feature, so it works sharded).
    "uniform_shared": R ids per sequence (``sample_uniform``: neg_ids [B, R]), shared by that sequence's
                positions (cheaper: B*R lookups instead of M*R, but the positions of one sequence see
                the same negatives).
    "in_batch": R = num_negatives draws (with replacement, so popularity-weighted) from the batch's own
                positive targets, shared by the whole batch; their embeddings are the targets' embeddings.
``next_item_index`` lives in ``gemray.jagged`` (imported here, where it was defined first).

kernel ("auto" | "triton" | "reference", ``model.retrieval_kernel``): how "uniform_shared" computes its
log-sum-exp. "reference": the padded fp32 bmm below (``_jagged_dense_bmm``, then gather / cat / mask /
logsumexp: [M, R+1] fp32 tensors); "triton": the fused kernel ``gemray.ops.sampled_softmax_lse``
(``gemray.kernels.sampled_softmax``: online log-sum-exp over the R negatives, nothing of size [M, R] in memory);
"auto": Triton on CUDA, the reference elsewhere (``gemray.ops.choose_backend``'s rules). Same loss, float32
products either way. The other negatives modes ignore it.

Under ``train.compile`` the head is one of the compiled modules (``gemray.parallel.compile.compile_targets``), with
the states' projection (``proj``: ``GEM.retrieval_proj``, passed in and traced into the head's graph) in it: on the
GEM-scale H200 step its eager work -- the projection's normalisation, the float32 [T, E] / [B*R, E] normalisations
of the item and negative embeddings, the gathers, the positive dot product and their backward -- was ~1-1.5 ms of
small separate kernels, which fuse compiled. The kernel's custom op (``gemray::sampled_softmax_lse``) and FBGEMM's
jagged ops (the reference) trace as single nodes. The host ints ``max_len`` / ``num_next`` change every batch:
dynamo's automatic dynamic shapes make them symbolic from the second distinct value (one more graph, not one per
batch; and one for a batch with M == 0, the zero-loss branch). The "in_batch" draw from a ``torch.Generator`` cannot be traced
and runs eagerly (``_draw_in_batch``: a graph break there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemray import ops
from gemray.jagged import jagged_to_padded, next_item_index, next_item_offsets, padded_to_jagged, segment_ids


def sample_uniform(batch_size: int, num_negatives: int, num_items: int,
                   generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, R] int64 ids uniform in 1..num_items (drawn on the generator's device, then moved to ``device``: from
    a CPU generator to CUDA through pinned memory, asynchronously -- a pageable copy would block the host)."""
    gdev = generator.device if generator is not None else torch.device("cpu")
    ids = torch.randint(1, num_items + 1, (batch_size, num_negatives), generator=generator, device=gdev)
    device = torch.device(device)
    if ids.device.type == "cpu" and device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def sample_uniform_per_position(offsets: torch.Tensor, num_negatives: int, num_items: int,
                                generator: torch.Generator | None = None, num_next: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of R uniform negatives per position that has a next item (LocalNegativesSampler).

    offsets: [B+1] int64. Returns (neg_ids [M, R] int64 in 1..num_items, rows [B] int64 = max(L_b - 1, 0)),
    rows ordered as ``next_item_index(offsets)`` (by sequence, then position). Drawn on the generator's
    device, returned on ``offsets.device``. num_next: M when known on the host (``HostShape.num_next``; else
    read from the offsets: a host sync on CUDA). Raises ValueError when num_negatives < 1 or num_items < 1.
    """
    if num_negatives < 1 or num_items < 1:
        raise ValueError(f"sample_uniform_per_position: num_negatives ({num_negatives}) and num_items "
                         f"({num_items}) must be >= 1")
    rows = (offsets[1:] - offsets[:-1] - 1).clamp(min=0)
    M = num_next if num_next is not None else (int(rows.sum()) if rows.numel() else 0)
    return sample_uniform(M, num_negatives, num_items, generator, offsets.device), rows


def _jagged_dense_bmm(x: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor, max_len: int | None = None
                      ) -> torch.Tensor:
    """x [T, D] jagged by offsets [B+1] int64, y [B, D, R] -> [T, R] float32 or float64 (row t times y of its
    sequence).

    Padded through FBGEMM (``jagged_to_padded_dense`` -> one batched GEMM -> ``dense_to_jagged``, both with
    autograd), in float32 with autocast off: the sampled-softmax logits are divided by a small temperature,
    so they keep float32 as before. FBGEMM's own ``jagged_dense_bmm`` kernel, used here until 2026-12-03, was
    the third-largest kernel of the GEM-scale step on the H200 (14 ms of 179 at batch 128: a CUDA-core kernel
    for a [T, 64] x [64, 512] product per sequence), while cuBLAS runs the padded product (<= 4x the work for
    these heavy-tailed lengths) in a fraction of that.
    max_len: the longest sequence when known on the host (else read from the offsets: a host sync on CUDA);
    rows past it would be dropped, so it must be >= every length (the callers pass the batch's max).
    """
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm; a dependency of the model, as TorchRec)

    n = max_len if max_len is not None else (int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0)
    if x.dtype == torch.float64:  # FBGEMM's jagged ops stop at float32; float64 is for tests
        return padded_to_jagged(torch.bmm(jagged_to_padded(x, offsets, n), y.to(x.dtype)), offsets)
    dt = torch.float32
    with torch.autocast(x.device.type, enabled=False):
        xp = torch.ops.fbgemm.jagged_to_padded_dense(x.to(dt), [offsets], [max(n, 1)], 0.0)  # [B, n, D]
        out = torch.bmm(xp, y.to(dt))                                                       # [B, n, R]
        return torch.ops.fbgemm.dense_to_jagged(out, [offsets], x.shape[0])[0]               # [T, R]


def retrieval_states(states: torch.Tensor, proj: nn.Module | None) -> torch.Tensor:
    """[N, d] encoder states -> [N, E] unit-norm states the item table is scored against: ``proj`` (a Linear(d, E),
    ``GEM.retrieval_proj``) then L2 normalisation; ``states`` itself without a projection (d == E: the encoder's
    output is unit-norm already)."""
    if proj is None:
        return states
    return F.normalize(proj(states), dim=-1, eps=1e-6)


@torch.compiler.disable
def _draw_in_batch(M: int, R: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[R] int64 positions in 0..M-1 ("in_batch" negatives), drawn on the generator's device, returned on
    ``device``. Never compiled: dynamo cannot pass a ``torch.Generator`` to a traced op, so a compiled head breaks
    its graph here either way; disabled, the break is a deliberate one and the draws are those of the eager head."""
    return torch.randint(0, M, (R,), generator=generator,
                         device=generator.device if generator is not None else "cpu").to(device)


class RetrievalHead(nn.Module):
    """Sampled-softmax next-item loss (no parameters; the item embeddings live in the EmbeddingCollection).

    negatives: one of ``NEGATIVES``; num_negatives: R; temperature: logit divisor (> 0); kernel: one of
    ``KERNELS``, the "uniform_shared" implementation (module docstring; an attribute, so tests can switch it).
    """

    NEGATIVES = ("uniform", "uniform_shared", "in_batch")
    KERNELS = ("auto", "triton", "reference")

    def __init__(self, negatives: str, num_negatives: int, temperature: float, kernel: str = "reference"):
        super().__init__()
        if negatives not in self.NEGATIVES:
            raise ValueError(f"model.negatives: expected one of {self.NEGATIVES}, got {negatives!r}")
        if kernel not in self.KERNELS:
            raise ValueError(f"model.retrieval_kernel: expected one of {self.KERNELS}, got {kernel!r}")
        if num_negatives < 1 or temperature <= 0:
            raise ValueError("RetrievalHead: num_negatives must be >= 1 and temperature > 0")
        self.negatives = negatives
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.kernel = kernel

    def uses_triton(self, device: torch.device) -> bool:
        """Whether "uniform_shared" runs the fused Triton kernel on ``device`` (``kernel`` resolved by
        ``gemray.ops.resolve_sampled_softmax_backend``; RuntimeError when "triton" cannot run there)."""
        return ops.resolve_sampled_softmax_backend(self.kernel, device) is ops.AttentionBackend.TRITON

    def forward(self, states: torch.Tensor, offsets: torch.Tensor, item_ids: torch.Tensor,
                item_emb: torch.Tensor, neg_ids: torch.Tensor | None = None,
                neg_emb: torch.Tensor | None = None,
                generator: torch.Generator | None = None, *, max_len: int | None = None,
                num_next: int | None = None, proj: nn.Module | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and stats for a training batch.

        states: [T, D] unit-norm user states, or with ``proj`` the [T, d] encoder states it projects to them
        (:func:`retrieval_states`: inside the head, so that a compiled head fuses the normalisation with the
        rest); offsets [B+1] int64; item_ids [T] int64;
        item_emb: [T, D] raw item embeddings of ``item_ids`` (targets are item t+1: no second lookup);
        neg_ids + neg_emb: [M, R] int64 + [M*R, D] for "uniform" (rows in ``next_item_index`` order),
        [B, R] int64 + [B*R, D] for "uniform_shared"; generator seeds "in_batch" draws.
        Raises ValueError when the negatives a mode needs are missing or mis-shaped.
        Returns (loss: scalar, {"num_targets": float tensor, "pos_logit": mean positive cosine}).
        With M == 0 the loss is 0 but stays connected to every input (distributed backward).
        max_len / num_next: the longest sequence and M as host ints (``gemray.jagged.HostShape``), so that no
        shape is read from a device tensor (each such read is a host sync); None: read from the offsets.
        """
        states = retrieval_states(states, proj)
        idx = next_item_index(offsets, num_next)
        M = idx.numel()
        target_ids = item_ids[idx + 1]
        zero = states.sum() * 0.0 + item_emb.sum() * 0.0
        if neg_emb is not None:
            zero = zero + neg_emb.sum() * 0.0
        if M == 0:
            return zero, {"num_targets": states.new_zeros(()), "pos_logit": states.new_zeros(())}
        h = states[idx]                                            # [M, D]
        e_all = F.normalize(item_emb, dim=-1, eps=1e-6)
        pos = (h * e_all[idx + 1]).sum(-1, keepdim=True)           # [M, 1]
        if self.negatives == "uniform":
            if neg_ids is None or neg_emb is None or neg_ids.dim() != 2 or neg_ids.shape[0] != M \
                    or neg_emb.shape[0] != neg_ids.numel():
                raise ValueError(f"RetrievalHead: 'uniform' negatives need neg_ids [M={M}, R] and neg_emb "
                                 f"[M*R, D], got {None if neg_ids is None else tuple(neg_ids.shape)} and "
                                 f"{None if neg_emb is None else tuple(neg_emb.shape)}")
            R = neg_ids.shape[1]
            e_neg = neg_emb.view(M, R, -1)                              # raw, [M, R, D]
            # <h, e/|e|> without a normalised [M, R, D] copy (the largest tensor of the step)
            dots = torch.bmm(e_neg, h.unsqueeze(-1)).squeeze(-1)        # [M, R]
            neg = dots / torch.linalg.vector_norm(e_neg, dim=-1).clamp(min=1e-6)
            same = neg_ids == target_ids.view(-1, 1)
        elif self.negatives == "uniform_shared":
            if neg_ids is None or neg_emb is None:
                raise ValueError("RetrievalHead: 'uniform_shared' negatives need neg_ids and neg_emb")
            B, R = neg_ids.shape
            e_neg = F.normalize(neg_emb, dim=-1, eps=1e-6).view(B, R, -1)
            if self.uses_triton(states.device):
                return self._fused_shared(h, pos.squeeze(1), e_neg, neg_ids, target_ids, offsets, max_len, zero)
            neg = _jagged_dense_bmm(states, offsets, e_neg.transpose(1, 2), max_len)[idx]  # [M, R]
            same = neg_ids[segment_ids(offsets, states.shape[0])[idx]] == target_ids.view(-1, 1)
        else:
            R = self.num_negatives
            draw = _draw_in_batch(M, R, generator, idx.device)
            e_neg = e_all[idx[draw] + 1]                            # [R, D]
            neg = h @ e_neg.T                                       # [M, R]
            same = target_ids[draw].view(1, R) == target_ids.view(-1, 1)
        logits = torch.cat([pos, neg.masked_fill(same, float("-inf"))], dim=1) / self.temperature
        loss = (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean() + zero
        stats = {"num_targets": torch.tensor(float(M)), "pos_logit": pos.detach().mean()}
        return loss, stats

    def _fused_shared(self, h: torch.Tensor, pos: torch.Tensor, e_neg: torch.Tensor, neg_ids: torch.Tensor,
                      target_ids: torch.Tensor, offsets: torch.Tensor, max_len: int | None, zero: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """"uniform_shared" through the fused kernel: h [M, D], pos [M] (cosines), e_neg [B, R, D] unit-norm,
        neg_ids [B, R], target_ids [M], offsets [B+1] (token offsets: sequence b has max(L_b - 1, 0) rows)."""
        if max_len is None:  # a host sync on CUDA, as _jagged_dense_bmm without max_len
            max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
        # float32 products, as the reference; float64 (tests) takes the reference formula: the kernels stop at fp32
        dt, backend = (torch.float64, "reference") if h.dtype == torch.float64 else (torch.float32, "triton")
        with torch.autocast(h.device.type, enabled=False):
            lse = ops.sampled_softmax_lse(h.to(dt), pos.to(dt), e_neg.to(dt), neg_ids, target_ids,
                                          next_item_offsets(offsets), max(max_len - 1, 0), self.temperature,
                                          backend=backend)
        loss = (lse - pos.to(lse.dtype) / self.temperature).mean() + zero
        stats = {"num_targets": torch.tensor(float(h.shape[0])), "pos_logit": pos.detach().mean()}
        return loss, stats
