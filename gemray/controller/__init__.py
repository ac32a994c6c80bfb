"""Driver side: ``fit`` (Ray Train job) and its ``Result``.

Imported lazily (PEP 562 ``__getattr__``): ``gemray.controller.submit``'s argument parser, which
``gemray --help`` builds, must not pull in torch and ray through :mod:`gemray.controller.run`.
"""

__all__ = ["Result", "fit"]


def __getattr__(name: str):
    if name in __all__:
        from gemray.controller import run

        return getattr(run, name)
    raise AttributeError(f"module 'gemray.controller' has no attribute {name!r}")
