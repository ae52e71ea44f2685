"""Property tests of the profiler service's state: ``state = fold(log)`` folded one entry at a
time (no Redis, no I/O).

* folding from any split point (a prefix, then the rest one entry at a time) gives the same
  state as folding the whole log, and ``apply`` never changes the state it is given;
* decisions and the manifest computed from the incremental state are those of the whole
  log, and those of an independent oracle (``tests/profiler_reference.py`` restates the
  documented rules and recomputes everything from the whole log on every call, sharing no
  logic with ``profiler_service``), the Redis clock, request expiry, the step barrier and
  runs started with profiling off included;
* a snapshot of the state, decoded and folded on, is the state of the whole log;
* the persistent map behaves like a dict, hash collisions included;
* a runtime request is refused, never served, once it is older than its own timeout (judged
  by the Redis clock and its entry id), and when the run's config has profiling off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler_service.manifest import build_manifest
from profiler_service.pmap import PMap
from profiler_service.records import ServiceState, TraceChecked
from profiler_service.schedule import PROFILER_SOURCE, SESSIONS_MISSING_CODE, decide
from profiler_service.snapshot import Snapshot, decode_snapshot, encode_snapshot
from profiler_service.state import apply, fold
from runconfig.schema import ProfilerConfig
from runschema.messages import (
    BlobRef,
    CheckpointSaved,
    Command,
    ComponentFailed,
    Event,
    Heartbeat,
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
    WeightsPublished,
)
from tests.profiler_reference import reference_decide, reference_manifest

TOTAL = 30
msgspec_replace = msgspec.structs.replace
Fact = Event | Command
Item = Fact | tuple[str, Fact]

SESSION_IDS = ["s1-1", "s2-3", "rq1-s4-4", "odd"]
# "q4\n" looks safe to a regular expression anchored with `$` (it matches before a final
# newline); the documented rule refuses it.
REQUEST_IDS = ["q1", "q2", "q3", "bad/id", "q4\n"]
ROLE_NAMES = ["trainer", "rollouter"]


def run_started(
    replicas: int, ts: float = 100.0, resumed: bool = False, profiling: bool = True
) -> RunStarted:
    config: dict[str, Any] = {
        "trainer": {"total_training_steps": TOTAL}, "rollout": {"replicas": replicas},
    }
    if not profiling:  # the run's own components hold no profiler
        config["global_profiler"] = {"tool": None}
    return RunStarted(run_id="r1", config=config, ts=ts, resumed=resumed)


def cfg_of(
    steps: Sequence[int], continuous: bool, roles: Sequence[str], ranks: Sequence[int] = ()
) -> ProfilerConfig:
    return ProfilerConfig(
        tool="torch",
        steps=list(steps),
        profile_continuous_steps=continuous,
        roles=list(roles),  # type: ignore[arg-type]
        ranks=list(ranks),
    )


# --------------------------------------------------------------------------- strategies

steps_ = st.integers(1, TOTAL)
roles_ = st.lists(st.sampled_from(ROLE_NAMES), min_size=1, max_size=2, unique=True)
ranks_ = st.integers(0, 1)


@st.composite
def start_profiles(draw: st.DrawFn) -> StartProfile:
    first = draw(steps_)
    return StartProfile(
        session_id=draw(st.sampled_from(SESSION_IDS)),
        roles=draw(roles_),
        tool="torch",
        first_step=first,
        last_step=first + draw(st.integers(0, 2)),
        ranks=draw(st.lists(ranks_, max_size=2, unique=True)),
        request_id=draw(st.sampled_from(["", "", *REQUEST_IDS])),
        ts=1.0,
    )


@st.composite
def requests(draw: st.DrawFn) -> ProfileRequest:
    if draw(st.booleans()):
        first = draw(st.sampled_from([0, 1, 2, 3, 5, 9, 12, TOTAL, TOTAL + 1]))
        steps = list(range(first, first + draw(st.integers(0, 3))))
        next_steps = 0
    else:
        steps, next_steps = [], draw(st.integers(-1, 4))
    return ProfileRequest(
        request_id=draw(st.sampled_from(REQUEST_IDS)),
        steps=steps,
        next_steps=next_steps,
        roles=draw(st.lists(st.sampled_from([*ROLE_NAMES, "x"]), max_size=2, unique=True)),
        ts=2.0,
        timeout_s=draw(st.sampled_from([0.05, 1.0, 30.0])),
    )


@st.composite
def stops(draw: st.DrawFn) -> ProfileStopped:
    first = draw(steps_)
    return ProfileStopped(
        session_id=draw(st.sampled_from(SESSION_IDS)),
        role=draw(st.sampled_from(ROLE_NAMES)),
        rank=draw(ranks_),
        first_step=first,
        last_step=first,
        tool="torch",
        path=draw(st.sampled_from(["t.json.gz", "../x", "/abs", ""])),
        bytes=draw(st.integers(0, 100)),
        duration_s=0.5,
        status=draw(st.sampled_from(["ok", "", "missed", "error: boom"])),
        ts=3.0,
    )


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, ref=BlobRef("redis", "k", 1, "0" * 64), ts=1.0)


small_steps = st.integers(1, 8)
profile_started = st.builds(
    lambda sid, role, rank, step: ProfileStarted(
        session_id=sid, role=role, rank=rank, step=step, tool="torch", ts=1.0
    ),
    st.sampled_from(SESSION_IDS), st.sampled_from(ROLE_NAMES), ranks_, steps_,
)
rare: st.SearchStrategy[Fact] = st.one_of(
    st.integers(1, 2).map(lambda r: run_started(r, ts=200.0, resumed=True)),
    st.just(run_started(1, ts=300.0, resumed=True, profiling=False)),
    st.just(ProfilerReady(session_ids=[], ts=1.0)),
    steps_.map(lambda s: RunFinished(run_id="r1", steps=s, ts=9.0)),
    st.just(WarningRaised(source=PROFILER_SOURCE, code=SESSIONS_MISSING_CODE, message="m",
                          ts=1.0)),
    st.just(WarningRaised(source="trainer", code="other", message="m", ts=1.0)),
    st.just(ProfilerFinished(manifest_path="manifest.json", sessions=0, ts=1.0)),
    st.sampled_from(REQUEST_IDS).map(
        lambda rid: ProfileRequestRefused(request_id=rid, reason="no", ts=1.0)
    ),
    # Entries the service does not care about.
    steps_.map(lambda s: StepFinished(step=s, sample_ids=[], metrics={}, duration_s=0.1,
                                      ts=1.0)),
    steps_.map(_weights),
    steps_.map(lambda s: CheckpointSaved(step=s, path="c", param_version=s, ts=1.0)),
    st.just(Heartbeat(role="trainer", rank=0, pid=1, ts=1.0)),
)
# A process dying or restarting inside its sessions.
deaths: st.SearchStrategy[Fact] = st.one_of(
    steps_.map(lambda s: TrainerResumed(step=s, param_version=s, checkpoint_step=0,
                                        replayed_steps=0, ts=1.0)),
    st.builds(lambda role, rank: ComponentFailed(role=role, rank=rank, error="boom", ts=1.0),
              st.sampled_from(ROLE_NAMES), ranks_),
)
facts: st.SearchStrategy[Fact] = st.one_of(
    start_profiles(),
    requests(),
    profile_started,
    stops(),
    small_steps.map(lambda s: StepStarted(step=s, param_version=s - 1, ts=1.0)),
    start_profiles(),
    profile_started,
    stops(),
    requests(),
    rare,
    rare,
    deaths,
)


@st.composite
def logs(draw: st.DrawFn, max_size: int = 40) -> list[Item]:
    """A merged log: events as ``(entry id, msg)`` with increasing Redis ms, commands bare
    (the control stream's entries carry no events id)."""
    items: list[Item] = []
    ms = 1_000_000
    body = draw(st.lists(facts, min_size=min(5, max_size), max_size=max_size))
    if draw(st.integers(0, 3)):  # most logs start with the run
        body.insert(0, run_started(draw(st.integers(1, 2))))
    # The service's checks of the trace files of stops (each right after the stop, or later).
    for i in reversed(range(len(body))):
        msg = body[i]
        if isinstance(msg, ProfileStopped) and draw(st.integers(0, 2)):
            check = TraceChecked(session_id=msg.session_id, role=msg.role, rank=msg.rank,
                                 stopped=msg, problem=draw(st.sampled_from(["", "", "gone"])))
            body.insert(draw(st.integers(i + 1, len(body))), check)
    for msg in body:
        ms += draw(st.integers(0, 2000))
        if isinstance(msg, StartProfile | TraceChecked):
            items.append(msg)
        else:
            items.append((f"{ms}-0", msg))
    return items


@st.composite
def session_lives(draw: st.DrawFn) -> list[Item]:
    """A run with a few sessions sent, then what their own processes report (runs begun,
    again by a successor, stops of any status), the processes dying or restarting in
    between (ComponentFailed, TrainerResumed, a resumed RunStarted), the service's file
    checks of the stops, and sometimes the run's end: the lives the manifest describes."""
    replicas = draw(st.integers(1, 2))
    body: list[Fact] = [run_started(replicas)]
    cmds = []
    for i in range(draw(st.integers(1, 3))):
        first = draw(st.integers(1, 8))
        cmds.append(StartProfile(session_id=f"s{i}", roles=draw(roles_), tool="torch",
                                 first_step=first, last_step=first + draw(st.integers(0, 5)),
                                 ranks=[], ts=1.0))
    body += cmds
    for _ in range(draw(st.integers(1, 25))):
        cmd = draw(st.sampled_from(cmds))
        role = draw(st.sampled_from(cmd.roles))
        rank = 0 if role == "trainer" else draw(st.integers(0, replicas))  # one too many
        step = draw(st.integers(cmd.first_step - 1, cmd.last_step + 1))
        kind = draw(st.integers(0, 5))
        if kind <= 1:
            body.append(ProfileStarted(session_id=cmd.session_id, role=role, rank=rank,
                                       step=step, tool="torch", ts=1.0))
        elif kind <= 3:
            stop = ProfileStopped(
                session_id=cmd.session_id, role=role, rank=rank,
                first_step=step, last_step=draw(st.integers(step, max(step, cmd.last_step))),
                tool="torch", path=f"{role}{rank}-{cmd.session_id}.json.gz", bytes=10,
                duration_s=0.5, status=draw(st.sampled_from(["ok", "ok", "missed",
                                                              "cancelled", "error: x"])),
                ts=3.0)
            body.append(stop)
            if draw(st.integers(0, 3)):
                body.append(TraceChecked(session_id=stop.session_id, role=role, rank=rank,
                                         stopped=stop,
                                         problem=draw(st.sampled_from(["", "", "gone"]))))
        elif kind == 4:
            body.append(draw(deaths))
        else:
            body.append(draw(st.one_of(
                st.just(run_started(replicas, ts=200.0, resumed=True)),
                st.integers(1, 12).map(lambda s: RunFinished(run_id="r1", steps=s, ts=9.0)),
                st.integers(1, 12).map(lambda s: StepStarted(step=s, param_version=s - 1,
                                                             ts=1.0)))))
    items: list[Item] = []
    for n, msg in enumerate(body):
        items.append(msg if isinstance(msg, StartProfile | TraceChecked)
                     else (f"{1_000_000 + n}-0", msg))
    return items


@settings(max_examples=400, deadline=None)
@given(log=session_lives(), final=st.booleans(), cut=st.integers(0, 60))
def test_sessions_lives_manifest_as_the_oracle_and_fold_from_any_cut(
    log: list[Item], final: bool, cut: int
) -> None:
    """Deaths and restarts inside sessions, file checks, foreign reports: the manifest is the
    oracle's at every prefix, and a snapshot at any cut folds on to the same state."""
    for i in range(len(log) + 1):
        assert build_manifest("r1", fold(log[:i]), final) == reference_manifest("r1", log[:i],
                                                                                 final)
    cut = min(cut, len(log))
    decoded = decode_snapshot(encode_snapshot(Snapshot(state=fold(log[:cut]), run_id="r1",
                                                       events_position="1-0")))
    assert decoded is not None
    assert fold(log[cut:], decoded.state) == fold(log)


def msgs_of(log: Sequence[Item]) -> list[Fact]:
    return [item[1] if isinstance(item, tuple) else item for item in log]


configs = st.builds(
    cfg_of,
    st.lists(steps_, max_size=6, unique=True),
    st.booleans(),
    roles_,
    st.sampled_from([[], [], [0], [1], [0, 1], [3]]),  # 3: past the replicas (may join)
)


# Runtime requests on a live run, drawn near every boundary a rule has: the last started
# step, the barrier, the run's last step, the id's length limit, a request's age limit.
LONG_IDS = ["x" * 40, "y" * 41]
# Mostly sound roles and ids, so that most requests reach the rules about their steps.
request_roles = st.sampled_from([["trainer", "rollouter"], ["trainer"], ["rollouter"],
                                 ["rollouter", "trainer"], ["trainer", "rollouter"],
                                 ["trainer"], ["rollouter"], [], ["x"], ["trainer", "x"]])
request_ids = st.sampled_from(["q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", *LONG_IDS,
                               "bad/id"])


@st.composite
def request_runs(draw: st.DrawFn) -> tuple[list[Item], int, int | None]:
    """``(log, barrier, now_ms)``: a started run, its steps so far, a few sessions already
    sent, then pending requests with distinct ids (nothing answers them yet)."""
    ms = 1_000_000
    items: list[Item] = [(f"{ms}-0", run_started(draw(st.integers(1, 2)),
                                                profiling=draw(st.integers(0, 19)) > 0))]
    started = draw(st.integers(0, 10))
    steps: list[Item] = []
    for k in range(1, started + 1):
        ms += 10
        steps.append((f"{ms}-0", StepStarted(step=k, param_version=k - 1, ts=1.0)))
    # Sessions sent at any point of the run so far: later steps close some of them.
    for i in range(draw(st.integers(0, 3))):
        first = draw(st.one_of(st.integers(1, TOTAL), st.integers(max(1, started - 3),
                                                                  started + 2)))
        steps.insert(draw(st.integers(0, len(steps))), StartProfile(
            session_id=f"s{i}", roles=draw(roles_), tool="torch", first_step=first,
            last_step=first + draw(st.integers(0, 3)), ranks=draw(st.sampled_from([[], [1]])),
            ts=1.0))
    items += steps
    if draw(st.integers(0, 19)) == 0:
        items.append((f"{ms}-1", RunFinished(run_id="r1", steps=started, ts=9.0)))
    barrier = started + draw(st.sampled_from([0, 0, 1, 2, 5]))
    near = [0, 1, started, started + 1, started + 2, barrier, barrier + 1, TOTAL, TOTAL + 1]
    timeouts = [0.05, 1.0, 30.0]
    ids = draw(st.lists(request_ids, min_size=1, max_size=4, unique=True))
    for rid in ids:
        ms += draw(st.integers(0, 50))
        if draw(st.booleans()):
            first = draw(st.sampled_from(near))
            steps = sorted(set(range(first, first + draw(st.sampled_from([0, 1, 1, 2, 3])))) | set(
                draw(st.lists(st.sampled_from(near), max_size=1))))
            req = ProfileRequest(request_id=rid, steps=steps, roles=draw(request_roles),
                                 timeout_s=draw(st.sampled_from(timeouts)), ts=2.0)
        else:
            req = ProfileRequest(request_id=rid, next_steps=draw(st.integers(-1, 3)),
                                 roles=draw(request_roles),
                                 timeout_s=draw(st.sampled_from(timeouts)), ts=2.0)
        items.append((f"{ms}-0", req))
    # The clock: none, or right at one request's age limit (-1, 0 or +1 ms), or far past.
    now_ms: int | None = None
    if draw(st.integers(0, 2)) == 0:
        arrival = draw(st.sampled_from([i for i in items if isinstance(i, tuple)
                                        and isinstance(i[1], ProfileRequest)]))
        limit = int(arrival[0].split("-")[0]) + int(arrival[1].timeout_s * 1000)
        now_ms = limit + draw(st.sampled_from([-1, 0, 1, 10**6]))
    return items, barrier, now_ms



# --------------------------------------------------------------------------- fold = repeated apply


@settings(max_examples=300, deadline=None)
@given(log=logs(), cut=st.integers(0, 40))
def test_fold_equals_prefix_then_apply_the_rest(log: list[Item], cut: int) -> None:
    cut = min(cut, len(log))
    state = fold(log[:cut])
    for item in log[cut:]:
        state = apply(state, item[1], item[0]) if isinstance(item, tuple) else apply(state, item)
    assert state == fold(log)
    assert fold(log[cut:], fold(log[:cut])) == fold(log)


@settings(max_examples=200, deadline=None)
@given(log=logs())
def test_apply_never_changes_the_state_it_is_given(log: list[Item]) -> None:
    states = [ServiceState()]
    for item in log:
        states.append(fold([item], states[-1]))
    # Every intermediate state is still the fold of its prefix after all the later applies.
    for i, state in enumerate(states):
        assert state == fold(log[:i])


@given(step=steps_)
def test_entries_the_service_ignores_return_the_same_state(step: int) -> None:
    finished = StepFinished(step=step, sample_ids=[], metrics={}, duration_s=0.1)
    state = fold([run_started(1), StepStarted(step=step, param_version=0), finished])
    for msg in (
        finished,  # not past the highest finished step (it is noted: RunFinished names it)
        _weights(step),
        CheckpointSaved(step=step, path="c", param_version=step),
        Heartbeat(role="rollouter", rank=0, pid=1),
        StepStarted(step=step, param_version=0),  # not past the highest step: no change
        WarningRaised(source="trainer", code="x", message="y"),
    ):
        assert apply(state, msg) is state


@settings(max_examples=200, deadline=None)
@given(cfg=configs, log=logs(), barrier=st.integers(0, 4), clock=st.integers(0, 5000))
def test_incremental_decisions_equal_decisions_from_the_full_fold(
    cfg: ProfilerConfig, log: list[Item], barrier: int, clock: int
) -> None:
    state = ServiceState()
    for i, item in enumerate(log):
        state = fold([item], state)
        last_ms = max((int(x[0].split("-")[0]) for x in log[: i + 1] if isinstance(x, tuple)),
                      default=1_000_000)
        now_ms = last_ms + clock
        assert decide(cfg, state, barrier, now_ms) == decide(cfg, fold(log[: i + 1]), barrier,
                                                             now_ms)


def _clock(log: Sequence[Item], after_ms: int | None) -> int | None:
    """A Redis clock ``after_ms`` past the log's last events entry (None: no clock)."""
    if after_ms is None:
        return None
    last = max((int(x[0].split("-")[0]) for x in log if isinstance(x, tuple)), default=1_000_000)
    return last + after_ms


@settings(max_examples=400, deadline=None)
@given(cfg=configs, log=logs(), barrier=st.integers(0, 4), final=st.booleans(),
       clock=st.one_of(st.none(), st.integers(0, 5000)))
def test_same_decisions_and_manifest_as_the_independent_oracle(
    cfg: ProfilerConfig, log: list[Item], barrier: int, final: bool, clock: int | None
) -> None:
    """The service's decisions and manifest on any log, barrier and Redis clock are those
    the oracle derives from the documented rules."""
    state = fold(log)
    now_ms = _clock(log, clock)
    assert decide(cfg, state, barrier, now_ms) == reference_decide(cfg, log, barrier, now_ms)
    assert build_manifest("r1", state, final=final) == reference_manifest("r1", log, final)


@settings(max_examples=400, deadline=None)
@given(cfg=configs, run=request_runs())
def test_requests_on_a_live_run_judged_as_the_oracle_judges_them(
    cfg: ProfilerConfig, run: tuple[list[Item], int, int | None]
) -> None:
    """Every refusal rule and the accepted sessions, at their boundaries: the same answers,
    reasons included, as the oracle; requests answered in one decision block each other."""
    log, barrier, now_ms = run
    got = decide(cfg, fold(log), barrier, now_ms)
    assert got == reference_decide(cfg, log, barrier, now_ms)


_S11 = StartProfile(session_id="s1-1", roles=ROLE_NAMES, tool="torch", first_step=1,
                   last_step=1, ts=1.0)
_STOP = ProfileStopped(session_id="s1-1", role="trainer", rank=0, first_step=1, last_step=1,
                       tool="torch", path="t.json.gz", bytes=1, duration_s=0.1, ts=1.0)
_GAVE_UP = WarningRaised(source=PROFILER_SOURCE, code=SESSIONS_MISSING_CODE, message="m",
                         ts=1.0)
TRICKY: list[list[Fact]] = [
    # A second RunFinished (a resumed run that ended again) resets the give-up.
    [run_started(1), _S11, RunFinished(run_id="r1", steps=5), _GAVE_UP,
     RunFinished(run_id="r1", steps=6)],
    # A give-up before any RunFinished means nothing.
    [run_started(1), _S11, _GAVE_UP, RunFinished(run_id="r1", steps=5)],
    # Reports before the command (the control stream may be merged in anywhere).
    [run_started(2), _STOP, ProfileStarted(session_id="s1-1", role="rollouter", rank=1, step=1,
                                           tool="torch"), _S11],
    # An answer before its request; a duplicate request; a resumed run.
    [run_started(1), StartProfile(session_id="rq1-s4-4", roles=["trainer"], tool="torch",
                                  first_step=4, last_step=4, request_id="q1", ts=1.0),
     ProfileRequest(request_id="q1", steps=[4]), ProfileRequest(request_id="q2", steps=[4]),
     ProfileRequest(request_id="q2", steps=[9]), run_started(1, ts=5.0, resumed=True)],
    # A StepStarted closes the sessions that end at it (s1-2), not the one that ends at the
    # next step (s3-3): a request for step 3 still overlaps that one.
    [run_started(1),
     StartProfile(session_id="s1-2", roles=["trainer"], tool="torch", first_step=1,
                  last_step=2, ts=1.0),
     StartProfile(session_id="s3-3", roles=["trainer"], tool="torch", first_step=3,
                  last_step=3, ts=1.0),
     StepStarted(step=1, param_version=0), StepStarted(step=2, param_version=1),
     ProfileRequest(request_id="q3", steps=[3], roles=["trainer"])],
    # Two stops of one process: the last one wins, in the first one's place.
    [run_started(1), _S11, _STOP, msgspec_replace(_STOP, status="error: x"),
     RunFinished(run_id="r1", steps=1)],
]


@settings(max_examples=20, deadline=None)
@given(cfg=configs, which=st.integers(0, len(TRICKY) - 1), final=st.booleans())
def test_tricky_logs_same_as_recomputing_from_the_whole_log(
    cfg: ProfilerConfig, which: int, final: bool
) -> None:
    log = TRICKY[which]
    for i in range(len(log) + 1):
        state = fold(log[:i])
        assert decide(cfg, state) == reference_decide(cfg, log[:i])
        assert build_manifest("r1", state, final) == reference_manifest("r1", log[:i], final)


@settings(max_examples=100, deadline=None)
@given(cfg=configs, log=logs(max_size=60), cut=st.integers(0, 60), barrier=st.integers(0, 4))
def test_a_whole_run_served_incrementally_equals_the_reference_service(
    cfg: ProfilerConfig, log: list[Item], cut: int, barrier: int
) -> None:
    """Play both services on the same inputs (each publishes what it decides after every
    entry); one folds incrementally and restarts from a snapshot at ``cut``, the other is
    the oracle, recomputing from the whole log. Their logs come out identical."""
    inputs = msgs_of(log)
    ours: list[Fact] = []
    theirs: list[Fact] = []
    state = ServiceState()
    for i, msg in enumerate(inputs):
        if i == cut:  # a restart from a snapshot of what was folded so far
            decoded = decode_snapshot(encode_snapshot(Snapshot(
                state=state, run_id="r1", events_position="1-0")))
            assert decoded is not None
            state = decoded.state
        ours.append(msg)
        state = apply(state, msg)
        for out in decide(cfg, state, barrier):
            ours.append(out)
            state = apply(state, out)
        theirs.append(msg)
        theirs += reference_decide(cfg, theirs, barrier)
    assert ours == theirs
    assert state == fold(ours)


# --------------------------------------------------------------------------- snapshots


@settings(max_examples=200, deadline=None)
@given(log=logs(), cut=st.integers(0, 40))
def test_snapshot_round_trip_then_fold_on(log: list[Item], cut: int) -> None:
    cut = min(cut, len(log))
    snapshot = Snapshot(state=fold(log[:cut]), run_id="r1", events_position="5-1",
                        control_position="4-0")
    decoded = decode_snapshot(encode_snapshot(snapshot))
    assert decoded == snapshot
    assert fold(log[cut:], decoded.state) == fold(log)


def test_a_file_that_is_not_a_snapshot_is_ignored() -> None:
    assert decode_snapshot(b"") is None
    assert decode_snapshot(b"\x81\xa1x\x01") is None
    good = encode_snapshot(Snapshot(state=ServiceState(), run_id="r", events_position="1-0"))
    assert decode_snapshot(good[:-3]) is None


# --------------------------------------------------------------------------- the persistent map


class Key:
    """A key whose hash the test chooses, to force deep paths and full collisions."""

    def __init__(self, name: int, h: int) -> None:
        self.name = name
        self.h = h

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:  # equal keys have equal hashes, as they must
        return isinstance(other, Key) and (other.name, other.h) == (self.name, self.h)

    def __repr__(self) -> str:
        return f"Key({self.name}, {self.h:#x})"


hashes = st.sampled_from([0, 1, 32, 1 << 60, (1 << 60) | 1, -1, -2, 7 << 55, 2**63 - 1])
keys = st.one_of(
    st.integers(-50, 50),
    st.text(max_size=3),
    st.builds(Key, st.integers(0, 20), hashes),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(keys, st.integers(0, 3)), max_size=60))
def test_pmap_behaves_like_a_dict_and_never_changes_a_version(
    ops: list[tuple[Any, int]],
) -> None:
    versions: list[tuple[PMap[Any, int], dict[Any, int]]] = [(PMap(), {})]
    for key, value in ops:
        pmap, model = versions[-1]
        versions.append((pmap.set(key, value), {**model, key: value}))
    for pmap, model in versions:  # every older version is untouched
        assert len(pmap) == len(model)
        assert dict(pmap.items()) == model
        assert sorted(map(repr, pmap)) == sorted(map(repr, model))
        for key, value in model.items():
            assert key in pmap and pmap[key] == value and pmap.get(key) == value
        assert pmap == PMap(model.items())
    missing = Key(99, 0)
    assert missing not in versions[-1][0] and versions[-1][0].get(missing, "d") == "d"


def test_pmap_set_to_the_same_value_is_the_same_map() -> None:
    value = object()
    pmap = PMap([("a", value)])
    assert pmap.set("a", value) is pmap
    assert pmap.set("a", object()) is not pmap


# --------------------------------------------------------------------------- expiry and tool off


CFG = cfg_of([1], False, ROLE_NAMES)


def _started_log() -> list[Item]:
    log: list[Item] = [("1000-0", run_started(1))]
    for msg in decide(CFG, fold(log)):
        log.append(("1001-0", msg) if not isinstance(msg, StartProfile) else msg)
    return log


def test_request_older_than_its_timeout_is_refused_never_served() -> None:
    req = ProfileRequest(request_id="q", steps=[5], timeout_s=2.0, ts=0.0)
    state = fold([*_started_log(), ("5000-0", req)])
    # Served while its client still waits (by the Redis clock: now - arrival <= timeout) ...
    (served,) = decide(CFG, state, now_ms=7000)
    assert isinstance(served, StartProfile) and served.request_id == "q"
    # ... refused once that is over, whatever its own `ts` (another host's clock) says.
    (refused,) = decide(CFG, state, now_ms=7001)
    assert isinstance(refused, ProfileRequestRefused) and refused.request_id == "q"
    assert refused.reason.startswith("expired") and "timeout of 2 s" in refused.reason
    # Answered: nothing more, whatever the clock.
    assert decide(CFG, apply(state, refused), now_ms=10**9) == []
    # Without a clock (or without an entry id) requests are not judged by age.
    assert decide(CFG, state) == [served]
    assert decide(CFG, fold([*_started_log(), req]), now_ms=10**9) == [served]


def test_expired_request_is_refused_at_once_even_before_run_started() -> None:
    old = ProfileRequest(request_id="old", steps=[5], timeout_s=1.0)
    fresh = ProfileRequest(request_id="fresh", steps=[6], timeout_s=60.0)
    state = fold([("1000-0", old), ("1500-0", fresh)])
    (refused,) = decide(CFG, state, now_ms=2500)
    assert refused.request_id == "old" and refused.reason.startswith("expired")  # type: ignore[union-attr]
    # The fresh one waits for RunStarted, then is served.
    state = fold([refused, ("2600-0", run_started(1))], state)
    out = decide(CFG, state, now_ms=2700)
    assert [type(m) for m in out] == [StartProfile, ProfilerReady, StartProfile]
    assert out[-1].request_id == "fresh"  # type: ignore[union-attr]


def test_run_started_with_profiling_off_refuses_requests_at_once() -> None:
    config = {**run_started(1).config, "global_profiler": {"tool": None}}
    log: list[Item] = [
        RunStarted(run_id="r1", config=config, ts=1.0),
        ProfileRequest(request_id="q", steps=[5]),
    ]
    out = decide(CFG, fold(log))
    refused = [m for m in out if isinstance(m, ProfileRequestRefused)]
    assert len(refused) == 1 and "profiling is off for this run" in refused[0].reason
    assert not [m for m in out if isinstance(m, StartProfile) and m.request_id]
    # The service's own config off: refused at once, before the run has even started.
    off = ProfilerConfig(tool=None)
    (refused_now,) = decide(off, fold([ProfileRequest(request_id="q", steps=[5])]))
    assert "profiling is off" in refused_now.reason  # type: ignore[union-attr]


# --------------------------------------------------------------------------- deaths and traces

S30 = StartProfile(session_id="s30-40", roles=["trainer", "rollouter"], tool="torch",
                   first_step=30, last_step=40, ts=1.0)


def _stop30(role: str, first: int, last: int, status: str = "ok") -> ProfileStopped:
    return ProfileStopped(session_id="s30-40", role=role, rank=0, first_step=first,
                          last_step=last, tool="torch", path=f"{role}0-s30-40.json.gz",
                          bytes=10, duration_s=1.0, status=status, ts=3.0)


def _checked(stop: ProfileStopped, problem: str = "") -> TraceChecked:
    return TraceChecked(session_id=stop.session_id, role=stop.role, rank=stop.rank,
                        stopped=stop, problem=problem)


def _entry(state: ServiceState, role: str) -> dict[str, Any]:
    (entry,) = [e for e in build_manifest("r1", state)["sessions"] if e["role"] == role]
    return entry


def test_a_trainer_killed_inside_a_session_leaves_its_lost_steps_in_the_manifest() -> None:
    """The trainer began s30-40 at 30 and was killed in step 36; its successor profiled
    36-40. The manifest says `partial`, steps 30-35 missing, and why."""
    stop = _stop30("trainer", 36, 40)
    log: list[Fact] = [
        run_started(1), S30,
        ProfileStarted(session_id="s30-40", role="trainer", rank=0, step=30, tool="torch"),
        TrainerResumed(step=35, param_version=35, checkpoint_step=30, replayed_steps=5),
        run_started(1, resumed=True),
        ProfileStarted(session_id="s30-40", role="trainer", rank=0, step=36, tool="torch"),
    ]
    running = _entry(fold(log), "trainer")
    assert (running["status"], running["missing_steps"]) == ("running", list(range(30, 36)))
    entry = _entry(fold([*log, stop, _checked(stop)]), "trainer")
    assert entry["status"] == "partial"
    assert (entry["first_step"], entry["last_step"], entry["path"]) == (
        36, 40, "trainer0-s30-40.json.gz")
    assert entry["missing_steps"] == list(range(30, 36))
    assert "TrainerResumed" in entry["reason"]
    # The rollouter, untouched, is not affected.
    assert _entry(fold([*log, stop, _checked(stop)]), "rollouter")["missing_steps"] == []


def test_a_restarted_rollouter_without_any_death_event_is_seen_by_its_new_start() -> None:
    first_run = ProfileStarted(session_id="s30-40", role="rollouter", rank=0, step=30,
                               tool="torch")
    log: list[Fact] = [run_started(1), S30, first_run, first_run,  # a retried XADD
                       msgspec_replace(first_run, step=33)]
    stop = _stop30("rollouter", 33, 40)
    entry = _entry(fold([*log, stop, _checked(stop)]), "rollouter")
    assert (entry["status"], entry["missing_steps"]) == ("partial", [30, 31, 32])
    # A successor that found the session over reports it missed: nothing of it is left.
    lost = _entry(fold([run_started(1), S30, first_run, _stop30("rollouter", 30, 40, "missed"),
                        RunFinished(run_id="r1", steps=38)]), "rollouter")
    assert (lost["status"], lost["missing_steps"]) == ("lost", list(range(30, 39)))


def test_a_component_that_failed_and_never_came_back_is_lost() -> None:
    log: list[Fact] = [
        run_started(1), S30,
        ProfileStarted(session_id="s30-40", role="trainer", rank=0, step=30, tool="torch"),
        ComponentFailed(role="trainer", rank=0, error="CUDA error"),
        RunFinished(run_id="r1", steps=32),
    ]
    entry = _entry(fold(log), "trainer")
    assert (entry["status"], entry["missing_steps"]) == ("lost", [30, 31, 32])
    assert "CUDA error" in entry["reason"]


def test_a_stop_naming_a_trace_that_is_not_there_is_not_ok(tmp_path: Any) -> None:
    """The service checks the file an ``ok`` stop names (check_trace); until then the entry is
    `unchecked`, after it `ok` only when the file is there with the stated size."""
    from profiler_service.manifest import check_trace, trace_warning
    from profiler_service.records import TRACE_MISSING_CODE
    from profiler_service.state import unchecked_stops

    forged = _stop30("trainer", 30, 40)
    state = fold([run_started(1), S30, forged])
    assert _entry(state, "trainer")["status"] == "unchecked"
    ((sid, fact, tool),) = unchecked_stops(state)
    problem = check_trace(tmp_path, fact.stopped, tool)
    assert "does not exist" in problem
    state = apply(state, TraceChecked(session_id=sid, role="trainer", rank=0,
                                      stopped=fact.stopped, problem=problem))
    assert unchecked_stops(state) == []
    entry = _entry(state, "trainer")
    assert (entry["status"], entry["reason"]) == ("missing", problem)
    # The warning is published once: once in the log, the service knows it.
    warning = trace_warning(TraceChecked(session_id=sid, role="trainer", rank=0,
                                         stopped=fact.stopped, problem=problem))
    assert warning.code == TRACE_MISSING_CODE
    assert warning.message in apply(state, warning).trace_warnings
    # A file of another size is no better; the right one is ok.
    (tmp_path / "trainer0-s30-40.json.gz").write_bytes(b"x" * 9)
    assert "has 9 bytes" in check_trace(tmp_path, forged, "torch")
    (tmp_path / "trainer0-s30-40.json.gz").write_bytes(b"x" * 10)
    assert check_trace(tmp_path, forged, "torch") == ""
    assert _entry(fold([run_started(1), S30, forged, _checked(forged)]), "trainer")[
        "status"] == "ok"
    # An nsys session's stop names no file (nsys writes its own reports).
    nsys = msgspec_replace(forged, path="", bytes=0, tool="nsys")
    assert check_trace(tmp_path, nsys, "nsys") == ""
    assert check_trace(tmp_path, nsys, "torch") != ""


def test_reports_for_a_session_never_sent_or_from_a_process_it_does_not_target_are_ignored(
) -> None:
    from profiler_service.state import report_refusal

    state = fold([run_started(1), S30])
    unknown = msgspec_replace(_stop30("trainer", 30, 40), session_id="s99-99")
    assert "never started" in (report_refusal(state, unknown) or "")
    assert apply(state, unknown) is state
    stranger = msgspec_replace(_stop30("trainer", 30, 40), rank=3)
    assert "does not target" in (report_refusal(state, stranger) or "")
    assert apply(state, stranger) is state
    started = ProfileStarted(session_id="s99-99", role="trainer", rank=0, step=1, tool="torch")
    assert apply(state, started) is state
    assert report_refusal(state, _stop30("trainer", 30, 40)) is None
    assert [e["id"] for e in build_manifest("r1", fold([run_started(1), S30, unknown,
                                                        stranger]))["sessions"]] == [
        "s30-40", "s30-40"]


def test_a_run_finished_naming_another_step_than_the_last_finished_is_not_believed() -> None:
    """A forged RunFinished(10**9) (or any that contradicts the log's last StepFinished) does
    not end the service's run: it goes on serving the real one."""
    steps = [StepFinished(step=k, sample_ids=[], metrics={}, duration_s=0.1) for k in (1, 2)]
    state = fold([run_started(1), *steps])
    forged = RunFinished(run_id="r1", steps=10**9)
    from profiler_service.state import run_finished_doubt

    assert apply(state, forged) is state
    assert "contradicts the log" in (run_finished_doubt(state, forged) or "")
    assert apply(state, RunFinished(run_id="r1", steps=2)).run_finished is not None


def test_a_rollouter_that_joined_beyond_the_replicas_has_its_traces_listed() -> None:
    """rollout.replicas is how many rollouters `rlbus up` started, not a cap: a replica that
    joined later (rank 3 of a run with 1) profiles a session for every rank, and the service
    counts its report and lists its trace (after the ranks it waits for)."""
    from profiler_service.state import report_refusal

    state = fold([run_started(1), S30])
    joined = msgspec_replace(_stop30("rollouter", 30, 40), rank=3)
    assert report_refusal(state, joined) is None
    manifest = build_manifest("r1", fold([run_started(1), S30, joined]))
    assert [(e["role"], e["rank"]) for e in manifest["sessions"]] == [
        ("trainer", 0), ("rollouter", 0), ("rollouter", 3)]
    # A session for rank 0 only does not target it.
    only0 = msgspec_replace(S30, ranks=[0])
    assert "does not target" in (report_refusal(fold([run_started(1), only0]), joined) or "")


def test_ranks_past_the_replicas_are_counted_when_they_report_and_never_waited_for() -> None:
    """global_profiler.ranks=[3] with rollout.replicas=2 (rank 3 may join the running run):
    the session is sent, a report from rank 3 counts and is listed, one from rank 2 does
    not, and once the run finishes the service does not wait for a rank that never joined."""
    from profiler_service.schedule import outstanding_targets
    from profiler_service.state import report_refusal

    cfg = cfg_of([1], False, ["trainer", "rollouter"], ranks=[3])
    sent = [m for m in decide(cfg, fold([run_started(2)])) if isinstance(m, StartProfile)]
    assert [(s.session_id, s.roles, s.ranks) for s in sent] == [("s1-1", ["rollouter"], [3])]
    assert sent == [m for m in reference_decide(cfg, [run_started(2)])
                    if isinstance(m, StartProfile)]
    stop3 = ProfileStopped(session_id="s1-1", role="rollouter", rank=3, first_step=1,
                           last_step=1, tool="torch", path="rollouter3-s1-1.json.gz", bytes=5,
                           duration_s=0.1, ts=3.0)
    log: list[Fact] = [run_started(2), *sent]
    assert "does not target" in (report_refusal(fold(log), msgspec_replace(stop3, rank=2)) or "")
    assert report_refusal(fold(log), stop3) is None
    joined = [*log, stop3, _checked(stop3)]
    manifest = build_manifest("r1", fold(joined))
    assert [(e["role"], e["rank"], e["status"]) for e in manifest["sessions"]] == [
        ("rollouter", 3, "ok")]
    assert manifest == reference_manifest("r1", joined)
    # Rank 3 never joined: nothing is outstanding, ProfilerFinished follows RunFinished at once.
    for run in (log, joined):
        ended = fold([*run, StepFinished(step=1, sample_ids=[], metrics={}, duration_s=0.1),
                      RunFinished(run_id="r1", steps=1)])
        assert outstanding_targets(ended) == []
        assert [type(m) for m in decide(cfg, ended)] == [ProfilerFinished]
