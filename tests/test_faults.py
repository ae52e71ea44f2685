"""Faults a real job meets, with real processes and a real Redis: long updates, lost tickets,
duplicated and malformed entries, a second trainer, forged weights, leaked blobs.

Each test asserts the outcome: the run finishes with every step once and no sample twice, or
the part exits non-zero naming the cause.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from bus import Bus, RunKeys, entry_key
from runschema.messages import (
    FIELD,
    Array,
    BlobRef,
    ComponentFailed,
    DeadLetter,
    PromptTicket,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TicketsIssued,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
    encode,
)
from tests.aof import aof_path, cut_aof_before
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.rewards_for_tests import SLOW_REWARD_S
from tests.waits import event, wait_for
from trainer.budget import max_staleness, ticket_budget
from weights.blobs import RedisBlobStore

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]




def _finished(events: list) -> list[StepFinished]:
    return [e for e in events if isinstance(e, StepFinished)]



async def test_update_longer_than_the_heartbeat_timeout_is_not_death(
    redis_url: str, bus: Bus, run_id: str, tmp_path: Path, procs: Procs
) -> None:
    """Updates run on a worker thread: liveness keys stay fresh during a step of any length.
    The update is made about three heartbeat timeouts long on this host (its epochs timed
    here first), so a fast host cannot make the test vacuous; a run whose updates all came
    in shorter than the timeout anyway (the host ran faster than when it was timed: on a
    busy machine the timing alone came out 3x slow) is run again with twice the epochs,
    until one outlasts it. Every run must finish with nobody declared dead."""
    steps, timeout_s = 3, 1.5
    model = ["model.d_model=256", "model.n_layers=6", "trainer.ppo_mini_batch_size=8",
             "rollout.prompts_per_batch=8"]
    epochs = max(1, math.ceil(3 * timeout_s / _epoch_s(run_args(redis_url, run_id, tmp_path,
                                                             *model))))
    runs: list[str] = []
    for attempt in range(LONG_UPDATE_ATTEMPTS):
        run = f"{run_id}-{attempt}"
        args = run_args(redis_url, run, tmp_path / run, f"trainer.total_training_steps={steps}",
                        "heartbeat.interval_s=0.2", f"heartbeat.timeout_s={timeout_s}", *model,
                        f"trainer.ppo_epochs={epochs}")
        procs.spawn(f"rollouter0-{attempt}", "rollouter", *args)
        procs.spawn(f"trainer-{attempt}", "trainer", *args)
        assert procs.wait(f"trainer-{attempt}", 600) == 0, procs.log(f"trainer-{attempt}")
        assert procs.wait(f"rollouter0-{attempt}", 60) == 0, procs.log(f"rollouter0-{attempt}")
        events = await events_of(bus, RunKeys(run).events)
        assert_every_step_once(events, steps)
        longest = max(e.metrics["trainer/update_s"] for e in _finished(events))
        # The point of the test: an update outlasted the timeout, and nobody was declared dead.
        if longest > timeout_s:
            return
        runs.append(f"{longest:.2f} s at {epochs} epochs")
        epochs *= 2
    raise AssertionError(f"no update outlasted the {timeout_s} s timeout: {runs}")


LONG_UPDATE_ATTEMPTS = 4
"""Runs of the long-update test, each with twice the epochs of the one before (8x at the
last): a host faster than it was timed gets a longer update, never a vacuous pass."""


def _epoch_s(args: list[str]) -> float:
    """Seconds one PPO epoch of this config's update takes here, on one thread (on samples
    shaped like the run's: a step's prompts, n responses each): the fastest of three, as
    load while timing makes an update look longer than it will be."""
    import msgspec
    import torch

    from policy import build_policy
    from runconfig import load_config
    from trainer.update import grpo_update

    cfg = load_config(None, args)
    torch.set_num_threads(1)
    policy = build_policy(msgspec.to_builtins(cfg.model), "cpu")
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    prompts = cfg.async_training.require_batches * cfg.trainer.ppo_mini_batch_size
    tokens = Array.of(np.asarray([1, 2, 3, 4, 5], dtype=np.int32))
    groups = [[Sample(sample_id=f"t{t}/{i}", ticket_id=f"t{t}", prompt_id="p", index=i,
                      n=cfg.rollout.n, prompt_tokens=tokens, response_tokens=tokens,
                      logprobs=Array.of(np.full(5, -1.0, dtype=np.float32)),
                      reward=float(i % 2), min_version=0, max_version=0)
               for i in range(cfg.rollout.n)] for t in range(prompts)]
    tc = msgspec.structs.replace(cfg.trainer, ppo_epochs=2)
    grpo_update(policy, optimizer, groups, tc, temperature=1.0, version=0, device="cpu")
    timed = []
    for _ in range(3):
        t0 = time.perf_counter()
        grpo_update(policy, optimizer, groups, tc, temperature=1.0, version=0, device="cpu")
        timed.append((time.perf_counter() - t0) / 2)
    return min(timed)


async def test_lost_tickets_are_reissued_and_the_run_finishes(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """Tickets that vanish from the prompts stream (as with a Redis that lost its tail) come
    back through their lease; the first answer wins."""
    steps = 3
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "heartbeat.ticket_lease_s=1.5")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    ids = [eid async for eid, _ in bus.read_all(run_keys.prompts)]
    assert ids
    await bus.command("XDEL", run_keys.prompts, *ids[:3])
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    reissued = [e for e in events if isinstance(e, TicketsIssued) and e.attempt > 0]
    assert reissued and "lease" in reissued[0].reason


async def test_a_run_that_cannot_progress_says_why_then_fails(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """No answer ever comes (every ticket deleted, leases longer than the test): the trainer
    warns what it waits for, then fails naming it; it never waits in silence."""
    args = run_args(redis_url, run_id, tmp_path, "trainer.total_training_steps=2",
                 "heartbeat.ticket_lease_s=600", "heartbeat.stall_warn_s=1",
                 "heartbeat.stall_timeout_s=4")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    ids = [eid async for eid, _ in bus.read_all(run_keys.prompts)]
    await bus.command("XDEL", run_keys.prompts, *ids)
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 120) == 1, procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    warnings = [e for e in events if isinstance(e, WarningRaised) and e.code == "trainer_stalled"]
    assert warnings and "open ticket" in warnings[0].message
    failed = [e for e in events if isinstance(e, ComponentFailed) and e.role == "trainer"]
    assert failed and "no progress" in failed[0].error and "t0" in failed[0].error
    assert "no progress" in procs.log("trainer")


async def _duplicate_samples(bus: Bus, keys: RunKeys, stop: asyncio.Event) -> int:
    """Re-append every sample entry byte for byte (a retried XADD), until ``stop``."""
    copied = 0
    cursor = "0"
    while not stop.is_set():
        reply = await bus.command("XREAD", "COUNT", 100, "BLOCK", 100, "STREAMS",
                                  keys.samples, cursor)
        if not reply:
            continue
        for entry_id, fields in reply[0][1]:
            cursor = entry_id.decode()
            if copied % 2 == 0:
                await bus.command("XADD", keys.samples, "*", *fields)
            copied += 1
    return copied


async def test_duplicated_samples_are_trained_once(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 5
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=2", "run.retention=all")
    stop = asyncio.Event()
    copier = asyncio.create_task(_duplicate_samples(bus, run_keys, stop))
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=3), 120, procs.watch("trainer"))
    procs.kill("trainer")
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 180) == 0, procs.log("trainer2")
    stop.set()
    assert await copier > 0
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].weights_match is True
    # The trained copies are the recorded ones.
    for e in _finished(events):
        found = await bus.read_ids(run_keys.samples, e.entry_ids)
        assert [found[i].sample_id for i in e.entry_ids] == e.sample_ids


def _forged_sample(ticket: str, n: int) -> Sample:
    return Sample(
        sample_id=f"{ticket}/0", ticket_id=ticket, prompt_id="p", index=0, n=n,
        prompt_tokens=Array.of(np.asarray([1, 2, 3], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([4], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.5], dtype=np.float32)),
        reward=1.0, min_version=0, max_version=0,
    )


async def _forge_weights(bus: Bus, keys: RunKeys) -> list[WeightsPublished]:
    """Two WeightsPublished no trainer wrote, far ahead of any real version: one whose blob
    does not match its reference (sha256), one whose blob is intact but holds no model."""
    corrupt = BlobRef(store="redis", key=keys.blob("forged-corrupt"), size=1, sha256="0" * 64,
                      chunks=1)
    await bus.command("SET", f"{corrupt.key}:0", b"x")
    garbage = await RedisBlobStore(bus, keys).put("forged-garbage", b"not a state dict")
    forged = [WeightsPublished(version=FORGED_VERSION, ref=corrupt),
              WeightsPublished(version=FORGED_VERSION + 1, ref=garbage)]
    for msg in forged:
        await bus.publish(keys.events, msg)
    return forged


FORGED_VERSION = 10**9


async def test_malformed_entries_are_dead_lettered_and_change_nothing(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """A well-formed Sample that contradicts its ticket, garbage in the prompts and samples
    streams, and forged WeightsPublished: dead-lettered or refused with a reason; the budget
    never moves, no sample is generated with forged weights, and the run finishes with
    every sample trained once."""
    steps, threshold = 4, 0.5
    # retention=all: the samples are read back below.
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 f"async_training.staleness_threshold={threshold}", "run.retention=all")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    await bus.publish(run_keys.samples, _forged_sample("t0", n=1))  # n=1 for a ticket of n=4
    await bus.publish(run_keys.samples, _forged_sample("t999999", n=4))  # never issued
    await bus.publish_raw(run_keys.samples, {FIELD: b"\x00garbage"})
    for _ in range(8):
        await bus.publish_raw(run_keys.prompts, {FIELD: b"\xffnot a ticket"})
    forged = await _forge_weights(bus, run_keys)
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    letters = [m async for _, m in bus.read_all(run_keys.dlq)]
    reasons = " | ".join(m.reason for m in letters if isinstance(m, DeadLetter))
    # Nobody claimed t0 when the forgery came: refused on that first (trainer.claims).
    assert "rollouter 0 answered attempt 0 of t0, claimed by no rollouter" in reasons
    assert "never issued" in reasons
    budget = ticket_budget(threshold, 1, 1, 4)
    assert all(e.metrics["tickets/outstanding"] <= budget for e in _finished(events))
    # The rollouter refused each forged publication, naming it, and went on with real ones.
    unloadable = [e for e in events if isinstance(e, WarningRaised)
                  and e.code == "weights_unloadable"]
    for msg in forged:
        named = [w for w in unloadable
                 if f"weights v{msg.version} ({msg.ref.key}) ignored" in w.message]
        assert named and named[0].source == "rollouter0", (msg, unloadable)
    assert "sha256" in " ".join(w.message for w in unloadable)
    # No trained sample was generated with a forged version: each with weights the trainer
    # had published before the step (step k trains on versions <= k-1), and none staler
    # than the bound allows.
    bound = max_staleness(threshold, 1, 1, 4)
    # By entry id: the reissued ticket t0's answer has the same sample ids as its first
    # attempt's, and which of the two a step trained is what its entry ids say.
    samples = {entry_id: m async for entry_id, m in bus.read_all(run_keys.samples)
               if isinstance(m, Sample)}
    for e in _finished(events):
        assert e.metrics["staleness/max"] <= bound, e.metrics
        for sid, entry_id in zip(e.sample_ids, e.entry_ids, strict=True):
            s = samples[entry_id]
            assert s.sample_id == sid
            assert 0 <= s.min_version <= s.max_version <= e.step - 1, (e.step, s)
            assert e.step - 1 - s.min_version <= bound, (e.step, s)


async def test_a_second_trainer_is_refused_and_a_zombie_is_fenced_out(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 4
    # Profiling on and no profiler service: the first trainer holds the lease while it waits
    # for the handshake, which keeps it alive and busy for as long as the test needs.
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "heartbeat.interval_s=0.2", "heartbeat.timeout_s=5",
                 "global_profiler.tool=torch", "global_profiler.steps=[]",
                 "global_profiler.handshake_timeout_s=60")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(RunStarted), 60, procs.watch("trainer"))
    # A second trainer while the first is alive: refused, naming the holder.
    procs.spawn("second", "trainer", *args)
    assert procs.wait("second", 60) == 1, procs.log("second")
    assert "another trainer is running" in procs.log("second")
    # The first one paused past its lease: a new trainer takes over; the zombie, woken up,
    # cannot write a single entry.
    zombie = procs.procs["trainer"]
    os.killpg(zombie.pid, signal.SIGSTOP)
    procs.spawn("third", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TrainerResumed), 60, procs.watch("third"))
    os.killpg(zombie.pid, signal.SIGCONT)
    assert procs.wait("third", 180) == 0, procs.log("third")
    assert procs.wait("trainer", 120) == 1, procs.log("trainer")
    assert "fenced out" in procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    assert sum(isinstance(e, RunFinished) for e in events) == 1


async def test_a_zombie_woken_mid_run_takes_no_sample(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """A trainer paused mid-run past its lease and woken while a new trainer runs: its
    group reads, acks and dead letters are fenced, so it takes none of the new trainer's
    samples (it once dead-lettered them: "ticket ... was never issued"); the new trainer
    adopts what it held and removes its member."""
    steps = 8
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "heartbeat.interval_s=0.2", "heartbeat.timeout_s=5")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=2), 120,
                   procs.watch("trainer"))
    token = (await bus.command("GET", run_keys.trainer_lease)).decode()
    zombie = procs.procs["trainer"]
    os.killpg(zombie.pid, signal.SIGSTOP)
    procs.spawn("second", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=4), 120,
                   procs.watch("second"))
    os.killpg(zombie.pid, signal.SIGCONT)
    assert procs.wait("second", 180) == 0, procs.log("second")
    assert procs.wait("trainer", 120) == 1, procs.log("trainer")
    assert "fenced out" in procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    assert sum(isinstance(e, RunFinished) for e in events) == 1
    letters = [m async for _, m in bus.read_all(run_keys.dlq)]
    assert letters == [], letters
    members = await bus.consumers(run_keys.samples, "trainer")
    assert len(members) == 1 and members[0] != f"trainer-{token.rsplit(':', 1)[1]}", members


async def test_resumed_trainer_leaves_no_weight_blobs_behind(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    steps = 8
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=2")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    for k in (3, 6):
        name = [n for n in procs.procs if n.startswith("trainer")][-1]
        await wait_for(bus, run_keys.events, event(StepStarted, step=k), 120, procs.watch(name))
        procs.kill(name)
        procs.spawn(f"trainer{k}", "trainer", *args)
    assert procs.wait("trainer6", 180) == 0, procs.log("trainer6")
    keys = await bus.command("KEYS", run_keys.blob("weights-*"))
    blobs = {k.decode().rsplit(":", 1)[0] for k in keys}
    assert len(blobs) <= 3, sorted(blobs)


def _is_step_finished(args: list[bytes]) -> bool:
    return (args[0].upper() == b"XADD" and args[1].endswith(b":events")
            and b"StepFinished" in args[-1])


@pytest.mark.chaos
async def test_a_log_that_lost_its_tail(
    redis_factory, make_bus, run_id: str, tmp_path: Path, procs: Procs
) -> None:
    """Redis killed and restarted from an AOF cut before the last two StepFinished (what
    `appendfsync everysec` loses): the trainer notices the log is behind what it did,
    resumes from the log in-process, and the run finishes with every step once and no
    sample trained twice."""
    server = redis_factory(appendonly=True)
    bus = await make_bus(server.url)
    keys = RunKeys(run_id)
    steps = 12
    args = run_args(server.url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=3")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, keys.events, event(StepFinished, step=7), 120, procs.watch("trainer"))
    server.kill()
    removed = cut_aof_before(aof_path(server.dir), _is_step_finished, which=-2)
    server.start()
    assert removed > 0
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    assert "resuming from the log" in procs.log("trainer")
    events = await events_of(bus, keys.events)
    assert_every_step_once(events, steps)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and all(e.weights_match is not False for e in resumed)


async def test_a_finished_run_continues_with_more_steps(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    args = run_args(redis_url, run_id, tmp_path, "trainer.save_freq=2")
    procs.spawn("rollouter0", "rollouter", *args, "trainer.total_training_steps=3")
    procs.spawn("trainer", "trainer", *args, "trainer.total_training_steps=3")
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    procs.spawn("rollouter0b", "rollouter", *args, "trainer.total_training_steps=5")
    procs.spawn("trainer2", "trainer", *args, "trainer.total_training_steps=5")
    assert procs.wait("trainer2", 180) == 0, procs.log("trainer2")
    assert procs.wait("rollouter0b", 60) == 0, procs.log("rollouter0b")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, 5)
    assert [e.steps for e in events if isinstance(e, RunFinished)] == [3, 5]
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].step == 3 and resumed[0].weights_match is True


async def test_trim_then_resume_rebuilds_the_same_model(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """Retention trims samples and tickets below each durable checkpoint; a trainer killed
    right after a trim resumes from the checkpoint's snapshot, reading only the log after
    it, and rebuilds the same model (trimming never removed a sample it needed)."""
    steps = 9
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=3")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=6), 120, procs.watch("trainer"))
    procs.kill("trainer")
    events_before = await bus.length(run_keys.events)
    procs.spawn("trainer2", "trainer", *args)
    assert procs.wait("trainer2", 180) == 0, procs.log("trainer2")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    resumed = [e for e in events if isinstance(e, TrainerResumed)]
    assert resumed and resumed[0].weights_match is True
    assert resumed[0].checkpoint_step == 6
    # Only the log after the step-6 snapshot was read.
    assert 0 < resumed[0].events_read < events_before / 2, (resumed[0], events_before)
    # Samples of steps before the checkpoint before the last (step 6's, kept for a fallback
    # from the final step's) are gone.
    produced = sum(len(e.sample_ids) for e in _finished(events))
    assert await bus.length(run_keys.samples) < produced / 2
    assert await bus.length(run_keys.prompts) < steps * 4


async def test_a_slow_rollouter_keeps_its_tickets(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """Ticket leases far shorter than an answer: tickets a live rollouter holds or still has
    queued are not reissued (a slow peer is not a dead one), and the run finishes.

    The rollouter is slow by construction (a reward function that takes SLOW_REWARD_S per
    response), and the test checks that it was: every ticket was answered more than a
    second after it was issued, by Redis's own clock (entry ids), so its lease had expired
    while the trainer, idle, checked leases (after each empty 0.5 s read of samples)."""
    steps, lease_s = 3, 0.05
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 f"heartbeat.ticket_lease_s={lease_s}", "rollout.n=16", "run.retention=all",
                 "task.reward_fn=tests.rewards_for_tests:slow_digits")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    assert not [e for e in events if isinstance(e, TicketsIssued) and e.attempt > 0]
    # The slowness happened: each trained ticket's first response came long after its lease.
    issued = {(m.ticket_id, m.attempt): _entry_ms(eid)
              async for eid, m in bus.read_all(run_keys.prompts) if isinstance(m, PromptTicket)}
    answered: dict[tuple[str, int], int] = {}
    async for eid, m in bus.read_all(run_keys.samples):
        if isinstance(m, Sample):
            answered.setdefault((m.ticket_id, m.attempt), _entry_ms(eid))
    trained = {samples_ticket(sid) for e in _finished(events) for sid in e.sample_ids}
    held_ms = {t: answered[(t, 0)] - issued[(t, 0)] for t in trained}
    slow_ms = 16 * SLOW_REWARD_S * 1000  # one ticket's 16 responses, rewarded one by one
    assert slow_ms > 20 * lease_s * 1000
    assert min(held_ms.values()) >= slow_ms - 1, held_ms  # - 1: entry ids are whole ms


def _entry_ms(entry_id: str) -> int:
    """The Redis clock (ms) when a stream entry was appended: the first part of its id."""
    return int(entry_id.split("-")[0])


def samples_ticket(sample_id: str) -> str:
    """``t12/3`` -> ``t12``: a sample id is its ticket id and its index."""
    return sample_id.split("/")[0]


async def test_a_flood_of_junk_does_not_stop_training(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """20 000 junk entries in the samples stream (undecodable bytes and samples of tickets
    never issued), half before the rollouter starts and half while the run trains: every
    step finishes, each junk entry the trainer read is a dead letter kept or counted as
    dropped by the stream's cap, and the trainer says it in a few lines, not one per entry."""
    steps, cap, half = 6, 5000, 10_000
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                    f"redis.dead_letter_max={cap}")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    injected = await _flood(bus, run_keys, half)  # ahead of every real sample
    procs.spawn("rollouter0", "rollouter", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=1), 120,
                   procs.watch("trainer"))
    injected += await _flood(bus, run_keys, half)
    assert procs.wait("trainer", 300) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    assert_every_step_once(await events_of(bus, run_keys.events), steps)
    # What the trainer read of the junk (all of the first half, maybe not all the second's).
    last = (await bus.groups(run_keys.samples))[0].last_delivered_id
    read = [i for i in injected if entry_key(i) <= entry_key(last)]
    assert len(read) >= half
    kept = [m.entry_id async for _, m in bus.read_all(run_keys.dlq)
            if isinstance(m, DeadLetter) and m.source_stream == run_keys.samples]
    dropped = int(await bus.command("GET", run_keys.dlq_dropped) or 0)
    assert set(kept) <= set(read)
    assert await bus.command("XLEN", run_keys.dlq) < cap + 100  # XTRIM ~: whole nodes of 100
    assert dropped == len(read) - len(kept) > 0
    said = [line for line in procs.log("trainer").splitlines() if "refused " in line]
    assert 0 < len(said) < 50, said[:5]


async def _flood(bus: Bus, keys: RunKeys, n: int) -> list[str]:
    """``n`` junk entries in pipelines of 1000: every other one undecodable, the others
    samples of tickets never issued. Their entry ids."""
    ids: list[str] = []
    for start in range(0, n, 1000):
        replies = await bus.pipeline([
            ("XADD", keys.samples, "*", FIELD,
             b"\xc1junk" if i % 2 else encode(_forged_sample(f"t{10**7 + i}", n=4)))
            for i in range(start, start + 1000)])
        ids += [r.decode() for r in replies]
    return ids
