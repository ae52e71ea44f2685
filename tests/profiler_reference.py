"""The profiler service's decisions and manifest as they were before the state was folded
incrementally: everything recomputed from the whole log on every call (O(log) each).

Kept only as a test oracle: ``tests/test_profiler_state.py`` checks that the incremental
state gives the same decisions and the same manifest on random logs. Not used by the code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from bus.messages import (
    Command,
    Event,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    RunStarted,
    StartProfile,
    StepStarted,
    WarningRaised,
)
from profiler_service.manifest import _relative_trace_path
from profiler_service.schedule import (
    MANIFEST_NAME,
    MAX_REQUEST_ID_LEN,
    MAX_REQUEST_STEPS,
    PROFILER_SOURCE,
    ROLES,
    SESSIONS_MISSING_CODE,
    _profiled_roles,
    expected_targets,
    is_safe_label,
    plan_sessions,
    session_id_for,
    sessions_overlap,
)
from runconfig.schema import ProfilerConfig

__all__ = ["reference_decide", "reference_manifest"]


class RunView(msgspec.Struct, kw_only=True):
    """What the log says so far, as far as the profiler service is concerned."""

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
    sent: dict[str, StartProfile] = msgspec.field(default_factory=dict)
    """StartProfile commands already in the control stream, by session id (first wins)."""
    answers: dict[str, StartProfile | ProfileRequestRefused] = msgspec.field(
        default_factory=dict
    )
    """Answers already published, by request id (first wins)."""
    requests: list[ProfileRequest] = msgspec.field(default_factory=list)
    """Runtime requests in log order, first occurrence of each request id only."""
    stopped: set[tuple[str, str, int]] = msgspec.field(default_factory=set)
    """``(session_id, role, rank)`` of every ProfileStopped."""

    @property
    def total_steps(self) -> int | None:
        """``trainer.total_training_steps`` of the run's config, when it says."""
        return _config_int(self.run_started, "trainer", "total_training_steps")

    @property
    def replicas(self) -> int:
        """``rollout.replicas`` of the run's config (1 when it does not say)."""
        return _config_int(self.run_started, "rollout", "replicas") or 1


def _config_int(run_started: RunStarted | None, section: str, key: str) -> int | None:
    if run_started is None:
        return None
    node: Any = run_started.config.get(section) if isinstance(run_started.config, dict) else None
    value = node.get(key) if isinstance(node, dict) else None
    # bool is an int subclass; a config that says `true` here is not a count.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def fold_log(seen: Sequence[Event | Command]) -> RunView:
    """Fold the events and control entries seen so far into a :class:`RunView`.

    Only the relative order of *events* matters (RunStarted vs ProfilerReady/RunFinished);
    commands are matched by id wherever they appear, so the caller may merge the two streams
    in any order.
    """
    view = RunView()
    seen_request_ids: set[str] = set()
    for msg in seen:
        match msg:
            case RunStarted():
                view.run_started = msg
                view.ready_since_run_started = False
                view.run_finished = None
                view.gave_up_waiting = False
            case ProfilerReady():
                view.ready_since_run_started = view.run_started is not None
            case RunFinished():
                if view.run_started is not None:
                    view.run_finished = msg
                    view.gave_up_waiting = False
            case WarningRaised(source=source, code=code):
                if (
                    source == PROFILER_SOURCE
                    and code == SESSIONS_MISSING_CODE
                    and view.run_finished is not None
                ):
                    view.gave_up_waiting = True
            case ProfilerFinished():
                view.profiler_finished = True
            case StepStarted():
                view.last_started_step = max(view.last_started_step, msg.step)
            case StartProfile():
                view.sent.setdefault(msg.session_id, msg)
                if msg.request_id:
                    view.answers.setdefault(msg.request_id, msg)
            case ProfileRequestRefused():
                view.answers.setdefault(msg.request_id, msg)
            case ProfileRequest():
                if msg.request_id not in seen_request_ids:
                    seen_request_ids.add(msg.request_id)
                    view.requests.append(msg)
            case ProfileStopped():
                view.stopped.add((msg.session_id, msg.role, msg.rank))
            case _:
                pass
    return view


def outstanding_targets(
    view: RunView, scheduled: Iterable[StartProfile] | None = None
) -> list[tuple[str, str, int]]:
    """``(session_id, role, rank)`` still expected to stop, for a finished run.

    A session whose first step is past the run's last step never started and is not waited
    for. Before RunFinished everything unstopped is outstanding.
    """
    sessions = list(view.sent.values()) if scheduled is None else list(scheduled)
    last_step = view.run_finished.steps if view.run_finished is not None else None
    missing: list[tuple[str, str, int]] = []
    for session in sessions:
        if last_step is not None and session.first_step > last_step:
            continue
        for role, rank in expected_targets(session.roles, view.replicas, session.ranks):
            if (session.session_id, role, rank) not in view.stopped:
                missing.append((session.session_id, role, rank))
    return missing


def _refuse(req: ProfileRequest, reason: str) -> ProfileRequestRefused:
    return ProfileRequestRefused(request_id=req.request_id, reason=reason, ts=req.ts)


def _answer_request(
    cfg: ProfilerConfig,
    view: RunView,
    req: ProfileRequest,
    scheduled: list[StartProfile],
    barrier: int = 0,
) -> StartProfile | ProfileRequestRefused:
    """Validate one runtime request against the log, the sessions scheduled so far and the
    step barrier (steps ``<= barrier`` have begun or are beginning: closed to commands)."""
    if cfg.tool is None:
        return _refuse(
            req, "profiling is off: global_profiler.tool is null in the profiler service config"
        )
    if not is_safe_label(req.request_id, MAX_REQUEST_ID_LEN):
        return _refuse(
            req,
            f"request id must be 1-{MAX_REQUEST_ID_LEN} letters, digits, '_', '.' or '-'",
        )
    if view.run_finished is not None:
        return _refuse(req, f"the run has finished (after step {view.run_finished.steps})")
    unknown = [r for r in req.roles if r not in ROLES]
    if unknown or not req.roles:
        return _refuse(req, f"roles must be a non-empty subset of {list(ROLES)}, got {req.roles}")
    roles = _profiled_roles(req.roles, view.replicas, cfg.ranks)
    if not roles:
        return _refuse(
            req, f"no rank of roles {req.roles} is selected by global_profiler.ranks={cfg.ranks}"
        )
    started = view.last_started_step
    # The barrier is ahead of StepStarted while the trainer crosses a step boundary: the
    # step it names has begun for the components even though its StepStarted is not out.
    last = max(started, barrier)
    if req.steps and req.next_steps:
        return _refuse(req, "give either steps or next_steps, not both")
    if req.next_steps < 0:
        return _refuse(req, f"next_steps must be >= 1, got {req.next_steps}")
    # Bound the size before building any list: a message could ask for 10**12 steps.
    if req.next_steps > MAX_REQUEST_STEPS or len(req.steps) > MAX_REQUEST_STEPS:
        return _refuse(req, f"a request may cover at most {MAX_REQUEST_STEPS} steps")
    if req.next_steps:
        steps = list(range(last + 1, last + 1 + req.next_steps))
    else:
        steps = sorted(set(req.steps))
    if not steps:
        return _refuse(req, "the request names no step")
    if steps[0] < 1:
        return _refuse(req, f"steps are 1-based, got {steps[0]}")
    if steps[-1] - steps[0] + 1 != len(steps):
        return _refuse(req, f"steps {steps} are not consecutive; one request is one session")
    first, final = steps[0], steps[-1]
    if first <= started:
        return _refuse(
            req,
            f"step {first} is not in the future: trainer step {started} has already started, "
            f"so the earliest step a request can profile is {last + 1}",
        )
    if first <= last:
        return _refuse(
            req,
            f"step {first} is not in the future: trainer step {last} has already begun "
            f"(the trainer closed commands for steps up to {last}), so the earliest step a "
            f"request can profile is {last + 1}",
        )
    total = view.total_steps
    if total is not None and final > total:
        return _refuse(
            req, f"step {final} is past the run's last step (trainer.total_training_steps={total})"
        )
    candidate = StartProfile(
        session_id=session_id_for(first, final, req.request_id),
        roles=roles,
        tool=cfg.tool,
        first_step=first,
        last_step=final,
        ranks=list(cfg.ranks),
        contents=list(cfg.contents),
        request_id=req.request_id,
        ts=req.ts,
    )
    for other in scheduled:
        if sessions_overlap(candidate, other):
            shared = [r for r in candidate.roles if r in other.roles]
            return _refuse(
                req,
                f"steps {first}-{final} overlap session {other.session_id} "
                f"(steps {other.first_step}-{other.last_step}) on {', '.join(shared)}",
            )
    return candidate


def reference_decide(
    cfg: ProfilerConfig, seen: Sequence[Event | Command], barrier: int = 0
) -> list[Command | Event]:
    """What the service must publish now, given everything seen so far (in log order) and
    the run's step ``barrier`` (the value of ``RunKeys.barrier``: the trainer raises it to
    ``k`` before it lets any role begin step ``k``; 0 when unknown).

    Returned in publishing order: commands go to the control stream, events to the events
    stream, one after the other, so a reader that sees ProfilerReady already finds every
    command before it.

    * Latest RunStarted: every scheduled StartProfile not yet sent, then ProfilerReady (one
      per RunStarted, so a resumed trainer that waits for it gets one too). Neither once the
      run has finished: nobody is left to arm them.
    * Each ProfileRequest not yet answered: a StartProfile with its ``request_id``, or a
      ProfileRequestRefused with the reason. Answered only once the run has started (a
      request read before RunStarted waits for it), except that ``tool`` null refuses at once.
      A request's steps must come after both the last StepStarted and ``barrier``
      (``next:N`` counts from the higher of the two). The service publishes these
      StartProfile commands guarded by the barrier (:meth:`bus.Bus.publish_guarded`) and,
      when the guard refuses one, decides again with the barrier it reads then.
    * RunFinished, when every session that could have run has a ProfileStopped for every
      expected ``(role, rank)`` (or the service gave up waiting, see
      :data:`SESSIONS_MISSING_CODE`): ProfilerFinished, once per log. Its ``manifest_path``
      is :data:`MANIFEST_NAME` (relative) and ``hook_rc`` None: the service fills both in.

    ``tool`` null: no command at all, only refusals.
    """
    view = fold_log(seen)
    out: list[Command | Event] = []
    if cfg.tool is None:
        for req in view.requests:
            if req.request_id not in view.answers:
                out.append(_answer_request(cfg, view, req, []))
        return out
    started = view.run_started
    if started is None:
        return out

    scheduled: list[StartProfile] = list(view.sent.values())
    planned_ids: list[str] = []
    for session in plan_sessions(cfg, view.replicas, view.total_steps, ts=started.ts):
        if session.session_id in view.sent:
            planned_ids.append(session.session_id)
            continue
        if view.run_finished is not None:
            continue  # a service that starts after the run ended: nobody is left to arm it
        # A restart with a changed config must not add sessions over ones already armed.
        if any(sessions_overlap(session, other) for other in scheduled):
            continue
        out.append(session)
        scheduled.append(session)
        planned_ids.append(session.session_id)
    if not view.ready_since_run_started and view.run_finished is None:
        out.append(ProfilerReady(session_ids=planned_ids, ts=started.ts))

    for req in view.requests:
        if req.request_id in view.answers:
            continue
        answer = _answer_request(cfg, view, req, scheduled, barrier)
        out.append(answer)
        if isinstance(answer, StartProfile):
            scheduled.append(answer)

    finished = view.run_finished
    if finished is not None and not view.profiler_finished:
        if view.gave_up_waiting or not outstanding_targets(view, scheduled):
            out.append(
                ProfilerFinished(
                    manifest_path=MANIFEST_NAME, sessions=len(scheduled), ts=finished.ts
                )
            )
    return out


def reference_manifest(
    run_id: str, seen: Sequence[Event | Command], final: bool = False
) -> dict[str, Any]:
    """The manifest implied by the log ``seen`` (events and control, any merge order).

    ``final`` (or a ProfilerFinished, or the service's give-up warning, in the log) turns
    sessions still ``scheduled``/``running`` into ``missing`` (or ``not_reached``).
    """
    view = fold_log(seen)
    final = final or view.profiler_finished or view.gave_up_waiting
    last_step = view.run_finished.steps if view.run_finished is not None else None
    entries: dict[tuple[str, str, int], dict[str, Any]] = {}

    for msg in seen:
        if isinstance(msg, StartProfile) and view.sent.get(msg.session_id) is msg:
            for role, rank in expected_targets(msg.roles, view.replicas, msg.ranks):
                entries.setdefault(
                    (msg.session_id, role, rank),
                    {
                        "id": msg.session_id,
                        "role": role,
                        "rank": rank,
                        "first_step": msg.first_step,
                        "last_step": msg.last_step,
                        "tool": msg.tool,
                        "path": "",
                        "bytes": 0,
                        "status": "scheduled",
                        "request_id": msg.request_id,
                    },
                )
    for msg in seen:
        if isinstance(msg, ProfileStarted):
            entry = entries.get((msg.session_id, msg.role, msg.rank))
            if entry is not None and entry["status"] == "scheduled":
                entry["status"] = "running"
        elif isinstance(msg, ProfileStopped):
            key = (msg.session_id, msg.role, msg.rank)
            entry = entries.setdefault(
                key, {"id": msg.session_id, "role": msg.role, "rank": msg.rank, "request_id": ""}
            )
            if entry.get("status") == "ok" and (msg.status or "ok") != "ok":
                continue  # a restarted component's "missed" never hides a written trace
            entry.update(
                first_step=msg.first_step,
                last_step=msg.last_step,
                tool=msg.tool,
                path=_relative_trace_path(msg.path),
                bytes=msg.bytes,
                status=msg.status or "ok",
                duration_s=msg.duration_s,
            )
    if final:
        for entry in entries.values():
            if entry["status"] in ("scheduled", "running"):
                never_started = last_step is not None and entry["first_step"] > last_step
                entry["status"] = "not_reached" if never_started else "missing"
    return {"run_id": run_id, "sessions": list(entries.values())}


