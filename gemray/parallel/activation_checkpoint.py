"""Activation checkpointing under a memory budget: a pure planner, a probe that measures, one place that acts.

Candidates: every ``HSTUBlock`` and the ``CandidateTower`` (the modules whose forward keeps the most for the
backward). For each the probe measures, during one ordinary training step (the second: the first compiles kernels) (forward with
``torch.autograd.graph.saved_tensors_hooks`` and forward pre/post hooks):

* ``saved_bytes``: bytes of the tensors autograd saves while the module's forward runs (distinct storages;
  parameters and their views excluded -- they stay resident anyway);
* ``input_bytes``: bytes of its tensor inputs, what a checkpoint keeps instead;
* ``recompute_cost``: seconds its forward took (CUDA-synchronised around it), what a checkpoint spends again
  in the backward. Time rather than counted FLOPs, because the jagged attention kernels are custom Triton
  ops a FLOP counter does not see.

Peak model (``predicted_peak``): with R the recomputed set and P0 the peak of the probe step (measured on
CUDA; ``base_bytes + sum(saved)`` elsewhere)::

    peak(R) = P0 - sum_{i in R} (saved_i - input_i) + max_{i in R} saved_i

(the last term: in the backward one recomputed module's activations are live at a time). The planner
(``plan_checkpointing``) adds modules in order of ``recompute_cost / (saved - input)`` -- cheapest recompute
per byte saved first, as the issue asks -- until ``peak(R) <= budget``; a module that saves no more than its
inputs is never chosen. When even all candidates miss the budget the plan says so (``fits = False``) and
recomputes all of them.

Modes (``train.activation_checkpointing``): "none"; "full" (every candidate); "auto" (this planner, when
``train.activation_memory_budget`` > 0: bytes, or a fraction of P0); "torch" (torch's own min-cut
recomputation: each HSTU block compiled by ``gemray.parallel.compile`` with ``torch._functorch.config.activation_memory_budget`` set
to the fraction). Recomputation is ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (dropout's RNG
state is replayed) around the module's own forward, patched on the instance so the state-dict keys do not
change (``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module.`` and break resuming).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

MODES = ("none", "full", "auto", "torch")


@dataclass(frozen=True)
class ModuleCost:
    """One candidate: name, saved_bytes / input_bytes (int bytes), recompute_cost (seconds or FLOPs: any unit,
    the planner only compares ratios)."""

    name: str
    saved_bytes: int
    input_bytes: int
    recompute_cost: float

    @property
    def gain(self) -> int:
        return self.saved_bytes - self.input_bytes


@dataclass(frozen=True)
class CheckpointPlan:
    """The planner's answer: which modules to recompute (in choice order), the predicted peak with them, the
    no-checkpointing peak it starts from, the budget (bytes) and whether the prediction fits it."""

    recompute: tuple[str, ...]
    predicted_peak: int
    no_checkpoint_peak: int
    budget: int
    fits: bool

    def describe(self) -> str:
        gib = 2.0 ** 30
        return (f"recompute {len(self.recompute)} module(s) [{', '.join(self.recompute) or 'none'}]; predicted "
                f"peak {self.predicted_peak / gib:.2f} GiB (no checkpointing {self.no_checkpoint_peak / gib:.2f} "
                f"GiB, budget {self.budget / gib:.2f} GiB{'' if self.fits else ', NOT met'})")


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


def predicted_peak(costs: list[ModuleCost], recompute: set[str] | tuple[str, ...], no_checkpoint_peak: int) -> int:
    """peak(R) of the module docstring, bytes."""
    chosen = [c for c in costs if c.name in set(recompute)]
    return int(no_checkpoint_peak - sum(c.gain for c in chosen) + max((c.saved_bytes for c in chosen), default=0))


def plan_checkpointing(costs: list[ModuleCost], budget_bytes: int, no_checkpoint_peak: int) -> CheckpointPlan:
    """Choose modules to recompute, cheapest ``recompute_cost / (saved - input)`` first, until the predicted
    peak <= ``budget_bytes`` (pure; ties broken by name). Modules with ``saved <= input`` are never chosen.
    Raises ValueError on negative byte counts or duplicate names."""
    if len({c.name for c in costs}) != len(costs):
        raise ValueError("plan_checkpointing: duplicate module names")
    if any(c.saved_bytes < 0 or c.input_bytes < 0 or c.recompute_cost < 0 for c in costs):
        raise ValueError("plan_checkpointing: negative bytes or cost")
    order = sorted((c for c in costs if c.gain > 0), key=lambda c: (c.recompute_cost / c.gain, c.name))
    chosen: list[str] = []
    peak = int(no_checkpoint_peak)
    for c in order:
        if peak <= budget_bytes:
            break
        chosen.append(c.name)
        peak = predicted_peak(costs, chosen, no_checkpoint_peak)
    return CheckpointPlan(tuple(chosen), peak, int(no_checkpoint_peak), int(budget_bytes), peak <= budget_bytes)


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


class _Probe:
    """Context manager measuring ModuleCost of each candidate during one forward (module docstring)."""

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
        self.time: dict[str, float] = {n: 0.0 for n in modules}
        self.seen: set[tuple[int, str]] = set()
        self.other = 0
        self._t0: dict[str, float] = {}
        self._handles: list = []
        self._hooks = None

    def _sync(self, m: nn.Module) -> None:
        p = next(m.parameters(), None)
        if p is not None and p.is_cuda:
            torch.cuda.synchronize(p.device)

    def __enter__(self):
        for name, m in self.modules.items():
            def pre(mod, args, kwargs, name=name):
                self._sync(mod)
                self.stack.append(name)
                self.inputs[name] += sum(_tensor_bytes(a) for a in list(args) + list(kwargs.values())
                                         if isinstance(a, torch.Tensor))
                self._t0[name] = time.perf_counter()

            def post(mod, args, kwargs, out, name=name):
                self._sync(mod)
                self.time[name] += time.perf_counter() - self._t0.pop(name)
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
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def costs(self) -> list[ModuleCost]:
        return [ModuleCost(n, self.saved[n], self.inputs[n], self.time[n]) for n in self.modules]


def apply_checkpointing(modules: dict[str, nn.Module], names) -> None:
    """Recompute ``names`` (keys of ``modules``) in the backward: their instance ``forward`` becomes
    ``checkpoint(original_forward, ..., use_reentrant=False)``. Idempotent per module."""
    for name in names:
        m = modules[name]
        if getattr(m, "_gemray_checkpointed", False):
            continue
        orig = m.forward

        def fwd(*args, _orig=orig, **kwargs):
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        m.forward = fwd
        m._gemray_checkpointed = True


def apply_torch_budget(model: nn.Module, fraction: float, backend: str = "inductor", *,
                       dynamic: str = "auto", optimize_ddp: bool | None = None) -> list[str]:
    """Mode "torch": set ``torch._functorch.config.activation_memory_budget`` and compile every HSTU block
    (torch.compile's min-cut partitioner then recomputes to that fraction) through
    ``gemray.parallel.compile.compile_dense_modules``, the one compile path (``train.compile`` shares it: a block
    compiled already is not compiled twice; ``dynamic`` / ``optimize_ddp`` as there). Returns the HSTU block
    names."""
    import torch._functorch.config as fconfig

    from gemray.model.hstu import HSTUBlock
    from gemray.parallel.compile import compile_dense_modules

    fconfig.activation_memory_budget = float(fraction)
    compile_dense_modules(model, backend=backend, tower=False, dynamic=dynamic, optimize_ddp=optimize_ddp,
                          reason="activation_checkpointing = 'torch'")
    return [n for n, m in model.named_modules() if isinstance(m, HSTUBlock)]


class ActivationCheckpointer:
    """The trainer's one handle: ``setup(model)`` after build applies "full" / "torch"; in "auto" the second
    ``step(model)`` context probes (no checkpointing; the first is a warm-up: kernel compilation) and its
    ``after_step`` plans and applies, then logs the measured peak of the next step beside the prediction.

    mode: one of MODES; budget: ``train.activation_memory_budget``; compile_backend / compile_dynamic /
    compile_optimize_ddp: ``train.compile_backend`` / ``compile_dynamic`` / ``compile_optimize_ddp`` (how mode
    "torch" compiles the blocks, as ``train.compile`` would)."""

    def __init__(self, mode: str = "none", budget: float = 0.0, compile_backend: str = "inductor",
                 compile_dynamic: str = "auto", compile_optimize_ddp: bool = False):
        if mode not in MODES:
            raise ValueError(f"activation_checkpointing: expected one of {MODES}, got {mode!r}")
        self.mode, self.budget, self.compile_backend = mode, float(budget), compile_backend
        self.compile_dynamic, self.compile_optimize_ddp = compile_dynamic, bool(compile_optimize_ddp)
        self.plan: CheckpointPlan | None = None
        self._probe: _Probe | None = None
        # the probe runs on the second step: the first one compiles the Triton kernels, its times mean nothing
        self._state = "warmup" if (mode == "auto" and budget > 0) else "done"
        self._modules: dict[str, nn.Module] = {}
        self._device: torch.device | None = None

    @classmethod
    def from_config(cls, train_cfg) -> "ActivationCheckpointer":
        return cls(train_cfg.activation_checkpointing, train_cfg.activation_memory_budget,
                   getattr(train_cfg, "compile_backend", "inductor"), getattr(train_cfg, "compile_dynamic", "auto"),
                   getattr(train_cfg, "compile_optimize_ddp", False))

    def setup(self, model: nn.Module) -> None:
        self._modules = candidate_modules(model)
        if self.mode == "full":
            apply_checkpointing(self._modules, list(self._modules))
            log.info("activation checkpointing: full, recomputing %d module(s)", len(self._modules))
        elif self.mode == "torch":
            names = apply_torch_budget(model, self.budget, self.compile_backend,
                                       dynamic=self.compile_dynamic,
                                       optimize_ddp=self.compile_optimize_ddp)
            log.info("activation checkpointing: torch.compile'd %d HSTU block(s) with activation_memory_budget "
                     "%.3g", len(names), self.budget)

    @contextlib.contextmanager
    def step(self, model: nn.Module, device: torch.device):
        """Wrap one training step (forward + backward)."""
        self._device = device
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
            costs = self._probe.costs()
            modelled = self._probe.other + sum(c.saved_bytes for c in costs)
            measured = torch.cuda.max_memory_allocated(dev) if dev is not None and dev.type == "cuda" else 0
            peak0 = measured or modelled
            budget = resolve_budget(self.budget, peak0)
            self.plan = plan_checkpointing(costs, budget, peak0)
            for c in costs:
                log.info("activation checkpointing probe: %s saves %.1f MiB (inputs %.1f MiB), forward %.2f ms",
                         c.name, c.saved_bytes / 2**20, c.input_bytes / 2**20, 1e3 * c.recompute_cost)
            log.info("activation checkpointing: auto, %s", self.plan.describe())
            apply_checkpointing(self._modules, self.plan.recompute)
            self._probe, self._state = None, "measure"
            return self.plan
        if self._state == "measure":
            if dev is not None and dev.type == "cuda" and self.plan is not None:
                log.info("activation checkpointing: measured peak %.2f GiB (predicted %.2f GiB)",
                         torch.cuda.max_memory_allocated(dev) / 2**30, self.plan.predicted_peak / 2**30)
            self._state = "done"
        return None
