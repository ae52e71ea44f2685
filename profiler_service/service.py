"""The profiler service process: follows a run's log, publishes what :func:`decide` says.

Life of the service (``python -m profiler_service`` / ``rlbus profiler``):

1. Read the run's control stream and events stream from their beginnings (either may not
   exist yet). This is all the state there is: a restarted service knows from the log what
   it already published, so it never publishes it twice.
2. Follow the events stream. After every batch of new entries read the run's step barrier,
   call :func:`~profiler_service.schedule.decide` on the whole log and the barrier, and
   publish its output in order: commands (StartProfile) to the control stream, events
   (ProfilerReady, ProfileRequestRefused, ProfilerFinished) to the events stream. A runtime
   request's StartProfile is published guarded by the barrier (refused once the trainer
   let its first step begin; then decide again). Keep ``manifest.json`` up to date.
   Publish a Heartbeat (role ``profiler``) every ``heartbeat.interval_s`` once the events
   stream exists (never creating it: that is the trainer's job).
3. After RunFinished, wait up to ``global_profiler.handshake_timeout_s`` for the sessions
   still expected to stop; then publish a WarningRaised naming the missing ones (so the log
   says why), which lets ``decide`` finish.
4. On ProfilerFinished: write the final manifest, run ``finish_hook_cmd`` (local config only)
   once, publish ProfilerFinished with its exit code, exit 0. A hook that already ran (its
   marker file says so, or ProfilerFinished is in the log) is never run again.

SIGTERM/SIGINT end it cleanly (exit 0). Garbage entries are skipped (logged by the bus).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from bus import (
    Bus,
    BusError,
    Command,
    Entry,
    Event,
    Heartbeat,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    RunKeys,
    RunStarted,
    StartProfile,
    StepStarted,
    StopProfile,
    WarningRaised,
)
from profiler_service.manifest import build_manifest, manifest_file, profile_dir, write_manifest
from profiler_service.schedule import (
    PROFILER_SOURCE,
    SESSIONS_MISSING_CODE,
    decide,
    fold_log,
    outstanding_targets,
)
from runconfig.schema import Config

__all__ = [
    "HOOK_INTERRUPTED_CODE",
    "HOOK_MARKER_NAME",
    "HOOK_TIMEOUT_S",
    "ProfilerService",
    "serve",
]

log = logging.getLogger("profiler_service")

HOOK_MARKER_NAME = ".finish_hook.json"
"""Marker in ``save_path/RUN`` recording that the finish hook started and how it ended, so a
service that crashes between running the hook and publishing ProfilerFinished does not run
it a second time."""

HOOK_INTERRUPTED_CODE = "finish_hook_interrupted"
"""WarningRaised code: the hook's marker says it started but never ended (the service died)."""

HOOK_TIMEOUT_S = 600.0
"""Longest a finish hook may run before it is killed (its exit code is then recorded as -9)."""

WAIT_SLICE_S = 0.5
"""Longest single wait of the main loop (SIGTERM and timers are noticed at least this often)."""

WAITING_LOG_EVERY_S = 30.0
"""How often a service waiting for a run that has not started says so."""

READ_COUNT = 500

GUARD_ATTEMPTS = 5
"""Decisions in a row one turn of the loop makes when the step barrier refuses a guarded
StartProfile (each one re-reads the barrier first, so a second refusal needs the trainer to
cross another step boundary in between)."""

_KEPT = (
    RunStarted,
    StepStarted,
    RunFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    ProfilerFinished,
    ProfileRequest,
    ProfileRequestRefused,
    WarningRaised,
    StartProfile,
    StopProfile,
)
"""Message types the decisions and the manifest depend on; the rest (heartbeats, samples'
announcements, metrics) is not kept in memory."""


class ProfilerService:
    """One service instance for run ``cfg.run.id`` on ``bus``; :meth:`run` does the work."""

    def __init__(self, cfg: Config, bus: Bus) -> None:
        if cfg.run.id is None:
            raise ValueError("the profiler service needs run.id")
        self.cfg = cfg
        self.bus = bus
        self.keys = RunKeys(cfg.run.id)
        self.profile_dir = profile_dir(cfg)
        self.manifest_path = manifest_file(cfg)
        self.log: list[Event | Command] = []
        """Everything relevant seen on both streams (our own output included), log order."""
        self._own_event_ids: set[str] = set()
        self._events_cursor = "0"
        self._events_exist = False
        self._give_up_at: float | None = None
        self._next_heartbeat = 0.0
        self._dirty = True  # the log changed since the last decision

    # ------------------------------------------------------------------ reading

    def _keep(self, entry: Entry) -> None:
        if isinstance(entry.msg, _KEPT):
            self.log.append(entry.msg)  # type: ignore[arg-type]
            self._dirty = True

    async def _catch_up(self) -> None:
        """Read both streams from their beginnings: the state a restarted service resumes."""
        async for entry in self.bus.read_all(self.keys.control, count=READ_COUNT):
            self._keep(entry)
        async for entry in self.bus.read_all(self.keys.events, count=READ_COUNT):
            self._events_cursor = entry.id
            self._events_exist = True
            self._keep(entry)
        # A stream that holds only garbage still exists; read_all skipped those entries.
        if not self._events_exist and await self.bus.exists(self.keys.events):
            self._events_exist = True

    async def _follow(self, queue: asyncio.Queue[Entry], stop: asyncio.Event) -> None:
        """Background: new events entries into ``queue`` (XREAD BLOCK, bounded waits)."""
        block_ms = int(WAIT_SLICE_S * 1000)
        async for entry in self.bus.tail(
            self.keys.events, self._events_cursor, block_ms=block_ms, count=READ_COUNT, stop=stop
        ):
            await queue.put(entry)

    # ------------------------------------------------------------------ publishing

    async def _publish(self, msg: Command | Event) -> None:
        """Publish one decision (restamped with the current time) and remember it."""
        msg = msgspec.structs.replace(msg, ts=time.time())
        if isinstance(msg, StartProfile | StopProfile):
            await self.bus.publish(self.keys.control, msg)
        else:
            entry_id = await self.bus.publish(self.keys.events, msg)
            self._own_event_ids.add(entry_id)
        self.log.append(msg)
        self._dirty = True
        log.info("published %s", _describe(msg))

    async def _heartbeat(self, now: float) -> None:
        if not self._events_exist or now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.cfg.heartbeat.interval_s
        view = fold_log(self.log)
        state = "waiting for RunStarted" if view.run_started is None else "following"
        if view.run_finished is not None:
            state = "finishing"
        await self.bus.publish(
            self.keys.events,
            Heartbeat(role=PROFILER_SOURCE, rank=0, pid=os.getpid(), state=state),
        )

    # ------------------------------------------------------------------ finishing

    def _write_manifest(self, final: bool = False) -> None:
        if self.cfg.global_profiler.tool is None or fold_log(self.log).run_started is None:
            return  # nothing to describe: do not create folders for a run that is not profiled
        manifest = build_manifest(self.keys.run_id, self.log, final=final)
        if write_manifest(self.manifest_path, manifest):
            log.info("manifest %s: %d entries", self.manifest_path, len(manifest["sessions"]))

    async def _run_hook_once(self) -> int | None:
        """Run ``finish_hook_cmd`` unless a marker says it already ran; its exit code."""
        cmd = self.cfg.global_profiler.finish_hook_cmd
        if not cmd:
            return None
        marker = self.profile_dir / HOOK_MARKER_NAME
        previous = _read_marker(marker)
        if previous is not None:
            rc = previous.get("rc")
            if isinstance(rc, int):
                log.info("finish hook already ran (exit code %d); not running it again", rc)
                return rc
            message = (
                "the finish hook was started by an earlier profiler service that died before "
                "it ended; not running it a second time (at most once)"
            )
            log.warning("%s", message)
            await self._publish(
                WarningRaised(
                    source=PROFILER_SOURCE, code=HOOK_INTERRUPTED_CODE, message=message
                )
            )
            return None
        started = time.time()
        _write_marker(marker, {"started": started})
        env = {
            **os.environ,
            "RLBUS_RUN_ID": self.keys.run_id,
            "RLBUS_PROFILE_DIR": str(self.profile_dir.resolve()),
            "RLBUS_MANIFEST": str(self.manifest_path.resolve()),
        }
        log.info("running finish hook: %s", cmd)
        # The command comes from this process's own config file, never from a message.
        proc = await asyncio.create_subprocess_shell(cmd, env=env)
        try:
            rc = await asyncio.wait_for(proc.wait(), HOOK_TIMEOUT_S)
        except TimeoutError:
            log.error("finish hook ran over %.0f s; killing it", HOOK_TIMEOUT_S)
            proc.kill()
            rc = await proc.wait()
        _write_marker(marker, {"started": started, "rc": rc})
        log.info("finish hook exited with code %d", rc)
        return rc

    async def _finish(self, template: ProfilerFinished) -> None:
        self._write_manifest(final=True)
        hook_rc = await self._run_hook_once()
        await self._publish(
            msgspec.structs.replace(
                template, manifest_path=str(self.manifest_path.resolve()), hook_rc=hook_rc
            )
        )

    async def _check_give_up(self, now: float) -> None:
        """After RunFinished, bound the wait for the last ProfileStopped events."""
        view = fold_log(self.log)
        if view.run_finished is None or view.profiler_finished or view.gave_up_waiting:
            self._give_up_at = None
            return
        missing = outstanding_targets(view)
        if not missing:
            return
        if self._give_up_at is None:
            grace = self.cfg.global_profiler.handshake_timeout_s
            self._give_up_at = now + grace
            log.info("run finished; waiting up to %.0f s for %d session(s) to stop",
                     grace, len(missing))
            return
        if now < self._give_up_at:
            return
        names = ", ".join(f"{role}{rank}:{sid}" for sid, role, rank in missing[:20])
        await self._publish(
            WarningRaised(
                source=PROFILER_SOURCE,
                code=SESSIONS_MISSING_CODE,
                message=f"no ProfileStopped within "
                f"{self.cfg.global_profiler.handshake_timeout_s:g} s of RunFinished from "
                f"{names}{' ...' if len(missing) > 20 else ''}; marked missing in the manifest",
            )
        )

    # ------------------------------------------------------------------ the loop

    async def _step(self) -> None:
        """Publish whatever the log now calls for, and refresh the manifest.

        Runtime-request StartProfile commands go out guarded by the run's step barrier
        (:meth:`_publish_request`). When the guard refuses one (the trainer crossed a step
        boundary between our GET of the barrier and the publish), decide again with the
        barrier read anew: ``next:N`` moves on to the steps after it, explicit steps that
        have begun are refused with a reason. After :data:`GUARD_ATTEMPTS` refusals in a row
        the log stays dirty and the next turn of the loop tries again.
        """
        if not self._dirty:
            return
        self._dirty = False
        for _ in range(GUARD_ATTEMPTS):
            barrier = await self.bus.get_barrier(self.keys.barrier)
            if await self._publish_decisions(barrier):
                break
        else:
            log.info("step barrier kept moving under %d guarded publishes; retrying",
                     GUARD_ATTEMPTS)
            self._dirty = True
        self._write_manifest()

    async def _publish_decisions(self, barrier: int) -> bool:
        """Publish :func:`decide`'s output in order; False if a guarded command was refused
        (the rest is left for the next decision)."""
        for msg in decide(self.cfg.global_profiler, self.log, barrier):
            if isinstance(msg, ProfilerFinished):
                await self._finish(msg)
            elif isinstance(msg, StartProfile) and msg.request_id:
                if not await self._publish_request(msg):
                    return False
            else:
                await self._publish(msg)
        return True

    async def _publish_request(self, cmd: StartProfile) -> bool:
        """Publish a runtime request's StartProfile only while the trainer has not begun
        its first step (barrier < first_step, checked and written atomically); True if it
        is now in the control stream.

        Scheduled sessions need no guard: they all go out at RunStarted, before the
        trainer publishes weights version 0 (and raises the barrier to 1).
        """
        cmd = msgspec.structs.replace(cmd, ts=time.time())
        entry_id = await self.bus.publish_guarded(
            self.keys.control, cmd, self.keys.barrier, cmd.first_step
        )
        if entry_id is None:
            # A retried call whose reply was lost may have landed before the barrier moved.
            landed = await self._find_answer(cmd.request_id)
            if landed is None:
                log.info("StartProfile %s refused by the step barrier (step %d has begun); "
                         "deciding again", cmd.session_id, cmd.first_step)
                return False
            cmd = landed
        self.log.append(cmd)
        self._dirty = True
        log.info("published %s", _describe(cmd))
        return True

    async def _find_answer(self, request_id: str) -> StartProfile | None:
        """The StartProfile answering ``request_id`` already in the control stream, if any."""
        async for entry in self.bus.read_all(self.keys.control, count=READ_COUNT):
            msg = entry.msg
            if isinstance(msg, StartProfile) and msg.request_id == request_id:
                return msg
        return None

    def _done(self) -> bool:
        view = fold_log(self.log)
        if view.run_finished is None:
            return False
        return view.profiler_finished or self.cfg.global_profiler.tool is None

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until the run finished (0), ``stop`` is set (0) or Redis fails (1)."""
        if self.cfg.global_profiler.tool is None:
            log.info("global_profiler.tool is null: profiling is off; refusing runtime requests")
        await self._catch_up()
        log.info("run %s: read %d relevant entries from the log", self.keys.run_id, len(self.log))
        queue: asyncio.Queue[Entry] = asyncio.Queue()
        follower = asyncio.create_task(self._follow(queue, stop), name="follow-events")
        last_waiting_log = time.monotonic()
        try:
            while not stop.is_set():
                await self._step()
                if self._done():
                    log.info("run %s finished; profiler service done", self.keys.run_id)
                    return 0
                now = time.monotonic()
                await self._check_give_up(now)
                await self._heartbeat(now)
                if follower.done():
                    follower.result()  # re-raise what ended it (BusUnavailable, ...)
                    return 0  # it ends without error only when stop is set
                if not self._events_exist and now - last_waiting_log >= WAITING_LOG_EVERY_S:
                    last_waiting_log = now
                    log.info("waiting for run %s to start (no events at %s yet)",
                             self.keys.run_id, self.bus.url)
                await self._drain(queue, stop)
            log.info("stopped by signal")
            return 0
        finally:
            stop.set()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await follower

    async def _drain(self, queue: asyncio.Queue[Entry], stop: asyncio.Event) -> None:
        """Wait (bounded) for new entries, then take every one already queued."""
        timeout = WAIT_SLICE_S
        if self._give_up_at is not None:
            timeout = max(0.0, min(timeout, self._give_up_at - time.monotonic()))
        got: list[Entry] = []
        with contextlib.suppress(TimeoutError):
            got.append(await asyncio.wait_for(queue.get(), timeout))
        while not queue.empty():
            got.append(queue.get_nowait())
        for entry in got:
            self._events_exist = True
            if entry.id in self._own_event_ids:
                self._own_event_ids.discard(entry.id)  # ours: already in the log
                continue
            self._keep(entry)


def _describe(msg: Command | Event) -> str:
    match msg:
        case StartProfile():
            extra = f" for request {msg.request_id}" if msg.request_id else ""
            return (f"StartProfile {msg.session_id} steps {msg.first_step}-{msg.last_step} "
                    f"on {','.join(msg.roles)}{extra}")
        case ProfilerReady():
            return f"ProfilerReady ({len(msg.session_ids)} session(s))"
        case ProfileRequestRefused():
            return f"ProfileRequestRefused {msg.request_id}: {msg.reason}"
        case ProfilerFinished():
            return f"ProfilerFinished ({msg.sessions} session(s), hook rc {msg.hook_rc})"
        case WarningRaised():
            return f"WarningRaised {msg.code}: {msg.message}"
        case _:
            return type(msg).__name__


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: something ran; do not run the hook again
    return data if isinstance(data, dict) else {}


def _write_marker(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


async def serve(cfg: Config) -> int:
    """Run the service for ``cfg`` (``redis.url`` and ``run.id`` set); the exit code.

    SIGTERM and SIGINT stop it cleanly (exit code 0).
    """
    if cfg.redis.url is None or cfg.run.id is None:
        raise ValueError("serve needs redis.url and run.id")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    bus = Bus.from_url(cfg.redis.url, client_name=f"rlbus-profiler-{cfg.run.id}")
    try:
        return await ProfilerService(cfg, bus).run(stop)
    except BusError as exc:
        log.error("%s", exc)
        return 1
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await bus.close()
