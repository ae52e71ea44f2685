"""Helpers for integration tests: run components as real processes and wait on run events.

``spawn(module, *args, log=path)`` starts ``python -m module args...`` in its own session;
``Procs`` tracks them and kills leftovers; ``wait_for(bus, stream, pred, timeout_s)`` waits for
the first event matching ``pred`` (synchronising on events, never on sleeps).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bus import Bus, Message, RunKeys
from bus.history import find_archive, read_history

__all__ = ["FAST", "Procs", "events_of", "run_cli", "wait_exit", "wait_for"]

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
    """Component processes of one test; ``kill_all`` is idempotent."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, module: str, *args: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} did not exit within {timeout_s} s; its log:\n{self.log(name)[-3000:]}"
            ) from None

    def kill_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                proc.wait(timeout=30)
            del name


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    return proc.wait(timeout=timeout_s)


async def events_of(bus: Bus, stream: str) -> list[Message]:
    """Every entry of ``stream``; for a run's events stream, the events that retention
    archived (found through the path the trainer recorded, bus.history) and then the
    stream's."""
    m = re.fullmatch(r"rlbus:\{(.+)\}:events", stream)
    if m is None:
        return [msg async for _, msg in bus.read_all(stream)]
    keys = RunKeys(m[1])
    archive = await find_archive(bus, keys, None)
    return [msg async for _, msg in read_history(bus, stream, archive)]


async def wait_for(
    bus: Bus,
    stream: str,
    pred: Callable[[Message], bool],
    timeout_s: float,
    procs: Procs | None = None,
    watch: Iterable[str] = (),
) -> Message:
    """The first entry of ``stream`` (from its beginning) matching ``pred``.

    Fails with the logs of ``watch`` processes when one of them died or the time ran out.
    """
    deadline = time.monotonic() + timeout_s
    cursor = "0"
    while time.monotonic() < deadline:
        entries, cursor = await bus.read_after(stream, cursor, count=1000, block_ms=200)
        for _, msg in entries:
            if pred(msg):
                return msg
        if procs is not None:
            for name in watch:
                rc = procs.procs[name].poll()
                if rc is not None and rc != 0:
                    raise AssertionError(f"{name} exited {rc}:\n{procs.log(name)[-3000:]}")
    logs = "\n".join(f"--- {n}\n{procs.log(n)[-2000:]}" for n in watch) if procs else ""
    raise AssertionError(f"no matching event on {stream} within {timeout_s} s\n{logs}")


def run_cli(*args: str, timeout_s: float = 120, cwd: Path | None = None) -> (
    subprocess.CompletedProcess[str]
):
    """``rlbus ARGS`` as a process (``python -m rlbus``), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rlbus", *args], capture_output=True, text=True,
        timeout=timeout_s, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
