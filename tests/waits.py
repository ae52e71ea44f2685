"""The tests' waits, in one place: every one bounded, driven by what it waits for, and failing
with a message that says what it waited for.

A test never sleeps to let something happen; it waits for the thing itself: a stream entry
(:func:`wait_for`, :func:`wait_stream`, :func:`follow`, with blocking reads), a line in a
process's log (:func:`wait_log`), a component's liveness key (:func:`wait_heartbeat`), a
process's exit (:func:`wait_exit`), or any other condition (:func:`wait_until`). The bound
(``timeout_s``) is a generous limit on a hung test, never the thing the test measures: a
loaded machine makes a wait longer, not a test wrong.

Processes under test are :class:`Watched`: a wait that watches one fails at once, with its
log, when it exits non-zero (a wait on a process's own log also ends when it exits at all:
the line can no longer come).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from bus import LOG_ROLES, Bus, Entry, RunKeys, entry_key, log_order, peers
from runschema.messages import Heartbeat, Message, RunStarted

__all__ = [
    "POLL_S",
    "EventMatch",
    "Watched",
    "event",
    "follow",
    "log_keys",
    "read_log",
    "wait_exit",
    "wait_exit_blocking",
    "wait_for",
    "wait_heartbeat",
    "wait_log",
    "wait_stream",
    "wait_until",
    "wait_until_blocking",
]

T = TypeVar("T")

POLL_S = 0.05
"""Pause between two looks at something that cannot be waited on directly (a file, a log,
a liveness key, an exit): short, so that a wait ends soon after its condition holds."""

LOG_TAIL = 3000
"""Characters of each watched process's log quoted in a failure."""


class Watched:
    """A process under test: its name, its ``Popen`` and the file its output goes to.

    Proxies what the tests use of the ``Popen`` (``pid``, ``poll``, ``returncode``,
    ``send_signal``, ``wait``)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def log(self) -> str:
        """Everything the process wrote so far ("" before its first line)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe(self) -> str:
        rc = self.poll()
        state = "running" if rc is None else f"exited {rc}"
        return f"--- {self.name} ({state}), last lines of its log:\n{self.log()[-LOG_TAIL:]}"


def _failure(what: str, timeout_s: float, watch: Iterable[Watched]) -> AssertionError:
    logs = "\n".join(w.describe() for w in watch)
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{logs}".rstrip())


def _check_alive(what: str, watch: Iterable[Watched]) -> None:
    """A watched process that failed ends the wait: what it waited for may never come."""
    for w in watch:
        rc = w.poll()
        if rc is not None and rc != 0:
            raise AssertionError(f"{w.name} exited {rc} while waiting for {what}\n"
                                 f"{w.describe()}")


async def wait_until(
    probe: Callable[[], T | None] | Callable[[], Awaitable[T | None]],
    what: str,
    timeout_s: float,
    watch: Iterable[Watched] = (),
) -> T:
    """The first result of ``probe()`` (sync or async) that is not None, looked at every
    :data:`POLL_S`; fails naming ``what`` after ``timeout_s``, or at once when a watched
    process exits non-zero."""
    watch = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        if result is not None:
            return result  # type: ignore[return-value]
        _check_alive(what, watch)
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, watch)
        await asyncio.sleep(POLL_S)


def wait_until_blocking(
    probe: Callable[[], T | None],
    what: str,
    timeout_s: float,
    watch: Iterable[Watched] = (),
) -> T:
    """:func:`wait_until` for code without an event loop (fixtures, helper scripts)."""
    watch = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if result is not None:
            return result
        _check_alive(what, watch)
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, watch)
        time.sleep(POLL_S)


# --------------------------------------------------------------------------- streams


class EventMatch:
    """A predicate on messages that says what it matches (see :func:`event`)."""

    def __init__(self, kind: type, **fields: Any) -> None:
        self.kind = kind
        self.fields = fields

    def __call__(self, msg: Message) -> bool:
        return isinstance(msg, self.kind) and all(
            getattr(msg, k) == v for k, v in self.fields.items())

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{self.kind.__name__}({args})"


def event(kind: type, **fields: Any) -> EventMatch:
    """A predicate that says what it matches, for failure messages:
    ``event(StepStarted, step=2)`` holds for a StepStarted whose ``step`` is 2."""
    return EventMatch(kind, **fields)


def _describe(pred: Callable[..., Any]) -> str:
    if isinstance(pred, EventMatch):
        return str(pred)
    code = getattr(pred, "__code__", None)
    where = f" ({Path(code.co_filename).name}:{code.co_firstlineno})" if code else ""
    return f"an entry matching {getattr(pred, '__name__', repr(pred))}{where}"


_EVENTS = re.compile(r"^rlbus:\{(?P<run>[^}]+)\}:events$")


def log_keys(stream: str) -> RunKeys | None:
    """The run whose log ``stream`` names, when it is a run's (trainer's) events stream: the
    waits below then read the whole log, every role's stream merged by entry id."""
    m = _EVENTS.match(stream)
    return None if m is None else RunKeys(m.group("run"))


async def read_log(bus: Bus, stream: str) -> list[Entry]:
    """Every entry of ``stream``; of the run's whole log (every role's stream, merged by id,
    nothing refused: a test sees what was written) when ``stream`` is a run's events key."""
    keys = log_keys(stream)
    if keys is None:
        return [e async for e in bus.read_all(stream)]
    tagged = []
    for rank, role in enumerate(LOG_ROLES):
        tagged += [(log_order(e.id, role), rank, e) async for e in bus.read_all(keys.log(role))]
    return [e for _, _, e in sorted(tagged, key=lambda t: (t[0], t[1]))]


async def _read_after(bus: Bus, stream: str, cursors: dict[str, str]) -> list[Entry]:
    """One blocking read of ``stream`` (of every stream of the run's log, when it is a run's
    events key) after ``cursors``, which move on; in the log's order (bus.keys.log_order)."""
    read = await bus.read_after_many(cursors, count=1000, block_ms=200)
    entries: list[tuple[tuple[int, int, int], Entry]] = []
    for name, (got, cursor, _) in read.items():
        cursors[name] = cursor
        ms_seq = [(entry_key(e.id), e) for e in got]
        rank = list(cursors).index(name)
        entries += [((ms, rank, seq), e) for (ms, seq), e in ms_seq]
    return [e for _, e in sorted(entries, key=lambda t: t[0])]


async def follow(
    bus: Bus,
    stream: str,
    timeout_s: float,
    what: str,
    watch: Iterable[Watched] = (),
    after: str = "0",
) -> AsyncIterator[tuple[str, Message]]:
    """Every entry of ``stream`` after ``after`` (from its beginning by default), as it
    arrives (XREAD BLOCK); the caller stops by leaving the loop. Fails naming ``what`` when
    ``timeout_s`` pass first, or when a watched process exits non-zero."""
    watch = list(watch)
    deadline = time.monotonic() + timeout_s
    keys = log_keys(stream)
    streams = [stream] if keys is None else list(keys.log_streams)
    cursors = dict.fromkeys(streams, after)
    while True:
        entries = await _read_after(bus, stream, cursors)
        for entry_id, msg in entries:
            yield entry_id, msg
        _check_alive(what, watch)
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, watch)


async def wait_for(
    bus: Bus,
    stream: str,
    pred: Callable[[Message], bool],
    timeout_s: float,
    watch: Iterable[Watched] = (),
    what: str | None = None,
) -> Message:
    """The first entry of ``stream`` (from its beginning) that ``pred`` holds for."""
    what = f"{what or _describe(pred)} on {stream}"
    async for _, msg in follow(bus, stream, timeout_s, what, watch):
        if pred(msg):
            return msg
    raise AssertionError("unreachable: follow() ends only by failing")


async def wait_stream(
    bus: Bus,
    stream: str,
    done: Callable[[list[Message]], bool],
    timeout_s: float,
    what: str,
    watch: Iterable[Watched] = (),
) -> list[Entry]:
    """Every entry of ``stream`` once ``done(all its messages)`` holds."""
    seen: list[Entry] = []

    async def probe() -> list[Entry] | None:
        seen[:] = await read_log(bus, stream)
        return list(seen) if done([e.msg for e in seen]) else None

    return await wait_until(probe, f"{what} on {stream}", timeout_s, watch)


# --------------------------------------------------------------------------- processes


async def wait_trimmed(bus: Bus, stream: str, timeout_s: float,
                       watch: Iterable[Watched] = ()) -> None:
    """Until retention has trimmed a run's events ``stream``: its first entry is no longer
    the RunStarted that begins it (what was archived is then in the archive, and in the
    storage's copy of it: both come before the trim)."""

    async def trimmed() -> bool | None:
        async for _, msg in bus.read_all(stream):
            return None if isinstance(msg, RunStarted) else True
        return None

    await wait_until(trimmed, f"retention to trim {stream}", timeout_s, watch)


async def wait_log(proc: Watched, text: str, timeout_s: float) -> None:
    """Until ``proc``'s log holds ``text``; fails at once if ``proc`` exits without it."""
    what = f"{text!r} in {proc.name}'s log"

    def probe() -> bool | None:
        if text in proc.log():
            return True
        if proc.poll() is not None and text not in proc.log():
            raise AssertionError(f"{proc.name} exited {proc.poll()} before writing {text!r}\n"
                                 f"{proc.describe()}")
        return None

    await wait_until(probe, what, timeout_s)


async def wait_heartbeat(
    bus: Bus,
    pattern: str,
    proc: Watched,
    timeout_s: float,
    until: Callable[[Heartbeat], bool] = lambda beat: True,
    what: str = "a heartbeat",
) -> Heartbeat:
    """The first heartbeat of ``proc`` (its pid) on a liveness key matching ``pattern`` that
    ``until`` holds for; fails at once if ``proc`` exits."""

    async def probe() -> Heartbeat | None:
        for beat in await peers(bus, pattern):
            if beat.pid == proc.pid and until(beat):
                return beat
        if proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited {proc.poll()} while waiting for {what}\n"
                                 f"{proc.describe()}")
        return None

    return await wait_until(probe, f"{what} from {proc.name} (pid {proc.pid})", timeout_s)


def wait_exit_blocking(proc: Watched, timeout_s: float) -> int:
    """``proc``'s exit code once it exits; fails with its log if it runs past ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {proc.name} to "
                             f"exit\n{proc.describe()}") from None


async def wait_exit(proc: Watched, timeout_s: float) -> int:
    """:func:`wait_exit_blocking` on a thread: the event loop keeps running meanwhile."""
    return await asyncio.to_thread(wait_exit_blocking, proc, timeout_s)

