"""The bus client core: one connection pool, the retry/deadline policy, error mapping.

:class:`BusClient` holds one ``redis.asyncio.Redis`` client (bytes in, bytes out, RESP2).
The command groups (:mod:`bus.publish`, :mod:`bus.logs`, :mod:`bus.groups`, :mod:`bus.trim`,
:mod:`bus.barrier`, :mod:`bus.keyspace`) are mixins on top of it, composed into
:class:`bus.streams.Bus`; they and the other bus modules (liveness, blobs) send commands to
Redis only through its public surface: :meth:`~BusClient.command` (one command),
:meth:`~BusClient.pipeline` (several in one round trip, optionally MULTI/EXEC) and
:meth:`~BusClient.run_script` (a Lua script, registered once per client). Redis's error
replies reach them as raised (``redis.exceptions.ResponseError``: BUSYGROUP, NOGROUP, a
script's own errors); connection failures come mapped to bus errors.

Decisions:

- **Connection loss** → every call is retried with bounded exponential backoff + jitter
  (:class:`~bus.retry.RetryPolicy`) within one wall-clock budget: a call gives up
  ``redis.give_up_s`` (:data:`~bus.retry.BUDGET_S`, 600 s, by default) after its first try
  began, plus the time it asked to block, whether its tries were refused or hung, then raises
  :class:`~bus.errors.BusUnavailable` naming the redacted URL, the command, the tries and the
  budget. A client that has never
  been answered (a wrong URL) gives up after :data:`~bus.retry.FIRST_CONTACT_S` (10 s), quietly:
  the caller's one-line error says it. A retried XADD may land twice (the reply, not the
  write, was lost): delivery is at-least-once and handlers are idempotent. Refused credentials
  are :class:`~bus.errors.BusAuthError`, never retried.
- **No silent wait**: a call of a client that has been answered before, silent for
  :data:`SILENCE_WARN_S` (5 s) past its own block time, logs a WARNING naming the URL, the
  command and how long it has waited, and again every :data:`SILENCE_REPEAT_S` (10 s) while
  the wait lasts (one line per client per period, naming the other calls waiting too).
  Components log WARNINGs to stderr, so a stopped Redis is never a silent process.
- **A pause is not Redis's silence**: a watchdog timer, due every second while calls are in
  flight, that comes 5 s or more late means this process did not run (SIGSTOP, a frozen
  VM, a blocked loop). That time is left out of the budget and of the silence lines
  (:class:`~bus.reach.Stalls`); one WARNING says it, and :attr:`BusClient.on_pause` lets the
  owner re-check what it holds. :meth:`BusClient.reach_clock` is a clock that stops while
  Redis is silent (:class:`~bus.reach.Reach`), to judge peers' liveness keys by.
- **No wait is unbounded**: each try of a call (one command or one pipeline) has a deadline
  of ``op_timeout_s`` (or the budget left, if less) plus its ``block_ms``; a missed deadline
  counts as a connection failure (retried, then :class:`~bus.errors.BusUnavailable`).
  ``block_ms=0``/``None`` means *do not block* (unlike Redis, where 0 means forever). One
  deadline per round trip, not per reply, keeps pipelines cheap.
- **Redis Cluster** (``redis+cluster://``, ``rediss+cluster://``): the client is redis-py's
  ``RedisCluster``, which routes each command, script and pipeline by its keys' slot. Every
  key of a run carries ``{RUN}``, so a run's MULTI/EXEC, scripts and multi-stream reads stay
  in one slot, on one master. A pipeline whose commands share one slot goes as a plain
  pipeline to that slot's master (:mod:`bus.cluster`: redis-py's cluster transaction queues
  each command through a thread). Commands without a key (PING, TIME, INFO) go to the node the
  URL names; SCAN goes to the node owning its pattern's hash tag (a run's keys are all there).
  A plain URL at a cluster node is :class:`~bus.errors.BusClusterError` at :meth:`ping`, and
  a MOVED reply later is the same error, not a traceback.
- **Stream replies stay raw**: redis-py's parsers for the stream commands drop nil entries'
  ids and build a dict per entry (lossy, and slow on the hot path); the bus parses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bus.cluster import SlotPipelines
from bus.errors import (
    BusAuthError,
    BusClusterError,
    BusOutOfMemory,
    BusPermissionError,
    BusRefusedWrite,
    BusUnavailable,
    describe,
    redact_url,
    seconds,
    server_refusal,
)
from bus.reach import Reach, Stalls
from bus.retry import RetryHook, RetryPolicy, retry_async
from bus.urls import split_cluster

__all__ = ["SILENCE_REPEAT_S", "SILENCE_WARN_S", "Arg", "BusClient", "Reply", "block_args"]

log = logging.getLogger(__name__)

T = TypeVar("T")

Arg = str | bytes | bytearray | memoryview | int | float
"""One argument of a Redis command (what redis-py encodes)."""

_UNCOPIED_BYTES = 6000
"""A bytes argument longer than this is handed to redis-py as a memoryview (:func:`_wire_args`):
redis-py packs a command with hiredis, which copies every argument into the command it
builds, unless an argument is a memoryview: then its own packer sends arguments longer than
its buffer cut-off (6000 bytes, this) as they are. A weights chunk's transaction costs the
writer's event loop 1.12 ms of CPU at 0.4 MiB and 9.26 ms at 4 MiB given bytes, 0.47 and
2.28 ms given views (bench/wire_copy.py). Shorter arguments pack faster in hiredis."""


def _wire_args(args: Sequence[Arg]) -> Sequence[Arg]:
    """``args`` with each bytes argument longer than :data:`_UNCOPIED_BYTES` as a memoryview
    of it (the same bytes on the wire, not copied on the way); ``args`` itself when none is."""
    if not any(type(a) is bytes and len(a) > _UNCOPIED_BYTES for a in args):
        return args
    return [memoryview(a) if type(a) is bytes and len(a) > _UNCOPIED_BYTES else a
            for a in args]


# Untyped on purpose: a reply's shape is the command's (bytes, an int, None, lists of those,
# nested; INFO's dict), and the caller that sent the command reads it as that shape. A union
# of every shape would make each caller re-check what Redis guarantees.
Reply = Any
"""A Redis reply, as the command that asked for it shapes it."""

_RETRY_ON: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # includes BusyLoadingError while a restarted server replays its AOF
    RedisTimeoutError,
    TimeoutError,
    OSError,
    # A cluster between a master's failure and its replica's promotion (or a slot moving):
    # transient, retried within the same budget as an unreachable server.
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
)
_NO_RETRY: tuple[type[BaseException], ...] = (AuthenticationError, AuthorizationError)

SILENCE_WARN_S = 5.0
"""A call silent this long past its own block time logs a WARNING (a stopped server)."""

SILENCE_REPEAT_S = 10.0
"""...and logs it again this often while the wait lasts."""

_RAW_COMMANDS = ("XREADGROUP", "XREAD", "XRANGE", "XREVRANGE", "XAUTOCLAIM", "XPENDING", "XCLAIM")


def _raw(response: T, **options: object) -> T:
    return response


def _raw_stream_replies(client: aioredis.Redis) -> None:
    for name in _RAW_COMMANDS:
        client.set_response_callback(name, _raw)


def block_args(block_ms: int | None) -> list[str | int]:
    """``["BLOCK", ms]`` for a blocking read, ``[]`` for ``None``/``0`` (do not block)."""
    if not block_ms or block_ms <= 0:
        return []
    return ["BLOCK", int(block_ms)]


class _Wait:
    """One call in flight, as its silence warning describes it."""

    __slots__ = ("block_s", "budget_s", "error", "op", "started", "tries")

    def __init__(self, op: str, started: float, block_s: float, budget_s: float) -> None:
        self.op = op
        self.started = started
        self.block_s = block_s
        self.budget_s = budget_s
        self.tries = 0
        self.error: BaseException | None = None

    def silent_s(self, now: float) -> float:
        """Seconds without an answer, past the time the call asked to block."""
        return now - self.started - self.block_s


_PIPELINE_PREFIX = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.S)
"""redis-py's prefix of a pipeline's error reply."""


class BusClient:
    """The client core every command group builds on. Build it with :meth:`from_url`."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        op_timeout_s: float = 30.0,
        silence_warn_s: float = SILENCE_WARN_S,
        silence_repeat_s: float = SILENCE_REPEAT_S,
    ) -> None:
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        if silence_warn_s <= 0 or silence_repeat_s <= 0:
            raise ValueError("silence_warn_s and silence_repeat_s must be > 0")
        self._redis = client
        self.cluster = isinstance(client, RedisCluster)
        """Whether the client is a Redis Cluster client (``redis+cluster://``)."""
        self.url = redact_url(url)
        """The URL with any password replaced by ``***``."""
        self.retry = retry or RetryPolicy()
        self.op_timeout_s = op_timeout_s
        """Deadline of one try (plus its block time), in seconds."""
        self.silence_warn_s = silence_warn_s
        """Seconds of silence (past a call's block time) before its first WARNING."""
        self.silence_repeat_s = silence_repeat_s
        """Seconds between the WARNINGs of one wait."""
        self._answered = False  # until then, a failure is a first contact: no warnings
        # The calls in flight, watched by one timer per client while there are any (a timer
        # per call would cost ~2 us a call, as much as the rest of the call's overhead).
        self._waits: dict[_Wait, None] = {}
        self._watch: asyncio.TimerHandle | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._next_line = float("-inf")  # no new warning line before (loop time)
        # The watchdog's lateness: time this process did not run, never blamed on Redis.
        self._stalls = Stalls()
        self._reach = Reach()
        self.on_pause: Callable[[float], None] | None = None
        """Optional hook ``(seconds)`` run when the watchdog finds this process did not run
        for that long (SIGSTOP, a frozen VM): what it holds must be re-checked (the runtime
        pulses at once: rank claim, lease). The hook says it; without one the client logs a
        WARNING."""
        for name in _RAW_COMMANDS:
            client.set_response_callback(name, _raw)
        self._slots: SlotPipelines | None = None
        if isinstance(client, RedisCluster):
            # SCAN goes to one node (_route): its reply as it is, not merged into {node: ...}.
            client.result_callbacks.pop("SCAN", None)
            self._slots = SlotPipelines(client, _raw_stream_replies)
        self._scripts: dict[str, AsyncScript] = {}
        self.home_key: str | None = None
        """A key of the run this client serves (the runtime sets it). On a cluster, the
        server-wide commands (PING, TIME, INFO) go to the master owning its slot: the node
        whose clock stamps the run's entry ids and whose memory holds its keys. None: the
        node the URL names."""
        self.on_retry: Callable[[str, int, BaseException], None] | None = None
        """Optional hook ``(op, attempt, error)`` run before each retry wait (metrics, tests)."""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        retry: RetryPolicy | None = None,
        op_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        client_name: str | None = None,
        silence_warn_s: float = SILENCE_WARN_S,
        silence_repeat_s: float = SILENCE_REPEAT_S,
    ) -> Self:
        """A bus on ``url`` (``redis://``, ``rediss://``, ``unix://``; user/password allowed;
        ``redis+cluster://``/``rediss+cluster://`` for a Redis Cluster, the URL naming any
        node of it).

        Connects lazily: the first command opens the connection (and is retried).
        ``silence_warn_s``/``silence_repeat_s``: when a silent call logs its WARNINGs.
        """
        plain, is_cluster = split_cluster(url)
        factory = RedisCluster.from_url if is_cluster else aioredis.Redis.from_url
        client = factory(
            plain,
            decode_responses=False,
            protocol=2,  # the reply shapes the bus parses are RESP2's
            # No per-reply socket timeout: _call puts one deadline on the whole round trip
            # (a per-reply timer costs ~10 us for each of a pipeline's 64 replies).
            socket_timeout=None,
            socket_connect_timeout=connect_timeout_s,
            # Our own RetryPolicy is the only retry layer; redis-py's would multiply it.
            retry=Retry(NoBackoff(), 0),
            client_name=client_name,
        )
        return cls(client, url, retry=retry, op_timeout_s=op_timeout_s,
                   silence_warn_s=silence_warn_s, silence_repeat_s=silence_repeat_s)

    # ------------------------------------------------------------------ the one retry layer

    async def _call(
        self,
        op: str,
        fn: Callable[[], Awaitable[T]],
        on_retry: RetryHook | None = None,
        block_ms: int | None = None,
    ) -> T:
        """Run ``fn`` under the retry policy and its budget, each try within ``op_timeout_s``
        (or the budget left) plus the block time; warn while it is silent; map
        connection/auth failures to bus errors."""
        block_s = (block_ms or 0) / 1000
        loop = asyncio.get_running_loop()
        answered = self._answered
        budget_s = self.retry.budget_s if answered else self.retry.first_contact_s
        stalls = self._stalls

        def clock() -> float:  # the loop's, less this process's pauses: Redis's time to answer
            return stalls.clock(loop.time())

        wait = _Wait(op, clock(), block_s, budget_s)
        if answered:
            self._track(wait, loop)
        op_timeout_s = self.op_timeout_s

        async def attempt(left_s: float) -> T:
            wait.tries += 1
            # A cancelled redis-py read closes its connection, so no stale reply is left.
            async with asyncio.timeout(block_s + min(op_timeout_s, left_s)):
                return await self._answer(op, fn)

        heard = False
        try:
            result = await retry_async(
                self.retry, attempt, retry_on=_RETRY_ON, no_retry=_NO_RETRY,
                on_retry=self._retrying(wait, on_retry), budget_s=budget_s, clock=clock,
            )
            heard = True
        except (AuthenticationError, AuthorizationError, NoPermissionError) as exc:
            raise self._refused(op, exc) from exc
        except _RETRY_ON as exc:
            counted = self.retry.attempts is not None and wait.tries >= self.retry.attempts
            raise BusUnavailable(
                self.url, op, wait.tries, exc, waited_s=clock() - wait.started,
                budget_s=None if counted else budget_s,
            ) from exc
        except (MovedError, RedisClusterException) as exc:
            raise self._misnamed(exc) from exc
        except ResponseError:
            heard = True  # an error reply (NOGROUP, a script's error) is Redis answering
            raise
        finally:
            if answered:
                self._reach.ended(clock(), self._oldest(), answered=heard)
                del self._waits[wait]
        self._answered = True
        return result

    def _retrying(self, wait: _Wait, on_retry: RetryHook | None) -> RetryHook:
        """The hook run before each retry wait of ``wait``'s call: noted, logged, passed on."""

        def retrying(attempt: int, exc: BaseException) -> None:
            wait.error = exc
            log.info("%s on %s failed (%s); retry %d", wait.op, self.url, exc, attempt + 1)
            if on_retry is not None:
                on_retry(attempt, exc)
            if self.on_retry is not None:
                self.on_retry(wait.op, attempt, exc)

        return retrying

    def _oldest(self) -> float | None:
        """When the longest-waiting call in flight began to wait for its answer (run clock)."""
        return min((w.started + w.block_s for w in self._waits), default=None)

    def since_dark_s(self) -> float:
        """Seconds since Redis last failed to answer this client for over 5 s (0 while it
        does not; inf: never). A liveness key read sooner may have lapsed while its owner
        could not refresh it: absence is no proof of death yet. Call it on the client's
        event loop."""
        run = self._stalls.clock(asyncio.get_running_loop().time())
        return self._reach.since_dark_s(run, self._oldest())

    def reach_clock(self) -> float:
        """The loop's clock less every second Redis did not answer this client (past a 5 s
        grace, :class:`bus.reach.Reach`): the clock to judge peers' liveness keys by, since
        none could be refreshed while Redis was silent. Non-decreasing; call it on the
        client's event loop."""
        now = asyncio.get_running_loop().time()
        run = self._stalls.clock(now)
        return now - (run - self._reach.clock(run, self._oldest()))

    def _track(self, wait: _Wait, loop: asyncio.AbstractEventLoop) -> None:
        """Watch ``wait`` for silence (the client's one timer, started if not running)."""
        self._waits[wait] = None
        if self._watch is None or self._watch_loop is not loop:
            self._watch_loop = loop
            self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        tick = self._tick_s()
        self._stalls.armed(loop.time() + tick)
        self._watch = loop.call_later(tick, self._watch_waits)

    def _misnamed(self, exc: BaseException) -> BaseException:
        """:class:`BusClusterError` when ``exc`` says the URL's form is not the server's: a
        MOVED reply to a plain client (RedisCluster follows them), or a cluster client at a
        server without cluster mode; else ``exc`` itself."""
        if isinstance(exc, MovedError):
            return BusClusterError(self.url, is_cluster=True)
        if "cluster mode is not enabled" in str(exc).lower():
            return BusClusterError(self.url, is_cluster=False)
        return exc

    def _refused(self, op: str, exc: BaseException) -> BusAuthError:
        """The bus error for refused credentials, or a right the ACL does not give."""
        if isinstance(exc, NoPermissionError):
            return BusPermissionError(f"Redis at {self.url} refused {op}: {exc}")
        return BusAuthError(f"Redis at {self.url} refused the credentials: {exc}")

    async def _answer(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn``'s reply; a write the server refused for its own state (out of memory,
        unable to persist) raised as the :class:`BusRefusedWrite` that says so."""
        try:
            return await fn()
        except ResponseError as exc:
            # redis-py names an OOM reply (its code stripped); a script's is in its message.
            refused = (BusOutOfMemory if isinstance(exc, OutOfMemoryError)
                       else server_refusal(str(exc)))
            if refused is None:
                raise
            raise refused(await self._refusal_line(op, exc, refused)) from exc

    async def _refusal_line(self, op: str, exc: ResponseError,
                            kind: type[BusRefusedWrite]) -> str:
        """What a write the server refused for its own state says: the server, the op, and
        for memory its ``used_memory``/``maxmemory`` (INFO memory, read once: a read is not
        refused for memory; the numbers are left out when INFO is not answered)."""
        # redis-py prefixes a pipeline's error with the command it refused, arguments and
        # all (a weights chunk's bytes): the op names it already.
        reply = _PIPELINE_PREFIX.sub("", str(exc).strip(), count=1)
        reply = (reply.splitlines() or [""])[0][:200]
        if kind is BusOutOfMemory:
            numbers = ""
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(self.op_timeout_s, 5.0)):
                    info = await self._redis.execute_command("INFO", "memory")
                numbers = f": {_memory_numbers(info)}"
            return (f"Redis at {self.url} is out of memory{numbers}; it refused {op} ({reply}): "
                    f"free memory or raise maxmemory, then resume the run")
        return (f"Redis at {self.url} cannot persist its writes and refused {op} ({reply}): its "
                f"RDB/AOF could not be written, often a full disk; free space where it writes "
                f"(CONFIG GET dir), then resume the run")

    def _tick_s(self) -> float:
        # A fifth of the shorter period: a warning falls due at most this late.
        return min(self.silence_warn_s, self.silence_repeat_s) / 5

    def _watch_waits(self) -> None:
        """The timer of the calls in flight: one WARNING line for the client when one of
        them is silent ``silence_warn_s`` (the longest-silent named), again every
        ``silence_repeat_s`` while any is; the timer stops when no call is in flight."""
        loop = asyncio.get_running_loop()
        paused = self._stalls.fired(loop.time())
        if paused:
            self._paused(paused)
        if not self._waits:
            self._watch = None
            return
        now = self._stalls.clock(loop.time())
        self._arm(loop)
        silent = [w for w in self._waits if w.silent_s(now) >= self.silence_warn_s]
        if not silent:
            self._next_line = float("-inf")  # the next silence is reported when it is due
            return
        if now < self._next_line:
            return
        self._next_line = now + self.silence_repeat_s
        silent.sort(key=lambda w: -w.silent_s(now))
        log.warning("%s", self._silence_line(silent[0], silent[1:], now))

    def _paused(self, seconds_: float) -> None:
        """The watchdog found this process did not run for ``seconds_``: the owner's hook
        re-checks what it holds and says it; without one, a WARNING says it (the waits it
        interrupted are not Redis's silence either way)."""
        if self.on_pause is not None:
            self.on_pause(seconds_)
            return
        log.warning("this process did not run for %s s (stopped, frozen, or its event loop "
                    "blocked); not counted as Redis's silence", seconds(seconds_))

    def _silence_line(self, wait: _Wait, others: Sequence[_Wait], now: float) -> str:
        """``redis URL has not answered OP for N s; waiting up to B s (redis.give_up_s)``, with the
        block time, the tries and last error, and the ``others`` (three named), if any."""
        line = f"redis {self.url} has not answered {wait.op} for {seconds(wait.silent_s(now))} s"
        if wait.block_s:
            line += f" past its {seconds(wait.block_s)} s BLOCK"
        if wait.error is not None:
            line += f" ({wait.tries} try(s), last: {describe(wait.error)})"
        line += f"; waiting up to {seconds(wait.budget_s)} s (redis.give_up_s)"
        if others:
            named = ", ".join(f"{w.op} ({seconds(w.silent_s(now))} s)" for w in others[:3])
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            line += f"; also waiting: {named}{more}"
        return line

    # ------------------------------------------------------------------ public surface

    async def command(
        self, *args: Arg, block_ms: int | None = None, on_retry: RetryHook | None = None
    ) -> Reply:
        """Run one raw Redis command (``args[0]`` names it) under the retry policy; bytes
        replies, raw ones for the stream commands. ``block_ms``: how long the command itself
        may block (added to the deadline); ``on_retry`` runs before each retry wait."""
        redis_ = self._redis
        args = tuple(_wire_args(args))
        if isinstance(redis_, RedisCluster):
            route = self._route

            async def routed() -> Reply:
                await redis_.initialize()  # the slot table, the first time (routing needs it)
                return await redis_.execute_command(*args, **route(args))

            return await self._call(str(args[0]).upper(), routed, on_retry=on_retry,
                                    block_ms=block_ms)
        return await self._call(
            str(args[0]).upper(),
            lambda: redis_.execute_command(*args),
            on_retry=on_retry,
            block_ms=block_ms,
        )

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], *, atomic: bool = False, op: str | None = None
    ) -> list[Reply]:
        """Run ``commands`` in one round trip, as one call of the retry policy; their replies
        in order. ``atomic=True`` wraps them in MULTI/EXEC (all or nothing, no other client's
        command in between). ``op`` names the call in logs and errors (default: the first
        command's name)."""
        if not commands:
            return []
        commands = [_wire_args(args) for args in commands]
        redis_ = self._redis
        slots = self._slots

        async def go() -> list[Reply]:
            if slots is not None:
                await redis_.initialize()  # the slot table, the first time
                slot = await slots.slot_of(commands)
                if slot is not None:  # the bus's case: one run's keys, one slot
                    return await slots.execute(slot, commands, atomic)
            pipe = redis_.pipeline(transaction=atomic)
            for args in commands:
                pipe.execute_command(*args)
            return await pipe.execute()

        return await self._call(op or str(commands[0][0]).upper(), go)

    async def run_script(
        self, lua: str, keys: Sequence[str], args: Sequence[Arg], *, op: str = "EVAL",
        on_retry: RetryHook | None = None,
    ) -> Reply:
        """Run the Lua script ``lua`` with ``keys`` and ``args`` under the retry policy
        (``on_retry`` runs before each retry wait). Wraps EVALSHA (EVAL when the server does
        not have the script yet). A script is registered with the client once, the first
        time it runs."""
        script = self._scripts.get(lua)
        if script is None:
            script = self._scripts[lua] = self._redis.register_script(lua)
        keys_, args_ = list(keys), list(_wire_args(args))
        return await self._call(op, lambda: script(keys=keys_, args=args_), on_retry=on_retry)

    def _route(self, args: Sequence[Arg]) -> dict[str, ClusterNode | None]:
        """The node a keyless command goes to on a cluster: SCAN to the master owning its
        pattern's slot (``rlbus:{RUN}:*`` hashes like every key of the run: the run's keys are
        all there); PING, TIME and INFO to the master of :attr:`home_key` when set (else, and
        CLUSTER always, to the node the URL names)."""
        cluster = self._redis
        assert isinstance(cluster, RedisCluster)
        if str(args[0]).upper() == "SCAN" and "MATCH" in args:
            pattern = args[list(args).index("MATCH") + 1]
            key = pattern.decode() if isinstance(pattern, bytes) else str(pattern)
            return {"target_nodes": cluster.get_node_from_key(key)}
        name = str(args[0]).upper()
        if name in ("PING", "TIME", "INFO") and self.home_key is not None:
            return {"target_nodes": cluster.get_node_from_key(self.home_key)}
        if name in ("PING", "TIME", "INFO", "CLUSTER"):
            return {"target_nodes": cluster.get_default_node()}
        return {}

    # ------------------------------------------------------------------ server

    async def ping(self) -> None:
        """Wraps PING, then INFO cluster: raises :class:`BusUnavailable` if Redis stays
        unreachable, :class:`BusClusterError` if the URL's form (plain or cluster) is not
        what the server is."""
        await self.command("PING")
        if not self.cluster and await self._is_cluster_node():
            raise BusClusterError(self.url, is_cluster=True)

    async def _is_cluster_node(self) -> bool:
        """Whether the server is a node of a Redis Cluster. Wraps CLUSTER MYID (an error on a
        server without cluster support; a user without the right is not asked again)."""
        try:
            await self.command("CLUSTER", "MYID")
        except BusPermissionError:
            return False  # an ACL of before cluster support: the MOVED reply will say it
        except ResponseError:
            return False  # "ERR This instance has cluster support disabled"
        return True

    async def server_time(self) -> float:
        """The Redis server's clock, in seconds since the epoch. Wraps TIME.

        Entry ids of ``XADD *`` are this clock in milliseconds, so an entry's age is
        ``server_time()`` minus its id's ms part: one clock, whatever the hosts' clocks say.
        """
        seconds, micros = await self.command("TIME")
        return int(seconds) + int(micros) / 1_000_000

    async def server_version(self) -> tuple[int, int, int]:
        """The server's version, from INFO server."""
        info = await self.command("INFO", "server")
        parts = [int(p) for p in str(info["redis_version"]).split(".")[:3]]
        while len(parts) < 3:
            parts.append(0)
        return parts[0], parts[1], parts[2]

    async def memory_refusals(self) -> int | None:
        """How many commands the server has refused for memory since it started (INFO
        errorstats ``errorstat_OOM``); None for a user without INFO."""
        try:
            stats = await self.command("INFO", "errorstats")
        except (BusAuthError, ResponseError):
            return None
        oom = stats.get("errorstat_OOM")
        return int(oom.get("count", 0)) if isinstance(oom, dict) else 0

    async def write_refusal(self, memory_refusals_before: int | None = None,
                            since: str = "since the silent part was last seen"
                            ) -> str | None:
        """Why the server refuses writes now, in one line (None: it does not seem to):
        ``used_memory`` at its ``maxmemory`` with a policy that cannot evict for it, or its
        last AOF write / RDB save failed (MISCONF). Wraps INFO memory and persistence; a
        user without INFO gets None. What a peer says of a part that went silent: a write
        refused to every part is why, and the silent one could not say so itself.

        ``memory_refusals_before``: :meth:`memory_refusals` read while the silent part was
        alive (``since`` says when, in the line). A server that refused writes for memory
        since then is named even when its ``used_memory`` has fallen back below the limit:
        a large write (a batch of samples) counts its own request against ``maxmemory`` and
        is refused, and the memory it held is freed when its client goes, so a small write
        passes a moment later."""
        try:
            memory = await self.command("INFO", "memory")
            persistence = await self.command("INFO", "persistence")
        except (BusAuthError, ResponseError):
            return None
        limit, used = int(memory.get("maxmemory", 0)), int(memory.get("used_memory", 0))
        policy = str(memory.get("maxmemory_policy", ""))
        if limit and used >= limit * 0.98 and not policy.startswith("allkeys"):
            return (f"Redis at {self.url} is out of memory: {_memory_numbers(memory)}: no "
                    f"part can write")
        refused = (None if memory_refusals_before is None or not limit
                   else await self.memory_refusals())
        if refused is not None and memory_refusals_before is not None and (
                refused > memory_refusals_before):
            return (f"Redis at {self.url} is out of memory: {_memory_numbers(memory)}: it "
                    f"refused {refused - memory_refusals_before} write(s) for memory {since}")
        if "err" in (str(persistence.get("aof_last_write_status", "ok")),
                     str(persistence.get("rdb_last_bgsave_status", "ok"))):
            return (f"Redis at {self.url} cannot persist its writes (its last AOF write or "
                    f"RDB save failed, often a full disk): it refuses every write")
        return None

    # ------------------------------------------------------------------ lifetime

    async def close(self) -> None:
        """Close the client and its connections."""
        if self._slots is not None:
            await self._slots.close()
        await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _memory_numbers(info: dict[str, Any]) -> str:
    """What INFO memory says of a full server, in a line's words."""
    return (f"used_memory {info.get('used_memory_human', '?')} of maxmemory "
            f"{info.get('maxmemory_human', '?')} (policy {info.get('maxmemory_policy', '?')})")
