"""Width-scaled learning rates for the dense weights (muP's rule for Adam).

Why: Adam moves every weight by about ``lr`` per step whatever its gradient's size, so a layer's output moves
by about ``lr x fan_in`` (the number of inputs each output sums). A learning rate tuned at width 128 is 8x too
large for the 1024-wide GEM blocks: on a CPU proxy of configs/gem-h200.toml (1 block, width 1024, 24 steps)
the click tower collapsed to a near-constant output at lr 1e-3 (test CTR AUC 0.490) and learned at
1e-3 x 128 / 1024 (AUC 0.581; benchmarks/reports/gem_h200_2026-12-04.md). Scaling only the wide matrices keeps
the embeddings' projections, the biases and the position / bias tables at the base rate.

Rule (Yang et al., "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer",
2022, Table 3, Adam's hidden and output weights): a weight matrix with fan-in ``K`` learns at
``lr x min(1, base_fan_in / K)``; every other parameter at ``lr``.

Which dimension is the fan-in is declared by the module that owns the weight: ``nn.Linear`` (and the FP8
subclass) its ``weight``'s dim 1; a module with custom weights lists them in a class attribute
``FAN_IN_DIMS = {"param_name": dim}`` (``HSTUBlock``: ``uvqk_weight`` [D, W] dim 0, ``o_weight`` [D, H*V]
dim 1; ``MoEFFN``: the batched experts' ``w1`` [E, D, Hd] / ``w2`` [E, Hd, O] dim 1). Parameters not declared
(biases, embedding / position tables, PMA seeds) are not scaled.
"""

from __future__ import annotations

from torch import nn


def parameter_fan_ins(model: nn.Module) -> dict[str, int]:
    """{parameter name as ``model.named_parameters()`` gives it: fan-in K} for every declared weight matrix
    (module docstring) of ``model``. Matched by identity, so wrappers that rename parameters (TorchRec's
    DistributedModelParallel strips its own prefixes from ``named_parameters`` but not from ``named_modules``,
    DDP, FSDP2) give the names their optimizer sees. Uses the parameters' global shapes (a DTensor's
    ``shape``), so sharding does not change it."""
    by_id: dict[int, int] = {}
    for mod in model.modules():
        dims = {"weight": 1} if isinstance(mod, nn.Linear) else getattr(type(mod), "FAN_IN_DIMS", {})
        for pname, dim in dims.items():
            p = mod._parameters.get(pname)
            if p is not None:
                by_id[id(p)] = int(p.shape[dim])
    return {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}


def lr_scales(fan_ins: dict[str, int], base_fan_in: int) -> dict[str, float]:
    """{name: lr multiplier} = ``min(1, base_fan_in / K)`` per weight of ``fan_ins`` (from
    :func:`parameter_fan_ins`); ``base_fan_in`` 0 = no scaling (every multiplier 1.0). Names absent here train
    at the base rate. Raises ValueError for base_fan_in < 0 or a fan-in < 1."""
    if base_fan_in < 0:
        raise ValueError(f"lr_scales: base_fan_in must be >= 0 (0 = off), got {base_fan_in}")
    bad = {n: k for n, k in fan_ins.items() if k < 1}
    if bad:
        raise ValueError(f"lr_scales: fan-in must be >= 1, got {bad}")
    if base_fan_in == 0:
        return {n: 1.0 for n in fan_ins}
    return {n: min(1.0, base_fan_in / k) for n, k in fan_ins.items()}


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear learning-rate warm-up: the multiplier of optimizer step ``step`` (0-based global step),
    ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then 1.0 (``warmup_steps`` 0: always 1).
    A function of the global step only, so a resumed run continues the schedule exactly.
    Raises ValueError for a negative step or warmup_steps."""
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"warmup_factor: step and warmup_steps must be >= 0, got {step}, {warmup_steps}")
    return 1.0 if step >= warmup_steps else (step + 1) / warmup_steps
