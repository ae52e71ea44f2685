"""One broadcast round of the collective weight transport, the blocking side: the round's
plan, the gloo group of its own, the publication's bytes in pieces straight into one buffer
with every chunk checked as it lands, and the worker thread a round runs on.

:mod:`weights.collective` plans the rounds (who is invited, when) and runs these parts on
a :class:`Worker`; every wait here polls the worker's stop flag, so a stopping process waits at
most :data:`STOP_WAIT_S` for a round in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
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

__all__ = ["CONNECT_S", "PIECE", "STOP_WAIT_S", "STORE", "ChunkCheck", "Member", "RoundPlan",
           "Stopped", "Worker", "first_line", "flatten", "open_store", "receive_round",
           "send_round"]

STORE = "weights:collective"
"""The ``BlobRef.store`` of a broadcast publication."""

PIECE = 64 * 1024 * 1024
"""Bytes per broadcast call (a whole number of chunks)."""

CONNECT_S = 5.0
"""How long a receiver tries to reach a round's store."""

STOP_WAIT_S = CONNECT_S + 2.0
"""How long a stopping process waits for its round in flight to give up."""

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


def first_line(exc: BaseException) -> str:
    """An exception's first line: torch's distributed errors append a C++ stack."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__



class Stopped(Exception):
    """The process is stopping: a round in flight gives up at its next wait."""


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
                loop.call_soon_threadsafe(fail, exc)
            else:
                loop.call_soon_threadsafe(settle, result)

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

_ABANDONED: list[dist.ProcessGroupGloo] = []  # left with an operation pending (_close_group)


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


def _close_group(group: dist.ProcessGroupGloo, pending: bool) -> None:
    """Shut ``group`` down. One with an operation still pending (the round was stopped)
    is kept, not destroyed: its destructor waits out gloo's timeout."""
    group.shutdown()
    if pending:
        _ABANDONED.append(group)


def _finish(work: dist.Work, stop: threading.Event) -> None:
    """Wait for a gloo operation (which fails by itself after the group's timeout),
    looking at ``stop`` every :data:`_WAIT_S`."""
    while True:
        try:
            work.wait(datetime.timedelta(seconds=_WAIT_S))
            return
        except RuntimeError as exc:
            if str(exc).strip() != "Operation timed out!":  # torch's poll timeout
                raise
        if stop.is_set():
            raise Stopped("stopped in a broadcast")


def _broadcast(group: dist.ProcessGroupGloo, buf: memoryview, size: int, stop: threading.Event,
               received: Callable[[int], None] | None = None) -> None:
    """Broadcast ``buf[:size]`` from rank 0 in pieces of :data:`PIECE`, in place. With
    ``received(end)``: called once ``buf[:end]`` is in, while the next piece is in flight
    (gloo sends it on its own thread), so a receiver checks what it has meanwhile."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    in_flight: tuple[int, dist.Work] | None = None
    for start in range(0, size, PIECE):
        count = min(PIECE, size - start)
        piece = torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=start)
        # torch's stub leaves broadcast out of the gloo backend's class; the class has it.
        work: dist.Work = group.broadcast([piece], opts)  # type: ignore[attr-defined]
        if in_flight is not None:
            _piece_in(*in_flight, stop, received)
        in_flight = (start + count, work)
    if in_flight is not None:
        _piece_in(*in_flight, stop, received)


def _piece_in(end: int, work: dist.Work, stop: threading.Event,
              received: Callable[[int], None] | None) -> None:
    _finish(work, stop)
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


def _present(store: dist.Store, keys: list[str], deadline: float,
             stop: threading.Event) -> list[int]:
    """The indices of ``keys`` set in ``store`` by ``deadline`` (all of them as soon as they
    are)."""
    while True:
        seen = [i for i, key in enumerate(keys) if store.check([key])]
        if len(seen) == len(keys) or time.monotonic() >= deadline:
            return seen
        if stop.is_set():
            raise Stopped("stopped while waiting for a round's members")
        time.sleep(0.02)


def open_store(timeout_s: float, stop: threading.Event) -> dist.TCPStore:
    """The trainer's store of one round, on a free port."""
    return dist.TCPStore("0.0.0.0", 0, None, True, datetime.timedelta(seconds=timeout_s),
                         False)


def send_round(store: dist.Store, plan: RoundPlan, buf: memoryview,
                stop: threading.Event) -> tuple[list[int], str | None]:
    """The trainer's side of one round: wait for the invited, send, wait for their ok.
    Returns the member indices (1-based) that hold the publication, and what went wrong."""
    invited = list(range(1, len(plan.members) + 1))
    ready = [invited[i] for i in _present(store, [f"ready/{i}" for i in invited],
                                          time.monotonic() + plan.join_timeout_s, stop)]
    # torch's stub says str; the store takes bytes as well (msgpack is not text).
    store.set("go", msgspec.msgpack.encode(ready))  # type: ignore[arg-type]
    if not ready:
        return [], f"none of {len(invited)} invited joined within {plan.join_timeout_s:g} s"
    group, pending = None, True
    try:
        group = _group(store, 0, len(ready) + 1, plan.host, plan.join_timeout_s,
                       plan.timeout_s)
        _broadcast(group, buf, plan.size, stop)
        pending = False
    except RuntimeError as exc:  # a member gone: gloo's timeout or a closed connection
        pending = False
        return [], f"the broadcast to {len(ready)} failed: {first_line(exc)}"
    finally:
        if group is not None:
            _close_group(group, pending)
    oks = _present(store, [f"ok/{i}" for i in ready], time.monotonic() + plan.timeout_s, stop)
    served = [ready[i] for i in oks]
    missing = [i for i in invited if i not in served]
    return served, (f"members {missing} of {len(invited)} did not receive it" if missing
                    else None)


def receive_round(plan: RoundPlan, index: int, m: Manifest,
                   stop: threading.Event) -> memoryview | None:
    """A receiver's side of one round: say ready, and if let in, receive the bytes into one
    buffer, check every chunk and say ok. None: left out of this round (joined late)."""
    # Connecting is bounded by CONNECT_S (a plan whose trainer died fails in seconds), the
    # wait for "go" by the join timeout, the broadcast by gloo's.
    store = dist.TCPStore(plan.host, plan.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=CONNECT_S))
    store.set_timeout(datetime.timedelta(seconds=plan.timeout_s))
    store.set(f"ready/{index}", "1")
    if not _present(store, ["go"], time.monotonic() + plan.join_timeout_s * 2, stop):
        raise BlobError(f"the trainer did not start round {plan.round} within "
                        f"{plan.join_timeout_s * 2:g} s")
    let_in = _INDICES.decode(store.get("go"))
    if index not in let_in:
        return None
    buf = flat_buffer(m.size)
    check = ChunkCheck(m, buf, plan.key)
    group = _group(store, let_in.index(index) + 1, len(let_in) + 1,
                   local_address(plan.host, plan.port), plan.join_timeout_s, plan.timeout_s)
    pending = True
    try:
        _broadcast(group, buf, m.size, stop, received=check)
        pending = False
    except RuntimeError:
        pending = False
        raise
    finally:
        _close_group(group, pending)
    check(m.size)  # an empty publication has no piece
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
