"""A lost rollouter is restarted while the run goes on (rlbus.watching.RestartPolicy): the
loss is named in the run's event log and on the console, the run finishes, no step is lost
and no sample is trained twice. The trainer is never restarted."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from rlbus.children import Console
from rlbus.supervise import Supervisor
from rlbus.watching import Progress, RestartPolicy, RunWatch, Summary
from runschema.messages import ComponentFailed, WarningRaised
from tests.procs import FAST, assert_every_step_once, events_of
from tests.test_supervise import Up


def test_policy_restarts_rollouters_profiler_logger_within_the_bound() -> None:
    policy = RestartPolicy(max_restarts=2)
    assert [policy.restart("rollouter1") for _ in range(3)] == [True, True, False]
    assert policy.restart("rollouter0") and policy.restart("logger") and policy.restart("profiler")
    assert not policy.restart("trainer")
    assert not policy.restart("rollouter2", rc=2)  # a config error fails again: not restarted
    assert "rollouter2" not in policy.restarts
    assert policy.restarts == {"rollouter1": 2, "rollouter0": 1, "logger": 1, "profiler": 1}
    assert not RestartPolicy(max_restarts=0).restart("rollouter0")


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_killed_rollouter_is_restarted_and_the_run_finishes(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    steps = 8
    up = Up([sys.executable, "-m", "rlbus", "up", f"redis.url={redis_url}", f"run.id={run_id}",
             f"run.output_dir={tmp_path / 'out'}", *FAST, "trainer.logger=[console]",
             "rollout.replicas=2", "heartbeat.timeout_s=5",
             f"trainer.total_training_steps={steps}"], tmp_path)
    try:
        pids = up.pids()
        assert set(pids) == {"rollouter0", "rollouter1", "trainer"}, pids
        up.wait_line(lambda s: s.startswith("step ") and int(s.split()[1].split("/")[0]) >= 2)
        os.kill(pids["rollouter1"], signal.SIGKILL)
        rc, out = up.finish()
    finally:
        up.kill()
    assert rc == 0, out
    restarted = [s for s in out.splitlines() if s.startswith("warning from rlbus up: ")]
    assert len(restarted) == 1, out
    assert "rollouter1 failed (exit code -9); restarted (1 of 3" in restarted[0], out
    assert "Traceback" not in out, out
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    warnings = [e for e in events if isinstance(e, WarningRaised) and e.source == "rlbus up"]
    assert [(w.code, w.message.split(";")[0]) for w in warnings] == [
        ("component_restarted", "rollouter1 failed (exit code -9)")]
    # The restarted rollouter ran to the run's end (the killed one could not say this).
    log = (tmp_path / "out" / run_id / "logs" / "rollouter1.log").read_text()
    assert f"rollouter1: run {run_id} finished" in log, log[-2000:]


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_past_the_bound_the_loss_stops_the_run_named_with_the_resume_command(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """run.max_restarts=0: a lost rollouter stops the run as the trainer's loss does: a
    component_failed warning in the log, its log tail on the console, the resume command."""
    up = Up([sys.executable, "-m", "rlbus", "up", f"redis.url={redis_url}", f"run.id={run_id}",
             f"run.output_dir={tmp_path / 'out'}", *FAST, "trainer.logger=[console]",
             "run.max_restarts=0", "trainer.total_training_steps=100000"], tmp_path)
    try:
        pids = up.pids()
        up.wait_line(lambda s: s.startswith("step "))
        os.kill(pids["rollouter0"], signal.SIGKILL)
        rc, out = up.finish()
    finally:
        up.kill()
    assert rc == 1, out
    assert "rlbus up: rollouter0 failed (exit code -9); last lines of " in out, out
    assert any(s.strip().startswith("resume ") and f"run.id={run_id}" in s
               for s in out.splitlines()), out
    events = await events_of(bus, run_keys.events)
    logged = [(e.code, e.message) for e in events
              if isinstance(e, WarningRaised) and e.source == "rlbus up"]
    assert logged == [("component_failed", "rollouter0 failed (exit code -9); the run stops")]


class _Task:
    """A component as RunWatch sees it (a Ray task: ``lost`` says what Ray lost)."""

    def __init__(self, name: str, rc: int | None, lost: str = "") -> None:
        self.name, self.rc, self.lost, self.starts = name, rc, lost, 0
        self.log_path = Path("/nonexistent") / f"{name}.log"

    def returncode(self) -> int | None:
        return self.rc

    def start(self, env: dict[str, str]) -> None:
        self.rc, self.lost, self.starts = None, "", self.starts + 1

    def log_tail(self) -> str:
        return ""


def _watch(*children: _Task, max_restarts: int = 3) -> RunWatch:
    sup = Supervisor()
    return RunWatch("r", list(children), sup, Progress(10, 0, Console(sup)), Summary(), set(),
                    policy=RestartPolicy(max_restarts))


def test_a_lost_node_restarts_its_rollouter_and_names_it() -> None:
    lost = _Task("rollouter1", 1, "NodeDiedError: node ID: abc")
    watch = _watch(_Task("trainer", None), lost)
    assert watch._verdict() is None and lost.starts == 1
    assert watch.pending == [("component_restarted", "rollouter1 lost: NodeDiedError: node ID: "
                              "abc; restarted (1 of 3, run.max_restarts)")]


def test_the_trainer_is_looked_at_first_and_never_restarted() -> None:
    rollouter, trainer = _Task("rollouter0", 1), _Task("trainer", 1)
    watch = _watch(rollouter, trainer)
    assert watch._verdict() == 1
    assert rollouter.starts == 0 and trainer.starts == 0
    assert [code for code, _ in watch.pending] == ["component_failed"]


def test_a_node_lost_after_the_run_finished_fails_nothing() -> None:
    lost = _Task("rollouter0", 1, "NodeDiedError: node ID: abc")
    watch = _watch(_Task("trainer", 0), lost)
    watch.finished_at = time.monotonic()
    assert watch._verdict() == 0 and lost.starts == 0
    assert [code for code, _ in watch.pending] == ["component_lost"]


def test_placement_verdict_waits_warns_once_then_gives_up_at_the_bound() -> None:
    from rlbus.watching import placement_verdict

    assert placement_verdict(5, 300, warned=False) == "wait"
    assert placement_verdict(30, 300, warned=False) == "warn"  # said at 30 s ...
    assert placement_verdict(200, 300, warned=True) == "wait"  # ... once, then waits on
    assert placement_verdict(300, 300, warned=True) == "fail"
    assert placement_verdict(301, 300, warned=False) == "fail"
    assert placement_verdict(1, 2, warned=False) == "warn"  # a short bound: at its half


class _Unplaced(_Task):
    """A Ray task no node has started yet (submitted ``waited`` seconds ago)."""

    def __init__(self, name: str, waited: float) -> None:
        super().__init__(name, None)
        self.placed, self.started = False, True
        self.submitted_at = time.monotonic() - waited

    def asks(self) -> str:
        return "num_cpus=1, resources={'slot': 1.0}"


def test_an_unplaced_task_is_named_once_then_stops_the_run_at_the_bound() -> None:
    unplaced = _Unplaced("rollouter1", waited=40)
    watch = _watch(_Task("trainer", None), _Task("rollouter0", None), unplaced)
    watch.placement_timeout_s = 300
    assert watch._verdict() is None and watch._verdict() is None  # said once, then waits
    assert [code for code, _ in watch.pending] == ["component_unplaced"]
    assert watch.pending[0][1].startswith("rollouter1 not placed by Ray after 40 s: ")
    assert "{'slot': 1.0}" in watch.pending[0][1]
    assert "run.ray.placement_timeout_s" in watch.pending[0][1]
    unplaced.submitted_at -= 300
    assert watch._verdict() == 1
    assert watch.pending[-1][0] == "component_failed"
    assert watch.pending[-1][1].endswith("gave up (run.ray.placement_timeout_s); the run stops")


def test_a_placed_task_and_a_local_child_have_no_placement_wait() -> None:
    placed = _Unplaced("trainer", waited=1000)
    placed.placed = True
    watch = _watch(placed, _Task("rollouter0", None))
    watch.placement_timeout_s = 1
    assert watch._verdict() is None and watch.pending == []


@pytest.mark.asyncio
async def test_an_exit_is_judged_after_what_the_child_wrote_before_it(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The trainer wrote its ComponentFailed and exited before the watch's next read (the
    watch may wait between reads, RunWatch.SHOW_GATHER_S): the failure is shown, then the
    run judged; an exit never hides the last events."""
    await bus.publish(run_keys.log("trainer"), ComponentFailed(
        role="trainer", rank=0, error="CUDA out of memory on rank 0"))
    sup = Supervisor()
    watch = RunWatch(run_id, [_Task("trainer", 1), _Task("rollouter0", None)], sup,
                     Progress(10, 0, Console(sup)), Summary(), set(),
                     policy=RestartPolicy(0))
    assert await watch.run(redis_url) == 1
    out = capsys.readouterr()
    said = (out.out + out.err).splitlines()
    failed = [i for i, s in enumerate(said) if s == "trainer0 failed: CUDA out of memory on rank 0"]
    judged = [i for i, s in enumerate(said) if s.startswith("rlbus up: trainer failed")]
    assert len(failed) == 1 and len(judged) == 1 and failed[0] < judged[0], said
