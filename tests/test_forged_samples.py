"""A rollouter answering another rollouter's open ticket, in a live run (issue 36): with a
real trainer and rollouter processes and a real Redis.

The forgery is what the issue found: a second rollouter's answer of a ticket the first
claimed, with another prompt and log-probs of 0.0, XADDed to the samples stream as any
client with the rollouter role's write access could. The trainer dead-letters each forged
response with the reason (the holder check), and no step trains one of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bus import Bus, RunKeys
from runschema.messages import (
    Array,
    DeadLetter,
    PromptTicket,
    Sample,
    StepFinished,
    TicketsClaimed,
    TicketsIssued,
)
from tests.procs import Procs, assert_every_step_once, events_of, run_args
from tests.waits import event, wait_for, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.asyncio]


def _forged(ticket: str, index: int, n: int, rank: int) -> Sample:
    """Response ``index`` of ``ticket`` as the forger sent it: its own rank, a prompt that
    is not the ticket's, log-probs of 0.0, the best reward."""
    return Sample(
        sample_id=f"{ticket}/{index}", ticket_id=ticket, prompt_id="p0", index=index, n=n,
        prompt_tokens=Array.of(np.asarray([1, 5, 6, 7], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([4, 5], dtype=np.int32)),
        logprobs=Array.of(np.zeros(2, dtype=np.float32)), reward=1.0,
        min_version=0, max_version=0, rank=rank)


async def test_a_forged_answer_of_another_rollouters_ticket_is_dead_lettered_never_trained(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    """rollouter0 runs alone and claims tickets; rollouter 1 (no process: the forger) then
    answers one of them. Each forged response is dead-lettered naming the holder check, the
    run finishes, and no StepFinished holds a forged entry."""
    steps, n = 3, 4  # FAST: rollout.n=4
    args = run_args(redis_url, run_id, tmp_path, f"trainer.total_training_steps={steps}")
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(TicketsIssued), 60, procs.watch("trainer"))
    # The holder's claim is in the log before the forgery (as rollouter0 states it when
    # Redis delivers it the ticket); rollouter0 itself starts after, and claims it again.
    tickets = [m async for _, m in bus.read_all(run_keys.prompts)
               if isinstance(m, PromptTicket)]
    ticket = tickets[0]
    await bus.publish(run_keys.log("rollouter"), TicketsClaimed(
        ticket_ids=[ticket.ticket_id], attempts=[0], rank=0))
    forged = [await bus.publish(run_keys.samples, _forged(ticket.ticket_id, i, n, rank=1))
              for i in range(n)]

    async def refused() -> list[DeadLetter] | None:
        letters = [m async for _, m in bus.read_all(run_keys.dlq)
                   if isinstance(m, DeadLetter) and m.entry_id in forged]
        return letters if len(letters) == n else None

    letters = await wait_until(refused, f"{n} forged answers in the dead-letter stream", 120,
                               procs.watch("trainer"))
    for letter in letters:
        assert letter.reason.endswith(
            f"refused alone: rollouter 1 answered attempt 0 of {ticket.ticket_id}, claimed by "
            "rollouter 0 (holder check)"), letter.reason
    procs.spawn("rollouter0", "rollouter", *args)
    assert procs.wait("trainer", 180) == 0, procs.log("trainer")
    assert procs.wait("rollouter0", 60) == 0, procs.log("rollouter0")

    events = await events_of(bus, run_keys.events)
    assert_every_step_once(events, steps)
    trained = {eid for e in events if isinstance(e, StepFinished) for eid in e.entry_ids}
    assert trained and not trained & set(forged)
    # The forger's answer asked for no new attempt: the holder's answer was on its way.
    assert not [e for e in events if isinstance(e, TicketsIssued) and e.attempt > 0]
    # rollouter0 stated its claims: every trained answer's ticket is among them.
    claimed = {tid async for _, m in bus.read_all(run_keys.log("rollouter"))
               if isinstance(m, TicketsClaimed) and m.rank == 0 for tid in m.ticket_ids}
    assert {sid.rsplit("/", 1)[0] for e in events if isinstance(e, StepFinished)
            for sid in e.sample_ids} <= claimed
