"""Property tests of the profiler service's pure decision core (no Redis, no I/O).

Decisions are a function of the config and the folded log: :func:`decide` here folds a log
and decides (as a freshly started service does); :func:`serve` plays a running service that
folds one entry at a time and decides after each, as ``profiler_service.service`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler_service import schedule
from profiler_service.manifest import build_manifest
from profiler_service.records import TraceChecked
from profiler_service.request import parse_spec
from profiler_service.schedule import (
    PROFILER_SOURCE,
    SESSIONS_MISSING_CODE,
    expected_targets,
    is_safe_label,
    plan_sessions,
    safe_label,
    sessions_overlap,
    step_runs,
)
from profiler_service.state import apply, fold
from runconfig.schema import ProfilerConfig
from runschema.messages import (
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

TOTAL = 30

Log = list[Event | Command]


def decide(
    cfg: ProfilerConfig, log: Sequence[Event | Command], barrier: int = 0
) -> list[Command | Event]:
    """What a service that has just read ``log`` publishes."""
    return schedule.decide(cfg, fold(log), barrier)


def run_started(total: int = TOTAL, replicas: int = 1, ts: float = 100.0) -> RunStarted:
    return RunStarted(
        run_id="r1",
        config={"trainer": {"total_training_steps": total}, "rollout": {"replicas": replicas}},
        ts=ts,
    )


def cfg_of(
    steps: Sequence[int],
    continuous: bool = False,
    roles: Sequence[str] = ("trainer", "rollouter"),
    ranks: Sequence[int] = (),
    tool: str | None = "torch",
) -> ProfilerConfig:
    return ProfilerConfig(
        tool=tool,  # type: ignore[arg-type]
        steps=list(steps),
        profile_continuous_steps=continuous,
        roles=list(roles),  # type: ignore[arg-type]
        ranks=list(ranks),
    )


def starts(msgs: Sequence[object]) -> list[StartProfile]:
    return [m for m in msgs if isinstance(m, StartProfile)]


def files_found(log: Log) -> list[Event | Command | TraceChecked]:
    """``log`` and the service's check of every stop's trace file, all found."""
    return [*log, *(TraceChecked(session_id=m.session_id, role=m.role, rank=m.rank, stopped=m)
                     for m in log if isinstance(m, ProfileStopped))]


def stop_all(session: StartProfile, replicas: int) -> list[ProfileStopped]:
    return [
        ProfileStopped(
            session_id=session.session_id,
            role=role,
            rank=rank,
            first_step=session.first_step,
            last_step=session.last_step,
            tool=session.tool,
            path=f"{role}{rank}-{session.session_id}.json.gz",
            bytes=10,
            duration_s=0.5,
            ts=1.0,
        )
        for role, rank in expected_targets(session.roles, replicas, session.ranks)
    ]


step_lists = st.lists(st.integers(1, TOTAL), min_size=1, max_size=12, unique=True)
role_lists = st.lists(st.sampled_from(["trainer", "rollouter"]), min_size=1, unique=True)
rank_lists = st.lists(st.integers(0, 3), max_size=3, unique=True)


# --------------------------------------------------------------------------- planning


@settings(deadline=None)
@given(steps=step_lists, continuous=st.booleans(), roles=role_lists, replicas=st.integers(1, 3))
def test_every_step_covered_once_per_role(
    steps: list[int], continuous: bool, roles: list[str], replicas: int
) -> None:
    sessions = plan_sessions(cfg_of(steps, continuous, roles), replicas)
    for role in roles:
        mine = [s for s in sessions if role in s.roles]
        covered = [k for s in mine for k in range(s.first_step, s.last_step + 1)]
        assert sorted(covered) == sorted(steps)  # exactly once each, nothing else
    if 1 in steps:
        assert sessions[0].first_step == 1


@settings(deadline=None)
@given(steps=step_lists, continuous=st.booleans(), roles=role_lists)
def test_sessions_never_overlap_and_ids_unique(
    steps: list[int], continuous: bool, roles: list[str]
) -> None:
    sessions = plan_sessions(cfg_of(steps, continuous, roles), 2)
    assert len({s.session_id for s in sessions}) == len(sessions)
    for i, a in enumerate(sessions):
        assert is_safe_label(a.session_id)
        for b in sessions[i + 1 :]:
            assert not sessions_overlap(a, b)


@settings(deadline=None)
@given(steps=step_lists)
def test_discrete_is_one_session_per_step_continuous_one_per_run(steps: list[int]) -> None:
    assert len(plan_sessions(cfg_of(steps, False), 1)) == len(steps)
    assert len(plan_sessions(cfg_of(steps, True), 1)) == len(step_runs(steps))


def test_continuous_2_3_is_one_session_discrete_two() -> None:
    cont = plan_sessions(cfg_of([2, 3], True), 1)
    assert [(s.session_id, s.first_step, s.last_step) for s in cont] == [("s2-3", 2, 3)]
    disc = plan_sessions(cfg_of([3, 2], False), 1)
    assert [(s.session_id, s.first_step, s.last_step) for s in disc] == [
        ("s2-2", 2, 2),
        ("s3-3", 3, 3),
    ]


def test_tool_null_plans_and_decides_nothing() -> None:
    cfg = cfg_of([1, 2], tool=None)
    assert plan_sessions(cfg, 1) == []
    log: Log = [
        run_started(),
        StepStarted(step=1, param_version=0),
        RunFinished(run_id="r1", steps=2),
    ]
    assert decide(cfg, log) == []
    req = ProfileRequest(request_id="q1", steps=[5], ts=3.0)
    out = decide(cfg, [*log[:2], req])
    assert len(out) == 1 and isinstance(out[0], ProfileRequestRefused)
    assert "tool is null" in out[0].reason


def test_ranks_filter_drops_roles_without_a_rank() -> None:
    # trainer has only rank 0; ranks=[1] leaves the rollouter replica 1 alone.
    sessions = plan_sessions(cfg_of([1], ranks=[1]), replicas=2)
    assert [(s.roles, s.ranks) for s in sessions] == [(["rollouter"], [1])]
    assert expected_targets(sessions[0].roles, 2, sessions[0].ranks) == [("rollouter", 1)]
    assert plan_sessions(cfg_of([1], roles=["trainer"], ranks=[1]), replicas=2) == []


def test_steps_past_the_run_are_not_planned() -> None:
    assert [s.first_step for s in plan_sessions(cfg_of([1, 5, 9]), 1, total_steps=5)] == [1, 5]


def test_safe_label() -> None:
    assert safe_label("ok-1.2_x") == "ok-1.2_x"
    assert safe_label("../../etc/passwd") == "_.._etc_passwd"
    assert safe_label("-rf") == "rf"
    assert safe_label("") == "_"
    assert len(safe_label("x" * 500)) == 64
    assert not is_safe_label("a b") and not is_safe_label("") and not is_safe_label("x" * 65)
    # The whole string: a final newline is not allowed (a `$`-anchored pattern let it by).
    assert not is_safe_label("q1\n") and not is_safe_label("q1\nx")
    assert is_safe_label("q1")


# --------------------------------------------------------------------------- decide at RunStarted


@settings(deadline=None)
@given(steps=step_lists, continuous=st.booleans(), roles=role_lists, replicas=st.integers(1, 3))
def test_run_started_sends_every_session_then_ready(
    steps: list[int], continuous: bool, roles: list[str], replicas: int
) -> None:
    cfg = cfg_of(steps, continuous, roles)
    log: Log = [run_started(replicas=replicas)]
    out = decide(cfg, log)
    assert out[:-1] == plan_sessions(cfg, replicas, TOTAL, ts=100.0)
    assert isinstance(out[-1], ProfilerReady)
    assert out[-1].session_ids == [s.session_id for s in out[:-1]]
    if 1 in steps:
        step1 = [s for s in starts(out) if s.first_step == 1]
        assert len(step1) == 1 and set(step1[0].roles) == set(roles)
    # Replaying gives the same; its own output appended gives nothing new.
    assert decide(cfg, log) == out
    assert decide(cfg, [*log, *out]) == []


def test_nothing_before_run_started() -> None:
    cfg = cfg_of([1])
    assert decide(cfg, []) == []
    # A request read before RunStarted waits for it (the total is not known yet).
    assert decide(cfg, [ProfileRequest(request_id="q1", steps=[3])]) == []


def test_resumed_run_gets_a_second_ready_but_no_duplicate_commands() -> None:
    cfg = cfg_of([1, 2])
    log: Log = [run_started()]
    log += decide(cfg, log)
    log += [StepStarted(step=1, param_version=0), StepStarted(step=2, param_version=1)]
    resumed = RunStarted(run_id="r1", config=run_started().config, resumed=True, ts=200.0)
    out = decide(cfg, [*log, resumed])
    assert out == [ProfilerReady(session_ids=["s1-1", "s2-2"], ts=200.0)]


def test_service_started_after_the_run_finished_sends_no_commands() -> None:
    cfg = cfg_of([1])
    out = decide(cfg, [run_started(), RunFinished(run_id="r1", steps=TOTAL, ts=5.0)])
    assert out == [ProfilerFinished(manifest_path="manifest.json", sessions=0, ts=5.0)]


# --------------------------------------------------------------------------- runtime requests


def test_next_steps_from_the_next_boundary_and_past_step_refused() -> None:
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    log += [StepStarted(step=k, param_version=k - 1) for k in (1, 2, 3)]
    log.append(ProfileRequest(request_id="q1", next_steps=1, ts=7.0))
    out = decide(cfg, log)
    assert out == [
        StartProfile(
            session_id="rq1-s4-4",
            roles=["trainer", "rollouter"],
            tool="torch",
            first_step=4,
            last_step=4,
            request_id="q1",
            ts=7.0,
        )
    ]
    log += out
    log.append(ProfileRequest(request_id="q2", steps=[3], ts=8.0))
    refused = decide(cfg, log)
    assert len(refused) == 1 and isinstance(refused[0], ProfileRequestRefused)
    assert refused[0].request_id == "q2" and "already started" in refused[0].reason


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (ProfileRequest(request_id="q", steps=[31]), "past the run's last step"),
        (ProfileRequest(request_id="q", steps=[5, 7]), "not consecutive"),
        (ProfileRequest(request_id="q", steps=[1]), "overlap session s1-1"),
        (ProfileRequest(request_id="q", steps=[]), "names no step"),
        (ProfileRequest(request_id="q", steps=[5], next_steps=1), "not both"),
        (ProfileRequest(request_id="q", steps=[5], roles=["x"]), "roles must be"),
        (ProfileRequest(request_id="q/../x", steps=[5]), "request id must be"),
        (ProfileRequest(request_id="q", next_steps=TOTAL + 1), "past the run's last step"),
        (ProfileRequest(request_id="q", next_steps=10**12), "at most 1000 steps"),
        (ProfileRequest(request_id="q", next_steps=-1), "must be >= 1"),
        (ProfileRequest(request_id="q", steps=[0]), "1-based"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(request_: ProfileRequest, reason: str) -> None:
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    out = decide(cfg, [*log, request_])
    assert len(out) == 1 and isinstance(out[0], ProfileRequestRefused)
    assert reason in out[0].reason


def test_request_after_run_finished_is_refused() -> None:
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    log += [*stop_all(starts(log)[0], 1), RunFinished(run_id="r1", steps=TOTAL)]
    log += decide(cfg, log)
    out = decide(cfg, [*log, ProfileRequest(request_id="late", steps=[5])])
    assert len(out) == 1 and "finished" in out[0].reason  # type: ignore[union-attr]


def test_request_only_targets_roles_asked_and_overlap_is_per_role() -> None:
    cfg = cfg_of([5], roles=["trainer"])
    log: Log = [run_started()]
    log += decide(cfg, log)
    out = decide(cfg, [*log, ProfileRequest(request_id="q", steps=[5], roles=["rollouter"])])
    assert starts(out) and starts(out)[0].roles == ["rollouter"]


def test_duplicate_request_id_is_answered_once() -> None:
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    req = ProfileRequest(request_id="q", steps=[9])
    log += [req, req]
    out = decide(cfg, log)
    assert len(out) == 1
    assert decide(cfg, [*log, *out, req]) == []


# --------------------------------------------------------------------------- finishing


def test_finished_once_after_run_finished_and_every_stop() -> None:
    cfg = cfg_of([1, 2], continuous=True)
    log: Log = [run_started(replicas=2)]
    log += decide(cfg, log)
    (session,) = starts(log)
    stops = stop_all(session, 2)
    assert len(stops) == 3  # trainer 0, rollouter 0 and 1
    finished = RunFinished(run_id="r1", steps=TOTAL, ts=9.0)
    assert decide(cfg, [*log, *stops]) == []  # all stopped but the run goes on
    assert decide(cfg, [*log, *stops[:2], finished]) == []  # one rollouter still tracing
    out = decide(cfg, [*log, *stops, finished])
    assert out == [ProfilerFinished(manifest_path="manifest.json", sessions=1, ts=9.0)]
    assert decide(cfg, [*log, *stops, finished, *out]) == []


def test_gave_up_waiting_finishes_and_manifest_says_missing() -> None:
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    (session,) = starts(log)
    log += [
        ProfileStarted(session_id="s1-1", role="trainer", rank=0, step=1, tool="torch"),
        stop_all(session, 1)[0],
        RunFinished(run_id="r1", steps=TOTAL),
    ]
    assert decide(cfg, log) == []
    manifest = build_manifest("r1", fold(files_found(log)))
    assert [e["status"] for e in manifest["sessions"]] == ["ok", "scheduled"]
    log.append(WarningRaised(source=PROFILER_SOURCE, code=SESSIONS_MISSING_CODE, message="x"))
    out = decide(cfg, log)
    assert [type(m) for m in out] == [ProfilerFinished]
    manifest = build_manifest("r1", fold(files_found([*log, *out])))
    assert [(e["role"], e["status"], e["path"]) for e in manifest["sessions"]] == [
        ("trainer", "ok", "trainer0-s1-1.json.gz"),
        ("rollouter", "missing", ""),
    ]


def test_sessions_after_the_last_step_are_not_waited_for() -> None:
    cfg = cfg_of([1, 9])
    log: Log = [run_started()]
    log += decide(cfg, log)
    log += [*stop_all(starts(log)[0], 1), RunFinished(run_id="r1", steps=4, status="failed")]
    out = decide(cfg, log)
    assert [type(m) for m in out] == [ProfilerFinished]
    manifest = build_manifest("r1", fold(files_found([*log, *out])))
    statuses = {e["id"]: e["status"] for e in manifest["sessions"]}
    assert statuses == {"s1-1": "ok", "s9-9": "not_reached"}


# --------------------------------------------------------------------------- a whole run, replayed

specs = st.one_of(
    st.integers(1, TOTAL + 2).map(str),
    st.tuples(st.integers(1, TOTAL), st.integers(0, 3)).map(lambda t: f"{t[0]}-{t[0] + t[1]}"),
    st.integers(1, 4).map(lambda n: f"next:{n}"),
)


@st.composite
def runs(draw: st.DrawFn) -> tuple[ProfilerConfig, int, Log]:
    """A config and a trainer-side log: RunStarted, steps, runtime requests, stops, end."""
    cfg = cfg_of(draw(step_lists), draw(st.booleans()), draw(role_lists), draw(rank_lists))
    replicas = draw(st.integers(1, 3))
    last_step = draw(st.integers(0, TOTAL))
    log: Log = [run_started(replicas=replicas)]
    for step in range(1, last_step + 1):
        log.append(StepStarted(step=step, param_version=step - 1, ts=float(step)))
        if draw(st.integers(0, 4)) == 0:
            spec = parse_spec(draw(specs))
            roles = draw(role_lists)
            log.append(
                ProfileRequest(
                    request_id=f"q{step}",
                    steps=list(spec.steps),
                    next_steps=spec.next_steps,
                    roles=roles,
                    ts=float(step),
                )
            )
    if draw(st.booleans()):
        log.append(RunFinished(run_id="r1", steps=last_step, ts=1000.0))
    return cfg, replicas, log


class Service:
    """A service that folds one entry at a time (``state = apply(state, entry)``) and keeps
    nothing else; every step checks that its state is the fold of the whole log so far."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.state = fold(log)  # a service starting on this log reads it whole

    def add(self, msg: Event | Command) -> None:
        self.log.append(msg)
        self.state = apply(self.state, msg)

    def decide(self, cfg: ProfilerConfig, barrier: int = 0) -> list[Command | Event]:
        assert self.state == fold(self.log)  # incremental == full fold...
        out = schedule.decide(cfg, self.state, barrier)
        assert out == decide(cfg, self.log, barrier)  # ...so the same decisions
        return out


def serve(cfg: ProfilerConfig, inputs: Log, log: Log | None = None, crash_at: int = -1) -> Log:
    """Play the service: after each input entry, decide and append what it publishes.

    With ``crash_at`` a fresh service (no memory but the log) takes over at that point.
    """
    service = Service([] if log is None else log)
    for i, entry in enumerate(inputs):
        service.add(entry)
        if i == crash_at:
            continue  # died before deciding on this entry; the next one catches up
        if i - 1 == crash_at:
            service = Service(service.log)  # the new service folds the log from the start
        for msg in service.decide(cfg):
            service.add(msg)
    return service.log


@settings(max_examples=150, deadline=None)
@given(run=runs(), crash=st.integers(-1, 40))
def test_whole_run_no_duplicates_no_past_steps_no_overlap(
    run: tuple[ProfilerConfig, int, Log], crash: int
) -> None:
    cfg, replicas, inputs = run
    log = serve(cfg, inputs, crash_at=crash)
    log += decide(cfg, log)  # a service restarted after the end catches up once...
    assert decide(cfg, log) == []  # ...and replaying the whole log again gives nothing new

    sent = starts(log)
    assert len({s.session_id for s in sent}) == len(sent)
    for i, a in enumerate(sent):
        assert is_safe_label(a.session_id)
        for b in sent[i + 1 :]:
            assert not sessions_overlap(a, b), (a, b)

    # Every scheduled step is covered: the plan goes out at RunStarted, before step 1. (With
    # the service down at RunStarted, crash == 0, it comes later or, if the run has
    # finished meanwhile, not at all.)
    planned = plan_sessions(cfg, replicas, TOTAL, ts=100.0)
    first_step_entry = next((i for i, m in enumerate(log) if isinstance(m, StepStarted)), None)
    if crash != 0:
        assert [s for s in sent if not s.request_id] == planned
    if first_step_entry is not None and crash != 0:
        ready = next(i for i, m in enumerate(log) if isinstance(m, ProfilerReady))
        assert ready < first_step_entry
        assert all(log.index(s) < ready for s in planned)

    # Each request is answered exactly once, never for a step that had already started.
    requests = [m for m in log if isinstance(m, ProfileRequest)]
    for req in requests:
        answers = [
            (i, m)
            for i, m in enumerate(log)
            if isinstance(m, StartProfile | ProfileRequestRefused)
            and m.request_id == req.request_id
        ]
        assert len(answers) == 1
        index, answer = answers[0]
        if isinstance(answer, StartProfile):
            started_before = [m.step for m in log[:index] if isinstance(m, StepStarted)]
            assert answer.first_step > max(started_before, default=0)
            assert answer.last_step <= TOTAL

    finished = [m for m in log if isinstance(m, ProfilerFinished)]
    assert len(finished) <= 1
    if not any(isinstance(m, RunFinished) for m in log):
        assert not finished


@settings(max_examples=60, deadline=None)
@given(run=runs(), cut=st.integers(0, 60))
def test_restart_mid_run_equals_uninterrupted_service(
    run: tuple[ProfilerConfig, int, Log], cut: int
) -> None:
    cfg, _, inputs = run
    cut = min(cut, len(inputs))
    straight = serve(cfg, inputs)
    # First service handles a prefix; a new one (state = the log only) continues.
    restarted = serve(cfg, inputs[cut:], log=serve(cfg, inputs[:cut]))
    assert restarted == straight


def test_manifest_is_a_pure_fold() -> None:
    cfg = cfg_of([1])
    log: Log = [run_started(replicas=2)]
    log += decide(cfg, log)
    manifest = build_manifest("r1", fold(log))
    assert manifest == {
        "run_id": "r1",
        "sessions": [
            {
                "id": "s1-1",
                "role": role,
                "rank": rank,
                "first_step": 1,
                "last_step": 1,
                "tool": "torch",
                "path": "",
                "bytes": 0,
                "status": "scheduled",
                "request_id": "",
                "missing_steps": [],
            }
            for role, rank in [("trainer", 0), ("rollouter", 0), ("rollouter", 1)]
        ],
    }
    escaping = ProfileStopped(
        session_id="s1-1", role="trainer", rank=0, first_step=1, last_step=1, tool="torch",
        path="../../etc/passwd", bytes=1, duration_s=0.1,
    )
    assert build_manifest("r1", fold([*log, escaping]))["sessions"][0]["path"] == ""


# --------------------------------------------------------------------------- the step barrier


def test_barrier_ahead_of_step_started_moves_requests_on() -> None:
    """At a step boundary the trainer raised the barrier to 4 but StepStarted(4) is not out:
    ``next:1`` is step 5, an explicit step 4 is refused, and without a barrier nothing
    changes."""
    cfg = cfg_of([1])
    log: Log = [run_started()]
    log += decide(cfg, log)
    log += [StepStarted(step=k, param_version=k - 1) for k in (1, 2, 3)]
    nxt = ProfileRequest(request_id="q1", next_steps=2, ts=7.0)
    assert [(s.first_step, s.last_step) for s in starts(decide(cfg, [*log, nxt]))] == [(4, 5)]
    out = decide(cfg, [*log, nxt], barrier=4)
    assert [(s.session_id, s.first_step, s.last_step) for s in starts(out)] == [
        ("rq1-s5-6", 5, 6)
    ]
    explicit = ProfileRequest(request_id="q2", steps=[4], ts=8.0)
    (refused,) = decide(cfg, [*log, explicit], barrier=4)
    assert isinstance(refused, ProfileRequestRefused) and refused.request_id == "q2"
    assert "already begun" in refused.reason
    assert "earliest step a request can profile is 5" in refused.reason
    # An explicit step after the barrier is fine; a barrier behind StepStarted changes nothing.
    ok = ProfileRequest(request_id="q3", steps=[5], ts=9.0)
    assert [s.first_step for s in starts(decide(cfg, [*log, ok], barrier=4))] == [5]
    assert [s.first_step for s in starts(decide(cfg, [*log, nxt], barrier=2))] == [4]
    # Scheduled sessions at RunStarted do not depend on the barrier.
    fresh: Log = [run_started()]
    assert decide(cfg, fresh, barrier=1) == decide(cfg, fresh)


def serve_guarded(
    cfg: ProfilerConfig,
    inputs: Log,
    barriers: Sequence[int],
    moves: Sequence[int],
    log: Log | None = None,
) -> tuple[Log, list[tuple[StartProfile, int]]]:
    """Play the service with the barrier: after input ``i`` it reads ``barriers[i]``, decides,
    and publishes with the guard while the trainer has moved the barrier on by ``moves[i]``
    (a refused command makes it decide again with the barrier as it is now).

    Returns the log and every accepted runtime StartProfile with the barrier it beat. With
    ``log`` it continues a log (a restarted service: no memory but the log).
    """
    service = Service([] if log is None else log)
    accepted: list[tuple[StartProfile, int]] = []
    for entry, read, move in zip(inputs, barriers, moves, strict=True):
        service.add(entry)
        current = read + move  # the barrier when the guarded publishes reach Redis
        barrier = read
        for _ in range(3):
            refused = False
            for msg in service.decide(cfg, barrier):
                if isinstance(msg, StartProfile) and msg.request_id:
                    if msg.first_step <= current:  # publish_guarded refuses it
                        refused = True
                        break
                    accepted.append((msg, current))
                service.add(msg)
            if not refused:
                break
            barrier = current  # re-read
    log = service.log
    return log, accepted


@st.composite
def barrier_runs(draw: st.DrawFn) -> tuple[ProfilerConfig, Log, list[int], list[int]]:
    """A run of :func:`runs` plus, per input, the barrier the service reads (the trainer is
    at step L or already crossed into L+1: L or L+1) and how far it moves before the publish."""
    cfg, _, log = draw(runs())
    barriers: list[int] = []
    moves: list[int] = []
    last = 0
    for msg in log:
        if isinstance(msg, StepStarted):
            last = msg.step
        floor = max(last, barriers[-1] + moves[-1] if barriers else 0)
        barriers.append(draw(st.integers(floor, floor + 1)))
        moves.append(draw(st.integers(0, 1)))
    return cfg, log, barriers, moves


@settings(max_examples=150, deadline=None)
@given(run=barrier_runs())
def test_guarded_answers_never_for_a_begun_step_and_replay_is_idempotent(
    run: tuple[ProfilerConfig, Log, list[int], list[int]],
) -> None:
    cfg, inputs, barriers, moves = run
    log, accepted = serve_guarded(cfg, inputs, barriers, moves)
    # Every accepted runtime command is for steps after the barrier at its publish.
    for cmd, barrier in accepted:
        assert cmd.first_step > barrier, (cmd, barrier)
        assert cmd.session_id == f"r{cmd.request_id}-s{cmd.first_step}-{cmd.last_step}"
    # Each request is answered exactly once (a refused publish is decided again at once).
    for req in [m for m in log if isinstance(m, ProfileRequest)]:
        answers = [
            m
            for m in log
            if isinstance(m, StartProfile | ProfileRequestRefused)
            and m.request_id == req.request_id
        ]
        assert len(answers) == 1, (req, answers)
    # Replay: once everything is answered, the log plus any barrier gives the same result.
    final = barriers[-1] + moves[-1]
    log += decide(cfg, log, final)
    for barrier in (0, final, final + 5):
        assert decide(cfg, log, barrier) == []
    # A restarted service (the log only) with the same barriers continues identically.
    cut = len(inputs) // 2
    first, _ = serve_guarded(cfg, inputs[:cut], barriers[:cut], moves[:cut])
    restarted, _ = serve_guarded(cfg, inputs[cut:], barriers[cut:], moves[cut:], log=first)
    straight, _ = serve_guarded(cfg, inputs, barriers, moves)
    assert restarted == straight


def test_every_trainer_rank_is_expected_and_global_profiler_ranks_picks_among_them() -> None:
    assert expected_targets(["trainer", "rollouter"], 1, trainers=2) == [
        ("trainer", 0), ("trainer", 1), ("rollouter", 0)]
    assert expected_targets(["trainer"], 1, [1], trainers=2) == [("trainer", 1)]
    assert expected_targets(["trainer"], 1, [1]) == []  # one trainer rank: rank 0 only
