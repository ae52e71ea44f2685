"""One-line progress of a run, printed the same way by ``rlbus up`` and by every component.

:func:`step_line` formats a StepFinished; :func:`follow_progress` tails a run's log (the
trainer's stream and the rollouters', for the validation answers, from the newest entry: the
past is never re-read) and prints one line per finished step for the trainer (one XREAD BLOCK
at a time, a step's entries gathered for :data:`PER_STEP_GATHER_S`), and one line every
``every_s`` seconds for the other roles (what came meanwhile, read when the line is due).
:class:`ProgressThread` runs that follower beside a component's own event loop, so no
component code has to know about it. No torch here: ``rlbus up`` imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from typing import TextIO

import msgspec

from bus import Bus, BusError, RetryPolicy, RunKeys, log_order
from runschema.authority import refusal
from runschema.facts import run_finished_refusal, step_reward
from runschema.messages import Message, RunFinished, StepFinished, ValidationFinished

__all__ = [
    "ProgressSpec",
    "ProgressThread",
    "follow_progress",
    "step_line",
    "val_core_reward",
    "validation_line",
]


PER_STEP_GATHER_S = 0.05
"""After a read that found something, a per-step role waits this long before the next: a
step writes ~8 entries (tickets claimed, weights, the step's events), and a wake-up for each
cost the trainer's process GIL time its update needs; a line is at most this late."""


async def _read_log(bus: Bus, keys: RunKeys, cursors: dict[str, str],
                    wait_ms: int | None) -> tuple[list[Message], bool]:
    """One read of the followed streams after ``cursors`` (which move on): the messages in
    id order, without any its stream's role may not state (runschema.authority), and whether
    more may follow at once."""
    read = await bus.read_after_many(cursors, count=500, block_ms=wait_ms)
    found = []
    for stream, (entries, cursor, _) in read.items():
        cursors[stream] = cursor
        role = keys.log_role(stream) or "trainer"
        found += [(log_order(e.id, role), e.msg) for e in entries
                  if refusal(role, e.msg) is None]
    more = any(full for _, _, full in read.values())
    return [msg for _, msg in sorted(found, key=lambda pair: pair[0])], more


async def _next_messages(bus: Bus, keys: RunKeys, cursors: dict[str, str],
                         per_step: bool, next_line: float) -> list[Message]:
    """A per-step role's next read (waits up to 1 s for the next entry); any other role's
    reads once its next line is due, of all that came meanwhile in one go: a role that
    prints every ``every_s`` does not wake for every entry of the run."""
    if per_step:
        messages = (await _read_log(bus, keys, cursors, 1000))[0]
        if messages:  # what comes next gathers meanwhile: one wake-up, not one an entry
            await asyncio.sleep(PER_STEP_GATHER_S)
        return messages
    await asyncio.sleep(max(0.0, next_line - time.monotonic()))
    messages, more = await _read_log(bus, keys, cursors, None)
    while more:  # a long wait's backlog, a batch at a time: only what its line needs is kept
        batch, more = await _read_log(bus, keys, cursors, None)
        messages = _line_needs(messages) + batch
    return messages


def _line_needs(messages: list[Message]) -> list[Message]:
    """What a periodic line needs of ``messages``: the newest StepFinished and every
    RunFinished, in their order (a RunFinished is believed against the step before it)."""
    steps = [i for i, m in enumerate(messages) if isinstance(m, StepFinished)]
    newest = steps[-1] if steps else -1
    return [m for i, m in enumerate(messages) if i == newest or isinstance(m, RunFinished)]


def _believed(msg: RunFinished, last: StepFinished | None) -> bool:
    """A RunFinished ends the lines only when it names the last finished step seen."""
    return last is None or run_finished_refusal(msg, last.step) is None


def step_line(event: StepFinished, total: int) -> str:
    """``step   12/300  reward 0.412  staleness 0.50 (max 1)  123.4 samples/s  0.31s``, and
    ``  2 ranks`` when several trainer ranks trained it."""
    m = event.metrics
    return (
        f"step {event.step:>4}/{total}  reward {step_reward(m):.3f}  "
        f"staleness {m.get('staleness/mean', 0.0):.2f} (max {m.get('staleness/max', 0.0):.0f})  "
        f"{m.get('throughput/samples_per_s', 0.0):6.1f} samples/s  {event.duration_s:5.2f}s"
        + (f"  {ranks} ranks" if (ranks := int(m.get("trainer/ranks", 1))) > 1 else "")
    )


def _core_means(metrics: dict[str, float]) -> dict[str, float]:
    """The val-core ``mean@N`` figures (one per data source: its core variable's mean)."""
    return {k: v for k, v in sorted(metrics.items())
            if k.startswith("val-core/") and "/mean@" in k}


def val_core_reward(metrics: dict[str, float]) -> float | None:
    """A validation's headline: the mean over data sources of the val-core ``mean@N``
    (verl's ``val-core/{data_source}/reward/mean@N``); None without one."""
    means = list(_core_means(metrics).values())
    return sum(means) / len(means) if means else None


def validation_line(event: ValidationFinished) -> str:
    """``validation v3 (step 6): val-core/src/reward/mean@1 0.412  2.1s``."""
    head = f"validation v{event.version} (step {event.step})"
    if event.error:
        return f"{head} failed: {event.error}"
    figures = "  ".join(f"{k} {v:.3f}" for k, v in _core_means(event.metrics).items())
    return f"{head}: {figures or 'no metrics'}  {event.duration_s:.1f}s"


class ProgressSpec(msgspec.Struct, frozen=True):
    """What to follow: run ``run_id`` of ``total_steps`` steps, printed as ``role``."""

    run_id: str
    total_steps: int
    role: str
    every_s: float = 10.0
    """Roles other than the trainer print at most one line per this many seconds."""


async def follow_progress(
    bus: Bus, spec: ProgressSpec, out: TextIO | None = None, after: str | None = None
) -> None:
    """Print progress lines for ``spec`` until the run finishes or the task is cancelled,
    for entries after ``after`` (default: the newest entry when it starts).

    A Redis error ends the follower silently: the component itself reports it.
    """
    keys = RunKeys(spec.run_id)
    per_step = spec.role == "trainer"
    try:
        if after is None:
            after = await bus.latest_id(keys.events) or "0-0"
        # Entry ids of different streams compare by Redis's clock: one start for both.
        cursors = {keys.events: after, keys.log("rollouter"): after}
        last: StepFinished | None = None
        shown: StepFinished | None = None
        next_line = time.monotonic() + spec.every_s
        while True:
            for msg in await _next_messages(bus, keys, cursors, per_step, next_line):
                if isinstance(msg, RunFinished) and _believed(msg, last):
                    return
                if isinstance(msg, StepFinished):
                    last = msg
                line = _event_line(msg, spec.total_steps) if per_step else None
                if line is not None:
                    _print(out, f"{spec.role}: {line}")
            if per_step or time.monotonic() < next_line:
                continue
            next_line = time.monotonic() + spec.every_s
            if last is not None and last is not shown:
                _print(out, f"{spec.role}: {step_line(last, spec.total_steps)}")
                shown = last
            else:
                where = f"last step {last.step}" if last is not None else "no step yet"
                _print(out, f"{spec.role}: no step finished in the last {spec.every_s:g} s "
                            f"({where})")
    except BusError:
        return


def _event_line(msg: object, total: int) -> str | None:
    """The line a finished step or validation prints (per-step roles); None otherwise."""
    if isinstance(msg, StepFinished):
        return step_line(msg, total)
    if isinstance(msg, ValidationFinished):
        return validation_line(msg)
    return None


def _print(out: TextIO | None, line: str) -> None:
    print(line, file=out if out is not None else sys.stdout, flush=True)


def _said_by_the_component(_seconds: float) -> None:
    """The progress bus's pause hook: the component's own bus says the pause (one line)."""


class ProgressThread:
    """:func:`follow_progress` on its own thread, event loop and connection.

    ``start()`` then ``stop()`` (idempotent; waits at most ``join_s`` for the thread).
    """

    def __init__(self, url: str, spec: ProgressSpec, out: TextIO | None = None, *,
                 retry: RetryPolicy | None = None) -> None:
        self.url = url
        self.spec = spec
        self.out = out
        self.retry = retry
        """The component's retry policy (redis.give_up_s): its progress waits as long."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._ready.set()
            bus = Bus.from_url(self.url, retry=self.retry,
                               client_name=f"rlbus-progress-{self.spec.role}")
            bus.on_pause = _said_by_the_component
            try:
                await follow_progress(bus, self.spec, self.out)
            finally:
                with contextlib.suppress(Exception):
                    await bus.close()

        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(main())
        self._ready.set()

    def start(self) -> ProgressThread:
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def stop(self, join_s: float = 5.0) -> None:
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(task.cancel)
        if self._thread.is_alive():
            self._thread.join(join_s)
