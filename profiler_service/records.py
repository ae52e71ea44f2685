"""The records the profiler service's state is made of (:mod:`profiler_service.state` folds
the log into them): the state itself (:class:`ServiceState`), each session's facts
(:class:`Session`: its processes' runs, stops and lost steps), the runtime requests still
unanswered, and the service's own trace check (:class:`TraceChecked`). Every record is
frozen: a new entry replaces records, it never edits one. Also the rules the decisions and
the manifest share: which processes a session targets, and whether a stop wrote a trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from profiler_service.pmap import PMap
from runschema.messages import (
    Message,
    ProfileRequest,
    ProfileStopped,
    RunFinished,
    RunStarted,
    StartProfile,
)

__all__ = [
    "NEVER_RAN",
    "PROFILER_SOURCE",
    "SESSIONS_MISSING_CODE",
    "TRACE_MISSING_CODE",
    "Fact",
    "LostSteps",
    "PendingRequest",
    "Run",
    "ServiceState",
    "Session",
    "StopFact",
    "Target",
    "TraceChecked",
    "entry_ms",
    "expected_ranks",
    "expected_targets",
    "lowest_last_step",
    "stop_is_ok",
]

PROFILER_SOURCE = "profiler"
"""``source`` of the WarningRaised events the profiler service publishes (and its role)."""

SESSIONS_MISSING_CODE = "profile_sessions_missing"
"""WarningRaised code the service publishes when, after RunFinished, it gave up waiting for
the last ProfileStopped events. Once it is in the log, ``decide`` finishes the run."""

TRACE_MISSING_CODE = "profile_trace_missing"
"""WarningRaised code the service publishes (once per message) when the trace file an ``ok``
ProfileStopped names is not under ``save_path/RUN`` with the stated size."""

NEVER_RAN = frozenset({"missed", "cancelled", "unavailable"})
"""ProfileStopped statuses of a session its reporter never profiled (``profiling.agent``): one
that follows a ProfileStarted of the same process comes from a later incarnation of it."""

Target = tuple[str, int]
"""One profiled process: ``(role, rank)``."""


class TraceChecked(msgspec.Struct, frozen=True, kw_only=True):
    """The service's check of the trace file an ``ok`` ProfileStopped names: ``problem`` is
    "" when the file is there with the stated size, else what is wrong. Folded by
    :func:`apply` like an entry, never published (a restarted service checks again)."""

    session_id: str
    role: str
    rank: int
    stopped: ProfileStopped
    problem: str = ""


Fact = Message | TraceChecked
"""An entry of the log or the control stream (or the service's own trace check). Entries
hold any message; those the state does not fold (samples' announcements, metrics, ...)
leave it as it was."""


def stop_is_ok(stopped: ProfileStopped) -> bool:
    """Whether a ProfileStopped says its trace was written (an empty status is ``ok``)."""
    return (stopped.status or "ok") == "ok"


def expected_ranks(role: str, replicas: int, ranks: Sequence[int] = (), *,
                   trainers: int = 1) -> list[int]:
    """Ranks of ``role`` that profile a session: trainer ``0..trainers-1`` (its ranks,
    trainer.nnodes x n_gpus_per_node), rollouter ``0..replicas-1``, kept only if listed in
    ``ranks`` (empty = every rank)."""
    if role == "trainer":
        all_ranks = list(range(max(1, trainers)))
    elif role == "rollouter":
        all_ranks = list(range(max(1, replicas)))
    else:
        return []
    return [r for r in all_ranks if not ranks or r in ranks]


def expected_targets(
    roles: Sequence[str], replicas: int, ranks: Sequence[int] = (), *, trainers: int = 1
) -> list[Target]:
    """Every ``(role, rank)`` that is expected to profile a session on ``roles``."""
    return [(role, rank) for role in roles
            for rank in expected_ranks(role, replicas, ranks, trainers=trainers)]


class Run(msgspec.Struct, frozen=True):
    """A process's profiling run of a session: from its ProfileStarted at ``step`` until its
    ProfileStopped (or until the process is found gone)."""

    role: str
    rank: int
    step: int


class LostSteps(msgspec.Struct, frozen=True):
    """Steps ``first..last`` of a session that ``(role, rank)`` began profiling and whose
    trace is lost (``last`` None: up to the session's end); ``reason`` says why."""

    role: str
    rank: int
    first: int
    last: int | None
    reason: str


class StopFact(msgspec.Struct, frozen=True):
    """The ProfileStopped of one ``(role, rank)`` for a session: the latest one (the last
    report wins), and ``order``, when the first one was folded (the manifest lists
    unexpected reporters in that order)."""

    role: str
    rank: int
    order: int
    stopped: ProfileStopped
    check: str | None = None
    """The service's check of an ``ok`` stop's trace file: None not checked yet, "" the file
    is there with the stated size, else what is wrong (:class:`TraceChecked`)."""


class Session(msgspec.Struct, frozen=True):
    """What the log says about one session id."""

    session_id: str
    cmd: StartProfile | None = None
    """The first StartProfile with this id (None: only reports of it so far)."""
    seq: int = -1
    """Position of ``cmd`` among the sessions sent (the manifest's order)."""
    started: tuple[Target, ...] = ()
    """``(role, rank)`` of every ProfileStarted, first report first."""
    stops: tuple[StopFact, ...] = ()
    """One per ``(role, rank)`` that reported the session stopped."""
    runs: tuple[Run, ...] = ()
    """The runs in progress: a ProfileStarted with no ProfileStopped (or death) after it."""
    lost: tuple[LostSteps, ...] = ()
    """Steps whose trace died with its process, in the order found."""

    def stop_of(self, role: str, rank: int) -> StopFact | None:
        """The stop reported by ``(role, rank)``, if any."""
        for fact in self.stops:
            if fact.role == role and fact.rank == rank:
                return fact
        return None

    def run_of(self, role: str, rank: int) -> Run | None:
        """The run of ``(role, rank)`` in progress, if any."""
        for run in self.runs:
            if run.role == role and run.rank == rank:
                return run
        return None

    def lost_of(self, role: str, rank: int) -> list[LostSteps]:
        """What ``(role, rank)`` lost of this session, in the order found."""
        return [lost for lost in self.lost if lost.role == role and lost.rank == rank]


class PendingRequest(msgspec.Struct, frozen=True):
    """A runtime request not answered yet, with its Redis arrival time (the ms part of its
    events entry id; None when it was folded without an id)."""

    request: ProfileRequest
    arrived_ms: int | None = None


_NO_SESSIONS: PMap[str, Session] = PMap()
_NO_IDS: PMap[str, bool] = PMap()


class ServiceState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the profiler service has learnt from the log (see the module docstring)."""

    run_started: RunStarted | None = None
    """The latest RunStarted (a resumed run publishes it again)."""
    ready_since_run_started: bool = False
    """A ProfilerReady follows the latest RunStarted."""
    run_finished: RunFinished | None = None
    """A RunFinished that follows the latest RunStarted."""
    gave_up_waiting: bool = False
    """A SESSIONS_MISSING_CODE warning follows that RunFinished."""
    profiler_finished: bool = False
    last_started_step: int = 0
    """Highest trainer StepStarted seen (0 before step 1)."""
    last_finished_step: int = 0
    """Highest trainer StepFinished seen (0 before step 1): a RunFinished that names another
    step contradicts the log and is not believed (runschema.facts)."""
    sessions: PMap[str, Session] = _NO_SESSIONS
    """Every session id the log mentions (sent, started or stopped)."""
    sent: int = 0
    """How many sessions have a StartProfile (the next one's :attr:`Session.seq`)."""
    stop_reports: int = 0
    """How many ``(session, role, rank)`` reported a stop (the next :attr:`StopFact.order`)."""
    answered: PMap[str, bool] = _NO_IDS
    """Request ids that have an answer in the log (a StartProfile or a refusal)."""
    pending: tuple[PendingRequest, ...] = ()
    """Runtime requests without an answer yet, in log order, one per request id."""
    open_sessions: tuple[StartProfile, ...] = ()
    """The sessions sent whose last step is after the last started one, in the order they
    were sent: the only ones a runtime request (always for later steps) can overlap."""
    open_until: int = 0
    """The lowest ``last_step`` of :attr:`open_sessions` (0 when there is none): the step
    at which one of them closes."""
    running: tuple[tuple[str, str, int], ...] = ()
    """``(session_id, role, rank)`` of every run in progress (:attr:`Session.runs`), so that
    a process's death finds its runs without a scan of the sessions."""
    unchecked: tuple[tuple[str, str, int], ...] = ()
    """``(session_id, role, rank)`` whose ``ok`` stop waits for the service's file check."""
    trace_warnings: PMap[str, bool] = _NO_IDS
    """Messages of the service's own TRACE_MISSING_CODE warnings in the log (each once)."""

    @property
    def total_steps(self) -> int | None:
        """``trainer.total_training_steps`` of the run's config, when it says."""
        return _config_int(self.run_started, "trainer", "total_training_steps")

    @property
    def trigger(self) -> int:
        """``async_training.trigger_parameter_sync_step`` of the run's config (1 when it does
        not say): how many updates one verl step (parameter version) spans."""
        return _config_int(self.run_started, "async_training", "trigger_parameter_sync_step") or 1

    @property
    def replicas(self) -> int:
        """``rollout.replicas`` of the run's config (1 when it does not say)."""
        return _config_int(self.run_started, "rollout", "replicas") or 1

    @property
    def trainers(self) -> int:
        """The run's trainer ranks, ``trainer.nnodes x trainer.n_gpus_per_node`` (1 when its
        config does not say)."""
        nodes = _config_int(self.run_started, "trainer", "nnodes") or 1
        return nodes * (_config_int(self.run_started, "trainer", "n_gpus_per_node") or 1)

    @property
    def run_profiling_off(self) -> bool:
        """The run's own config (in RunStarted) says ``global_profiler.tool: null``: its
        trainer and rollouters hold no profiler, so no session could ever run."""
        if self.run_started is None or not isinstance(self.run_started.config, dict):
            return False
        section = self.run_started.config.get("global_profiler")
        return isinstance(section, dict) and "tool" in section and section["tool"] is None

    def sent_sessions(self) -> list[StartProfile]:
        """Every StartProfile sent, in the order they were sent. O(sessions)."""
        found = [s for s in self.sessions.values() if s.cmd is not None]
        found.sort(key=lambda s: s.seq)
        return [s.cmd for s in found if s.cmd is not None]

    def is_sent(self, session_id: str) -> bool:
        """Whether a StartProfile with this id is in the log."""
        session = self.sessions.get(session_id)
        return session is not None and session.cmd is not None

    def stopped(self, session_id: str, role: str, rank: int) -> bool:
        """Whether ``(role, rank)`` reported ``session_id`` stopped."""
        session = self.sessions.get(session_id)
        return session is not None and session.stop_of(role, rank) is not None


def _config_int(run_started: RunStarted | None, section: str, key: str) -> int | None:
    if run_started is None:
        return None
    node: Any = run_started.config.get(section) if isinstance(run_started.config, dict) else None
    value = node.get(key) if isinstance(node, dict) else None
    # bool is an int subclass; a config that says `true` here is not a count.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def entry_ms(entry_id: str | None) -> int | None:
    """The millisecond part of a stream entry id (the Redis server's clock when it was
    appended), or None."""
    if not entry_id:
        return None
    ms, _, _ = entry_id.partition("-")
    return int(ms) if ms.isdigit() else None


def lowest_last_step(sessions: tuple[StartProfile, ...]) -> int:
    """The lowest last step of ``sessions`` (0 for none): until then one may still be open."""
    return min((s.last_step for s in sessions), default=0)
