"""rlbus message bus: the only package that knows Redis.

Callers import what they use from here, never from its modules (tests/test_layering.py): ``from bus
import Bus, Consumer, Lease, RunKeys, BusError``. It re-exports the ``__all__`` of :mod:`bus.acl`,
:mod:`bus.errors`, :mod:`bus.keys`, :mod:`bus.liveness`, :mod:`bus.ranks`, :mod:`bus.refusals`,
:mod:`bus.retry`, :mod:`bus.streams` and :mod:`bus.urls`. Its other modules are its parts.

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
    from bus.acl import COMPONENT_USERS, acl_file, acl_rules
    from bus.entries import BadEntry, Entry, entry_key
    from bus.errors import (
        BlobCorrupt,
        BlobError,
        BlobNotFound,
        BusAuthError,
        BusCannotPersist,
        BusClusterError,
        BusError,
        BusOutOfMemory,
        BusPermissionError,
        BusRefusedWrite,
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
        server_refusal,
    )
    from bus.group_admin import GroupInfo
    from bus.groups import (
        EXCEEDED_REASON,
        TRIMMED_REASON,
        Consumer,
        ConsumerStats,
        Delivery,
        Then,
        ThenRead,
        default_dlq,
    )
    from bus.keys import (
        DLQ_MAXLEN,
        LOG_ROLES,
        ROLE_LOG_MAXLEN,
        RUNS_STREAM,
        RunKeys,
        dlq_dropped_key,
        log_order,
        validate_run_id,
    )
    from bus.liveness import FENCE_LUA, Lease, members_key, peers, pulse, pulse_forever
    from bus.ranks import (
        MAX_RANKS,
        RankClaim,
        RankHeld,
        RankLost,
        claim_lowest_rank,
        claim_rank,
        holder_pid_host,
        holder_token,
    )
    from bus.reach import PAUSE_S, REACH_GRACE_S, Reach, Stalls
    from bus.refusals import REFUSAL_LOG_S, Refusal, RefusalTally, refusal_kind
    from bus.retry import BUDGET_S, FIRST_CONTACT_S, RetryHook, RetryPolicy, retry_async
    from bus.streams import Bus
    from bus.urls import (
        CLUSTER_SCHEMES,
        as_cluster_url,
        bus_error_line,
        expand_env,
        local_address,
        redis_host,
        split_cluster,
    )

__all__ = [
    "BUDGET_S",
    "CLUSTER_SCHEMES",
    "COMPONENT_USERS",
    "DLQ_MAXLEN",
    "EXCEEDED_REASON",
    "FENCE_LUA",
    "FIRST_CONTACT_S",
    "LOG_ROLES",
    "MAX_RANKS",
    "PAUSE_S",
    "REACH_GRACE_S",
    "REFUSAL_LOG_S",
    "ROLE_LOG_MAXLEN",
    "RUNS_STREAM",
    "TRIMMED_REASON",
    "BadEntry",
    "BlobCorrupt",
    "BlobError",
    "BlobNotFound",
    "Bus",
    "BusAuthError",
    "BusCannotPersist",
    "BusClusterError",
    "BusError",
    "BusOutOfMemory",
    "BusPermissionError",
    "BusRefusedWrite",
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
    "RankClaim",
    "RankHeld",
    "RankLost",
    "Reach",
    "RedisBinaryNotFound",
    "RedisStartError",
    "Refusal",
    "RefusalTally",
    "RetryHook",
    "RetryPolicy",
    "RunKeys",
    "Stalls",
    "StreamGone",
    "Then",
    "ThenRead",
    "acl_file",
    "acl_rules",
    "as_cluster_url",
    "bus_error_line",
    "claim_lowest_rank",
    "claim_rank",
    "default_dlq",
    "dlq_dropped_key",
    "entry_key",
    "expand_env",
    "holder_pid_host",
    "holder_token",
    "local_address",
    "log_order",
    "members_key",
    "peers",
    "pulse",
    "pulse_forever",
    "redact_url",
    "redis_host",
    "refusal_kind",
    "retry_async",
    "server_refusal",
    "split_cluster",
    "validate_run_id",
]

# Each bus module and the names callers take from it; a name's first use imports its
# module, and only that one.
_MODULES: dict[str, tuple[str, ...]] = {
    "acl": ("COMPONENT_USERS", "acl_file", "acl_rules",),
    "entries": ("BadEntry", "Entry", "entry_key",),
    "errors": ("BlobCorrupt", "BlobError", "BlobNotFound", "BusAuthError", "BusCannotPersist",
               "BusClusterError", "BusError", "BusOutOfMemory", "BusPermissionError",
               "BusRefusedWrite", "BusUnavailable", "EntryGone", "Fenced",
               "GoneError", "GroupGone", "PortInUse", "RedisBinaryNotFound", "RedisStartError",
               "StreamGone", "redact_url", "server_refusal",),
    "group_admin": ("GroupInfo",),
    "groups": ("EXCEEDED_REASON", "TRIMMED_REASON", "Consumer", "ConsumerStats", "Delivery",
               "Then", "ThenRead", "default_dlq",),
    "keys": ("DLQ_MAXLEN", "LOG_ROLES", "ROLE_LOG_MAXLEN", "RUNS_STREAM", "RunKeys",
             "dlq_dropped_key", "log_order", "validate_run_id",),
    "liveness": ("FENCE_LUA", "Lease", "members_key", "peers", "pulse", "pulse_forever",),
    "ranks": ("MAX_RANKS", "RankClaim", "RankHeld", "RankLost", "claim_lowest_rank", "claim_rank",
              "holder_pid_host", "holder_token",),
    "refusals": ("REFUSAL_LOG_S", "Refusal", "RefusalTally", "refusal_kind",),
    "reach": ("PAUSE_S", "REACH_GRACE_S", "Reach", "Stalls",),
    "retry": ("BUDGET_S", "FIRST_CONTACT_S", "RetryHook", "RetryPolicy", "retry_async",),
    "streams": ("Bus",),
    "urls": ("CLUSTER_SCHEMES", "as_cluster_url", "bus_error_line", "expand_env", "local_address",
             "redis_host", "split_cluster",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bus.{module}"), name)
    globals()[name] = value  # found once, then a plain attribute
    return value
