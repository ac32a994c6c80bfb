"""Ahead-of-time compile of the attention kernels: one forward + backward per length regime, before step 1.

The Triton kernels (gemray.kernels.jagged_attention) compile one variant per launch plan, and the plan follows
the batch's *length regime* (``KernelConfig.regime_of``: the mean sequence length against
``regime_mean_len``; each regime has its own tiles and launch modes) and Triton's specialisation of integer
arguments (divisible by 16 or not). Left to the training loop, each new regime a batch reaches stalls that step
for the compile (issue 17: steps of 36 s, 72 s and 2 minutes). This module compiles them up front:

* :func:`reachable_regimes` (pure): the regimes whose mean-length range a batch of a config can fall in
  (mean lengths 1 .. ``data.max_seq_len``);
* :func:`warmup_lengths` (pure): per regime two batches of ``data.batch_size`` sequences -- every length a
  multiple of 16, and one sequence at ``max_seq_len`` with the rest chosen so the mean stays in the regime
  and the token count is not a multiple of 16 -- so both integer specialisations compile;
  :func:`warmup_lengths_within` halves the number of sequences of a regime whose batches would hold more than
  :func:`warmup_token_budget` tokens (``gemray.jagged.TOKEN_HEADROOM``, 1.25x a real batch);
* :func:`warm_up_attention`: builds each batch from a real batch of the train stream (tokens, features,
  requests and candidates resampled from it, so every field the model reads is valid), runs the model's
  forward on it and the backward into the *dense* parameters only (``torch.autograd.grad``: no ``.grad`` is
  written, the embedding tables' fused optimizer never runs, DDP's hooks are bypassed by calling the unwrapped
  module; the step count FBGEMM's TBE adds to in every forward, which its Adam bias correction reads, is put
  back: ``gemray.parallel.sparse_steps_kept``), and logs the seconds per regime. The number of calls is fixed (2
  per reachable regime): bounded. Every rank runs the same batches, so sharded-embedding collectives line up.

It runs where the Triton backend is used (``ops.resolve_backend`` gives TRITON: CUDA, or the CPU interpreter
when ``model.attention_backend = "triton"`` under TRITON_INTERPRET=1); elsewhere nothing compiles and it
returns at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from gemray.config import JobConfig
from gemray.jagged import JaggedBatch, headroom_tokens, lengths_to_offsets
from gemray.kernels.config import DEFAULT, REGIMES, KernelConfig

log = logging.getLogger("gemray.train.warmup")


def reachable_regimes(max_seq_len: int, kernel_config: KernelConfig | None = None) -> list[str]:
    """Pure: the length regimes (of ``REGIMES``, in order) a batch with sequences of 1..``max_seq_len`` tokens
    can be in: those whose lower mean-length bound is <= max_seq_len. Raises ValueError for max_seq_len < 1."""
    if max_seq_len < 1:
        raise ValueError(f"reachable_regimes: max_seq_len must be >= 1, got {max_seq_len}")
    kc = kernel_config or DEFAULT
    lows = (1, *kc.regime_mean_len)
    return [r for r, lo in zip(REGIMES, lows) if lo <= max_seq_len]


def _mean_range(reg: str, kc: KernelConfig) -> tuple[int, int]:
    lows = (1, *kc.regime_mean_len)
    highs = (*kc.regime_mean_len, 1 << 62)
    i = REGIMES.index(reg)
    return lows[i], highs[i]


def warmup_lengths(reg: str, batch_size: int, max_seq_len: int, kernel_config: KernelConfig | None = None
                   ) -> list[list[int]]:
    """Pure: the history lengths of the warm-up batches of regime ``reg`` (see the module docstring): a list of
    one or two [batch_size] lists, each with its mean in the regime's range and every length in 1..max_seq_len.
    Raises ValueError for a regime the lengths cannot reach or batch_size < 1."""
    kc = kernel_config or DEFAULT
    if batch_size < 1:
        raise ValueError(f"warmup_lengths: batch_size must be >= 1, got {batch_size}")
    if reg not in reachable_regimes(max_seq_len, kc):
        raise ValueError(f"warmup_lengths: regime {reg!r} is not reachable with max_seq_len {max_seq_len}")
    lo, hi = _mean_range(reg, kc)
    hi = min(hi - 1, max_seq_len)  # largest mean inside the regime
    # an aligned length: the smallest multiple of 16 at or above lo (within the range), else lo itself
    aligned = next((m for m in range(-(-lo // 16) * 16, hi + 1, 16) if m >= 16), lo)
    out = [[aligned] * batch_size]
    if batch_size > 1:
        # one sequence at max_seq_len, the others at the length that keeps the mean in [lo, hi]
        rest = max(1, min(max_seq_len, (lo * batch_size - max_seq_len + batch_size - 2) // (batch_size - 1)))
        lens = [max_seq_len] + [rest] * (batch_size - 1)
        while sum(lens) / batch_size > hi and rest > 1:
            rest -= 1
            lens = [max_seq_len] + [rest] * (batch_size - 1)
        if sum(lens) % 16 == 0:  # make the token count unaligned: shorten one sequence if the mean allows
            j = 1 if lens[1] > 1 and (sum(lens) - 1) / batch_size >= lo else None
            if j is None and lens[1] < max_seq_len and (sum(lens) + 1) / batch_size <= hi:
                lens[1] += 1
            elif j is not None:
                lens[1] -= 1
        if lo <= sum(lens) / batch_size <= hi and lens != out[0]:
            out.append(lens)
    return out


def warmup_token_budget(template_tokens: int) -> int:
    """Pure: the most tokens a warm-up batch may hold: ``gemray.jagged.TOKEN_HEADROOM`` (1.25) x the real template
    batch's (batch-to-batch variation; the activation-checkpointing planner allows for the same), so that
    compiling a regime the data rarely reaches never needs more memory than training does (at batch 128 the GEM
    config's long-history regime asked 2x a real batch and ran out of memory under FSDP)."""
    return headroom_tokens(template_tokens)


def warmup_lengths_within(reg: str, batch_size: int, max_seq_len: int, max_tokens: int,
                          kernel_config: KernelConfig | None = None) -> list[list[int]]:
    """Pure: :func:`warmup_lengths` with the fewest halvings of the number of sequences (from ``batch_size``,
    down to 2) that keep every batch within ``max_tokens``. The kernels a batch compiles follow its mean length
    (the regime) and its token count's alignment, not its number of sequences, so a shorter batch compiles the
    same variants. Raises ValueError as :func:`warmup_lengths`."""
    n = batch_size
    while True:
        out = warmup_lengths(reg, n, max_seq_len, kernel_config)
        if n <= 2 or all(sum(lens) <= max_tokens for lens in out):
            return out
        n = max(2, n // 2)


def resample_batch(template: JaggedBatch, lengths: list[int], generator: torch.Generator) -> JaggedBatch:
    """A batch with the given history ``lengths`` made of ``template``'s values (on CPU): tokens (items,
    ratings, per-token features) drawn from its tokens, timestamps drawn and sorted per sequence, requests
    (user ids, context, candidates with their labels) drawn from its rows. Raises ValueError for an empty
    template."""
    if template.batch_size == 0 or template.num_tokens == 0:
        raise ValueError("resample_batch: the template batch is empty")
    B, T = len(lengths), int(sum(lengths))
    off = lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    tok = torch.randint(0, template.num_tokens, (T,), generator=generator)
    rows = torch.randint(0, template.batch_size, (B,), generator=generator)
    ts = template.timestamps[tok].clone()
    for b in range(B):  # non-decreasing within each sequence
        s, e = int(off[b]), int(off[b + 1])
        ts[s:e] = torch.sort(ts[s:e]).values
    fields: dict[str, Any] = {
        "user_ids": template.user_ids[rows], "offsets": off, "item_ids": template.item_ids[tok],
        "ratings": template.ratings[tok], "timestamps": ts,
        "features": None if template.features is None else {k: v[tok] for k, v in template.features.items()},
        "context": None if template.context is None else {k: v[rows] for k, v in template.context.items()},
    }
    if template.targets is not None:
        fields["targets"] = template.targets[rows]
    if template.target_timestamps is not None:
        fields["target_timestamps"] = torch.maximum(template.target_timestamps[rows], ts[off[1:] - 1])
    if template.candidate_offsets is not None:
        co = template.candidate_offsets
        parts = [torch.arange(int(co[r]), int(co[r + 1])) for r in rows.tolist()]
        idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        fields["candidate_offsets"] = lengths_to_offsets(torch.tensor([p.numel() for p in parts], dtype=torch.int64))
        fields["candidate_ids"] = template.candidate_ids[idx]
        fields["labels"] = template.labels[idx]
    return JaggedBatch(**fields)


def _dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that take a gradient and have no optimizer fused into the backward: not those of a TorchRec
    sharded module (FBGEMM's TBE updates its rows inside its backward), nor any that TorchRec's
    ``apply_optimizer_in_backward`` marked with ``_in_backward_optimizers``."""
    try:
        from torchrec.distributed.types import ShardedModule
    except ImportError:  # pragma: no cover - torchrec is a dependency of the model
        ShardedModule = ()  # type: ignore[assignment]
    sharded = {id(p) for m in model.modules() if isinstance(m, ShardedModule) for p in m.parameters()}
    return [p for p in model.parameters()
            if p.requires_grad and id(p) not in sharded and not hasattr(p, "_in_backward_optimizers")]


def triton_in_use(cfg: JobConfig, device: torch.device) -> bool:
    """True when the model's attention calls take the Triton kernels on ``device`` (``ops.resolve_backend``)."""
    from gemray.ops import AttentionBackend, resolve_backend

    try:
        return resolve_backend(cfg.model.attention_backend, device) is AttentionBackend.TRITON
    except RuntimeError:
        return False


def _compile_regimes(cfg: JobConfig, device: torch.device, model: torch.nn.Module, template: JaggedBatch,
                     forward: Callable[[torch.nn.Module, JaggedBatch], torch.Tensor],
                     params: list[torch.nn.Parameter], gen: torch.Generator, kernel_config: KernelConfig | None,
                     done: list[dict[str, Any]]) -> None:
    """The warm-up's batches: per reachable regime and length variant one forward + ``torch.autograd.grad`` into
    ``params``, timed; one record per batch appended to ``done``."""
    budget = warmup_token_budget(int(template.num_tokens))
    for reg in reachable_regimes(cfg.data.max_seq_len, kernel_config):
        for lens in warmup_lengths_within(reg, cfg.data.batch_size, cfg.data.max_seq_len, budget, kernel_config):
            t0 = time.perf_counter()
            batch = resample_batch(template, lens, gen).to(device)
            loss = forward(model, batch)
            torch.autograd.grad(loss, params, allow_unused=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            s = time.perf_counter() - t0
            done.append({"regime": reg, "lengths_mean": sum(lens) / len(lens), "tokens": int(sum(lens)),
                         "seconds": s})
            log.info("kernel warm-up: regime %s, %d sequences of mean length %.1f (%d tokens): %.1f s",
                     reg, len(lens), sum(lens) / len(lens), sum(lens), s)


def warm_up_attention(cfg: JobConfig, device: torch.device, model: torch.nn.Module | None = None,
                      template: JaggedBatch | None = None,
                      forward: Callable[[torch.nn.Module, JaggedBatch], torch.Tensor] | None = None,
                      kernel_config: KernelConfig | None = None) -> dict[str, Any]:
    """Compile the attention kernels for every regime ``cfg`` can reach (module docstring) on ``model`` (the
    unwrapped model: ``dmp.module``), from ``template`` (a real train batch, CPU). ``forward(model, batch)``
    returns the loss (default: ``model(batch)[0]`` under ``train.precision``'s autocast, as training runs it, so
    the kernels compile for the dtypes training uses). Returns {"ran": bool, "why": str, "regimes": [{"regime",
    "lengths_mean", "tokens", "seconds"}, ...], "seconds": total}. Raises ValueError when the template is
    empty."""
    if model is None or template is None:
        return {"ran": False, "why": "no model or template batch", "regimes": [], "seconds": 0.0}
    if not triton_in_use(cfg, device):
        return {"ran": False, "why": f"attention backend {cfg.model.attention_backend!r} on {device.type} does "
                                     "not use the Triton kernels", "regimes": [], "seconds": 0.0}
    if forward is None:
        from gemray.train.precision import autocast

        def forward(m, b):  # as forward_backward_step: the forward under train.precision's autocast
            with autocast(cfg.train.precision, device):
                return m(b)[0]
    from gemray.parallel import sparse_steps_kept

    params = _dense_params(model)
    gen = torch.Generator().manual_seed(int(cfg.train.seed))
    rng_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    was_training = model.training
    model.train()
    done, t_all = [], time.perf_counter()
    # sparse_steps_kept: FBGEMM's TBE counts an optimizer step per forward (its Adam bias correction reads the
    # count): without it the Triton path alone started training as if some steps had been taken already
    try:
        with sparse_steps_kept(model):
            _compile_regimes(cfg, device, model, template, forward, params, gen, kernel_config, done)
    finally:
        model.train(was_training)
        torch.set_rng_state(rng_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    total = time.perf_counter() - t_all
    log.info("kernel warm-up: %d batches over regimes %s in %.1f s", len(done),
             sorted({d["regime"] for d in done}, key=REGIMES.index), total)
    return {"ran": True, "why": "triton backend", "regimes": done, "seconds": total}


__all__ = ["reachable_regimes", "resample_batch", "triton_in_use", "warm_up_attention", "warmup_lengths",
           "warmup_lengths_within", "warmup_token_budget"]
