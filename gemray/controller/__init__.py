"""Driver side: ``fit`` (Ray Train job) and its ``Result``."""

from gemray.controller.run import Result, fit

__all__ = ["Result", "fit"]
