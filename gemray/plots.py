"""Training curves: train loss and validation HR@10 per epoch (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(history: list[dict[str, Any]], path: str | Path, *, hr_key: str = "valid_hr@10") -> Path:
    """Write a two-panel PNG: ``train_loss`` vs epoch and ``hr_key`` vs epoch (eval epochs only).

    history: per-epoch dicts as reported by ``gemray.train`` (keys ``epoch``, ``train_loss``,
    optionally ``valid_hr@10``). Returns the path. Raises ValueError for an empty history.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("plot_curves: empty history (no epoch was reported)")
    path = Path(path)
    ep = [h["epoch"] for h in history]
    loss = [h.get("train_loss", float("nan")) for h in history]
    ev = [(h["epoch"], h[hr_key]) for h in history if hr_key in h]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(ep, loss, marker="o")
    a.set_xlabel("epoch")
    a.set_ylabel("train loss (sampled softmax)")
    a.grid(alpha=0.3)
    if ev:
        b.plot([e for e, _ in ev], [v for _, v in ev], marker="o", color="tab:green")
    b.set_xlabel("epoch")
    b.set_ylabel(hr_key.replace("_", " ").upper())
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
