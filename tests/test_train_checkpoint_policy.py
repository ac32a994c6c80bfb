"""gemray.train.CheckpointPolicy: when the trainer checkpoints (pure, no process group)."""

import pytest

from gemray.config import load_config
from gemray.train import CheckpointPolicy


def test_every_steps_inside_an_epoch():
    policy = CheckpointPolicy(every_steps=3, every_epochs=1, epochs=5)
    assert [policy.reason(g, epoch_end=False) for g in range(1, 8)] == [None, None, "periodic", None, None,
                                                                         "periodic", None]
    off = CheckpointPolicy(every_steps=0, every_epochs=1, epochs=5)
    assert [off.reason(g, epoch_end=False) for g in range(1, 10)] == [None] * 9  # 0 = off


def test_emergency_wins_inside_an_epoch():
    policy = CheckpointPolicy(every_steps=3, every_epochs=1, epochs=5)
    assert policy.reason(1, epoch_end=False, preempt=True) == "emergency"
    assert policy.reason(3, epoch_end=False, preempt=True) == "emergency"  # not "periodic"
    # inside an epoch the epoch count does not matter (epochs_done is the count completed so far)
    assert policy.reason(2, epoch_end=False, epochs_done=5) is None


def test_epoch_ends():
    policy = CheckpointPolicy(every_steps=5, every_epochs=2, epochs=3)
    assert policy.reason(20, epoch_end=True, epochs_done=2) == "epoch"
    assert policy.reason(30, epoch_end=True, epochs_done=3) == "final"  # the last epoch, though 3 % 2 != 0
    # an epoch end that is not an "epoch" one still takes the periodic checkpoint of its step
    assert policy.reason(10, epoch_end=True, epochs_done=1) == "periodic"
    assert policy.reason(11, epoch_end=True, epochs_done=1) is None
    assert CheckpointPolicy(every_steps=0, every_epochs=2, epochs=3).reason(10, epoch_end=True, epochs_done=1) is None
    # "final" and "epoch" come before an emergency (nothing is lost: the epoch's checkpoint is taken anyway)
    assert policy.reason(20, epoch_end=True, epochs_done=2, preempt=True) == "epoch"
    assert policy.reason(11, epoch_end=True, epochs_done=1, preempt=True) == "emergency"


def test_from_config_and_bad_values():
    cfg = load_config(None, ["checkpoint.every_steps=7", "checkpoint.every_epochs=2", "train.epochs=4"])
    assert CheckpointPolicy.from_config(cfg) == CheckpointPolicy(7, 2, 4)
    for kw, field in ((dict(every_steps=-1), "checkpoint.every_steps"), (dict(every_steps=1, every_epochs=0),
                      "checkpoint.every_epochs"), (dict(every_steps=1, epochs=-1), "train.epochs")):
        with pytest.raises(ValueError, match=field):
            CheckpointPolicy(**kw)
