"""The component runtime (runtime/): one lifecycle for every process, one log follower.

Against a real Redis: a component is alive (its liveness key holds its heartbeat) from its
set-up to its exit and not after; its kept events position is stored at each pulse; a named
failure is one ComponentFailed event and exit code 1; a failed set-up never says "alive"; a
restart builds a fresh component, a bounded number of times. The follower folds every entry
of the log once and in order, however many reads overlap, passes over garbage, and reads
the archive where the stream was trimmed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from bus import Bus, Entry, RunKeys, entry_key
from runconfig import Config, load_config
from runschema.messages import ComponentFailed, Heartbeat, StepStarted, decode
from runtime import Component, Failure, Follower, Restart
from runtime.history import archive_below
from runtime.process import _run_restarting
from tests.procs import events_of

pytestmark = pytest.mark.asyncio


def _cfg(redis_url: str, run_id: str, tmp_path: Path) -> Config:
    return load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                  f"run.output_dir={tmp_path}", "heartbeat.interval_s=0.05"])


class Probe(Component):
    """A component that serves until told to, records its hooks, keeps a position."""

    role = "logger"

    def __init__(self, cfg: Config, bus: Bus, fail: str | None = None) -> None:
        super().__init__(cfg, bus)
        self.fail = fail
        self.go = asyncio.Event()
        self.serving = asyncio.Event()
        self.pulses = 0
        self.pulsed_twice = asyncio.Event()
        self.torn_down = False

    async def on_pulse(self) -> None:
        self.pulses += 1
        if self.pulses >= 2:
            self.pulsed_twice.set()

    def kept_position(self) -> str | None:
        return "5-0"

    async def serve(self) -> int:
        self.serving.set()
        await self.go.wait()
        if self.fail:
            raise Failure(self.fail)
        return 7

    async def teardown(self) -> None:
        self.torn_down = True


async def test_alive_from_start_to_exit_with_its_position_kept(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    probe = Probe(_cfg(redis_url, run_id, tmp_path), bus)
    task = asyncio.create_task(probe.run())
    await probe.serving.wait()
    async with asyncio.timeout(30):  # the second pulse came after the position was stored
        await probe.pulsed_twice.wait()
    raw = await bus.command("GET", run_keys.alive("logger", 0))
    beat = decode(raw)
    assert isinstance(beat, Heartbeat) and beat.role == "logger" and beat.state == "running"
    assert await bus.get_text(run_keys.position("logger")) == "5-0"
    probe.go.set()
    assert await task == 7
    assert probe.torn_down
    assert not await bus.exists(run_keys.alive("logger", 0)), "a clean exit is not a silent death"


async def test_a_named_failure_is_one_event_and_exit_code_1(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    probe = Probe(_cfg(redis_url, run_id, tmp_path), bus, fail="the peer is gone")
    probe.go.set()
    assert await probe.run() == 1
    failed = [e for e in await events_of(bus, run_keys.events) if isinstance(e, ComponentFailed)]
    assert [(f.role, f.error) for f in failed] == [("logger", "the peer is gone")]
    assert probe.torn_down


async def test_a_failed_set_up_never_says_alive(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    class Refused(Probe):
        async def setup(self) -> None:
            raise Failure("someone else holds it")

    probe = Refused(_cfg(redis_url, run_id, tmp_path), bus)
    assert await probe.run() == 1
    assert probe.pulses == 0 and not probe.serving.is_set()
    assert not await bus.exists(run_keys.alive("logger", 0))


async def test_a_restart_builds_a_fresh_component_a_bounded_number_of_times(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path
) -> None:
    built: list[Component] = []

    class Restarting(Probe):
        max_restarts = 2

        async def serve(self) -> int:
            if len(built) < 3:
                raise Restart("the log lost its tail")
            return 0

    def factory(cfg: Config, bus: Bus) -> Component:
        built.append(Restarting(cfg, bus))
        return built[-1]

    cfg = _cfg(redis_url, run_id, tmp_path)
    assert await _run_restarting(cfg, bus, "probe", factory) == 0
    assert len(built) == 3 and len({id(c) for c in built}) == 3

    class Endless(Restarting):  # one more restart than allowed
        async def serve(self) -> int:
            raise Restart("again")

    assert await _run_restarting(cfg, bus, "probe", lambda c, b: Endless(c, b)) == 1


async def test_a_background_task_that_fails_ends_the_component_with_its_error(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """A spawned part that dies (a named failure, a restart) ends the component as if serve
    had raised it, instead of leaving serve waiting on it in silence."""
    cfg = _cfg(redis_url, run_id, tmp_path)

    class PartFails(Probe):
        error: BaseException = Failure("the broadcast part failed: no port")

        async def serve(self) -> int:
            async def part() -> None:
                await asyncio.sleep(0.05)
                raise self.error

            self.spawn(part(), "part")
            return await super().serve()  # waits on `go`, which nobody sets

    probe = PartFails(cfg, bus)
    async with asyncio.timeout(30):
        assert await probe.run() == 1
    failed = [e for e in await events_of(bus, run_keys.events) if isinstance(e, ComponentFailed)]
    assert [(f.role, f.error) for f in failed] == [("logger", "the broadcast part failed: no port")]
    assert probe.torn_down

    built: list[Component] = []

    class PartRestarts(PartFails):
        max_restarts = 1
        error = Restart("the log lost its tail")

        async def serve(self) -> int:
            if len(built) > 1:
                return 0
            return await super().serve()

    def factory(cfg: Config, bus: Bus) -> Component:
        built.append(PartRestarts(cfg, bus))
        return built[-1]

    async with asyncio.timeout(30):
        assert await _run_restarting(cfg, bus, "probe", factory) == 0
    assert len(built) == 2


async def test_a_teardown_that_meets_the_failure_already_said_says_nothing_more(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Redis out of memory ends a component with its one line; the teardown's own writes
    (the profiler service's snapshot) meet the same refusal and add no traceback. Without a
    failure said, a teardown's error is not hidden."""
    from bus import BusOutOfMemory

    class FullRedis(Probe):
        async def teardown(self) -> None:
            raise BusOutOfMemory("Redis is out of memory (the teardown's write)")

    probe = FullRedis(_cfg(redis_url, run_id, tmp_path), bus, fail="Redis is out of memory")
    probe.go.set()
    async with asyncio.timeout(30):
        assert await probe.run() == 1
    err = capfd.readouterr().err
    assert err.count("out of memory") == 1, err

    clean = FullRedis(_cfg(redis_url, run_id, tmp_path), bus)
    clean.go.set()
    with pytest.raises(BusOutOfMemory):
        await clean.run()


async def test_overlapping_reads_fold_each_entry_once_in_order(
    bus: Bus, run_keys: RunKeys
) -> None:
    folded: list[str] = []

    def fold(entries: Sequence[Entry]) -> None:
        folded.extend(e.id for e in entries)

    follower = Follower(bus, run_keys.events, fold=fold, count=7)
    written: list[str] = []

    async def writer() -> None:
        for k in range(60):
            written.append(await bus.publish(run_keys.events, StepStarted(step=k + 1,
                                                                        param_version=0)))
            if k % 9 == 0:
                await bus.publish_raw(run_keys.events, {"garbage": b"x"})

    async def reader(block_ms: int | None) -> None:
        while len(folded) < 60:
            await follower.poll(block_ms=block_ms)

    async with asyncio.timeout(60):
        await asyncio.gather(writer(), reader(200), reader(None), reader(50))
    assert folded == written
    assert entry_key(follower.position) >= entry_key(written[-1])  # past the last garbage


async def test_history_reads_the_archive_where_the_stream_was_trimmed(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    ids = [await bus.publish(run_keys.events, StepStarted(step=k + 1, param_version=0))
           for k in range(30)]
    folder = tmp_path / "events"
    done = await archive_below(bus, run_keys.events, folder, ids[20])
    assert done.trimmed == 20
    folded: list[str] = []
    follower = Follower(bus, run_keys.events, ids[4], archive=folder, count=8,
                        fold=lambda entries: folded.extend(e.id for e in entries))
    assert await follower.catch_up() == 25
    assert folded == ids[5:] and follower.position == ids[-1] and follower.caught_up
    assert await follower.poll() == []


async def test_a_task_dump_names_the_innermost_await_of_every_task() -> None:
    """SIGUSR1's dump (runtime.process.dump_tasks) shows where each task waits: down the
    chain of awaits to the innermost coroutine, not only its outermost frame."""
    import io

    from runtime.process import dump_tasks

    gate = asyncio.Event()

    async def innermost_wait() -> None:
        await gate.wait()

    async def outer() -> None:
        await innermost_wait()

    task = asyncio.create_task(outer(), name="the-outer-task")
    await asyncio.sleep(0)
    out = io.StringIO()
    dump_tasks("probe", out)
    gate.set()
    await task
    text = out.getvalue()
    block = text[text.index("the-outer-task:"):]
    assert "in outer" in block
    assert "in innermost_wait" in block
    assert "in wait" in block  # asyncio.Event.wait: the innermost coroutine
