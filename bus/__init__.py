"""rlbus message bus: the only package that knows Redis.

Everything public is re-exported here: message schemas (:mod:`bus.messages`), stream keys
(:mod:`bus.keys`), streams and consumer groups (:mod:`bus.streams`, composed of
:mod:`bus.client`, :mod:`bus.publish`, :mod:`bus.logs`, :mod:`bus.groups`, :mod:`bus.trim`,
:mod:`bus.barrier`, :mod:`bus.keyspace`), blob stores (:mod:`bus.blobs`), the embedded
redis-server (:mod:`bus.server`), retry policy (:mod:`bus.retry`), atomic file writes
(:mod:`bus.files`) and errors (:mod:`bus.errors`). See each module's docstring for the API.

Names load on first use (PEP 562 ``__getattr__``): a command that needs only the config
and the embedded server (``rlbus up`` before it starts the components) does not pay for
redis and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bus.blobs import (
        DEFAULT_CHUNK_SIZE,
        BlobStore,
        DirBlobStore,
        RedisBlobStore,
        open_store,
    )
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
    from bus.files import atomic_file, atomic_write, fsync_path
    from bus.keys import (
        LOG_ROLES,
        ROLE_LOG_MAXLEN,
        RUNS_STREAM,
        RunKeys,
        log_order,
        validate_run_id,
    )
    from bus.liveness import Lease, peers, pulse, pulse_forever
    from bus.messages import (
        FIELD,
        SCHEMA_VERSION,
        Array,
        BlobRef,
        CheckpointSaved,
        Command,
        ComponentFailed,
        DeadLetter,
        DecodeError,
        Event,
        Heartbeat,
        Message,
        ProfileRequest,
        ProfileRequestRefused,
        ProfilerFinished,
        ProfilerReady,
        ProfileStarted,
        ProfileStopped,
        PromptTicket,
        RolloutFailed,
        RunFinished,
        RunStarted,
        Sample,
        StartProfile,
        StepFinished,
        StepStarted,
        StopProfile,
        TicketsClosed,
        TicketsIssued,
        TrainerResumed,
        ValidationFinished,
        ValidationRequested,
        WarningRaised,
        WeightsPublished,
        decode,
        encode,
    )
    from bus.redisbin import (
        BINARY_ENV,
        ensure_port_free,
        find_redis_server,
        free_port,
        redis_server_version,
    )
    from bus.retry import (
        BUDGET_S,
        FIRST_CONTACT_S,
        RetryPolicy,
        retry_async,
    )
    from bus.serve import serve_forever
    from bus.server import (
        AOF_BLOAT,
        AOF_MIN_REWRITE_BYTES,
        LOCK_NAME,
        DirOwner,
        EmbeddedRedis,
        RedisDirInUse,
        RedisStartCancelled,
        dir_owner,
        pdeathsig_hook,
    )
    from bus.streams import (
        EXCEEDED_REASON,
        TRIMMED_REASON,
        BadEntry,
        Bus,
        Consumer,
        ConsumerStats,
        Delivery,
        Entry,
        GroupInfo,
        default_dlq,
        entry_key,
    )
    from bus.urls import bus_error_line, expand_env

__all__ = [
    "AOF_BLOAT",
    "AOF_MIN_REWRITE_BYTES",
    "BINARY_ENV",
    "BUDGET_S",
    "DEFAULT_CHUNK_SIZE",
    "EXCEEDED_REASON",
    "FIELD",
    "FIRST_CONTACT_S",
    "LOCK_NAME",
    "LOG_ROLES",
    "ROLE_LOG_MAXLEN",
    "RUNS_STREAM",
    "SCHEMA_VERSION",
    "TRIMMED_REASON",
    "Array",
    "BadEntry",
    "BlobCorrupt",
    "BlobError",
    "BlobNotFound",
    "BlobRef",
    "BlobStore",
    "Bus",
    "BusAuthError",
    "BusClusterError",
    "BusError",
    "BusPermissionError",
    "BusUnavailable",
    "CheckpointSaved",
    "Command",
    "ComponentFailed",
    "Consumer",
    "ConsumerStats",
    "DeadLetter",
    "DecodeError",
    "Delivery",
    "DirBlobStore",
    "DirOwner",
    "EmbeddedRedis",
    "Entry",
    "EntryGone",
    "Event",
    "Fenced",
    "GoneError",
    "GroupGone",
    "GroupInfo",
    "Heartbeat",
    "Lease",
    "Message",
    "PortInUse",
    "ProfileRequest",
    "ProfileRequestRefused",
    "ProfileStarted",
    "ProfileStopped",
    "ProfilerFinished",
    "ProfilerReady",
    "PromptTicket",
    "RedisBinaryNotFound",
    "RedisBlobStore",
    "RedisDirInUse",
    "RedisStartCancelled",
    "RedisStartError",
    "RetryPolicy",
    "RolloutFailed",
    "RunFinished",
    "RunKeys",
    "RunStarted",
    "Sample",
    "StartProfile",
    "StepFinished",
    "StepStarted",
    "StopProfile",
    "StreamGone",
    "TicketsClosed",
    "TicketsIssued",
    "TrainerResumed",
    "ValidationFinished",
    "ValidationRequested",
    "WarningRaised",
    "WeightsPublished",
    "atomic_file",
    "atomic_write",
    "bus_error_line",
    "decode",
    "default_dlq",
    "dir_owner",
    "encode",
    "ensure_port_free",
    "entry_key",
    "expand_env",
    "find_redis_server",
    "free_port",
    "fsync_path",
    "log_order",
    "open_store",
    "pdeathsig_hook",
    "peers",
    "pulse",
    "pulse_forever",
    "redact_url",
    "redis_server_version",
    "retry_async",
    "serve_forever",
    "validate_run_id",
]

# Submodules searched for a public name, the cheap ones first.
_MODULES = ("errors", "keys", "retry", "files", "redisbin", "server", "serve", "urls",
            "messages", "entries", "client", "publish", "logs", "groups", "trim", "barrier",
            "keyspace", "streams", "blobs", "liveness")


def __getattr__(name: str) -> object:
    if name in __all__:
        for sub in _MODULES:
            module = importlib.import_module(f"bus.{sub}")
            if name in module.__all__:
                value = getattr(module, name)
                globals()[name] = value  # found once, then a plain attribute
                return value
    raise AttributeError(f"module 'bus' has no attribute {name!r}")
