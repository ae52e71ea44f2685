"""`rlbus inspect` beyond the timeline: the pulses of the components alive now
(``--heartbeats``), the plot's validation curves, and ``--plot`` where matplotlib is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bus import Bus, RunKeys, pulse
from rlbus.inspect import step_stacks, validation_curves
from runconfig import config_to_dict, load_config
from runschema.messages import Heartbeat, RunStarted, StepFinished, ValidationFinished
from tests.procs import run_cli


async def _started(bus: Bus, run_id: str) -> RunKeys:
    keys = RunKeys(run_id)
    cfg = config_to_dict(load_config(None, [f"run.id={run_id}"]))
    await bus.publish(keys.events, RunStarted(run_id=run_id, config=cfg))
    return keys


@pytest.mark.procs
@pytest.mark.asyncio
async def test_heartbeats_shows_each_live_component_s_latest_pulse(
    bus: Bus, redis_url: str, run_id: str
) -> None:
    keys = await _started(bus, run_id)
    await pulse(bus, keys.alive("rollouter", 3), Heartbeat(
        role="rollouter", rank=3, pid=4242, state="weights v7, validating (val-v6)",
        metrics={"rollouter/idle_ratio": 0.25}, progress=1234), ttl_s=600)
    await pulse(bus, keys.alive("trainer", 0), Heartbeat(
        role="trainer", rank=0, pid=77, state="step 12"), ttl_s=600)
    res = run_cli("inspect", "--run", run_id, "--heartbeats", f"redis.url={redis_url}")
    assert res.returncode == 0, res.stderr
    live = res.stdout.split("alive now: ", 1)[1].splitlines()
    assert live[0] == "2 component(s)"
    assert live[1].startswith("  rollouter3 pid 4242: weights v7, validating (val-v6) "
                              "progress=1234 rollouter/idle_ratio=0.25"), live
    assert live[2].startswith("  trainer0 pid 77: step 12"), live
    # Without the flag: the log only (a pulse is not a fact of the run).
    plain = run_cli("inspect", "--run", run_id, f"redis.url={redis_url}")
    assert plain.returncode == 0 and "alive now" not in plain.stdout and "4242" not in plain.stdout


@pytest.mark.procs
@pytest.mark.asyncio
async def test_plot_without_matplotlib_is_one_line_saying_how_to_get_it(
    bus: Bus, redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _started(bus, run_id)
    # A matplotlib that cannot be imported, first on the path (as in `make demo`'s venv).
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('no matplotlib here')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    res = run_cli("inspect", "--run", run_id, "--plot", str(tmp_path / "run.png"),
                  f"redis.url={redis_url}")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--plot needs matplotlib" in lines[0] and "pip install" in lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run.png").exists()


def test_validation_curves_are_each_data_source_s_headline_by_step() -> None:
    events = [
        StepFinished(step=1, sample_ids=[], metrics={}, duration_s=1.0),
        ValidationFinished(request_id="val-v0", version=0, step=0, rank=0, metrics={
            "val-core/gsm8k/acc/mean@1": 0.1, "val-core/gsm8k/acc/best@2/mean": 0.3,
            "val-aux/gsm8k/exact/mean@1": 0.0, "val-core/math/acc/mean@1": 0.2}),
        ValidationFinished(request_id="val-v2", version=2, step=2, rank=1, metrics={},
                           error="weights v2 are not in the log"),
        ValidationFinished(request_id="val-v4", version=4, step=4, rank=0, metrics={
            "val-core/gsm8k/acc/mean@1": 0.5, "val-core/math/acc/mean@1": 0.6}),
    ]
    assert validation_curves(events) == {
        "val-core/gsm8k/acc/mean@1": ([0, 4], [0.1, 0.5]),
        "val-core/math/acc/mean@1": ([0, 4], [0.2, 0.6]),
    }


def test_step_stacks_are_the_laps_of_each_step_without_the_all_zero_ones() -> None:
    """--plot's stacked panels: the trainer's laps in ms (not the totals beside them) and
    the rollouters' shares; a lap zero in every step is not drawn, a run without laps
    draws no panel."""
    steps = [
        StepFinished(step=1, sample_ids=[], duration_s=1.0, metrics={
            "timing_s/step": 0.1, "timing_s/wait_samples": 0.06, "timing_s/judge": 0.04,
            "timing_s/profiler": 0.0, "timing_s/update_actor": 0.08,
            "rollouter/timing_share/generate": 0.7, "rollouter/timing_share/idle": 0.3}),
        StepFinished(step=2, sample_ids=[], duration_s=1.0, metrics={
            "timing_s/step": 0.05, "timing_s/wait_samples": 0.0, "timing_s/judge": 0.05,
            "timing_s/profiler": 0.0, "timing_s/update_actor": 0.04}),
    ]
    stacks = step_stacks(steps)
    assert list(stacks) == ["trainer step (ms)", "rollouter loop (share)"]
    xs, trainer = stacks["trainer step (ms)"]
    assert xs == [1, 2]
    assert trainer == {"judge": [40.0, 50.0], "wait_samples": [60.0, 0.0]}
    assert stacks["rollouter loop (share)"][1] == {"generate": [0.7, 0.0], "idle": [0.3, 0.0]}
    assert step_stacks([StepFinished(step=1, sample_ids=[], metrics={}, duration_s=1.0)]) == {}
