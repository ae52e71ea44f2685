"""``rlbus inspect``: a run's events log as a timeline, JSON lines, a metrics plot or a trace.

Under ``run.retention=checkpoint`` the oldest events live in the run's archive
(``run.output_dir/RUN/events``) rather than in Redis: inspect reads the archive, then the
stream, as one log (runtime.history). The timeline shows wall-clock times (and seconds since the
run's first event). Pulses are not in the log (liveness keys with a TTL): ``--heartbeats``
adds the components alive now, each with its latest pulse. ``--plot`` and ``--trace`` write
only their file. Nothing is created as a side effect: no folder for a mistyped
``run.output_dir`` or plot path.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from bus import Bus, RunKeys
from runconfig import Config
from runconfig.paths import events_dir
from runschema.facts import STEP_REWARD, step_reward
from runschema.messages import (
    Heartbeat,
    Message,
    ProfileStopped,
    RunForked,
    Sample,
    StepFinished,
    ValidationFinished,
)
from runtime import LogFollower
from runtime.events_archive import fetch_for_reading
from runtime.history import find_archive
from runtime.progress import validation_line
from storage.run_storage import StorageError

__all__ = ["event_to_json", "inspect_run", "lineage", "summary_line", "validation_curves",
           "validations_table"]

_json = msgspec.json.Encoder()


def event_to_json(msg: Message) -> bytes:
    """One JSON object: ``type`` plus every field (bytes as base64, as msgspec does)."""
    tree: dict[str, Any] = {"type": type(msg).__name__}
    tree.update(msgspec.to_builtins(msg))
    return _json.encode(tree)


def _entry_time(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _ranks(metrics: dict[str, float]) -> str:
    """`` ranks=N`` for a step trained by several trainer ranks (``trainer/ranks``)."""
    ranks = int(metrics.get("trainer/ranks", 1))
    return f" ranks={ranks}" if ranks > 1 else ""


def summary_line(entry_id: str, msg: Message, t0: float | None = None) -> str:
    """One line: ``HH:MM:SS.mmm  +SECONDS  TYPE  fields`` (time from the entry id)."""
    when = _entry_time(entry_id)
    stamp = dt.datetime.fromtimestamp(when).strftime("%H:%M:%S.%f")[:-3]
    rel = f"+{when - (t0 if t0 is not None else when):8.2f}s"
    name = type(msg).__name__
    if isinstance(msg, StepFinished):
        m = msg.metrics
        text = (f"step={msg.step} samples={len(msg.sample_ids)} "
                f"reward={step_reward(m):.3f} "
                f"staleness={m.get('staleness/mean', 0.0):.2f} {msg.duration_s:.2f}s"
                f"{_ranks(m)}")
    elif isinstance(msg, ValidationFinished):
        text = f"{msg.request_id} rank={msg.rank} {validation_line(msg)}"
    else:
        fields = msgspec.to_builtins(msg)
        for noisy in ("type", "v", "ts", "config", "raw"):
            fields.pop(noisy, None)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"{stamp} {rel}  {name:<18} {text}"[:220]


def lineage(events: list[tuple[str, Message]]) -> list[str]:
    """The run's parents (``rlbus fork``), one line each: which run, which step, what changed."""
    lines = []
    for _, msg in events:
        if isinstance(msg, RunForked):
            changed = " ".join(msg.overrides) or "no change"
            lines.append(f"lineage: forked from run {msg.parent} after step {msg.step} "
                         f"({changed}); steps 1-{msg.step} are the parent's")
    return lines


def validations_table(events: list[tuple[str, Message]]) -> list[str]:
    """One line per validation in the log: weights version, the step it was requested at,
    its val-core figures (or why it failed), who ran it and how long it took."""
    lines = []
    for _, msg in events:
        if not isinstance(msg, ValidationFinished):
            continue
        if msg.error:
            lines.append(f"  v{msg.version:<4} step {msg.step:<5} failed: {msg.error}")
            continue
        core = "  ".join(f"{k}={v:.4f}" for k, v in sorted(msg.metrics.items())
                         if k.startswith("val-core/"))
        lines.append(f"  v{msg.version:<4} step {msg.step:<5} {core or 'no val-core metrics'}"
                     f"  (rollouter{msg.rank}, {msg.duration_s:.1f} s)")
    return ["validations:", *lines] if lines else []


def _gap(after: str, first: str) -> None:
    print(f"rlbus inspect: events after {after} up to {first} were trimmed "
          "(run.retention=checkpoint) and are not in the archive here; not shown",
          file=sys.stderr)


class DeadLetters(NamedTuple):
    """The run's dead-letter stream: entries it holds, and those its cap dropped
    (``redis.dead_letter_max``; counted in ``rlbus:{RUN}:dlq:dropped``)."""

    kept: int = 0
    dropped: int = 0

    def line(self, run_id: str) -> str | None:
        """One line for the timeline's head; None when there are none."""
        if not (self.kept or self.dropped):
            return None
        return (f"dead letters: {self.kept} in rlbus:{{{run_id}}}:dlq"
                + (f", {self.dropped} older ones dropped by its cap (redis.dead_letter_max)"
                   if self.dropped else ""))


async def dead_letters(bus: Bus, keys: RunKeys) -> DeadLetters:
    """What the run's dead-letter stream holds and what its cap dropped."""
    dropped = await bus.command("GET", keys.dlq_dropped)
    return DeadLetters(await bus.length(keys.dlq), int(dropped or 0))


async def _read(url: str, run_id: str, with_samples: bool, archive: Path | None = None) -> tuple[
    list[tuple[str, Message]], list[Sample], DeadLetters
]:
    """The run's events (the archive of what retention trimmed, then the stream), when
    asked the samples still in the stream, and its dead letters' counts."""
    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    try:
        folder = await find_archive(bus, keys, archive)
        log = LogFollower(bus, keys, archive=folder)
        events = [(entry_id, msg) async for batch in log.history(on_gap=_gap)
                  for entry_id, msg in batch]
        samples: list[Sample] = []
        if with_samples and events:
            samples = [m async for _, m in bus.read_all(keys.samples) if isinstance(m, Sample)]
        return events, samples, await dead_letters(bus, keys)
    finally:
        await bus.close()


def _plot(run_id: str, events: list[tuple[str, Message]], path: str, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for _, m in events if isinstance(m, StepFinished)]
    profiled = sorted({(m.first_step, m.last_step) for _, m in events
                       if isinstance(m, ProfileStopped) and m.status == "ok"})
    xs = [s.step for s in steps]
    # The reward first: the target line is drawn on the first axes.
    curves = {STEP_REWARD: (xs, [step_reward(s.metrics) for s in steps])}
    curves.update({key: (xs, [s.metrics.get(key, float("nan")) for s in steps])
                   for key in ("staleness/mean", "trainer/idle_ratio",
                               "throughput/samples_per_s")})
    curves.update(validation_curves([m for _, m in events]))
    stacks = step_stacks(steps)
    fig, axes = plt.subplots(len(curves) + len(stacks), 1,
                             figsize=(7, 2.2 * (len(curves) + len(stacks))), sharex=True)
    for ax, (title, (xs, layers)) in zip(axes[len(curves):], stacks.items(), strict=True):
        ax.stackplot(xs, *layers.values(), labels=list(layers), alpha=0.85)
        ax.set_ylabel(title, fontsize=8)
        ax.legend(fontsize=6, loc="upper left", ncol=4)
        ax.grid(alpha=0.3)
    for i, (ax, (key, (xs, ys))) in enumerate(zip(axes, curves.items(), strict=False)):
        ax.plot(xs, ys, marker="o" if key.startswith("val-") else None, markersize=3)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
        for j, (first, last) in enumerate(profiled):
            ax.axvspan(first - 0.5, last + 0.5, color="tab:orange", alpha=0.25,
                       label="profiled" if i == 0 and j == 0 else None)
    axes[0].axhline(target, color="tab:green", linestyle="--", label=f"target {target:g}")
    axes[0].legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"run {run_id}: {len(steps)} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def step_stacks(steps: list[StepFinished]
                ) -> dict[str, tuple[list[int], dict[str, list[float]]]]:
    """Where each step's time went, as stacked layers against the step: the trainer's
    ``timing_s/<lap>`` in ms (trainer.timing: they add up to ``timing_s/step``) and the
    rollouters' ``rollouter/timing_share/<lap>`` (their loops' laps, shares of a pulse's
    window). A lap that is zero in every step is left out; a run without them adds none."""
    out: dict[str, tuple[list[int], dict[str, list[float]]]] = {}
    for title, prefix, scale, skip in (
            ("trainer step (ms)", "timing_s/", 1000.0,
             {"timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/update_actor"}),
            ("rollouter loop (share)", "rollouter/timing_share/", 1.0, set())):
        keys = sorted({k for s in steps for k in s.metrics
                       if k.startswith(prefix) and k not in skip})
        layers = {k[len(prefix):]: [scale * s.metrics.get(k, 0.0) for s in steps] for k in keys}
        layers = {name: ys for name, ys in layers.items() if any(ys)}
        if layers:
            out[title] = ([s.step for s in steps], layers)
    return out


def validation_curves(events: list[Message]) -> dict[str, tuple[list[int], list[float]]]:
    """Each ``val-core/.../mean@N`` figure of the run's validations (the headline of each data
    source) against the step whose weights were validated; a failed validation adds nothing."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for msg in events:
        if not isinstance(msg, ValidationFinished) or msg.error:
            continue
        for key, value in sorted(msg.metrics.items()):
            if key.startswith("val-core/") and "/mean@" in key:
                xs, ys = curves.setdefault(key, ([], []))
                xs.append(msg.step)
                ys.append(value)
    return curves


def _plot_unavailable() -> str | None:
    """Why ``--plot`` cannot draw here (matplotlib is an extra: ``make demo`` does not install
    it), in one line saying how to get it; None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        return None
    return (f"--plot needs matplotlib, which is not installed in this environment "
            f"({sys.executable}): install the plot extra (`{sys.executable} -m pip install "
            "matplotlib`, or `make test`, which installs it)")


def _check_out_path(flag: str, path: str) -> str | None:
    parent = Path(path).parent
    if not parent.is_dir():
        return f"{flag}: folder {parent} does not exist (not creating it)"
    return None


def inspect_run(
    cfg: Config,
    as_json: bool = False,
    plot: str | None = None,
    heartbeats: bool = False,
    target: float = 0.9,
    trace: str | None = None,
) -> int:
    """Print or write run ``cfg.run.id``'s events; exit code 1 when the run has no events."""
    from rlbus.launcher import RunDataMissing, redis_for_reading

    for flag, path in (("--plot", plot), ("--trace", trace)):
        problem = _check_out_path(flag, path) if path else None
        if problem is None and flag == "--plot" and path:
            problem = _plot_unavailable()
        if problem:
            print(f"rlbus inspect: error: {problem}", file=sys.stderr)
            return 2
    run_id = cfg.run.id or ""
    _fetch_archive(cfg, run_id)
    try:
        with redis_for_reading(cfg) as url:
            events, samples, dlq = asyncio.run(_read(
                url, run_id, with_samples=trace is not None,
                archive=events_dir(cfg, run_id)))
    except RunDataMissing as exc:
        print(f"rlbus inspect: error: {exc}", file=sys.stderr)
        return 1
    if not events:
        print(f"rlbus inspect: run {run_id!r} has no events at this Redis", file=sys.stderr)
        return 1
    if plot or trace:
        if plot:
            _plot(run_id, events, plot, target)
            print(f"plot written to {plot}", file=sys.stderr)
        if trace:
            _write_trace(cfg, run_id, events, samples, trace)
        return 0
    rc = _print_events(run_id, events, as_json, dlq)
    if heartbeats and rc == 0:
        with redis_for_reading(cfg) as url:
            _print_pulses(asyncio.run(_pulses(url, run_id)), as_json)
    return rc


async def _pulses(url: str, run_id: str) -> list[Heartbeat]:
    """The latest pulse of every component alive now (its liveness key exists: it spoke
    within heartbeat.timeout_s, by Redis's clock)."""
    from bus import LOG_ROLES, peers

    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    try:
        return [hb for role in LOG_ROLES for hb in await peers(bus, keys.alive_pattern(role))]
    finally:
        await bus.close()


def _print_pulses(pulses: list[Heartbeat], as_json: bool) -> None:
    if as_json:
        for hb in pulses:
            sys.stdout.buffer.write(event_to_json(hb) + b"\n")
        sys.stdout.flush()
        return
    print(f"alive now: {len(pulses)} component(s)" if pulses else
          "alive now: none (no component has pulsed within heartbeat.timeout_s)")
    for hb in sorted(pulses, key=lambda h: (h.role, h.rank)):
        figures = " ".join(f"{k}={v:g}" for k, v in sorted(hb.metrics.items()))
        print(f"  {hb.role}{hb.rank} pid {hb.pid}: {hb.state} progress={hb.progress} {figures}"
              .rstrip()[:220])


def _fetch_archive(cfg: Config, run_id: str) -> None:
    """On a remote run.storage, the archive segments the trainer mirrored there, into this
    node's events folder (download only, before the event loop starts); a storage that
    fails is a warning (the trimmed events are then not shown, and inspect says so)."""
    try:
        fetch_for_reading(cfg, run_id)
    except StorageError as exc:
        print(f"rlbus inspect: warning: the events archive could not be fetched from "
              f"run.storage ({exc})", file=sys.stderr)


def _write_trace(cfg: Config, run_id: str, events: list[tuple[str, Message]],
                 samples: list[Sample], path: str) -> None:
    from profiling import profile_root
    from rlbus.trace import build_trace

    tree = build_trace(run_id, [m for _, m in events], samples, Path(profile_root(cfg)))
    Path(path).write_text(json.dumps(tree))
    print(f"trace written to {path} ({len(tree['traceEvents'])} events; open it at "
          "ui.perfetto.dev or chrome://tracing)", file=sys.stderr)


def _print_events(run_id: str, events: list[tuple[str, Message]], as_json: bool,
                  dlq: DeadLetters | None = None) -> int:
    # Heartbeats of runs written before pulses left the log: not facts, not shown.
    shown = [(i, m) for i, m in events if not isinstance(m, Heartbeat)]
    out = sys.stdout.buffer
    try:
        if not as_json:
            t0 = _entry_time(events[0][0])
            first = dt.datetime.fromtimestamp(t0).strftime("%Y-%m-%d %H:%M:%S")
            span = _entry_time(events[-1][0]) - t0
            out.write(f"run {run_id}: {len(shown)} events from {first} over {span:.1f} s\n"
                      .encode())
            for line in lineage(events):
                out.write(line.encode() + b"\n")
            if dlq is not None and (said := dlq.line(run_id)) is not None:
                out.write(said.encode() + b"\n")
        for entry_id, msg in shown:
            if as_json:
                out.write(event_to_json(msg) + b"\n")
            else:
                out.write(summary_line(entry_id, msg, t0).encode() + b"\n")
        if not as_json:
            for line in validations_table(events):
                out.write(line.encode() + b"\n")
        out.flush()
    except BrokenPipeError:  # `rlbus inspect ... | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0
