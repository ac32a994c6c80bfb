"""gemray: Ray-orchestrated, elastic training of GEM-style generative recommenders.

Python entry points (imported lazily so that ``import gemray`` stays light):
    gemray.fit(config) -> Result        train on the current or an embedded Ray cluster
    gemray.submit(config, address=...) -> JobHandle   submit as a Ray job (status/logs/wait/result)
    gemray.load_config(path, overrides) -> JobConfig
"""

from gemray.config import JobConfig, load_config

__all__ = ["JobConfig", "load_config", "fit", "submit"]


def _version() -> str:
    """The installed distribution's version (pyproject.toml's [project] version, via importlib.metadata);
    "0+unknown" when gemray runs from a checkout that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gemray")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()


def fit(config, **kwargs):
    """Train ``config`` (a JobConfig or a TOML path) with Ray Train; see gemray.controller.run.fit."""
    from gemray.controller.run import fit as _fit

    return _fit(config, **kwargs)


def submit(config, address=None, **kwargs):
    """Submit ``config`` (a JobConfig or a TOML path) as a Ray job to the cluster at ``address``
    (``http://host:8265``); returns a JobHandle. See gemray.controller.submit.submit."""
    from gemray.controller.submit import submit as _submit

    return _submit(config, address, **kwargs)
