"""The profiler agent: runs inside the trainer and the rollouter and profiles at step boundaries.

It does no I/O on the bus. A component hands it the StartProfile/StopProfile commands it read
from the control stream (:meth:`ProfilerAgent.on_command`), calls :meth:`~ProfilerAgent.step_begin`
and :meth:`~ProfilerAgent.step_end` around every step, :meth:`~ProfilerAgent.close` when it
finishes or shuts down, and publishes the events each call returns (ProfileStarted,
ProfileStopped, WarningRaised) to the events stream.

With profiling off (``global_profiler.tool`` is null) a component creates no agent at all
(:func:`create_agent` returns ``None``): no profiler object exists and a
step costs one ``is None`` check.

Threading: :meth:`on_command` never touches torch and may be called from any thread (for
example a control-stream reader). ``step_begin``/``step_end``/``close`` start and stop
torch.profiler and must be called from the thread that runs the steps. A call that ends a
session stops its recorders on that thread and hands the rest (exporting and gzipping the
trace, which can take seconds for a long session) to its exporter (:mod:`profiling.export`):
inline by default, on a dedicated thread in the components (``create_agent``), so their
next step begins at once and the trace is written beside it. ProfileStopped is reported only
once the trace is complete under its final name; :meth:`~ProfilerAgent.close` waits for every
trace.

Session life cycle (one active session per agent at a time)::

    on_command(StartProfile) -> armed -> step_begin(first..last) -> active -> step_end(last)
                                                                            -> ProfileStopped

Traces carry ``distributedInfo.rank`` (trainer 0, rollouter replica ``r`` 1 + r) below its
``world_size`` (:func:`~profiling.paths.trace_world_size`, a joined rank too), the role,
run and session in an ``"rlbus"`` object, and their own path as ``traceName``; each is also
linked from ``sessions/SESSION/{role}{rank}.json.gz``, a folder of one trace per rank that
Holistic Trace Analysis loads (see :mod:`profiling.traces`).

Warm-up: the first ``torch.profiler`` start in a process initialises Kineto (about a second on
CPU, more with CUPTI), and it must happen on the thread that later profiles. :func:`create_agent`
therefore starts and stops a throwaway profiler (:meth:`ProfilerAgent.warm_up`) when the tool
uses torch.profiler, so the first profiled step measures the step, not the profiler. Call
``create_agent`` on the thread that will call ``step_begin``/``step_end``; before that,
:func:`prepare_main_thread` on the thread that imported torch (Kineto's first
initialisation must happen there).

ProfileStopped.status is one of ``ok``, ``missed`` (its steps were already past, or the
component closed before they came), ``cancelled`` (StopProfile before it started),
``unavailable`` (the tool cannot run here, e.g. nsys without CUDA) or ``error: ...``. For
``ok`` (and errors while stopping) ``first_step``/``last_step`` are the steps actually
profiled; otherwise they are the requested ones.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.profiler

from profiling.driver import Agent
from profiling.export import (
    AgentEvent,
    BackgroundExporter,
    Exporter,
    FinishedSession,
    InlineExporter,
    TraceWriter,
)
from profiling.export import describe_error as _err
from profiling.nsys import nsys_command
from profiling.paths import profile_root, trace_rank, trace_world_size
from runconfig.schema import Config, GlobalToolConfig
from runschema.messages import (
    ProfileStarted,
    ProfileStopped,
    StartProfile,
    StopProfile,
    WarningRaised,
)

__all__ = ["TOOLS", "AgentEvent", "ProfilerAgent", "create_agent", "prepare_main_thread"]

TOOLS = frozenset({"torch", "torch_memory", "nsys"})
"""Tools the agent knows."""

_WARMED: dict[tuple[bool, int], float] = {}  # (cuda, thread id) -> seconds the warm-up took


@dataclass(slots=True)
class _Session:
    cmd: StartProfile
    started_step: int
    t0: float = 0.0
    last_done: int = 0  # last step whose step_end ran inside this session
    prof: torch.profiler.profile | None = None  # while a torch/torch_memory session runs
    memory_history: bool = False  # CUDA allocator history recording (torch_memory)
    nsys: bool = False  # an nsys session: step ranges are NVTX
    range_open: bool = False  # cudaProfilerStart issued, no cudaProfilerStop yet
    stop_requested: bool = False


class ProfilerAgent(Agent):
    """Executes profiling commands for one ``role``/``rank`` at its step boundaries.

    ``run_dir`` is :func:`~profiling.paths.profile_root` (created on the first trace).
    ``device`` is the component's torch device (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or
    ``"auto"``); CUDA activity, NVTX and memory history are used only when it is a CUDA device
    and CUDA is available. ``after_step`` marks steps ``<= after_step`` as past, so a resumed
    component that re-reads old commands reports them ``missed`` instead of profiling them.
    ``run_id`` goes into the traces' metadata; ``world_size`` (at least this trace rank + 1,
    and widened per session to the ranks its command names:
    :func:`~profiling.paths.trace_world_size`) and the trace rank
    (:func:`~profiling.paths.trace_rank`) into their ``distributedInfo``;
    ``tools`` are verl's ``global_tool_config`` (torch_memory history, nsys ranges).
    ``exporter`` writes a stopped session's files (:mod:`profiling.export`): inline by default
    (the call that ends a session returns its ProfileStopped); :func:`create_agent` gives a
    :class:`~profiling.export.BackgroundExporter`, and then a session's ProfileStopped comes
    out of a later call (any of them, :meth:`drain` included) once its trace is written, and
    out of :meth:`close` at the latest.
    """

    def __init__(
        self,
        role: str,
        rank: int,
        run_dir: Path,
        device: str = "cpu",
        *,
        after_step: int = 0,
        run_id: str = "",
        world_size: int | None = None,
        tools: GlobalToolConfig | None = None,
        exporter: Exporter | None = None,
        trainers: int = 1,
    ) -> None:
        self.role = role
        self.rank = int(rank)
        self.run_id = run_id
        self.trainers = int(trainers)
        self.trace_rank = trace_rank(role, self.rank, self.trainers)
        self.world_size = max(int(world_size or 0), self.trace_rank + 1)
        self.tools = tools if tools is not None else GlobalToolConfig()
        self.nsys_command: list[str] = []  # shown when nsys is not attached (create_agent)
        self.all_threads = False  # record every thread, not only the steps' (create_agent)
        self.warm_thread: int | None = None  # thread the profiler was warmed up on
        self.run_dir = Path(run_dir)
        self.device = device
        want_cuda = device == "auto" or device.startswith("cuda")
        self._cuda = bool(want_cuda and torch.cuda.is_available())
        self._cuda_device = (
            torch.device("cuda" if device == "auto" else device) if self._cuda else None
        )
        self._lock = threading.Lock()
        self._seen: set[str] = set()  # session ids handled: duplicates (redelivery) ignored
        self._queue: list[StartProfile] = []  # armed sessions, arrival order
        self._active: _Session | None = None
        self._annotation: torch.profiler.record_function | None = None  # the step's, open
        self._nvtx_open = False
        self._in_step: int | None = None
        self._last_begun = int(after_step)
        self._closed = False
        self._exporter = exporter if exporter is not None else InlineExporter()
        self._writer = TraceWriter(
            self.run_dir, role, self.rank, run_id, self.trace_rank, self.world_size,
            # torch cuts the stacks itself where _record_memory_history takes a depth.
            stack_depth=0 if "stack_depth" in _history_params()
            else self.tools.torch_memory.stack_depth, trainers=self.trainers,
        )

    # ------------------------------------------------------------------ public API

    @property
    def active(self) -> bool:
        """Whether a session is running (between its start and its ProfileStopped)."""
        return self._active is not None

    @property
    def armed(self) -> int:
        """How many sessions wait for their first step."""
        return len(self._queue)

    def warm_up(self) -> float:
        """Start and stop a throwaway torch.profiler on this thread; seconds it took.

        The first start in a process initialises Kineto (and CUPTI with CUDA activity) on the
        calling thread: done here, at start-up, it is not inside the first profiled step.
        Once per process, thread and activity set; errors are ignored (the real start will
        report them).
        """
        key = (self._cuda, threading.get_ident())
        self.warm_thread = key[1]
        if key in _WARMED:
            return 0.0
        t0 = time.monotonic()
        try:
            prof = torch.profiler.profile(activities=self._activities(cuda=True))
            prof.start()
            with torch.profiler.record_function("rlbus:warm_up"):
                torch.zeros(8).add_(1)
            prof.stop()
        except Exception:
            pass
        _WARMED[key] = time.monotonic() - t0
        return _WARMED[key]

    def on_command(self, cmd: object) -> list[AgentEvent]:
        """Take one control command; anything not addressed to this role/rank is ignored."""
        with self._lock:
            if self._closed:
                return []
            events = self._exporter.ready()
            if isinstance(cmd, StartProfile):
                return events + self._on_start(cmd)
            if isinstance(cmd, StopProfile):
                return events + self._on_stop(cmd)
            return events

    def drain(self) -> list[AgentEvent]:
        """The events of traces written since the last call (any thread; a background
        exporter's ProfileStopped, once its file is complete)."""
        return self._exporter.ready()

    def step_begin(self, step: int) -> list[AgentEvent]:
        """Step ``step`` starts: end a session that is due, start one that is, annotate."""
        # Idle fast path without the lock: only this (step) thread sets _active, and a command
        # appended concurrently is seen at this boundary or the next one, both consistent
        # with the _last_begun check in on_command (set first).
        self._last_begun = step
        if self._active is None and not self._queue:
            self._in_step = step
            return self._exporter.ready()
        with self._lock:
            if self._closed:
                return []
            events: list[AgentEvent] = self._exporter.ready()
            sess = self._active
            if sess is not None and (sess.stop_requested or step > sess.cmd.last_step):
                # Stop requested between steps, or steps skipped past its last one.
                events += self._finish("ok")
            if self._annotation is not None or self._nvtx_open:
                # step_begin twice without step_end: close the dangling annotation first.
                events += self._close_step_or_fail()
            self._in_step = step
            if self._queue:
                events += self._drop_past(step)
            if self._active is None:
                due = next((c for c in self._queue if c.first_step <= step), None)
                if due is not None:
                    self._queue.remove(due)
                    events += self._start(due, step)
            if self._active is not None:
                events += self._open_step(step)
            return events

    def step_end(self, step: int) -> list[AgentEvent]:
        """Step ``step`` is done: close its annotation; stop the session if it is due."""
        self._in_step = None
        if self._active is None:  # idle fast path (see step_begin)
            return self._exporter.ready()
        with self._lock:
            sess = self._active
            if self._closed or sess is None:
                return []
            events = self._exporter.ready() + self._close_step_or_fail()
            if self._active is None:
                return events
            sess.last_done = step
            if step >= sess.cmd.last_step or sess.stop_requested:
                return events + self._finish("ok")
            return events

    def close(self, status: str = "ok") -> list[AgentEvent]:
        """Finish: write the active session's trace (with ``status``), report armed ones
        missed, and wait until every trace is written (their ProfileStopped included).

        Idempotent; the agent ignores every call after it.
        """
        with self._lock:
            if self._closed:
                return []
            events: list[AgentEvent] = []
            if self._active is not None:
                events += self._finish(status)
            for cmd in self._queue:
                events.append(self._stopped_unrun(cmd, "missed"))
            self._queue.clear()
            self._closed = True
            events += self._exporter.wait()
            self._exporter.close()
            return events

    # ------------------------------------------------------------------ commands

    def _targets(self, roles: list[str], ranks: list[int]) -> bool:
        # Empty lists mean "everyone", as StartProfile.ranks documents.
        return (not roles or self.role in roles) and (not ranks or self.rank in ranks)

    def _on_start(self, cmd: StartProfile) -> list[AgentEvent]:
        if not self._targets(cmd.roles, cmd.ranks) or cmd.session_id in self._seen:
            return []
        self._seen.add(cmd.session_id)
        problem = None
        if cmd.tool not in TOOLS:
            problem = f"unknown tool {cmd.tool!r}"
        elif cmd.first_step < 1 or cmd.last_step < cmd.first_step:
            problem = f"invalid step range {cmd.first_step}..{cmd.last_step}"
        if problem is not None:
            return [
                self._warn("profile_bad_command", f"session {cmd.session_id!r}: {problem}"),
                self._stopped_unrun(cmd, f"error: {problem}"),
            ]
        if cmd.last_step <= self._last_begun:
            # Every step it asks for has begun already: it can never be profiled.
            return [self._stopped_unrun(cmd, "missed")]
        self._queue.append(cmd)
        return []

    def _on_stop(self, cmd: StopProfile) -> list[AgentEvent]:
        if cmd.roles and self.role not in cmd.roles:
            return []
        sess = self._active
        if sess is not None and sess.cmd.session_id == cmd.session_id:
            # Stopped at the next boundary, from the step thread (torch.profiler calls stay
            # on one thread; this method may run on a reader thread).
            sess.stop_requested = True
            return []
        for armed in self._queue:
            if armed.session_id == cmd.session_id:
                self._queue.remove(armed)
                return [self._stopped_unrun(armed, "cancelled")]
        # Unknown or finished: remember it so a late redelivered StartProfile is ignored.
        self._seen.add(cmd.session_id)
        return []

    def _drop_past(self, step: int) -> list[AgentEvent]:
        past = [c for c in self._queue if c.last_step < step]
        for cmd in past:
            self._queue.remove(cmd)
        return [self._stopped_unrun(c, "missed") for c in past]

    # ------------------------------------------------------------------ start / stop

    def _activities(self, cuda: bool) -> list[torch.profiler.ProfilerActivity]:
        """CPU always (the step annotations are CPU events); CUDA when asked and present."""
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda and self._cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    def _start(self, cmd: StartProfile, step: int) -> list[AgentEvent]:
        events: list[AgentEvent] = []
        if cmd.tool == "nsys" and not self._cuda:
            return [
                self._warn("nsys_no_cuda", f"session {cmd.session_id!r}: nsys needs CUDA"),
                self._stopped_unrun(cmd, "unavailable"),
            ]
        if cmd.tool != "nsys" and self.warm_thread not in (None, threading.get_ident()):
            events.append(self._warn(
                "profiler_warmed_elsewhere",
                "torch.profiler was warmed up on another thread than the one running the "
                "steps; the first profiled step includes the profiler's start-up",
            ))
            self.warm_thread = None
        sess = _Session(cmd=cmd, started_step=step)
        contents = set(cmd.contents)
        try:
            if cmd.tool == "nsys":
                sess.nsys = True
                if not self.tools.nsys.discrete:  # one capture range for the whole session
                    torch.cuda.cudart().cudaProfilerStart()
                    sess.range_open = True
                if not _nsys_attached():
                    hint = " ".join(self.nsys_command) or (
                        "nsys profile --capture-range=cudaProfilerApi ..."
                    )
                    events.append(
                        self._warn(
                            "nsys_not_attached",
                            "cudaProfilerStart issued but this process does not seem to run "
                            f"under nsys (start it as: {hint} python -m {self.role} ...)",
                        )
                    )
            else:
                memory = "memory" in contents
                if cmd.tool == "torch_memory":
                    memory = True
                    if self._cuda:
                        torch.cuda.memory._record_memory_history("all", **self._history_kwargs())
                        sess.memory_history = True
                    else:
                        events.append(
                            self._warn(
                                "torch_memory_no_cuda",
                                f"session {cmd.session_id!r}: no CUDA; recording a CPU memory "
                                "profile (torch.profiler, profile_memory=True) instead",
                            )
                        )
                if "cuda" in contents and not self._cuda:
                    events.append(
                        self._warn(
                            "profile_no_cuda",
                            f"session {cmd.session_id!r}: contents asks for cuda but this "
                            "process has no CUDA device; recording CPU activity only",
                        )
                    )
                # verl's rule: no contents = CPU + CUDA; a list without "cuda" = no CUDA.
                prof = torch.profiler.profile(
                    activities=self._activities(cuda=not contents or "cuda" in contents),
                    record_shapes="shapes" in contents,
                    profile_memory=memory,
                    with_stack="stack" in contents,
                    **self._thread_options(),
                )
                prof.start()
                sess.prof = prof
        except Exception as exc:
            self._abandon(sess)
            return [
                *events,
                self._warn("profile_start_failed", f"session {cmd.session_id!r}: {_err(exc)}"),
                self._stopped_unrun(cmd, f"error: {_err(exc)}"),
            ]
        sess.t0 = time.monotonic()
        self._active = sess
        events.append(
            ProfileStarted(
                session_id=cmd.session_id, role=self.role, rank=self.rank, step=step, tool=cmd.tool
            )
        )
        return events

    def _thread_options(self) -> dict[str, Any]:
        """torch records the thread it was started on; with :attr:`all_threads` (a rollouter
        whose tool calls run on threads of their own) every thread."""
        if not self.all_threads:
            return {}
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}

    def _history_kwargs(self) -> dict[str, object]:
        """verl's torch_memory options as ``_record_memory_history`` arguments."""
        tm = self.tools.torch_memory
        kwargs: dict[str, object] = {
            "context": tm.context,
            "stacks": tm.stacks,
            "max_entries": tm.trace_alloc_max_entries,
            "device": self._cuda_device,
        }
        if "stack_depth" in _history_params():
            kwargs["stack_depth"] = tm.stack_depth
        return kwargs

    def _open_step(self, step: int) -> list[AgentEvent]:
        sess = self._active
        assert sess is not None
        try:
            if sess.nsys:
                if not sess.range_open:  # discrete: one capture range per step
                    torch.cuda.cudart().cudaProfilerStart()
                    sess.range_open = True
                torch.cuda.nvtx.range_push(f"step:{step}")
                self._nvtx_open = True
            else:
                # Entered by hand: a rollouter step spans many calls, no `with` block fits.
                annotation = torch.profiler.record_function(f"step:{step}")
                annotation.__enter__()
                self._annotation = annotation
        except Exception as exc:
            events: list[AgentEvent] = [
                self._warn("profile_annotate_failed", f"step:{step}: {_err(exc)}")
            ]
            return events + self._finish(f"error: {_err(exc)}")
        return []

    def _close_step(self) -> None:
        annotation, self._annotation = self._annotation, None
        if annotation is not None:
            annotation.__exit__(None, None, None)
        if self._nvtx_open:
            self._nvtx_open = False
            torch.cuda.nvtx.range_pop()
            sess = self._active
            if sess is not None and sess.range_open and self.tools.nsys.discrete:
                # The step's queued kernels belong in its range: let them land first.
                sess.range_open = False
                torch.cuda.synchronize(self._cuda_device)
                torch.cuda.cudart().cudaProfilerStop()

    def _close_step_or_fail(self) -> list[AgentEvent]:
        """Close the step annotation; if torch refuses, end the session with an error."""
        try:
            self._close_step()
        except Exception as exc:
            self._annotation, self._nvtx_open = None, False
            return [
                self._warn("profile_annotate_failed", f"closing step: {_err(exc)}"),
                *self._finish(f"error: {_err(exc)}"),
            ]
        return []

    def _abandon(self, sess: _Session) -> None:
        """Best-effort undo of a half-started session (errors here are secondary)."""
        try:
            if sess.prof is not None:
                sess.prof.stop()
        except Exception:
            pass
        try:
            if sess.memory_history:
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            pass
        try:
            if sess.range_open:
                torch.cuda.cudart().cudaProfilerStop()
        except Exception:
            pass

    def _finish(self, status: str) -> list[AgentEvent]:
        """Stop the active session on this (the step) thread and hand what it recorded to
        the exporter, which writes it and reports it (ProfileStopped after the file is
        complete). Never raises."""
        sess = self._active
        assert sess is not None
        errors: list[str] = []
        try:
            self._close_step()
        except Exception as exc:
            errors.append(f"closing annotation: {_err(exc)}")
        self._active = None
        done = FinishedSession(
            cmd=sess.cmd,
            first_step=sess.started_step,
            last_step=max(sess.last_done, self._in_step or 0, sess.started_step),
            duration_s=time.monotonic() - sess.t0,
            status=status,
            errors=errors,
        )
        self._stop_recording(sess, done)
        return self._exporter.submit(functools.partial(self._writer.write, done))

    def _stop_recording(self, sess: _Session, done: FinishedSession) -> None:
        """Stop every recorder the session started (kernels landed first, the CUDA profiler
        range, torch.profiler, the allocator history after its snapshot) and leave in
        ``done`` what is to be written; each failure is appended to ``done.errors``."""
        errors = done.errors
        try:
            if self._cuda:
                # Queued kernels belong to the profiled steps; let them land in the window.
                torch.cuda.synchronize(self._cuda_device)
        except Exception as exc:
            errors.append(f"synchronize: {_err(exc)}")
        if sess.range_open:
            sess.range_open = False
            try:
                torch.cuda.cudart().cudaProfilerStop()
            except Exception as exc:
                errors.append(f"cudaProfilerStop: {_err(exc)}")
        if sess.prof is not None:
            try:
                sess.prof.stop()
                done.prof = sess.prof  # stopped: its trace can be exported
            except Exception as exc:
                errors.append(f"stop: {_err(exc)}")
        if sess.memory_history:
            try:
                # Taken now (the allocator's state at the session's end); pickled later.
                done.snapshot = torch.cuda.memory._snapshot(self._cuda_device)
            except Exception as exc:
                errors.append(f"memory snapshot: {_err(exc)}")
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:
                errors.append(f"memory history off: {_err(exc)}")

    # ------------------------------------------------------------------ events

    def _warn(self, code: str, message: str) -> WarningRaised:
        return self._writer.warn(code, message)

    def _stopped_unrun(self, cmd: StartProfile, status: str) -> ProfileStopped:
        return ProfileStopped(
            session_id=cmd.session_id,
            role=self.role,
            rank=self.rank,
            first_step=cmd.first_step,
            last_step=cmd.last_step,
            tool=cmd.tool,
            path="",
            bytes=0,
            duration_s=0.0,
            status=status,
        )


def create_agent(
    cfg: Config,
    role: str,
    rank: int,
    device: str,
    run_id: str | None = None,
    after_step: int = 0,
) -> ProfilerAgent | None:
    """The agent a component should hold, or ``None`` when profiling is off.

    ``run_id`` overrides ``cfg.run.id``; ``after_step`` is the last finished step when the
    component resumes (see :class:`ProfilerAgent`). The agent takes its tool options
    (``global_tool_config``), its trace rank and the run's world size from ``cfg``, and is
    warmed up (:meth:`ProfilerAgent.warm_up`) before it is returned: call this on the thread
    that will run the steps.
    """
    prof = cfg.global_profiler
    if prof.tool is None:
        return None
    trainers = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rid = run_id if run_id is not None else cfg.run.id
    agent = ProfilerAgent(
        role,
        rank,
        profile_root(cfg, run_id),
        device,
        after_step=after_step,
        run_id=rid or "",
        world_size=trace_world_size(cfg.rollout.replicas, trace_rank(role, rank, trainers),
                                    trainers=trainers),
        trainers=trainers,
        tools=prof.global_tool_config,
        # Traces are written beside the next step, not before it (profiling.export).
        exporter=BackgroundExporter(),
    )
    # A rollouter's conversations run their tools on threads of their own: recorded too.
    agent.all_threads = role == "rollouter" and cfg.rollout.multi_turn.enable
    if prof.tool == "nsys":
        agent.nsys_command = nsys_command(cfg, role, rank, run_id)
    else:
        agent.warm_up()
    return agent


def prepare_main_thread(cfg: Config, device: str) -> bool:
    """Initialise Kineto (torch.profiler's engine) on the calling thread; True when done.

    Call it from the thread that imported torch (a component's main thread) before the step
    thread creates its agent. Kineto's first initialisation checks that it runs on the thread
    where torch registered its Kineto client (at ``import torch``); the agent's warm-up runs
    on the step thread, so without this every profiled component's log starts with
    ``ERROR: External init callback must run in same thread as registerClient``. A prepare,
    start and stop with nothing recorded: ~20 ms, and the agent's warm-up then finds Kineto
    ready. Nothing when the tool is not torch.profiler's (null, nsys) or on a failure (the
    message is then all that is lost)."""
    if cfg.global_profiler.tool not in ("torch", "torch_memory"):
        return False
    try:
        from torch.autograd import _disable_profiler
        from torch.autograd.profiler import profile

        cuda = device != "cpu" and torch.cuda.is_available()
        prof = profile(use_device="cuda" if cuda else None)
        prof._prepare_trace()
        prof._start_trace()
        _disable_profiler()
    except Exception:
        return False
    return True


def _history_params() -> frozenset[str]:
    """Parameter names of this torch's ``torch.cuda.memory._record_memory_history``."""
    try:
        return frozenset(inspect.signature(torch.cuda.memory._record_memory_history).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _nsys_attached() -> bool:
    """Heuristic: nsys injects its libraries and sets NSYS_* variables in the target."""
    preload = os.environ.get("LD_PRELOAD", "")
    return (
        any(k.startswith("NSYS_") for k in os.environ)
        or "nsys" in preload.lower()
        or "ToolsInjection" in preload
    )
