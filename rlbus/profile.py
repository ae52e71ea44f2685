"""``rlbus profile`` on a live run: refuse what cannot produce a trace, withdraw what timed out.

Before a request is published the run's own log is checked: a run that has not started, has
finished, or was started with ``global_profiler.tool`` null (no component holds a profiler,
so no trace could ever be written) is refused at once with exit code 2. A request that gets
no answer within its timeout is withdrawn: a ProfileRequestRefused for it is appended to the
events log, which the profiler service reads as the request's answer, so a service started
later never serves it at a step nobody asked for.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from bus import ROLE_LOG_MAXLEN, RUNS_STREAM, Bus, BusError, RunKeys
from profiler_service.request import (
    EXIT_ACCEPTED,
    EXIT_NO_ANSWER,
    EXIT_REFUSED,
    new_request_id,
    request_profile,
)
from rlbus.runlog import RunStatus, run_status
from runschema.messages import ProfileRequestRefused, RunStarted, StartProfile

__all__ = ["WITHDRAWN_PREFIX", "live_run_status", "profile_live_run", "refusal_for"]

PROG = "rlbus profile"

WITHDRAWN_PREFIX = "withdrawn by rlbus profile"
"""Start of the reason of the ProfileRequestRefused that withdraws a timed-out request."""


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def refusal_for(run_id: str, started: bool, finished_steps: int | None,
                config: dict | None) -> str | None:
    """Why a request on this run could never produce a trace (None: it may)."""
    if not started:
        return f"run {run_id!r} has not started (no RunStarted in its log; is the run id right?)"
    if finished_steps is not None:
        return f"run {run_id} has finished (after step {finished_steps})"
    tool = ((config or {}).get("global_profiler") or {}).get("tool")
    if tool is None:
        return (f"run {run_id} was started with profiling off (global_profiler.tool is null in "
                "its config), so its trainer and rollouters hold no profiler and no trace "
                "could be written; start the run with global_profiler.tool=torch")
    return None


async def live_run_status(url: str, run_id: str) -> RunStatus:
    """What the run's log says about it (rlbus.runlog.run_status). Under
    ``run.retention=checkpoint`` a long run's RunStarted may have been archived and trimmed
    from its events stream (run_status still sees that it started): then the run's entry in
    the discovery stream (``rlbus:runs``, written with the first RunStarted) gives its
    config."""
    status = await run_status(url, run_id)
    if status.config is not None or not status.started:
        return status
    bus = Bus.from_url(url, client_name="rlbus-profile")
    try:
        async for _, msg in bus.read_all(RUNS_STREAM):
            if isinstance(msg, RunStarted) and msg.run_id == run_id:
                status.config = msg.config
    finally:
        await bus.close()
    return status


async def _withdraw(
    bus: Bus, run_id: str, request_id: str, timeout_s: float
) -> StartProfile | None:
    """Append the withdrawal, then look once more for an answer that beat it (None: none)."""
    keys = RunKeys(run_id)
    withdrawn = ProfileRequestRefused(
        request_id=request_id, reason=f"{WITHDRAWN_PREFIX}: no answer within {timeout_s:g} s")
    await bus.publish(keys.log("operator"), withdrawn, maxlen=ROLE_LOG_MAXLEN)
    async for _, msg in bus.read_all(keys.control):
        if isinstance(msg, StartProfile) and msg.request_id == request_id:
            return msg
    return None


async def _go(url: str, run_id: str, spec: str, roles: Sequence[str], timeout_s: float) -> int:
    status = await live_run_status(url, run_id)
    reason = refusal_for(run_id, status.started, status.finished_steps, status.config)
    if reason is not None:
        _error(reason)
        return EXIT_REFUSED
    bus = Bus.from_url(url, client_name="rlbus-profile")
    rid = new_request_id()
    try:
        rc = await request_profile(bus, run_id, spec, list(roles), timeout_s, request_id=rid)
        if rc != EXIT_NO_ANSWER:
            return rc
        served = await _withdraw(bus, run_id, rid, timeout_s)
        if served is not None:
            print(f"profiling steps {served.first_step}-{served.last_step} of run {run_id} on "
                  f"{', '.join(served.roles)} (answered as the wait ended): session "
                  f"{served.session_id}", flush=True)
            return EXIT_ACCEPTED
        _error(f"request {rid} withdrawn: a profiler service started later will not serve it")
        return EXIT_NO_ANSWER
    except BusError as exc:
        _error(str(exc))
        return EXIT_NO_ANSWER
    finally:
        await bus.close()


def profile_live_run(url: str, run_id: str, spec: str, roles: Sequence[str],
                     timeout_s: float) -> int:
    """The exit code: 0 a session that will write a trace, 2 refused, 1 no answer."""
    return asyncio.run(_go(url, run_id, spec, roles, timeout_s))
