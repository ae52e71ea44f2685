"""verl's step unit on every role: with ``trigger_parameter_sync_step=2``, verl step 2 of
``global_profiler.steps`` is parameter version 2, the trainer's updates 3-4, and a session's
trainer and rollouter windows cover the same stretch of the run (docs/profiling.md, *Step
semantics*).

The profiler service, a rollouter and the trainer run as real processes against a throwaway
redis-server. The session ``s2-2`` (named by the verl step) profiles updates 3 and 4 on both
roles: each trace holds the annotations ``step:3`` and ``step:4`` (updates), and the run's
fifth update (a partial third version) is not profiled.

Both traces carry absolute times (torch's ``baseTimeNanoseconds`` + ``ts``, microseconds, the
host's wall clock) and so do the events (``ts``, ``time.time()`` when written), all on this
machine, so they are compared on one clock. ``CLOCK_SLACK_S`` only absorbs the conversion of
torch's clock to wall-clock time (a few ms measured); it is not a bound on speed.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bus import Bus, RunKeys
from runschema.messages import (
    ProfileStopped,
    RunFinished,
    StepFinished,
    StepStarted,
    WeightsPublished,
)
from tests.procs import FAST, Procs, events_of

pytestmark = pytest.mark.e2e

TOTAL = 5  # syncs after updates 2 and 4 (weights v1, v2), then one more update
TRIGGER = 2
VERL_STEP = 2  # global_profiler.steps=[2]: parameter version 2
PROFILED = (3, 4)  # ... is the trainer's updates 3 and 4
SESSION = "s2-2"
WAIT_S = 240.0
CLOCK_SLACK_S = 0.05
STEP_RE = re.compile(r"^step:(\d+)$")


def step_windows(path: Path) -> dict[int, tuple[float, float]]:
    """``K -> (begin, end)`` of each ``step:K`` user annotation, in wall-clock seconds."""
    with gzip.open(path, "rt") as fh:
        trace: dict[str, Any] = json.load(fh)
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    windows: dict[int, tuple[float, float]] = {}
    for e in trace["traceEvents"]:
        m = STEP_RE.match(str(e.get("name", "")))
        if m and e.get("cat") == "user_annotation" and e.get("ph") == "X":
            k = int(m.group(1))
            assert k not in windows, f"{path}: step:{k} twice"
            begin = (base_us + float(e["ts"])) / 1e6
            windows[k] = (begin, begin + float(e["dur"]) / 1e6)
    return windows


@pytest.mark.asyncio
async def test_t2_a_verl_step_is_one_version_on_both_roles(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}", *FAST,
            f"trainer.total_training_steps={TOTAL}", "rollout.replicas=1",
            f"async_training.trigger_parameter_sync_step={TRIGGER}",
            # Updates of a few hundred ms: a step is long next to a generation batch.
            "trainer.ppo_epochs=10",
            "global_profiler.tool=torch", f"global_profiler.steps=[{VERL_STEP}]"]
    procs = Procs(tmp_path / "logs")
    try:
        procs.spawn("profiler", "profiler_service", *args)
        procs.spawn("rollouter", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        for name in ("trainer", "rollouter", "profiler"):
            assert procs.wait(name, WAIT_S) == 0, procs.log(name)[-3000:]
    finally:
        procs.kill_all()

    events = await events_of(bus, run_keys.events)
    started = {e.step: e.ts for e in events if isinstance(e, StepStarted)}
    finished = {e.step: e.ts for e in events if isinstance(e, StepFinished)}
    assert sorted(finished) == list(range(1, TOTAL + 1))
    # Weights: v0, then one version per TRIGGER updates (the run this test is about).
    assert [(e.version, e.step) for e in events if isinstance(e, WeightsPublished)] == [
        (0, 0), (1, 2), (2, 4)]
    (run_end,) = [e.ts for e in events if isinstance(e, RunFinished)]
    stops = {e.role: e for e in events
             if isinstance(e, ProfileStopped) and e.session_id == SESSION}
    assert set(stops) == {"trainer", "rollouter"}, stops
    for stop in stops.values():
        assert stop.status == "ok" and (stop.first_step, stop.last_step) == PROFILED, stop

    folder = tmp_path / "profiles" / run_id
    trainer = step_windows(folder / f"trainer0-{SESSION}.json.gz")
    rollouter = step_windows(folder / f"rollouter0-{SESSION}.json.gz")
    assert sorted(trainer) == sorted(rollouter) == list(PROFILED), (trainer, rollouter)

    slack = CLOCK_SLACK_S
    # How late each end of the rollouter's windows came (seen with pytest -s).
    print({k: (round(rollouter[k][0] - finished[k - 1], 4), round(rollouter[k][1] - finished[k], 4),
               round(trainer[k][1] - trainer[k][0], 4)) for k in PROFILED})
    for k in PROFILED:
        t_begin, t_end = trainer[k]
        r_begin, r_end = rollouter[k]
        # Trainer step K: its annotation holds StepStarted(K) .. StepFinished(K).
        assert t_begin <= started[k] + slack and t_end >= finished[k] - slack, (k, trainer)
        # Rollouter step K: from its reading of StepFinished(K-1) to its reading of
        # StepFinished(K), never before either was written ...
        assert r_begin >= finished[k - 1] - slack, (k, r_begin - finished[k - 1])
        assert r_end >= finished[k] - slack, (k, r_end - finished[k])
        # ... so the two roles' step:K overlap: the same stretch of the run.
        overlap = min(t_end, r_end) - max(t_begin, r_begin)
        assert overlap > 0, (k, trainer[k], rollouter[k], finished)
    # One window after the other, all before the run ended.
    assert rollouter[3][1] <= rollouter[4][0] + slack
    assert rollouter[4][1] < run_end, (rollouter[4], run_end)
