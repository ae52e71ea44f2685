"""The metrics logger process: follow a run's events, write each StepFinished to the sinks,
and each ValidationFinished's metrics at the step its validation was requested at (verl logs
its validation metrics at the training step).

Position: at most once per :data:`COMMIT_INTERVAL_S` while it follows, and when it ends, the
sinks are flushed and then the id of the last entry read and the last step written are
stored (atomically, fsynced) in ``RUN/logger-position.json``, on the worker thread (never on
the event loop); a restarted logger reads the log only after that id and skips steps it
already wrote. A crash repeats at most the steps written since the last store; nothing is
lost. When retention trimmed the entries after that id from the stream, they are read from the
run's events archive (``RUN/events``, runtime.history) on the same filesystem; without one, a
line says which range was skipped. Exit code 0 when the run finished
(or on SIGTERM), 1 when Redis failed, 2 for a bad config.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from bus import Bus, Entry
from runconfig import Config
from runconfig.paths import events_dir
from runschema.facts import run_finished_refusal
from runschema.messages import Heartbeat, RunFinished, StepFinished, ValidationFinished
from runtime import Component, LogFollower
from runtime import main as run_main
from runtime.events_archive import fetch_for_reading
from runtime.history import find_archive
from storage.files import atomic_write
from storage.run_storage import StorageError

__all__ = [
    "LOGGER_NAMES_WRITTEN",
    "MetricsLogger",
    "Position",
    "logger_names",
    "logger_warnings",
    "main",
    "position_file",
    "tensorboard_dir",
]

PROG = "logger"

FOLLOW_GATHER_S = 0.2
"""After a read that found something, the follower waits this long before the next: the
log gets ~8 entries a step and a wake-up for each cost the run's shared cores CPU; a step's
metrics are written at most this much later."""

COMMIT_INTERVAL_S = 1.0
"""Least seconds between two commits (sinks flushed, position stored) while following: one
per step cost the run ~6 ms of a 2-core machine's CPU a step (a flush and two fsyncs), and
a crash repeats only what was written since (docs/benchmarks.md, "Where a step's time
goes")."""

LOGGER_NAMES_WRITTEN = ("tensorboard", "wandb")
"""``trainer.logger`` values this process writes (``console`` is the progress lines)."""


class Position(msgspec.Struct):
    """Where a logger is in the run's log: the trainer's stream (``entry_id``) and the
    rollouters' (validation answers)."""

    entry_id: str = "0"
    step: int = 0
    rollouter_id: str = "0"


def logger_names(cfg: Config) -> list[str]:
    """``trainer.logger`` as a list (verl allows one name or a list)."""
    names = cfg.trainer.logger
    return [names] if isinstance(names, str) else list(names)


def tensorboard_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / (cfg.run.id or "") / "tensorboard"


def position_file(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / (cfg.run.id or "") / "logger-position.json"


def logger_warnings(cfg: Config) -> list[str]:
    """What ``trainer.logger`` asks for that will not be written, and why."""
    out = []
    for name in logger_names(cfg):
        if name in ("console", *LOGGER_NAMES_WRITTEN):
            if name in LOGGER_NAMES_WRITTEN and importlib.util.find_spec(name) is None:
                extra = ("pip install 'rlbus[logger]'" if name == "tensorboard"
                         else "pip install wandb")
                out.append(f"trainer.logger has {name} but the {name} package is not "
                           f"installed ({extra}); not writing {name} logs")
            continue
        out.append(f"trainer.logger '{name}' is not supported by rlbus (console, tensorboard, "
                   "wandb are); ignored")
    return out


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float], wall_time: float) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars in TensorBoard event files, written with tensorboard's own writer."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._event = event_pb2.Event
        self._summary = summary_pb2.Summary
        self._writer = EventFileWriter(str(logdir), flush_secs=5)

    def write(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_event(self._event(wall_time=wall_time, step=step,
                                           summary=self._summary(value=values)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases in offline mode (``wandb sync`` uploads it later, if ever)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=cfg.trainer.project_name, name=cfg.trainer.experiment_name or cfg.run.id,
            id=cfg.run.id, dir=str(run_dir), mode="offline", resume="allow",
        )
        self._val_axis = False

    def write(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self._run.log(metrics, step=step)

    def write_validation(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        """A validation answers after later steps were logged, and wandb drops a ``step``
        below its last one: validation figures get their own x axis, ``val/step``."""
        if not self._val_axis:
            self._run.define_metric("val/step")
            for section in ("val-core/*", "val-aux/*"):
                self._run.define_metric(section, step_metric="val/step")
            self._val_axis = True
        self._run.log({**metrics, "val/step": step})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def _open_sinks(cfg: Config) -> list[Sink]:
    names = logger_names(cfg)
    sinks: list[Sink] = []
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is not None:
        sinks.append(TensorBoardSink(tensorboard_dir(cfg)))
    if "wandb" in names and importlib.util.find_spec("wandb") is not None:
        sinks.append(WandbSink(cfg, Path(cfg.run.output_dir) / (cfg.run.id or "")))
    return sinks


def _write_validation(sink: Sink, ev: ValidationFinished) -> None:
    """A validation's metrics at the step it was requested at (a sink with a
    ``write_validation`` of its own decides how)."""
    metrics = {k: float(v) for k, v in ev.metrics.items() if not math.isnan(v)}
    if metrics:
        getattr(sink, "write_validation", sink.write)(ev.step, metrics, ev.ts)


def _scalars(ev: StepFinished) -> dict[str, float]:
    out = {k: float(v) for k, v in ev.metrics.items() if not math.isnan(v)}
    out["timing/step_s"] = ev.duration_s
    return out


class MetricsLogger(Component):
    """Follows run ``cfg.run.id`` on ``bus`` and writes to ``sinks``."""

    role = "logger"
    cancel_on_stop = False  # a stop ends the batch in hand: flushed, position stored, exit 0

    def __init__(self, cfg: Config, bus: Bus, sinks: list[Sink] | None = None) -> None:
        super().__init__(cfg, bus)
        self.sinks = _open_sinks(cfg) if sinks is None else sinks
        self.path = position_file(cfg)
        self.position = self._load()
        self.written = 0
        self.finished = False
        self._dirty = False  # written to the sinks since the last commit
        self._committed = b""  # the position the last commit stored
        self._commit: asyncio.Future[None] | None = None
        self._commit_due = 0.0  # time.monotonic() from which the next batch commits
        self.follower = LogFollower(
            bus, self.keys, ("trainer", "rollouter"), count=500, fold=self._take,
            positions={self.keys.events: self.position.entry_id,
                       self.keys.log("rollouter"): self.position.rollouter_id})

    def _load(self) -> Position:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Position)
        except (OSError, msgspec.DecodeError):
            return Position()

    def kept_position(self) -> str | None:
        """Retention keeps the events after what this logger has written, while it lives."""
        return self.position.entry_id

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(role=self.role, rank=0, pid=os.getpid(),
                         state=f"written up to step {self.position.step}",
                         metrics={"logger/steps_written": float(self.written)})

    def _take(self, entries: Sequence[Entry]) -> None:
        """Write the StepFinished metrics of ``entries`` (the follower's next batch) to the
        sinks, move the position past them and commit when one is due; note RunFinished."""
        wrote = False
        for _, msg in entries:
            if isinstance(msg, StepFinished) and msg.step > self.position.step:
                for sink in self.sinks:
                    sink.write(msg.step, _scalars(msg), msg.ts)
                self.position.step = msg.step
                self.written += 1
                wrote = True
            elif isinstance(msg, ValidationFinished):
                for sink in self.sinks:
                    _write_validation(sink, msg)
                wrote = True
            elif isinstance(msg, RunFinished):
                why = run_finished_refusal(msg, self.position.step)
                if why is None:
                    self.finished = True
                else:  # not the trainer's: the run goes on
                    print(f"{PROG}: ignored a RunFinished: {why}", file=sys.stderr, flush=True)
        self._dirty |= wrote
        self.position.entry_id = self.follower.position
        self.position.rollouter_id = self.follower.positions[self.keys.log("rollouter")]
        if time.monotonic() >= self._commit_due:
            self._commit_soon()

    def _commit_soon(self) -> None:
        """Commit what was written so far on the worker thread, unless a commit is still
        under way (the next batch commits then); a failed commit raises here."""
        if self._commit is not None:
            if not self._commit.done():
                return
            self._commit.result()
        position = msgspec.json.encode(self.position)
        if position == self._committed and not self._dirty:
            return
        self._commit = self.submit(self._store, position, self._dirty)
        self._committed, self._dirty = position, False
        self._commit_due = time.monotonic() + COMMIT_INTERVAL_S

    async def _commit_now(self) -> None:
        """The last commit: after any under way, what was written up to now."""
        if self._commit is not None:
            await self._commit
        self._commit = None
        self._commit_soon()
        if self._commit is not None:
            await self._commit

    def _store(self, position: bytes, flush: bool) -> None:
        """On the worker thread: the sinks flushed, then ``position`` stored (its steps are
        in the sinks' files before the position says so)."""
        if flush:
            for sink in self.sinks:
                sink.flush()
        atomic_write(self.path, position)

    def _gap(self, after: str, first: str) -> None:
        print(f"{PROG}: events after {after} up to {first} were trimmed from the stream "
              f"(run.retention=checkpoint) and their archive is not at "
              f"{events_dir(self.cfg, self.run_id)}; "
              "skipped the metrics of those steps", file=sys.stderr, flush=True)

    async def _fetch_archive(self) -> None:
        """On a remote run.storage, the archive segments the trainer mirrored there, into
        this node's events folder (download only); a storage that fails is a warning (the
        trimmed steps are then skipped, :meth:`_gap` says so)."""
        try:
            await asyncio.to_thread(fetch_for_reading, self.cfg, self.run_id)
        except StorageError as exc:
            print(f"{PROG}: warning: the events archive could not be fetched from "
                  f"run.storage ({exc})", file=sys.stderr, flush=True)

    async def serve(self) -> int:
        """From the stored position to the end of the log (the archive first when retention
        trimmed what follows it, runtime.history), then new entries until RunFinished."""
        await self._fetch_archive()
        self.follower.archive = await find_archive(
            self.bus, self.keys, events_dir(self.cfg, self.run_id))
        await self.follower.catch_up(on_gap=self._gap)
        while not self.finished and not self.stopping.is_set():
            if await self.follower.poll(block_ms=1000) and self.follower.caught_up:
                # What comes next gathers meanwhile: one wake-up a FOLLOW_GATHER_S at most,
                # not one an entry of the log (~8 a step); a backlog is read at once.
                await asyncio.sleep(FOLLOW_GATHER_S)
            if time.monotonic() >= self._commit_due:  # what a skipped commit left
                self._commit_soon()
        await self._commit_now()
        print(f"{PROG}: run {self.run_id} {'finished' if self.finished else 'stopped'}; "
              f"{self.written} step(s) written this time, last step {self.position.step}",
              flush=True)
        return 0

    async def teardown(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close()


def _precheck(cfg: Config, prog: str) -> int | None:
    """Before Redis: say what ``trainer.logger`` asks for that will not be written; exit 0
    when there is nothing to write."""
    for warning in logger_warnings(cfg):
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)
    if not any(name in LOGGER_NAMES_WRITTEN and importlib.util.find_spec(name) is not None
               for name in logger_names(cfg)):
        print(f"{prog}: nothing to write for trainer.logger={logger_names(cfg)}; exiting",
              flush=True)
        return 0
    print(f"{prog}: run {cfg.run.id}: writing {', '.join(logger_names(cfg))} (TensorBoard: "
          f"{tensorboard_dir(cfg)})", flush=True)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m metrics_logger`` / ``rlbus logger``; returns the exit code."""
    return run_main(PROG, lambda: MetricsLogger, argv, precheck=_precheck)
