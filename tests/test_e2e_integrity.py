"""A corrupt checkpoint with real processes and a real Redis (issue 36 item 1): a resume
never trains on garbage.

The trainer is killed after step 9 of a run with weights published every second step
(``trigger_parameter_sync_step=2``, so step 9 is mid-window), checkpoints every second
version (``save_freq=2``, verl's unit: steps 4 and 8) and the default retention
(``run.retention=checkpoint``: the streams are trimmed after each checkpoint). Then
``step-000008.pt`` has 128 bytes flipped: the restarted trainer finds it before loading it,
says so in one warning, falls back to step 4's checkpoint, re-applies the steps after it
(their samples were kept for this) and rebuilds exactly the weights it had published
(``weights_match``: compared at step 8, which published them), then writes a resume point
at its first sync (step 10), so that retention never leaves the bad file as the only
fallback of the next checkpoint. With one rank and checkpoints
at steps 3 and 6, both harmed (flipped, truncated), the trainer exits 1 with one line naming
both files.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import (
    CheckpointSaved,
    ComponentFailed,
    Message,
    StepFinished,
    TrainerResumed,
    WarningRaised,
)
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def _flip(path: Path, count: int = 128) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


async def _killed_after(step: int, bus: Bus, run_keys: RunKeys, procs: Procs,
                       args: list[str], ckpts: Path, expected: list[str]) -> None:
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=step), 180,
                   procs.watch("trainer"))
    procs.kill("trainer")
    assert await asyncio.to_thread(_names, ckpts) == expected


def _names(ckpts: Path) -> list[str]:
    return sorted(p.name for p in ckpts.glob("step-*.pt"))


async def _resumed_past_a_flipped_step_8(steps: int, redis_url: str, bus: Bus, run_id: str,
                                        run_keys: RunKeys, tmp_path: Path, procs: Procs
                                        ) -> list[Message]:
    """A run of ``steps`` (checkpoints at steps 4 and 8) killed after step 9, step 8's file
    flipped, then a second trainer to the run's end: the log."""
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                    "trainer.save_freq=2", "async_training.trigger_parameter_sync_step=2")
    ckpts = tmp_path / run_id / "checkpoints"
    await _killed_after(9, bus, run_keys, procs, args, ckpts,
                        ["step-000004.pt", "step-000008.pt"])
    _flip(ckpts / "step-000008.pt")

    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 240) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    log = procs.log("trainer2")
    assert "Traceback" not in log, log
    return await events_of(bus, run_keys.events)


async def test_a_flipped_checkpoint_falls_back_to_the_one_before_it(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 12
    events = await _resumed_past_a_flipped_step_8(steps, redis_url, bus, run_id, run_keys,
                                                  tmp_path, procs)
    assert_every_step_once(events, steps)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert len(resumed) == 1, resumed
    assert resumed[0].checkpoint_step == 4 and resumed[0].replayed_steps >= 5, resumed
    assert resumed[0].weights_match is True, resumed
    warned = [e for e in events if isinstance(e, WarningRaised)
              and e.code == "checkpoint_corrupt"]
    assert len(warned) == 1 and "step-000008.pt" in warned[0].message, warned
    assert "resuming from" in warned[0].message and "step 4" in warned[0].message
    assert not [e for e in events if isinstance(e, WarningRaised)
                and e.code == "resume_weights_mismatch"]
    after = events[events.index(resumed[0]):]
    assert [(e.step, e.resume_point) for e in after if isinstance(e, CheckpointSaved)][:1] == [
        (10, True)], after


async def test_after_a_fallback_the_first_trim_keeps_what_the_fallback_re_applies(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """The trainer fell back past the corrupt step-000008.pt to step 4's checkpoint; its
    first checkpoint (step 10, the run's last) trims the samples stream. A later start whose
    log has lost that checkpoint (Redis's AOF cut short) finds step 8's file corrupt again
    and re-applies steps 5-8 after step 4's: their samples must still be in the stream."""
    events = await _resumed_past_a_flipped_step_8(10, redis_url, bus, run_id, run_keys,
                                                  tmp_path, procs)
    (resumed,) = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed.checkpoint_step == 4, resumed
    assert 10 in {e.step for e in events if isinstance(e, CheckpointSaved)}
    finished = {e.step: e for e in events if isinstance(e, StepFinished)}
    needed = [eid for step in range(5, 9) for eid in finished[step].entry_ids]
    assert len(needed) == sum(len(finished[k].sample_ids) for k in range(5, 9)) > 0
    held = await bus.read_ids(run_keys.samples, needed)
    assert sorted(held) == sorted(needed), f"{len(needed) - len(held)} of {len(needed)} trimmed"


async def test_no_intact_checkpoint_is_one_line_naming_each(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = run_args(redis_url, run_id, tmp_path, "trainer.total_training_steps=10",
                    "trainer.save_freq=3", "run.retention=all")
    ckpts = tmp_path / run_id / "checkpoints"
    await _killed_after(7, bus, run_keys, procs, args, ckpts,
                        ["step-000003.pt", "step-000006.pt"])
    _flip(ckpts / "step-000006.pt")
    three = ckpts / "step-000003.pt"
    three.write_bytes(three.read_bytes()[: three.stat().st_size // 2])

    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 180) == 1, procs.log("trainer2")
    log = procs.log("trainer2")
    assert "Traceback" not in log, log
    lines = [ln for ln in log.splitlines() if "no checkpoint the log names can be loaded" in ln]
    assert len(lines) == 1, log
    assert "step-000006.pt does not hash" in lines[0] and "step-000003.pt holds" in lines[0]
    failed = [e for e in await events_of(bus, run_keys.events)
              if isinstance(e, ComponentFailed) and e.role == "trainer"]
    assert len(failed) == 1 and "step-000003.pt" in failed[0].error
