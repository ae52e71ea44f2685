"""rlbus message bus: the only package that knows Redis.

Callers import what they use from here, never from its modules (tests/test_layering.py): ``from bus
import Bus, Consumer, Lease, RunKeys, BusError``. Its modules' public names are re-exported here.

Not here: the run's schema (:mod:`runschema`); the log read across the archive and the stream
(:mod:`runtime.history`); files, ``run.storage`` and the events archive (:mod:`storage`); weight
transports and blob stores (:mod:`weights`); the embedded redis-server (:mod:`rlbus.redis_server`);
the progress lines (:mod:`runtime.progress`).

Names load on first use (PEP 562 ``__getattr__``), each from its own module only: a command that
needs only the config and the errors (``rlbus up`` before it starts the components) does not pay
for redis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bus.entries import BadEntry, Entry, entry_key
    from bus.errors import (
        BlobCorrupt,
        BlobError,
        BlobNotFound,
        BusAuthError,
        BusClusterError,
        BusError,
        BusPermissionError,
        BusUnavailable,
        EntryGone,
        Fenced,
        GoneError,
        GroupGone,
        PortInUse,
        RedisBinaryNotFound,
        RedisStartError,
        StreamGone,
        redact_url,
    )
    from bus.group_admin import GroupInfo
    from bus.groups import (
        EXCEEDED_REASON,
        TRIMMED_REASON,
        Consumer,
        ConsumerStats,
        Delivery,
        default_dlq,
    )
    from bus.keys import (
        LOG_ROLES,
        ROLE_LOG_MAXLEN,
        RUNS_STREAM,
        RunKeys,
        log_order,
        validate_run_id,
    )
    from bus.liveness import Lease, peers, pulse, pulse_forever
    from bus.retry import BUDGET_S, FIRST_CONTACT_S, RetryPolicy, retry_async
    from bus.streams import Bus
    from bus.urls import bus_error_line, expand_env

__all__ = [
    "BUDGET_S",
    "EXCEEDED_REASON",
    "FIRST_CONTACT_S",
    "LOG_ROLES",
    "ROLE_LOG_MAXLEN",
    "RUNS_STREAM",
    "TRIMMED_REASON",
    "BadEntry",
    "BlobCorrupt",
    "BlobError",
    "BlobNotFound",
    "Bus",
    "BusAuthError",
    "BusClusterError",
    "BusError",
    "BusPermissionError",
    "BusUnavailable",
    "Consumer",
    "ConsumerStats",
    "Delivery",
    "Entry",
    "EntryGone",
    "Fenced",
    "GoneError",
    "GroupGone",
    "GroupInfo",
    "Lease",
    "PortInUse",
    "RedisBinaryNotFound",
    "RedisStartError",
    "RetryPolicy",
    "RunKeys",
    "StreamGone",
    "bus_error_line",
    "default_dlq",
    "entry_key",
    "expand_env",
    "log_order",
    "peers",
    "pulse",
    "pulse_forever",
    "redact_url",
    "retry_async",
    "validate_run_id",
]

# Each bus module and the names callers take from it; a name's first use imports its
# module, and only that one.
_MODULES: dict[str, tuple[str, ...]] = {
    "entries": ("BadEntry", "Entry", "entry_key",),
    "errors": ("BlobCorrupt", "BlobError", "BlobNotFound", "BusAuthError", "BusClusterError",
               "BusError", "BusPermissionError", "BusUnavailable", "EntryGone", "Fenced",
               "GoneError", "GroupGone", "PortInUse", "RedisBinaryNotFound", "RedisStartError",
               "StreamGone", "redact_url",),
    "group_admin": ("GroupInfo",),
    "groups": ("EXCEEDED_REASON", "TRIMMED_REASON", "Consumer", "ConsumerStats", "Delivery",
               "default_dlq",),
    "keys": ("LOG_ROLES", "ROLE_LOG_MAXLEN", "RUNS_STREAM", "RunKeys", "log_order",
             "validate_run_id",),
    "liveness": ("Lease", "peers", "pulse", "pulse_forever",),
    "retry": ("BUDGET_S", "FIRST_CONTACT_S", "RetryPolicy", "retry_async",),
    "streams": ("Bus",),
    "urls": ("bus_error_line", "expand_env",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bus.{module}"), name)
    globals()[name] = value  # found once, then a plain attribute
    return value
