"""Activation checkpointing under a memory budget: a pure planner, a probe that measures, one place that acts.

Candidates: every ``HSTUBlock`` and the ``CandidateTower`` (the modules whose forward keeps the most for the
backward). Each can run at one of three levels (``LEVELS``):

* "none": autograd keeps what the forward saves;
* "selective" (op-level selective activation checkpointing, torchtitan's "op" SAC): the module's forward runs
  under ``torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=selective_contexts)``, whose policy
  (:func:`sac_policy`) SAVES the outputs of the expensive ops (``SAVED_OPS``: the GEMMs ``aten::mm`` /
  ``addmm`` / ``_scaled_mm`` and the jagged attention custom ops ``gemray::gdpa_fwd`` (the HSTU blocks' Triton
  kernels), ``gemray::cross_attention`` and ``gemray::pma`` (the tower's)) and RECOMPUTES everything else in the
  backward: the LayerNorms, SiLU, ``u * norm(attn)``, dropout (its RNG state replayed), casts, the residual. An
  HSTU block then keeps its input x [T, D], the uvqk GEMMs' outputs (u's [T, HV], v / q / k's [T, HV + 2HA]:
  SiLU's backward needs its input), the attention's output [T, HV] (and, eagerly, the output GEMM's [T, D], which the backward never
  reads -- SAC caches every saved op's output as it runs -- while under torch.compile the partitioner drops it).
  The reference attention (``attention_backend = "reference"``, the CPU spec) is plain aten ops whose GEMMs are
  ``bmm`` over [B*H, n, n] scores: not saved, so selective recomputes that attention whole. (Eager calls of
  the Triton kernels normally skip the dispatcher, ``gemray.kernels._eager.plain_eager``; under SAC's dispatch
  modes they take the custom ops -- which SAC can see, cache and replay -- at the dispatcher's ~100-200 us of
  host time per call);
* "full": the whole forward recomputed from the inputs (up to the last tensor the backward needs).

The probe measures, during one ordinary training step (the second: the first compiles kernels) with
``torch.autograd.graph.saved_tensors_hooks`` and forward pre/post hooks, per candidate:

* ``saved_bytes``: bytes of the tensors autograd saves while the module's forward runs (distinct storages;
  parameters and their views excluded -- they stay resident anyway);
* ``input_bytes``: bytes of its tensor inputs, what a checkpoint keeps instead;
* an op census (:class:`_OpCensus`, a ``TorchDispatchMode``): in the forward pre-hook the module's forward runs
  once more, eagerly, under ``torch.no_grad()`` on the same inputs (the RNG state forked, so the step's own
  dropout draws are unchanged; on CUDA the census's transient memory is kept out of the measured peak), and
  every op is timed -- CUDA-synchronised before and after, except view ops, which launch nothing -- and
  classified by :func:`sac_policy`. ``selective_bytes``: bytes of the outputs of the ops selective saves (what it
  keeps beyond the inputs); ``recompute_cost``: the seconds of all the forward's ops (what "full" recomputes);
  ``selective_cost``: the seconds of the ops selective recomputes -- "the forward time minus the saved ops'
  time", both from the same eager, op-by-op measurement, so the two levels are in one unit. Time rather than
  counted FLOPs: the recomputed ops are memory-bound (no FLOPs to count) and the jagged attention kernels are
  custom Triton ops. The census is eager even for compiled modules (a dispatch mode makes dynamo run frames
  eagerly anyway), which also keeps the compiled modules' (re)compiles out of the measurement;
* for a candidate compiled in place (:func:`compiled_in_place`: ``nn.Module.compile`` set ``_compiled_call_impl``,
  as ``train.compile`` does), the seconds of its compiled forward instead (:meth:`_Probe.time_compiled`): the
  forward pre-hook keeps its inputs (detached; their requires_grad recorded; containers copied) and the autocast
  state, and after the step -- the probe's saved-tensor and module hooks gone, the step's activations freed --
  ``mod(*args, **kwargs)`` runs twice with grad enabled as in training (inputs as they were, so dynamo reuses the
  step's graph and does not recompile; each tensor a new leaf, so nothing reaches the step's graph; the RNG
  forked; no backward, so no ``.grad`` is written), CUDA-synchronised, outputs dropped at once; the second call's
  seconds are "full"'s cost and selective's is ``max(compiled forward - the census's seconds of the ops selective
  saves, 0)``. The bytes stay the census's and the step's (they are right under compile too). The held inputs
  stay alive through the probe step's backward: most of them (a block's input, saved by its first LayerNorm)
  are saved for it anyway, so the probe step's peak rises by at most their bytes, which keeps the plan on the
  safe side. Under FSDP the timing calls all-gather like any forward; every rank runs them in the same order.

Known biases, documented rather than corrected. Timed eagerly (the census), recomputation under torch.compile
is overstated, most of all selective's, whose pointwise ops inductor fuses: on the H200 (batch 256) the census's
costs put 4 blocks at "full" (338 ms a step) where "selective" on every candidate measured 311 ms at a lower peak
-- hence the compiled timing above. What remains with it: selective's true cost can be below the compiled
forward's pointwise time (the recompute inside the compiled backward may fuse those ops into the backward's own
kernels, while ``forward - saved ops`` prices them at the forward's cost), so selective still looks somewhat
dearer than it is; the saved ops' seconds subtracted are the census's eager ones (the same GEMM and attention
kernels, plus eager host overhead per op, which leans the other way); and the forward, with grad, also writes
the activations it saves, which a recompute inside the backward need not. In eager mode torch's early stop ends
a recompute once the last tensor the backward needs is back -- before an HSTU block's output GEMM -- so "full"
costs one GEMM less than the census counts, which favours "selective". Costs only decide which level buys the
bytes; whether the plan fits is decided on bytes alone.

Peak model (``predicted_peak``): with L_i the level of module i, P0 the peak of the probe step (measured on
CUDA; ``base_bytes + sum(saved)`` elsewhere), kept_i = input_i (full), input_i + selective_bytes_i (selective),
gain_i = saved_i - kept_i, and live_i the bytes its recomputation brings back in the backward (full: saved_i;
selective: saved_i - selective_bytes_i; the inputs counted in, conservatively)::

    peak(L) = P0 - sum_{i recomputed} gain_i(L_i) + max_{i recomputed} live_i(L_i)

(the last term: in the backward one recomputed module's activations are live at a time).

Design batch: batches differ in tokens and activations scale with tokens, so the plan is made for a batch of
``TOKEN_HEADROOM`` (``gemray.jagged``: 1.25, the kernel warm-up's allowance too) x the probe batch's tokens
(:func:`scale_to_tokens`): every candidate's saved_i, input_i and selective_bytes_i and the activation bytes saved
outside the candidates (``_Probe.other``) scale by that factor, while the rest of P0 -- parameters, embedding
tables, optimizer state, what the step allocates besides saved activations -- stays. P0 in the formula above is
then that scaled no-checkpointing peak, and a fractional budget is a fraction of it: plan, prediction and budget
all refer to the design batch. (On the GEM config at batch 256 a plan for the probe batch alone predicted 60.7
GiB against a 61.5 GiB budget and the next step measured 61.9 GiB, but later batches, holding more tokens, peaked
at 70.2 GiB.) Transients that scale with tokens but are not saved activations (the backward's activation gradients)
are not scaled: on CUDA they are part of the measured P0 at the probe batch's size. The planner
(``plan_checkpointing``) starts from every module at "none" and repeatedly takes the upgrade with the lowest
extra recompute cost per extra byte saved -- none -> selective, none -> full or selective -> full, whichever of a
module's next steps is cheapest per byte, as the issue asks -- until ``peak(L) <= budget``; a step that saves no
bytes is never taken. When even every module at its highest level misses the budget the plan says so (``fits =
False``) and recomputes all of them fully.

Modes (``train.activation_checkpointing``, ``MODES``): "none"; "full" (every candidate); "selective" (every
candidate at level selective); "auto" (this planner, when ``train.activation_memory_budget`` > 0: bytes, or a
fraction of the design batch's P0); "torch" (torch's own min-cut recomputation: each HSTU block compiled by
``gemray.parallel.compile`` with ``torch._functorch.config.activation_memory_budget`` set to the fraction).
Recomputation is ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (dropout's RNG state is replayed)
around the module's own forward, patched on the instance so the state-dict keys do not change
(``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module.`` and break resuming). A module compiled in
place (``train.compile``: ``nn.Module.compile`` compiles ``_call_impl``, which calls the patched ``forward``) has
the checkpoint inside its compiled region, as torchtitan's per-block compile of checkpoint-wrapped blocks: dynamo
traces it as the ``tag_activation_checkpoint`` higher-order op, the selective policy tags the traced ops, and the
min-cut partitioner (inductor's and aot_eager's) saves the tagged ones and recomputes the rest inside the compiled
backward (``tests/test_activation_checkpoint.py`` checks the compiled backward graph on aot_eager).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gemray.config import TrainConfig
from gemray.jagged import TOKEN_HEADROOM, headroom_tokens

log = logging.getLogger(__name__)

MODES = TrainConfig.CHECKPOINTING  # ("none", "full", "selective", "auto", "torch")
#: a candidate's checkpointing level, cheapest (and keeping the most) first
LEVELS = ("none", "selective", "full")
#: the ops whose outputs selective checkpointing keeps (qualified names, every overload): the GEMMs and the jagged
#: attention custom ops (gemray.kernels.jagged_attention: gdpa_fwd; gemray.ops: cross_attention, pma)
SAVED_OPS = frozenset({"aten::mm", "aten::addmm", "aten::_scaled_mm", "gemray::gdpa_fwd",
                       "gemray::cross_attention", "gemray::pma"})


def saves_output(op) -> bool:
    """Whether selective checkpointing keeps the output of ``op`` (an OpOverload): its qualified name is in
    ``SAVED_OPS``."""
    name = getattr(op, "name", None)
    return callable(name) and name() in SAVED_OPS


def sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective level's policy (``create_selective_checkpoint_contexts``): MUST_SAVE the outputs of
    ``SAVED_OPS``, PREFER_RECOMPUTE everything else (MUST: torch.compile's partitioner may not override it)."""
    return CheckpointPolicy.MUST_SAVE if saves_output(op) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """``context_fn`` of the selective level: a fresh (caching, cached) pair of dispatch modes per call. A plain
    module-level function, which dynamo accepts as a checkpoint ``context_fn`` under torch.compile."""
    return create_selective_checkpoint_contexts(sac_policy)


@dataclass(frozen=True)
class ModuleCost:
    """One candidate (module docstring): name; saved_bytes / input_bytes (int bytes: what autograd saves with no
    checkpointing, the tensor inputs); recompute_cost: what recomputing the whole forward costs (level "full");
    selective_bytes: bytes of the outputs selective keeps beyond the inputs and selective_cost: what recomputing
    the other ops costs, both None when the level is not offered. Costs in any one unit (the planner compares
    ratios); the probe's are seconds."""

    name: str
    saved_bytes: int
    input_bytes: int
    recompute_cost: float
    selective_bytes: int | None = None
    selective_cost: float | None = None

    def offers(self, level: str) -> bool:
        """Whether ``level`` (one of LEVELS) is an option for this module."""
        return level != "selective" or (self.selective_bytes is not None and self.selective_cost is not None)

    def kept(self, level: str) -> int:
        """Bytes held from the forward to the backward at ``level``. Raises ValueError for a level not offered."""
        if not self.offers(level):
            raise ValueError(f"{self.name}: level {level!r} is not offered")
        return {"none": self.saved_bytes, "selective": self.input_bytes + (self.selective_bytes or 0),
                "full": self.input_bytes}[level]

    def gain(self, level: str = "full") -> int:
        """Bytes saved at ``level`` against "none" (negative: it keeps more than no checkpointing)."""
        return self.saved_bytes - self.kept(level)

    def cost(self, level: str = "full") -> float:
        """Recompute cost at ``level`` (0 at "none")."""
        return {"none": 0.0, "selective": self.selective_cost, "full": self.recompute_cost}[level]

    def live(self, level: str) -> int:
        """Bytes the recomputation brings back during this module's backward at ``level`` (0 at "none"; the
        inputs counted in, conservatively)."""
        if level == "none":
            return 0
        return self.saved_bytes if level == "full" else max(self.saved_bytes - (self.selective_bytes or 0), 0)


@dataclass(frozen=True)
class CheckpointPlan:
    """The planner's answer: ``levels``, the (module, level) pairs of the modules it recomputes ("selective" or
    "full"; in the order each first left "none"; a module not listed stays at "none"), the predicted peak with
    them, the no-checkpointing peak it starts from, the budget (bytes) and whether the prediction fits it."""

    levels: tuple[tuple[str, str], ...]
    predicted_peak: int
    no_checkpoint_peak: int
    budget: int
    fits: bool

    @property
    def recompute(self) -> tuple[str, ...]:
        """The modules recomputed at any level, in choice order."""
        return tuple(n for n, _ in self.levels)

    def level(self, name: str) -> str:
        """The level of module ``name`` ("none" when the plan does not recompute it)."""
        return dict(self.levels).get(name, "none")

    def describe(self) -> str:
        parts = [f"{lvl} {len(names)} [{', '.join(names)}]" for lvl in LEVELS[1:]
                 if (names := [n for n, v in self.levels if v == lvl])]
        return (f"recompute {len(self.levels)} module(s): {'; '.join(parts) or 'none'}; predicted peak "
                f"{format_bytes(self.predicted_peak)} (no checkpointing {format_bytes(self.no_checkpoint_peak)}, "
                f"budget {format_bytes(self.budget)}{'' if self.fits else ', NOT met'})")


def format_bytes(n: float) -> str:
    """``n`` bytes as "12.3 KiB" / "4.56 MiB" / "7.89 GiB" (B below 1 KiB), for the log."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def resolve_budget(budget: float, no_checkpoint_peak: int) -> int:
    """``train.activation_memory_budget`` -> bytes: a value in (0, 1] is a fraction of ``no_checkpoint_peak``,
    one > 1 is bytes, 0 is off (returns the peak itself). Raises ValueError when negative."""
    if budget < 0:
        raise ValueError(f"activation_memory_budget: expected >= 0, got {budget}")
    if budget == 0:
        return int(no_checkpoint_peak)
    if budget <= 1:
        return int(budget * no_checkpoint_peak)
    return int(budget)


def _as_levels(levels: Mapping[str, str] | Iterable[str]) -> dict[str, str]:
    """{name: level}; a plain collection of names means every one at "full". Raises ValueError for an unknown
    level."""
    out = dict(levels) if isinstance(levels, Mapping) else {n: "full" for n in levels}
    bad = {v for v in out.values() if v not in LEVELS}
    if bad:
        raise ValueError(f"checkpointing levels: expected one of {LEVELS}, got {sorted(bad)}")
    return out


def predicted_peak(costs: list[ModuleCost], levels: Mapping[str, str] | Iterable[str],
                   no_checkpoint_peak: int) -> int:
    """peak(L) of the module docstring, bytes. ``levels``: {name: level} (absent names: "none"), or a collection
    of names all at "full"."""
    lv = _as_levels(levels)
    chosen = [(c, lv[c.name]) for c in costs if lv.get(c.name, "none") != "none"]
    return int(no_checkpoint_peak - sum(c.gain(v) for c, v in chosen)
               + max((c.live(v) for c, v in chosen), default=0))


def plan_checkpointing(costs: list[ModuleCost], budget_bytes: int, no_checkpoint_peak: int) -> CheckpointPlan:
    """Choose a level per module (module docstring; pure): from every module at "none", repeatedly take the
    upgrade -- to any higher level the module offers -- with the lowest extra cost per extra byte saved
    (``(cost(new) - cost(old)) / (gain(new) - gain(old))``; ties broken by module name, then the lower level)
    until the predicted peak <= ``budget_bytes``. An upgrade that saves no bytes is never taken, so a module that
    saves no more than its inputs stays at "none". Raises ValueError on negative byte counts or costs, or
    duplicate names."""
    if len({c.name for c in costs}) != len(costs):
        raise ValueError("plan_checkpointing: duplicate module names")
    if any(c.saved_bytes < 0 or c.input_bytes < 0 or c.recompute_cost < 0 or (c.selective_bytes or 0) < 0
           or (c.selective_cost or 0) < 0 for c in costs):
        raise ValueError("plan_checkpointing: negative bytes or cost")
    levels: dict[str, str] = {}
    peak = int(no_checkpoint_peak)
    while peak > budget_bytes:
        best = None
        for c in costs:
            cur = levels.get(c.name, "none")
            for new in LEVELS[LEVELS.index(cur) + 1:]:
                if not c.offers(new):
                    continue
                extra = c.gain(new) - c.gain(cur)
                if extra <= 0:
                    continue
                key = (max(c.cost(new) - c.cost(cur), 0.0) / extra, c.name, LEVELS.index(new))
                if best is None or key < best[0]:
                    best = (key, c.name, new)
        if best is None:
            break
        levels[best[1]] = best[2]  # dicts keep first-insertion order: the order modules first left "none"
        peak = predicted_peak(costs, levels, no_checkpoint_peak)
    return CheckpointPlan(tuple(levels.items()), peak, int(no_checkpoint_peak), int(budget_bytes),
                          peak <= budget_bytes)


def scale_to_tokens(costs: list[ModuleCost], other_bytes: int, no_checkpoint_peak: int, factor: float
                    ) -> tuple[list[ModuleCost], int]:
    """Pure: the probe's measurements carried to the design batch of ``factor`` x the probe batch's tokens
    (module docstring): each candidate's saved / input / selective bytes and ``other_bytes`` (the activation
    bytes saved outside the candidates) are multiplied by ``factor`` (rounded to whole bytes), the rest of
    ``no_checkpoint_peak`` (bytes: parameters, tables, optimizer state) stays. Recompute costs stay as measured
    (seconds of the probe batch): every module's cost per byte changes by the same factor, so the planner's order
    does not. Returns (the scaled costs, the scaled no-checkpointing peak in bytes). Raises ValueError for
    factor <= 0 or negative bytes."""
    if factor <= 0:
        raise ValueError(f"scale_to_tokens: factor must be > 0, got {factor}")
    if other_bytes < 0 or no_checkpoint_peak < 0:
        raise ValueError("scale_to_tokens: negative bytes")

    def sc(n: int) -> int:
        return int(round(n * factor))

    scaled = [replace(c, saved_bytes=sc(c.saved_bytes), input_bytes=sc(c.input_bytes),
                      selective_bytes=None if c.selective_bytes is None else sc(c.selective_bytes)) for c in costs]
    activations = other_bytes + sum(c.saved_bytes for c in costs)
    scaled_activations = sc(other_bytes) + sum(c.saved_bytes for c in scaled)
    return scaled, int(no_checkpoint_peak) - activations + scaled_activations


def plan_report(plan: CheckpointPlan, probe_tokens: int | None, factor: float) -> tuple[int, str]:
    """Pure: (logging level, message) of the "auto" plan made for ``factor`` x the probe batch's
    ``probe_tokens`` tokens (None: not given). INFO when the plan fits its budget; WARNING when the budget is
    unreachable -- even every candidate at its level that saves the most predicts more -- naming the budget and
    that lowest predicted peak (bytes in the message as GiB / MiB)."""
    if probe_tokens is None:
        design = f"{factor:g}x the probe batch's tokens"
    else:
        design = f"{headroom_tokens(probe_tokens, factor)} tokens ({factor:g}x the probe batch's {probe_tokens})"
    msg = f"activation checkpointing: auto, {plan.describe()}; planned for {design}"
    if plan.fits:
        return logging.INFO, msg
    return logging.WARNING, (f"{msg}. The budget {format_bytes(plan.budget)} is unreachable: the lowest predicted "
                             f"peak, every candidate recomputed at its level that saves the most, is "
                             f"{format_bytes(plan.predicted_peak)}")


def peak_report(measured: int, plan: CheckpointPlan, tokens: int | None, design_tokens: int | None
                ) -> tuple[int, str]:
    """Pure: (logging level, message) of the step after the plan: its ``measured`` peak (bytes) at ``tokens``
    tokens beside the plan's prediction for ``design_tokens`` (either None: not given). WARNING when the
    measured peak exceeds the plan's budget, else INFO."""
    at = "" if tokens is None else f" at {tokens} tokens"
    pred = f"predicted {format_bytes(plan.predicted_peak)}" + ("" if design_tokens is None
                                                                else f" for {design_tokens} tokens")
    if measured > plan.budget:
        return logging.WARNING, (f"activation checkpointing: measured peak {format_bytes(measured)}{at} exceeds "
                                 f"the budget {format_bytes(plan.budget)} ({pred})")
    return logging.INFO, f"activation checkpointing: measured peak {format_bytes(measured)}{at} ({pred})"


# ----------------------------------------------------------------------------------------------------------
# acting: candidates, probe, apply
# ----------------------------------------------------------------------------------------------------------
def candidate_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The checkpointable modules of a GEM (any wrapper around it): HSTU blocks and the candidate tower."""
    from gemray.model.hstu import HSTUBlock
    from gemray.model.ranking import CandidateTower

    return {n: m for n, m in model.named_modules() if isinstance(m, (HSTUBlock, CandidateTower))}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _device_of(args, kwargs) -> torch.device | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def compiled_in_place(mod: nn.Module) -> bool:
    """Whether ``mod`` was compiled in place (``nn.Module.compile`` sets ``_compiled_call_impl``, which its
    ``__call__`` then runs): how ``train.compile`` / ``gemray.parallel.compile`` compile the candidates."""
    return getattr(mod, "_compiled_call_impl", None) is not None


@dataclass(frozen=True)
class _Held:
    """A probe-step input kept for the compiled timing: the tensor detached (no tie to the step's graph) and
    whether the original required grad."""

    tensor: torch.Tensor
    requires_grad: bool


def _hold(tree):
    """``tree`` (args / kwargs) with every tensor a :class:`_Held` and its containers copied, so later in-place
    changes to them (a dict the blocks fill) do not change what the timing calls get."""
    return tree_map(lambda a: _Held(a.detach(), a.requires_grad) if isinstance(a, torch.Tensor) else a, tree)


def _fresh(tree):
    """A :func:`_hold` tree as call arguments: each tensor a new leaf (``detach``, requires_grad as it was), the
    containers copied again, so one timing call leaves nothing for the next and nothing in the step's graph."""
    return tree_map(lambda a: a.tensor.detach().requires_grad_(a.requires_grad) if isinstance(a, _Held) else a,
                    tree)


def _time_compiled_forward(mod: nn.Module, args, kwargs, device: torch.device | None,
                           autocast: tuple[bool, torch.dtype] | None, calls: int = 2) -> float:
    """Seconds of ``mod``'s compiled forward (module docstring): ``calls`` calls of ``mod(*args, **kwargs)`` --
    ``args`` / ``kwargs`` as :func:`_hold` made them -- with grad enabled and ``autocast`` ((enabled, dtype) on
    ``device``'s type, as in the step) as in training, the RNG forked (the caller's draws are unchanged),
    CUDA-synchronised before and after each call on a CUDA ``device``; returns the last call's seconds (the first
    absorbs one-off work). Each call's output and graph are dropped at once; no backward runs, so no ``.grad``
    is written."""
    cuda = device is not None and device.type == "cuda"
    dev_type = device.type if device is not None else "cpu"
    enabled, dtype = autocast if autocast is not None else (False, None)
    seconds = 0.0
    with torch.random.fork_rng(devices=[device] if cuda else []), torch.enable_grad(), \
            torch.autocast(dev_type, dtype=dtype, enabled=enabled):
        for _ in range(calls):
            a, k = _fresh((args, kwargs))
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = mod(*a, **k)
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            del out, a, k
    return seconds


class _OpCensus(TorchDispatchMode):
    """Times and classifies every op of a forward (module docstring): ``saved_s`` / ``other_s`` the seconds of
    the ops :func:`saves_output` keeps / of the rest, ``saved_bytes`` the bytes of the kept ops' outputs
    (distinct storages). On ``sync_device`` (a CUDA device, or None) each non-view op is synchronised before
    and after."""

    def __init__(self, sync_device: torch.device | None):
        super().__init__()
        self.sync_device = sync_device
        self.saved_s = 0.0
        self.other_s = 0.0
        self.saved_bytes = 0
        self._ptrs: set[int] = set()
        # the counted outputs stay referenced until the census ends, as SAC keeps them until the backward: a freed
        # output's address reused by a later op's would otherwise read as the same storage and go uncounted
        self._kept: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        sync = self.sync_device is not None and not getattr(func, "is_view", False)
        if sync:
            torch.cuda.synchronize(self.sync_device)
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if sync:
            torch.cuda.synchronize(self.sync_device)
        dt = time.perf_counter() - t0
        if not saves_output(func):
            self.other_s += dt
            return out
        self.saved_s += dt
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self._ptrs:
                    self._ptrs.add(storage.data_ptr())
                    self._kept.append(t)
                    self.saved_bytes += storage.nbytes()
        return out


class _Probe:
    """Context manager measuring ModuleCost of each candidate during one forward (module docstring). After the
    step, :meth:`measured_peak` is the step's CUDA peak without the censuses' transient memory, and
    :meth:`time_compiled` times the candidates compiled in place (their inputs are held until then)."""

    #: ``timing[name]`` values: where a candidate's recompute seconds come from
    COMPILED, CENSUS = "compiled forward", "eager op census"

    def __init__(self, modules: dict[str, nn.Module], params: list[torch.Tensor]):
        self.modules = modules
        self.param_ptrs = set()
        for p in params:  # sharded embedding tables (ShardedTensor / DTensor) may have no plain storage
            try:
                if p.device.type != "meta":
                    self.param_ptrs.add(p.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                pass
        self.stack: list[str] = []
        self.saved: dict[str, int] = {n: 0 for n in modules}
        self.inputs: dict[str, int] = {n: 0 for n in modules}
        self.full_s: dict[str, float] = {n: 0.0 for n in modules}
        self.selective_s: dict[str, float] = {n: 0.0 for n in modules}
        self.selective_bytes: dict[str, int] = {n: 0 for n in modules}
        self.saved_ops_s: dict[str, float] = {n: 0.0 for n in modules}  # the census's seconds of SAVED_OPS
        self.compiled_s: dict[str, float] = {}  # time_compiled: the compiled forward's seconds, all calls
        # the compiled candidates' probe-step calls: (held args, held kwargs, device, (autocast on, dtype))
        self._calls: dict[str, list[tuple]] = {}
        self.seen: set[tuple[int, str]] = set()
        self.other = 0
        self._peaks: list[int] = []  # CUDA peaks of the step's segments before each census
        self._handles: list = []
        self._hooks = None

    def _run_census(self, name: str, mod: nn.Module, args, kwargs) -> None:
        """The module's (class) forward once more, eagerly, under no_grad and the census, RNG forked; on CUDA the
        peak so far is kept and the peak statistics reset after it, so its transient memory is not measured."""
        dev = _device_of(args, kwargs)
        cuda = dev is not None and dev.type == "cuda"
        if cuda:
            self._peaks.append(torch.cuda.max_memory_allocated(dev))
        census = _OpCensus(dev if cuda else None)
        with torch.no_grad(), torch.random.fork_rng(devices=[dev] if cuda else []), census:
            type(mod).forward(mod, *args, **kwargs)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        self.full_s[name] += census.saved_s + census.other_s
        self.selective_s[name] += census.other_s
        self.saved_ops_s[name] += census.saved_s
        self.selective_bytes[name] += census.saved_bytes

    def _hold_call(self, name: str, mod: nn.Module, args, kwargs) -> None:
        """Keep a compiled candidate's call -- its inputs (:func:`_hold`), device and autocast state -- for
        :meth:`time_compiled`."""
        if not compiled_in_place(mod):
            return
        dev = _device_of(args, kwargs)
        dev_type = dev.type if dev is not None else "cpu"
        autocast = (torch.is_autocast_enabled(dev_type), torch.get_autocast_dtype(dev_type))
        self._calls.setdefault(name, []).append((*_hold((tuple(args), dict(kwargs))), dev, autocast))

    def time_compiled(self) -> dict[str, float]:
        """After the step (the probe exited: its saved-tensor and module hooks gone, the step's activations
        freed): the seconds of each compiled candidate's compiled forward on its probe-step inputs, summed over its
        calls in the step (:func:`_time_compiled_forward`); they replace the census's seconds in :meth:`costs`.
        Drops the held inputs. Returns {name: seconds}. Raises RuntimeError while the probe is active."""
        if self._hooks is not None or self._handles:
            raise RuntimeError("_Probe.time_compiled: the probe is still active (call it after the step)")
        for name in list(self._calls):
            held = self._calls.pop(name)  # each module's inputs released once it is timed
            self.compiled_s[name] = sum(_time_compiled_forward(self.modules[name], a, k, dev, autocast)
                                        for a, k, dev, autocast in held)
            del held
        return dict(self.compiled_s)

    def timing(self, name: str) -> str:
        """Where candidate ``name``'s recompute seconds come from: ``COMPILED`` or ``CENSUS``."""
        return self.COMPILED if name in self.compiled_s else self.CENSUS

    def measured_peak(self, device: torch.device) -> int:
        """The step's peak allocated bytes on CUDA ``device`` without the censuses' own (0 off CUDA)."""
        if device.type != "cuda":
            return 0
        return max(self._peaks + [torch.cuda.max_memory_allocated(device)])

    def __enter__(self):
        for name, m in self.modules.items():
            @torch.compiler.disable
            def pre(mod, args, kwargs, name=name):
                self._run_census(name, mod, args, kwargs)
                self._hold_call(name, mod, args, kwargs)
                self.stack.append(name)
                self.inputs[name] += sum(_tensor_bytes(a) for a in list(args) + list(kwargs.values())
                                         if isinstance(a, torch.Tensor))

            @torch.compiler.disable
            def post(mod, args, kwargs, out):
                self.stack.pop()

            self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(post, with_kwargs=True))

        def pack(t: torch.Tensor):
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return t
            if ptr in self.param_ptrs:
                return t
            owner = self.stack[-1] if self.stack else ""
            if (ptr, owner) not in self.seen:
                self.seen.add((ptr, owner))
                nbytes = t.untyped_storage().nbytes()
                if owner:
                    self.saved[owner] += nbytes
                else:
                    self.other += nbytes
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def costs(self) -> list[ModuleCost]:
        """The candidates' ModuleCost (bytes from the step and the census; seconds from the compiled forward
        where :meth:`time_compiled` timed one -- full: its seconds; selective: those less the census's seconds of
        the ops selective saves, at least 0 -- else from the census)."""
        out = []
        for n in self.modules:
            if n in self.compiled_s:
                full, sel = self.compiled_s[n], max(self.compiled_s[n] - self.saved_ops_s[n], 0.0)
            else:
                full, sel = self.full_s[n], self.selective_s[n]
            out.append(ModuleCost(n, self.saved[n], self.inputs[n], full, self.selective_bytes[n], sel))
        return out


def apply_checkpointing(modules: dict[str, nn.Module], levels: Mapping[str, str] | Iterable[str]) -> None:
    """Recompute modules in the backward: ``levels`` maps names (keys of ``modules``) to a level of LEVELS (a
    plain collection of names: all "full"). The instance ``forward`` of a module at "full" becomes
    ``checkpoint(original_forward, ..., use_reentrant=False)``, at "selective" the same with
    ``context_fn=selective_contexts``, at "none" the original again. Idempotent; a module's level can change
    (the wrapper always calls the original forward). Under no_grad (evaluation) the original runs. Raises
    KeyError for an unknown name and ValueError for an unknown level."""
    for name, level in _as_levels(levels).items():
        m = modules[name]
        current = getattr(m, "_gemray_checkpointed", "none")
        if current == level:
            continue
        orig = m.__dict__.get("_gemray_orig_forward", m.forward)
        m._gemray_orig_forward = orig
        if level == "none":
            m.forward = orig
            del m._gemray_checkpointed
            continue
        context_fn = {"selective": {"context_fn": selective_contexts}, "full": {}}[level]

        def fwd(*args, _orig=orig, _ctx=context_fn, **kwargs):
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            return checkpoint(_orig, *args, use_reentrant=False, **_ctx, **kwargs)

        m.forward = fwd
        m._gemray_checkpointed = level


def apply_torch_budget(model: nn.Module, fraction: float, backend: str = "inductor", *,
                       dynamic: str = "auto", optimize_ddp: bool | None = None, mode: str = "default",
                       options: dict | None = None) -> list[str]:
    """Mode "torch": set ``torch._functorch.config.activation_memory_budget`` and compile every HSTU block
    (torch.compile's min-cut partitioner then recomputes to that fraction) through
    ``gemray.parallel.compile.compile_dense_modules``, the one compile path (``train.compile`` shares it: a block
    compiled already is not compiled twice; ``dynamic`` / ``optimize_ddp`` / ``mode`` / ``options`` as there).
    Returns the HSTU block names."""
    import torch._functorch.config as fconfig

    from gemray.model.hstu import HSTUBlock
    from gemray.parallel.compile import compile_dense_modules

    fconfig.activation_memory_budget = float(fraction)
    compile_dense_modules(model, backend=backend, tower=False, head=False, dynamic=dynamic,
                          optimize_ddp=optimize_ddp, mode=mode, options=options,
                          reason="activation_checkpointing = 'torch'")
    return [n for n, m in model.named_modules() if isinstance(m, HSTUBlock)]


class ActivationCheckpointer:
    """The trainer's one handle: ``setup(model)`` after build applies "full" / "selective" / "torch"; in "auto"
    the second ``step(model)`` context probes (no checkpointing; the first is a warm-up: kernel compilation) and
    its ``after_step`` plans -- for a batch of ``headroom`` x the probe batch's tokens (module docstring, "Design
    batch") -- and applies a level per module, then logs the measured peak of the next step beside the prediction
    (a WARNING when it exceeds the budget).

    mode: one of MODES; budget: ``train.activation_memory_budget``; compile_backend / compile_dynamic /
    compile_optimize_ddp: ``train.compile_backend`` / ``compile_dynamic`` / ``compile_optimize_ddp`` (how mode
    "torch" compiles the blocks, as ``train.compile`` would); headroom: the design batch's tokens over the probe
    batch's (default ``gemray.jagged.TOKEN_HEADROOM``). Raises ValueError for an unknown mode or headroom <= 0."""

    def __init__(self, mode: str = "none", budget: float = 0.0, compile_backend: str = "inductor",
                 compile_dynamic: str = "auto", compile_optimize_ddp: bool = False, *,
                 headroom: float = TOKEN_HEADROOM, compile_mode: str = "default", compile_options: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"activation_checkpointing: expected one of {MODES}, got {mode!r}")
        if headroom <= 0:
            raise ValueError(f"activation checkpointing headroom: expected > 0, got {headroom}")
        self.mode, self.budget, self.compile_backend = mode, float(budget), compile_backend
        self.compile_dynamic, self.compile_optimize_ddp = compile_dynamic, bool(compile_optimize_ddp)
        self.compile_mode, self.compile_options = compile_mode, dict(compile_options or {})
        self.headroom = float(headroom)
        self.plan: CheckpointPlan | None = None
        #: tokens of the probe batch and of the design batch the plan is for (None: the trainer did not say), and
        #: the probe step's no-checkpointing peak (bytes: measured on CUDA, else modelled; the plan's
        #: ``no_checkpoint_peak`` is the design batch's)
        self.probe_tokens: int | None = None
        self.probe_peak: int | None = None
        self.design_tokens: int | None = None
        self._tokens: int | None = None
        self._probe: _Probe | None = None
        # the probe runs on the second step: the first one compiles the Triton kernels, its times mean nothing
        self._state = "warmup" if (mode == "auto" and budget > 0) else "done"
        self._modules: dict[str, nn.Module] = {}
        self._device: torch.device | None = None

    @classmethod
    def from_config(cls, train_cfg) -> "ActivationCheckpointer":
        from gemray.config import compile_options

        return cls(train_cfg.activation_checkpointing, train_cfg.activation_memory_budget,
                   getattr(train_cfg, "compile_backend", "inductor"), getattr(train_cfg, "compile_dynamic", "auto"),
                   getattr(train_cfg, "compile_optimize_ddp", False),
                   compile_mode=getattr(train_cfg, "compile_mode", "default"),
                   compile_options=compile_options(getattr(train_cfg, "compile_options", [])))

    def setup(self, model: nn.Module) -> None:
        self._modules = candidate_modules(model)
        if self.mode in ("full", "selective"):
            apply_checkpointing(self._modules, {n: self.mode for n in self._modules})
            log.info("activation checkpointing: %s, recomputing %d module(s)", self.mode, len(self._modules))
        elif self.mode == "torch":
            names = apply_torch_budget(model, self.budget, self.compile_backend,
                                       dynamic=self.compile_dynamic,
                                       optimize_ddp=self.compile_optimize_ddp, mode=self.compile_mode,
                                       options=self.compile_options)
            log.info("activation checkpointing: torch.compile'd %d HSTU block(s) with activation_memory_budget "
                     "%.3g", len(names), self.budget)

    @contextlib.contextmanager
    def step(self, model: nn.Module, device: torch.device, tokens: int | None = None):
        """Wrap one training step (forward + backward) of a batch of ``tokens`` tokens (this rank's; None: not
        known -- the plan and the logs then say the headroom factor only)."""
        self._device = device
        self._tokens = None if tokens is None else int(tokens)
        if self._state == "probe":
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self._probe = _Probe(self._modules or candidate_modules(model), list(model.parameters()))
            with self._probe:
                yield
            return
        if self._state == "measure" and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        yield

    def after_step(self) -> CheckpointPlan | None:
        """Call after each step; returns the plan on the step it was made (else None)."""
        dev = self._device
        if self._state == "warmup":
            self._state = "probe"
            return None
        if self._state == "probe" and self._probe is not None:
            measured = self._probe.measured_peak(dev) if dev is not None else 0  # before the timing allocates
            self._probe.time_compiled()
            costs = self._probe.costs()
            modelled = self._probe.other + sum(c.saved_bytes for c in costs)
            peak0 = measured or modelled
            design, design_peak = scale_to_tokens(costs, self._probe.other, peak0, self.headroom)
            budget = resolve_budget(self.budget, design_peak)
            self.plan = plan_checkpointing(design, budget, design_peak)
            self.probe_tokens, self.probe_peak = self._tokens, int(peak0)
            self.design_tokens = None if self._tokens is None else headroom_tokens(self._tokens, self.headroom)
            log.info("activation checkpointing probe: %s tokens, peak %s (%s), activations saved outside the "
                     "candidates %s", "?" if self._tokens is None else self._tokens, format_bytes(peak0),
                     "measured" if measured else "modelled: saved activations only", format_bytes(self._probe.other))
            for c in costs:
                log.info("activation checkpointing probe: %s saves %s (inputs %s; selective keeps %s more), "
                         "recompute %.2f ms full, %.2f ms selective (timed: %s)", c.name,
                         format_bytes(c.saved_bytes), format_bytes(c.input_bytes), format_bytes(c.selective_bytes or 0),
                         1e3 * c.recompute_cost, 1e3 * (c.selective_cost or 0.0), self._probe.timing(c.name))
            log.log(*plan_report(self.plan, self.probe_tokens, self.headroom))
            apply_checkpointing(self._modules, dict(self.plan.levels))
            self._probe, self._state = None, "measure"
            return self.plan
        if self._state == "measure":
            if dev is not None and dev.type == "cuda" and self.plan is not None:
                log.log(*peak_report(torch.cuda.max_memory_allocated(dev), self.plan, self._tokens,
                                     self.design_tokens))
            self._state = "done"
        return None
