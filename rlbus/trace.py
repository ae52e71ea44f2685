"""A whole run as one Chrome/Perfetto trace, built from its event log (``rlbus inspect --trace``).

One process track per component (trainer, each rollouter, the profiler service, the metrics
logger) plus a ``run`` track for run-wide events. The trainer has its steps (with their
metrics), weight publications and checkpoints; a rollouter has its generation windows by
weights version (from the samples stream when it is still there) and its validations; every
role has its profile sessions with the path of their torch trace; warnings and failures are
global instants.
Times are microseconds since the run's first event (Trace Event Format, ``displayTimeUnit``
ms); open the file at ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from runschema.facts import STEP_REWARD, step_reward
from runschema.messages import (
    CheckpointSaved,
    ComponentFailed,
    Message,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TrainerResumed,
    ValidationFinished,
    WarningRaised,
    WeightsPublished,
)

__all__ = ["build_trace"]

RUN_PID, TRAINER_PID, PROFILER_PID, LOGGER_PID, ROLLOUTER_PID0 = 0, 1, 2, 3, 10
STEPS_TID, WEIGHTS_TID, PROFILE_TID, FAILURES_TID, GEN_TID = 1, 2, 3, 4, 1
VALIDATION_TID = 5


class _Builder:
    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}
        self.threads: set[tuple[int, int, str]] = set()

    def us(self, ts: float) -> float:
        return round((ts - self.t0) * 1e6, 1)

    def track(self, pid: int, process: str, tid: int, thread: str) -> None:
        self.names.setdefault(pid, process)
        self.threads.add((pid, tid, thread))

    def span(self, pid: int, tid: int, name: str, start: float, end: float,
             args: dict[str, Any] | None = None, cat: str = "run") -> None:
        self.events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat,
                            "ts": self.us(start), "dur": max(1.0, self.us(end) - self.us(start)),
                            "args": args or {}})

    def instant(self, pid: int, tid: int, name: str, ts: float,
                args: dict[str, Any] | None = None, scope: str = "t", cat: str = "run") -> None:
        self.events.append({"ph": "i", "s": scope, "pid": pid, "tid": tid, "name": name,
                            "cat": cat, "ts": self.us(ts), "args": args or {}})

    def counter(self, pid: int, name: str, ts: float, values: dict[str, float]) -> None:
        self.events.append({"ph": "C", "pid": pid, "tid": 0, "name": name, "ts": self.us(ts),
                            "args": values})

    def metadata(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for pid, name in self.names.items():
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                        "args": {"name": name}})
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index",
                        "args": {"sort_index": pid}})
        for pid, tid, name in sorted(self.threads):
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                        "args": {"name": name}})
        return out


def _role_pid(role: str, rank: int) -> tuple[int, str]:
    if role == "trainer":
        return TRAINER_PID, "trainer"
    if role == "rollouter":
        return ROLLOUTER_PID0 + rank, f"rollouter{rank}"
    if role == "logger":
        return LOGGER_PID, "logger"
    return PROFILER_PID, "profiler service"


def _clean(value: float) -> float | None:
    return None if value != value else value  # NaN is not valid JSON


def build_trace(
    run_id: str,
    events: Sequence[Message],
    samples: Iterable[Sample] = (),
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """The trace of run ``run_id`` as a JSON-ready dict (``traceEvents`` and metadata).

    ``profile_dir`` (``save_path/RUN``) turns the relative trace path of a ProfileStopped
    into the file's full path.
    """
    stamps = [float(ts) for m in events if (ts := getattr(m, "ts", None))]
    t0 = min(stamps) if stamps else 0.0
    b = _Builder(t0)
    b.track(RUN_PID, f"run {run_id}", 0, "run")
    log = _Log(b, profile_dir)
    for msg in events:
        draw = _DRAW.get(type(msg))
        if draw is not None:
            draw(log, msg)
    _generation_windows(b, samples)
    return {
        "traceEvents": b.metadata() + b.events,
        "displayTimeUnit": "ms",
        "otherData": {"run_id": run_id, "source": "rlbus inspect --trace", "t0_unix_s": t0},
    }


class _Log:
    """What drawing one event needs: the builder, where traces live, and the starts of the
    spans still open (a step or profile session ends at a later event)."""

    def __init__(self, b: _Builder, profile_dir: Path | None) -> None:
        self.b = b
        self.profile_dir = profile_dir
        self.step_start: dict[int, float] = {}
        self.profile_start: dict[tuple[str, str, int], float] = {}


def _run_started(log: _Log, msg: RunStarted) -> None:
    log.b.instant(RUN_PID, 0, "RunStarted" + (" (resumed)" if msg.resumed else ""), msg.ts,
                  scope="g")


def _run_finished(log: _Log, msg: RunFinished) -> None:
    log.b.instant(RUN_PID, 0, f"RunFinished after {msg.steps} steps ({msg.status})", msg.ts,
                  scope="g")


def _step_started(log: _Log, msg: StepStarted) -> None:
    log.step_start[msg.step] = msg.ts


def _step_finished(log: _Log, msg: StepFinished) -> None:
    """The step as a span (from its StepStarted, else its duration back from the end), and
    the reward and staleness counters."""
    b = log.b
    b.track(TRAINER_PID, "trainer", STEPS_TID, "steps")
    start = log.step_start.pop(msg.step, msg.ts - msg.duration_s)
    metrics = {k: _clean(v) for k, v in msg.metrics.items()}
    b.span(TRAINER_PID, STEPS_TID, f"step {msg.step}", start, msg.ts,
           {"step": msg.step, "param_version": msg.param_version,
            "samples": len(msg.sample_ids), **metrics}, cat="step")
    reward = _clean(step_reward(msg.metrics))
    if reward is not None:
        b.counter(TRAINER_PID, STEP_REWARD, msg.ts, {STEP_REWARD: reward})
    b.counter(TRAINER_PID, "staleness/mean", msg.ts,
              {"staleness/mean": msg.metrics.get("staleness/mean", 0.0)})


def _trainer_instant(log: _Log, name: str, ts: float, args: dict[str, Any]) -> None:
    log.b.track(TRAINER_PID, "trainer", WEIGHTS_TID, "weights and checkpoints")
    log.b.instant(TRAINER_PID, WEIGHTS_TID, name, ts, args)


def _weights_published(log: _Log, msg: WeightsPublished) -> None:
    _trainer_instant(log, f"weights v{msg.version} published", msg.ts,
                     {"version": msg.version, "step": msg.step, "bytes": msg.ref.size,
                      "store": msg.ref.store})


def _checkpoint_saved(log: _Log, msg: CheckpointSaved) -> None:
    _trainer_instant(log, f"checkpoint step {msg.step}", msg.ts,
                     {"path": msg.path, "param_version": msg.param_version})


def _trainer_resumed(log: _Log, msg: TrainerResumed) -> None:
    _trainer_instant(log, f"resumed after step {msg.step}", msg.ts,
                     {"checkpoint_step": msg.checkpoint_step,
                      "replayed_steps": msg.replayed_steps, "weights_match": msg.weights_match})


def _profile_started(log: _Log, msg: ProfileStarted) -> None:
    log.profile_start[(msg.session_id, msg.role, msg.rank)] = msg.ts


def _profile_stopped(log: _Log, msg: ProfileStopped) -> None:
    """The session as a span on its process (from its ProfileStarted, else its duration back
    from the end), with the full path of its torch trace."""
    pid, name = _role_pid(msg.role, msg.rank)
    log.b.track(pid, name, PROFILE_TID, "profiling")
    start = log.profile_start.pop((msg.session_id, msg.role, msg.rank), msg.ts - msg.duration_s)
    path = str(log.profile_dir / msg.path) if log.profile_dir and msg.path else msg.path
    log.b.span(pid, PROFILE_TID, f"profile steps {msg.first_step}-{msg.last_step} ({msg.status})",
               start, msg.ts,
               {"session": msg.session_id, "tool": msg.tool, "status": msg.status,
                "trace": path, "bytes": msg.bytes, "top_ops": msg.top_ops}, cat="profile")


def _decision_args(msg: Message) -> dict[str, Any]:
    if isinstance(msg, ProfileRequestRefused):
        return {"request": msg.request_id, "reason": msg.reason}
    if isinstance(msg, ProfileRequest):
        return {"request": msg.request_id, "steps": msg.steps, "next_steps": msg.next_steps,
                "roles": msg.roles}
    if isinstance(msg, ProfilerFinished):
        return {"manifest": msg.manifest_path, "sessions": msg.sessions}
    return {}


def _decision(
    log: _Log, msg: ProfilerReady | ProfilerFinished | ProfileRequest | ProfileRequestRefused
) -> None:
    """What the profiler service was asked and answered, on its own track."""
    log.b.track(PROFILER_PID, "profiler service", PROFILE_TID, "decisions")
    log.b.instant(PROFILER_PID, PROFILE_TID, type(msg).__name__, msg.ts, _decision_args(msg))


def _warning(log: _Log, msg: WarningRaised) -> None:
    log.b.instant(RUN_PID, 0, f"warning {msg.code}", msg.ts,
                  {"source": msg.source, "message": msg.message}, scope="g")


def _component_failed(log: _Log, msg: ComponentFailed) -> None:
    log.b.instant(RUN_PID, 0, f"{msg.role}{msg.rank} failed", msg.ts, {"error": msg.error},
                  scope="g")


def _rollout_failed(log: _Log, msg: RolloutFailed) -> None:
    pid, name = _role_pid("rollouter", msg.rank)
    log.b.track(pid, name, FAILURES_TID, "failures")
    log.b.instant(pid, FAILURES_TID, "rollout failed", msg.ts,
                  {"ticket": msg.ticket_id, "error": msg.error})


def _validation_finished(log: _Log, msg: ValidationFinished) -> None:
    pid, name = _role_pid("rollouter", msg.rank)
    log.b.track(pid, name, VALIDATION_TID, "validation")
    args: dict[str, Any] = {"request": msg.request_id, "step": msg.step,
                            **{k: _clean(v) for k, v in msg.metrics.items()
                               if k.startswith("val-core/")}}
    if msg.error:
        args["error"] = msg.error
    log.b.span(pid, VALIDATION_TID, f"validate weights v{msg.version}",
               msg.ts - msg.duration_s, msg.ts, args, cat="validation")


# How each kind of event is drawn; any other kind (heartbeats, tickets, ...) is not.
_DRAW: dict[type, Callable[[_Log, Any], None]] = {
    RunStarted: _run_started,
    RunFinished: _run_finished,
    StepStarted: _step_started,
    StepFinished: _step_finished,
    WeightsPublished: _weights_published,
    CheckpointSaved: _checkpoint_saved,
    TrainerResumed: _trainer_resumed,
    ProfileStarted: _profile_started,
    ProfileStopped: _profile_stopped,
    ProfilerReady: _decision,
    ProfilerFinished: _decision,
    ProfileRequest: _decision,
    ProfileRequestRefused: _decision,
    WarningRaised: _warning,
    ComponentFailed: _component_failed,
    RolloutFailed: _rollout_failed,
    ValidationFinished: _validation_finished,
}


def _generation_windows(b: _Builder, samples: Iterable[Sample]) -> None:
    """One span per rollouter and weights version: first generation start to last sample."""
    windows: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        key = (s.rank, s.max_version)
        start = s.ts - s.gen_time_s
        w = windows.get(key)
        if w is None:
            windows[key] = [start, s.ts, 1.0]
        else:
            w[0], w[1], w[2] = min(w[0], start), max(w[1], s.ts), w[2] + 1
    last_end: dict[int, float] = {}
    for (rank, version), (start, end, count) in sorted(windows.items()):
        pid, name = _role_pid("rollouter", rank)
        b.track(pid, name, GEN_TID, "generation")
        start = max(start, last_end.get(rank, start))  # spans on one track must not overlap
        last_end[rank] = max(end, start)
        b.span(pid, GEN_TID, f"generate with weights v{version}", start, max(end, start),
               {"weights_version": version, "samples": int(count),
                "rollouter_step": version + 1}, cat="generation")
