"""Steps a 30 s flood of junk costs a running job (issue 36's "unbounded" case, measured).

``rlbus up`` runs the default task (embedded Redis, real processes); once it has trained
``--warm`` steps, a client writes junk into the run's samples stream at ``--rate`` entries a
second for ``--seconds`` (pipelines of 1 000, paced: half undecodable bytes, half samples of
tickets never issued, as a broken or hostile client would). The run's own StepFinished
entries (their Redis times) give the steps trained in the flood's window against the same
window just before it, the longest wait between two steps, and how long after the flood the
step rate is back; the dead-letter stream, the count its cap dropped and the trainer's log
lines about it are printed too.

    python bench/flood_run.py                  # 20 000 entries/s for 30 s
    python bench/flood_run.py --rate 5000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bus import Bus, RunKeys
from runschema.messages import FIELD, Array, Sample, StepFinished, encode

ROOT = Path(__file__).resolve().parents[1]
BATCH = 1000


def _junk(i: int) -> bytes:
    if i % 2:
        return b"\xc1junk %d" % i
    a = Array.of(np.asarray([1, 2], dtype=np.int32))
    return encode(Sample(sample_id=f"t{10**8 + i}/0", ticket_id=f"t{10**8 + i}",
                         prompt_id="p", index=0, n=1, prompt_tokens=a, response_tokens=a,
                         logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)),
                         reward=0.0, min_version=0, max_version=0))


async def _flood(bus: Bus, keys: RunKeys, rate: int, seconds: float) -> tuple[int, float, float]:
    """Junk at ``rate`` entries/s for ``seconds``: (entries, start, end) on the Redis clock."""
    start = await _redis_now(bus)
    t0, sent = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        await bus.pipeline([("XADD", keys.samples, "*", FIELD, _junk(sent + i))
                            for i in range(BATCH)])
        sent += BATCH
        ahead = sent / rate - (time.monotonic() - t0)
        if ahead > 0:
            await asyncio.sleep(ahead)
    return sent, start, await _redis_now(bus)


async def _redis_now(bus: Bus) -> float:
    """The Redis clock, which stamps the stream entries' ids."""
    seconds, micros = await bus.command("TIME")
    return int(seconds) + int(micros) / 1e6


async def _steps(bus: Bus, keys: RunKeys, seen: dict[int, float]) -> None:
    """Add (step -> Redis time in s) of the StepFinished entries in the run's log to
    ``seen``: read as the run goes, since the log's spine is trimmed after a checkpoint
    (the run's last step saves one)."""
    async for entry_id, message in bus.read_all(keys.events):
        if isinstance(message, StepFinished):
            seen.setdefault(message.step, int(entry_id.split("-")[0]) / 1000)


async def _wait_step(bus: Bus, keys: RunKeys, step: int, proc: subprocess.Popen[str],
                     seen: dict[int, float]) -> None:
    while True:
        await _steps(bus, keys, seen)
        if seen and max(seen) >= step:
            return
        if proc.poll() is not None:
            raise SystemExit(f"rlbus up ended (exit {proc.returncode}) before step {step}")
        await asyncio.sleep(0.5)


def _window(steps: list[tuple[int, float]], start: float, end: float) -> int:
    return sum(1 for _, at in steps if start <= at < end)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "up.log"
        cmd = [sys.executable, "-m", "rlbus", "up", f"run.output_dir={tmp}",
               f"trainer.total_training_steps={args.steps}", "trainer.save_freq=0",
               "global_profiler.tool=null"]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    cwd=ROOT)
        try:
            url, run_id = _started(log, proc)
            found = asyncio.run(_measure(args, url, RunKeys(run_id), proc))
        finally:
            if proc.poll() is None:
                proc.kill()
        trainer_log = next(Path(tmp).glob("*/logs/trainer.log")).read_text().splitlines()
    _report(args, *found, trainer_log)


def _started(log: Path, proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The embedded Redis's URL and the run's id, as ``rlbus up`` prints them."""
    while True:
        text = log.read_text()
        url = re.search(r"embedded Redis at (\S+)", text)
        run_id = re.search(r"^run (\S+): ", text, re.M)
        if url and run_id:
            return url[1], run_id[1]
        if proc.poll() is not None:
            raise SystemExit(f"rlbus up ended: {text[-2000:]}")
        time.sleep(0.2)


async def _measure(args: argparse.Namespace, url: str, keys: RunKeys,
                   proc: subprocess.Popen[str]
                   ) -> tuple[list[tuple[int, float]], int, float, float, int, int]:
    bus, seen = Bus.from_url(url), dict[int, float]()
    try:
        await _wait_step(bus, keys, args.warm, proc, seen)
        sent, start, end = await _flood(bus, keys, args.rate, args.seconds)
        # Read before the run's end: its embedded Redis goes with rlbus up.
        await _wait_step(bus, keys, args.steps, proc, seen)
        steps = sorted(seen.items())
        dlq = await bus.command("XLEN", keys.dlq)
        dropped = int(await bus.command("GET", keys.dlq_dropped) or 0)
        await asyncio.to_thread(proc.wait, 600)
    finally:
        await bus.close()
    return steps, sent, start, end, dlq, dropped


def _report(args: argparse.Namespace, steps: list[tuple[int, float]], sent: int, start: float,
            end: float, dlq: int, dropped: int, trainer_log: list[str]) -> None:
    span = end - start
    before = _window(steps, start - span, start)
    during = _window(steps, start, end)
    after = _window(steps, end, end + span)
    times = [at for _, at in steps]
    gaps = np.diff(times)
    in_flood = [g for g, at in zip(gaps, times[1:], strict=True) if start <= at <= end + 10]
    junk_lines = sum(1 for line in trainer_log if "refused " in line or "dead letter" in line)
    print(f"flood: {sent} junk entries in {span:.1f} s ({sent / span:,.0f}/s), from step "
          f"{args.warm}")
    print(f"steps in the {span:.0f} s before: {before}; during: {during} "
          f"({during / max(before, 1):.2f}x); the {span:.0f} s after: {after}")
    print(f"longest wait between steps: {max(gaps):.2f} s overall, "
          f"{max(in_flood, default=0.0):.2f} s in and up to 10 s after the flood "
          f"(median {np.median(gaps):.3f} s)")
    print(f"steps trained: {len(steps)} of {args.steps}; dead-letter stream {dlq} entries, "
          f"{dropped} dropped by its cap; trainer log lines about junk: {junk_lines} "
          f"(of {len(trainer_log)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=20_000, help="entries/s (20 000)")
    parser.add_argument("--seconds", type=float, default=30.0, help="flood length (30)")
    parser.add_argument("--warm", type=int, default=60, help="steps before the flood (60)")
    parser.add_argument("--steps", type=int, default=1500, help="the run's steps (1500)")
    run(parser.parse_args())
