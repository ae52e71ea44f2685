"""The metrics logger process: follow a run's events, write each StepFinished to the sinks.

Position: after each batch is flushed to every sink, the id of the last entry read and the
last step written are stored (atomically) in ``RUN/logger-position.json``; a restarted logger
reads the log only after that id and skips steps it already wrote. A crash between a flush
and the store can repeat that one batch; nothing is lost. When retention trimmed the entries
after that id from the stream, they are read from the run's events archive
(``RUN/events``, bus.history) on the same filesystem; without one, a line says which range
was skipped. Exit code 0 when the run finished
(or on SIGTERM), 1 when Redis failed, 2 for a bad config.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from bus import Bus, Entry, RunFinished, RunKeys, StepFinished, run_with_bus
from bus.history import events_folder, find_archive, read_history
from runconfig import Config, load_or_exit

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

LOGGER_NAMES_WRITTEN = ("tensorboard", "wandb")
"""``trainer.logger`` values this process writes (``console`` is the progress lines)."""


class Position(msgspec.Struct):
    """Where a logger is in the run's events stream."""

    entry_id: str = "0"
    step: int = 0


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

    def write(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        self._run.log(metrics, step=step)

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


def _scalars(ev: StepFinished) -> dict[str, float]:
    out = {k: float(v) for k, v in ev.metrics.items() if not math.isnan(v)}
    out["timing/step_s"] = ev.duration_s
    return out


class MetricsLogger:
    """Follows run ``cfg.run.id`` on ``bus`` and writes to ``sinks``."""

    def __init__(self, cfg: Config, bus: Bus, sinks: list[Sink]) -> None:
        self.cfg = cfg
        self.bus = bus
        self.sinks = sinks
        self.stream = RunKeys(cfg.run.id or "").events
        self.path = position_file(cfg)
        self.position = self._load()
        self.written = 0

    def _load(self) -> Position:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Position)
        except (OSError, msgspec.DecodeError):
            return Position()

    def _store(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(self.position))
        os.replace(tmp, self.path)

    def _take(self, entries: Sequence[Entry], cursor: str, new_cursor: str) -> bool:
        """Write the StepFinished metrics of ``entries`` (read after ``cursor``, up to
        ``new_cursor``), flush, store the position; whether RunFinished was among them."""
        finished = False
        wrote = False
        for _, msg in entries:
            if isinstance(msg, StepFinished) and msg.step > self.position.step:
                for sink in self.sinks:
                    sink.write(msg.step, _scalars(msg), msg.ts)
                self.position.step = msg.step
                self.written += 1
                wrote = True
            elif isinstance(msg, RunFinished):
                finished = True
        if new_cursor != cursor:
            if wrote:
                for sink in self.sinks:
                    sink.flush()
            self.position.entry_id = new_cursor
            self._store()
        return finished

    def _gap(self, after: str, first: str) -> None:
        print(f"{PROG}: events after {after} up to {first} were trimmed from the stream "
              f"(run.retention=checkpoint) and their archive is not at "
              f"{events_folder(self.cfg.run.output_dir, self.cfg.run.id or '')}; "
              "skipped the metrics of those steps", file=sys.stderr, flush=True)

    async def _catch_up(self) -> bool:
        """Read from the stored position to the end of the log, the archive first when
        retention trimmed what follows that position (bus.history). Whether the run
        finished."""
        archive = await find_archive(self.bus, RunKeys(self.cfg.run.id or ""),
                                     events_folder(self.cfg.run.output_dir, self.cfg.run.id or ""))
        cursor = self.position.entry_id
        batch: list[Entry] = []
        finished = False
        async for entry in read_history(self.bus, self.stream, archive, cursor, count=500,
                                        on_gap=self._gap):
            batch.append(entry)
            if len(batch) >= 500:
                finished |= self._take(batch, cursor, batch[-1].id)
                cursor, batch = batch[-1].id, []
        if batch:
            finished |= self._take(batch, cursor, batch[-1].id)
        return finished

    async def run(self) -> int:
        try:
            finished = await self._catch_up()
            cursor = self.position.entry_id
            while not finished:
                entries, new_cursor = await self.bus.read_after(
                    self.stream, cursor, count=500, block_ms=1000
                )
                finished = self._take(entries, cursor, new_cursor)
                cursor = new_cursor
            print(f"{PROG}: run {self.cfg.run.id} finished; {self.written} step(s) "
                  f"written this time, last step {self.position.step}", flush=True)
            return 0
        finally:
            for sink in self.sinks:
                with contextlib.suppress(Exception):
                    sink.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m metrics_logger`` / ``rlbus logger``; returns the exit code."""
    cfg = load_or_exit(list(sys.argv[1:] if argv is None else argv), PROG)
    for key, value in (("redis.url", cfg.redis.url), ("run.id", cfg.run.id)):
        if not value:
            print(f"{PROG}: error: invalid config key '{key}': required for the logger "
                  "(rlbus up sets it for you)", file=sys.stderr)
            return 2
    for warning in logger_warnings(cfg):
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    sinks = _open_sinks(cfg)
    if not sinks:
        print(f"{PROG}: nothing to write for trainer.logger={logger_names(cfg)}; exiting",
              flush=True)
        return 0
    where = ", ".join(type(s).__name__ for s in sinks)
    print(f"{PROG}: run {cfg.run.id}: writing {where} (TensorBoard: "
          f"{tensorboard_dir(cfg)})", flush=True)
    return run_with_bus(cfg.redis.url or "", PROG,
                        lambda bus: MetricsLogger(cfg, bus, sinks).run())
