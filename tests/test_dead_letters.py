"""Dead letters under a flood: one script per batch, a capped stream, one line per interval.

The tally that says refusals (bus.refusals) is fed by hand with its clock; the consumer's
dead-lettering runs against the real redis-server fixture, fenced (the trainer's) and not
(the rollouter's).
"""

from __future__ import annotations

import logging

import pytest

from bus import Bus, Consumer, Lease, Refusal, RefusalTally, RunKeys
from rlbus.inspect import dead_letters
from runschema.messages import FIELD, DeadLetter, StepStarted, encode

# ---------------------------------------------------------------------------- the log line


def test_the_first_refusal_is_said_at_once_then_one_line_per_interval() -> None:
    tally = RefusalTally("S", "trainer", interval_s=10.0)
    assert tally.line(0.0) is None  # nothing refused: nothing to say
    tally.add([("1-0", "undecodable bytes: bad", "undecodable bytes")])
    first = tally.line(0.0)
    assert first == ("refused 1 entry of S (group trainer): 1 undecodable bytes "
                     "(e.g. 1-0: undecodable bytes: bad)")
    # A flood within the interval: counted, not said.
    for t in range(1, 10):
        tally.add([(f"{t}-{i}", "undecodable bytes: x", "undecodable bytes") for i in range(1800)]
                  + [(f"{t}-x", "expected a Sample, got Heartbeat", "not a sample")] * 38,
                  dropped=100)
        assert tally.line(float(t)) is None
    line = tally.line(10.0)
    assert line is not None
    assert line.startswith("refused 16542 entries of S (group trainer) in the last 10 s: "
                           "16200 undecodable bytes (e.g. 1-0: undecodable bytes: x), "
                           "342 not a sample (e.g. 1-x: expected a Sample, got Heartbeat)")
    assert line.endswith("; 900 older dead letter(s) dropped (the dead-letter stream is at "
                         "its cap)")
    assert tally.line(30.0) is None  # the counts started again from zero


# ---------------------------------------------------------------------------- the consumer


async def _fenced(bus: Bus, keys: RunKeys, dlq_max: int) -> Consumer:
    lease = Lease(bus, keys.trainer_lease, "host:1:a", 30.0)
    assert await lease.acquire() is None
    consumer = Consumer(bus, keys.samples, "trainer", "trainer-a", dlq_stream=keys.dlq,
                        fence=lease, dlq_max=dlq_max)
    await consumer.ensure_group()
    return consumer


async def _junk(bus: Bus, stream: str, n: int) -> list[str]:
    """``n`` entries, every other one undecodable and the others a message of some type."""
    replies = await bus.pipeline([
        ("XADD", stream, "*", FIELD,
         b"\xc1junk" if i % 2 else encode(StepStarted(step=i, param_version=0)))
        for i in range(n)])
    return [r.decode() for r in replies]


@pytest.mark.asyncio
async def test_a_read_of_junk_is_one_round_trip_and_one_log_line(
    bus: Bus, run_keys: RunKeys, caplog: pytest.LogCaptureFixture,
) -> None:
    """1000 undecodable entries in one read: one script dead-letters and acks them all, and
    the log says so in one line with the count (once per interval, never per entry)."""
    consumer = await _fenced(bus, run_keys, 100_000)
    consumer.accept = (StepStarted,)
    assert await consumer.read(count=1, block_ms=None) == []  # its own pending: none
    ids = await _junk(bus, run_keys.samples, 2000)
    scripts: list[str] = []
    script = consumer._script

    async def counted(body: str, keys: list[str], args: list[object], *, op: str,
                      **kw: object) -> object:
        scripts.append(op)
        return await script(body, keys, args, op=op, **kw)  # type: ignore[arg-type]

    consumer._script = counted  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="bus.groups"):
        got = await consumer.read(count=2000, block_ms=None)
    assert [d.id for d in got] == ids[0::2]
    assert scripts == ["XREADGROUP", "DLQ"]
    letters = [m async for _, m in bus.read_all(run_keys.dlq)]
    assert [m.entry_id for m in letters if isinstance(m, DeadLetter)] == ids[1::2]
    assert await bus.pending_owners(run_keys.samples, "trainer", 10_000) == {
        i: "trainer-a" for i in ids[0::2]}  # the junk acked, the good ones pending
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"refused 1000 entries of {run_keys.samples} (group trainer): 1000 undecodable bytes")
    # A handler's refusals: one more script for all of them, said at the interval's end.
    await consumer.dead_letter_many([Refusal(d, "ticket never issued", "never issued")
                                     for d in got])
    assert scripts == ["XREADGROUP", "DLQ", "DLQ"]
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("fenced", [True, False])
async def test_the_dead_letter_stream_is_capped_and_what_it_drops_is_counted(
    bus: Bus, run_keys: RunKeys, fenced: bool,
) -> None:
    """Batches of dead letters past the cap: the stream stays within a node of it (XTRIM
    MAXLEN ~ trims whole nodes of 100 entries), its newest letters kept, and the counter
    holds exactly how many were dropped."""
    cap = 1000
    if fenced:
        consumer = await _fenced(bus, run_keys, cap)
    else:
        consumer = Consumer(bus, run_keys.samples, "trainer", "r", dlq_stream=run_keys.dlq,
                            dlq_max=cap)
        await consumer.ensure_group()
    injected: list[str] = []
    for _ in range(7):
        injected += await _junk(bus, run_keys.samples, 700)
        await consumer.dead_letter_many(
            [Refusal(d, "not a sample") for d in await consumer.read(count=700, block_ms=None)])
    kept = [m.entry_id async for _, m in bus.read_all(run_keys.dlq) if isinstance(m, DeadLetter)]
    dropped = int(await bus.command("GET", run_keys.dlq_dropped))
    assert cap <= len(kept) < cap + 100
    # The newest kept: each batch's undecodable letters come first (the read's), then the
    # handler's, so the order is by batch; the last batch is whole.
    assert len(set(kept)) == len(kept) and set(kept) <= set(injected)
    assert set(injected[-700:]) <= set(kept)
    assert dropped == len(injected) - len(kept) > 0
    assert consumer.stats.dead_lettered == len(injected)
    # rlbus inspect says both in its timeline's head.
    counts = await dead_letters(bus, run_keys)
    assert counts == (len(kept), dropped)
    assert counts.line(run_keys.run_id) == (
        f"dead letters: {len(kept)} in rlbus:{{{run_keys.run_id}}}:dlq, {dropped} older ones "
        "dropped by its cap (redis.dead_letter_max)")
