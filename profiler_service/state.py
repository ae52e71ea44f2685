"""The profiler service's state, folded from the run's log one entry at a time.

``state = fold(log)`` where ``fold`` is repeated :func:`apply`: ``apply(state, msg)`` returns
the state after one more entry of the events or control stream and leaves its argument as it
was (every record here is frozen). The service keeps only the latest state and the id of the
last events entry it applied (its tracking position), never the entries themselves, so each
new entry costs the same however long the run has been going:

* the scalar facts (latest RunStarted, ProfilerReady since, RunFinished, ...) are replaced;
* per-session facts live in a persistent map (:class:`~profiler_service.pmap.PMap`), so a
  ProfileStarted/ProfileStopped replaces one small :class:`Session` record and one path of
  the map, not a copy of every session;
* runtime requests are kept only while they are unanswered (:attr:`ServiceState.pending`);
  answered request ids stay in a persistent set for de-duplication;
* a ProfileStarted/ProfileStopped counts only for a session the service sent and from a
  process that session targets (:func:`report_refusal` says why not; the service logs it);
* each process's profiling run of a session is tracked from its ProfileStarted to its
  ProfileStopped; when the process dies or restarts inside it (ComponentFailed,
  TrainerResumed, a resumed RunStarted, a new ProfileStarted, or a later process reporting the
  session never ran) the steps it began are recorded as lost (:class:`LostSteps`), so the
  manifest can say which steps have no trace;
* an ``ok`` ProfileStopped waits for the service's check of its trace file
  (:class:`TraceChecked`, folded like an entry although it is never published).

Entries that do not concern the service (samples' announcements, metrics, heartbeats, ...)
return the very same state object, which lets the service skip deciding after them.

The state is everything :func:`~profiler_service.schedule.decide` and
:func:`~profiler_service.manifest.build_manifest` need; both are pure functions of it (plus
the config). Only the relative order of *events* matters: commands are matched by id, so the
control stream may be merged in anywhere (the service reads it first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from profiler_service.records import (
    NEVER_RAN,
    PROFILER_SOURCE,
    SESSIONS_MISSING_CODE,
    TRACE_MISSING_CODE,
    Fact,
    LostSteps,
    PendingRequest,
    Run,
    ServiceState,
    Session,
    StopFact,
    TraceChecked,
    entry_ms,
    expected_targets,
    lowest_last_step,
    stop_is_ok,
)
from runschema.facts import run_finished_refusal
from runschema.messages import (
    ComponentFailed,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    RunStarted,
    StartProfile,
    StepFinished,
    StepStarted,
    TrainerResumed,
    WarningRaised,
)

__all__ = [
    "apply",
    "fold",
    "joined_target",
    "report_refusal",
    "run_finished_doubt",
    "unchecked_stops",
]


_replace = msgspec.structs.replace


def _answer(state: ServiceState, request_id: str) -> ServiceState:
    """``request_id`` has its answer in the log."""
    answered = state.answered.set(request_id, True)
    pending = state.pending
    if any(p.request.request_id == request_id for p in pending):
        pending = tuple(p for p in pending if p.request.request_id != request_id)
    if answered is state.answered and pending is state.pending:
        return state
    return _replace(state, answered=answered, pending=pending)




def _session(state: ServiceState, session_id: str) -> Session:
    return state.sessions.get(session_id) or Session(session_id=session_id)


def apply(state: ServiceState, msg: Fact, entry_id: str | None = None) -> ServiceState:
    """The state after ``msg``; ``state`` itself is left as it was.

    ``entry_id``: the entry's id in the events stream (a ProfileRequest's arrival time is
    taken from it); None for control entries and for logs folded without ids. Entries that
    change nothing return ``state`` itself. O(1) whatever the log before it: at most one
    path of a persistent map and one small record are replaced.
    """
    fold_one = _APPLY.get(type(msg))
    return state if fold_one is None else fold_one(state, msg, entry_id)


def _run_started(state: ServiceState, msg: RunStarted, _: str | None) -> ServiceState:
    """A (re)started run: nothing after the previous RunStarted holds for it any more. A
    resumed one comes from a new trainer process: the old one's runs are lost."""
    if msg.resumed:
        state = _process_gone(state, "trainer", 0, "the trainer restarted inside the session "
                              "(RunStarted, resumed)")
    return _replace(state, run_started=msg, ready_since_run_started=False, run_finished=None,
                    gave_up_waiting=False)


def _trainer_resumed(state: ServiceState, msg: TrainerResumed, _: str | None) -> ServiceState:
    return _process_gone(state, "trainer", 0, "the trainer restarted inside the session "
                         f"(TrainerResumed after step {msg.step})")


def _component_failed(state: ServiceState, msg: ComponentFailed, _: str | None) -> ServiceState:
    error = msg.error if len(msg.error) <= 200 else msg.error[:200] + "..."
    return _process_gone(state, msg.role, msg.rank,
                         f"{msg.role}{msg.rank} failed inside the session ({error})")


def _process_gone(state: ServiceState, role: str, rank: int, reason: str) -> ServiceState:
    """``(role, rank)``'s process is gone: each of its runs in progress is lost from the step
    it began at to the session's end (a later run may profile some of those steps again)."""
    gone = [key for key in state.running if key[1] == role and key[2] == rank]
    if not gone:
        return state
    sessions = state.sessions
    for session_id, _, _ in gone:
        session = sessions[session_id]
        run = session.run_of(role, rank)
        assert run is not None  # state.running indexes Session.runs
        session = _replace(session, runs=tuple(r for r in session.runs if r is not run),
                           lost=(*session.lost, LostSteps(role, rank, run.step, None, reason)))
        sessions = sessions.set(session_id, session)
    running = tuple(key for key in state.running if key not in gone)
    return _replace(state, sessions=sessions, running=running)


def _profiler_ready(state: ServiceState, msg: ProfilerReady, _: str | None) -> ServiceState:
    ready = state.run_started is not None
    if ready == state.ready_since_run_started:
        return state
    return _replace(state, ready_since_run_started=ready)


def _run_finished(state: ServiceState, msg: RunFinished, _: str | None) -> ServiceState:
    if state.run_started is None or run_finished_doubt(state, msg) is not None:
        return state
    return _replace(state, run_finished=msg, gave_up_waiting=False)


def run_finished_doubt(state: ServiceState, msg: RunFinished) -> str | None:
    """Why a RunFinished is not believed (the service logs it), or None: once the log has
    StepFinished events, it must name the last finished step."""
    if state.last_finished_step == 0:
        return None
    return run_finished_refusal(msg, state.last_finished_step)


def _step_finished(state: ServiceState, msg: StepFinished, _: str | None) -> ServiceState:
    if msg.step <= state.last_finished_step:
        return state
    return _replace(state, last_finished_step=msg.step)


def _warning(state: ServiceState, msg: WarningRaised, _: str | None) -> ServiceState:
    """Only the service's own warnings are facts for it: the give-up, after RunFinished, and
    the missing traces (so that each is published once)."""
    if msg.source == PROFILER_SOURCE and msg.code == TRACE_MISSING_CODE:
        warned = state.trace_warnings.set(msg.message, True)
        return state if warned is state.trace_warnings else _replace(state,
                                                                      trace_warnings=warned)
    gave_up = (msg.source == PROFILER_SOURCE and msg.code == SESSIONS_MISSING_CODE
               and state.run_finished is not None)
    if not gave_up or state.gave_up_waiting:
        return state
    return _replace(state, gave_up_waiting=True)


def _profiler_finished(state: ServiceState, msg: ProfilerFinished, _: str | None) -> ServiceState:
    if state.profiler_finished:
        return state
    return _replace(state, profiler_finished=True)


def _step_started(state: ServiceState, msg: StepStarted, _: str | None) -> ServiceState:
    step = msg.step
    if step <= state.last_started_step:
        return state
    if state.open_sessions and step >= state.open_until:
        # Sessions end at this step: each leaves the open list once, so this filter costs
        # O(1) per session over the run, not per step.
        still = tuple(s for s in state.open_sessions if s.last_step > step)
        return _replace(state, last_started_step=step, open_sessions=still,
                        open_until=lowest_last_step(still))
    return _replace(state, last_started_step=step)


def _start_profile(state: ServiceState, msg: StartProfile, _: str | None) -> ServiceState:
    """The first command of a session id is the session (a repeat is a retried XADD); one
    that carries a request id answers that request."""
    session = _session(state, msg.session_id)
    if session.cmd is None:
        session = _replace(session, cmd=msg, seq=state.sent)
        state = _replace(state, sessions=state.sessions.set(msg.session_id, session),
                         sent=state.sent + 1)
        if msg.last_step > state.last_started_step:
            opened = (*state.open_sessions, msg)
            state = _replace(state, open_sessions=opened, open_until=lowest_last_step(opened))
    return _answer(state, msg.request_id) if msg.request_id else state


def _refused(state: ServiceState, msg: ProfileRequestRefused, _: str | None) -> ServiceState:
    return _answer(state, msg.request_id)


def _request(state: ServiceState, msg: ProfileRequest, entry_id: str | None) -> ServiceState:
    if msg.request_id in state.answered or any(
        p.request.request_id == msg.request_id for p in state.pending
    ):
        return state  # answered already, or a duplicate of one waiting
    pending = PendingRequest(msg, entry_ms(entry_id))
    return _replace(state, pending=(*state.pending, pending))


def report_refusal(state: ServiceState, msg: ProfileStarted | ProfileStopped) -> str | None:
    """Why ``msg`` does not count (the service logs it and ignores it), or None: a report
    counts only for a session the service sent, from a process that session targets."""
    kind = type(msg).__name__
    session = state.sessions.get(msg.session_id)
    if session is None or session.cmd is None:
        return f"{kind} for session {msg.session_id!r}, which the service never started"
    cmd = session.cmd
    if ((msg.role, msg.rank) not in expected_targets(cmd.roles, state.replicas, cmd.ranks,
                                                     trainers=state.trainers)
            and not joined_target(cmd, msg.role, msg.rank)):
        return (f"{kind} for session {msg.session_id!r} from {msg.role}{msg.rank}, which the "
                f"session does not target")
    return None


def joined_target(cmd: StartProfile, role: str, rank: int) -> bool:
    """Whether rollouter ``rank`` beyond ``rollout.replicas`` (one that joined the running
    run, docs/operations.md) acts on ``cmd``, as its agent decides: the rollouter role is
    profiled and ``cmd.ranks`` is empty (every rank) or names it. The service does not wait
    for such a replica, but counts its reports and lists its traces."""
    return role == "rollouter" and role in cmd.roles and (not cmd.ranks or rank in cmd.ranks)


def unchecked_stops(state: ServiceState) -> list[tuple[str, StopFact, str]]:
    """``(session_id, stop, session's tool)`` of each ``ok`` stop whose trace file the
    service has not checked yet (an nsys session's stop names no file: nsys writes its own
    reports)."""
    found: list[tuple[str, StopFact, str]] = []
    for session_id, role, rank in state.unchecked:
        session = state.sessions[session_id]
        fact = session.stop_of(role, rank)
        if fact is not None and session.cmd is not None:
            found.append((session_id, fact, session.cmd.tool))
    return found


def _set_running(state: ServiceState, key: tuple[str, str, int], on: bool) -> ServiceState:
    if (key in state.running) == on:
        return state
    running = (*state.running, key) if on else tuple(k for k in state.running if k != key)
    return _replace(state, running=running)


def _set_unchecked(state: ServiceState, key: tuple[str, str, int], on: bool) -> ServiceState:
    if (key in state.unchecked) == on:
        return state
    unchecked = (*state.unchecked, key) if on else tuple(k for k in state.unchecked if k != key)
    return _replace(state, unchecked=unchecked)


def _profile_started(state: ServiceState, msg: ProfileStarted, _: str | None) -> ServiceState:
    """A process begins a run of the session. A run of the same process already in progress
    from an earlier step belongs to a process that is gone (this is its successor): its
    steps before this one are lost. A trace the process wrote earlier is replaced by this
    run's (same file): its steps are lost unless this run profiles them again."""
    if report_refusal(state, msg) is not None:
        return state
    session = state.sessions[msg.session_id]
    role, rank, step = msg.role, msg.rank, msg.step
    before = session.run_of(role, rank)
    if before is not None and before.step == step:
        return state  # a retried XADD (or a successor redoing the very step it began at)
    lost = session.lost
    if before is not None:
        lost = (*lost, LostSteps(role, rank, before.step, step - 1,
                                 f"{role}{rank} restarted inside the session (profiling began "
                                 f"again at step {step})"))
    else:
        fact = session.stop_of(role, rank)
        if fact is not None and stop_is_ok(fact.stopped):
            lost = (*lost, LostSteps(role, rank, fact.stopped.first_step,
                                     fact.stopped.last_step,
                                     f"{role}{rank} profiled the session again from step "
                                     f"{step}; its new trace replaces the earlier one"))
    runs = (*(r for r in session.runs if r is not before), Run(role, rank, step))
    started = session.started if (role, rank) in session.started else (
        *session.started, (role, rank))
    session = _replace(session, runs=runs, lost=lost, started=started)
    state = _replace(state, sessions=state.sessions.set(msg.session_id, session))
    return _set_running(state, (msg.session_id, role, rank), True)


def _profile_stopped(state: ServiceState, msg: ProfileStopped, _: str | None) -> ServiceState:
    """A process's first stop of a session is recorded in report order; a later one
    replaces it, except that a failed stop never replaces an ``ok`` one. It ends the
    process's run in progress; a stop saying the session never ran ends it as lost (it comes
    from a later process: the one that began the run is gone)."""
    if report_refusal(state, msg) is not None:
        return state
    key = (msg.session_id, msg.role, msg.rank)
    session = state.sessions[msg.session_id]
    run = session.run_of(msg.role, msg.rank)
    if run is not None:
        lost = session.lost
        if (msg.status or "ok") in NEVER_RAN:
            lost = (*lost, LostSteps(msg.role, msg.rank, run.step, None,
                                     f"{msg.role}{msg.rank} restarted inside the session "
                                     f"(a later process reported it {msg.status})"))
        session = _replace(session, runs=tuple(r for r in session.runs if r is not run),
                           lost=lost)
        state = _set_running(state, key, False)
    before = session.stop_of(msg.role, msg.rank)
    if before is None:
        fact = StopFact(msg.role, msg.rank, state.stop_reports, msg)
        session = _replace(session, stops=(*session.stops, fact))
        state = _replace(state, stop_reports=state.stop_reports + 1)
    elif stop_is_ok(before.stopped) and not stop_is_ok(msg):
        # A restarted component reports the sessions it finds in the past as missed; the
        # trace an earlier incarnation wrote stands.
        if run is None:
            return state
    else:
        fact = StopFact(before.role, before.rank, before.order, msg)
        session = _replace(session, stops=tuple(fact if f is before else f
                                                for f in session.stops))
    state = _replace(state, sessions=state.sessions.set(msg.session_id, session))
    recorded = session.stop_of(msg.role, msg.rank)
    assert recorded is not None
    return _set_unchecked(state, key, stop_is_ok(recorded.stopped) and recorded.check is None)


def _trace_checked(state: ServiceState, msg: TraceChecked, _: str | None) -> ServiceState:
    """The verdict on a stop's trace file, if that stop is still the recorded one."""
    session = state.sessions.get(msg.session_id)
    fact = None if session is None else session.stop_of(msg.role, msg.rank)
    if (session is None or fact is None or fact.stopped != msg.stopped
            or not stop_is_ok(fact.stopped) or fact.check == msg.problem):
        return state
    checked = _replace(fact, check=msg.problem)
    session = _replace(session, stops=tuple(checked if f is fact else f for f in session.stops))
    state = _replace(state, sessions=state.sessions.set(msg.session_id, session))
    return _set_unchecked(state, (msg.session_id, msg.role, msg.rank), False)


# How each kind of entry changes the state; any other kind (samples' announcements,
# metrics, heartbeats, ...) leaves it as it is.
_APPLY: dict[type, Callable[[ServiceState, Any, str | None], ServiceState]] = {
    RunStarted: _run_started,
    ProfilerReady: _profiler_ready,
    RunFinished: _run_finished,
    StepFinished: _step_finished,
    WarningRaised: _warning,
    ProfilerFinished: _profiler_finished,
    StepStarted: _step_started,
    StartProfile: _start_profile,
    ProfileRequestRefused: _refused,
    ProfileRequest: _request,
    ProfileStarted: _profile_started,
    ProfileStopped: _profile_stopped,
    TrainerResumed: _trainer_resumed,
    ComponentFailed: _component_failed,
    TraceChecked: _trace_checked,
}


def fold(
    log: Iterable[Fact | tuple[str, Fact]], state: ServiceState | None = None
) -> ServiceState:
    """Fold a log into a state (from ``state``, or from the empty state): repeated
    :func:`apply`. Items are messages or ``(events entry id, message)`` pairs (such as
    :class:`bus.Entry`)."""
    state = ServiceState() if state is None else state
    for item in log:
        if isinstance(item, tuple):
            state = apply(state, item[1], item[0])
        else:
            state = apply(state, item)
    return state
