"""`rlbus up` supervision with real processes: SIGINT, SIGTERM, SIGHUP, a second Ctrl-C and an
expired grace all stop every child (SIGKILL when needed), say so, and print a resume command
that works; a signal while the embedded Redis loads or while the children start stops what
has started (and nothing else); a closed stdout stops the run like a signal."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rlbus import launcher
from rlbus.children import Child, cpu_plan, stop_children
from rlbus.launcher import run_up
from rlbus.ray_launcher import RayChild
from rlbus.redis_server import dir_owner
from runconfig import load_config
from tests.procs import FAST

# Long enough that the run is still going when the signal arrives; no profiler, no logger:
# only the processes under test (embedded Redis, one rollouter, the trainer). A rollouter
# waits heartbeat.timeout_s for the trainer's first lease: on a loaded machine the trainer's
# start-up (importing torch) can take longer than FAST's 20 s, which these tests are not about.
LONG = (*FAST, "trainer.total_training_steps=100000", "trainer.logger=[console]",
        "heartbeat.timeout_s=600")


class Up:
    """`rlbus up` as a process, its merged output read line by line on a thread.

    Waits are event-driven: a line is awaited until it comes or the output ends (the process
    exited); a hang is caught by the test's own timeout (pytest-timeout), never by a guess of
    how long a step takes on this machine."""

    def __init__(self, argv: list[str], cwd: Path, stdout: int = subprocess.PIPE) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.ended = False
        self.proc = subprocess.Popen(
            argv, stdout=stdout, stderr=subprocess.STDOUT, text=True, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # end of output: every writer of the pipe is gone

    def _next(self) -> str | None:
        if self.ended:
            return None
        line = self.lines.get()
        if line is None:
            self.ended = True
        else:
            self.seen.append(line)
        return line

    def wait_line(self, pred: Callable[[str], bool]) -> str:
        while (line := self._next()) is not None:
            if pred(line):
                return line
        raise AssertionError("output ended without a matching line; last lines:\n"
                             + "\n".join(self.seen[-40:]))

    def pids(self) -> dict[str, int]:
        line = self.wait_line(lambda s: "(pid " in s)
        return {name: int(pid) for name, pid in re.findall(r"(\w+) \(pid (\d+)\)", line)}

    def finish(self) -> tuple[int, str]:
        """Read to the end of the output, then the exit code (the launcher's own stop is
        bounded: run.stop_grace_s, then SIGKILL)."""
        while self._next() is not None:
            pass
        return self.proc.wait(), "\n".join(self.seen)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.pump.join()  # EOF once every writer of the pipe is gone
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


def _reap(pids: dict[str, int]) -> None:
    """After a failure: a child this test SIGSTOPped runs in its own session, out of reach of
    up.kill(), and cannot act on its pending SIGTERM: kill it."""
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if f"rlbus {name.rstrip('0123456789')}" in " ".join(proc.cmdline()):  # not a reused pid
                proc.kill()


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
    pids: dict[str, int] = {}
    try:
        pids.update(up.pids())
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
        _reap(pids)


@pytest.mark.e2e
def test_grace_expiry_escalates_to_sigkill(tmp_path: Path) -> None:
    up = _up(tmp_path, "run.stop_grace_s=1")
    pids: dict[str, int] = {}
    try:
        pids.update(up.pids())
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
        _reap(pids)


SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_stop_children_leaves_children_that_never_started_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    never = Child("never", SLEEP, tmp_path / "never.log")
    never_ray = RayChild("never_ray", SLEEP, tmp_path / "never_ray.log")
    stop_children([never, never_ray], 600, None)  # nothing started: no wait, no error
    assert capsys.readouterr().err == ""
    sleeper = Child("sleeper", SLEEP, tmp_path / "sleeper.log")
    sleeper.start(dict(os.environ))
    stop_children([never, sleeper, never_ray], 600, None)
    err = capsys.readouterr().err
    assert "stopping sleeper (SIGTERM" in err and "never" not in err, err
    assert sleeper.returncode() == -signal.SIGTERM and not never.started


class _CtrlC(Child):
    """A child whose start is followed by a Ctrl-C (as if typed right then)."""

    def start(self, env: dict[str, str]) -> None:
        super().start(env)
        os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_while_children_start_stops_those_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    children = [Child("a", SLEEP, logs / "a.log"), _CtrlC("b", SLEEP, logs / "b.log"),
                Child("c", SLEEP, logs / "c.log")]
    monkeypatch.setattr(launcher, "build_children", lambda *args: children)
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.id=sig", "run.stop_grace_s=600"])
    rc = run_up(cfg, ["run.id=sig"])
    out = capsys.readouterr()
    assert rc == 128 + signal.SIGINT, out
    assert [c.started for c in children] == [True, True, False]
    assert all(c.returncode() == -signal.SIGTERM for c in children[:2]), out
    assert "SIGINT (Ctrl-C) received; stopping the run" in out.err
    assert "stopping a, b (SIGTERM" in out.err and "Traceback" not in out.err + out.out
    assert "resume" in out.out and "run.id=sig" in out.out
    assert dir_owner(tmp_path / "redis") is None  # its embedded Redis was stopped too


_LOADING = """#!{python}
# A redis-server that loads forever: it answers every command with -LOADING.
import os, pathlib, socket, sys
conf = pathlib.Path(sys.argv[1]).read_text().splitlines()
port = int(next(line.split()[1] for line in conf if line.startswith("port ")))
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen()
pathlib.Path({marker!r}).write_text(str(os.getpid()))
while True:
    conn, _ = sock.accept()
    conn.recv(4096)
    conn.sendall(b"-LOADING Redis is loading the dataset in memory\\r\\n")
    conn.close()
"""


@pytest.mark.procs
def test_a_signal_while_the_embedded_redis_loads_stops_it(tmp_path: Path) -> None:
    marker = tmp_path / "loading.pid"
    fake = tmp_path / "slow-redis-server"
    fake.write_text(_LOADING.format(python=sys.executable, marker=str(marker)))
    fake.chmod(0o755)
    up = _up(tmp_path, f"redis.binary={fake}")
    try:
        while not marker.exists() or not marker.read_text():  # written once it listens
            assert up.proc.poll() is None, up.finish()[1]
            time.sleep(0.05)
        pid = int(marker.read_text())
        up.proc.send_signal(signal.SIGINT)
        rc, out = up.finish()
        assert rc == 128 + signal.SIGINT, out
        assert "SIGINT (Ctrl-C) received; stopping the run" in out and "Traceback" not in out
        assert "resume" in out and "run.id=sup" in out
        _gone({"redis-server": pid})
    finally:
        up.kill()


@pytest.mark.e2e
def test_closed_stdout_stops_the_run_like_a_signal(tmp_path: Path) -> None:
    err = tmp_path / "stderr.txt"
    with err.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlbus", "up", f"run.output_dir={tmp_path / 'out'}", *LONG],
            stdout=subprocess.PIPE, stderr=err_file, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            line = ""
            while "(pid " not in line:  # `rlbus up | head -2`: the reader goes away here
                line = proc.stdout.readline()
                assert line, err.read_text()
            pids = {n: int(p) for n, p in re.findall(r"(\w+) \(pid (\d+)\)", line)}
            proc.stdout.close()
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = err.read_text()
    assert rc == 128 + signal.SIGPIPE, text
    assert "SIGPIPE (stdout was closed) received; stopping the run" in text
    assert "Traceback" not in text and "resume" in text, text
    _gone(pids)


@pytest.mark.e2e
def test_every_child_ends_within_its_grace_when_rlbus_up_is_killed(tmp_path: Path) -> None:
    # kill -9 of rlbus up: Linux SIGTERMs its children (PR_SET_PDEATHSIG). Their Redis is
    # paused here (a stopped VM, a failover): a graceful stop that writes to it would wait out
    # the bus's retry budget (the profiler service lived 66 s). Each child ends within
    # run.stop_grace_s of the signal all the same, forced if it must be.
    grace = 4
    up = _up(tmp_path, "global_profiler.tool=torch", "global_profiler.steps=[1]",
             f"run.stop_grace_s={grace}", "trainer.logger=[console,tensorboard]")
    pids: dict[str, int] = {}
    server: psutil.Process | None = None
    try:
        line = up.wait_line(lambda s: "(pid " in s)
        pids = {n: int(p) for n, p in re.findall(r"(\w+) \(pid (\d+)\)", line)}
        assert {"trainer", "rollouter0", "profiler", "logger"} <= set(pids), line
        up.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 2)
        server = next(p for p in psutil.Process(up.proc.pid).children()
                      if "redis-server" in p.name())
        server.suspend()
        up.proc.kill()
        up.proc.wait()
        children = [psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)]
        alive = psutil.wait_procs(children, timeout=3 * grace)[1]
        assert not alive, f"children still running {3 * grace} s after: {alive}"
    finally:
        _reap(pids)
        if server is not None:
            with contextlib.suppress(psutil.Error):
                server.kill()
        up.kill()


@pytest.mark.e2e
@pytest.mark.parametrize("after_s", [0.1, 0.2, 0.3, 0.5])
def test_an_early_ctrl_c_is_one_line_whatever_it_interrupts(tmp_path: Path,
                                                            after_s: float) -> None:
    # While the command still imports (before rlbus up or a component wires its handlers),
    # during the embedded Redis's start or the first children's: never a traceback, nothing
    # left running. (Before Python has imported anything of ours, tens of ms after exec, the
    # interrupt is the interpreter's own.)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus", "up", f"run.output_dir={tmp_path / 'out'}", *LONG],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        time.sleep(after_s)
        before = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err and "Traceback" not in out, err
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), (proc.returncode, err)
    assert err.strip(), "the interrupt is said"
    _gone({str(pid): pid for pid in before})
