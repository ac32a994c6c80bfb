"""Tuning knobs that count their changes, so that decisions cached from them can tell when they went stale.

The attention kernels' host side caches a launch plan per batch and call configuration
(``jagged_attention._fwd_plan``): the tiles, launch modes, work tables, grids and scalar arguments of every
launch, decided once instead of on every call (that Python work bounds short, heavy-tailed batches). The
plans are decided from module-level knobs (``TILES``, ``DS_STORE``, ``ws_attention.WS_FWD`` ...) that the
bench's sweeps, the device A/B scripts and the tests change at run time, in place (``TILES[reg][kind][128]
= cfg``) or by assigning the attribute (``monkeypatch.setattr(ja, "DS_STORE", {...})``, a stubbed kernel or
helper). ``track(module)`` makes both kinds of change bump :func:`version`, which the plans' cache key
holds: a plan made before any change is never used after it.

- every attribute assignment or deletion on a tracked module bumps the version; a plain ``dict`` assigned
  to an upper-case name becomes a :class:`Knobs` (nested dicts too);
- a :class:`Knobs` bumps the version on every in-place change (item assignment, ``update``, ``pop`` ...).

Assignments from inside the module's own functions (``global X; X = ...``) bypass ``__setattr__``; the
tracked modules make none.
"""

from __future__ import annotations

import sys
import types

_VERSION = [0]


def version() -> int:
    """The number of knob changes so far (a cache key part: equal versions, same knobs)."""
    return _VERSION[0]


def _bump() -> None:
    _VERSION[0] += 1


def _wrap(value):
    return Knobs(value) if type(value) is dict else value


class Knobs(dict):
    """A dict of tuning knobs whose in-place changes bump :func:`version` (nested plain dicts become Knobs)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        for k, v in dict(*args, **kwargs).items():
            dict.__setitem__(self, k, _wrap(v))

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, _wrap(value))
        _bump()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        _bump()

    def __ior__(self, other):
        self.update(other)
        return self

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            dict.__setitem__(self, k, _wrap(v))
        _bump()

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, *args):
        _bump()
        return dict.pop(self, *args)

    def popitem(self):
        _bump()
        return dict.popitem(self)

    def clear(self):
        dict.clear(self)
        _bump()


class _TrackedModule(types.ModuleType):
    def __setattr__(self, name, value):
        if name.isupper():
            value = _wrap(value)
        super().__setattr__(name, value)
        _bump()

    def __delattr__(self, name):
        super().__delattr__(name)
        _bump()


def track(module_name: str) -> None:
    """Track the module ``module_name`` (call at the end of its body): its upper-case dict globals become
    Knobs and every later attribute change bumps :func:`version`."""
    module = sys.modules[module_name]
    for name, value in list(vars(module).items()):
        if name.isupper() and type(value) is dict:
            vars(module)[name] = Knobs(value)
    module.__class__ = _TrackedModule
