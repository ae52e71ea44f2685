"""The operator's view: a finished run is not started again, an unreachable Redis is one line,
`rlbus inspect` is for people (times, no heartbeats, plot-only, a Perfetto trace), the metrics
logger's TensorBoard files read back with tensorboard's own reader, and `rlbus profile` only
says yes to a session that will write a trace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from rlbus.profile import WITHDRAWN_PREFIX
from runconfig import config_to_dict, load_config
from runschema.messages import ProfileRequest, ProfileRequestRefused, RunStarted, StartProfile
from tests.procs import FAST, Procs, events_of, run_cli
from tests.waits import wait_for

RUN = "op-run"
STEPS = 3


class FinishedRun:
    def __init__(self, out: Path, stdout: str) -> None:
        self.out = out
        self.stdout = stdout

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, f"run.output_dir={self.out}")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """One short `rlbus up` run, with profiling and the TensorBoard logger, run to the end."""
    out = tmp_path_factory.mktemp("op") / "out"
    res = run_cli("up", f"run.output_dir={out}", f"run.id={RUN}", *FAST,
                  f"trainer.total_training_steps={STEPS}", "global_profiler.tool=torch",
                  "global_profiler.steps=[1,2]", "trainer.logger=[console,tensorboard]",
                  timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return FinishedRun(out, res.stdout)


@pytest.mark.e2e
def test_up_ends_with_a_summary_and_the_logger_in_the_outputs(finished: FinishedRun) -> None:
    assert re.search(r"\(pid \d+\).*logger \(pid \d+\)", finished.stdout), finished.stdout
    assert f"summary: run {RUN}: {STEPS} step(s)" in finished.stdout
    assert "tensorboard --logdir" in finished.stdout
    assert "resume" not in finished.stdout  # nothing to resume after a finished run


@pytest.mark.e2e
def test_up_on_a_finished_run_exits_at_once_saying_so(finished: FinishedRun) -> None:
    res = finished.cli("up", f"run.id={RUN}", f"trainer.total_training_steps={STEPS}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"run {RUN} already finished after {STEPS} steps" in res.stdout
    # Continuing it with more steps: tests/test_faults.py (it would change this shared run).


@pytest.mark.e2e
def test_metrics_logger_tensorboard_files_read_back(finished: FinishedRun) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(finished.out / RUN / "tensorboard"))
    acc.Reload()
    assert "critic/score/mean" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("critic/score/mean")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("timing/step_s")] == list(range(1, STEPS + 1))


@pytest.mark.e2e
def test_tensorboards_own_ui_reader_finds_every_verl_curve(finished: FinishedRun) -> None:
    """What TensorBoard's scalars dashboard reads (its data provider over the plugin
    multiplexer, as `tensorboard --logdir` serves it): every verl name, every step. The
    rollouters' idle share is known from their first pulse on (NaN before: not written)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem

    from tests.test_verl_metrics import VERL_STEP_METRICS

    logdir = finished.out / RUN / "tensorboard"
    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    curves = provider.read_scalars(context.RequestContext(), experiment_id="",
                                   plugin_name="scalars", downsample=10_000)
    assert len(curves) == 1, list(curves)
    points = {tag: [p.step for p in series] for tag, series in next(iter(curves.values())).items()}
    every = list(range(1, STEPS + 1))
    for name in VERL_STEP_METRICS:
        steps = points.get(name, [])
        if name == "fully_async/rollouter/idle_ratio":
            assert steps and steps == every[every.index(steps[0]):], (name, steps)
        else:
            assert steps == every, (name, steps)


@pytest.mark.e2e
def test_inspect_shows_wall_clock_times_and_no_pulses_of_a_finished_run(
    finished: FinishedRun,
) -> None:
    res = finished.cli("inspect", "--run", RUN)
    assert res.returncode == 0, res.stderr
    header, *lines = res.stdout.splitlines()
    assert re.match(rf"run {RUN}: \d+ events from \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d", header)
    assert all(re.match(r"\d\d:\d\d:\d\d\.\d{3} \+\s*\d+\.\d\ds  \w+", ln) for ln in lines)
    assert not any(" Heartbeat " in ln for ln in lines)
    assert any(" StepFinished " in ln for ln in lines)
    # Pulses are liveness keys, not log entries: a finished run has no component alive.
    every = finished.cli("inspect", "--run", RUN, "--heartbeats")
    assert every.returncode == 0, every.stderr
    assert every.stdout.startswith(res.stdout)
    assert every.stdout[len(res.stdout):].startswith("alive now: none"), every.stdout


@pytest.mark.e2e
def test_inspect_plot_writes_only_the_plot(finished: FinishedRun, tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    res = finished.cli("inspect", "--run", RUN, "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = finished.cli("inspect", "--run", RUN, "--plot", str(tmp_path / "no" / "such.png"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.e2e
def test_inspect_trace_has_a_track_per_component(finished: FinishedRun, tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    res = finished.cli("inspect", "--run", RUN, "--trace", str(path))
    assert res.returncode == 0, res.stderr
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"trainer", "rollouter0", "profiler service", f"run {RUN}"} <= names, names
    steps = [e for e in events if e["ph"] == "X" and e.get("cat") == "step"]
    assert [e["name"] for e in steps] == [f"step {k}" for k in range(1, STEPS + 1)]
    assert all("critic/score/mean" in e["args"] for e in steps)
    gen = [e for e in events if e.get("cat") == "generation"]
    assert gen and all(e["pid"] >= 10 for e in gen)
    profiles = [e for e in events if e.get("cat") == "profile"]
    assert {(e["pid"], e["name"]) for e in profiles} >= {(1, "profile steps 1-1 (ok)"),
                                                          (10, "profile steps 1-1 (ok)")}
    for e in profiles:
        assert Path(e["args"]["trace"]).is_file(), e
    assert any(e["name"].startswith("weights v") for e in events)
    assert all(e["ts"] >= 0 for e in events if "ts" in e)


@pytest.mark.e2e
def test_profile_refuses_a_finished_run(finished: FinishedRun) -> None:
    res = finished.cli("profile", "--run", RUN, "--steps", "next:1")
    assert res.returncode == 2 and "has finished" in res.stderr, res.stderr


@pytest.mark.procs
def test_inspect_with_a_wrong_output_dir_creates_nothing(tmp_path: Path) -> None:
    res = run_cli("inspect", "--run", "x", "run.output_dir=typo", cwd=tmp_path)
    assert res.returncode == 1 and "no embedded Redis data in typo/redis" in res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_unreachable_redis_is_one_line_from_every_command(tmp_path: Path) -> None:
    url = "redis.url=redis://127.0.0.1:1/0"
    commands = {
        "up": ["up", url, f"run.output_dir={tmp_path / 'out'}"],
        "trainer": ["trainer", url, "run.id=x"],
        "rollouter": ["rollouter", url, "run.id=x"],
        "profiler": ["profiler", url, "run.id=x", "global_profiler.tool=torch"],
        "logger": ["logger", url, "run.id=x", f"run.output_dir={tmp_path / 'out'}"],
        "inspect": ["inspect", "--run", "x", url],
        "profile": ["profile", "--run", "x", "--steps", "3", url],
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "rlbus", *argv], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for name, argv in commands.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode == 1, (name, out, err)
        assert "Traceback" not in err, (name, err)
        assert len(lines) == 1 and "redis://127.0.0.1:1/0" in lines[0], (name, err)
    assert not (tmp_path / "out").exists()  # nothing created before Redis answered


@pytest.mark.procs
@pytest.mark.asyncio
async def test_profile_refuses_at_once_a_run_with_profiling_off(
    bus: Bus, redis_url: str, run_id: str
) -> None:
    keys = RunKeys(run_id)
    cfg = config_to_dict(load_config(None, [f"run.id={run_id}"]))  # global_profiler.tool null
    await bus.publish(keys.events, RunStarted(run_id=run_id, config=cfg))
    res = run_cli("profile", "--run", run_id, "--steps", "next:1", f"redis.url={redis_url}")
    assert res.returncode == 2, res.stderr
    assert "profiling off" in res.stderr and "global_profiler.tool" in res.stderr
    # Refused before anything was queued: no later profiler can serve it.
    assert not any(isinstance(m, ProfileRequest) for m in await events_of(bus, keys.events))


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_timed_out_request_is_withdrawn_and_never_served_later(
    bus: Bus, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    keys = RunKeys(run_id)
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}",
            "global_profiler.tool=torch", "trainer.total_training_steps=50"]
    await bus.publish(keys.events, RunStarted(run_id=run_id,
                                              config=config_to_dict(load_config(None, args))))
    late = run_cli("profile", "--run", run_id, "--steps", "5", "--timeout", "0.5", *args[:1])
    assert late.returncode == 1 and "withdrawn" in late.stderr, late.stderr
    first = next(m for m in await events_of(bus, keys.events) if isinstance(m, ProfileRequest))
    refused = [m for m in await events_of(bus, keys.events)
               if isinstance(m, ProfileRequestRefused) and m.request_id == first.request_id]
    assert refused and refused[0].reason.startswith(WITHDRAWN_PREFIX)
    # A profiler service started now reads both from the log and serves only a new request.
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("profiler", "profiler_service", *args)
        ok = run_cli("profile", "--run", run_id, "--steps", "7", *args[:1])
        assert ok.returncode == 0, ok.stdout + ok.stderr + procs.log("profiler")
        await wait_for(bus, keys.control, lambda m: isinstance(m, StartProfile)
                       and bool(m.request_id), 30, procs.watch("profiler"),
                       what="a StartProfile answering a request")
        served = [m.request_id for m in await events_of(bus, keys.control)
                  if isinstance(m, StartProfile) and m.request_id]
        assert first.request_id not in served and len(served) == 1, served
    finally:
        procs.kill_all()
