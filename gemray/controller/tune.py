"""Hyper-parameter search: Ray Tune over ``gemray.fit``, each trial a Ray Train run of its own.

Ray Tune's pattern for Ray Train V2 ("Hyperparameter tuning with Ray Tune", Ray Train docs): a Tune trial is a
small driver function that launches a whole ``TorchTrainer`` run and reports its final metrics with
``ray.tune.report``. Here that function is :func:`run_trial`: the trial's parameters become ``--set``
overrides (``{"train.lr": 1e-3}`` -> ``train.lr=0.001``, :func:`trial_overrides`) on the base config, and
``gemray.fit`` trains into ``<output>/trials/<trial name>`` (its own metrics.json, checkpoints, events), so a
trial is exactly the run ``gemray train --set ...`` would make, elastic recovery included.

    from ray import tune
    from gemray.controller.tune import tune_fit
    grid = tune_fit("configs/ml-1m.toml", {"train.lr": tune.loguniform(1e-4, 3e-3),
                                           "model.dropout": tune.choice([0.1, 0.2])},
                    metric="ndcg@10", mode="max", num_samples=8, output_dir="runs/tune-ml1m")
    print(grid.get_best_result().config, grid.get_best_result().metrics["ndcg@10"])

Trials share the cluster: each trial's driver holds ``trial_cpus`` (a fraction: it only waits on its run) and
its Ray Train workers hold what ``[ray]`` asks; ``max_concurrent_trials`` bounds how many run at once. The
metric is read from the run's final (test-split) metrics; a search algorithm or scheduler of Ray Tune's
(``search_alg``, ``scheduler``) plugs in unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gemray.config import JobConfig, check_overrides, load_config
from gemray.controller import session

log = logging.getLogger(__name__)


def trial_overrides(params: dict[str, Any]) -> list[str]:
    """Pure: a trial's parameters ``{"section.key": value}`` as ``section.key=value`` overrides (lists as
    comma-separated values, booleans lower case). Raises ValueError for a key that is not ``section.key``."""
    out = []
    for key, value in sorted(params.items()):
        if key.count(".") != 1:
            raise ValueError(f"tune: parameter {key!r} must name a config key as section.key (e.g. train.lr)")
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        out.append(f"{key}={text}")
    return out


def reportable(metrics: dict[str, Any]) -> dict[str, float]:
    """Pure: the scalar numbers of a run's final metrics (what Tune compares and shows)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_trial(params: dict[str, Any], *, config: dict[str, Any], output_root: str,
              overrides: list[str]) -> None:
    """One Tune trial (runs in the trial's process): ``gemray.fit`` of the base ``config`` (a
    ``JobConfig.to_dict()``) with ``overrides`` then the trial's parameters, into
    ``<output_root>/trials/<trial name>``; reports the run's final scalar metrics and its ``output_dir``."""
    import ray.tune

    from gemray.config import from_dict
    from gemray.controller.run import fit

    ctx = ray.tune.get_context()
    name = ctx.get_trial_name() or ctx.get_trial_id()
    cfg = from_dict(config)
    cfg.name = f"{cfg.name}-{ctx.get_trial_id()}"
    res = fit(cfg, output_dir=Path(output_root) / "trials" / name, overrides=list(overrides) + trial_overrides(params))
    ray.tune.report({**reportable(res.metrics), "output_dir": res.output_dir})


def tune_fit(config: JobConfig | str | Path, param_space: dict[str, Any], *, metric: str = "ndcg@10",
             mode: str = "max", num_samples: int = 1, output_dir: str | Path = "runs/tune",
             overrides: list[str] | str | None = None, max_concurrent_trials: int = 1, trial_cpus: float = 0.1,
             search_alg: Any = None, scheduler: Any = None):
    """Search ``param_space`` (``{"section.key": value or a ray.tune search space}``) over ``gemray.fit``.

    config: a JobConfig or TOML path (``overrides``: ``section.key=value`` strings, or one such string, applied
    first, as ``--set``); metric / mode: what the best trial maximises or minimises, a key of metrics.json (e.g.
    "ndcg@10", "hr@10"); num_samples: trials per grid point (Ray Tune's ``num_samples``); output_dir:
    ``trials/<trial>`` run folders and Tune's own record (``tune/``); max_concurrent_trials / trial_cpus: see the
    module docstring; search_alg / scheduler: Ray Tune's, optional. Connects to the configured Ray cluster or starts an embedded one for the search.

    Returns Ray Tune's ``ResultGrid`` (``get_best_result(metric, mode)``: the trial's ``config`` and
    ``metrics``, with ``output_dir`` its run folder). Raises ValueError for a bad parameter key, config or mode,
    TypeError for ``overrides`` that are not strings (:func:`gemray.config.check_overrides`), before Ray starts.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"tune: mode must be 'max' or 'min', got {mode!r}")
    # one string -> [it] (not its characters); not strings (overrides=5, [1]): TypeError naming the element,
    # before Ray is imported
    overrides = check_overrides(overrides)
    import ray.tune

    if isinstance(config, JobConfig):
        from gemray.config import apply_overrides
        import copy

        cfg = apply_overrides(copy.deepcopy(config), overrides)
    else:
        cfg = load_config(Path(config), overrides)
    for key in param_space:
        trial_overrides({key: 0})  # bad keys fail here, before any trial starts
    from gemray.controller.run import _resolve

    cfg = _resolve(cfg)  # data paths absolute: trials run in Ray's folders
    out = Path(output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    trainable = ray.tune.with_parameters(run_trial, config=cfg.to_dict(), output_root=str(out), overrides=[])
    trainable = ray.tune.with_resources(trainable, {"CPU": trial_cpus})
    tuner = ray.tune.Tuner(
        trainable, param_space=dict(param_space),
        tune_config=ray.tune.TuneConfig(metric=metric, mode=mode, num_samples=num_samples,
                                        max_concurrent_trials=max_concurrent_trials, search_alg=search_alg,
                                        scheduler=scheduler),
        run_config=ray.tune.RunConfig(name="tune", storage_path=str(out), verbose=0))
    with session.ray_session(cfg), session.train_env(cfg):
        grid = tuner.fit()
    return grid
