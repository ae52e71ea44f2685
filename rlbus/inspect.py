"""``rlbus inspect``: a run's events log as a timeline, JSON lines, or a metrics plot."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import msgspec

from bus import Bus, RunKeys
from bus.messages import Message, StepFinished
from runconfig import Config

__all__ = ["event_to_json", "inspect_run", "summary_line"]

_json = msgspec.json.Encoder()


def event_to_json(msg: Message) -> bytes:
    """One JSON object: ``type`` plus every field (bytes as base64, as msgspec does)."""
    tree: dict[str, Any] = {"type": type(msg).__name__}
    tree.update(msgspec.to_builtins(msg))
    return _json.encode(tree)


def summary_line(entry_id: str, msg: Message) -> str:
    """A one-line human description of an event."""
    name = type(msg).__name__
    if isinstance(msg, StepFinished):
        m = msg.metrics
        return (f"{entry_id:<18} {name:<18} step={msg.step} samples={len(msg.sample_ids)} "
                f"reward={m.get('reward/mean', float('nan')):.3f} "
                f"staleness={m.get('staleness/mean', 0.0):.2f} {msg.duration_s:.2f}s")
    fields = msgspec.to_builtins(msg)
    for noisy in ("v", "ts", "config", "raw"):
        fields.pop(noisy, None)
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"{entry_id:<18} {name:<18} {text}"[:200]


async def _events(url: str, run_id: str) -> list[tuple[str, Message]]:
    bus = Bus.from_url(url)
    try:
        return [(entry_id, msg) async for entry_id, msg in bus.read_all(RunKeys(run_id).events)]
    finally:
        await bus.close()


def _plot(events: list[tuple[str, Message]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for _, m in events if isinstance(m, StepFinished)]
    keys = ["reward/mean", "staleness/mean", "trainer/idle_ratio", "throughput/samples_per_s"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True)
    for ax, key in zip(axes, keys, strict=True):
        ax.plot([s.step for s in steps], [s.metrics.get(key, float("nan")) for s in steps])
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def inspect_run(cfg: Config, as_json: bool = False, plot: str | None = None) -> int:
    """Print run ``cfg.run.id``'s events; exit code 1 when the run has no events."""
    from rlbus.launcher import redis_for_reading

    run_id = cfg.run.id or ""
    with redis_for_reading(cfg) as url:
        events = asyncio.run(_events(url, run_id))
    if not events:
        print(f"rlbus inspect: run {run_id!r} has no events at this Redis", file=sys.stderr)
        return 1
    if plot:
        _plot(events, plot)
        print(f"plot written to {plot}", file=sys.stderr)
    out = sys.stdout.buffer
    try:
        for entry_id, msg in events:
            if as_json:
                out.write(event_to_json(msg) + b"\n")
            else:
                out.write(summary_line(entry_id, msg).encode() + b"\n")
        out.flush()
    except BrokenPipeError:  # `rlbus inspect ... | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0
