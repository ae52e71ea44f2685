"""The profiler service as a real process against a real redis-server.

There is no trainer here: the test plays the trainer and the components by publishing their
events with the bus API, and reads what the service publishes. Every wait is bounded and
synchronised on stream entries, the service's liveness key or its own log lines
(tests/waits.py), never on sleeping.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from bus import Bus, Entry, RunKeys, peers
from profiler_service.records import ServiceState
from profiler_service.request import request_profile, run_profile_request
from profiler_service.service import SNAPSHOT_NAME, ProfilerService
from runconfig import config_to_dict, load_config
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
    TrainerResumed,
    WarningRaised,
)
from runtime.history import archive_below, events_folder, read_history
from tests.waits import (
    Watched,
    event,
    read_log,
    wait_exit,
    wait_exit_blocking,
    wait_for,
    wait_heartbeat,
    wait_log,
    wait_stream,
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 15.0

Launch = Callable[..., Watched]


# --------------------------------------------------------------------------- helpers


def write_config(tmp_path: Path, redis_url: str, run_id: str, *, total_steps: int = 10,
                 **profiler: Any) -> Path:
    """A YAML config for the service (a file, so a hook command needs no shell quoting); the
    run's RunFinished must name ``total_steps`` for the service to take it as the end."""
    tree: dict[str, Any] = {
        "redis": {"url": redis_url},
        "run": {"id": run_id, "output_dir": str(tmp_path / "outputs")},
        "trainer": {"total_training_steps": total_steps},
        "heartbeat": {"interval_s": 0.2},
        "global_profiler": {
            "tool": "torch",
            "steps": [1],
            "save_path": str(tmp_path / "profiles"),
            "handshake_timeout_s": 1.0,
            **profiler,
        },
    }
    path = tmp_path / f"config-{run_id}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    """``launch(config_path, *overrides)`` starts ``python -m profiler_service`` (its log in
    ``tmp_path``); every process still running at teardown is killed."""
    procs: list[Watched] = []

    def start(config: Path, *overrides: str) -> Watched:
        log_path = tmp_path / f"service-{len(procs)}.log"
        with open(log_path, "wb") as log_file:  # the child keeps its own copy of the fd
            popen = subprocess.Popen(
                [sys.executable, "-m", "profiler_service", "--config", str(config), *overrides],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
        procs.append(Watched(f"service-{len(procs)}", popen, log_path))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.popen.kill()
            wait_exit_blocking(proc, 10)


async def entries(bus: Bus, stream: str) -> list[Entry]:
    """Every entry of ``stream`` (of the run's whole log, merged, for its events key)."""
    return await read_log(bus, stream)


def decided(beat: Heartbeat) -> bool:
    """The service's liveness key says it has read the log and decided on it."""
    return beat.state != "catching up"


async def wait_decided(
    bus: Bus, keys: RunKeys, proc: Watched, until: Callable[[Heartbeat], bool] = decided
) -> Heartbeat:
    """The service's first heartbeat past its catch-up for which ``until`` holds."""
    return await wait_heartbeat(bus, keys.alive_pattern("profiler"), proc, WAIT_S,
                                until=lambda b: decided(b) and until(b),
                                what="a heartbeat past its catch-up")


async def wait_ready(bus: Bus, keys: RunKeys, proc: Watched) -> list[Entry]:
    """The events stream once the service's ProfilerReady is in it."""
    return await wait_stream(bus, keys.events, lambda m: bool(of(m, ProfilerReady)), WAIT_S,
                             "ProfilerReady", [proc])


def of(msgs: Sequence[Any], kind: type) -> list[Any]:
    return [m for m in msgs if isinstance(m, kind)]


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def run_started(config: Path, run_id: str) -> RunStarted:
    return RunStarted(run_id=run_id, config=config_to_dict(load_config(config)))


async def assert_step1_then_ready(bus: Bus, keys: RunKeys, proc: Watched) -> None:
    """Step-1 StartProfile for both roles in control, then ProfilerReady in events."""
    events = await wait_ready(bus, keys, proc)
    control = await entries(bus, keys.control)
    starts = [e for e in control if isinstance(e.msg, StartProfile)]
    assert [(e.msg.session_id, e.msg.first_step, e.msg.last_step) for e in starts] == [
        ("s1-1", 1, 1)
    ]
    assert set(starts[0].msg.roles) == {"trainer", "rollouter"}
    (ready,) = [e for e in events if isinstance(e.msg, ProfilerReady)]
    assert ready.msg.session_ids == ["s1-1"]
    # Published one after the other: the command's entry is not newer than the event's.
    assert id_key(starts[0].id) <= id_key(ready.id)


def stopped(session: StartProfile, role: str, rank: int = 0, folder: Path | None = None,
            first_step: int | None = None) -> ProfileStopped:
    """A component's ProfileStopped; its trace file (123 bytes) is written in ``folder``
    (``save_path/RUN``) first, as the agent does, unless ``folder`` is None."""
    stop = ProfileStopped(
        session_id=session.session_id,
        role=role,
        rank=rank,
        first_step=session.first_step if first_step is None else first_step,
        last_step=session.last_step,
        tool=session.tool,
        path=f"{role}{rank}-{session.session_id}.json.gz",
        bytes=123,
        duration_s=0.5,
    )
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / stop.path).write_bytes(b"t" * stop.bytes)
    return stop


# --------------------------------------------------------------------------- tests


@pytest.mark.procs
@pytest.mark.asyncio
async def test_started_before_run_started(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    config = write_config(tmp_path, redis_url, run_id)
    proc = launch(config)
    await wait_log(proc, "read 0 relevant entries from the log", WAIT_S)  # an empty log
    assert not await bus.exists(run_keys.events)  # it did not create the trainer's stream

    # Garbage first: the service must skip it, not crash.
    await bus.publish_raw(run_keys.events, {b"m": b"\xc1 not msgpack"})
    await bus.publish_raw(run_keys.events, {b"other": b"field"})
    await bus.publish(run_keys.events, run_started(config, run_id))
    await assert_step1_then_ready(bus, run_keys, proc)
    # Alive by the liveness key (a TTL key), never by events in the durable log.
    beat = await wait_decided(bus, run_keys, proc, lambda b: b.state == "following")
    assert (beat.role, beat.rank) == ("profiler", 0)
    assert await bus.command("PTTL", run_keys.alive("profiler", 0)) > 0

    # Run ends without any ProfileStopped: after handshake_timeout_s the service gives up,
    # says so, marks the sessions missing and finishes.
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=10))
    assert await wait_exit(proc, WAIT_S) == 0
    msgs = [e.msg for e in await entries(bus, run_keys.events)]
    (warning,) = [w for w in of(msgs, WarningRaised) if w.source == "profiler"]
    assert "trainer0:s1-1" in warning.message and "rollouter0:s1-1" in warning.message
    (finished,) = of(msgs, ProfilerFinished)
    assert not of(msgs, Heartbeat)
    assert not await peers(bus, run_keys.alive_pattern("profiler"))  # a clean exit says so
    manifest_path = tmp_path / "profiles" / run_id / "manifest.json"
    assert finished.manifest_path == str(manifest_path.resolve())
    manifest = json.loads(manifest_path.read_text())
    assert manifest["run_id"] == run_id
    assert [(s["id"], s["role"], s["rank"], s["status"]) for s in manifest["sessions"]] == [
        ("s1-1", "trainer", 0, "missing"),
        ("s1-1", "rollouter", 0, "missing"),
    ]


@pytest.mark.procs
@pytest.mark.asyncio
async def test_started_after_run_started_requests_manifest_and_hook_once(
    bus: Bus,
    redis_url: str,
    run_id: str,
    run_keys: RunKeys,
    tmp_path: Path,
    launch: Launch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    hook_out = tmp_path / "hook.txt"
    config = write_config(
        tmp_path,
        redis_url,
        run_id,
        finish_hook_cmd=f'echo "$RLBUS_RUN_ID $RLBUS_PROFILE_DIR" >> "{hook_out}"',
    )
    await bus.publish(run_keys.events, run_started(config, run_id))
    proc = launch(config)
    # Started after RunStarted was appended: its catch-up read of the log finds it (the one
    # relevant entry) before it decides anything.
    await wait_log(proc, "read 1 relevant entries from the log", WAIT_S)
    await assert_step1_then_ready(bus, run_keys, proc)

    # Live run: steps 1..3 have started; `next:1` is step 4, step 2 is in the past.
    for step in (1, 2, 3):
        await bus.publish(run_keys.events, StepStarted(step=step, param_version=step - 1))
    rc = await asyncio.to_thread(
        run_profile_request, redis_url, run_id, "next:1", ["trainer", "rollouter"], WAIT_S
    )
    assert rc == 0, capfd.readouterr().err
    out = capfd.readouterr().out
    assert "step 4" in out
    control = [e.msg for e in await entries(bus, run_keys.control)]
    (requested,) = [m for m in of(control, StartProfile) if m.request_id]
    assert (requested.first_step, requested.last_step) == (4, 4)
    assert requested.session_id in out

    rc = await asyncio.to_thread(
        run_profile_request, redis_url, run_id, "2", ["trainer"], WAIT_S
    )
    assert rc == 2
    err = capfd.readouterr().err
    assert "refused" in err and "already started" in err
    refused = of([e.msg for e in await entries(bus, run_keys.events)], ProfileRequestRefused)
    assert len(refused) == 1 and "earliest step a request can profile is 4" in refused[0].reason
    # A bad SPEC never reaches the service.
    assert await request_profile(bus, run_id, "4-2", ["trainer"], 1.0) == 2

    # The components report their sessions; the manifest follows.
    (planned,) = [m for m in of(control, StartProfile) if not m.request_id]
    await bus.publish(
        run_keys.events,
        ProfileStarted(session_id="s1-1", role="trainer", rank=0, step=1, tool="torch"),
    )
    for session in (planned, requested):
        for role in ("trainer", "rollouter"):
            await bus.publish(run_keys.log(role),
                              stopped(session, role, folder=tmp_path / "profiles" / run_id))
    manifest_path = tmp_path / "profiles" / run_id / "manifest.json"

    def complete_manifest() -> list[dict[str, Any]] | None:
        text = manifest_path.read_text() if manifest_path.exists() else "{}"
        sessions = json.loads(text).get("sessions", [])
        done = len(sessions) == 4 and all(s["status"] == "ok" for s in sessions)
        return sessions if done else None

    sessions = await wait_until(complete_manifest, f"4 'ok' sessions in {manifest_path}",
                                WAIT_S, [proc])
    assert {(s["id"], s["role"], s["path"], s["bytes"]) for s in sessions} == {
        (s.session_id, role, f"{role}0-{s.session_id}.json.gz", 123)
        for s in (planned, requested)
        for role in ("trainer", "rollouter")
    }

    # Every session stopped and the run finished: ProfilerFinished at once, hook once.
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=10))
    assert await wait_exit(proc, WAIT_S) == 0
    profile_dir = (tmp_path / "profiles" / run_id).resolve()
    assert hook_out.read_text().splitlines() == [f"{run_id} {profile_dir}"]
    msgs = [e.msg for e in await entries(bus, run_keys.events)]
    (finished,) = of(msgs, ProfilerFinished)
    assert (finished.sessions, finished.hook_rc) == (2, 0)
    assert not [w for w in of(msgs, WarningRaised) if w.source == "profiler"]

    # A service restarted after the end publishes nothing new and does not rerun the hook.
    n_control = len(await entries(bus, run_keys.control))
    again = launch(config)
    assert await wait_exit(again, WAIT_S) == 0
    assert hook_out.read_text().splitlines() == [f"{run_id} {profile_dir}"]
    assert len(await entries(bus, run_keys.control)) == n_control
    msgs = [e.msg for e in await entries(bus, run_keys.events)]
    assert len(of(msgs, ProfilerFinished)) == 1 and len(of(msgs, ProfilerReady)) == 1

    # The finished run continued by more steps (`rlbus up` with a larger total): a service
    # started with its continuation, before the trainer's new RunStarted, stays for them
    # (it used to read the old RunFinished as the end and exit at once).
    more = launch(config, "trainer.total_training_steps=20")
    await wait_decided(bus, run_keys, more)
    await asyncio.sleep(1.0)  # five of its turns
    assert more.poll() is None, more.log_path.read_text()
    await bus.publish(run_keys.events, RunStarted(run_id=run_id, config={}, resumed=True))
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=20))
    assert await wait_exit(more, WAIT_S) == 0


@pytest.mark.procs
@pytest.mark.asyncio
async def test_sigkill_and_restart_sends_no_duplicates(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    config = write_config(
        tmp_path, redis_url, run_id, steps=[1, 2, 5, 6], profile_continuous_steps=True
    )
    proc = launch(config)
    await bus.publish(run_keys.events, run_started(config, run_id))
    await wait_ready(bus, run_keys, proc)
    await bus.publish(run_keys.events, StepStarted(step=1, param_version=0))
    assert await request_profile(bus, run_id, "3-4", ["rollouter"], WAIT_S) == 0
    before = [e.msg for e in await entries(bus, run_keys.control)]
    assert [m.session_id for m in of(before, StartProfile)][:2] == ["s1-2", "s5-6"]
    assert len(of(before, StartProfile)) == 3

    proc.send_signal(signal.SIGKILL)
    wait_exit_blocking(proc, 10)
    restarted = launch(config)
    # Its heartbeat stops saying "catching up" once it has read the whole log back and
    # decided on it.
    await wait_decided(bus, run_keys, restarted)
    # ...and it still answers requests, without clashing with what the first one sent.
    assert await request_profile(bus, run_id, "4", ["trainer"], WAIT_S) == 0
    assert await request_profile(bus, run_id, "4", ["rollouter"], WAIT_S) == 2
    after = [e.msg for e in await entries(bus, run_keys.control)]
    ids = [m.session_id for m in of(after, StartProfile)]
    assert len(ids) == len(set(ids)) == 4
    assert after[: len(before)] == before
    events = [e.msg for e in await entries(bus, run_keys.events)]
    assert len(of(events, ProfilerReady)) == 1

    restarted.send_signal(signal.SIGTERM)  # a clean stop mid-run
    assert await wait_exit(restarted, WAIT_S) == 0
    assert "Traceback" not in restarted.log()


@pytest.mark.procs
@pytest.mark.asyncio
async def test_finish_hook_is_never_run_twice_even_if_the_service_dies_in_it(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    hook_out = tmp_path / "hook.txt"
    # The hook kills its service (the shell's parent) before it can publish ProfilerFinished.
    config = write_config(
        tmp_path, redis_url, run_id, finish_hook_cmd=f'echo ran >> "{hook_out}"; kill -9 $PPID'
    )
    await bus.publish(run_keys.events, run_started(config, run_id))
    proc = launch(config)
    await wait_ready(bus, run_keys, proc)
    (session,) = of([e.msg for e in await entries(bus, run_keys.control)], StartProfile)
    for role in ("trainer", "rollouter"):
        await bus.publish(run_keys.log(role),
                          stopped(session, role, folder=tmp_path / "profiles" / run_id))
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=10))
    assert await wait_exit(proc, WAIT_S) == -signal.SIGKILL
    assert not of([e.msg for e in await entries(bus, run_keys.events)], ProfilerFinished)

    again = launch(config)
    assert await wait_exit(again, WAIT_S) == 0
    assert hook_out.read_text().splitlines() == ["ran"]
    msgs = [e.msg for e in await entries(bus, run_keys.events)]
    (finished,) = of(msgs, ProfilerFinished)
    assert finished.hook_rc is None
    assert [w.code for w in of(msgs, WarningRaised)] == ["finish_hook_interrupted"]


@pytest.mark.procs
@pytest.mark.asyncio
async def test_manifest_names_the_steps_a_killed_trainer_lost_and_a_trace_that_is_not_there(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    """The trainer began the continuous session s1-4 at step 1 and was killed in step 3; its
    successor profiled 3-4. A rollouter's ProfileStopped names a trace that is not there;
    another names a session the service never sent. The manifest says `partial` with steps
    1-2 missing, and `missing` with the reason; one warning, even after a restart."""
    config = write_config(tmp_path, redis_url, run_id, total_steps=4, steps=[1, 2, 3, 4],
                          profile_continuous_steps=True)
    await bus.publish(run_keys.events, run_started(config, run_id))
    proc = launch(config)
    await wait_ready(bus, run_keys, proc)
    (session,) = of([e.msg for e in await entries(bus, run_keys.control)], StartProfile)
    assert session.session_id == "s1-4"
    folder = tmp_path / "profiles" / run_id
    forged = msgspec.structs.replace(stopped(session, "rollouter"), session_id="s9-9")
    for msg in [
        ProfileStarted(session_id="s1-4", role="trainer", rank=0, step=1, tool="torch"),
        ProfileStarted(session_id="s1-4", role="rollouter", rank=0, step=1, tool="torch"),
        # kill -9 in step 3: the resumed trainer says so, then profiles from step 3.
        TrainerResumed(step=2, param_version=2, checkpoint_step=0, replayed_steps=2),
        msgspec.structs.replace(run_started(config, run_id), resumed=True),
        ProfileStarted(session_id="s1-4", role="trainer", rank=0, step=3, tool="torch"),
        stopped(session, "trainer", folder=folder, first_step=3),
        stopped(session, "rollouter"),  # no file
        forged,
    ]:
        role = msg.role if isinstance(msg, ProfileStarted | ProfileStopped) else "trainer"
        await bus.publish(run_keys.log(role), msg)

    async def trace_warnings() -> list[WarningRaised]:
        msgs = [e.msg for e in await entries(bus, run_keys.events)]
        return [w for w in of(msgs, WarningRaised) if w.code == "profile_trace_missing"]

    async def warned() -> WarningRaised | None:
        found = await trace_warnings()
        return found[0] if found else None

    warning = await wait_until(warned, "a profile_trace_missing warning", WAIT_S, [proc])
    assert "s1-4 rollouter0" in warning.message
    assert "ignoring ProfileStopped for session 's9-9'" in proc.log()
    # A service killed and restarted (no snapshot: it folds the whole log) checks the file
    # again and finds the same, but the warning is in the log: it is not said twice.
    proc.popen.kill()
    assert await wait_exit(proc, WAIT_S) == -signal.SIGKILL
    (folder / ".profiler_state.msgpack").unlink(missing_ok=True)
    again = launch(config)
    await wait_log(again, "rollouter0-s1-4.json.gz does not exist", WAIT_S)
    await bus.publish(run_keys.events, RunFinished(run_id=run_id, steps=4))
    assert await wait_exit(again, WAIT_S) == 0
    assert len(await trace_warnings()) == 1
    manifest = json.loads((folder / "manifest.json").read_text())
    trainer, rollouter = manifest["sessions"]  # nothing for s9-9
    assert (trainer["role"], trainer["status"], trainer["first_step"]) == ("trainer", "partial", 3)
    assert trainer["missing_steps"] == [1, 2]
    assert "TrainerResumed" in trainer["reason"]
    assert (rollouter["role"], rollouter["status"]) == ("rollouter", "missing")
    assert "rollouter0-s1-4.json.gz does not exist" in rollouter["reason"]


@pytest.mark.asyncio
async def test_request_without_a_service_or_a_run(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # No events at all: the run id is wrong (and nothing is published into a missing run).
    assert await request_profile(bus, run_id, "3", ["trainer"], 0.5) == 2
    assert "has no events" in capfd.readouterr().err
    assert not await bus.exists(run_keys.events)
    # A run exists but no service answers: exit code 1, naming who is not answering.
    await bus.publish(run_keys.events, RunStarted(run_id=run_id, config={}))
    rc = await asyncio.to_thread(run_profile_request, redis_url, run_id, "3", ["trainer"], 0.5)
    assert rc == 1
    assert "no answer from the profiler service" in capfd.readouterr().err
    assert await request_profile(bus, run_id, "x", ["trainer"], 0.5) == 2
    assert await request_profile(bus, run_id, "3", ["nobody"], 0.5) == 2


async def until_redis_clock_passes(bus: Bus, entry_id: str, seconds: float) -> None:
    """Wait until the Redis server's clock is more than ``seconds`` past ``entry_id``'s
    arrival (the clock the service judges ages by)."""
    arrived_ms = int(entry_id.partition("-")[0])

    async def passed() -> bool | None:
        return True if await bus.server_time() * 1000 > arrived_ms + seconds * 1000 else None

    await wait_until(passed, f"the Redis clock to pass {seconds:g} s after {entry_id}", WAIT_S)


@pytest.mark.procs
@pytest.mark.asyncio
async def test_a_request_nobody_waits_for_any_more_is_refused_by_a_later_service(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``rlbus profile`` gave up (no service was running); a service started later must not
    schedule a session at a step nobody asked for any more. A request still within its own
    timeout is served as usual."""
    config = write_config(tmp_path, redis_url, run_id)
    await bus.publish(run_keys.events, run_started(config, run_id))
    assert await request_profile(bus, run_id, "5", ["trainer"], 0.2) == 1
    assert "no answer" in capfd.readouterr().err
    (old,) = [e for e in await entries(bus, run_keys.events)
              if isinstance(e.msg, ProfileRequest)]
    assert old.msg.timeout_s == 0.2  # the client says how long it waits
    await bus.publish(run_keys.log("operator"), ProfileRequest(request_id="fresh", steps=[6],
                                                      timeout_s=3600.0))
    await until_redis_clock_passes(bus, old.id, old.msg.timeout_s)

    proc = launch(config)
    events = await wait_stream(bus, run_keys.events, lambda m: bool(of(m, ProfileRequestRefused)),
                               WAIT_S, "a ProfileRequestRefused", [proc])
    (refused,) = of([e.msg for e in events], ProfileRequestRefused)
    assert refused.request_id == old.msg.request_id
    assert refused.reason.startswith("expired"), refused.reason
    control = await wait_stream(
        bus, run_keys.control, lambda m: any(c.request_id == "fresh" for c in of(m, StartProfile)),
        WAIT_S, "the StartProfile answering 'fresh'", [proc],
    )
    served = [e.msg for e in control if isinstance(e.msg, StartProfile) and e.msg.request_id]
    assert [(c.request_id, c.first_step) for c in served] == [("fresh", 6)]


@pytest.mark.procs
@pytest.mark.asyncio
async def test_restart_reads_only_the_log_after_its_snapshot_unless_the_log_lost_it(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    config = write_config(tmp_path, redis_url, run_id)
    snapshot_path = tmp_path / "profiles" / run_id / SNAPSHOT_NAME
    proc = launch(config)
    await bus.publish(run_keys.events, run_started(config, run_id))
    await assert_step1_then_ready(bus, run_keys, proc)
    await bus.publish(run_keys.events, StepStarted(step=1, param_version=0))

    async def stop_after_step(proc: Watched, step: int) -> None:
        # The heartbeat says when the service has folded StepStarted(step), the last entry.
        await wait_decided(bus, run_keys, proc,
                           lambda b: b.metrics["last_started_step"] >= step)
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc, WAIT_S) == 0
        assert snapshot_path.is_file()  # written at a clean exit

    await stop_after_step(proc, 1)
    # While no service runs: a step and a request.
    await bus.publish(run_keys.events, StepStarted(step=2, param_version=1))
    await bus.publish(run_keys.log("operator"), ProfileRequest(request_id="q", steps=[4]))
    again = launch(config)
    await wait_log(again, "read 2 relevant entries from the log after the snapshot at", WAIT_S)
    await wait_for(bus, run_keys.control, event(StartProfile, request_id="q"), WAIT_S, [again])
    await bus.publish(run_keys.events, StepStarted(step=3, param_version=2))
    await stop_after_step(again, 3)

    # The log lost its tail (Redis with AOF everysec): the snapshot's position is gone.
    last = await bus.latest(run_keys.events)
    assert last is not None and isinstance(last.msg, StepStarted) and last.msg.step == 3
    await bus.command("XDEL", run_keys.events, last.id)
    third = launch(config)
    await wait_log(third, "which the log does not hold; reading the whole log", WAIT_S)
    await wait_decided(bus, run_keys, third)
    assert "after the snapshot" not in third.log()

    # Whichever way it rebuilt its state, nothing was published twice.
    control = [e.msg for e in await entries(bus, run_keys.control)]
    assert [c.session_id for c in of(control, StartProfile)] == ["s1-1", "rq-s4-4"]
    events = [e.msg for e in await entries(bus, run_keys.events)]
    assert len(of(events, ProfilerReady)) == 1 and not of(events, ProfileRequestRefused)
    third.send_signal(signal.SIGTERM)
    assert await wait_exit(third, WAIT_S) == 0


@pytest.mark.procs
@pytest.mark.asyncio
async def test_restart_without_a_snapshot_folds_the_archive_and_the_stream(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch
) -> None:
    """Retention trimmed the log's beginning (RunStarted, the commands' answers) to the
    archive: a service restarted without its snapshot folds archive + stream, so it
    publishes nothing twice; a live service's snapshot position is stored for the trim."""
    config = write_config(tmp_path, redis_url, run_id)
    snapshot_path = tmp_path / "profiles" / run_id / SNAPSHOT_NAME
    proc = launch(config)
    await bus.publish(run_keys.events, run_started(config, run_id))
    await assert_step1_then_ready(bus, run_keys, proc)
    for k in (1, 2, 3):
        await bus.publish(run_keys.events, StepStarted(step=k, param_version=k - 1))
    await wait_decided(bus, run_keys, proc, lambda b: b.metrics["last_started_step"] >= 3)
    proc.send_signal(signal.SIGTERM)
    assert await wait_exit(proc, WAIT_S) == 0
    last = await bus.latest(run_keys.events)
    assert last is not None
    stored = await bus.command("GET", run_keys.position("profiler"))
    assert stored is not None and stored.decode() == last.id  # its snapshot's position
    snapshot_path.unlink()
    # Everything but the newest entry is archived and trimmed (the service is not alive).
    archive = events_folder(tmp_path / "outputs", run_id)
    done = await archive_below(bus, run_keys.events, archive, last.id,
                               readers=run_keys.events_readers())
    assert done.trimmed == 3 and await bus.length(run_keys.events) == 1
    again = launch(config)
    await wait_decided(bus, run_keys, again)
    assert "after the snapshot" not in again.log()
    await bus.publish(run_keys.log("operator"), ProfileRequest(request_id="q", steps=[6]))
    await wait_for(bus, run_keys.control, event(StartProfile, request_id="q"), WAIT_S, [again])
    control = [e.msg for e in await entries(bus, run_keys.control)]
    assert [c.session_id for c in of(control, StartProfile)] == ["s1-1", "rq-s6-6"]
    history = [e.msg async for e in read_history(bus, run_keys.events, archive)]
    assert len(of(history, RunStarted)) == 1
    answers = [e.msg for e in await entries(bus, run_keys.log("profiler"))]
    assert len(of(answers, ProfilerReady)) == 1  # not published again
    again.send_signal(signal.SIGTERM)
    assert await wait_exit(again, WAIT_S) == 0


# --------------------------------------------------------------------------- the step barrier


@pytest.mark.procs
@pytest.mark.asyncio
async def test_requests_at_a_step_boundary_skip_the_step_that_began(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path, launch: Launch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The race: the trainer has crossed into step L+1 (barrier L+1: its control read and
    weights are done or under way) but StepStarted(L+1) is not out. ``next:1`` must be L+2,
    an explicit L+1 is refused with a reason, and L+2 explicitly is accepted."""
    config = write_config(tmp_path, redis_url, run_id, steps=[])
    proc = launch(config)
    await bus.publish(run_keys.events, run_started(config, run_id))
    await wait_ready(bus, run_keys, proc)
    last = 3
    await bus.set_barrier(run_keys.barrier, 1)  # as the trainer does before weights v0
    for step in range(1, last + 1):
        await bus.publish(run_keys.events, StepStarted(step=step, param_version=step - 1))
        await bus.set_barrier(run_keys.barrier, step + 1)  # end of step: before its weights
    capfd.readouterr()

    assert await request_profile(bus, run_id, "next:1", ["trainer", "rollouter"], WAIT_S) == 0
    assert f"step {last + 2}" in capfd.readouterr().out
    control = [e.msg for e in await entries(bus, run_keys.control)]
    (granted,) = [m for m in of(control, StartProfile) if m.request_id]
    assert (granted.first_step, granted.last_step) == (last + 2, last + 2)

    assert await request_profile(bus, run_id, str(last + 1), ["trainer"], WAIT_S) == 2
    err = capfd.readouterr().err
    assert "refused" in err and "already begun" in err, err
    (refused,) = of([e.msg for e in await entries(bus, run_keys.events)], ProfileRequestRefused)
    assert f"earliest step a request can profile is {last + 2}" in refused.reason
    # An explicit later step is still fine (on a role the next:1 session leaves free).
    await bus.publish(run_keys.events, StepStarted(step=last + 1, param_version=last))
    assert await request_profile(bus, run_id, str(last + 3), ["trainer"], WAIT_S) == 0
    control = [e.msg for e in await entries(bus, run_keys.control)]
    assert [m.first_step for m in of(control, StartProfile) if m.request_id] == [
        last + 2, last + 3
    ]
    proc.send_signal(signal.SIGTERM)
    assert await wait_exit(proc, WAIT_S) == 0


def service_for(config: Path, bus: Bus) -> ProfilerService:
    return ProfilerService(load_config(config), bus)


@pytest.mark.asyncio
async def test_guard_refusal_decides_again_with_the_new_barrier(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The barrier moves between the service's GET and its guarded publish (forced here by
    serving it a stale barrier once): the StartProfile is refused by Redis, nothing lands,
    and the service decides again: ``next:1`` for the step after the new barrier, an explicit
    step that has begun refused with a reason."""
    config = write_config(tmp_path, redis_url, run_id, steps=[])
    await bus.publish(run_keys.events, run_started(config, run_id))
    service = service_for(config, bus)
    await service._catch_up()
    await service._step()  # ProfilerReady
    await bus.publish(run_keys.events, StepStarted(step=3, param_version=2))
    await bus.set_barrier(run_keys.barrier, 4)  # the trainer crossed into step 4 meanwhile
    real_get = bus.get_barrier
    stale = [3, 3]

    async def get_barrier(key: str) -> int:
        return stale.pop(0) if stale else await real_get(key)

    monkeypatch.setattr(bus, "get_barrier", get_barrier)
    for req in (ProfileRequest(request_id="n1", next_steps=1),
                ProfileRequest(request_id="e4", steps=[4])):
        await bus.publish(run_keys.log("operator"), req)
    service.state = ServiceState()
    await service._catch_up()
    service._dirty = True
    await service._step()
    assert not stale  # both stale reads were used: the first decision was refused
    control = [e.msg for e in await entries(bus, run_keys.control)]
    (granted,) = of(control, StartProfile)
    assert (granted.request_id, granted.first_step, granted.last_step) == ("n1", 5, 5)
    events = [e.msg for e in await entries(bus, run_keys.events)]
    (refused,) = of(events, ProfileRequestRefused)
    assert refused.request_id == "e4" and "already begun" in refused.reason
    service._dirty = True
    await service._step()  # nothing more to say
    assert len(await entries(bus, run_keys.control)) == 1


@pytest.mark.asyncio
async def test_guarded_publish_that_landed_despite_a_refused_retry_is_not_sent_twice(
    bus: Bus, redis_url: str, run_id: str, run_keys: RunKeys, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A guarded XADD whose reply was lost lands; its retry finds the barrier moved and
    reports a refusal. The service finds its command in the control stream and keeps it."""
    config = write_config(tmp_path, redis_url, run_id, steps=[])
    await bus.publish(run_keys.events, run_started(config, run_id))
    await bus.publish(run_keys.events, StepStarted(step=2, param_version=1))
    await bus.publish(run_keys.log("operator"), ProfileRequest(request_id="q", next_steps=1))
    real = bus.publish_guarded

    async def lost_reply(stream: str, msg: Any, guard_key: str, first_step: int) -> None:
        assert await real(stream, msg, guard_key, first_step) is not None  # it landed...
        await bus.set_barrier(guard_key, first_step)  # ...the barrier moved, the retry fails

    monkeypatch.setattr(bus, "publish_guarded", lost_reply)
    service = service_for(config, bus)
    await service._catch_up()
    await service._step()
    control = [e.msg for e in await entries(bus, run_keys.control)]
    (cmd,) = [m for m in of(control, StartProfile) if m.request_id]
    assert cmd.first_step == 3
    assert service.state.sessions[cmd.session_id].cmd == cmd
    service._dirty = True
    await service._step()
    assert len([m for m in of([e.msg for e in await entries(bus, run_keys.control)],
                              StartProfile) if m.request_id]) == 1
    assert not of([e.msg for e in await entries(bus, run_keys.events)], ProfileRequestRefused)


@pytest.mark.procs
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("global_profiler.steps=[0]", "global_profiler.steps"),
        ("global_profiler.steps=[-1]", "global_profiler.steps"),
        ("global_profiler.steps=[a]", "global_profiler.steps"),
        ("global_profiler.tool=foo", "global_profiler.tool"),
        ("global_profiler.roles=[x]", "global_profiler.roles"),
        ("redis.url=null", "redis.url"),
        ("run.id=null", "run.id"),
    ],
)
def test_bad_config_exits_2_naming_the_key(override: str, key: str) -> None:
    good = ["redis.url=redis://127.0.0.1:1", "run.id=bad-config", "global_profiler.tool=torch"]
    result = subprocess.run(
        [sys.executable, "-m", "profiler_service", *good, override],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"'{key}'" in result.stderr
