"""Small model configs and random jagged batches shared by the model tests."""

from __future__ import annotations

import contextlib

import torch

from gemray.config import ModelConfig
from gemray.jagged import JaggedBatch, lengths_to_offsets


def tiny_cfg(**kw):
    base = dict(embedding_dim=16, num_blocks=2, num_heads=2, attention_dim=4, linear_dim=4, dropout=0.0,
                num_negatives=8, temperature=0.1, num_time_buckets=32, num_position_buckets=16)
    base.update(kw)
    return ModelConfig(**base)


def random_batch(lengths, num_items=40, seed=0, targets=False):
    g = torch.Generator().manual_seed(seed)
    offsets = lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    T = int(offsets[-1])
    return JaggedBatch(
        user_ids=torch.arange(len(lengths)), offsets=offsets,
        item_ids=torch.randint(1, num_items + 1, (T,), generator=g),
        ratings=torch.randint(1, 11, (T,), generator=g),
        timestamps=torch.cumsum(torch.randint(0, 10 ** 5, (T,), generator=g), 0),
        targets=torch.randint(1, num_items + 1, (len(lengths),), generator=g) if targets else None,
    ).validate()


@contextlib.contextmanager
def cpu_trainer(cfg):
    """A ``Trainer`` for ``cfg`` set up, built and restored (no checkpoint) on the CPU at world size 1, inside a
    gloo process group made for it when none exists (destroyed on exit)."""
    import torch.distributed as dist

    from gemray.bench.train import _init_process_group
    from gemray.train.trainer import Trainer

    device = torch.device("cpu")
    made = _init_process_group(device)
    tr = None
    try:
        tr = Trainer(cfg)
        tr.setup(context=(0, 1, device))
        tr.build()
        tr.restore(from_ray=False)
        yield tr
    finally:
        if tr is not None and tr.gc is not None:
            tr.gc.close()  # automatic garbage collection back (train.gc_every_steps): module fixtures use it too
        if made:
            dist.destroy_process_group()
