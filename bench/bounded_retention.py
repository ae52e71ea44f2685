"""What a run with verl's ``trainer.save_freq=-1`` keeps in Redis: with the trainer's resume
points (the default, trainer.resumepoints) and without them (``run.resume_point_steps=0
run.resume_point_mb=0``: retention then waits for a checkpoint that never comes).

Both runs here, one after the other, in one invocation: ``rlbus up`` on a redis-server of its
own (no persistence), the default task, ``--steps`` steps. Every second the bench reads the
samples stream's length, the events stream's length and Redis's ``used_memory``; it prints,
side by side, their values at every ``--every`` steps, their maxima and the ratio of the
maxima (off / on).

    .venv/bin/python bench/bounded_retention.py [--steps 1000] [--every 100]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus import RunKeys
from rlbus.redis_binary import find_redis_server, free_port

__all__ = ["main"]

STEP_LINE = re.compile(r"^step\s+(\d+)/\d+")


class Sample(NamedTuple):
    step: int
    samples: int
    events: int
    used_mb: float


def _redis(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the bench's redis-server did not start")


def _run(steps: int, extra: list[str]) -> list[Sample]:
    """One ``rlbus up`` of ``steps`` steps; what Redis held, read once a second."""
    with tempfile.TemporaryDirectory() as tmp:
        server, port = _redis(Path(tmp))
        client = redis.Redis(port=port)
        keys = RunKeys("bench-retention")
        cmd = [sys.executable, "-m", "rlbus", "up", f"redis.url=redis://127.0.0.1:{port}/0",
               f"run.id={keys.run_id}", f"run.output_dir={tmp}/out",
               f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
               "trainer.logger=[console]", "global_profiler.tool=null",
               "run.progress_interval_s=1", *extra]
        up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: list[Sample] = []
        step = 0
        assert up.stdout is not None
        last = 0.0
        try:
            for line in up.stdout:
                m = STEP_LINE.match(line)
                if m:
                    step = int(m[1])
                if time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    seen.append(Sample(step, int(client.xlen(keys.samples)),
                                       int(client.xlen(keys.events)),
                                       int(client.info("memory")["used_memory"]) / 2**20))
            code = up.wait()
            seen.append(Sample(steps, int(client.xlen(keys.samples)),
                               int(client.xlen(keys.events)),
                               int(client.info("memory")["used_memory"]) / 2**20))
        finally:
            up.kill()
            server.kill()
            server.wait()
        if code != 0:
            raise RuntimeError(f"rlbus up exited {code}: {' '.join(cmd)}")
        return seen


def _at(seen: list[Sample], step: int) -> Sample:
    return next((s for s in seen if s.step >= step), seen[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args(argv)
    on = _run(args.steps, [])
    off = _run(args.steps, ["run.resume_point_steps=0", "run.resume_point_mb=0"])
    print(f"save_freq=-1, {args.steps} steps: Redis with resume points (default) | without")
    print(f"{'step':>6} {'samples':>9} {'events':>8} {'MB':>7} | "
          f"{'samples':>9} {'events':>8} {'MB':>7}")
    for step in range(args.every, args.steps + 1, args.every):
        a, b = _at(on, step), _at(off, step)
        print(f"{step:>6} {a.samples:>9} {a.events:>8} {a.used_mb:>7.1f} | "
              f"{b.samples:>9} {b.events:>8} {b.used_mb:>7.1f}")
    peak_on = max(s.samples for s in on)
    peak_off = max(s.samples for s in off)
    mem_on = max(s.used_mb for s in on)
    mem_off = max(s.used_mb for s in off)
    print(f"max samples XLEN: {peak_on} | {peak_off} (x{peak_off / max(peak_on, 1):.1f}); "
          f"max used_memory: {mem_on:.1f} MB | {mem_off:.1f} MB "
          f"(x{mem_off / max(mem_on, 1e-9):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
