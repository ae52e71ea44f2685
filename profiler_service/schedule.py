"""The profiler service's decision core: pure functions of the config and the folded log.

Nothing here does I/O, reads the clock or keeps state between calls. :func:`decide` is given
the state folded from *everything* seen so far on the run's events and control streams (the
service's own earlier output included; see :mod:`profiler_service.state`) and returns only
what is still missing. That one rule buys three properties:

* start order does not matter: a service that starts after the trainer reads the log from its
  beginning and computes the same commands as one that was waiting for ``RunStarted``;
* restarts never duplicate: what was already published is in the log, so it is not returned;
* replay is deterministic: the same log gives the same output, timestamps included (every
  returned message takes the timestamp of the entry that caused it; the service restamps it
  when it publishes).

Because the state is folded one entry at a time (``state = apply(state, entry)``), deciding
after a new entry costs the same at step 10 as at step 100 000.

``global_profiler.steps`` counts verl's steps, parameter versions (``trigger_parameter_sync_step``
updates each; :func:`plan_sessions` maps them with :mod:`runconfig.stepunit`). Everything else
here (commands, requests, the barrier) counts 1-based trainer updates, one unit on every
role: a trainer step K is the K-th update; a rollouter step K runs
from the trainer's ``StepFinished(K-1)`` to its ``StepFinished(K)`` (:mod:`profiling.steps`), so
no session outlives the run's last step. A :class:`~runschema.messages.StartProfile` names the
first *and* last step of its session, so all scheduled commands can go out at ``RunStarted``:
the components arm them and start at the step boundary, which means the service can never be
late for a step, step 1 included.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence

from profiler_service.records import (
    PROFILER_SOURCE,
    SESSIONS_MISSING_CODE,
    PendingRequest,
    ServiceState,
    Target,
    expected_ranks,
    expected_targets,
)
from runconfig.schema import Content, ProfilerConfig, Role, Tool
from runconfig.stepunit import last_version, version_step_updates
from runschema.messages import (
    Command,
    Event,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    RunStarted,
    StartProfile,
)

__all__ = [
    "MANIFEST_NAME",
    "MAX_LABEL_LEN",
    "MAX_REQUEST_ID_LEN",
    "MAX_REQUEST_STEPS",
    "PROFILER_SOURCE",
    "ROLES",
    "SESSIONS_MISSING_CODE",
    "Target",
    "decide",
    "expected_ranks",
    "expected_targets",
    "expired_reason",
    "is_safe_label",
    "outstanding_targets",
    "plan_sessions",
    "safe_label",
    "session_id_for",
    "sessions_overlap",
    "step_runs",
]

ROLES: tuple[str, ...] = ("trainer", "rollouter")
"""The roles a session can target."""

MAX_LABEL_LEN = 64
"""Longest session id (it becomes part of a trace file name on every component)."""

MAX_REQUEST_ID_LEN = 40
"""Longest accepted request id, so ``r{request_id}-s{first}-{last}`` stays a short label."""

MAX_REQUEST_STEPS = 1000
"""Most steps one runtime request may cover (a trace of more would be unreadable anyway)."""

MANIFEST_NAME = "manifest.json"
"""File name of the manifest inside ``save_path/RUN``."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
# Used with fullmatch: a `^...$` pattern with match() also accepts a final "\n".
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# --------------------------------------------------------------------------- labels


def safe_label(text: str, max_len: int = MAX_LABEL_LEN) -> str:
    """``text`` reduced to ``[A-Za-z0-9_.-]`` (others become ``_``), at most ``max_len`` long.

    Never empty and never starting with ``.`` or ``-`` (so it cannot read as a hidden file or
    a command-line option).
    """
    cleaned = _UNSAFE.sub("_", text)[:max_len].lstrip(".-")
    return cleaned or "_"


def is_safe_label(text: str, max_len: int = MAX_LABEL_LEN) -> bool:
    """Whether ``text`` is already a safe label no longer than ``max_len``."""
    return 0 < len(text) <= max_len and _SAFE.fullmatch(text) is not None


def session_id_for(first_step: int, last_step: int, request_id: str = "") -> str:
    """Deterministic session id: ``s{first}-{last}``, or ``r{request_id}-s{first}-{last}``.

    The two namespaces cannot collide (``s`` vs ``r`` prefix), and scheduled steps never
    repeat, so ids are unique within a run.
    """
    base = f"s{first_step}-{last_step}"
    if not request_id:
        return base
    return safe_label(f"r{request_id}-{base}")


# --------------------------------------------------------------------------- planning


def step_runs(steps: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive steps, as inclusive ``(first, last)`` pairs, ascending.

    >>> step_runs([5, 1, 2, 3, 7])
    [(1, 3), (5, 5), (7, 7)]
    """
    runs: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


def _profiled_roles(roles: Iterable[str], replicas: int, ranks: Sequence[int],
                    trainers: int = 1) -> list[str]:
    """``roles`` de-duplicated, in order, keeping only roles that have a rank to profile.
    The rollouter always has one: a rank past ``rollout.replicas`` names a rollouter that may
    join the running run; nothing waits for it, but its reports count (:func:`joined_target`)."""
    kept: list[str] = []
    for role in roles:
        has_rank = role == "rollouter" or expected_ranks(role, replicas, ranks,
                                                         trainers=trainers)
        if role in ROLES and role not in kept and has_rank:
            kept.append(role)
    return kept


def plan_sessions(
    cfg: ProfilerConfig,
    replicas: int,
    total_steps: int | None = None,
    ts: float = 0.0,
    trigger: int = 1,
    trainers: int = 1,
) -> list[StartProfile]:
    """The sessions scheduled by ``global_profiler.*``, ascending by step.

    ``global_profiler.steps`` counts verl's steps, parameter versions: step ``s`` is the
    ``trigger`` (``async_training.trigger_parameter_sync_step``) updates ``(s-1)*trigger+1 ..
    s*trigger`` (:func:`runconfig.stepunit.version_steps_to_updates`). A command's
    ``first_step``/``last_step`` are those updates (the unit every component counts); its
    session id names the verl steps (``s{first}-{last}``). With ``trigger`` 1 both are the
    same numbers.

    Continuous mode (``profile_continuous_steps``): each maximal run of consecutive steps is
    one session. Discrete mode: one session per step. One command targets every configured
    role, so each update of a chosen step is covered by exactly one session per role. Steps
    past the run's last version (``total_steps // trigger``, ``total_steps`` being the run's
    ``trainer.total_training_steps`` in updates) are left out: they never happen. ``tool``
    null plans nothing.
    """
    if cfg.tool is None:
        return []
    roles = _profiled_roles(cfg.roles, replicas, cfg.ranks, trainers)
    if not roles:
        return []
    last = None if total_steps is None else last_version(total_steps, trigger)
    steps = [s for s in cfg.steps if s >= 1 and (last is None or s <= last)]
    if cfg.profile_continuous_steps:
        spans = step_runs(steps)
    else:
        spans = [(s, s) for s in sorted(set(steps))]
    return [
        StartProfile(
            session_id=session_id_for(first, final),
            roles=list(roles),
            tool=cfg.tool,
            first_step=version_step_updates(first, trigger)[0],
            last_step=version_step_updates(final, trigger)[1],
            ranks=list(cfg.ranks),
            contents=list(cfg.contents),
            ts=ts,
        )
        for first, final in spans
    ]


@functools.lru_cache(maxsize=16)
def _plan_cached(
    tool: Tool | None,
    steps: tuple[int, ...],
    continuous: bool,
    roles: tuple[Role, ...],
    ranks: tuple[int, ...],
    contents: tuple[Content, ...],
    replicas: int,
    total_steps: int | None,
    ts: float,
    trigger: int,
    trainers: int,
) -> tuple[StartProfile, ...]:
    cfg = ProfilerConfig(
        tool=tool,
        steps=list(steps),
        profile_continuous_steps=continuous,
        roles=list(roles),
        ranks=list(ranks),
        contents=list(contents),
    )
    return tuple(plan_sessions(cfg, replicas, total_steps, ts, trigger, trainers))


def _plan(
    cfg: ProfilerConfig, replicas: int, total_steps: int | None, ts: float, trigger: int = 1,
    trainers: int = 1,
) -> tuple[StartProfile, ...]:
    """:func:`plan_sessions`, computed once per distinct input (``decide`` runs after every
    new entry; the plan changes only with the config or the latest RunStarted)."""
    return _plan_cached(
        cfg.tool, tuple(cfg.steps), cfg.profile_continuous_steps, tuple(cfg.roles),
        tuple(cfg.ranks), tuple(cfg.contents), replicas, total_steps, ts, trigger, trainers,
    )


def sessions_overlap(a: StartProfile, b: StartProfile) -> bool:
    """Whether two sessions share a role and at least one step."""
    shares_role = any(role in b.roles for role in a.roles)
    return shares_role and a.first_step <= b.last_step and b.first_step <= a.last_step


# --------------------------------------------------------------------------- the log, folded


def outstanding_targets(
    state: ServiceState, scheduled: Iterable[StartProfile] | None = None
) -> list[tuple[str, str, int]]:
    """``(session_id, role, rank)`` still expected to stop, for a finished run.

    A session whose first step is past the run's last step never started and is not waited
    for. Before RunFinished everything unstopped is outstanding. O(sessions): the service
    asks only once the run has finished.
    """
    sessions = state.sent_sessions() if scheduled is None else list(scheduled)
    last_step = state.run_finished.steps if state.run_finished is not None else None
    missing: list[tuple[str, str, int]] = []
    for session in sessions:
        if last_step is not None and session.first_step > last_step:
            continue
        for role, rank in expected_targets(session.roles, state.replicas, session.ranks,
                                           trainers=state.trainers):
            if not state.stopped(session.session_id, role, rank):
                missing.append((session.session_id, role, rank))
    return missing


# --------------------------------------------------------------------------- decisions


def _refuse(req: ProfileRequest, reason: str) -> ProfileRequestRefused:
    return ProfileRequestRefused(request_id=req.request_id, reason=reason, ts=req.ts)


def expired_reason(pending: PendingRequest, now_ms: int | None) -> str | None:
    """Why ``pending`` must not be served any more, judged by the Redis server's clock alone:
    its age is ``now_ms`` (Redis ``TIME``) minus its arrival (its entry id), and the client
    stops waiting ``timeout_s`` after it sent it. None while it may still be served (or when
    either time is unknown)."""
    if now_ms is None or pending.arrived_ms is None:
        return None
    age_ms = now_ms - pending.arrived_ms
    limit_ms = pending.request.timeout_s * 1000.0
    if age_ms <= limit_ms:
        return None
    return (
        f"expired: the request arrived {age_ms / 1000:.1f} s before the profiler service "
        f"could answer it, past its timeout of {pending.request.timeout_s:g} s; nobody is "
        "waiting for the answer any more, so no session is scheduled for it"
    )


def _answer_request(
    cfg: ProfilerConfig,
    state: ServiceState,
    req: ProfileRequest,
    scheduled: Sequence[StartProfile],
    barrier: int = 0,
) -> StartProfile | ProfileRequestRefused:
    """Validate one runtime request against the log, the sessions scheduled so far and the
    step barrier (steps ``<= barrier`` have begun or are beginning: closed to commands).
    The checks run in a fixed order; the first that fails is the refusal's reason."""
    reason = _unservable_reason(cfg, state, req) or _shape_reason(req)
    if reason is not None:
        return _refuse(req, reason)
    # The barrier is ahead of StepStarted while the trainer crosses a step boundary: the
    # step it names has begun for the components even though its StepStarted is not out.
    begun = max(state.last_started_step, barrier)
    steps = _requested_steps(req, begun)
    reason = _steps_reason(steps) or _timing_reason(steps, state, begun)
    if reason is not None:
        return _refuse(req, reason)
    assert cfg.tool is not None  # _unservable_reason refused a service with profiling off
    candidate = StartProfile(
        session_id=session_id_for(steps[0], steps[-1], req.request_id),
        roles=_profiled_roles(req.roles, state.replicas, cfg.ranks, state.trainers),
        tool=cfg.tool,
        first_step=steps[0],
        last_step=steps[-1],
        ranks=list(cfg.ranks),
        contents=list(cfg.contents),
        request_id=req.request_id,
        ts=req.ts,
    )
    reason = _overlap_reason(candidate, scheduled)
    return candidate if reason is None else _refuse(req, reason)


def _unservable_reason(cfg: ProfilerConfig, state: ServiceState, req: ProfileRequest) -> str | None:
    """Why no session can serve this request whatever its steps: profiling off, a bad id,
    a finished run, roles that are unknown or have no rank to profile."""
    if cfg.tool is None:
        return "profiling is off: global_profiler.tool is null in the profiler service config"
    if state.run_profiling_off:
        return ("profiling is off for this run: it was started with global_profiler.tool null, "
                "so its trainer and rollouters hold no profiler and no trace could be written")
    if not is_safe_label(req.request_id, MAX_REQUEST_ID_LEN):
        return f"request id must be 1-{MAX_REQUEST_ID_LEN} letters, digits, '_', '.' or '-'"
    if state.run_finished is not None:
        return f"the run has finished (after step {state.run_finished.steps})"
    if not req.roles or any(r not in ROLES for r in req.roles):
        return f"roles must be a non-empty subset of {list(ROLES)}, got {req.roles}"
    if not _profiled_roles(req.roles, state.replicas, cfg.ranks, state.trainers):
        return f"no rank of roles {req.roles} is selected by global_profiler.ranks={cfg.ranks}"
    return None


def _shape_reason(req: ProfileRequest) -> str | None:
    """Why the request's step fields cannot be read: both forms, a negative count, too many
    steps (bounded before any list is built: a message could ask for 10**12 steps)."""
    if req.steps and req.next_steps:
        return "give either steps or next_steps, not both"
    if req.next_steps < 0:
        return f"next_steps must be >= 1, got {req.next_steps}"
    if req.next_steps > MAX_REQUEST_STEPS or len(req.steps) > MAX_REQUEST_STEPS:
        return f"a request may cover at most {MAX_REQUEST_STEPS} steps"
    return None


def _requested_steps(req: ProfileRequest, begun: int) -> list[int]:
    """The steps asked for, ascending: ``next:N`` counts from the last step that has begun."""
    if req.next_steps:
        return list(range(begun + 1, begun + 1 + req.next_steps))
    return sorted(set(req.steps))


def _steps_reason(steps: Sequence[int]) -> str | None:
    """Why ``steps`` are not one session: none, not 1-based, not consecutive."""
    if not steps:
        return "the request names no step"
    if steps[0] < 1:
        return f"steps are 1-based, got {steps[0]}"
    if steps[-1] - steps[0] + 1 != len(steps):
        return f"steps {list(steps)} are not consecutive; one request is one session"
    return None


def _timing_reason(steps: Sequence[int], state: ServiceState, begun: int) -> str | None:
    """Why ``steps`` are not in the run's future: their first has started (StepStarted) or
    begun (the barrier), or their last is past the run's last step."""
    first, final, started = steps[0], steps[-1], state.last_started_step
    if first <= started:
        return (f"step {first} is not in the future: trainer step {started} has already "
                f"started, so the earliest step a request can profile is {begun + 1}")
    if first <= begun:
        return (f"step {first} is not in the future: trainer step {begun} has already begun "
                f"(the trainer closed commands for steps up to {begun}), so the earliest step "
                f"a request can profile is {begun + 1}")
    total = state.total_steps
    if total is not None and final > total:
        return f"step {final} is past the run's last step (trainer.total_training_steps={total})"
    return None


def _overlap_reason(candidate: StartProfile, scheduled: Sequence[StartProfile]) -> str | None:
    """The first scheduled session sharing a role and a step with ``candidate``, named."""
    for other in scheduled:
        if sessions_overlap(candidate, other):
            shared = [r for r in candidate.roles if r in other.roles]
            return (f"steps {candidate.first_step}-{candidate.last_step} overlap session "
                    f"{other.session_id} (steps {other.first_step}-{other.last_step}) on "
                    f"{', '.join(shared)}")
    return None


def decide(
    cfg: ProfilerConfig,
    state: ServiceState,
    barrier: int = 0,
    now_ms: int | None = None,
) -> list[Command | Event]:
    """What the service must publish now, given the folded log ``state`` (everything seen so
    far on the events and control streams, its own output included), the run's step
    ``barrier`` (the value of ``RunKeys.barrier``: the trainer raises it to ``k`` before it
    lets any role begin step ``k``; 0 when unknown) and the Redis server's clock ``now_ms``
    (``TIME`` in ms; None: requests are not judged by age).

    Returned in publishing order: commands go to the control stream, events to the events
    stream, one after the other, so a reader that sees ProfilerReady already finds every
    command before it.

    * Latest RunStarted: every scheduled StartProfile not yet sent, then ProfilerReady (one
      per RunStarted, so a resumed trainer that waits for it gets one too). Neither once the
      run has finished: nobody is left to arm them.
    * Each ProfileRequest not yet answered: a StartProfile with its ``request_id``, or a
      ProfileRequestRefused with the reason. Answered only once the run has started (a
      request read before RunStarted waits for it), except that ``tool`` null refuses at once,
      and so does a request older than its own ``timeout_s`` (see :func:`expired_reason`):
      its client has given up, so it is never served. A run started with ``tool`` null gets
      refusals only. A request's steps must come after both the last StepStarted and
      ``barrier`` (``next:N`` counts from the higher of the two). The service publishes these
      StartProfile commands guarded by the barrier (:meth:`bus.Bus.publish_guarded`) and,
      when the guard refuses one, decides again with the barrier it reads then.
    * RunFinished, when every session that could have run has a ProfileStopped for every
      expected ``(role, rank)`` (or the service gave up waiting, see
      :data:`SESSIONS_MISSING_CODE`): ProfilerFinished, once per log. Its ``manifest_path``
      is :data:`MANIFEST_NAME` (relative) and ``hook_rc`` None: the service fills both in.

    ``tool`` null: no command at all, only refusals.

    Cost: O(configured sessions + pending requests x open sessions) while the run goes on,
    whatever the length of the log; every session sent is listed only when a configured one
    is still unsent (at RunStarted) or once the run has finished.
    """
    if cfg.tool is None:
        return [_answer_request(cfg, state, p.request, []) for p in state.pending]
    started = state.run_started
    if started is None:
        # Nothing can be scheduled yet, but a request nobody waits for is refused at once.
        return _refuse_expired(state.pending, now_ms)
    scheduled = _Scheduled(state)
    out: list[Command | Event] = []
    out += _send_plan(cfg, state, started, scheduled)
    out += _answer_pending(cfg, state, scheduled, barrier, now_ms)
    out += _finish(state, scheduled)
    return out


class _Scheduled:
    """The sessions of the run: those already sent (listed from the state only when asked,
    O(sessions)) and those decided in this call (:attr:`new`), in the order sent."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.new: list[StartProfile] = []
        self._sent: list[StartProfile] | None = None

    def all(self) -> list[StartProfile]:
        if self._sent is None:
            self._sent = self.state.sent_sessions()
        return [*self._sent, *self.new]


def _refuse_expired(
    pending: Iterable[PendingRequest], now_ms: int | None
) -> list[Command | Event]:
    """A refusal for each request its client no longer waits for (see expired_reason)."""
    out: list[Command | Event] = []
    for p in pending:
        reason = expired_reason(p, now_ms)
        if reason is not None:
            out.append(_refuse(p.request, reason))
    return out


def _send_plan(
    cfg: ProfilerConfig, state: ServiceState, started: RunStarted, scheduled: _Scheduled
) -> list[Command | Event]:
    """At the latest RunStarted: every configured session not sent yet, then ProfilerReady
    naming the planned sessions (neither once the run finished: nobody is left to arm them).
    A session overlapping one already armed (a restart with a changed config) is left out."""
    out: list[Command | Event] = []
    planned_ids: list[str] = []
    for session in _plan(cfg, state.replicas, state.total_steps, started.ts, state.trigger,
                         state.trainers):
        if state.is_sent(session.session_id):
            planned_ids.append(session.session_id)
        elif state.run_finished is None and not any(
            sessions_overlap(session, other) for other in scheduled.all()
        ):
            out.append(session)
            scheduled.new.append(session)
            planned_ids.append(session.session_id)
    if not state.ready_since_run_started and state.run_finished is None:
        out.append(ProfilerReady(session_ids=planned_ids, ts=started.ts))
    return out


def _answer_pending(
    cfg: ProfilerConfig,
    state: ServiceState,
    scheduled: _Scheduled,
    barrier: int,
    now_ms: int | None,
) -> list[Command | Event]:
    """An answer to each request not answered yet, in log order: refused when expired,
    else judged against the sessions it could overlap (each accepted one counts for the
    next)."""
    out: list[Command | Event] = []
    for pending in state.pending:
        reason = expired_reason(pending, now_ms)
        if reason is not None:
            out.append(_refuse(pending.request, reason))
            continue
        # A request is for steps after the last started one, so only sessions that end
        # after it can overlap it: the open ones (in the order sent), not the whole run's.
        candidates = [*state.open_sessions, *scheduled.new]
        answer = _answer_request(cfg, state, pending.request, candidates, barrier)
        out.append(answer)
        if isinstance(answer, StartProfile):
            scheduled.new.append(answer)
    return out


def _finish(state: ServiceState, scheduled: _Scheduled) -> list[Command | Event]:
    """ProfilerFinished, once per log, after RunFinished when no session that could have
    run still waits for a stop (or the service gave up waiting)."""
    finished = state.run_finished
    if finished is None or state.profiler_finished:
        return []
    if not state.gave_up_waiting and outstanding_targets(state, scheduled.all()):
        return []
    sessions = state.sent + len(scheduled.new)
    return [ProfilerFinished(manifest_path=MANIFEST_NAME, sessions=sessions, ts=finished.ts)]
