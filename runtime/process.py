"""The entry point every component process shares: ``rlbus ROLE`` and ``python -m ROLE`` are
this one code path.

:func:`main` validates the whole config (exit 2 naming the key), checks the keys a component
needs (``redis.url``, ``run.id``), turns the garbage collector off for a component whose
start-up builds a large heap (it is turned back on, frozen, by :func:`runtime.settle_heap`),
sets up logging, reaches Redis (an unreachable server is one line and exit 1, never a
traceback), starts the progress lines (:mod:`runtime.progress`) and runs the component on a fresh
event loop with the stop signals wired to it (:class:`runtime.Component`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

from runconfig import Config, ConfigError, load_or_exit
from runtime.storage import check_storage

if TYPE_CHECKING:
    from bus import Bus, RankClaim
    from runtime.component import Component

__all__ = ["CLOSE_TIMEOUT_S", "entry_point", "expand_or_fail", "expanded_url", "main"]

CLOSE_TIMEOUT_S = 5.0
"""Bound on closing the Redis client at exit."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_DUMP_SIGNAL = signal.SIGUSR1
"""``kill -USR1 PID``: the process writes every asyncio task's stack to stderr and goes on
(what a component that stopped making progress is waiting on; a thread's stack is what
``py-spy dump`` shows)."""

def expand_or_fail(url: str) -> str:
    """``url`` with ``${VAR}`` expanded (the placeholder stays in configs, logs and the run's
    RunStarted event; only the connection sees the password); an unset variable is a
    ConfigError on redis.url."""
    from bus import expand_env, redact_url

    try:
        return expand_env(url)
    except KeyError as exc:
        raise ConfigError(
            "redis.url", f"environment variable {exc.args[0]} (named in {redact_url(url)}) "
            "is not set"
        ) from None


def expanded_url(cfg: Config) -> str | None:
    """``cfg.redis.url`` ready to connect with (None when it is not set); in its cluster form
    (``redis+cluster://``) when ``redis.cluster`` is true."""
    from bus import as_cluster_url

    if cfg.redis.url is None:
        return None
    url = expand_or_fail(cfg.redis.url)
    return as_cluster_url(url) if cfg.redis.cluster else url


def _required(cfg: Config, prog: str) -> int | None:
    for key, value in (("redis.url", cfg.redis.url), ("run.id", cfg.run.id)):
        if not value:
            print(f"{prog}: error: invalid config key '{key}': required for a component "
                  "(rlbus up sets it for you)", file=sys.stderr, flush=True)
            return 2
    return None


def _storage(cfg: Config, role: str, prog: str) -> int | None:
    """The run's storage can be read (and by the trainer written): else exit 2 naming it."""
    why = check_storage(cfg, role)
    if why is None:
        return None
    print(f"{prog}: error: {why}", file=sys.stderr, flush=True)
    return 2


def _logging(prog: str, package: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"{prog}: %(message)s", stream=sys.stderr,
                        force=True)
    logging.getLogger(package).setLevel(logging.INFO)


def main(
    role: str,
    load: Callable[[], Callable[..., Component]],
    argv: Sequence[str] | None = None,
    *,
    heavy: bool = False,
    precheck: Callable[[Config, str], int | None] | None = None,
    divert: Callable[[Config], int | None] | None = None,
) -> int:
    """Run one component process; returns its exit code.

    ``load()`` imports and returns the component class (``cls(cfg, bus)``), only after the
    config is valid and, for a ``heavy`` component, the collector is off. ``precheck(cfg,
    prog)`` may end the process before Redis is contacted (an exit code) or let it go on
    (None). ``divert(cfg)`` may run the process as something else than the component
    (an exit code: a trainer node without rank 0, trainer.rank), before any check."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Until the event loop answers it (and after), a dump request is not a kill.
    with contextlib.suppress(ValueError):  # not the main thread: not ours to set
        signal.signal(_DUMP_SIGNAL, signal.SIG_IGN)
    prog = role
    cfg = load_or_exit(args, prog)
    if divert is not None and (diverted := divert(cfg)) is not None:
        return diverted
    if role == "rollouter":  # a rollouter without a rank gets one at join (_serve)
        prog = f"rollouter{'' if cfg.rollout.rank is None else cfg.rollout.rank}"
    code = _required(cfg, prog)
    if code is None and precheck is not None:
        code = precheck(cfg, prog)
    if code is None:
        code = _storage(cfg, role, prog)
    if code is not None:
        return code
    if heavy:
        # Start-up builds ~300 000 objects that live as long as the process (torch, the model,
        # the trainer's optimizer): the collector's full passes over them free nothing and
        # cost ~0.35 s before the first step. settle_heap turns it back on once built.
        gc.disable()
    try:
        url = expanded_url(cfg) or ""
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    component = load()
    _logging(prog, component.__module__.split(".")[0])
    atexit.register(_quiet_native_teardown)
    try:
        return asyncio.run(_serve(cfg, url, prog, component))
    finally:
        _STOP_DEADLINE.disarm()  # stopped in time (or never signalled)


def _quiet_native_teardown() -> None:
    """At exit, once the component has said everything (atexit: after its last line, before
    the interpreter's native teardown). Where triton is installed (with vLLM, and on every
    GPU machine) torch's optimizers import it, and its nanobind bindings print ~30 lines of
    ``nanobind: leaked ...`` at every interpreter exit: noise that buried a component's last
    lines, its failure among them, in its log and in what ``rlbus up`` shows. Standard error
    is closed to what follows only then."""
    if "triton" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


class ComponentMain(Protocol):
    """A component package's ``main``: runs it with ``argv`` (None: ``sys.argv[1:]``)."""

    def __call__(self, argv: Sequence[str] | None = None) -> int: ...


def entry_point(role: str, module: str, name: str, *, heavy: bool = False,
                precheck: Callable[[Config, str], int | None] | None = None,
                divert: Callable[[Config], int | None] | None = None,
                ) -> ComponentMain:
    """A component package's ``main(argv)``: :func:`main` for the class ``name`` of
    ``module``, imported (with torch) only once the config is valid (and ``precheck``
    passed)."""

    def load() -> Callable[..., Component]:
        component: Callable[..., Component] = getattr(importlib.import_module(module), name)
        return component

    def component_main(argv: Sequence[str] | None = None) -> int:
        return main(role, load, argv, heavy=heavy, precheck=precheck, divert=divert)

    component_main.__doc__ = (f"``rlbus {role}`` / ``python -m {module.split('.')[0]}``; "
                              "returns the exit code.")
    return component_main


async def _serve(cfg: Config, url: str, prog: str, factory: Callable[..., Component]) -> int:
    from bus import (
        Bus,
        BusAuthError,
        BusClusterError,
        BusUnavailable,
        RetryPolicy,
        RunKeys,
        bus_error_line,
    )
    from runtime.progress import ProgressSpec, ProgressThread

    retry = RetryPolicy(budget_s=cfg.redis.give_up_s)
    bus = Bus.from_url(url, retry=retry, client_name=f"rlbus-{prog}-{cfg.run.id}")
    if cfg.run.id:  # on a cluster, TIME and INFO ask the master holding the run's keys
        bus.home_key = RunKeys(cfg.run.id).events
    progress: ProgressThread | None = None
    claim: RankClaim | None = None
    try:
        # One line if Redis cannot be reached, before the component builds anything.
        await bus.ping()
        joined = await _join(cfg, bus, prog, factory)
        if isinstance(joined, int):
            return joined
        cfg, claim = joined
        if claim is not None:  # a rollouter started without a rank has one now
            prog = f"{claim.role}{claim.rank}"
            for handler in logging.getLogger().handlers:
                handler.setFormatter(logging.Formatter(f"{prog}: %(message)s"))
        progress = ProgressThread(url, ProgressSpec(
            cfg.run.id or "", cfg.trainer.total_training_steps, prog,
            cfg.run.progress_interval_s), retry=retry).start()
        return await _run_restarting(cfg, bus, prog, factory, claim)
    except (BusUnavailable, BusAuthError) as exc:
        print(bus_error_line(prog, exc), file=sys.stderr, flush=True)
        return 1
    except BusClusterError as exc:  # a config error: the URL's form, not the server's state
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if progress is not None:
            progress.stop()
        if claim is not None:  # a clean stop frees the rank at once; a crash lets it lapse
            with contextlib.suppress(Exception):
                await asyncio.wait_for(claim.release(), CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), CLOSE_TIMEOUT_S)


async def _join(cfg: Config, bus: Bus, prog: str, factory: Callable[..., Component],
                ) -> tuple[Config, RankClaim | None] | int:
    """The component's :meth:`~runtime.Component.join` (a rollouter's rank claimed): the
    config to build with and the claim, or the exit code of a named failure."""
    from runtime.component import Failure

    join = getattr(factory, "join", None)
    if join is None:
        return cfg, None
    try:
        joined: tuple[Config, RankClaim | None] = await join(cfg, bus)
    except Failure as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    return joined


async def _run_restarting(cfg: Config, bus: Bus, prog: str,
                          factory: Callable[..., Component],
                          claim: RankClaim | None = None) -> int:
    """A fresh component after each :class:`runtime.Restart`, a bounded number of times in
    a row: one that progressed before its restart starts the count again."""
    from runtime.component import Restart

    restarts = 0
    while True:
        component = factory(cfg, bus)
        component.claim = claim
        try:
            return await _run_until_stopped(component, prog, cfg.run.stop_grace_s / 2)
        except Restart as exc:
            if component.progressed:  # only restarts with no progress between count
                restarts = 0
            if restarts >= component.max_restarts:
                print(f"{prog}: {exc}; started over {restarts} time(s) already: giving up",
                      file=sys.stderr, flush=True)
                return 1
            restarts += 1
            print(f"{prog}: {exc}; {component.restart_says} ({restarts}/{component.max_restarts})",
                  file=sys.stderr, flush=True)


class _StopDeadline:
    """The forced part of a stop: armed by the first stop signal, it ends the process
    ``run.stop_grace_s`` later if it is still there (exit 143, one line). ``rlbus up``
    SIGKILLs a child after that grace too, but a child whose launcher died (kill -9: Linux
    SIGTERMs it, PR_SET_PDEATHSIG) has nobody to do it, and its graceful part may be waiting
    on a Redis that went with the launcher or that does not answer. A thread, not the event
    loop: the loop may be what is stuck (a blocking call, a worker the loop's exit joins)."""

    def __init__(self) -> None:
        self._timer: threading.Timer | None = None

    def arm(self, seconds: float, prog: str) -> None:
        if self._timer is not None:
            return
        self._timer = threading.Timer(seconds, self._force, (seconds, prog))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @staticmethod
    def _force(seconds: float, prog: str) -> None:
        with contextlib.suppress(Exception):
            print(f"{prog}: still stopping {seconds:g} s after the signal (run.stop_grace_s): "
                  "forced", file=sys.stderr, flush=True)
            sys.stdout.flush()
        os._exit(143)


_STOP_DEADLINE = _StopDeadline()


async def _run_until_stopped(component: Component, prog: str, drain_s: float) -> int:
    """``component.run()`` with the stop signals wired to it: the first sets its
    ``stopping`` event (and cancels it when it stops at once, or after ``drain_s``) and arms
    the forced stop (:class:`_StopDeadline`, ``2 * drain_s``: run.stop_grace_s), a second
    cancels it. Cancelled by a signal: exit code 143."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    forced: list[asyncio.TimerHandle] = []

    def on_signal() -> None:
        _STOP_DEADLINE.arm(2 * drain_s, prog)
        if component.stopping.is_set() or component.cancel_on_stop:
            task.cancel()  # every `finally` runs: traces written, ProfileStopped sent
        else:
            forced.append(loop.call_later(drain_s, task.cancel))
        component.stopping.set()

    for sig in _SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(_DUMP_SIGNAL, dump_tasks, prog)
    try:
        return await component.run()
    except asyncio.CancelledError:
        print(f"{prog}: stopped by signal", file=sys.stderr, flush=True)
        return 143
    finally:
        for handle in forced:
            handle.cancel()
        for sig in (*_SIGNALS, _DUMP_SIGNAL):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(ValueError):
            signal.signal(_DUMP_SIGNAL, signal.SIG_IGN)


def dump_tasks(prog: str, file: TextIO | None = None) -> None:
    """Write every task of the running loop with the chain of awaits it is suspended in
    (``file``: stderr), then go on: the answer to "what is this process waiting on" for a
    live one. (``Task.print_stack`` shows only a suspended task's outermost frame.)"""
    out = sys.stderr if file is None else file
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    print(f"{prog}: {len(tasks)} asyncio task(s) (SIGUSR1):", file=out)
    for task in tasks:
        print(f"  {task.get_name()}:", file=out)
        for line in awaiting(task.get_coro()):
            print(f"    {line}", file=out)
    out.flush()


def awaiting(coro: object, limit: int = 40) -> list[str]:
    """Where a suspended coroutine waits: its frame, then that of what it awaits, down the
    ``cr_await`` / ``gi_yieldfrom`` chain to the innermost (a future, a sleep)."""
    lines: list[str] = []
    while coro is not None and len(lines) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(repr(coro)[:200])  # a future, or a finished coroutine
            break
        code = frame.f_code
        lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines
