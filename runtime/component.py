"""One lifecycle for every component process, in the spirit of arq's ``Worker``.

A :class:`Component` (the trainer, a rollouter, the profiler service, the metrics logger) is
the one object that owns its process's life on the bus:

1. :meth:`~Component.setup`, before anything says "alive" (the trainer takes its lease here);
2. the pulse: a task refreshing the liveness key ``RunKeys.alive(role, rank)`` every
   ``heartbeat.interval_s`` with :meth:`~Component.heartbeat`, after :meth:`~Component.on_pulse`
   (lease renewal) and, for a component that follows the events log, after storing the
   position it needs kept (:meth:`~Component.kept_position`): the trainer's events trim never
   passes it while the key lives. Heavy work runs on the worker thread (:meth:`off`), so a
   step of any length never delays a pulse;
3. :meth:`~Component.serve`, the component's own work, which returns the exit code;
4. the stop: a first SIGTERM/SIGINT/SIGHUP sets :attr:`~Component.stopping`. A component
   whose work is its run's (``cancel_on_stop``: trainer, rollouters) is cancelled at once,
   its ``finally`` blocks being its graceful part (exit 143); a follower (profiler service,
   logger) finishes what it is doing and returns its own code, cancelled after half of
   ``run.stop_grace_s`` if it does not. A second signal cancels at once; a process still
   there ``run.stop_grace_s`` after the first signal ends itself (exit 143: its launcher, who
   would SIGKILL it then, may be gone: runtime.process);
5. teardown, whatever happened: background tasks cancelled, the profiler agent closed (its
   trace written, ProfileStopped published), :meth:`~Component.teardown`, the worker thread
   shut down, the liveness key taken down (a clean exit is not a silent death).

Before it is built, a component may :meth:`~Component.join` its run (a rollouter claims its
rank on the bus, :mod:`bus.ranks`); the claim is refreshed at every pulse, and one lost to
another process ends the component (:class:`ClaimLost`, exit 1). A process that did not run
for a while (SIGSTOP, a frozen VM: the bus's watchdog, :mod:`bus.reach`) pulses at once on
waking, so it re-checks its claim (and the trainer its lease) before blaming anything on
Redis: still held, it goes on; taken, it exits with the claim-lost line.

A :class:`Failure` raised from setup or serve is the component's named error: one line on
stderr, a ``ComponentFailed`` event (unless the failure says the log must not be written),
exit code 1. A background task (:meth:`~Component.spawn`: the pulse, the trainer's weights
broadcasts, a rollouter's weights receiver) that ends with an error ends the component with
that error, exactly as if serve had raised it: a part that died never leaves the rest of
its process waiting in silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import sys
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, ParamSpec, TypeVar, TypeVarTuple

from bus import (
    ROLE_LOG_MAXLEN,
    Bus,
    BusError,
    BusPermissionError,
    BusRefusedWrite,
    Fenced,
    RankClaim,
    RankLost,
    RunKeys,
    pulse_forever,
)
from runconfig import Config
from runschema.messages import Command, ComponentFailed, Event, Heartbeat, StartProfile, StopProfile

if TYPE_CHECKING:
    from profiling.driver import StepProfiler

__all__ = ["ClaimLost", "Component", "Failure", "Restart", "settle_heap"]

T = TypeVar("T")
P = ParamSpec("P")
Args = TypeVarTuple("Args")

ALIVE_DELETE_TIMEOUT_S = 2.0
"""Bound on removing the liveness key at exit (Redis may be what failed)."""


class Failure(RuntimeError):
    """A component's named failure: the message says what it waited for or what broke.
    ``publish``: whether a ``ComponentFailed`` event may be written about it."""

    code = 1
    publish = True


class ClaimLost(Failure):
    """This process's rank claim lapsed and another process took it (exit 1)."""


class Restart(RuntimeError):
    """The component must start over in this process, as a new instance (the trainer found
    the log behind what it wrote): :func:`runtime.process.main` builds a fresh one, at most
    ``max_restarts`` times in a row."""


def settle_heap() -> None:
    """A component's start-up is over: if the garbage collector is off (the trainer and the
    rollouters start with it off, see :func:`runtime.process.main`), freeze what is alive now
    (gc.freeze: the imports and the model stay out of every later collection) and turn it
    back on. With the collector on (a component run in-process, e.g. under tests) this does
    nothing."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


class Component:
    """Base of every component; subclasses set :attr:`role` and implement :meth:`serve`."""

    role: ClassVar[str]
    cancel_on_stop: ClassVar[bool] = True
    """True: a stop signal cancels :meth:`serve` (exit 143). False: :meth:`serve` watches
    :attr:`stopping` and returns its own exit code."""
    max_restarts: ClassVar[int] = 0
    """How many times in a row a :class:`Restart` may start the component over."""
    restart_says: ClassVar[str] = "starting over"
    """What a restart is, in the line that announces it."""

    def __init__(self, cfg: Config, bus: Bus, rank: int = 0) -> None:
        self.cfg = cfg
        self.bus = bus
        self.rank = rank
        self.progressed = False
        """This instance did useful work (a trainer: finished a step): a :class:`Restart`
        after it is not "in a row" with the ones before (a week brings several outages, each
        survivable)."""
        self.run_id = cfg.run.id or ""
        self.keys = RunKeys(self.run_id)
        self.stopping = asyncio.Event()
        """Set by the first stop signal."""
        self.profiler: StepProfiler | None = None
        """The component's :class:`profiling.driver.StepProfiler`, when profiling is on."""
        self._control_last = "0"
        self._pulse_now = asyncio.Event()
        self._tasks: list[asyncio.Task[object]] = []
        self._worker: ThreadPoolExecutor | None = None
        self.claim: RankClaim | None = None
        """The rank this process claimed at :meth:`join` (set by runtime.process)."""
        self._lost: ClaimLost | None = None
        self._ended_by: BaseException | None = None
        """What a background task (:meth:`spawn`) ended with, which ends the component."""
        self._serving_now = False
        self._said: Failure | None = None
        """The failure this component ended with, said (one line) and published."""
        self._main: asyncio.Task[object] | None = None

    @property
    def name(self) -> str:
        """How this process names itself in lines and events (``rollouter1``, ``trainer``)."""
        return f"{self.role}{self.rank}" if self.role == "rollouter" else self.role

    # ------------------------------------------------------------------ hooks

    @classmethod
    async def join(cls, cfg: Config, bus: Bus) -> tuple[Config, RankClaim | None]:
        """Once Redis answers, before the component is built: claim what makes this process
        one of its run's (a rollouter's rank, :func:`runtime.ranks.join_rank`). Returns the
        config to build with and the claim (refreshed at every pulse, released at exit by
        runtime.process); raise :class:`Failure` to exit. By default: nothing to claim."""
        return cfg, None

    async def setup(self) -> None:
        """Before the pulse starts (e.g. the trainer's lease); raise :class:`Failure` to exit."""

    async def serve(self) -> int:
        """The component's work; returns the exit code."""
        raise NotImplementedError

    def heartbeat(self) -> Heartbeat:
        """The value of the next pulse: who this is, what it does, its gauges."""
        return Heartbeat(role=self.role, rank=self.rank, pid=os.getpid(), state="running")

    async def on_pulse(self) -> None:
        """At every pulse, before the liveness key is refreshed."""

    def kept_position(self) -> str | None:
        """The events position this component needs kept in the stream (stored at every
        pulse, honoured by the trainer's trim while the liveness key lives); None: none."""
        return None

    async def teardown(self) -> None:
        """At exit, after the profiler agent closed, whatever ended :meth:`serve`."""

    # ------------------------------------------------------------------ services

    def say(self, text: str, *, error: bool = False) -> None:
        """One line on stdout (stderr for ``error``), named after this component."""
        print(f"{self.name}: {text}", file=sys.stderr if error else sys.stdout, flush=True)

    def pulse_now(self) -> None:
        """Refresh the liveness key now, not an interval later (a state worth telling)."""
        self._pulse_now.set()

    def spawn(self, coro: Coroutine[object, None, T], name: str) -> asyncio.Task[T]:
        """A background task of this component, cancelled (and awaited) at exit. One that
        ends with an error ends the component with it, as if :meth:`serve` had raised it
        (a named failure, a restart, a traceback for a bug): a part that died must never
        leave the rest waiting on it in silence."""
        task = asyncio.create_task(coro, name=f"{self.name}-{name}")
        task.add_done_callback(self._background_ended)
        self._tasks.append(task)
        return task

    def _background_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        # Only while serve runs: a task that fails as it is cancelled at the wind-down must
        # not cut the wind-down short (its teardown, the liveness key's removal).
        if self._ended_by is None and self._serving_now:
            self._ended_by = exc
            if self._main is not None and not self._main.done():
                self._main.cancel()

    @property
    def worker(self) -> ThreadPoolExecutor:
        """The component's one worker thread: heavy work (updates, generation, serialisation,
        checkpoint I/O) and every torch.profiler call run there, in call order."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-work")
        return self._worker

    def submit(self, fn: Callable[[*Args], T], *args: *Args) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` on the worker now, in call order, without waiting for it."""
        return asyncio.get_running_loop().run_in_executor(self.worker,
                                                          functools.partial(fn, *args))

    async def off(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run blocking work on the worker thread: the loop stays free for the pulse."""
        return await self.submit(functools.partial(fn, *args, **kwargs))

    async def publish(self, *events: Event) -> None:
        """Append events to this role's stream of the run's log (one round trip)."""
        if events:
            await self.bus.publish_many(self.keys.log(self.role), list(events),
                                        maxlen=ROLE_LOG_MAXLEN)

    async def read_commands(self) -> list[Command]:
        """New profiling commands on the run's control stream (one non-blocking XREAD)."""
        entries, self._control_last = await self.bus.read_after(
            self.keys.control, self._control_last, count=1000)
        return [msg for _, msg in entries if isinstance(msg, StartProfile | StopProfile)]

    async def apply_commands(self) -> None:
        """Hand the new profiling commands to the profiler agent (with profiling on)."""
        if self.profiler is not None:
            await self.publish(*self.profiler.on_commands(await self.read_commands()))

    # ------------------------------------------------------------------ lifecycle

    async def _pulse_step(self) -> None:
        await self._keep_claim()
        await self.on_pulse()
        if self.profiler is not None:  # traces written beside the steps since the last pulse
            await self.publish(*self.profiler.exported())
        position = self.kept_position()
        if position is not None and position != "0":
            await self.bus.set_position(self.keys.position(self.name), position)

    async def _keep_claim(self) -> None:
        """Refresh the rank claim; lost to another process, end :meth:`serve` (the pulse
        stops too: the rank's liveness key is the new holder's now)."""
        if self.claim is None:
            return
        try:
            await self.claim.check()
        except RankLost as exc:
            self._lost = ClaimLost(str(exc))
            raise self._lost from None  # it ends the pulse's task, and so the component

    async def run(self) -> int:
        """The whole life of the component; returns the exit code."""
        self._main = asyncio.current_task()
        try:
            await self.setup()
        except Failure as exc:
            self.say(str(exc), error=True)
            return exc.code
        # A process that did not run (SIGSTOP, a frozen VM) may have lost its rank or lease
        # meanwhile: the pulse re-checks it at once (ClaimLost, or the trainer fenced out)
        # rather than an interval later, after the work it woke into.
        self.bus.on_pause = self._paused
        hb = self.cfg.heartbeat
        self.spawn(pulse_forever(self.bus, self.keys.alive(self.role, self.rank), self.heartbeat,
                                 hb.interval_s, hb.timeout_s, before=self._pulse_step,
                                 wake=self._pulse_now), "pulse")
        try:
            return await self._serving()
        except Failure as exc:
            return await self._failed(exc)
        except (BusRefusedWrite, BusPermissionError) as exc:
            # Redis refused a write for its own state (memory, disk) or the ACL a right: the
            # bus's one line says which; nothing here can mend it.
            return await self._failed(Failure(str(exc)))
        except OSError as exc:
            from runtime.faults import disk_full  # it imports this module

            full = disk_full(exc, exc.filename or os.getcwd(), "a file")
            if full is None:
                raise
            return await self._failed(full)
        except Fenced as exc:  # a fenced write of a background task (the trainer's)
            self.say(f"fenced out: {exc}", error=True)
            return 1
        finally:
            await self._wind_down()

    async def _serving(self) -> int:
        """:meth:`serve`; cancelled by a background task that ended with an error (the
        pulse's when the rank claim was lost), that error instead."""
        self._serving_now = True
        try:
            return await self.serve()
        except asyncio.CancelledError:
            if self._ended_by is None or self._main is None:
                raise
            self._main.uncancel()  # not a stop signal
            raise self._ended_by from None
        finally:
            self._serving_now = False

    def _paused(self, seconds: float) -> None:
        """The bus's watchdog: this process did not run for ``seconds``. One line, and the
        pulse at once (the claim re-checked, the lease renewed)."""
        held = "its rank claim" if self.claim is not None else "what it holds"
        self.say(f"this process did not run for {seconds:.1f} s (stopped or frozen; not "
                 f"Redis's silence): re-checking {held} before going on", error=True)
        self.pulse_now()

    async def _failed(self, exc: Failure) -> int:
        """A named failure: one line, a ComponentFailed event (if it may be written), its
        exit code."""
        self._said = exc
        self.say(str(exc), error=True)
        if exc.publish:
            with contextlib.suppress(Exception):
                await self.publish(ComponentFailed(role=self.role, rank=self.rank,
                                                   error=str(exc)))
        return exc.code

    async def _wind_down(self) -> None:
        """Background tasks first (the pulse last: closing the agent can take a while), the
        agent, the component's teardown, the worker, the liveness key."""
        pulse, *others = self._tasks
        for task in reversed(others):
            await _cancelled(task)
        if self.profiler is not None:
            with contextlib.suppress(Exception):
                await self.publish(*(await self.profiler.close()))
            self.profiler = None
        await _cancelled(pulse)
        try:
            await self.teardown()
        except BusError:
            # After a failure said in its one line (Redis out of memory, unreachable, a
            # refused right), the teardown's writes meet the same cause: said once.
            if self._said is None:
                raise
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=False, cancel_futures=True)
            # Redis may be what failed, or the user may lack DEL: the key lapses by itself.
            # A lost rank's liveness key is its new holder's: left alone.
            with contextlib.suppress(Exception):
                if self._lost is None:
                    await asyncio.wait_for(
                        self.bus.delete(self.keys.alive(self.role, self.rank)),
                        ALIVE_DELETE_TIMEOUT_S)


async def _cancelled(task: asyncio.Task[object]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
