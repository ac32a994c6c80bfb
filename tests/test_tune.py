"""Ray Tune over gemray.fit: a 2-trial grid on ml-latest-small (1 worker, 2 steps), each trial a Ray Train run
with its own run folder and metrics.json; the best trial is the one with the best reported metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import DATA

from gemray.controller.tune import reportable, trial_overrides

REPO = Path(__file__).resolve().parents[1]
SRC = DATA / "ml-latest-small"


def test_trial_overrides_are_set_strings():
    assert trial_overrides({"train.lr": 0.001, "model.dropout": 0.2, "data.bbs": False,
                            "train.eval_ks": [10, 50]}) == ["data.bbs=false", "model.dropout=0.2",
                                                             "train.eval_ks=10,50", "train.lr=0.001"]
    with pytest.raises(ValueError, match="section.key"):
        trial_overrides({"lr": 0.1})
    assert reportable({"hr@10": 0.5, "epochs": 2, "final": True, "history": []}) == {"hr@10": 0.5, "epochs": 2.0}


@pytest.mark.slow  # two Ray Tune trials (~1 min): make test-slow; make test: the trial overrides above, the train loop elsewhere
def test_two_trial_grid(tmp_path):
    if not SRC.is_dir():
        pytest.skip(f"{SRC} not available")
    from ray import tune

    from gemray.controller.tune import tune_fit

    grid = tune_fit(REPO / "configs" / "ml-latest-small.toml", {"train.lr": tune.grid_search([1e-3, 3e-3])},
                    metric="ndcg@10", mode="max", output_dir=tmp_path / "search", max_concurrent_trials=2,
                    overrides=[f"data.raw_dir={SRC}", f"data.prepared_dir={tmp_path / 'prepared'}", "train.epochs=1",
                               "train.max_steps_per_epoch=2", "ray.num_workers=1", "ray.max_failures=0",
                               "train.eval_ks=10"])
    assert len(grid) == 2 and not grid.errors
    results = list(grid)
    lrs = sorted(r.config["train.lr"] for r in results)
    assert lrs == [1e-3, 3e-3]
    for r in results:
        out = Path(r.metrics["output_dir"])
        assert out.parent == (tmp_path / "search" / "trials").resolve()
        m = json.loads((out / "metrics.json").read_text())
        assert m["ndcg@10"] == r.metrics["ndcg@10"] and m["epochs"] == 1 and m["world_size"] == 1
        from gemray.config import load_config

        assert load_config(out / "config.toml").train.lr == r.config["train.lr"]
    best = grid.get_best_result()
    assert best.metrics["ndcg@10"] == max(r.metrics["ndcg@10"] for r in results)


@pytest.mark.parametrize("overrides, error, needle", [
    (5, TypeError, "overrides: 5 (int) is not a list of strings; each override is a 'section.key=value' string"),
    ([1], TypeError, "overrides[0]: 1 (int) is not a string"),
    # one string is one override, not its characters (was: "--set 't': expected section.key=value")
    ("train.epochs=nope", ValueError, "train.epochs: expected int, got 'nope'"),
])
def test_tune_fit_checks_overrides_up_front(overrides, error, needle):
    """``tune_fit(..., overrides="train.epochs=3")`` split the string into characters and ``overrides=5`` raised a
    bare "'int' object is not iterable": both now go through ``check_overrides`` as ``gemray.fit`` does, before
    Ray Tune starts."""
    from gemray.config import JobConfig
    from gemray.controller.tune import tune_fit

    with pytest.raises(error) as e:
        tune_fit(JobConfig(), {"train.lr": 1e-3}, overrides=overrides)
    assert needle in str(e.value), str(e.value)
    assert "--set 't'" not in str(e.value)


def test_tune_fit_takes_one_override_string():
    """A single ``section.key=value`` string is applied as one override: the search gets as far as checking its
    parameter keys (a bad one fails there, before any trial starts)."""
    from gemray.config import JobConfig
    from gemray.controller.tune import tune_fit

    with pytest.raises(ValueError, match=r"tune: parameter 'lr' must name a config key as section.key"):
        tune_fit(JobConfig(), {"lr": 1e-3}, overrides="train.epochs=3")
