"""The profiler service process: follows a run's log, publishes what :func:`decide` says.

Life of the service (``python -m profiler_service`` / ``rlbus profiler``):

1. Fold the run's control stream and events stream into its state
   (:mod:`profiler_service.state`: ``state = apply(state, entry)``, one entry at a time;
   either stream may not exist yet). That state is all there is: a restarted service knows
   from the log what it already published, so it never publishes it twice. It starts from
   the snapshot it keeps next to the manifest when there is one (the folded state and the
   id of the last events entry in it), so a restart reads only the log after that position;
   a snapshot the log does not confirm (its position is not in the stream: a lost tail,
   another run with the same id) is ignored and the whole log is folded: the events archive
   (``run.output_dir/RUN/events``, what retention trimmed) and then the stream. The
   snapshot's position is stored in ``RunKeys.position("profiler")``: the trainer's events
   trim never passes it while this service is alive.
2. Follow the events stream, folding each new entry (the entries themselves are not kept).
   After a batch that changed the state, read the run's step barrier (and, when a runtime
   request is waiting, Redis's clock), call :func:`~profiler_service.schedule.decide` on the
   state, and publish its output in order: commands (StartProfile) to the control stream,
   events (ProfilerReady, ProfileRequestRefused, ProfilerFinished) to the events stream. A
   runtime request's StartProfile is published guarded by the barrier (refused once the
   trainer let its first step begin; then decide again); a request older than its own
   timeout is refused, never served. Keep ``manifest.json`` up to date (at most every
   :data:`MANIFEST_EVERY_S`, written on a worker thread), after checking, on a worker thread,
   the trace file each new ``ok`` ProfileStopped names (a missing one is marked so and
   warned about once). Reports for sessions it never sent are ignored and logged.
   The service runs on the component runtime (:class:`runtime.Component`): from start to
   exit it says "alive" on ``RunKeys.alive("profiler", 0)`` from a task that nothing on the
   loop blocks (file writes run on threads, the hook is an asyncio subprocess), and it reads
   the log through one :class:`runtime.Follower`.
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
import logging
import os
import time
from collections.abc import Sequence

import msgspec

from bus import LOG_ROLES, ROLE_LOG_MAXLEN, Bus, Entry
from profiler_service.files import SNAPSHOT_NAME, ServiceFiles
from profiler_service.finish import HOOK_INTERRUPTED_CODE, HOOK_MARKER_NAME, FinishHook
from profiler_service.manifest import (
    check_traces,
    trace_warning,
)
from profiler_service.records import PROFILER_SOURCE, SESSIONS_MISSING_CODE, Fact, ServiceState
from profiler_service.schedule import decide, outstanding_targets
from profiler_service.snapshot import Snapshot
from profiler_service.state import apply, report_refusal, run_finished_doubt, unchecked_stops
from profiling.hook import hook_env
from runconfig.paths import events_dir
from runconfig.schema import Config
from runschema.messages import (
    Command,
    Event,
    Heartbeat,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    StartProfile,
    StopProfile,
    WarningRaised,
)
from runtime import Component, LogFollower
from runtime.events_archive import fetch_for_reading
from runtime.history import find_archive
from storage.run_storage import StorageError

__all__ = [
    "SNAPSHOT_NAME",
    "ProfilerService",
]

log = logging.getLogger("profiler_service")

WAIT_SLICE_S = 0.5
"""Longest single wait of the main loop (SIGTERM and timers are noticed at least this often)."""

WAITING_LOG_EVERY_S = 30.0
"""How often a service waiting for a run that has not started says so."""

READ_COUNT = 500

GUARD_ATTEMPTS = 5
"""Decisions in a row one turn of the loop makes when the step barrier refuses a guarded
StartProfile (each one re-reads the barrier first, so a second refusal needs the trainer to
cross another step boundary in between)."""


class ProfilerService(Component):
    """One service instance for run ``cfg.run.id`` on ``bus``; :meth:`run` does the work.
    A stop signal ends it cleanly: files written, exit 0."""

    role = PROFILER_SOURCE
    cancel_on_stop = False

    def __init__(self, cfg: Config, bus: Bus) -> None:
        if cfg.run.id is None:
            raise ValueError("the profiler service needs run.id")
        super().__init__(cfg, bus)
        self.files = ServiceFiles(cfg, bus, self.keys)
        self.profile_dir = self.files.profile_dir
        self.manifest_path = self.files.manifest_path
        self.state = ServiceState()
        """Everything seen on both streams (our own output included), folded."""
        self.follower = LogFollower(bus, self.keys, fold=self._fold_entries, count=READ_COUNT,
                                    skip=self._own)
        """Reads the run's log (every role's stream, merged); its positions are the ids of
        the last entries folded."""
        self.control_position = ""
        """Id of the last control entry known (read, or published by us)."""
        self._own_event_ids: set[str] = set()
        self._events_exist = False
        self._give_up_at: float | None = None
        self._dirty = True  # the state changed since the last decision
        self._caught_up = False  # read the log and made a first decision
        self._hook_running = False
        self._pulsed_activity = ""
        self._relevant = 0  # entries that changed the state, for the catch-up's log line

    # ------------------------------------------------------------------ folding

    @property
    def events_position(self) -> str:
        """Tracking position: id of the last events entry folded into :attr:`state`."""
        return self.follower.position

    def _fold(self, msg: Fact, entry_id: str | None = None) -> None:
        """Fold one entry into the state (``entry_id``: its events stream id, if any)."""
        refused = None
        if isinstance(msg, ProfileStarted | ProfileStopped):
            refused = report_refusal(self.state, msg)
        elif isinstance(msg, RunFinished):
            refused = run_finished_doubt(self.state, msg)
        if refused is not None:
            log.warning("ignoring %s", refused)
        state = apply(self.state, msg, entry_id)
        if state is not self.state:
            self.state = state
            self._dirty = True
            self._relevant += 1

    @property
    def log_positions(self) -> dict[str, str]:
        """Tracking positions in the other roles' streams of the log, by role."""
        return {role: self.follower.positions[self.keys.log(role)]
                for role in LOG_ROLES if role != "trainer"}

    def _own(self, stream: str, entry: Entry) -> bool:
        """Our own publication coming back (folded when we published it)."""
        if stream == self.keys.log(PROFILER_SOURCE) and entry.id in self._own_event_ids:
            self._own_event_ids.discard(entry.id)
            return True
        return False

    def _fold_entries(self, entries: Sequence[Entry]) -> None:
        """The follower's fold: every entry of the log once, in order (our own publications
        were folded when we published them)."""
        self._events_exist = True
        for entry in entries:
            self._fold(entry.msg, entry.id)

    async def _catch_up(self) -> None:
        """Fold both streams (the events one from the snapshot's position, if any): the state
        a restarted service resumes."""
        snapshot = await self.files.load_snapshot()
        self.follower.positions = dict.fromkeys(self.follower.positions, "0")
        if snapshot is not None:
            self.state = snapshot.state
            self.follower.position = snapshot.events_position
            self.follower.start_at_end({self.keys.log(role): position for role, position
                                        in snapshot.log_positions.items()})
            self.control_position = snapshot.control_position
            self._events_exist = True
        self._relevant = 0
        # The control stream holds commands only (a few per session): read it whole; its
        # commands are matched by id, so folding one again changes nothing.
        async for entry in self.bus.read_all(self.keys.control, count=READ_COUNT):
            self.control_position = entry.id
            self._fold(entry.msg)
        # The archive first when retention trimmed the stream (runtime.history), then the stream;
        # on a remote run.storage its segments are fetched to this node first.
        try:
            await asyncio.to_thread(fetch_for_reading, self.cfg, self.keys.run_id)
        except StorageError as exc:
            log.warning("the events archive could not be fetched from run.storage (%s)", exc)
        self.follower.archive = await find_archive(
            self.bus, self.keys, events_dir(self.cfg, self.keys.run_id))
        await self.follower.catch_up(on_gap=_log_gap)
        # A stream that holds only garbage still exists; read_all skipped those entries.
        if not self._events_exist and await self.bus.exists(self.keys.events):
            self._events_exist = True
        where = f" after the snapshot at {snapshot.events_position}" if snapshot else ""
        log.info("run %s: read %d relevant entries from the log%s", self.keys.run_id,
                 self._relevant, where)

    # ------------------------------------------------------------------ publishing

    async def _publish(self, msg: Command | Event) -> None:
        """Publish one decision (restamped with the current time) and fold it."""
        msg = msgspec.structs.replace(msg, ts=time.time())
        if isinstance(msg, StartProfile | StopProfile):
            self.control_position = await self.bus.publish(self.keys.control, msg)
            self._fold(msg)
        else:
            entry_id = await self.bus.publish(self.keys.log(PROFILER_SOURCE), msg,
                                              maxlen=ROLE_LOG_MAXLEN)
            self._own_event_ids.add(entry_id)
            self._fold(msg, entry_id)
        self._dirty = True
        log.info("published %s", _describe(msg))

    # ------------------------------------------------------------------ liveness

    def _activity(self) -> str:
        state = self.state
        if not self._caught_up:
            return "catching up"
        if self._hook_running:
            return "running the finish hook"
        if state.run_started is None:
            return "waiting for RunStarted"
        if state.run_finished is not None:
            return "finishing"
        return "following"

    def heartbeat(self) -> Heartbeat:
        """The service's pulse (at once when :meth:`pulse_now` was called): what it is
        doing and its counts."""
        state = self.state
        heartbeat = Heartbeat(
            role=PROFILER_SOURCE,
            rank=0,
            pid=os.getpid(),
            state=self._activity(),
            metrics={
                "sessions": float(state.sent),
                "pending_requests": float(len(state.pending)),
                "last_started_step": float(state.last_started_step),
            },
        )
        self._pulsed_activity = heartbeat.state
        return heartbeat

    # ------------------------------------------------------------------ files

    def _profiled(self) -> bool:
        # Nothing to describe otherwise: do not create folders for a run that is not profiled.
        return self.cfg.global_profiler.tool is not None and self.state.run_started is not None

    async def _write_manifest(self, final: bool = False) -> None:
        """Write the manifest of the current state (:mod:`profiler_service.files`)."""
        if self._profiled():
            await self.files.write_manifest(self.state, final)

    async def _write_snapshot(self) -> None:
        """Store the state and the tracking positions. Only when every event we published
        has come back through the tail, so that everything the state holds is at or before
        :attr:`events_position`."""
        if not self._profiled() or self._own_event_ids or self.events_position == "0":
            return
        await self.files.write_snapshot(Snapshot(
            state=self.state,
            run_id=self.keys.run_id,
            events_position=self.events_position,
            control_position=self.control_position,
            log_positions=self.log_positions,
        ))

    async def _keep_files(self, now: float) -> None:
        """Check new traces; write the manifest when its inputs changed and the snapshot
        when due."""
        if not self._profiled():
            return
        await self._check_traces()
        if self.files.manifest_due(self.state, now):
            await self._write_manifest()
        if self.files.snapshot_due(now):
            await self._write_snapshot()

    async def _check_traces(self, publish: bool = True) -> None:
        """Check the trace file of every ``ok`` ProfileStopped not checked yet (on a worker
        thread) and fold the verdicts; publish a WarningRaised for a missing one, once (the
        same warning already in the log is not published again; none when ``publish`` is
        False: on the way out, where Redis may be what failed, a successor says it)."""
        pending = unchecked_stops(self.state)
        if not pending:
            return
        verdicts = await asyncio.to_thread(check_traces, self.profile_dir, pending)
        for verdict in verdicts:
            self._fold(verdict)
            if not verdict.problem:
                continue
            warning = trace_warning(verdict)
            log.warning("%s", warning.message)
            if publish and warning.message not in self.state.trace_warnings:
                await self._publish(warning)

    # ------------------------------------------------------------------ finishing

    async def _run_hook_once(self) -> int | None:
        """Run ``finish_hook_cmd`` unless its marker says it already ran; its exit code."""
        cmd = self.cfg.global_profiler.finish_hook_cmd
        if not cmd:
            return None
        hook = FinishHook(cmd, self.profile_dir / HOOK_MARKER_NAME)
        ran = await hook.earlier()
        if ran is not None:
            if ran.interrupted:
                log.warning("%s", ran.message)
                await self._publish(WarningRaised(source=PROFILER_SOURCE,
                                                  code=HOOK_INTERRUPTED_CODE, message=ran.message))
            return ran.rc
        # rlbus's own variables plus verl's VERL_PROFILE_* (profiling.hook).
        env = {**os.environ, **hook_env(self.cfg, self.keys.run_id, self.profile_dir,
                                        self.manifest_path)}
        self._hook_running = True
        self.pulse_now()
        try:
            return await hook.run(env)
        finally:
            self._hook_running = False

    async def _finish(self, template: ProfilerFinished) -> None:
        if self._profiled():
            await self._check_traces()
        await self._write_manifest(final=True)
        hook_rc = await self._run_hook_once()
        await self._publish(
            msgspec.structs.replace(
                template, manifest_path=str(self.manifest_path.resolve()), hook_rc=hook_rc
            )
        )

    async def _check_give_up(self, now: float) -> None:
        """After RunFinished, bound the wait for the last ProfileStopped events."""
        state = self.state
        if state.run_finished is None or state.profiler_finished or state.gave_up_waiting:
            self._give_up_at = None
            return
        missing = outstanding_targets(state)
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
        """Publish whatever the state now calls for.

        Runtime-request StartProfile commands go out guarded by the run's step barrier
        (:meth:`_publish_request`). When the guard refuses one (the trainer crossed a step
        boundary between our GET of the barrier and the publish), decide again with the
        barrier read anew: ``next:N`` moves on to the steps after it, explicit steps that
        have begun are refused with a reason. After :data:`GUARD_ATTEMPTS` refusals in a row
        the state stays dirty and the next turn of the loop tries again.

        Redis's clock is read once per batch, and only while a request waits for an answer:
        requests older than their own timeout are refused, never served.
        """
        if not self._dirty:
            return
        self._dirty = False
        now_ms: int | None = None
        if self.state.pending and self.cfg.global_profiler.tool is not None:
            now_ms = int(await self.bus.server_time() * 1000)
        for _ in range(GUARD_ATTEMPTS):
            barrier = await self.bus.get_barrier(self.keys.barrier)
            if await self._publish_decisions(barrier, now_ms):
                break
        else:
            log.info("step barrier kept moving under %d guarded publishes; retrying",
                     GUARD_ATTEMPTS)
            self._dirty = True

    async def _publish_decisions(self, barrier: int, now_ms: int | None = None) -> bool:
        """Publish :func:`decide`'s output in order; False if a guarded command was refused
        (the rest is left for the next decision)."""
        for msg in decide(self.cfg.global_profiler, self.state, barrier, now_ms):
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
        else:
            self.control_position = entry_id
        self._fold(cmd)
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
        state, finished = self.state, self.state.run_finished
        if finished is None:
            return False
        if not finished.validation_only and \
                finished.steps < self.cfg.trainer.total_training_steps:
            # A run extended with more steps than it finished with goes on (as rollouters
            # read it): this service was started with its continuation, maybe before the
            # trainer's new RunStarted, and profiles its steps.
            return False
        return state.profiler_finished or self.cfg.global_profiler.tool is None

    async def serve(self) -> int:
        """Serve until the run finished (0) or a stop signal (0); Redis failing ends it (1,
        one line: runtime.main)."""
        if self.cfg.global_profiler.tool is None:
            log.info("global_profiler.tool is null: profiling is off; refusing runtime requests")
        await self._catch_up()
        last_waiting_log = time.monotonic()
        while not self.stopping.is_set():
            await self._step()
            if not self._caught_up:
                self._caught_up = True
                self.pulse_now()  # say at once that the log is read and decided on
            if self._done():
                log.info("run %s finished; profiler service done", self.keys.run_id)
                return 0
            now = time.monotonic()
            await self._check_give_up(now)
            await self._keep_files(now)
            if self._activity() != self._pulsed_activity:
                self.pulse_now()  # say what changed now, not an interval later
            if not self._events_exist and now - last_waiting_log >= WAITING_LOG_EVERY_S:
                last_waiting_log = now
                log.info("waiting for run %s to start (no events at %s yet)",
                         self.keys.run_id, self.bus.url)
            await self._drain()
        log.info("stopped by signal")
        return 0

    async def teardown(self) -> None:
        """Flush the files (their last changes may have been coalesced)."""
        with contextlib.suppress(OSError):
            if self._caught_up:
                if self._profiled():
                    await self._check_traces(publish=False)
                await self._write_manifest(final=self.state.profiler_finished)
                await self._write_snapshot()

    async def _drain(self) -> None:
        """Wait (bounded) for new entries, folding what arrives (the follower's fold)."""
        timeout = WAIT_SLICE_S
        if self._give_up_at is not None:
            timeout = max(0.0, min(timeout, self._give_up_at - time.monotonic()))
        await self.follower.poll(block_ms=int(timeout * 1000) or None)


def _log_gap(after: str, first: str) -> None:
    log.warning("events after %s up to %s were trimmed from the stream and are not in the "
                "archive here; folding without them", after, first)


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


