"""Helpers for integration tests: run components as real processes and read a run's log.

``Procs(log_dir).spawn(name, module, *args)`` starts ``python -m module args...`` in its own
session with its output in ``log_dir/name.log``, as a :class:`tests.waits.Watched`;
``Procs.kill_all`` kills leftovers. The waits (on events, logs, exits) are in
:mod:`tests.waits`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from bus import Bus, RunKeys
from runschema.messages import Message, StepFinished
from runtime import LogFollower
from runtime.history import find_archive
from tests.waits import Watched, wait_exit_blocking

__all__ = ["FAST", "Procs", "assert_every_step_once", "events_of", "run_args", "run_cli"]

# Small, fast runs: a few steps of the default task with short timeouts.
FAST = (
    "trainer.ppo_mini_batch_size=4",
    "async_training.require_batches=1",
    "rollout.n=4",
    "rollout.prompts_per_batch=4",
    "heartbeat.interval_s=0.5",
    "heartbeat.timeout_s=20",
    "trainer.save_freq=0",
)


class Procs:
    """Component processes of one test, by name; ``kill_all`` is idempotent."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Watched] = {}

    def spawn(self, name: str, module: str, *args: str) -> Watched:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with path.open("ab") as log:  # the child keeps its own copy of the fd
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self.procs[name] = Watched(name, popen, path)
        return self.procs[name]

    def watch(self, *names: str) -> list[Watched]:
        """The named processes, for a wait to watch."""
        return [self.procs[name] for name in names]

    def log(self, name: str) -> str:
        return self.procs[name].log() if name in self.procs else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal ``name``'s whole process group and wait for it to exit."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            wait_exit_blocking(proc, 30)

    def wait(self, name: str, timeout_s: float) -> int:
        """``name``'s exit code (fails with its log if it runs past ``timeout_s``)."""
        return wait_exit_blocking(self.procs[name], timeout_s)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                wait_exit_blocking(proc, 30)


async def events_of(bus: Bus, stream: str) -> list[Message]:
    """Every entry of ``stream``; for a run's events stream, the run's whole log: the events
    that retention archived (found through the path the trainer recorded, runtime.history),
    then the stream's, merged with the other roles' streams (entries a role may not state
    are refused, as every component refuses them)."""
    m = re.fullmatch(r"rlbus:\{(.+)\}:events", stream)
    if m is None:
        return [msg async for _, msg in bus.read_all(stream)]
    keys = RunKeys(m[1])
    archive = await find_archive(bus, keys, None)
    # The whole log: every role's stream, merged by id (what the components fold).
    log = LogFollower(bus, keys, archive=archive)
    return [msg async for batch in log.history() for _, msg in batch]


def run_rollouter_and_trainer(log_dir: Path, args: list[str], timeout_s: float = 300) -> None:
    """rollouter0 and the trainer as processes on ``args``, to the run's end: both exit 0,
    else the test fails with the log of the one that did not."""
    procs = Procs(log_dir)
    try:
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        assert procs.wait("trainer", timeout_s) == 0, procs.log("trainer")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    finally:
        procs.kill_all()


def run_cli(*args: str, timeout_s: float = 120, cwd: Path | None = None) -> (
    subprocess.CompletedProcess[str]
):
    """``rlbus ARGS`` as a process (``python -m rlbus``), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rlbus", *args], capture_output=True, text=True,
        timeout=timeout_s, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def run_args(redis_url: str, run_id: str, out: Path, *extra: str) -> list[str]:
    """The overrides of a test's run: its Redis, run id and output folder, :data:`FAST`,
    then ``extra``."""
    return [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={out}", *FAST, *extra]


def assert_every_step_once(events: list[Message], steps: int) -> None:
    """Steps 1..``steps`` finished (the last copy of each counts) and no sample id was
    trained twice."""
    finished = {e.step: e for e in events if isinstance(e, StepFinished)}
    assert sorted(finished) == list(range(1, steps + 1))
    trained = [sid for e in finished.values() for sid in e.sample_ids]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
