"""Client side of ``rlbus profile --run RUN --steps SPEC [--roles trainer,rollouter]``.

It publishes a :class:`~runschema.messages.ProfileRequest` to the run's events stream and waits,
bounded by a timeout, for the profiler service's answer: a StartProfile carrying the request
id on the control stream (accepted: exit code 0) or a ProfileRequestRefused on the events
stream (refused: exit code 2, the reason is printed). No answer in time means the service is
not running for this run (exit code 1). The request carries that timeout
(``ProfileRequest.timeout_s``): a service that first sees it later than that, by Redis's
clock, refuses it as expired instead of scheduling a session nobody waits for.

SPEC is one of:

* ``K``: trainer step K (1-based);
* ``A-B``: steps A to B inclusive, one session;
* ``next:N``: the N steps after the last started one, or after the step the trainer is
  already crossing into (the run's step barrier, docs/profiling.md); ``next`` alone is
  ``next:1``.

The service refuses steps that have already started, steps past the run's last step and steps
that overlap a session already scheduled on the same role.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from collections.abc import Sequence

import msgspec

from bus import ROLE_LOG_MAXLEN, Bus, BusError, RunKeys
from profiler_service.schedule import MAX_REQUEST_STEPS, ROLES
from runschema.messages import ProfileRequest, ProfileRequestRefused, StartProfile

__all__ = [
    "EXIT_ACCEPTED",
    "EXIT_NO_ANSWER",
    "EXIT_REFUSED",
    "ProfileSpec",
    "new_request_id",
    "parse_spec",
    "request_profile",
    "run_profile_request",
]

EXIT_ACCEPTED = 0
"""The service scheduled the session."""
EXIT_NO_ANSWER = 1
"""No answer within the timeout (or Redis unreachable)."""
EXIT_REFUSED = 2
"""Refused by the service, or a bad SPEC/argument."""

POLL_INTERVAL_S = 0.1
"""How often the client looks for the answer (it reads two streams, so it polls both)."""

PROG = "rlbus profile"

_NUMBER = re.compile(r"^[0-9]{1,9}$")


class ProfileSpec(msgspec.Struct, frozen=True):
    """A parsed SPEC: explicit ``steps`` (consecutive, ascending) or ``next_steps`` > 0."""

    steps: tuple[int, ...] = ()
    next_steps: int = 0


def _step(text: str, spec: str) -> int:
    if not _NUMBER.match(text):
        raise ValueError(f"{spec!r}: {text!r} is not a step number (steps are 1-based integers)")
    value = int(text)
    if value < 1:
        raise ValueError(f"{spec!r}: steps are 1-based, got {value}")
    return value


def parse_spec(spec: str) -> ProfileSpec:
    """Parse ``K``, ``A-B`` or ``next:N``; raise :class:`ValueError` saying what is wrong."""
    text = spec.strip()
    if not text:
        raise ValueError("empty SPEC: use K, A-B or next:N")
    if text == "next":
        return ProfileSpec(next_steps=1)
    if text.startswith("next:"):
        count = text[len("next:") :].strip()
        if not _NUMBER.match(count) or int(count) < 1:
            raise ValueError(f"{spec!r}: next:N needs a count N >= 1")
        if int(count) > MAX_REQUEST_STEPS:
            raise ValueError(f"{spec!r}: at most {MAX_REQUEST_STEPS} steps per request")
        return ProfileSpec(next_steps=int(count))
    first_text, dash, last_text = text.partition("-")
    first = _step(first_text.strip(), spec)
    last = _step(last_text.strip(), spec) if dash else first
    if last < first:
        raise ValueError(f"{spec!r}: range end {last} is before its start {first}")
    if last - first + 1 > MAX_REQUEST_STEPS:
        raise ValueError(f"{spec!r}: at most {MAX_REQUEST_STEPS} steps per request")
    return ProfileSpec(steps=tuple(range(first, last + 1)))


def new_request_id() -> str:
    """A fresh request id: short, unique and a safe label."""
    return uuid.uuid4().hex[:16]


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _after(entry_id: str | None) -> str:
    """XRANGE start just after ``entry_id`` (the whole stream when None)."""
    return "0" if entry_id is None else f"({entry_id}"


async def request_profile(
    bus: Bus,
    run_id: str,
    spec: str,
    roles: Sequence[str],
    timeout_s: float,
    request_id: str | None = None,
) -> int:
    """Publish a ProfileRequest for ``run_id`` on ``bus`` and wait for its answer.

    Returns :data:`EXIT_ACCEPTED`, :data:`EXIT_REFUSED` or :data:`EXIT_NO_ANSWER`, having
    printed what happened (the session and its steps, the reason, or who is not answering).
    """
    try:
        parsed = parse_spec(spec)
        keys = RunKeys(run_id)
    except ValueError as exc:
        _error(str(exc))
        return EXIT_REFUSED
    bad_roles = [r for r in roles if r not in ROLES]
    if bad_roles or not roles:
        _error(f"roles must be a non-empty subset of {','.join(ROLES)}, got {list(roles)}")
        return EXIT_REFUSED
    rid = request_id or new_request_id()

    # The run must exist: publishing into a missing events stream would create it, and a
    # trainer started later would find a log that is not its own.
    if await bus.latest(keys.events) is None:
        _error(f"run {run_id!r} has no events at {bus.url} (is the run id right? has it started?)")
        return EXIT_REFUSED
    # Answers can only come after the request: remember where both streams end now.
    control_cursor = _after(await bus.latest_id(keys.control))
    answers_cursor = _after(await bus.latest_id(keys.log("profiler")))
    request = ProfileRequest(
        request_id=rid,
        steps=list(parsed.steps),
        next_steps=parsed.next_steps,
        roles=list(dict.fromkeys(roles)),
        timeout_s=timeout_s,  # the service never serves it after we stopped waiting
    )
    await bus.publish(keys.log("operator"), request, maxlen=ROLE_LOG_MAXLEN)

    deadline = time.monotonic() + timeout_s
    while True:
        async for entry in bus.read_all(keys.control, start=control_cursor):
            control_cursor = _after(entry.id)
            msg = entry.msg
            if isinstance(msg, StartProfile) and msg.request_id == rid:
                steps = (
                    f"step {msg.first_step}"
                    if msg.first_step == msg.last_step
                    else f"steps {msg.first_step}-{msg.last_step}"
                )
                print(
                    f"profiling {steps} of run {run_id} on {', '.join(msg.roles)} "
                    f"(tool {msg.tool}): session {msg.session_id}",
                    flush=True,
                )
                return EXIT_ACCEPTED
        async for entry in bus.read_all(keys.log("profiler"), start=answers_cursor):
            answers_cursor = _after(entry.id)
            msg = entry.msg
            if isinstance(msg, ProfileRequestRefused) and msg.request_id == rid:
                _error(f"the profiler service refused the request: {msg.reason}")
                return EXIT_REFUSED
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _error(
                f"no answer from the profiler service for run {run_id} within {timeout_s:g} s: "
                "is it running (rlbus profiler / python -m profiler_service)?"
            )
            return EXIT_NO_ANSWER
        await asyncio.sleep(min(POLL_INTERVAL_S, remaining))


def run_profile_request(
    redis_url: str, run_id: str, spec: str, roles: list[str], timeout_s: float
) -> int:
    """``rlbus profile``: the exit code (0 accepted, 2 refused or bad SPEC, 1 no answer)."""

    async def go() -> int:
        bus = Bus.from_url(redis_url, client_name="rlbus-profile")
        try:
            return await request_profile(bus, run_id, spec, roles, timeout_s)
        except BusError as exc:
            _error(str(exc))
            return EXIT_NO_ANSWER
        finally:
            await bus.close()

    return asyncio.run(go())
