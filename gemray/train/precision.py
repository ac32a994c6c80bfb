"""Training precision: the one place ``train.precision`` turns into an autocast context.

    with autocast(cfg.train.precision, device):   # around the model's forward (training and evaluation)
        loss, stats = model(batch)

"fp32": nothing changes (``contextlib.nullcontext``; the ML-1M baselines are bit-identical to a run without
it). "bf16": ``torch.autocast(device.type, dtype=torch.bfloat16)`` (CUDA and CPU): the dense GEMMs and the
attention inputs run in bfloat16, the master weights and the optimizer state stay float32 (autocast casts
copies per op; no GradScaler is needed for bf16), the embedding tables stay as TorchRec / FBGEMM hold them
(their lookups are not autocast ops) and the losses reduce in float32 (autocast's fp32 ops: log_softmax,
logsumexp, BCE-with-logits, layer_norm). The backward runs outside the context, as autocast requires.

"fp8": bf16 autocast as well; its FP8 GEMMs are the modules ``gemray.model.fp8.convert_to_fp8`` swapped in
before parallelize. A new mode is one more branch of :func:`autocast` and one more entry of
``gemray.config.TrainConfig.PRECISIONS`` (what the config accepts).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from gemray.config import TrainConfig

PRECISIONS = TrainConfig.PRECISIONS


def autocast(precision: str, device: torch.device | str) -> ContextManager:
    """The context for the forward pass under ``precision`` (one of ``PRECISIONS``) on ``device``.

    Raises ValueError for an unknown precision (``train.precision`` is validated by the config first).
    """
    dev = torch.device(device)
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision in ("bf16", "fp8"):  # fp8: its GEMMs are the converted modules' (gemray.model.fp8)
        return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    raise ValueError(f"train.precision: expected one of {PRECISIONS}, got {precision!r}")
