"""Progress, not pulses; one bad answer, one reissue: with real processes and a real Redis.

- A rollouter whose generation is wedged while its pulse goes on holds tickets it will never
  answer: the trainer sees its progress counter stand still past the bound, warns naming it
  and what it held, and reissues them to a rollouter that works; the run finishes.
- One invalid group (every response of one ticket refused) gives exactly one new attempt of
  that ticket, whatever reads and dead letters it comes back through.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bus import Bus, GroupGone, RunKeys, StreamGone
from policy.tokenizer import CharTokenizer
from runschema.messages import (
    Array,
    DeadLetter,
    PromptTicket,
    Sample,
    TicketsClaimed,
    TicketsIssued,
    WarningRaised,
    decode,
)
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for, wait_until
from trainer.dispatch import ROLLOUTER_GROUP

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]





async def test_a_wedged_rollouter_with_a_fresh_pulse_loses_its_tickets(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """rollouter1 claims the first tickets, then its generation blocks for ever while its
    liveness key stays fresh. Ticket leases are short, so its tickets are judged often; the
    no-progress bound is heartbeat.timeout_s (the longest of lease, timeout and reward
    timeout). rollouter0, started once rollouter1 holds tickets, answers them after the
    reissue, and the run finishes."""
    steps = 3
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}",
                 "heartbeat.ticket_lease_s=1", "rollout.reward_timeout_s=5", "rollout.replicas=2")
    procs.spawn("trainer", "trainer", *args)
    procs.spawn("rollouter1", "tests.wedged_rollouter", *args, "rollout.rank=1")

    async def held_by_rollouter1() -> list[str] | None:
        try:
            owners = await bus.pending_owners(run_keys.prompts, ROLLOUTER_GROUP, 100)
        except (StreamGone, GroupGone):  # not created yet
            return None
        held = [e for e, owner in owners.items() if owner == RunKeys.rollouter_consumer(1)]
        return held or None

    held = await wait_until(held_by_rollouter1, "tickets pending on rollouter1", 120,
                            procs.watch("trainer", "rollouter1"))
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 300) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")
    # Not a dead peer: rollouter1 still runs and its liveness key is fresh.
    assert procs.procs["rollouter1"].poll() is None
    assert await bus.exists(run_keys.alive("rollouter", 1))

    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    warnings = [e for e in events if isinstance(e, WarningRaised)
                and e.code == "rollouter_no_progress"]
    assert warnings and all("rollouter1" in w.message for w in warnings), warnings
    found = await bus.read_ids(run_keys.prompts, held)
    held_tickets = {found[e].ticket_id for e in held}
    assert held_tickets
    for tid in held_tickets:  # what it held is named
        assert any(tid in w.message for w in warnings), (tid, warnings)
    reissued = [e for e in events if isinstance(e, TicketsIssued) and e.attempt > 0]
    assert reissued and all("without progress" in e.reason for e in reissued), reissued
    assert held_tickets <= {t for e in reissued for t in e.ticket_ids}


def _invalid_sample(ticket: PromptTicket, index: int, n: int) -> Sample:
    """A well-formed answer of attempt 0 of ``ticket`` (its prompt, from rollouter 0, which
    claimed it) with a reward that is not finite."""
    prompt = CharTokenizer().encode(ticket.prompt, bos=True)
    return Sample(
        sample_id=f"{ticket.ticket_id}/{index}", ticket_id=ticket.ticket_id, prompt_id="p",
        index=index, n=n, prompt_tokens=Array.of(np.asarray(prompt, dtype=np.int32)),
        response_tokens=Array.of(np.asarray([4], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.5], dtype=np.float32)),
        reward=float("nan"), min_version=0, max_version=0,
    )


async def test_one_invalid_group_gives_one_reissue(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """Every response of ticket t0 arrives invalid before any real answer: each is refused
    and dead-lettered (and read back by the trainer's dead-letter follower), and t0 is
    issued again exactly once (attempt 1); no ticket goes further."""
    steps, n = 2, 4  # FAST: rollout.n=4
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    tickets = [m async for _, m in bus.read_all(run_keys.prompts) if isinstance(m, PromptTicket)]
    t0 = tickets[0]
    assert t0.ticket_id == "t0"
    # As rollouter0 states it when Redis delivers it t0: the answers are its own.
    await bus.publish(run_keys.log("rollouter"),
                      TicketsClaimed(ticket_ids=["t0"], attempts=[0], rank=0))
    for i in range(n):
        await bus.publish(run_keys.samples, _invalid_sample(t0, i, n))

    async def refused() -> list[DeadLetter] | None:
        letters = [m async for _, m in bus.read_all(run_keys.dlq) if isinstance(m, DeadLetter)]
        return letters if len(letters) >= n else None

    await wait_until(refused, f"{n} refused answers in the dead-letter stream", 120,
                     procs.watch("trainer"))
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")

    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    letters = [m async for _, m in bus.read_all(run_keys.dlq) if isinstance(m, DeadLetter)]
    bad = [decode(m.raw) for m in letters if "not finite" in m.reason]
    assert sorted(s.sample_id for s in bad if math.isnan(s.reward)) == [f"t0/{i}"
                                                                        for i in range(n)]
    # rollouter0's own answers of attempt 0, if it gave any, went with that group: the
    # attempt's group is refused whole, whoever's members come after.
    assert all(s.ticket_id == "t0" and s.attempt == 0 for s in bad)
    reissued = [(t, e.attempt) for e in events if isinstance(e, TicketsIssued)
                and e.attempt > 0 for t in e.ticket_ids]
    assert reissued == [("t0", 1)], reissued
