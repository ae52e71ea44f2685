"""A component started over (runtime.Restart) a bounded number of times *in a row*: one that
made progress before its restart starts the count again, so a week of survivable outages
(each one a lease lost and the log read back) never adds up to giving up; and a lease that
lapsed during an outage is such a restart, not a fence. No component process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus import Bus, Fenced, Lease, RunKeys
from runconfig import load_config
from runschema.messages import RunStarted
from runtime import Restart
from runtime import process as runtime_process
from trainer.writer import LogBehind, Writer


class _Instance:
    max_restarts = 2
    restart_says = "resuming from the log"

    def __init__(self, progressed: bool) -> None:
        self.progressed, self.claim = progressed, None


def _run(monkeypatch: pytest.MonkeyPatch, outcomes: list[bool | int]) -> tuple[int, int]:
    """Instances whose runs end as ``outcomes`` says, in order: True/False a Restart after
    progress or none, an int the exit code. Returns the code and how many instances ran."""
    made: list[_Instance] = []
    plan = iter(outcomes)
    current: dict[str, Any] = {}

    def factory(*_: Any) -> _Instance:
        outcome = next(plan)
        current["outcome"] = outcome
        made.append(_Instance(progressed=outcome is True))
        return made[-1]

    async def run(*_: Any) -> int:
        outcome = current["outcome"]
        if isinstance(outcome, bool):
            raise Restart("the trainer lease had vanished")
        return outcome

    monkeypatch.setattr(runtime_process, "_run_until_stopped", run)
    code = asyncio.run(runtime_process._run_restarting(load_config(), None, "trainer",
                                                       factory))  # type: ignore[arg-type]
    return code, len(made)


def test_restarts_without_progress_in_a_row_give_up(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(monkeypatch, [False, False, False, 0]) == (1, 3)


def test_progress_between_restarts_starts_the_count_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Five outages, each after the trainer finished steps: it goes on every time.
    assert _run(monkeypatch, [True, True, True, True, True, 0]) == (0, 6)
    assert "(1/2)" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_a_lapsed_lease_our_own_pulse_took_back_is_a_resume_not_a_fence(
    bus: Bus, run_keys: RunKeys
) -> None:
    """Redis was silent past the trainer's lease (its TTL ran out meanwhile, by Redis's
    clock). The pulse takes the lapsed lease back (Writer.renew) a moment before the step's
    next write is refused for it: the write must read as "our lease vanished, resume from the
    log" (LogBehind, a Restart), not as another trainer owning the run (Fenced: exit 1), which
    it did when the pulse won that race (test_redis_outage under a busy make test)."""
    lease = Lease(bus, run_keys.trainer_lease, "host:1:epoch", ttl_s=60)
    assert await lease.acquire() is None
    writer = Writer(bus, run_keys, lease)
    await writer.publish(RunStarted(run_id=run_keys.run_id, config={}))
    await bus.delete(run_keys.trainer_lease)  # lapsed while Redis was silent

    async def refused_then_taken_back(_: object) -> None:
        await writer.renew()  # our pulse got there first: the key is ours again
        raise Fenced(run_keys.trainer_lease, lease.token, None)

    with pytest.raises(LogBehind, match="is ours again"):
        await writer._checked(refused_then_taken_back)
    assert writer.fenced is None


@pytest.mark.asyncio
async def test_a_refusal_that_read_our_own_token_as_holder_is_a_resume_not_a_fence(
    bus: Bus, run_keys: RunKeys
) -> None:
    """The other order of the same race (CI, stop 42): the script is refused for the lapsed
    lease, then the pulse re-takes it, then the refusal reads the holder: it names our own
    token. That is our lease again (LogBehind), never "no longer ours: now held by" ourselves;
    and the same for a refusal that reached the trainer's top (retention's fenced trim)."""
    lease = Lease(bus, run_keys.trainer_lease, "host:1:epoch", ttl_s=60)
    assert await lease.acquire() is None
    writer = Writer(bus, run_keys, lease)

    async def refused_naming_ourselves(_: object) -> None:
        raise Fenced(run_keys.trainer_lease, lease.token, lease.token)

    with pytest.raises(LogBehind, match="is ours again"):
        await writer._checked(refused_naming_ourselves)
    with pytest.raises(LogBehind):
        await writer.judge_refusal(Fenced(run_keys.trainer_lease, lease.token, lease.token))
    assert writer.fenced is None
    # Another trainer's token is a fence, and it is remembered.
    other = Lease(bus, run_keys.trainer_lease, "host:2:epoch", ttl_s=60)
    await bus.delete(run_keys.trainer_lease)
    assert await other.acquire() is None
    await writer.judge_refusal(Fenced(run_keys.trainer_lease, lease.token, other.token))
    assert writer.fenced == other.token
