"""Issue 36's named faults for bench/chaos.py's trust phase: a full disk and Redis out of
memory, each met by real processes in the middle of the chaos run and each to be named in one
line by every component it ends.

:class:`Faults` adds two scenarios to the trust phase (bench/chaos_trust.py runs them after
its own, one after the other; ``--named-faults`` picks them):

- **disk full**: the trainer's checkpoints (``trainer.default_local_dir``) live, for the whole
  run, on a tmpfs of :data:`DISK_SIZE` the bench mounts (a machine that cannot mount one, no
  root, skips the scenario and says so). The bench fills it with a ballast file that leaves
  less free than the newest checkpoint takes. The trainer must exit 1 at its next checkpoint
  with one line naming the full disk (no traceback) and a ``ComponentFailed`` saying so;
  then the bench removes the ballast and the supervisor starts it again (a person freeing
  space), and the run goes on.
- **Redis out of memory**: the bench sets Redis's ``maxmemory`` just below its used memory
  (:data:`OOM_BELOW`). Every component writes (a liveness key at least), so every one must
  exit 1 with one line naming Redis's used and max memory (no traceback); then the bench
  lifts the limit and the supervisor starts them all again (a person raising the limit),
  and the run goes on.

The supervisor holds its restarts while a fault lasts (a restart into a full disk or a full
Redis only fails again), and the exits are the bench's doing (planned). Whatever the faults
cost, chaos.py's accounting still holds the run to 0 samples lost and 0 trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runschema.messages import ComponentFailed

__all__ = ["DISK_SIZE", "FAULTS", "OOM_BELOW", "Faults"]

DISK_SIZE = "256m"
"""The checkpoints' tmpfs: the chaos run's checkpoints (about 1.3 MB each, all kept) fit."""

OOM_BELOW = 64 * 1024
"""Bytes of ``maxmemory`` below Redis's used memory when the fault starts: the next write
that needs memory is refused (a limit just above the use was not reached in a chaos run: the
trainer's retention trims as fast as the run writes, and the run finished first)."""

FAULTS = ("disk-full", "redis-oom")

EXIT_BOUND_S = 180.0
"""How long a fault may take to end the trainer (a checkpoint comes every
``trainer.save_freq`` steps)."""

OTHERS_GRACE_S = 15.0
"""Once the trainer is out, how long the other parts a fault reaches have to meet it (they
write at every pulse; a rollouter judges the trainer gone after ``heartbeat.timeout_s``)
before the fault is lifted."""


@dataclass
class Ended:
    """How one component met a fault: its exit and its log's lines since the fault."""

    name: str
    exit: int | None = None  # None: still running at the bound
    after_s: float = math.nan
    lines: list[str] = field(default_factory=list)  # lines naming the cause
    traceback: bool = False


@dataclass
class Outcome:
    fault: str
    note: str = ""  # why it did not run, or what it set
    ended: list[Ended] = field(default_factory=list)
    failed_events: list[str] = field(default_factory=list)  # ComponentFailed errors since


class Faults:
    """The named faults of one chaos run (``c``: :class:`bench.chaos.Chaos`)."""

    def __init__(self, c: Any, say: Callable[[str], None], names: list[str]) -> None:
        self.c, self.say, self.names = c, say, names
        self.disk: Path | None = None
        self.mount_note = ""
        self.outcomes: list[Outcome] = []

    # ------------------------------------------------------------------ set-up

    def mount(self) -> list[str]:
        """Mount the checkpoints' tmpfs (when the disk fault is on); the config keys that
        put the checkpoints there."""
        if "disk-full" not in self.names:
            return []
        where = self.c.out / "disk"
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs",
                               str(where)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            self.mount_note = (f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root "
                               "or CAP_SYS_ADMIN")
            return []
        self.disk = where
        return [f"trainer.default_local_dir={where / 'checkpoints'}"]

    def unmount(self, keep: bool) -> None:
        """Unmount the tmpfs, unless the run's files are kept (then it says where)."""
        if self.disk is None:
            return
        if keep:
            self.say(f"the checkpoints' tmpfs stays mounted at {self.disk} (umount it)")
            return
        subprocess.run(["umount", "-l", str(self.disk)], check=False)

    def scenarios(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        plan = {"disk-full": ("disk full", self.disk_full),
                "redis-oom": ("Redis out of memory", self.redis_oom)}
        return [plan[n] for n in self.names]

    # ------------------------------------------------------------------ disk full

    async def disk_full(self) -> None:
        """Fill the checkpoints' disk until the newest checkpoint would not fit; wait for
        the trainer's exit; free it."""
        out = Outcome("disk full")
        self.outcomes.append(out)
        if self.disk is None:
            out.note = f"not run: {self.mount_note}"
            return
        c = self.c
        newest = await c.checkpoints()
        size, free = await asyncio.to_thread(_room, self.disk, newest[0][1] if newest else None)
        ballast = self.disk / "ballast"
        leave = max(size // 3, 16 * 1024)
        out.note = (f"{free - leave} bytes of ballast on the {DISK_SIZE} tmpfs, {leave} left "
                    f"free (a checkpoint: {size})")
        await self._ended_by(out, ["trainer"], lambda: self._fill(ballast, free - leave),
                             lambda: ballast.unlink(missing_ok=True), "disk full")

    @staticmethod
    async def _fill(path: Path, size: int) -> None:
        def write() -> None:
            block = bytes(8 << 20)
            with path.open("wb") as f:
                left = size
                while left > 0:
                    left -= f.write(block[:min(left, len(block))])

        with contextlib.suppress(OSError):  # the disk filled a little earlier: all the better
            await asyncio.to_thread(write)

    # ------------------------------------------------------------------ Redis OOM

    async def redis_oom(self) -> None:
        """Set Redis's ``maxmemory`` just below its used memory; wait for the components'
        exits; lift it. A part other than the trainer may live through it: once the
        trainer's and others' connections are gone Redis's used memory can fall back under
        the limit (seen: 9.47M used of 9.43M, then 9.29M), and a part that wrote nothing
        meanwhile goes on."""
        out = Outcome("Redis out of memory")
        self.outcomes.append(out)
        c = self.c
        used = int((await c.raw("INFO", "memory"))["used_memory"])
        limit = max(1 << 20, used - OOM_BELOW)
        out.note = f"maxmemory {limit} (used {used})"

        async def on() -> None:
            await c.raw("CONFIG", "SET", "maxmemory", str(limit))

        async def off() -> None:
            await c.raw("CONFIG", "SET", "maxmemory", "0")

        await self._ended_by(out, list(c.parts), on, off, "out of memory")

    # ------------------------------------------------------------------ shared

    async def _ended_by(self, out: Outcome, names: list[str],
                        start: Callable[[], Awaitable[None]],
                        end: Callable[[], Awaitable[None] | None], cause: str) -> None:
        """Hold the restarts of ``names``, ``start`` the fault, wait (bounded) for each of
        them to exit, ``end`` the fault, let the supervisor restart them (their exits are
        the bench's doing); then record each one's exit and its lines naming ``cause``."""
        c = self.c
        parts = [c.parts[n] for n in names if c.parts[n].running]
        procs = {p.name: p.proc for p in parts}
        offsets = {p.name: p.log.stat().st_size for p in parts}
        for p in parts:
            p.restart_at = math.inf  # the supervisor waits until the fault is over
        t0 = time.monotonic()
        failed_before = len(c.watch.failures)
        exits: dict[str, tuple[int | None, float]] = {}
        until = t0 + EXIT_BOUND_S  # then, once the trainer is out, OTHERS_GRACE_S more
        try:
            await start()
            while len(exits) < len(parts) and time.monotonic() < until:
                for name, proc in procs.items():
                    if name not in exits and proc is not None and proc.poll() is not None:
                        exits[name] = (proc.returncode, time.monotonic() - t0)
                        if name == "trainer":
                            until = min(until, time.monotonic() + OTHERS_GRACE_S)
                await asyncio.sleep(0.1)
        finally:
            done = end()
            if done is not None:
                await done
            for p in parts:
                if p.proc is not None:
                    p.killed_pids.add(p.proc.pid)  # a planned exit: no crash-loop count
                p.restart_at = None
        for p in parts:
            code, after = exits.get(p.name, (None, math.nan))
            text = _since(p.log, offsets[p.name])
            out.ended.append(Ended(p.name, code, after,
                                   [ln.strip()[:240] for ln in text.splitlines()
                                    if cause in ln], "Traceback" in text))
        out.failed_events = [m.error for _, m in c.watch.failures[failed_before:]
                             if isinstance(m, ComponentFailed)]

    # ------------------------------------------------------------------ verdict

    def verify(self) -> list[str]:
        """Print what each fault did; the failures: the trainer not ended by it, a component
        that exited otherwise than 1 with exactly one line naming the cause, a traceback,
        the trainer's full disk without a ComponentFailed saying so."""
        fails: list[str] = []
        print("  named faults (issue 36)")
        # The trainer must be ended; another part may live through it (see redis_oom) if it
        # says nothing wrong: no traceback, at most the one line naming the cause.
        if not self.outcomes:
            print(f"    none run ({', '.join(self.names) or 'none asked for'})")
        for out in self.outcomes:
            print(f"    {out.fault:<18} {out.note}")
            for e in out.ended:
                print(f"      {e.name}: "
                      + (f"exit {e.exit} after {e.after_s:.1f} s" if e.exit is not None
                         else "went on (still running when the fault was lifted)") + "; "
                      f"{len(e.lines)} line(s) naming it"
                      + (", a TRACEBACK" if e.traceback else "")
                      + (f": {e.lines[0]}" if e.lines else ""))
                survived = e.exit is None and e.name != "trainer" and len(e.lines) <= 1
                if (not survived and (e.exit != 1 or len(e.lines) != 1)) or e.traceback:
                    fails.append(f"{out.fault}: {e.name} exit {e.exit}, {len(e.lines)} line(s) "
                                 f"naming it, traceback {e.traceback}")
            if out.fault == "disk full" and out.ended and not any(
                    err.startswith("disk full") for err in out.failed_events):
                fails.append(f"disk full: no ComponentFailed naming it ({out.failed_events})")
        return fails


def _room(disk: Path, checkpoint: str | None) -> tuple[int, int]:
    """The size of a checkpoint file (1 MiB without one) and the disk's free bytes."""
    size = Path(checkpoint).stat().st_size if checkpoint else 1 << 20
    return size, shutil.disk_usage(disk).free


def _since(log: Path, offset: int) -> str:
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
