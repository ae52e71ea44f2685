"""End-to-end profiling: the profiler service, the trainer and a rollouter as real processes.

Every test runs the real components (``python -m profiler_service``, ``python -m rollouter``,
``python -m trainer``, ``python -m rlbus``) against a real throwaway redis-server and checks
outcomes only: each trace file parses as gzip Chrome-trace JSON and holds a ``step:K`` user
annotation for exactly the steps of its session, ``manifest.json`` lists every session with its
status, and the events log holds ProfileStarted/ProfileStopped for every role.

Waits are bounded and synchronised on stream entries, the components' liveness keys or the
service's own "caught up" log line (tests/waits.py), never on sleeping. Where a test must
act on a live run at a known point (kill
the service mid-session, restart it, send runtime requests) it holds the only rollouter with
SIGSTOP: the trainer then blocks gathering samples (well inside ``heartbeat.timeout_s``) until
SIGCONT. Runs are kept short (few steps, small batches) because the machine has two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus import RUNS_STREAM, Bus, RunKeys
from profiler_service.request import request_profile
from runschema.messages import (
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
    StepStarted,
    WarningRaised,
    WeightsPublished,
)
from tests.procs import FAST, Procs, events_of, run_cli
from tests.waits import event, follow, wait_exit, wait_for, wait_heartbeat, wait_log

pytestmark = pytest.mark.e2e

ROLES = ("trainer", "rollouter")
COMPONENTS = ("profiler", "rollouter", "trainer")
WAIT_S = 120.0  # generous: a loaded 2-core machine imports torch in three processes at once
STEP_RE = re.compile(r"^step:(\d+)$")


# --------------------------------------------------------------------------- helpers


def _args(redis_url: str, run_id: str, out: Path, *extra: str) -> list[str]:
    return [
        f"redis.url={redis_url}",
        f"run.id={run_id}",
        f"run.output_dir={out}",
        *FAST,
        "global_profiler.tool=torch",
        "rollout.replicas=1",
        *extra,
    ]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.kill_all()


def _profile_dir(out: Path, run_id: str) -> Path:
    return out / "profiles" / run_id


def trace_steps(path: Path) -> set[int]:
    """The K of every ``step:K`` user annotation in a gzip Chrome trace (it must parse).

    Each annotation appears once and has recorded work (torch ops) inside it on its thread.
    """
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert isinstance(events, list) and events, f"{path} holds no trace events"
    found: Counter[int] = Counter()
    for e in events:
        m = STEP_RE.match(str(e.get("name", "")))
        if not m or e.get("cat") != "user_annotation" or e.get("ph") != "X":
            continue
        found[int(m.group(1))] += 1
        begin, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        assert any(
            o.get("cat") == "cpu_op" and o.get("tid") == e.get("tid")
            and begin <= float(o["ts"]) <= end
            for o in events
        ), f"{path}: {e['name']} holds no op"
    assert all(n == 1 for n in found.values()), f"{path}: annotations repeat: {found}"
    return set(found)


def decided(beat: Heartbeat) -> bool:
    """The profiler service's liveness key says it has read the log and decided on it."""
    return beat.state != "catching up"


async def wait_all_exit_ok(procs: Procs, names: Iterable[str]) -> None:
    for name in names:
        rc = await wait_exit(procs.procs[name], WAIT_S)
        assert rc == 0, f"{name} exited {rc}:\n{procs.log(name)[-3000:]}"


async def start_service_first(procs: Procs, args: list[str], name: str = "profiler") -> None:
    """Start the service and wait until it has read the (still empty) log."""
    proc = procs.spawn(name, "profiler_service", *args)
    await wait_log(proc, "relevant entries from the log", WAIT_S)


def stopped_of(events: list[Any], sid: str, role: str, rank: int = 0) -> list[ProfileStopped]:
    return [
        e for e in events
        if isinstance(e, ProfileStopped) and (e.session_id, e.role, e.rank) == (sid, role, rank)
    ]


async def control_of(bus: Bus, keys: RunKeys) -> list[Any]:
    return await events_of(bus, keys.control)


async def check_profiles(
    bus: Bus,
    keys: RunKeys,
    out: Path,
    expected: dict[str, set[int]],
    roles: Iterable[str] = ROLES,
) -> dict[str, Any]:
    """Every session of ``expected`` (id -> steps) ran once on every role and nothing else.

    Checks the events (one ProfileStarted and one ``ok`` ProfileStopped per session, role and
    rank 0, with the session's step range), the trace files (their ``step:K`` annotations are
    exactly the session's steps), the control stream (one StartProfile per session id) and
    the final manifest (one ``ok`` entry per session and role, path and size of the trace).
    Returns the manifest.
    """
    roles = tuple(roles)
    folder = _profile_dir(out, keys.run_id)
    events = await events_of(bus, keys.events)
    control = await control_of(bus, keys)

    starts = Counter(m.session_id for m in control if isinstance(m, StartProfile))
    assert set(starts) >= set(expected), starts
    assert all(n == 1 for n in starts.values()), f"duplicate StartProfile commands: {starts}"

    for sid, steps in expected.items():
        for role in roles:
            started = [
                e for e in events
                if isinstance(e, ProfileStarted) and (e.session_id, e.role, e.rank)
                == (sid, role, 0)
            ]
            assert len(started) == 1, (sid, role, started)
            assert started[0].step == min(steps), (sid, role, started[0])
            (stop,) = stopped_of(events, sid, role)
            assert stop.status == "ok", stop
            assert (stop.first_step, stop.last_step) == (min(steps), max(steps)), stop
            assert stop.path == f"{role}0-{sid}.json.gz", stop
            path = folder / stop.path
            assert path.is_file(), path
            assert stop.bytes == path.stat().st_size > 0
            assert trace_steps(path) == steps, (path, trace_steps(path), steps)
    # No other session ran on these roles.
    ran = {(e.session_id, e.role) for e in events if isinstance(e, ProfileStopped)}
    assert ran == {(sid, role) for sid in expected for role in roles}, ran

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["run_id"] == keys.run_id
    entries = {(s["id"], s["role"], s["rank"]): s for s in manifest["sessions"]}
    assert set(entries) == {(sid, role, 0) for sid in expected for role in roles}, entries
    for (sid, role, _), entry in entries.items():
        assert entry["status"] == "ok", entry
        assert (entry["first_step"], entry["last_step"]) == (
            min(expected[sid]), max(expected[sid])
        ), entry
        assert entry["tool"] == "torch"
        assert entry["path"] == f"{role}0-{sid}.json.gz"
        assert entry["bytes"] == (folder / entry["path"]).stat().st_size
    # The trainer never gave up waiting for the service.
    assert not [
        e for e in events if isinstance(e, WarningRaised) and e.code == "profiler_handshake_timeout"
    ]
    return manifest


async def finish(bus: Bus, keys: RunKeys, procs: Procs, names: Iterable[str] = COMPONENTS) -> None:
    """Wait for ProfilerFinished and for every process to exit 0."""
    names = tuple(names)
    await wait_for(bus, keys.events, event(ProfilerFinished), WAIT_S, procs.watch(*names))
    await wait_all_exit_ok(procs, names)


def ready_before_weights(events: list[Any]) -> None:
    """ProfilerReady precedes weights version 0 (so step-1 commands precede step 1)."""
    kinds = [
        "ready" if isinstance(e, ProfilerReady) else "v0"
        for e in events
        if isinstance(e, ProfilerReady) or (isinstance(e, WeightsPublished) and e.version == 0)
    ]
    assert kinds == ["ready", "v0"], kinds


# --------------------------------------------------------------------------- 1. step 1


@pytest.mark.asyncio
async def test_step1_profiled_on_both_roles_service_started_first(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    out = tmp_path / "out"
    args = _args(redis_url, run_id, out, "trainer.total_training_steps=2",
                 "global_profiler.steps=[1]")
    await start_service_first(procs, args)
    assert not await bus.exists(run_keys.events)  # the service never creates the run's log
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await finish(bus, run_keys, procs)

    await check_profiles(bus, run_keys, out, {"s1-1": {1}})
    ready_before_weights(await events_of(bus, run_keys.events))


async def trainer_parked_for_profiler(bus: Bus, keys: RunKeys, procs: Procs) -> None:
    """Return once the trainer is waiting for ProfilerReady (and has been for a pulse).

    The trainer publishes its RunStarted to the run's events, then to RUNS_STREAM, and then
    waits for ProfilerReady with nothing in between (trainer.process ``_serve`` ->
    trainer.app ``run_loop`` -> ``_wait_for_profiler``). Its liveness key is refreshed by a
    task of the same event loop, so a heartbeat made after Redis appended that RUNS_STREAM
    entry is made after the reply to it was there to read; the heartbeat after that one
    comes a whole pulse later, when the trainer has long been inside its wait. Pulses slow
    down with the trainer on a busy machine, so this holds whatever the load (no sleep, no
    guess of how long is enough).
    """
    trainer = procs.procs["trainer"]
    appended_ms: int | None = None
    async for entry_id, msg in follow(bus, RUNS_STREAM, WAIT_S, f"RunStarted({keys.run_id}) "
                                      f"on {RUNS_STREAM}", procs.watch("trainer", "rollouter")):
        if isinstance(msg, RunStarted) and msg.run_id == keys.run_id:
            appended_ms = int(entry_id.split("-")[0])
            break
    assert appended_ms is not None
    pattern = keys.alive_pattern("trainer")
    first = await wait_heartbeat(bus, pattern, trainer, WAIT_S,
                                 until=lambda b: b.ts * 1000 > appended_ms,
                                 what="a heartbeat made after its RunStarted")
    await wait_heartbeat(bus, pattern, trainer, WAIT_S, until=lambda b: b.ts > first.ts,
                         what="the heartbeat after that one")


@pytest.mark.asyncio
async def test_step1_profiled_on_both_roles_service_started_after_trainer(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """The trainer waits for a service that is not there yet: nothing is published until
    the service, started later, sends its commands and ProfilerReady; step 1 is profiled."""
    out = tmp_path / "out"
    args = _args(redis_url, run_id, out, "trainer.total_training_steps=2",
                 "global_profiler.steps=[1]")
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await trainer_parked_for_profiler(bus, run_keys, procs)
    events = await events_of(bus, run_keys.events)
    assert not [e for e in events if isinstance(e, WeightsPublished | ProfilerReady)], events
    procs.spawn("profiler", "profiler_service", *args)
    await finish(bus, run_keys, procs)

    await check_profiles(bus, run_keys, out, {"s1-1": {1}})
    ready_before_weights(await events_of(bus, run_keys.events))


# --------------------------------------------------------------------------- 2. continuous


@pytest.mark.parametrize(
    ("continuous", "expected"),
    [(True, {"s2-3": {2, 3}}), (False, {"s2-2": {2}, "s3-3": {3}})],
    ids=["continuous", "discrete"],
)
@pytest.mark.asyncio
async def test_steps_2_3_continuous_or_discrete(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs,
    continuous: bool, expected: dict[str, set[int]],
) -> None:
    out = tmp_path / "out"
    args = _args(redis_url, run_id, out, "trainer.total_training_steps=4",
                 "global_profiler.steps=[2,3]",
                 f"global_profiler.profile_continuous_steps={str(continuous).lower()}")
    await start_service_first(procs, args)
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await finish(bus, run_keys, procs)

    await check_profiles(bus, run_keys, out, expected)
    control = await control_of(bus, run_keys)
    assert [m.session_id for m in control if isinstance(m, StartProfile)] == list(expected)


# --------------------------------------------------------------------------- 3. kill -9


@contextlib.contextmanager
def paused(procs: Procs, name: str) -> Iterator[None]:
    """Hold ``name`` with SIGSTOP (SIGCONT on exit): a live run that cannot move on.

    With the only rollouter paused the trainer blocks gathering samples within a step, well
    inside ``heartbeat.timeout_s``; this pins the run at a known point without sleeping.
    """
    pid = procs.procs[name].pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)


@pytest.mark.chaos
@pytest.mark.asyncio
async def test_service_killed_mid_session_components_stop_by_themselves(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    out = tmp_path / "out"
    total = 8
    args = _args(redis_url, run_id, out, f"trainer.total_training_steps={total}",
                 "global_profiler.steps=[2,3,4]", "global_profiler.profile_continuous_steps=true",
                 "heartbeat.timeout_s=60")
    await start_service_first(procs, args)
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(ProfileStarted, role="trainer", session_id="s2-4"),
                   WAIT_S, procs.watch(*COMPONENTS))
    with paused(procs, "rollouter"):  # so that the kill lands inside the session, surely
        procs.kill("profiler", signal.SIGKILL)
        assert procs.procs["profiler"].returncode == -signal.SIGKILL
        events = await events_of(bus, run_keys.events)
        assert not [e for e in events if isinstance(e, ProfileStopped)], "session already over"

    # Without the service, both components end the session after step 4 by themselves.
    for role in ROLES:
        await wait_for(bus, run_keys.events, event(ProfileStopped, role=role, session_id="s2-4"),
                       WAIT_S, procs.watch("rollouter", "trainer"))
    # A new service on the still-live run rebuilds its state from the log: nothing is sent
    # twice. The rollouter is held so that the run cannot finish under it.
    with paused(procs, "rollouter"):
        procs.spawn("profiler2", "profiler_service", *args)
        # Its liveness key stops saying "catching up" once it has read the log and made its
        # first decisions (heartbeats are TTL keys, not events in the log).
        await wait_heartbeat(bus, run_keys.alive_pattern("profiler"), procs.procs["profiler2"],
                             WAIT_S, until=decided, what="its first decisions")
        events = await events_of(bus, run_keys.events)
        assert not [e for e in events if isinstance(e, RunFinished)], "the run ended too soon"
        control = await control_of(bus, run_keys)
        assert [m.session_id for m in control if isinstance(m, StartProfile)] == ["s2-4"]
        assert sum(isinstance(e, ProfilerReady) for e in events) == 1
    await finish(bus, run_keys, procs, ("profiler2", "rollouter", "trainer"))

    await check_profiles(bus, run_keys, out, {"s2-4": {2, 3, 4}})
    events = await events_of(bus, run_keys.events)
    assert sum(isinstance(e, ProfilerReady) for e in events) == 1
    assert sum(isinstance(e, ProfilerFinished) for e in events) == 1
    assert [e.steps for e in events if isinstance(e, RunFinished)] == [total]


# --------------------------------------------------------------------------- 4. runtime


async def profile_cli(redis_url: str, run_id: str, spec: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        run_cli, "profile", "--run", run_id, "--steps", spec, "--timeout", "60",
        f"redis.url={redis_url}",
    )


@pytest.mark.asyncio
async def test_runtime_request_on_live_run(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    out = tmp_path / "out"
    total = 8
    # No scheduled session: the only one is the runtime request's. On-policy (threshold 0):
    # with the rollouter paused the trainer cannot get more than a step ahead.
    args = _args(redis_url, run_id, out, f"trainer.total_training_steps={total}",
                 "global_profiler.steps=[]", "async_training.staleness_threshold=0",
                 "heartbeat.timeout_s=60")
    await start_service_first(procs, args)
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepStarted, step=2), WAIT_S,
                   procs.watch(*COMPONENTS))

    with paused(procs, "rollouter"):  # the run stays live while the two requests are answered
        # A step that has already started is refused: exit code 2 and a ProfileRequestRefused.
        past = await profile_cli(redis_url, run_id, "1")
        assert past.returncode == 2, (past.stdout, past.stderr)
        assert "not in the future" in past.stderr, past.stderr
        events = await events_of(bus, run_keys.events)
        (refused,) = [e for e in events if isinstance(e, ProfileRequestRefused)]
        (request,) = [e for e in events if isinstance(e, ProfileRequest)]
        assert refused.request_id == request.request_id
        assert "not in the future" in refused.reason

        # The next step is accepted ...
        nxt = await profile_cli(redis_url, run_id, "next:1")
        assert nxt.returncode == 0, (nxt.stdout, nxt.stderr)
        events = await events_of(bus, run_keys.events)
        last_started = max(e.step for e in events if isinstance(e, StepStarted))
        assert not [e for e in events if isinstance(e, RunFinished)]
    control = await control_of(bus, run_keys)
    (cmd,) = [m for m in control if isinstance(m, StartProfile)]
    assert cmd.request_id and cmd.session_id in nxt.stdout, (cmd, nxt.stdout)
    step = cmd.first_step
    assert step == cmd.last_step == last_started + 1 <= total, (cmd, last_started)
    assert cmd.session_id == f"r{cmd.request_id}-s{step}-{step}"
    assert set(cmd.roles) == set(ROLES)
    await finish(bus, run_keys, procs)

    # ... and profiled on both roles, exactly that step.
    manifest = await check_profiles(bus, run_keys, out, {cmd.session_id: {step}})
    assert {s["request_id"] for s in manifest["sessions"]} == {cmd.request_id}


@pytest.mark.asyncio
async def test_next_requests_at_step_boundaries_are_never_missed(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """``next:1`` fired right at trainer step boundaries of a live run, the moment that used
    to lose the race: WeightsPublished(v) is out (trainer step v+1 and rollouter step v+1
    are beginning) but StepStarted(v+1) may not be. The step barrier makes the service grant
    step v+2 or later, and every session comes out ``ok`` on both roles, never ``missed``.
    """
    out = tmp_path / "out"
    # Requests go out at weights v1..v7; the run is longer, so that a test that reads the
    # events behind the run (a loaded machine: the run is at step 10 when the test handles
    # v7) still asks for a step the run has (the service grants the live step + 2 or later).
    total, last_asked = 16, 7
    args = _args(redis_url, run_id, out, f"trainer.total_training_steps={total}",
                 "global_profiler.steps=[]", "async_training.staleness_threshold=0",
                 "heartbeat.timeout_s=60")
    await start_service_first(procs, args)
    procs.spawn("rollouter", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)

    granted: list[tuple[int, StartProfile]] = []  # (weights version it was fired at, answer)
    started: set[int] = set()
    async for _, msg in follow(bus, run_keys.events, WAIT_S, "the run's steps (or its end)",
                               procs.watch(*COMPONENTS)):
        if isinstance(msg, StepStarted):
            started.add(msg.step)
        elif isinstance(msg, RunFinished):
            break
        elif isinstance(msg, WeightsPublished) and 1 <= msg.version <= last_asked:
            # One session at a time: the previous one's step has begun, so no overlap.
            if granted and granted[-1][1].first_step not in started:
                continue
            rid = f"edge{msg.version}"
            rc = await request_profile(bus, run_id, "next:1", list(ROLES), 30.0, rid)
            assert rc == 0, f"request at weights v{msg.version} answered {rc}"
            control = await control_of(bus, run_keys)
            (cmd,) = [m for m in control if isinstance(m, StartProfile) and m.request_id == rid]
            granted.append((msg.version, cmd))
            if len(granted) == 4:
                break
    assert len(granted) >= 2, granted
    for version, cmd in granted:
        # Weights v close step v+1 (barrier v+1 set before they are published).
        assert version + 2 <= cmd.first_step == cmd.last_step <= total, (version, cmd)
    await finish(bus, run_keys, procs)
    await check_profiles(
        bus, run_keys, out, {cmd.session_id: {cmd.first_step} for _, cmd in granted}
    )


# --------------------------------------------------------------------------- 5. bad config


BAD = [
    ("global_profiler.steps=[0]", "global_profiler.steps"),
    ("global_profiler.steps=[-1]", "global_profiler.steps"),
    ("global_profiler.steps=[a]", "global_profiler.steps"),
    ("global_profiler.tool=foo", "global_profiler.tool"),
    ("global_profiler.roles=[x]", "global_profiler.roles"),
]


@pytest.mark.parametrize(("override", "key"), BAD, ids=[o for o, _ in BAD])
def test_bad_profiler_config_exits_2_naming_the_key(
    override: str, key: str, tmp_path: Path, run_id: str
) -> None:
    out = tmp_path / "out"
    # Everything else is valid (a Redis URL nobody listens on: validation comes first).
    common = ["redis.url=redis://127.0.0.1:1/0", f"run.id={run_id}", f"run.output_dir={out}",
              "global_profiler.tool=torch"]
    commands = {
        "rlbus profiler": run_cli("profiler", *common, override, cwd=tmp_path, timeout_s=60),
        "python -m profiler_service": subprocess.run(
            [sys.executable, "-m", "profiler_service", *common, override],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        ),
        # `up` without redis.url: it would start an embedded Redis if it did not validate first.
        "rlbus up": run_cli("up", *common[1:], override, cwd=tmp_path, timeout_s=60),
    }
    for name, proc in commands.items():
        assert proc.returncode == 2, (name, proc.returncode, proc.stdout, proc.stderr)
        assert f"'{key}'" in proc.stderr, (name, proc.stderr)
    assert not out.exists(), "a command did something before validating its config"


# --------------------------------------------------------------------------- 6. rlbus up


@pytest.mark.asyncio
async def test_rlbus_up_with_profiling_writes_manifest(tmp_path: Path, run_id: str) -> None:
    out = tmp_path / "out"
    proc = await asyncio.to_thread(
        run_cli, "up", f"run.output_dir={out}", f"run.id={run_id}",
        "trainer.total_training_steps=2", *FAST, "global_profiler.tool=torch",
        "global_profiler.steps=[1]", cwd=tmp_path, timeout_s=240,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    folder = _profile_dir(out, run_id)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["run_id"] == run_id
    entries = {(s["id"], s["role"], s["rank"]): s for s in manifest["sessions"]}
    assert set(entries) == {("s1-1", "trainer", 0), ("s1-1", "rollouter", 0)}, manifest
    for (_, role, _), entry in entries.items():
        assert entry["status"] == "ok", entry
        assert (entry["first_step"], entry["last_step"]) == (1, 1)
        path = folder / entry["path"]
        assert entry["path"] == f"{role}0-s1-1.json.gz"
        assert entry["bytes"] == path.stat().st_size
        assert trace_steps(path) == {1}
    assert "embedded Redis at" in proc.stdout
    assert str(folder) in proc.stdout  # it says where the traces are
