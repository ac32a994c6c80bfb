"""Training throughput in model FLOPs: the per-step FLOP count of a real batch, the device's peak, MFU, and the
scaling fields of a multi-GPU run.

Definitions (issue 17; NVIDIA recsys-examples' convention, :mod:`gemray.model.flops`):

* model FLOPs of a step: ``gemray.model.flops.step_flops(cfg.model, lengths, candidate_lengths)["total"]`` on
  the rank's real jagged lengths (from the batch's offsets: host arithmetic, no device work);
* model TFLOP/s: FLOPs / wall seconds / 1e12, where the wall seconds of a step run from the end of the previous
  step to the end of this one (so the data loader's time is inside: an end-to-end figure);
* local MFU: a rank's model FLOP/s / the dense bf16 peak of its device (:data:`PEAK_BF16_DENSE_BY_DEVICE`,
  keyed by the device name); ``None`` on a device without an entry (CPU: TFLOP/s are still reported);
* scaling ratio at world size W: the per-GPU tokens/s at W / the tokens/s of a single-GPU reference run of the
  same per-GPU batch (1.0 at W = 1; ``None`` at W > 1 without a reference);
* E2E MFU = local MFU x scaling ratio (the GEM paper's decomposition): the local MFU of the single-GPU
  reference times the ratio (at W = 1 the run is its own reference); ``None`` when either is unknown.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from gemray.config import ModelConfig
from gemray.model.flops import step_flops

#: Dense bf16 tensor-core peak (FLOP/s, no sparsity) by a substring of ``torch.cuda.get_device_name()``,
#: checked in this order (NVIDIA datasheets: H100 / H200 SXM 989.4 TF/s; H100 PCIe 756; A100 312; L40S 362).
PEAK_BF16_DENSE_BY_DEVICE: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device by its name (``torch.cuda.get_device_name()``), or None for a
    name without an entry (CPU, unknown GPUs): MFU is then not reported."""
    for key, peak in PEAK_BF16_DENSE_BY_DEVICE:
        if key.lower() in device_name.lower():
            return peak
    return None


def device_peak_flops(device: torch.device | str) -> tuple[str, float | None]:
    """(device name, dense bf16 peak FLOP/s or None) of ``device``; CPU: ("cpu", None)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    return name, peak_flops_for(name)


def batch_flops(model_cfg: ModelConfig, batch: Any) -> float:
    """Model FLOPs of one training step (forward + backward) on ``batch`` (a ``JaggedBatch``: ``lengths`` [B]
    from its offsets, ``candidate_offsets`` [B+1] when the model has ranking tasks). 0 for an empty batch."""
    if batch.batch_size == 0:
        return 0.0
    cand = None
    if model_cfg.ranking_tasks and batch.candidate_offsets is not None:
        co = batch.candidate_offsets.detach().cpu()
        cand = co[1:] - co[:-1]
    return float(step_flops(model_cfg, batch.offsets.detach().cpu().diff(), cand)["total"])


def mfu_or_none(flops: float, seconds: float, peak: float | None) -> float | None:
    """flops / seconds / peak, or None without a peak or without time."""
    if peak is None or not seconds > 0:
        return None
    return float(flops) / float(seconds) / float(peak)


class StepClock:
    """Wall seconds of each training step, measured end to end: from the end of the previous step (or
    :meth:`start`) to the end of this one, so the wait for the batch is inside. No device synchronisation: on
    CUDA the host may run ahead of the device (the loss is read every ``train.log_every`` steps, ``Trainer``),
    bounded by those reads and the launch queue; the sums over many steps are exact to within that lag, a
    single step's lap is not (``gemray bench train`` synchronises per step for its per-step figures)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def start(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or start), then start the next one."""
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def scaling_fields(*, world_size: int, tokens_per_s: float, local_mfu: float | None,
                   reference: dict[str, Any] | None = None) -> dict[str, float | None]:
    """Pure: ``scaling_ratio`` and ``e2e_mfu`` of a run (module docstring).

    tokens_per_s: the run's global tokens/s; local_mfu: its local MFU (None on CPU); reference: a single-GPU
    run's figures ({"tokens_per_s": float, "local_mfu": float | None}, e.g. its metrics.json or bench JSON),
    or None. World size 1 is its own reference (ratio 1.0) unless one is given.
    Raises ValueError for world_size < 1 or a reference without a positive tokens_per_s.
    """
    if world_size < 1:
        raise ValueError(f"scaling_fields: world_size must be >= 1, got {world_size}")
    if reference is None:
        if world_size == 1:
            return {"scaling_ratio": 1.0, "e2e_mfu": local_mfu}
        return {"scaling_ratio": None, "e2e_mfu": None}
    ref_tps = reference.get("tokens_per_s")
    if not isinstance(ref_tps, (int, float)) or not ref_tps > 0 or not math.isfinite(ref_tps):
        raise ValueError(f"scaling reference: expected a positive tokens_per_s, got {ref_tps!r}")
    ratio = float(tokens_per_s) / world_size / float(ref_tps)
    ref_mfu = reference.get("local_mfu")
    return {"scaling_ratio": ratio, "e2e_mfu": None if ref_mfu is None else float(ref_mfu) * ratio}


__all__ = ["PEAK_BF16_DENSE_BY_DEVICE", "StepClock", "batch_flops", "device_peak_flops", "mfu_or_none",
           "peak_flops_for", "scaling_fields"]
