"""Elastic rollouters, with real processes and a real Redis: a run started with one rollouter
(``rollout.replicas=1``, rank 0 as `rlbus up` gives it) takes a second one that joins without
a rank (it claims rank 1 on the bus) and trains its samples; a process asking for a rank a
live rollouter holds exits 2 naming the rank and its holder, before it builds anything."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from runschema.messages import Sample, StepFinished
from tests.procs import Procs, run_args
from tests.waits import event, wait_for, wait_heartbeat

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

STEPS = 500  # never reached: the test stops the run once it saw what it checks


async def test_a_rollouter_joins_a_running_run_and_a_duplicate_rank_is_refused(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={STEPS}",
                    "rollout.replicas=1")
    first = procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
    trainer = procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=1), 120,
                   procs.watch("trainer", "rollouter0"))
    holder = (await bus.command("GET", run_keys.rank_claim("rollouter", 0))).decode()
    assert holder.startswith(f"{first.pid}@"), holder

    # A second process asking for rank 0: refused before it builds anything.
    procs.spawn("dup", "rollouter", *args, "rollout.rank=0")
    assert procs.wait("dup", 120) == 2, procs.log("dup")
    log = procs.log("dup")
    assert "rollouter rank 0 is already held by" in log and holder in log, log
    assert "Traceback" not in log, log

    # A rollouter that knows nothing of the replicas joins: rank 1, on the bus.
    joiner = procs.spawn("joiner", "rollouter", *args)
    beat = await wait_heartbeat(bus, run_keys.alive_pattern("rollouter"), joiner, 120)
    assert beat.rank == 1
    claimed = await bus.command("GET", run_keys.rank_claim("rollouter", 1))
    assert claimed.decode().startswith(f"{joiner.pid}@")
    sample = await wait_for(bus, run_keys.samples,
                            lambda m: isinstance(m, Sample) and m.rank == 1, 120,
                            procs.watch("trainer", "joiner"), what="a sample of rollouter1")
    assert isinstance(sample, Sample)
    await wait_for(bus, run_keys.events,
                   lambda m: isinstance(m, StepFinished) and sample.sample_id in m.sample_ids,
                   120, procs.watch("trainer", "joiner"),
                   what=f"a step training {sample.sample_id}")

    # A clean stop frees the rank at once.
    procs.kill("joiner", signal.SIGTERM)
    assert joiner.poll() == 143, procs.log("joiner")
    assert await bus.command("GET", run_keys.rank_claim("rollouter", 1)) is None
    assert "rollouter1:" in procs.log("joiner")
    assert trainer.poll() is None and first.poll() is None, procs.log("trainer")
