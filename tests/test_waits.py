"""The tests' own waits (tests/waits.py): each ends when its condition holds, fails naming what
it waited for when its bound passes, and fails at once, with the log, when a process it
watches dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import StepStarted
from tests.waits import (
    Watched,
    event,
    wait_exit,
    wait_for,
    wait_log,
    wait_until,
    wait_until_blocking,
)


def _script(tmp_path: Path, name: str, code: str) -> Watched:
    log = tmp_path / f"{name}.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen([sys.executable, "-c", code], stdout=fh,
                                 stderr=subprocess.STDOUT)
    return Watched(name, popen, log)


@pytest.mark.asyncio
async def test_wait_until_returns_the_first_result_that_is_not_none() -> None:
    calls: list[int] = []

    async def third() -> int | None:
        calls.append(1)
        return len(calls) if len(calls) == 3 else None

    assert await wait_until(third, "the third call", 30) == 3
    assert wait_until_blocking(lambda: 0, "a zero", 30) == 0  # a falsy result is a result


@pytest.mark.asyncio
async def test_a_wait_that_runs_out_says_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.1 s waiting for the moon"):
        await wait_until(lambda: None, "the moon", 0.1)
    with pytest.raises(AssertionError, match=r"waiting for the sun"):
        wait_until_blocking(lambda: None, "the sun", 0.1)


@pytest.mark.asyncio
async def test_wait_for_names_the_event_and_the_stream(bus: Bus, run_keys: RunKeys) -> None:
    await bus.publish(run_keys.events, StepStarted(step=1, param_version=0))
    await bus.publish(run_keys.events, StepStarted(step=2, param_version=1))
    got = await wait_for(bus, run_keys.events, event(StepStarted, step=2), 30)
    assert got == StepStarted(step=2, param_version=1, ts=got.ts)  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match=rf"StepStarted\(step=3\) on {run_keys.events}"):
        await wait_for(bus, run_keys.events, event(StepStarted, step=3), 0.3)


@pytest.mark.asyncio
async def test_a_watched_process_that_fails_ends_the_wait_with_its_log(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    dead = _script(tmp_path, "dead", "print('cannot go on'); raise SystemExit(3)")
    assert await wait_exit(dead, 60) == 3
    with pytest.raises(AssertionError, match=r"(?s)dead exited 3 while waiting.*cannot go on"):
        await wait_for(bus, run_keys.events, event(StepStarted), 600, [dead])
    # Waiting for a line of a process that has exited without writing it fails at once.
    with pytest.raises(AssertionError, match="dead exited 3 before writing 'ready'"):
        await wait_log(dead, "ready", 600)
    await wait_log(dead, "cannot go on", 600)


@pytest.mark.asyncio
async def test_wait_exit_of_a_process_that_runs_on_names_it(tmp_path: Path) -> None:
    sleeper = _script(tmp_path, "sleeper", "import time; print('up', flush=True); time.sleep(60)")
    try:
        await wait_log(sleeper, "up", 60)
        with pytest.raises(AssertionError, match=r"waiting for sleeper to exit"):
            await wait_exit(sleeper, 0.1)
    finally:
        sleeper.popen.kill()
        sleeper.wait(timeout=30)
