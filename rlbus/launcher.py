"""``rlbus up``: the whole run on one machine, each component a separate process.

Order: embedded Redis (unless ``redis.url`` is set), then the profiler service (when
``global_profiler.tool`` is set), the rollouter replicas and the trainer. Progress comes from
the run's events stream, not from the children's output (that goes to ``RUN/logs/*.log``).
A child that exits non-zero fails the run: the others are stopped and its log tail printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bus import Bus, EmbeddedRedis, RunKeys
from bus.messages import (
    ComponentFailed,
    ProfilerFinished,
    ProfileStopped,
    RunFinished,
    StepFinished,
    WarningRaised,
    WeightsPublished,
)
from runconfig import Config, config_to_dict, resolve_run_id

__all__ = ["Child", "redis_for_reading", "run_up", "server_file"]

STOP_GRACE_S = 15.0


def server_file(cfg: Config) -> Path:
    """Where ``rlbus up`` records the URL of the embedded Redis it runs for ``output_dir``."""
    return Path(cfg.run.output_dir) / "redis" / "server.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def redis_for_reading(cfg: Config) -> Iterator[str]:
    """A Redis URL holding ``cfg``'s runs: ``redis.url``, the live embedded server of
    ``run.output_dir``, or a temporary server started on that directory's saved data."""
    if cfg.redis.url:
        yield cfg.redis.url
        return
    info_path = server_file(cfg)
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if _alive(int(info.get("pid", -1))):
            yield str(info["url"])
            return
    data_dir = Path(cfg.run.output_dir) / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    server = EmbeddedRedis(data_dir, port=cfg.redis.port, binary=cfg.redis.binary)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class Child(msgspec.Struct):
    """One component process of the run."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            # A new session per child: Ctrl-C reaches the launcher only, which stops them in order.
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            log.close()

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=grace_s)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _children(cfg: Config, config_path: Path, logs: Path) -> list[Child]:
    py = sys.executable
    base = ["--config", str(config_path)]
    children: list[Child] = []
    if cfg.global_profiler.tool is not None:
        children.append(
            Child("profiler", [py, "-m", "profiler_service", *base], logs / "profiler.log")
        )
    for rank in range(cfg.rollout.replicas):
        children.append(
            Child(
                f"rollouter{rank}",
                [py, "-m", "rollouter", *base, f"rollout.rank={rank}"],
                logs / f"rollouter{rank}.log",
            )
        )
    children.append(Child("trainer", [py, "-m", "trainer", *base], logs / "trainer.log"))
    return children


def _progress_line(event: StepFinished, total: int) -> str:
    m = event.metrics
    return (
        f"step {event.step:>4}/{total}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"staleness {m.get('staleness/mean', 0.0):.2f} (max {m.get('staleness/max', 0.0):.0f})  "
        f"{m.get('throughput/samples_per_s', 0.0):6.1f} samples/s  {event.duration_s:5.2f}s"
    )


async def _watch(cfg: Config, url: str, children: list[Any], since: str) -> int:
    """Print progress from the events stream until the run finishes or a child fails."""
    keys = RunKeys(cfg.run.id or "")
    total = cfg.trainer.total_training_steps
    finished_at: float | None = None
    bus = Bus.from_url(url)
    try:
        last = since
        while True:
            for child in children:
                rc = child.returncode()
                if rc is not None and rc != 0:
                    print(f"rlbus up: {child.name} failed (exit code {rc}); last lines of "
                          f"{child.log_path}:", file=sys.stderr)
                    print(child.log_tail(), file=sys.stderr)
                    return 1
            if finished_at is not None:
                if all(c.returncode() is not None for c in children):
                    return 0
                if time.monotonic() - finished_at > 60:
                    waiting = [c.name for c in children if c.returncode() is None]
                    print(f"rlbus up: run finished but {', '.join(waiting)} did not exit "
                          "within 60 s; stopping them", file=sys.stderr)
                    return 0
            entries, last = await bus.read_after(keys.events, last, count=500, block_ms=200)
            for _, msg in entries:
                match msg:
                    case StepFinished():
                        print(_progress_line(msg, total), flush=True)
                    case WeightsPublished(version=0):
                        print("weights version 0 published; rollouters start", flush=True)
                    case ProfileStopped():
                        print(f"profile {msg.session_id} {msg.role}{msg.rank} steps "
                              f"{msg.first_step}-{msg.last_step}: {msg.status} {msg.path}",
                              flush=True)
                    case ProfilerFinished():
                        print(f"profiler manifest: {msg.manifest_path}", flush=True)
                    case WarningRaised():
                        print(f"warning from {msg.source}: {msg.message}", flush=True)
                    case ComponentFailed():
                        print(f"{msg.role}{msg.rank} failed: {msg.error}", file=sys.stderr)
                    case RunFinished():
                        print(f"run {msg.run_id} finished after {msg.steps} steps "
                              f"({msg.status})", flush=True)
                        finished_at = time.monotonic()
    finally:
        await bus.close()


def run_up(cfg: Config) -> int:
    """Run the whole job; returns the exit code (0 when the run finished)."""
    cfg = resolve_run_id(cfg)
    run_id = cfg.run.id or ""
    out = Path(cfg.run.output_dir)
    run_dir = out / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    server: EmbeddedRedis | None = None
    url = cfg.redis.url
    if url is None:
        server = EmbeddedRedis(out / "redis", port=cfg.redis.port, binary=cfg.redis.binary)
        server.start()
        url = server.url
        server_file(cfg).write_text(json.dumps({"url": url, "pid": server.pid}))
        print(f"embedded Redis at {url} (data in {out / 'redis'})", flush=True)
    tree = config_to_dict(cfg)
    tree["redis"]["url"] = url
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(tree, sort_keys=False))
    children: list[Any] = _children(cfg, config_path, run_dir / "logs")
    if cfg.run.launcher == "ray":
        from rlbus.ray_launcher import init_ray, ray_children

        init_ray(cfg.run.ray_address, num_cpus=max(2, len(children)))
        gpus = 1.0 if cfg.trainer.device.startswith("cuda") else 0.0
        children = ray_children(children, trainer_gpus=gpus)
        print(f"Ray launcher: {len(children)} tasks", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rc = 1
    try:
        since = asyncio.run(_latest_id(url, RunKeys(run_id).events))
        print(f"run {run_id}: {', '.join(c.name for c in children)} "
              f"(logs in {run_dir / 'logs'})", flush=True)
        for child in children:
            child.start(env)
        rc = asyncio.run(_watch(cfg, url, children, since))
    except KeyboardInterrupt:
        print("rlbus up: interrupted; stopping the run", file=sys.stderr)
        rc = 130
    finally:
        # Trainer first: it is the one that ends the run for the others.
        for child in reversed(children):
            child.stop()
        if server is not None:
            server.stop()
            with contextlib.suppress(OSError):
                server_file(cfg).unlink()
    _print_outputs(cfg, run_dir, rc)
    return rc


async def _latest_id(url: str, stream: str) -> str:
    bus = Bus.from_url(url)
    try:
        latest = await bus.latest(stream)
        return latest[0] if latest else "0"
    finally:
        await bus.close()


def _print_outputs(cfg: Config, run_dir: Path, rc: int) -> None:
    from profiling import profile_root

    print(f"\noutputs of run {cfg.run.id}{'' if rc == 0 else ' (failed)'}:")
    print(f"  config       {run_dir / 'config.yaml'}")
    print(f"  checkpoints  {run_dir / 'checkpoints'}")
    print(f"  logs         {run_dir / 'logs'}")
    if cfg.global_profiler.tool is not None:
        print(f"  traces       {profile_root(cfg)} (manifest.json)")
    if cfg.redis.url is None:
        print(f"  event log    {Path(cfg.run.output_dir) / 'redis'} (Redis AOF)")
    print(f"  inspect      rlbus inspect --run {cfg.run.id}"
          + (f" --config {run_dir / 'config.yaml'}" if cfg.redis.url else "")
          + f" run.output_dir={cfg.run.output_dir}")
