"""A Redis that stops answering, and a process that stops running, with real processes.

- Redis SIGSTOPped longer than the heartbeat timeout (every liveness key, the trainer's
  lease and the rank claims lapse meanwhile) but within ``redis.give_up_s``: the run waits
  it out saying so every 10 s, nobody is declared dead, every step finishes once. The same
  silence past a shorter ``redis.give_up_s`` ends a part with one line naming the server
  (the bound is the key, not a constant).
- A rollouter SIGSTOPped past its heartbeat timeout and past ``redis.give_up_s``: woken, it
  does not blame Redis; it re-checks its rank claim and goes on when nobody took it, or
  exits with the claim-lost line when another process did. The run finishes.

Every SIGSTOP has its SIGCONT in a ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bus import Bus, RunKeys
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import ComponentFailed, StepFinished, WarningRaised
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for, wait_heartbeat

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


@contextmanager
def stopped(pid: int, *, group: bool = False) -> Iterator[None]:
    """``pid`` (its process group with ``group``) held with SIGSTOP; SIGCONT on exit."""
    kill = os.killpg if group else os.kill
    kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        kill(pid, signal.SIGCONT)


def _no_death(events: list[object]) -> None:
    failed = [e for e in events if isinstance(e, ComponentFailed)]
    assert failed == [], failed


@pytest.mark.parametrize("transport", ["auto", "collective"])
async def test_a_redis_pause_past_the_heartbeat_timeout_is_waited_out(
    redis_factory: Callable[..., EmbeddedRedis], run_id: str, tmp_path: Path, procs: Procs,
    transport: str,
) -> None:
    """Redis stopped 25 s, heartbeat.timeout_s 4 s, redis.give_up_s 40 s: every key lapses
    while nobody can write; when Redis answers again the trainer re-takes its lease, the
    rollouters re-pulse before anyone judges them, and the run finishes with nobody
    declared dead and no sample lost or trained twice."""
    server = redis_factory()
    assert server.pid is not None
    steps = 6
    args = run_args(server.url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                    "heartbeat.timeout_s=4", "redis.give_up_s=40",
                    f"rollout.weights_transport={transport}")
    keys = RunKeys(run_id)
    async with Bus.from_url(server.url) as bus:
        procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
        procs.spawn("trainer", "trainer", *args)
        await wait_for(bus, keys.events, event(StepFinished, step=2), 180,
                       procs.watch("trainer", "rollouter0"))
        with stopped(server.pid):
            await asyncio.sleep(25.0)
        assert procs.wait("trainer", 300) == 0, procs.log("trainer")
        assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
        events = await events_of(bus, keys.events)
    assert_every_step_once(events, steps)
    _no_death(events)
    codes = {e.code for e in events if isinstance(e, WarningRaised)}
    assert "rollouter_no_progress" not in codes, codes
    for name in ("trainer", "rollouter0"):
        log = procs.log(name)
        assert "cannot reach Redis" not in log, log
        assert "no rollouter is alive" not in log and "trainer is gone" not in log, log
    # Said while it lasted, naming the bound and its key.
    assert "waiting up to 40 s (redis.give_up_s)" in procs.log("trainer")


async def test_a_redis_pause_past_give_up_s_is_one_line_naming_the_server(
    redis_factory: Callable[..., EmbeddedRedis], run_id: str, tmp_path: Path, procs: Procs
) -> None:
    """The same silence with redis.give_up_s=6 (what the old fixed 60 s bound was for any
    silence longer than it): the rollouter exits 1 with one line naming the server and the
    key, once the bound has passed."""
    server = redis_factory()
    assert server.pid is not None
    args = run_args(server.url, run_id, tmp_path, "heartbeat.timeout_s=120",
                    "redis.give_up_s=6")
    async with Bus.from_url(server.url) as bus:
        proc = procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
        await wait_heartbeat(bus, RunKeys(run_id).alive_pattern("rollouter"), proc, 120)
    with stopped(server.pid):
        code = await asyncio.to_thread(procs.wait, "rollouter0", 60)
    log = procs.log("rollouter0")
    assert code == 1, log
    errors = [ln for ln in log.splitlines() if "error:" in ln]
    assert len(errors) == 1, log
    assert f"cannot reach Redis at {server.url}" in errors[0], log
    assert "redis.give_up_s" in errors[0] and "Traceback" not in log, log


async def test_a_paused_rollouter_rechecks_its_claim_instead_of_blaming_redis(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path, procs: Procs
) -> None:
    """rollouter0 SIGSTOPped 12 s (heartbeat.timeout_s 3 s, redis.give_up_s 6 s), twice.
    First nobody takes its rank: woken, it takes its claim back and goes on. Then a new
    rollouter takes rank 0 while it is stopped: woken, it exits 1 with the claim-lost line,
    one line, never "cannot reach Redis". The run finishes: every step once."""
    steps = 40  # a slow reward: the run outlasts both pauses (about 1 s a step)
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                    "heartbeat.timeout_s=3", "redis.give_up_s=6",
                    "task.reward_fn=tests.rewards_for_tests:slow_digits")
    keys = RunKeys(run_id)
    old = procs.spawn("rollouter0", "rollouter", *args, "rollout.rank=0")
    procs.spawn("rollouter1", "rollouter", *args, "rollout.rank=1")  # the trainer's peer
    procs.spawn("trainer", "trainer", *args)
    watch = procs.watch("trainer", "rollouter0", "rollouter1")
    await wait_for(bus, keys.events, event(StepFinished, step=1), 180, watch)
    claim = keys.rank_claim("rollouter", 0)
    token = await bus.command("GET", claim)
    with stopped(old.pid, group=True):
        await asyncio.sleep(12.0)
    await wait_heartbeat(bus, keys.alive_pattern("rollouter"), old, 60,
                         what="rollouter0 pulsing again")
    assert await bus.command("GET", claim) == token  # its own claim, taken back
    with stopped(old.pid, group=True):
        await asyncio.sleep(5.0)  # its claim lapses (3 s)
        new = procs.spawn("rollouter0b", "rollouter", *args)  # the lowest free rank: 0
        await wait_heartbeat(bus, keys.alive_pattern("rollouter"), new, 120,
                             what="the new rollouter's pulse")
        await asyncio.sleep(7.0)  # past redis.give_up_s, as stopped as before
    code = await asyncio.to_thread(procs.wait, "rollouter0", 60)
    log = procs.log("rollouter0")
    assert code == 1, log
    errors = [ln for ln in log.splitlines() if "lost rollouter rank 0" in ln]
    assert len(errors) == 1, log
    woke = [ln for ln in log.splitlines() if "this process did not run for" in ln]
    assert len(woke) == 2 and all("re-checking its rank claim" in ln for ln in woke), log
    assert "cannot reach Redis" not in log and "Traceback" not in log, log
    for name in ("trainer", "rollouter1", "rollouter0b"):
        assert procs.wait(name, 300) == 0, procs.log(name)
    events = await events_of(bus, keys.events)
    assert_every_step_once(events, steps)
