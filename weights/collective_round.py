"""One broadcast round of the collective weight transport, the blocking side: the round's
plan, the gloo group of its own, the publication's bytes in pieces straight into one buffer
with every chunk checked as it lands, and the worker thread a round runs on.

:mod:`weights.collective` plans the rounds (who is invited, when) and runs these parts on
a :class:`Worker`; every wait here polls the worker's stop flag, so a stopping process waits at
most :data:`STOP_WAIT_S` for a round in flight.

A member that dies or is paused mid-broadcast would hold everyone in the round for gloo's
timeout: those downstream of it in gloo's tree wait for bytes it never forwards, and the
trainer for its ok. So while the bytes flow each receiver pulses in the round's store
(``beat/I``, every :data:`_WAIT_S`, from the round's thread: a live process pulses whatever
the bytes do) and the trainer watches the pulses (:class:`MemberWatch`). A member silent for
:data:`SILENT_S`, or one that left the round on an error of its own (``left/I``), ends the
round for all: the trainer writes ``abort``, every member still in it leaves at its next pulse
(:class:`RoundDropped`), and the trainer serves the rest in a new round at once, without the
silent ones (:class:`RoundOutcome`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, TypeVarTuple

import msgspec
import torch
import torch.distributed as dist

from bus import BlobCorrupt, BlobError, local_address
from runschema.messages import BlobRef
from weights.transport import FORMAT, Manifest, _entries, _unique, chunk_digests, flat_buffer

__all__ = ["CONNECT_S", "PIECE", "SILENT_S", "STOP_WAIT_S", "STORE", "ChunkCheck", "Member",
           "MemberWatch", "RoundClock", "RoundDropped", "RoundOutcome", "RoundPlan", "Stopped",
           "Worker",
           "first_line", "flatten", "open_store", "receive_round", "send_round", "silent"]

STORE = "weights:collective"
"""The ``BlobRef.store`` of a broadcast publication."""

PIECE = 64 * 1024 * 1024
"""Bytes per broadcast call (a whole number of chunks)."""

CONNECT_S = 5.0
"""How long a receiver tries to reach a round's store."""

STOP_WAIT_S = CONNECT_S + 2.0
"""How long a stopping process waits for its round in flight to give up."""

SILENT_S = 5.0
"""How long a member of a broadcast may go without a pulse before the trainer drops the round
(it is dead or paused) and serves the others without it. A live member pulses every
:data:`_WAIT_S` from a thread that waits in C++ (the GIL released), so only a process that is
gone or stopped misses ten pulses."""

_WAIT_S = 0.5
T = TypeVar("T")
Args = TypeVarTuple("Args")


class Member(msgspec.Struct, frozen=True, array_like=True):
    """A receiver: a rollouter replica's rank and process id (a restarted replica with the
    same rank holds nothing)."""

    rank: int
    pid: int


class RoundPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One round, as the trainer announces it in the ``weights-round`` key. ``round`` is
    unique across trainer incarnations (``EPOCH/N``); member ``i`` of ``members`` says
    ``ready/{i+1}``."""

    round: str
    key: str
    sha256: str
    size: int
    chunks: int
    version: int
    host: str
    port: int
    members: list[Member]
    join_timeout_s: float
    timeout_s: float

    def ref(self) -> BlobRef:
        """The reference of the publication this round sends (to read its manifest)."""
        return BlobRef(store=STORE, key=self.key, size=self.size, sha256=self.sha256,
                       chunks=self.chunks)


_INDICES = msgspec.msgpack.Decoder(list[int])


_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")


def first_line(exc: BaseException) -> str:
    """An exception's first line: torch's distributed errors append a C++ stack, and gloo's
    open with its source file and close with advice for its own developers."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = _GLOO_SOURCE.sub("", text.splitlines()[0])
    return line.split(" This is typically caused by", 1)[0]



class Stopped(Exception):
    """The process is stopping: a round in flight gives up at its next wait."""


class RoundDropped(Exception):
    """The trainer dropped the round this receiver is in (a member went silent or left): it
    leaves at once, its broadcast call left pending (:func:`_close_group`), and waits for the
    next round."""


class _MembersGone(Exception):
    """The trainer's side: members of the round went silent or left it (its
    :class:`MemberWatch` says who)."""


class RoundOutcome(msgspec.Struct, frozen=True):
    """How a round ended, as the trainer saw it: ``served``, the member indices (1-based)
    that hold the publication; ``trouble``, what went wrong (None: nothing); ``silent``, the
    members that stopped pulsing (gone or paused), left out of the next rounds until they
    are seen alive again."""

    served: list[int]
    trouble: str | None = None
    silent: list[int] = []


class Worker:
    """Runs one blocking round at a time on a daemon thread of its own, so that a round
    waiting on gloo holds neither the event loop nor the process's exit (the default
    executor's threads are joined at exit), and stops it: every wait of a round polls
    :attr:`stop`, and :meth:`close` waits (bounded) for the thread to leave torch's C++ code
    before the interpreter finalizes (a daemon thread caught inside it aborts the process)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        # Untyped: the round in flight is whichever call runs (open_store, send_round, ...), and
        # close() only waits for it to end, never reads its result.
        self.inflight: asyncio.Future[Any] | None = None

    async def call(self, fn: Callable[[*Args, threading.Event], T], *args: *Args) -> T:
        """``fn(*args, stop)`` on the worker's thread: its result, or its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T) -> None:
            if not future.done():
                future.set_result(result)

        def fail(error: BaseException) -> None:
            if not future.done():
                future.set_exception(error)

        def body() -> None:
            try:
                result = fn(*args, self.stop)
            except BaseException as exc:  # handed to the awaiting task
                deliver(fail, exc)
            else:
                deliver(settle, result)

        def deliver(to: Callable[[Any], None], outcome: object) -> None:
            # A call given up (Receiver._receive) may end after its loop closed: nobody waits.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(to, outcome)

        self.inflight = future
        threading.Thread(target=body, name=f"weights-{fn.__name__}", daemon=True).start()
        # Shielded: a cancelled caller leaves the round to :meth:`close`.
        return await asyncio.shield(future)

    async def close(self) -> None:
        """Stop the round in flight and wait up to :data:`STOP_WAIT_S` for its thread."""
        self.stop.set()
        if self.inflight is not None and not self.inflight.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.inflight), STOP_WAIT_S)
        if self.inflight is not None and self.inflight.done() and not self.inflight.cancelled():
            self.inflight.exception()  # retrieved: a stopped round's end is no news


# ---------------------------------------------------------------------- the blocking parts

def _group(store: dist.Store, rank: int, world: int, host: str, connect_s: float,
           timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group of its own on ``store`` (no default group: the trainer's ranks may have
    one), bound to ``host``'s interface. Forming it fails after ``connect_s`` (a member that
    said ready and died holds a round that long, not gloo's whole timeout); each operation
    after ``timeout_s``."""
    # Private in torch's stubs, public in its code: the options are the only way to bind the
    # group to one interface and bound its forming before it forms.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=connect_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, opts)
    group._set_default_timeout(datetime.timedelta(seconds=timeout_s))
    return group


KEPT_MAX = 16
"""Groups of failed rounds kept at most (:func:`_close_group`)."""

_KEPT: list[dist.ProcessGroupGloo] = []
"""Groups of rounds that failed, oldest first (:func:`_close_group`). The list itself is never
freed, not even when the interpreter finalizes: the OS takes the groups back at exit."""
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))


def _close_group(group: dist.ProcessGroupGloo, failed: bool) -> None:
    """Shut ``group`` down (its connections close: peers still in a call fail at once). A
    group whose round failed may have a call pending (a round dropped or stopped mid-call;
    gloo cannot cancel one) that ends only by gloo's timeout, and its destructor waits for
    it: so it is kept, not destroyed, lest its last reference held this thread, an event
    loop's garbage collection or the process's exit that long. At most :data:`KEPT_MAX` are
    kept (each two idle threads of gloo's); beyond, the oldest, whose call has long ended,
    is let go."""
    group.shutdown()
    if failed:
        _KEPT.append(group)
        while len(_KEPT) > KEPT_MAX:
            _KEPT.pop(0)


def _finish(work: dist.Work, stop: threading.Event, tick: Callable[[], None]) -> None:
    """Wait for a gloo operation (which fails by itself after the group's timeout), looking
    at ``stop`` and calling ``tick`` (the round's pulse or watch, which may raise) every
    :data:`_WAIT_S`."""
    while True:
        tick()
        try:
            work.wait(datetime.timedelta(seconds=_WAIT_S))
            return
        except RuntimeError as exc:
            if str(exc).strip() != "Operation timed out!":  # torch's poll timeout
                raise
        if stop.is_set():
            raise Stopped("stopped in a broadcast")


def _broadcast(group: dist.ProcessGroupGloo, buf: memoryview, size: int, stop: threading.Event,
               tick: Callable[[], None], received: Callable[[int], None] | None = None
               ) -> None:
    """Broadcast ``buf[:size]`` from rank 0 in pieces of :data:`PIECE`, in place, calling
    ``tick`` between waits. With ``received(end)``: called once ``buf[:end]`` is in, while
    the next piece is in flight (gloo sends it on its own thread), so a receiver checks what
    it has meanwhile."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    in_flight: tuple[int, dist.Work] | None = None
    for start in range(0, size, PIECE):
        count = min(PIECE, size - start)
        piece = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=start)
        # torch's stub leaves broadcast out of the gloo backend's class; the class has it.
        work: dist.Work = group.broadcast([piece], opts)  # type: ignore[attr-defined]
        if in_flight is not None:
            _piece_in(*in_flight, stop, tick, received)
        in_flight = (start + count, work)
    if in_flight is not None:
        _piece_in(*in_flight, stop, tick, received)


def _piece_in(end: int, work: dist.Work, stop: threading.Event, tick: Callable[[], None],
              received: Callable[[int], None] | None) -> None:
    _finish(work, stop, tick)
    if received is not None:
        received(end)


class ChunkCheck:
    """Checks a received buffer's chunks against the manifest as its pieces come in."""

    def __init__(self, m: Manifest, buf: memoryview, key: str) -> None:
        self.m, self.buf, self.key = m, buf, key
        self.checked = 0  # chunks checked so far

    def __call__(self, end: int) -> None:
        """Check every whole chunk of ``buf[:end]`` not checked yet (the last one when
        ``end`` is the size)."""
        m = self.m
        upto = len(m.chunks) if end >= m.size else end // m.chunk_size
        if upto <= self.checked:
            return
        digests = chunk_digests(self.buf[self.checked * m.chunk_size:min(
            upto * m.chunk_size, m.size)], m.chunk_size)
        for i, digest in enumerate(digests, start=self.checked):
            if digest != m.chunks[i]:
                raise BlobCorrupt(f"weights {self.key!r} chunk {i} as broadcast does not "
                                  "match its sha256 in the manifest")
        self.checked = upto


def silent(seen: Mapping[int, tuple[int, float]], beats: Mapping[int, int], now: float,
           silent_s: float) -> tuple[dict[int, tuple[int, float]], list[int]]:
    """Which members are silent (pure): ``seen`` holds each member's last pulse count and
    when it was first seen at that count; ``beats`` the counts read ``now``. Returns the new
    ``seen`` and, in order, the members whose count has not moved for ``silent_s`` (a
    member first seen now starts its clock now)."""
    updated = {}
    for member, count in beats.items():
        last = seen.get(member)
        updated[member] = last if last is not None and last[0] == count else (count, now)
    return updated, sorted(m for m, (_, since) in updated.items() if now - since >= silent_s)


class MemberWatch:
    """The trainer's view of a round's members while the bytes flow: their pulses
    (``beat/I``, which each says before ``ready/I``) and departures (``left/I``). Called
    between waits (:func:`_finish`), at most every :data:`_WAIT_S`, it raises
    :class:`_MembersGone` naming who went silent or left."""

    def __init__(self, store: dist.Store, members: list[int], ranks: Mapping[int, int],
                 silent_s: float) -> None:
        self.store, self.members, self.ranks, self.silent_s = store, members, ranks, silent_s
        self.seen: dict[int, tuple[int, float]] = {}
        self.silent: list[int] = []
        self.left: dict[int, str] = {}
        self.last = 0.0

    def look(self, among: list[int]) -> None:
        """Read the pulses and departures of ``among`` (wraps the store's MULTI_GET)."""
        if not among:
            return
        counts = self.store.multi_get([f"beat/{i}" for i in among])
        self.seen, quiet = silent(self.seen, dict(zip(among, map(int, counts), strict=True)),
                                  time.monotonic(), self.silent_s)
        self.silent = sorted(set(self.silent) | set(quiet))
        if int(self.store.add("left", 0)):
            for i in among:
                if i not in self.left and self.store.check([f"left/{i}"]):
                    self.left[i] = self.store.get(f"left/{i}").decode(errors="replace")

    def poll(self, among: list[int]) -> bool:
        """:meth:`look` at ``among`` if :data:`_WAIT_S` passed since the last look; whether
        it looked."""
        if time.monotonic() - self.last < _WAIT_S:
            return False
        self.last = time.monotonic()
        self.look(among)
        return True

    def gone(self) -> list[int]:
        """The members known to be out of the round: silent or left."""
        return sorted(set(self.silent) | set(self.left))

    def why(self) -> str:
        """What went wrong, in one line: who went silent, who left and why."""
        parts = [f"rank {self.ranks[i]} went silent (no pulse for {self.silent_s:g} s: "
                 "dead or paused)" for i in self.silent]
        parts += [f"rank {self.ranks[i]} left it ({reason})" for i, reason in
                  sorted(self.left.items()) if i not in self.silent and reason != _DROPPED]
        return "; ".join(parts)

    def __call__(self) -> None:
        if self.poll(self.members) and self.gone():
            raise _MembersGone(self.why())


class RoundClock:
    """When a receiver's round thread last heard from the trainer's store (thread-safe: a
    float written by one thread, read by another). Torch's store client waits without bound
    for a server that accepted the connection and stopped answering (a trainer paused by
    SIGSTOP, a stopped VM), so the thread cannot see that for itself: its caller
    (``Receiver``) gives the round up once this stands still too long."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def mark(self) -> None:
        self.at = time.monotonic()

    def still_s(self) -> float:
        """Seconds since the last mark."""
        return time.monotonic() - self.at


_DROPPED = "the trainer dropped the round"
"""What a member that left for the trainer's ``abort`` says (not news in the round's outcome)."""


class _Pulse:
    """A receiver's side of :class:`MemberWatch`, called between waits: pulse (at most every
    :data:`_WAIT_S`) and leave at once when the trainer dropped the round."""

    def __init__(self, store: dist.Store, index: int, clock: RoundClock) -> None:
        self.store, self.index, self.clock, self.last = store, index, clock, 0.0

    def __call__(self) -> None:
        if time.monotonic() - self.last < _WAIT_S:
            return
        self.last = time.monotonic()
        self.store.add(f"beat/{self.index}", 1)
        aborted = self.store.check(["abort"])
        self.clock.mark()
        if aborted:
            self.leave(_DROPPED)
            raise RoundDropped(f"the trainer dropped the round: "
                               f"{self.store.get('abort').decode(errors='replace')}")

    def leave(self, reason: str) -> None:
        """Say ``left/I`` (best effort: the store may be gone with the trainer)."""
        with contextlib.suppress(RuntimeError):  # torch's store errors
            self.store.set(f"left/{self.index}", reason)
            self.store.add("left", 1)


def _present(store: dist.Store, keys: list[str], deadline: float,
             stop: threading.Event, clock: RoundClock | None = None) -> list[int]:
    """The indices of ``keys`` set in ``store`` by ``deadline`` (all of them as soon as they
    are); ``clock`` marked at each look."""
    while True:
        seen = [i for i, key in enumerate(keys) if store.check([key])]
        if clock is not None:
            clock.mark()
        if len(seen) == len(keys) or time.monotonic() >= deadline:
            return seen
        if stop.is_set():
            raise Stopped("stopped while waiting for a round's members")
        time.sleep(0.02)


def open_store(timeout_s: float, stop: threading.Event) -> dist.TCPStore:
    """The trainer's store of one round, on a free port."""
    return dist.TCPStore("0.0.0.0", 0, None, True, datetime.timedelta(seconds=timeout_s),
                         False)


def send_round(store: dist.Store, plan: RoundPlan, buf: memoryview, silent_s: float,
               stop: threading.Event) -> RoundOutcome:
    """The trainer's side of one round: wait for the invited, send while watching their
    pulses, wait for their ok. A member silent for ``silent_s`` or gone from the round drops
    the round for those without the publication (:func:`_drop`)."""
    invited = list(range(1, len(plan.members) + 1))
    ready = [invited[i] for i in _present(store, [f"ready/{i}" for i in invited],
                                          time.monotonic() + plan.join_timeout_s, stop)]
    # torch's stub says str; the store takes bytes as well (msgpack is not text).
    store.set("go", msgspec.msgpack.encode(ready))  # type: ignore[arg-type]
    if not ready:
        return RoundOutcome([], f"none of {len(invited)} invited joined within "
                                f"{plan.join_timeout_s:g} s")
    watch = MemberWatch(store, ready, {i: plan.members[i - 1].rank for i in ready}, silent_s)
    failure = _send(store, plan, buf, ready, watch, stop)
    broken = failure is not None or bool(watch.gone())
    served = [] if broken else _await_oks(store, ready, watch, plan.timeout_s, stop)
    if broken or watch.gone():
        _drop(store, watch, [i for i in ready if i not in served], failure or watch.why())
    missing = [plan.members[i - 1].rank for i in invited if i not in served]
    said = (f"ranks {missing} of the {len(invited)} invited did not receive it" if missing
            else "")
    trouble = "; ".join(part for part in (failure, watch.why(), said) if part)
    return RoundOutcome(served, trouble or None, watch.silent)


def _send(store: dist.Store, plan: RoundPlan, buf: memoryview, ready: list[int],
          watch: MemberWatch, stop: threading.Event) -> str | None:
    """Broadcast the bytes to ``ready``: gloo's failure, or None (members gone are in
    ``watch``)."""
    group, done = None, False
    try:
        group = _group(store, 0, len(ready) + 1, plan.host, plan.join_timeout_s,
                       plan.timeout_s)
        _broadcast(group, buf, plan.size, stop, watch)
        done = True
        return None
    except _MembersGone:
        return None
    except RuntimeError as exc:  # gloo's timeout, a closed connection, a failed forming
        return f"the broadcast to {len(ready)} failed: {first_line(exc)}"
    finally:
        if group is not None:
            _close_group(group, failed=not done)


def _await_oks(store: dist.Store, ready: list[int], watch: MemberWatch, timeout_s: float,
               stop: threading.Event) -> list[int]:
    """The members of ``ready`` that said ok: all of them, or those that did when one of
    the others went silent or left, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        served = [i for i in ready if store.check([f"ok/{i}"])]
        waiting = [i for i in ready if i not in served]
        if not waiting or time.monotonic() >= deadline:
            return served
        if stop.is_set():
            raise Stopped("stopped while waiting for a round's members")
        if watch.poll(waiting) and set(watch.gone()) & set(waiting):
            return [i for i in ready if store.check([f"ok/{i}"])]
        time.sleep(0.02)


def _drop(store: dist.Store, watch: MemberWatch, waiting: list[int], why: str) -> None:
    """End the round for ``waiting``: say ``abort`` and wait until each has left or gone
    silent (a live one leaves at its next pulse), at most ``silent_s`` and two pulses. The
    store (closed after this) is where they learn it: closing it first would fail them with
    a network error instead of the reason."""
    store.set("abort", why)
    deadline = time.monotonic() + watch.silent_s + 2 * _WAIT_S
    rest = [i for i in waiting if i not in watch.gone()]
    while rest and time.monotonic() < deadline:
        time.sleep(0.1)
        watch.look(rest)
        rest = [i for i in rest if i not in watch.gone()]


def receive_round(plan: RoundPlan, index: int, m: Manifest, clock: RoundClock,
                  stop: threading.Event) -> memoryview | None:
    """A receiver's side of one round: say ready, and if let in, receive the bytes into one
    buffer while pulsing, check every chunk and say ok. None: left out of this round (joined
    late). Raises :class:`RoundDropped` when the trainer drops the round; leaving on an
    error of its own, it says ``left/I`` first, so that the trainer drops it at once.
    ``clock`` is marked each time a call to the trainer's store comes back (the caller gives
    the round up when it stands still: torch's client has no bound on a call its server
    never answers)."""
    # Connecting is bounded by CONNECT_S (a plan whose trainer died fails in seconds), the
    # wait for "go" by the join timeout, the broadcast by gloo's, a paused trainer by the
    # caller's watch of ``clock``.
    store = dist.TCPStore(plan.host, plan.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=CONNECT_S))
    store.add(f"beat/{index}", 1)  # before ready: the trainer reads every let-in's pulse
    store.set(f"ready/{index}", "1")
    clock.mark()
    if not _present(store, ["go"], time.monotonic() + plan.join_timeout_s * 2, stop, clock):
        raise BlobError(f"the trainer did not start round {plan.round} within "
                        f"{plan.join_timeout_s * 2:g} s")
    let_in = _INDICES.decode(store.get("go"))
    if index not in let_in:
        return None
    store.set_timeout(datetime.timedelta(seconds=plan.timeout_s))
    buf = flat_buffer(m.size)
    check = ChunkCheck(m, buf, plan.key)
    pulse = _Pulse(store, index, clock)
    clock.mark()
    group, done = None, False
    try:
        group = _group(store, let_in.index(index) + 1, len(let_in) + 1,
                       local_address(plan.host, plan.port), plan.join_timeout_s,
                       plan.timeout_s)
        _broadcast(group, buf, m.size, stop, pulse, received=check)
        check(m.size)  # an empty publication has no piece
        done = True
    except RoundDropped:
        raise
    except Exception as exc:  # gloo, a bad chunk, the store gone with the trainer, stopping
        pulse.leave(first_line(exc))
        raise
    finally:
        if group is not None:
            _close_group(group, failed=not done)
    store.set(f"ok/{index}", "1")
    return buf


def flatten(tensors: Mapping[str, torch.Tensor], chunk_size: int
             ) -> tuple[memoryview, Manifest]:
    """The publication's bytes in one buffer and its manifest (a chunk's digest per
    ``chunk_size`` bytes). Torch copies each tensor in (in its threads, casting none: the
    snapshot is in the published dtype already)."""
    unique, aliases = _unique(tensors)
    entries, size = _entries(unique)
    buf = flat_buffer(size)
    for entry, t in zip(entries, unique.values(), strict=True):
        if entry.nbytes:
            into = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes,
                                    offset=entry.offset)
            into.view(t.dtype).copy_(t.detach().reshape(-1))
    return buf, Manifest(FORMAT, chunk_size, size, entries, chunk_digests(buf, chunk_size),
                         aliases)
