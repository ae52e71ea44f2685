"""Redis key names of a run. Every key of run RUN carries the hash tag ``{RUN}``, so a whole
run lives in one Redis Cluster slot and MULTI/EXEC across its streams is allowed."""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

__all__ = ["DLQ_MAXLEN", "LOG_ROLES", "ROLE_LOG_MAXLEN", "RUNS_STREAM", "RunKeys",
           "dlq_dropped_key", "log_order", "validate_run_id"]

RUNS_STREAM = "rlbus:runs"
"""One entry per run (discovery), written by the trainer."""

LOG_ROLES = ("trainer", "operator", "rollouter", "profiler", "logger")
"""The writing roles of a run's log, each appending to its own stream (:meth:`RunKeys.log`),
in the order the streams' entries of one millisecond are merged (:func:`log_order`): a role
before the roles that react to its facts (the profiler service answers the operator's
requests). The trainer reacts to the others too (validation answers, ProfilerReady): its
writes take an id in a millisecond after what it read (bus.Lease.write's floor)."""


def log_order(entry_id: str, role: str) -> tuple[int, int, int]:
    """Where an entry of ``role``'s stream stands in the merged log: its millisecond (Redis's
    clock), then the role (:data:`LOG_ROLES`), then its sequence number (its stream's own
    order within that millisecond; sequence numbers of different streams mean nothing to
    each other)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), LOG_ROLES.index(role), int(seq or 0)

ROLE_LOG_MAXLEN = 100_000
"""About how many entries the stream of a role other than the trainer's keeps (each writer
appends with ``MAXLEN ~``): warnings, profile sessions, validation answers and requests, far
fewer than that in a run, but never unbounded. The trainer's stream keeps every fact
(archived by retention)."""

DLQ_MAXLEN = 100_000
"""About how many dead letters a dead-letter stream keeps (``redis.dead_letter_max``): each
batch of dead letters is followed by ``XTRIM MAXLEN ~`` (whole stream nodes, so a little
more may stay), and what that trims is counted in :func:`dlq_dropped_key`. A flood of junk
then costs a bounded stream, not memory without end."""


def dlq_dropped_key(dlq: str) -> str:
    """The counter of dead letters trimmed from ``dlq`` by its cap (INCRBY, same slot)."""
    return f"{dlq}:dropped"


_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a safe name (letters, digits, ``_.-``; it is also a folder)."""
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r} must be 1-64 letters, digits, '_', '.' or '-', starting with "
            "a letter or digit"
        )
    return run_id


class RunKeys(msgspec.Struct, frozen=True):
    """The stream and key names of one run."""

    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @property
    def prefix(self) -> str:
        return f"rlbus:{{{self.run_id}}}"

    @property
    def events(self) -> str:
        """The trainer's facts (steps, weights, checkpoints, tickets, run start and finish):
        the log's spine, written only by the trainer's fenced script, archived and trimmed
        after checkpoints (``run.retention``)."""
        return f"{self.prefix}:events"

    def log(self, role: str) -> str:
        """The stream of the facts ``role`` states (one writing role per stream, enforced by
        the ACL users of deploy/redis/users.acl): :attr:`events` for the trainer,
        ``events:ROLE`` for the others. The run's log is these streams merged by entry id."""
        if role not in LOG_ROLES:
            raise ValueError(f"no log stream for role {role!r} (roles: {', '.join(LOG_ROLES)})")
        return self.events if role == "trainer" else f"{self.events}:{role}"

    @property
    def log_streams(self) -> tuple[str, ...]:
        """Every stream of the run's log, in :data:`LOG_ROLES` order."""
        return tuple(self.log(role) for role in LOG_ROLES)

    def log_role(self, stream: str) -> str | None:
        """The role whose facts ``stream`` holds (None: not a log stream of this run)."""
        for role in LOG_ROLES:
            if self.log(role) == stream:
                return role
        return None

    @property
    def prompts(self) -> str:
        return f"{self.prefix}:prompts"

    @property
    def samples(self) -> str:
        return f"{self.prefix}:samples"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"

    @property
    def dlq_dropped(self) -> str:
        """How many dead letters the dead-letter stream's cap dropped (a counter)."""
        return dlq_dropped_key(self.dlq)

    @property
    def barrier(self) -> str:
        """Step barrier (a plain string key holding an int, see :meth:`bus.Bus.set_barrier`):
        the trainer raises it to ``k`` before anything lets a role begin step ``k``, so
        commands for steps ``<= barrier`` are closed (:meth:`bus.Bus.publish_guarded`)."""
        return f"{self.prefix}:barrier"

    @property
    def trainer_lease(self) -> str:
        """The trainer's fencing lease (a string key with a TTL, see :mod:`bus.liveness`):
        it holds the token of the one trainer allowed to write this run."""
        return f"{self.prefix}:trainer-lease"

    def events_readers(self, rollouter_ranks: Iterable[int] = ()) -> tuple[tuple[str, str], ...]:
        """``(position key, liveness key)`` of every reader whose stored events position the
        trainer's events trim keeps (:meth:`bus.Bus.trim_log`), each honoured while its
        liveness key exists: the profiler service's snapshot position, the metrics logger's
        written position, then each rollouter replica's read position (stored at every
        pulse: a replica a step behind still reads the StepFinished events its profiling
        steps follow)."""
        return ((self.position("profiler"), self.alive("profiler", 0)),
                (self.position("logger"), self.alive("logger", 0)),
                *((self.rollouter_position(r), self.alive("rollouter", r))
                  for r in rollouter_ranks))

    def rollouter_position(self, rank: int) -> str:
        """Where rollouter replica ``rank`` stands in the events log (:meth:`position`)."""
        return self.position(f"rollouter{rank}")

    @property
    def archive(self) -> str:
        """Where the trainer archives the events it trims (a string key holding the absolute
        path of the archive folder on the trainer's machine, see :mod:`runtime.history`)."""
        return f"{self.prefix}:archive"

    def position(self, reader: str) -> str:
        """Where ``reader`` stands in the events log (a string key holding an entry id, see
        :meth:`bus.Bus.set_position`): the entry its snapshot was folded up to."""
        return f"{self.prefix}:position:{reader}"

    def alive(self, role: str, rank: int) -> str:
        """Liveness key of one component (SET PX, refreshed every heartbeat interval); its
        value is the component's latest :class:`~runschema.messages.Heartbeat`."""
        return f"{self.prefix}:alive:{role}:{rank}"

    @staticmethod
    def rollouter_consumer(rank: int) -> str:
        """Consumer name of rollouter replica ``rank`` in the prompts stream's group: what
        the trainer and the other replicas match against live replicas' heartbeats."""
        return f"rollouter-{rank}"

    def rank_claim(self, role: str, rank: int) -> str:
        """Who holds rank ``rank`` of ``role`` (a string key ``PID@HOST/NONCE`` with a TTL,
        SET NX PX, refreshed with the holder's heartbeat: see :mod:`bus.ranks`)."""
        return f"{self.prefix}:rank:{role}:{rank}"

    def alive_pattern(self, role: str = "*") -> str:
        """SCAN MATCH pattern of the liveness keys of ``role`` (every role by default)."""
        return f"{self.prefix}:alive:{role}:*"

    @property
    def blobs(self) -> str:
        """The set of the chunk keys of every blob stored in Redis for the run (SADD with
        each blob, SREM with its deletion): the trainer's sweep reads it instead of SCAN."""
        return f"{self.prefix}:blobs"

    @property
    def weights_round(self) -> str:
        """The trainer's current weight broadcast round (a string key, SET PX by the
        trainer, polled with GET by the rollouters: :mod:`weights.collective`)."""
        return f"{self.prefix}:weights-round"

    def blob(self, name: str) -> str:
        """Key prefix of blob ``name`` (its chunks are ``...:0``, ``...:1``, ...)."""
        return f"{self.prefix}:blob:{name}"
