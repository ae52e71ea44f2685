"""The runtime every component process runs on.

* :class:`Component` (:mod:`runtime.component`): one object owns a process's life on the bus:
  set-up, the liveness pulse, profiling commands, graceful then forced stop, teardown.
* :class:`Follower` (:mod:`runtime.follower`): reads the run's events log, archive then
  stream, each entry once, from a tracking position.
* :func:`main` (:mod:`runtime.process`): the entry point of ``rlbus ROLE`` and
  ``python -m ROLE``: config checks, garbage collector, logging, Redis, progress lines, signals.

Components import this package and ``bus``, never each other. Names load on first use, so a
process whose config is invalid exits before the Redis client is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.component import Component, Failure, Restart, settle_heap
    from runtime.follower import Follower, LogFollower, since
    from runtime.process import main

__all__ = ["Component", "Failure", "Follower", "LogFollower", "Restart", "main", "settle_heap",
           "since"]

_HOME = {"Component": "component", "Failure": "component", "Restart": "component",
         "settle_heap": "component",
         "Follower": "follower", "LogFollower": "follower", "main": "process",
         "since": "follower"}


def __getattr__(name: str) -> object:
    if name in _HOME:
        value = getattr(importlib.import_module(f"runtime.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
