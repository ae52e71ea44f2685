"""The run's log as one stream per writing role: who may state what (runschema.authority, pure) and
the merged reading of those streams (runtime.LogFollower) against a real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus import LOG_ROLES, Bus, Entry, Lease, RunKeys, entry_key, log_order
from runschema.authority import FACTS, refusal
from runschema.messages import (
    ComponentFailed,
    ProfileRequest,
    ProfilerReady,
    ProfileStarted,
    RolloutFailed,
    RunFinished,
    StepFinished,
    StepStarted,
    ValidationFinished,
    WarningRaised,
)
from runtime import LogFollower, since
from runtime.history import archive_below


def test_each_role_states_its_own_facts_only() -> None:
    assert refusal("trainer", RunFinished(run_id="r", steps=3)) is None
    assert refusal("rollouter", RolloutFailed(ticket_id="t", rank=0, error="x")) is None
    assert refusal("profiler", ProfilerReady()) is None
    assert refusal("operator", ProfileRequest(request_id="q", steps=[2])) is None
    reason = refusal("rollouter", RunFinished(run_id="r", steps=10**9))
    assert reason == "the rollouter role may not state RunFinished (a fact of the trainer's)"
    assert "a fact of the profiler's" in (refusal("operator", ProfilerReady()) or "")
    # A role may not speak for another: a rollouter's ProfileStarted of the trainer's role.
    forged = ProfileStarted(session_id="s", role="trainer", rank=0, step=1, tool="torch")
    assert refusal("rollouter", forged) == ("the rollouter role may not state ProfileStarted "
                                            "for role 'trainer'")
    assert refusal("trainer", forged) is None
    assert refusal("logger", ComponentFailed(role="trainer", rank=0, error="x")) is not None


@given(st.sampled_from(LOG_ROLES), st.sampled_from(sorted(
    {t for types in FACTS.values() for t in types}, key=lambda t: t.__name__)))
def test_a_fact_type_is_refused_exactly_where_its_role_may_not_state_it(
        role: str, kind: type) -> None:
    """Property: for messages that name no role, refusal is the FACTS table, nothing else."""
    samples = {RunFinished: RunFinished(run_id="r", steps=1), ProfilerReady: ProfilerReady(),
               WarningRaised: WarningRaised(source="x", code="c", message="m"),
               StepStarted: StepStarted(step=1, param_version=0),
               RolloutFailed: RolloutFailed(ticket_id="t", rank=0, error="e")}
    if kind not in samples:
        return
    assert (refusal(role, samples[kind]) is None) == (kind in FACTS[role])


def test_since_reads_from_the_millisecond_of_an_entry() -> None:
    assert since(None) == since("0") == "0"
    assert since("1700000000123-4") == f"1700000000122-{2**64 - 1}"


async def _write(bus: Bus, keys: RunKeys, plan: list[tuple[str, object]]) -> list[str]:
    return [await bus.publish(keys.log(role), msg) for role, msg in plan]  # type: ignore[arg-type]


def _plan() -> list[tuple[str, object]]:
    return [
        ("trainer", StepStarted(step=1, param_version=0)),
        ("rollouter", RolloutFailed(ticket_id="t1", rank=0, error="oom")),
        ("profiler", ProfilerReady()),
        ("trainer", StepFinished(step=1, sample_ids=[], metrics={}, duration_s=0.1)),
        ("rollouter", RunFinished(run_id="forged", steps=10**9)),  # refused by every reader
        ("rollouter", ValidationFinished(request_id="v", version=1, step=1, rank=0,
                                         metrics={})),
        ("operator", ProfileRequest(request_id="q", steps=[3])),
        ("trainer", StepStarted(step=2, param_version=1)),
    ]


@pytest.mark.asyncio
async def test_the_streams_fold_as_one_log_in_id_order_without_what_a_role_may_not_state(
        bus: Bus, run_keys: RunKeys, tmp_path: Path) -> None:
    ids = await _write(bus, run_keys, _plan())
    folded: list[Entry] = []
    refused: list[tuple[str, str]] = []
    log = LogFollower(bus, run_keys, fold=folded.extend, count=3,
                      on_refused=lambda role, e, reason: refused.append((role, e.id)))
    assert await log.catch_up() == 7
    # In the log's order: by millisecond (Redis's clock), then role (LOG_ROLES), then sequence.
    roles = [role for role, _ in _plan()]
    merged = sorted((k for k in range(len(ids)) if k != 4),
                    key=lambda k: log_order(ids[k], roles[k]))
    assert [e.id for e in folded] == [ids[k] for k in merged]
    assert refused == [("rollouter", ids[4])]
    assert log.position == ids[7]  # the trainer's stream: what its events trim keeps
    # Polling from the start reads the same log (a count of 3 cuts the read: the merged
    # order never goes back), each entry once.
    polled: list[Entry] = []
    again = LogFollower(bus, run_keys, fold=polled.extend, count=3)
    for _ in range(10):
        await again.poll()
    assert [e.id for e in polled] == [e.id for e in folded]
    # A reader of some roles only; the archive of the trainer's stream first when trimmed.
    await archive_below(bus, run_keys.events, tmp_path / "events", ids[7])
    some: list[Entry] = []
    part = LogFollower(bus, run_keys, ("trainer", "profiler"), fold=some.extend,
                       archive=tmp_path / "events")
    await part.catch_up()
    assert [e.id for e in some] == [ids[k] for k in sorted(
        (0, 2, 3, 7), key=lambda k: log_order(ids[k], roles[k]))]


@pytest.mark.asyncio
async def test_a_reader_starting_after_an_entry_reads_the_others_from_its_millisecond(
        bus: Bus, run_keys: RunKeys) -> None:
    ids = await _write(bus, run_keys, _plan())
    log = LogFollower(bus, run_keys, ("rollouter",))
    log.start_at_end(dict.fromkeys(log.positions, since(ids[3])))
    new = await log.poll()
    # What was written from ids[3]'s millisecond on (that millisecond may hold the earlier
    # failure too); the forgery refused, the answer kept.
    assert ids[5] in [e.id for e in new] and ids[4] not in [e.id for e in new]
    assert all(entry_key(e.id)[0] >= entry_key(ids[3])[0] for e in new)
    assert await log.ends() == {run_keys.log("rollouter"): ids[5]}


@pytest.mark.asyncio
async def test_a_trainer_write_comes_after_what_it_read_even_in_the_same_millisecond(
        bus: Bus, run_keys: RunKeys) -> None:
    """The fenced write's floor: an answer read from another role's stream with an id at or
    after Redis's clock (the same millisecond, here forced by an id ahead of the clock) is
    followed by an entry with a larger id, so the merged log puts the write after it."""
    lease = Lease(bus, run_keys.trainer_lease, "tok", 30.0)
    assert await lease.acquire() is None
    ahead_ms = int((await bus.server_time()) * 1000) + 400
    answer = f"{ahead_ms}-5"
    await bus.command("XADD", run_keys.log("rollouter"), answer, "m", b"x")
    ids = await lease.write([(run_keys.events, RunFinished(run_id="r", steps=1)),
                             (run_keys.events, StepStarted(step=2, param_version=1))],
                            floor=answer)
    # In a later millisecond than the answer: the merged log puts the write after it.
    assert entry_key(answer)[0] < entry_key(ids[0])[0] and entry_key(ids[0]) < entry_key(ids[1])
    if entry_key(ids[0])[0] == ahead_ms + 1:  # written before the clock passed the floor
        assert [entry_key(i) for i in ids] == [(ahead_ms + 1, 0), (ahead_ms + 1, 1)]
    # A floor far ahead of the clock is not followed: Redis's own id.
    far = f"{ahead_ms + 3_600_000}-0"
    (own,) = await lease.write([(run_keys.events, StepStarted(step=3, param_version=1))],
                               floor=far)
    assert entry_key(own) < entry_key(far)
    # Without a floor (or once the clock is past it) Redis picks the id as usual.
    (plain,) = await lease.write([(run_keys.log("rollouter"), StepStarted(step=4,
                                                                          param_version=1))])
    assert entry_key(plain) > entry_key(answer)
