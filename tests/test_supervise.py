"""`rlbus up` supervision with real processes: SIGINT, SIGTERM, SIGHUP, a second Ctrl-C and an
expired grace all stop every child (SIGKILL when needed), say so, and print a resume command
that works."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rlbus.launcher import cpu_plan
from tests.procs import FAST

# Long enough that the run is still going when the signal arrives; no profiler, no logger:
# only the processes under test (embedded Redis, one rollouter, the trainer).
LONG = (*FAST, "trainer.total_training_steps=100000", "trainer.logger=[console]")
WAIT_S = 120


class Up:
    """`rlbus up` as a process, its merged output read line by line on a thread."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_line(self, pred: Callable[[str], bool], timeout_s: float = WAIT_S) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError("no matching line; output so far:\n"
                                     + "\n".join(self.seen[-40:])) from None
            self.seen.append(line)
            if pred(line):
                return line

    def pids(self) -> dict[str, int]:
        line = self.wait_line(lambda s: "(pid " in s)
        return {name: int(pid) for name, pid in re.findall(r"(\w+) \(pid (\d+)\)", line)}

    def finish(self, timeout_s: float = WAIT_S) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout_s)
        while True:
            try:
                self.seen.append(self.lines.get(timeout=5))
            except queue.Empty:
                break
        return rc, "\n".join(self.seen)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.pump.join(timeout=30)  # EOF once every writer of the pipe is gone
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _up(tmp_path: Path, *extra: str) -> Up:
    argv = [sys.executable, "-m", "rlbus", "up", f"run.output_dir={tmp_path / 'out'}",
            "run.id=sup", *LONG, *extra]
    return Up(argv, tmp_path)


def _gone(pids: dict[str, int]) -> None:
    alive = {n: p for n, p in pids.items()
             if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
    assert not alive, f"children still running: {alive}"


def _pinned_apart(pids: dict[str, int]) -> None:
    """run.cpu_affinity=auto (the default): trainer and rollouter, every thread of each, on
    CPUs of their own (on a machine with at least 2)."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        return
    sets = {}
    for name in ("trainer", "rollouter0"):
        tids = [t.id for t in psutil.Process(pids[name]).threads()]
        assert len(tids) > 1  # the event loop, the torch worker, ...
        sets[name] = {frozenset(os.sched_getaffinity(t)) for t in tids}
        assert len(sets[name]) == 1, (name, sets[name])
    trainer, rollouter = sets["trainer"].pop(), sets["rollouter0"].pop()
    assert len(trainer) == 1 and len(rollouter) == 1 and not trainer & rollouter
    assert trainer | rollouter <= mine


@pytest.mark.parametrize(
    ("available", "demands", "expected"),
    [
        ([0, 1], [("trainer", 1), ("rollouter0", 1)], {"trainer": {0}, "rollouter0": {1}}),
        # The second replica does not fit: it and everything after it run anywhere.
        ([0, 1], [("trainer", 1), ("rollouter0", 1), ("rollouter1", 1)],
         {"trainer": {0}, "rollouter0": {1}}),
        ([2, 5, 7, 9], [("trainer", 2), ("rollouter0", 3), ("rollouter1", 1)],
         {"trainer": {2, 5}}),
        ([3, 1, 2, 0], [("trainer", 0), ("rollouter0", 2)], {"trainer": {0}, "rollouter0": {1, 2}}),
        ([0], [("trainer", 1), ("rollouter0", 1)], {}),  # one CPU: nothing to gain
    ],
)
def test_cpu_plan(available: list[int], demands: list[tuple[str, int]],
                  expected: dict[str, set[int]]) -> None:
    plan = cpu_plan(available, demands)
    assert {k: set(v) for k, v in plan.items()} == expected


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_stops_every_child_and_prints_resume(tmp_path: Path, sig: int) -> None:
    up = _up(tmp_path)
    try:
        pids = up.pids()
        assert set(pids) == {"rollouter0", "trainer"}, pids
        up.wait_line(lambda s: s.startswith("step ") and "/100000" in s)
        _pinned_apart(pids)
        up.proc.send_signal(sig)
        rc, out = up.finish()
        assert rc == 128 + sig, out
        _gone(pids)
        assert "stopping rollouter0, trainer" in out, out
        assert "received; stopping the run" in out, out
        assert "Traceback" not in out, out
        line = next(s for s in out.splitlines() if s.strip().startswith("resume "))
        resume = shlex.split(line.strip().removeprefix("resume"))
        assert resume[:2] == ["rlbus", "up"] and resume[-1] == "run.id=sup", line
        assert set(LONG) <= set(resume), line
    finally:
        up.kill()
    if sig != signal.SIGTERM:
        return
    # The printed command resumes the run: same id, after the steps already done.
    again = Up([sys.executable, "-m", "rlbus", *resume[1:]], tmp_path)
    try:
        again.wait_line(lambda s: s.startswith("resuming run sup after step "))
        again.wait_line(lambda s: s.startswith("step "))
        again.proc.send_signal(signal.SIGTERM)
        rc, out = again.finish()
        assert rc == 128 + signal.SIGTERM, out
    finally:
        again.kill()


@pytest.mark.e2e
def test_second_ctrl_c_kills_a_child_that_does_not_stop(tmp_path: Path) -> None:
    up = _up(tmp_path, "run.stop_grace_s=600")
    try:
        pids = up.pids()
        up.wait_line(lambda s: s.startswith("step "))
        os.kill(pids["trainer"], signal.SIGSTOP)  # it cannot act on SIGTERM any more
        up.proc.send_signal(signal.SIGINT)
        up.wait_line(lambda s: "stopping rollouter0, trainer" in s)
        up.proc.send_signal(signal.SIGINT)
        rc, out = up.finish()
        assert rc == 130, out
        killed = next(s for s in out.splitlines() if "second signal: killing" in s)
        assert "trainer" in killed and "(SIGKILL)" in killed, out
        _gone(pids)
    finally:
        up.kill()


@pytest.mark.e2e
def test_grace_expiry_escalates_to_sigkill(tmp_path: Path) -> None:
    up = _up(tmp_path, "run.stop_grace_s=1")
    try:
        pids = up.pids()
        up.wait_line(lambda s: s.startswith("step "))
        os.kill(pids["rollouter0"], signal.SIGSTOP)
        up.proc.send_signal(signal.SIGTERM)
        rc, out = up.finish()
        assert rc == 143, out
        killed = next(s for s in out.splitlines() if "still running after 1 s: killing" in s)
        assert "rollouter0" in killed and "(SIGKILL)" in killed, out
        _gone(pids)
    finally:
        up.kill()
