"""gemray: Ray-orchestrated, elastic training of GEM-style generative recommenders.

Python entry points (imported lazily so that ``import gemray`` stays light):
    gemray.fit(config) -> Result        train on the current or an embedded Ray cluster
    gemray.load_config(path, overrides) -> JobConfig
"""

from gemray.config import JobConfig, load_config

__all__ = ["JobConfig", "load_config", "fit"]
__version__ = "0.1.0"


def fit(config, **kwargs):
    """Train ``config`` (a JobConfig or a TOML path) with Ray Train; see gemray.controller.run.fit."""
    from gemray.controller.run import fit as _fit

    return _fit(config, **kwargs)
