"""A resumed run ends exactly like an uninterrupted one (issue 36, item 5), with validation.

verl's DAPO line shape on the chat demo's tiny model: weights synced every 2 updates
(``async_training.trigger_parameter_sync_step=2``), validation every 2 versions
(``trainer.test_freq=2``) and of version 0. The trainer is killed (SIGKILL) where a resumed
trainer once waited for ever at the run's end, after its last step and its last validation,
with no RunFinished and no line: mid-window, after a validated version's publication (it
asked again for a validation answered before the kill, which no rollouter answers twice),
and right after a validation request. Restarted
alone, and through ``rlbus up`` with ``trainer.resume_mode=auto``, the run ends with
RunFinished and exit 0, every step once, every validation once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import (
    Message,
    RunFinished,
    StepFinished,
    TrainerResumed,
    ValidationFinished,
    WeightsPublished,
)
from tests.procs import FAST, Procs, assert_every_step_once, events_of, run_cli
from tests.test_supervise import Up
from tests.waits import event, wait_for

pytest.importorskip("tasks.verl_data", reason="the verl data loader is not in this tree")
pytest.importorskip("rollouter.scoring", reason="the reward pool is not in this tree")

pytestmark = pytest.mark.e2e

STEPS = 8  # versions 1..4 (T=2): validated are v0, v2 and v4 (the last)
VALIDATED = ["val-v0", "val-v2", "val-v4"]
HANG_GUARD_S = 240  # only against a hang: the run takes seconds


def _line(demo: Path, *more: str) -> list[str]:
    return [*FAST, "model.kind=hf", f"model.path={demo / 'model'}",
            f"data.train_files={demo / 'train.parquet'}",
            f"data.val_files={demo / 'val.parquet'}",
            f"custom_reward_function.path={demo / 'reward.py'}", "rollout.max_new_tokens=8",
            f"trainer.total_training_steps={STEPS}", "async_training.trigger_parameter_sync_step=2",
            "trainer.test_freq=2", "trainer.val_before_train=true", *more]


def _ends_like_an_uninterrupted_run(events: list[Message]) -> None:
    assert_every_step_once(events, STEPS)
    assert any(isinstance(e, TrainerResumed) for e in events), "the trainer did not resume"
    answers = [e for e in events if isinstance(e, ValidationFinished)]
    assert Counter(a.request_id for a in answers) == Counter(VALIDATED), answers
    assert all(not a.error for a in answers), [a.error for a in answers]
    # Each answer names the step that published its version, as in an uninterrupted run.
    assert sorted((a.request_id, a.step) for a in answers) == [
        ("val-v0", 0), ("val-v2", 4), ("val-v4", 8)]
    ends = [(i, e) for i, e in enumerate(events) if isinstance(e, RunFinished)]
    assert [e.steps for _, e in ends] == [STEPS], ends
    last = max(i for i, e in enumerate(events) if isinstance(e, ValidationFinished))
    assert ends[0][0] > last, "RunFinished before the last validation's answer"


def _mid_window(msg: Message) -> bool:
    """StepFinished(5): weights v2 (validated, answered) held, step 6 not done."""
    return isinstance(msg, StepFinished) and msg.step == 5


def _after_request(msg: Message) -> bool:
    """Weights v2 published: their validation is asked next; the kill lands right after the
    request, before or just after StepFinished(4) (the race is not pinned: either way a
    resumed trainer once asked again for an answered val-v2, or missed its answer)."""
    return isinstance(msg, WeightsPublished) and msg.version == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("kill_at", [_mid_window, _after_request],
                         ids=["mid-window", "after-request"])
async def test_a_trainer_killed_and_restarted_alone_ends_the_run(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path, procs: Procs, kill_at
) -> None:
    from tasks.chatdemo import build_demo

    demo = build_demo(tmp_path / "demo", n_train=64, n_val=8)
    args = [f"redis.url={redis_url}", f"run.id={run_id}", f"run.output_dir={tmp_path}",
            *_line(demo)]
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    keys = RunKeys(run_id)
    await wait_for(bus, keys.events, kill_at, 120, procs.watch("trainer", "rollouter0"))
    procs.kill("trainer")
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", HANG_GUARD_S) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    _ends_like_an_uninterrupted_run(await events_of(bus, keys.events))


@pytest.mark.asyncio
async def test_a_verl_line_killed_mid_window_resumes_through_rlbus_up(
    redis_url: str, bus: Bus, tmp_path: Path
) -> None:
    """``rlbus up`` stops when its trainer is killed; the same line (resume_mode=auto, the
    checkpoints in trainer.default_local_dir) resumes the run, which ends."""
    from runconfig.paths import RUN_MARKER
    from tasks.chatdemo import build_demo

    demo = build_demo(tmp_path / "demo", n_train=64, n_val=8)
    out, local = tmp_path / "out", tmp_path / "local"
    line = ["up", f"redis.url={redis_url}", f"run.output_dir={out}",
            f"trainer.default_local_dir={local}", "trainer.resume_mode=auto",
            "trainer.logger=[console]", *_line(demo)]
    up = Up([sys.executable, "-m", "rlbus", *line], tmp_path)
    try:
        pids = up.pids()
        run_id = json.loads((local / RUN_MARKER).read_text())["run_id"]
        keys = RunKeys(run_id)
        await wait_for(bus, keys.events, event(StepFinished, step=5), 120)
        os.kill(pids["trainer"], signal.SIGKILL)
        rc, text = up.finish()
    finally:
        up.kill()
    assert rc != 0, text
    again = run_cli(*line, timeout_s=HANG_GUARD_S, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming run {run_id}" in again.stdout, again.stdout[-3000:]
    _ends_like_an_uninterrupted_run(await events_of(bus, keys.events))
