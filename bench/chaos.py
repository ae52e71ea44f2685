"""Chaos run (issue 7): never dead by mistake, never hung in silence, never trained twice.

One run of the real components (``python -m trainer|rollouter|profiler_service``: one trainer,
two rollouter replicas, the profiler service with torch traces of a few steps) against its own
redis-server with AOF on, under a process supervisor that restarts whatever exits non-zero,
while the bench:

- SIGKILLs ``--kills`` (20) components at random points (seeded RNG; trainer, both
  rollouters and the profiler service, each at least twice), each restarted by the supervisor;
- kills Redis with SIGKILL once, cuts its AOF before one of the last StepFinished commands
  (what ``appendfsync everysec`` loses with the machine) and restarts it on the same port;
- appends malformed and duplicated entries to every stream: garbage bytes, entries without
  the message field, wrong message types, a Sample contradicting its ticket, tickets and
  samples never issued, byte-for-byte copies of samples, tickets, StepFinished,
  TicketsIssued, StartProfile and DeadLetter entries, a forged WeightsPublished and a forged
  StopProfile;
- flips 128 bytes in the newest checkpoint file the log names between ``--corrupt`` (2) of
  the trainer's kills and their restarts (a bad disk, a torn copy): the resume must skip it
  with one ``checkpoint_corrupt`` warning naming the file, load the checkpoint before it and
  re-apply the steps after it, rebuilding the weights it had published;
- floods the samples stream once, ``--flood-s`` (3) seconds at ``--flood-rate`` (3000)
  entries/s from one client (half undecodable, half samples of tickets never issued): every
  one must be dead-lettered and the trainer say so in one line per interval, not per entry;
- then continues the finished run by one step (a larger ``trainer.total_training_steps``,
  as ``rlbus up`` does) whose update takes more than 40 s (``trainer.ppo_epochs`` sized from
  the pace of the trainer's own updates under chaos), with ``heartbeat.timeout_s`` (8 s) far
  below that, and kills a rollouter in the middle of it.
No test hook: only config keys, signals and entries any Redis client could write.

With issue 36's named faults (bench/chaos_faults.py, in the trust phase; ``--named-faults``):
a full disk under the trainer's checkpoints and Redis at its ``maxmemory``, each to end the
components it reaches with one line naming it; then freed, and the run goes on.

With issue 22 (bench/chaos_trust.py, on unless ``--no-trust``): forged facts in every
role's stream of the log, and a trust phase between the two (the finished run continued by
``--trust-steps``) with a SIGSTOPped rollouter whose liveness key the bench keeps fresh,
``--zombies`` zombie trainers and a ``--redis-stop-s`` Redis SIGSTOP. "The log" is every
role's stream (the trainer's ``events`` with its archive, and ``events:ROLE``) merged by id.

At the end it folds the events log and checks: every step finished (the last copy counts),
no sample trained twice, no forged entry trained, every resume rebuilt the published weights,
the total-queue invariant (every ticket ever issued was trained exactly once, closed with a
reason, or is still open), every dead letter has a reason, every malformed entry was
dead-lettered (or lost with the AOF tail), nobody was declared dead while its liveness key
was fresh, no running component went silent, and the long update was > 40 s with nobody
declared dead. It prints kills survived, entries injected (and what became of each),
samples lost, trained twice, dead-lettered (top reasons), the longest silent waits (between
events, between StepFinished, and without a liveness key), the wall time, and, as findings
outside issue 7's checks, profile sessions the manifest lost; exit code 1 if a check failed.

    .venv/bin/python bench/chaos.py [--kills 20] [--seed 0] [--steps N] [--out DIR] [--keep]
        [--corrupt 2] [--flood-s 3] [--flood-rate 3000] [--weights-transport collective]
        [--redis-kill random|checkpoint] [--long-update-s 50]
        [--no-trust] [--trust-steps 80] [--zombies 2] [--redis-stop-s 60] [--redis-binary PATH]
        [--named-faults disk-full,redis-oom]

About 4 minutes on the 2-core development machine while other jobs shared it (220-255 s
measured, the 40 s+ update included). Logs of every component (each restart appended to the
same file), the AOF and the traces are kept under the output folder when a check fails or
with ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: bus, trainer, tests.aof

import numpy as np  # noqa: E402
from chaos_faults import FAULTS, Faults  # noqa: E402  (bench/, the script's folder)
from chaos_trust import Trust  # noqa: E402

from bus import LOG_ROLES, REFUSAL_LOG_S, Bus, BusError, RunKeys, log_order  # noqa: E402
from rlbus.redis_server import EmbeddedRedis  # noqa: E402
from runschema.authority import refusal  # noqa: E402
from runschema.messages import (  # noqa: E402
    FIELD,
    Array,
    BlobRef,
    CheckpointSaved,
    ComponentFailed,
    DeadLetter,
    DecodeError,
    Heartbeat,
    ProfilerFinished,
    PromptTicket,
    RunFinished,
    RunStarted,
    Sample,
    StartProfile,
    StepFinished,
    StepStarted,
    StopProfile,
    TicketsClosed,
    TicketsIssued,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
    decode,
    encode,
)
from runtime.history import events_folder, read_history  # noqa: E402
from tests.aof import aof_commands, aof_path, cut_aof_before  # noqa: E402
from trainer.ledger import fold as fold_ledger  # noqa: E402
from trainer.ledger import ticket_index, ticket_of_sample  # noqa: E402

__all__ = ["main"]

TIMEOUT_S = 8.0  # heartbeat.timeout_s: far below the long update
INTERVAL_S = 0.5  # heartbeat.interval_s
RESTART_DELAY_S = 0.3  # the supervisor's pause before a restart
MIN_KILL_GAP_S = 1.0
LONG_UPDATE_MIN_S = 40.0
PHASE1_DEADLINE_S = 480.0
PHASE2_DEADLINE_S = 300.0
EXIT_GRACE_S = 60.0  # after RunFinished, components must have exited within this
SAVE_FREQ = 5  # trainer.save_freq: a resume re-applies at most 4 steps
CRASH_LOOP = 5  # unplanned non-zero exits in a row, no step in between: the phase is lost
STALL_DUMP_S = 120.0  # no step for this long: every component is asked for its tasks
PROFILED_STEPS = (1, 12)
ROLES = ("trainer", "rollouter0", "rollouter1", "profiler")
# Kinds of injected entries that must never be trained nor vanish silently.
MALFORMED = {
    ("samples", "garbage"), ("samples", "no-field"), ("samples", "wrong-type"),
    ("samples", "never-issued"), ("samples", "flood-garbage"), ("samples", "flood-never-issued"),
    ("prompts", "garbage"), ("prompts", "no-field"), ("prompts", "wrong-type"),
    ("prompts", "bad-n"), ("prompts", "unservable"),
}


def _say(msg: str) -> None:
    print(f"[chaos {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


T0 = time.monotonic()


# --------------------------------------------------------------------------- processes


@dataclass
class Part:
    """One component (a process and its restarts)."""

    name: str
    module: str
    alive_key: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    killed_pids: set[int] = field(default_factory=set)
    exits: list[tuple[float, int, bool, str]] = field(default_factory=list)
    done: bool = False  # exited 0
    handled_pid: int | None = None  # the exited process the supervisor has dealt with
    restart_at: float | None = None
    log_offset: int = 0
    phase: int = 1
    streak: int = 0  # unplanned non-zero exits in a row with no step finished in between
    streak_progress: int = -1
    clean_exits: list[tuple[float, int]] = field(default_factory=list)  # (t, phase's steps)
    start_times: list[float] = field(default_factory=list)  # bench time of each start

    def running_at(self, t: float) -> bool:
        """Whether a process of this part was running at bench time ``t`` (started before
        it, no exit seen between that start and ``t``)."""
        starts = [s for s in self.start_times if s <= t]
        return bool(starts) and not any(starts[-1] <= e[0] <= t for e in self.exits)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with self.log.open("ab") as f:
            f.write(f"\n=== chaos: start #{self.starts} (phase {self.phase}) at "
                    f"{time.monotonic() - T0:.1f} s ===\n".encode())
            self.log_offset = f.tell()
        out = self.log.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        out.close()
        self.restart_at = None
        self.done = False
        self.start_times.append(time.monotonic() - T0)

    def kill(self) -> bool:
        if not self.running or self.proc is None:
            return False
        self.killed_pids.add(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.kills += 1
        return True

    def terminate(self) -> None:
        """Clean-up at the end: SIGKILL whatever of ours still runs (not a chaos kill)."""
        if self.running and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def last_lines(self, n: int = 3) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return " | ".join(lines[-n:])


# --------------------------------------------------------------------------- state


@dataclass
class Watch:
    """What the bench has seen of the run (followed live from the events stream)."""

    progress: int = 0  # StepFinished events that moved the step (duplicates not counted)
    last_step: int = 0
    run_finished: set[int] = field(default_factory=set)
    profiler_finished: bool = False
    step_started: dict[int, float] = field(default_factory=dict)  # step -> monotonic
    started_step: int = 0  # the latest StepStarted read (in log order)
    step_finished: dict[int, float] = field(default_factory=dict)
    failures: list[tuple[float, ComponentFailed]] = field(default_factory=list)
    update_s: dict[int, float] = field(default_factory=dict)  # step -> trainer/update_s
    redis_up: asyncio.Event = field(default_factory=asyncio.Event)
    # (wall time, monotonic, {key: present}) every 0.25 s while Redis is up
    samples: list[tuple[float, float, dict[str, bool]]] = field(default_factory=list)
    silent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    silent_at: dict[str, float] = field(default_factory=dict)  # bench time the gap ended
    silent_now: dict[str, float | None] = field(default_factory=dict)
    seen_since_spawn: dict[str, int] = field(default_factory=dict)
    run_finished_at: dict[int, float] = field(default_factory=dict)  # steps -> bench time
    paused: set[str] = field(default_factory=set)  # parts stopped on purpose (not silent)
    # Called with (stream, entry id, message, monotonic) for every entry of the log read.
    listeners: list[Callable[[str, str, Any, float], None]] = field(default_factory=list)


@dataclass
class Injected:
    by_stream: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    # (stream, entry id) -> kind; ids alone collide across streams (same ms, seq 0)
    ids: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, stream: str, kind: str, entry_id: str) -> None:
        self.by_stream[stream][kind] += 1
        self.ids[stream, entry_id] = kind

    def has(self, stream: str, entry_id: str) -> bool:
        return (stream, entry_id) in self.ids


# --------------------------------------------------------------------------- the bench


class Chaos:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.run_id = f"chaos-{args.seed}-{os.getpid()}"
        self.keys = RunKeys(self.run_id)
        self.server = EmbeddedRedis(out / "redis", appendonly=True, binary=args.redis_binary)
        self.bus: Bus | None = None
        self.parts: dict[str, Part] = {}
        self.watch = Watch()
        self.inj = Injected()
        self.phase = 1
        self.phase_total = 0
        self.kill_log: list[tuple[float, str, int]] = []  # (t, victim, step when killed)
        self.redis_kill: dict[str, Any] = {}
        self.tail_ids: set[tuple[str, str]] = set()  # (stream key, entry id) the cut removed
        self.tail_tickets: set[int] = set()  # tickets whose TicketsIssued the cut removed
        self.problems: list[str] = []
        self.corrupted: list[tuple[int, str]] = []  # (step, file) flipped by the bench
        self.flooded: dict[str, Any] = {}  # the junk flood: entries, when, steps meanwhile
        self.epochs1 = 1
        self.epochs2 = 1
        self.per_epoch_s = 0.0
        self.stop_chaos = asyncio.Event()
        self.trust = None if args.no_trust else Trust(self, T0, _say, TIMEOUT_S)
        self.faults = Faults(self, _say, [] if args.no_trust else [
            n for n in args.named_faults.split(",") if n])
        self.fault_config: list[str] = []  # the checkpoints' tmpfs (Faults.mount)

    # ------------------------------------------------------------------ helpers

    @property
    def b(self) -> Bus:
        assert self.bus is not None
        return self.bus

    def common(self, total: int, epochs: int) -> list[str]:
        return [f"redis.url={self.server.url}", f"run.id={self.run_id}",
                f"run.output_dir={self.out / 'run'}", *self.config(total, epochs),
                *self.fault_config,
                *([f"rollout.weights_transport={self.args.weights_transport}"]
                  if self.args.weights_transport else [])]

    @staticmethod
    def config(total: int, epochs: int) -> list[str]:
        """Small, fast runs (as tests/procs.py FAST), heartbeats far below the long update,
        checkpoints every 5 steps (a resume re-applies at most 4), torch traces of a few
        steps."""
        steps = ",".join(str(s) for s in PROFILED_STEPS)
        return [
            f"trainer.total_training_steps={total}", f"trainer.ppo_epochs={epochs}",
            "trainer.ppo_mini_batch_size=4", "async_training.require_batches=1",
            "rollout.n=4", "rollout.prompts_per_batch=4", "rollout.replicas=2",
            f"trainer.save_freq={SAVE_FREQ}", "trainer.logger=[console]",
            f"heartbeat.interval_s={INTERVAL_S}", f"heartbeat.timeout_s={TIMEOUT_S}",
            "heartbeat.stall_warn_s=20", "heartbeat.stall_timeout_s=240",
            "global_profiler.tool=torch", f"global_profiler.steps=[{steps}]",
            "global_profiler.handshake_timeout_s=10",
        ]

    def make_parts(self, total: int, epochs: int, extra: list[str] | None = None) -> None:
        args = [*self.common(total, epochs), *(extra or [])]
        logs = self.out / "logs"
        specs = [
            ("profiler", "profiler_service", self.keys.alive("profiler", 0), []),
            ("rollouter0", "rollouter", self.keys.alive("rollouter", 0), ["rollout.rank=0"]),
            ("rollouter1", "rollouter", self.keys.alive("rollouter", 1), ["rollout.rank=1"]),
            ("trainer", "trainer", self.keys.alive("trainer", 0), []),
        ]
        for name, module, key, extra in specs:
            part = self.parts.get(name)
            if part is None:
                part = self.parts[name] = Part(name, module, key, [], logs / f"{name}.log")
            part.args = [*args, *extra]
            part.phase = self.phase

    async def raw(self, *cmd: Any) -> Any:
        return await self.b.command(*cmd)

    def key(self, stream: str) -> str:
        """The Redis key of a short stream name: samples, prompts, control, dlq, events (the
        trainer's facts) or events:ROLE (another role's stream of the log)."""
        if stream.startswith("events:"):
            return self.keys.log(stream.split(":", 1)[1])
        return str(getattr(self.keys, stream))

    def short(self, key: str) -> str:
        """The short name of one of the run's stream keys (:meth:`key`'s inverse)."""
        return key.removeprefix(self.keys.prefix + ":")

    async def read_log(self, on_bad: Callable[[Any], None] | None = None,
                       ) -> list[tuple[str, str, Any]]:
        """The run's whole log as ``(short stream, entry id, message)``: the trainer's
        stream (its archive, then the stream) and every other role's stream, merged by
        entry id (bus.keys.log_order), nothing refused."""
        tagged: list[tuple[Any, int, str, str, Any]] = []
        for rank, role in enumerate(LOG_ROLES):
            key = self.keys.log(role)
            if role == "trainer":
                it = read_history(self.b, key, events_folder(self.out / "run", self.run_id),
                                  on_bad=on_bad)
            else:
                it = self.b.read_all(key, on_bad=on_bad)
            tagged += [(log_order(e.id, role), rank, self.short(key), e.id, e.msg)
                       async for e in it]
        return [(s, i, m) for _, _, s, i, m in sorted(tagged, key=lambda t: t[:2])]

    # ------------------------------------------------------------------ calibration

    def calibrate(self) -> None:
        """Seconds per PPO epoch of this config's update, measured in this process on
        samples shaped like the run's (nothing else of the bench runs yet)."""
        import msgspec
        import torch

        from policy import build_policy
        from policy.text import build_tokenizer
        from runconfig import load_or_exit
        from tasks import build_prompt_source
        from trainer.update import grpo_update

        cfg = load_or_exit(self.config(max(PROFILED_STEPS), 1), "chaos")
        torch.set_num_threads(1)
        torch.manual_seed(0)
        policy = build_policy(msgspec.to_builtins(cfg.model), "cpu")
        policy.train()
        opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
        tok = build_tokenizer(cfg.model)
        prompts = build_prompt_source({"kind": "digits", "min_digits": 4, "max_digits": 4})
        groups = []
        for t in range(4):
            p = prompts.get(t)
            ptoks = np.asarray(tok.encode(p.prompt, bos=True), dtype=np.int32)
            rtoks = np.asarray(tok.encode(p.answer), dtype=np.int32)[:4]
            rtoks = np.concatenate([rtoks, np.asarray([tok.eos_id], dtype=np.int32)])
            groups.append([Sample(
                sample_id=f"t{t}/{i}", ticket_id=f"t{t}", prompt_id=p.prompt_id, index=i, n=4,
                prompt_tokens=Array.of(ptoks), response_tokens=Array.of(rtoks),
                logprobs=Array.of(np.full(len(rtoks), -1.0, dtype=np.float32)),
                reward=float(i % 2), min_version=0, max_version=0) for i in range(4)])

        def timed(epochs: int) -> float:
            tc = msgspec.structs.replace(cfg.trainer, ppo_epochs=epochs)
            t0 = time.perf_counter()
            grpo_update(policy, opt, groups, tc, temperature=1.0, version=0, device="cpu")
            return time.perf_counter() - t0

        timed(5)
        epochs, spent = 0, 0.0
        while spent < 2.0:
            spent += timed(20)
            epochs += 20
        self.per_epoch_s = spent / epochs
        self.epochs1 = self.args.epochs or max(1, round(0.35 / self.per_epoch_s))

    # ------------------------------------------------------------------ background tasks

    async def supervise(self) -> None:
        """Restart whatever exits non-zero, as a process manager would; not after the run
        finished (the profiler service still has its ProfilerFinished to write then)."""
        while True:
            now = time.monotonic()
            for part in self.parts.values():
                if part.proc is None:
                    continue
                if part.restart_at is not None:
                    if now >= part.restart_at:
                        part.spawn()
                    continue
                rc = part.proc.poll()
                if rc is None or part.handled_pid == part.proc.pid:
                    continue
                part.handled_pid = part.proc.pid
                if rc == 0:
                    part.done = True
                    part.exits.append((now - T0, rc, False, ""))
                    part.clean_exits.append((now - T0, self.phase_total))
                    continue
                planned = part.proc.pid in part.killed_pids
                why = "" if planned else part.last_lines()
                part.exits.append((now - T0, rc, planned, why))
                if not planned:
                    _say(f"{part.name} exited {rc} (not killed by the bench): {why}")
                    if self.watch.progress == part.streak_progress:
                        part.streak += 1
                    else:
                        part.streak, part.streak_progress = 1, self.watch.progress
                finished = self.phase_total in self.watch.run_finished
                if part.name == "profiler":
                    finished = finished and self.watch.profiler_finished
                if not finished:
                    part.restart_at = now + RESTART_DELAY_S
            await asyncio.sleep(0.1)

    async def follow(self) -> None:
        """Follow the run's log (every role's stream, merged by id; a fact its stream's role
        may not state is passed over, as every reader does): steps, RunFinished,
        ComponentFailed, ProfilerFinished."""
        w = self.watch
        roles = {self.keys.log(role): role for role in LOG_ROLES}
        cursors = dict.fromkeys(roles, "0")
        while True:
            try:
                read = await self.b.read_after_many(dict(cursors), count=1000, block_ms=200)
            except BusError:
                await asyncio.sleep(0.2)
                continue
            now = time.monotonic()
            merged = []
            for stream, (entries, cursor, _) in read.items():
                cursors[stream] = cursor
                merged += [(log_order(e.id, roles[stream]), 0, stream, e) for e in entries]
            for _, _, stream, (eid, msg) in sorted(merged, key=lambda t: t[:2]):
                if refusal(roles[stream], msg) is not None:
                    continue
                for listen in w.listeners:
                    listen(self.short(stream), eid, msg, now)
                match msg:
                    case StepFinished(step=step) if msg.sample_ids:  # forged ones have none
                        w.update_s[step] = msg.metrics.get("trainer/update_s", math.nan)
                        if step != w.last_step:
                            w.progress += 1
                            w.last_step = step
                        w.step_finished.setdefault(step, now)
                    case StepStarted(step=step):
                        w.step_started.setdefault(step, now)
                        w.started_step = step
                    case RunFinished(steps=steps) if steps < 10**9:  # forged ones say 10**9
                        w.run_finished.add(steps)
                        w.run_finished_at.setdefault(steps, now - T0)
                    case ProfilerFinished():
                        w.profiler_finished = True
                    case ComponentFailed():
                        w.failures.append((now, msg))
                        _say(f"ComponentFailed {msg.role}{msg.rank}: {msg.error[:200]}")

    async def monitor(self) -> None:
        """Sample the liveness keys and the trainer lease every 0.25 s. A running process
        whose own key (the heartbeat's pid is its pid) is missing after its first pulse is
        silent; the longest such stretch per component is kept."""
        w = self.watch

        def gap_ends(name: str, now: float) -> None:
            since = w.silent_now.get(name)
            if since is not None and now - since > w.silent[name]:
                w.silent[name] = now - since
                w.silent_at[name] = now - T0
            w.silent_now[name] = None

        while True:
            await asyncio.sleep(0.25)
            if not w.redis_up.is_set():
                continue
            keys = [p.alive_key for p in self.parts.values()] + [self.keys.trainer_lease]
            try:
                values = await self.raw("MGET", *keys)
            except BusError:
                continue
            now = time.monotonic()
            present = {k: v is not None for k, v in zip(keys, values, strict=True)}
            pids: dict[str, int | None] = {}
            for key, value in zip(keys, values, strict=True):
                with contextlib.suppress(DecodeError):
                    hb = decode(value) if value is not None else None
                    pids[key] = hb.pid if isinstance(hb, Heartbeat) else None
            w.samples.append((time.time(), now, present))
            for part in self.parts.values():
                name = part.name
                pid = part.proc.pid if part.running and part.proc is not None else None
                if pid is None or name in w.paused:
                    gap_ends(name, now)  # a silence that lasted until the process ended
                    continue
                if pids.get(part.alive_key) == pid:
                    w.seen_since_spawn[name] = pid
                    gap_ends(name, now)
                elif w.seen_since_spawn.get(name) == pid and w.silent_now.get(name) is None:
                    w.silent_now[name] = now

    # ------------------------------------------------------------------ injection

    async def recent(self, stream: str, count: int = 200) -> list[tuple[str, list[bytes]]]:
        reply = await self.raw("XREVRANGE", stream, "+", "-", "COUNT", count)
        return [(i.decode(), f) for i, f in reply
                if not self.inj.has(self.short(stream), i.decode())]

    @staticmethod
    def _decoded(fields: list[bytes]) -> Any:
        if len(fields) == 2 and fields[0] == FIELD:
            try:
                return decode(fields[1])
            except DecodeError:
                return None
        return None

    async def copy_latest(self, stream: str, kind: str, cls: type, n: int = 1,
                          scan: int = 300) -> None:
        """Re-append the newest ``n`` real entries of type ``cls`` of ``stream`` (a short
        name: samples, prompts, ...) byte for byte."""
        key = self.key(stream)
        found = [(i, f) for i, f in await self.recent(key, scan)
                 if isinstance(self._decoded(f), cls)][:n]
        for _, fields in reversed(found):
            eid = (await self.raw("XADD", key, "*", *fields)).decode()
            self.inj.add(stream, kind, eid)

    async def open_ticket(self) -> str | None:
        for _, fields in await self.recent(self.keys.events, 300):
            msg = self._decoded(fields)
            if isinstance(msg, TicketsIssued) and msg.ticket_ids:
                return msg.ticket_ids[-1]
        return None

    def actions(self) -> list[tuple[str, str, Callable[[], Awaitable[None]]]]:
        k = self.keys
        junk = {FIELD: b"\x00\xffnot msgpack at all"}
        no_field = {b"junk": b"an entry without the message field"}
        counter = iter(range(10**9))

        def sample(ticket: str, n: int) -> Sample:
            return Sample(
                sample_id=f"{ticket}/0", ticket_id=ticket, prompt_id="p", index=0, n=n,
                prompt_tokens=Array.of(np.asarray([1, 2, 3], dtype=np.int32)),
                response_tokens=Array.of(np.asarray([4], dtype=np.int32)),
                logprobs=Array.of(np.asarray([-0.5], dtype=np.float32)),
                reward=1.0, min_version=0, max_version=0)

        def ticket(tid: str, n: int = 4, min_version: int = 0) -> PromptTicket:
            return PromptTicket(ticket_id=tid, prompt_id="p-forged", prompt="1234",
                                answer="4321", n=n, min_version=min_version)

        def hb() -> Heartbeat:
            return Heartbeat(role="chaos", rank=0, pid=os.getpid())

        async def raw_entry(stream: str, kind: str, fields: dict[bytes, bytes]) -> None:
            key = self.key(stream)
            self.inj.add(stream, kind, await self.b.publish_raw(key, fields))

        async def msg_entry(stream: str, kind: str, msg: Any) -> None:
            self.inj.add(stream, kind, await self.b.publish(self.key(stream), msg))

        async def contradicting() -> None:
            tid = await self.open_ticket()
            if tid is not None:  # n=1 for a ticket of n=4
                await msg_entry("samples", "contradicts-ticket", sample(tid, 1))

        async def forged_weights() -> None:
            ref = BlobRef(store="redis", key=k.blob(f"forged-{next(counter)}"), size=1,
                          sha256="0" * 64, chunks=1)
            await msg_entry("events", "forged-WeightsPublished",
                            WeightsPublished(version=10**9, ref=ref))

        acts: list[tuple[str, str, Callable[[], Awaitable[None]]]] = []
        for stream in ("samples", "prompts", "events", "control", "dlq"):
            acts += [
                (stream, "garbage", lambda s=stream: raw_entry(s, "garbage", junk)),
                (stream, "no-field", lambda s=stream: raw_entry(s, "no-field", no_field)),
            ]
        acts += [
            ("samples", "wrong-type",
             lambda: msg_entry("samples", "wrong-type", ticket("t1"))),
            ("samples", "contradicts-ticket", contradicting),
            ("samples", "never-issued",
             lambda: msg_entry("samples", "never-issued", sample("t99999999", 4))),
            ("samples", "duplicate", lambda: self.copy_latest("samples", "duplicate", Sample, 8)),
            ("prompts", "wrong-type", lambda: msg_entry("prompts", "wrong-type", hb())),
            ("prompts", "bad-n", lambda: msg_entry("prompts", "bad-n", ticket("t90000001", 0))),
            ("prompts", "unservable",
             lambda: msg_entry("prompts", "unservable", ticket("t90000002", 4, 10**6))),
            ("prompts", "never-issued",
             lambda: msg_entry("prompts", "never-issued", ticket("t90000003"))),
            ("prompts", "duplicate",
             lambda: self.copy_latest("prompts", "duplicate", PromptTicket, 4)),
            ("events", "wrong-type", lambda: msg_entry("events", "wrong-type", sample("t0", 4))),
            ("events", "duplicate-StepFinished",
             lambda: self.copy_latest("events", "duplicate-StepFinished", StepFinished)),
            ("events", "duplicate-TicketsIssued",
             lambda: self.copy_latest("events", "duplicate-TicketsIssued", TicketsIssued)),
            ("events", "forged-WeightsPublished", forged_weights),
            ("control", "wrong-type", lambda: msg_entry("control", "wrong-type", hb())),
            ("control", "duplicate-StartProfile",
             lambda: self.copy_latest("control", "duplicate-StartProfile", StartProfile, 1,
                                      scan=1000)),
            ("control", "forged-StopProfile",
             lambda: msg_entry("control", "forged-StopProfile",
                               StopProfile(session_id="forged-session",
                                           roles=["trainer", "rollouter"], reason="chaos"))),
            ("dlq", "wrong-type", lambda: msg_entry("dlq", "wrong-type", hb())),
            ("dlq", "duplicate-DeadLetter",
             lambda: self.copy_latest("dlq", "duplicate-DeadLetter", DeadLetter, 2)),
        ]
        if self.trust is not None:
            acts += self.trust.actions()
        return acts

    async def inject(self) -> None:
        """Every 0.6-1.6 s one more malformed or duplicated entry, cycling through every
        kind on every stream in a shuffled order."""
        acts = self.actions()
        order: list[int] = []
        while not self.stop_chaos.is_set():
            await asyncio.sleep(self.rng.uniform(0.6, 1.6))
            await self.watch.redis_up.wait()
            if self.watch.progress < 1 or self.stop_chaos.is_set():
                continue
            if not order:
                order = list(range(len(acts)))
                self.rng.shuffle(order)
            _, _, act = acts[order.pop()]
            with contextlib.suppress(BusError):
                await act()

    # ------------------------------------------------------------------ kills

    def victims(self, kills: int) -> list[str]:
        base = [*ROLES, *ROLES] if kills >= 8 else []
        weights = {"trainer": 0.4, "rollouter0": 0.2, "rollouter1": 0.2, "profiler": 0.2}
        extra = self.rng.choices(list(weights), weights=list(weights.values()),
                                 k=kills - len(base))
        out = base + extra
        self.rng.shuffle(out)
        return out

    async def kill_redis(self) -> None:
        """SIGKILL Redis, cut its AOF before the second-to-last StepFinished the trainer
        wrote (not one of our copies), start it again on the same port."""
        events = self.keys.events.encode()
        injected = {eid for stream, eid in self.inj.ids if stream == "events"}

        def trainer_step_finished(args: list[bytes]) -> bool:
            if args[0].upper() != b"XADD" or args[1] != events or len(args) < 5:
                return False
            if args[2].decode(errors="replace") in injected:
                return False
            try:
                return isinstance(decode(args[-1]), StepFinished)
            except DecodeError:
                return False

        self.watch.redis_up.clear()
        t0 = time.monotonic()
        step = self.watch.last_step
        self.server.kill()
        path = aof_path(self.server.dir)
        data = path.read_bytes()
        removed = cut_aof_before(path, trainer_step_finished, which=-2)
        self.server.start()
        # What the cut took away: entry ids (the AOF has XADD's ids) and issued tickets.
        for offset, args in aof_commands(data):
            if offset < len(data) - removed or args[0].upper() != b"XADD" or len(args) < 5:
                continue
            self.tail_ids.add((args[1].decode(errors="replace"), args[2].decode(errors="replace")))
            with contextlib.suppress(DecodeError):
                msg = decode(args[-1])
                if isinstance(msg, TicketsIssued):
                    self.tail_tickets.update(i for t in msg.ticket_ids
                                             if (i := ticket_index(t)) is not None)
        down_s = time.monotonic() - t0
        await self.raw("CONFIG", "SET", "auto-aof-rewrite-percentage", "0")
        self.watch.redis_up.set()
        self.redis_kill = {"at_step": step, "removed_bytes": removed, "down_s": down_s}
        _say(f"Redis killed at step {step}; AOF cut by {removed} bytes; back after "
             f"{down_s:.2f} s")

    async def checkpoints(self) -> list[tuple[int, str]]:
        """The steps and files of the checkpoints the trainer's recent log names, newest
        first, whose files are on disk."""
        found = []
        for _, fields in await self.recent(self.keys.events, 400):
            msg = self._decoded(fields)
            if (isinstance(msg, CheckpointSaved) and (msg.step, msg.path) not in found
                    and await asyncio.to_thread(Path(msg.path).is_file)):
                found.append((msg.step, msg.path))
        return found

    async def newest_checkpoint(self) -> tuple[int, str] | None:
        """The newest checkpoint a resume could fall back from: one whose predecessor (the
        one fallback the trainer keeps: its samples are still in Redis) is on disk and
        intact (not flipped by the bench). None: none such (flipping it would rightly stop
        the run: no checkpoint the log names can serve; seen with seed 4, steps 10 and 15
        flipped while step 5 was still on disk)."""
        named = await self.checkpoints()
        flipped = {path for _, path in self.corrupted}
        if len(named) < 2 or named[1][1] in flipped:
            return None
        return named[0]

    async def kill_and_corrupt(self, part: Part) -> bool:
        """SIGKILL the trainer and, before the supervisor starts it again, flip 128 bytes
        in the middle of the newest checkpoint file its log names (the file a resume
        would load)."""
        newest = await self.newest_checkpoint()
        if newest is None:
            return part.kill()
        part.restart_at = math.inf  # the supervisor waits until the file is flipped
        try:
            if not part.kill() or part.proc is None:
                return False
            await asyncio.to_thread(part.proc.wait, 30)
            newest = await self.newest_checkpoint() or newest  # one written meanwhile
            path = Path(newest[1])
            await asyncio.to_thread(_flip_middle, path, 128)
            self.corrupted.append((newest[0], str(path)))
            _say(f"checkpoint {path.name} (step {newest[0]}): 128 bytes flipped before the "
                 "trainer's restart")
            return True
        finally:
            part.restart_at = None  # the supervisor handles the exit and restarts it

    async def flood(self) -> None:
        """One client writes junk into the samples stream, ``--flood-s`` seconds at
        ``--flood-rate`` entries/s, in pipelines of 500: half undecodable, half samples of
        tickets never issued (a broken or hostile rollouter)."""
        a = Array.of(np.asarray([1, 2], dtype=np.int32))
        key = self.keys.samples
        rate, seconds = self.args.flood_rate, self.args.flood_s
        step0, t0, sent = self.watch.last_step, time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            batch, kinds = [], []
            for i in range(sent, sent + 500):
                if i % 2:
                    batch.append(("XADD", key, "*", FIELD, b"\xc1flood %d" % i))
                    kinds.append("flood-garbage")
                else:
                    ticket = f"t{10**8 + i}"
                    batch.append(("XADD", key, "*", FIELD, encode(Sample(
                        sample_id=f"{ticket}/0", ticket_id=ticket, prompt_id="p", index=0,
                        n=1, prompt_tokens=a, response_tokens=a,
                        logprobs=Array.of(np.asarray([-0.1, -0.2], dtype=np.float32)),
                        reward=0.0, min_version=0, max_version=0))))
                    kinds.append("flood-never-issued")
            with contextlib.suppress(BusError):  # Redis killed meanwhile: what went in counts
                ids = await self.b.pipeline(batch)
                for eid, kind in zip(ids, kinds, strict=True):
                    self.inj.add("samples", kind, eid.decode())
            sent += len(batch)
            ahead = sent / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        took = time.monotonic() - t0
        self.flooded = {"entries": sent, "s": took, "from_step": step0,
                        "at": t0 - T0}
        _say(f"flood: {sent} junk entries into the samples stream in {took:.1f} s "
             f"(from step {step0})")

    async def chaos(self, kills: int) -> None:
        """The kill schedule of phase 1: each kill after 1-2 more steps and at least
        MIN_KILL_GAP_S after the previous one, at a random moment, and Redis once in the
        middle."""
        victims = self.victims(kills)
        redis_after = self.rng.randint(kills // 3, max(kills // 3, 2 * kills // 3))
        # The trainer kills that corrupt a checkpoint: from the second on, while there is an
        # intact one to fall back to, until --corrupt were.
        trainer_kills = [i for i, v in enumerate(victims) if v == "trainer"]
        flood_before = (self.rng.randint(2 * kills // 3, max(2 * kills // 3, kills - 1))
                        if self.args.flood_s > 0 else -1)
        last_kill = time.monotonic()
        for i, victim in enumerate(victims):
            if i == flood_before and not self.stop_chaos.is_set():
                await self.watch.redis_up.wait()
                await self.flood()
            if i == redis_after:
                target = self.watch.progress + 2
                await _until(lambda t=target: self.watch.progress >= t
                             or self.stop_chaos.is_set())
                if self.args.redis_kill == "checkpoint":
                    # Inside the update of a step that ends with a checkpoint.
                    await _until(lambda: self.stop_chaos.is_set() or (
                        self.watch.started_step % SAVE_FREQ == 0
                        and self.watch.last_step == self.watch.started_step - 1))
                    await asyncio.sleep(self.rng.uniform(0.02, 0.08))
                if self.stop_chaos.is_set():
                    return
                await self.kill_redis()
                last_kill = time.monotonic()
            target = self.watch.progress + self.rng.randint(1, 2)
            part = self.parts[victim]
            await _until(lambda t=target, p=part, lk=last_kill: self.stop_chaos.is_set() or (
                self.watch.progress >= t and p.running
                and time.monotonic() - lk >= MIN_KILL_GAP_S))
            await asyncio.sleep(self.rng.uniform(0.0, 0.8))
            if self.stop_chaos.is_set():
                return
            corrupt = (victim == "trainer" and i != trainer_kills[0]
                       and len(self.corrupted) < self.args.corrupt)
            killed = await self.kill_and_corrupt(part) if corrupt else part.kill()
            if killed:
                last_kill = time.monotonic()
                self.kill_log.append((last_kill - T0, victim, self.watch.last_step))
                _say(f"kill {len(self.kill_log)}/{kills}: SIGKILL {victim} at step "
                     f"{self.watch.last_step}")

    # ------------------------------------------------------------------ phases

    @staticmethod
    def phase_deadline(steps: int) -> float:
        """A phase of ``steps`` steps that is not done after this long is lost."""
        return max(PHASE1_DEADLINE_S, 6.0 * steps)

    async def wait_phase(self, total: int, deadline_s: float) -> bool:
        """Until RunFinished(total) and every part exited 0 (or gave up); False on timeout."""
        self.phase_total = total
        t0 = time.monotonic()
        finished_at: float | None = None
        moved_at, moved = t0, self.watch.progress
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            if self.watch.progress != moved:
                moved_at, moved = now, self.watch.progress
            elif now - moved_at > STALL_DUMP_S and finished_at is None:
                self.ask_for_tasks(f"no step for {now - moved_at:.0f} s")
                moved_at = now  # again after as long, if it still stands
            if total in self.watch.run_finished and finished_at is None:
                finished_at = now
                _say(f"RunFinished({total})")
            running = [p.name for p in self.parts.values()
                       if p.running or p.restart_at is not None]
            if finished_at is not None and not running:
                return True
            if finished_at is not None and now - finished_at > EXIT_GRACE_S:
                self.problems.append(f"phase {self.phase}: {', '.join(running)} still running "
                                     f"{EXIT_GRACE_S:.0f} s after RunFinished({total})")
                return False
            looping = [p for p in self.parts.values() if p.streak >= CRASH_LOOP]
            if looping:
                p = looping[0]
                self.problems.append(
                    f"phase {self.phase}: crash loop: {p.name} exited non-zero {p.streak} times "
                    f"in a row without a step finishing (last step {self.watch.last_step}); "
                    f"last exit: {p.exits[-1][3]}")
                return False
            if now - t0 > deadline_s:
                self.ask_for_tasks(f"no RunFinished({total}) within {deadline_s:.0f} s")
                await asyncio.sleep(1.0)  # the dumps reach the logs
                last = self.parts["trainer"].last_lines(4) or next(
                    (e[3] for e in reversed(self.parts["trainer"].exits) if e[3]), "")
                self.problems.append(
                    f"phase {self.phase}: no RunFinished({total}) within {deadline_s:.0f} s "
                    f"(last step {self.watch.last_step}); trainer: {last}")
                return False

    def ask_for_tasks(self, why: str) -> None:
        """SIGUSR1 to every running component started a while ago (runtime.process: each
        writes its asyncio tasks' chains of awaits to its log): what a stall waits on."""
        asked = []
        for part in self.parts.values():
            if part.running and part.proc is not None and part.start_times \
                    and time.monotonic() - T0 - part.start_times[-1] > 20.0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(part.proc.pid, signal.SIGUSR1)
                    asked.append(part.name)
        _say(f"{why}: asked {', '.join(asked) or 'nobody'} for their tasks (SIGUSR1; in "
             "their logs)")

    async def phase1(self, steps: int) -> bool:
        self.make_parts(steps, self.epochs1)
        for name in ("profiler", "rollouter0", "rollouter1", "trainer"):
            self.parts[name].spawn()
        chaos = asyncio.create_task(self.chaos(self.args.kills))
        inject = asyncio.create_task(self.inject())
        ok = await self.wait_phase(steps, PHASE1_DEADLINE_S)
        self.stop_chaos.set()
        for t in (chaos, inject):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await t
        if len(self.kill_log) < self.args.kills:
            self.problems.append(f"only {len(self.kill_log)} of {self.args.kills} kills happened "
                                 f"before the run finished: raise --steps")
        if not self.redis_kill:
            self.problems.append("the Redis kill did not happen before the run finished")
        return ok

    async def phase2(self, steps: int) -> dict[str, Any]:
        """Continue the finished run by one step whose update takes > 40 s; kill a rollouter
        during it. Returns what was seen."""
        self.phase = 2
        total = steps + 1
        # The long update's epochs from the pace of the trainer's own updates under chaos,
        # a fast one (10th percentile: the least contended): at that pace it lasts
        # --long-update-s, slower is longer.
        rates = sorted(u / self.epochs1 for s, u in self.watch.update_s.items()
                       if s <= steps and u > 0 and s not in PROFILED_STEPS)
        if rates:
            self.per_epoch_s = rates[len(rates) // 10]
        self.epochs2 = self.args.long_epochs or math.ceil(
            self.args.long_update_s / self.per_epoch_s)
        _say(f"fast updates under chaos: {self.per_epoch_s * 1000:.1f} ms per epoch; "
             f"ppo_epochs {self.epochs2} for the long update")
        self.make_parts(total, self.epochs2)
        t_start = time.monotonic()
        for name in ("profiler", "rollouter0", "rollouter1", "trainer"):
            self.parts[name].spawn()
        failures_before = len(self.watch.failures)

        async def kill_during_update() -> None:
            await _until(lambda: total in self.watch.step_started)
            await asyncio.sleep(12.0)
            part = self.parts["rollouter1"]
            if total not in self.watch.step_finished and part.kill():
                self.kill_log.append((time.monotonic() - T0, "rollouter1", steps))
                _say(f"kill {len(self.kill_log)}: SIGKILL rollouter1 during the long update")

        killer = asyncio.create_task(kill_during_update())
        ok = await self.wait_phase(total, PHASE2_DEADLINE_S)
        killer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await killer
        seen: dict[str, Any] = {"ok": ok, "ran": True,
                                "failures": self.watch.failures[failures_before:]}
        unplanned = [(p.name, e) for p in self.parts.values() for e in p.exits
                     if e[0] >= t_start - T0 and e[1] != 0 and not e[2]]
        seen["unplanned"] = unplanned
        begin = self.watch.step_started.get(total)
        end = self.watch.step_finished.get(total)
        seen["window"] = (begin, end)
        missing: Counter[str] = Counter()
        n = 0
        if begin is not None and end is not None:
            for _, mono, present in self.watch.samples:
                if begin <= mono <= end:
                    n += 1
                    for key, name in ((self.keys.trainer_lease, "trainer lease"),
                                      (self.parts["trainer"].alive_key, "trainer"),
                                      (self.parts["rollouter0"].alive_key, "rollouter0")):
                        if not present.get(key, False):
                            missing[name] += 1
        seen["samples"] = n
        seen["missing"] = missing
        return seen

    # ------------------------------------------------------------------ the verdict

    async def verify(self, steps: int, phase2: dict[str, Any]) -> list[str]:
        """Fold the log and check everything; prints the figures; returns the failures."""
        k = self.keys
        bad_events = Counter[str]()
        # The whole log: every role's stream merged (the trainer's with what retention
        # archived, RUN/events). The bench's own entries are not facts of the run; a fact
        # a component wrote to a stream whose role may not state it is a bug.
        log = await self.read_log(on_bad=lambda b: bad_events.update(["x"]))
        fails: list[str] = list(self.problems)
        misplaced = [(s, eid, type(m).__name__) for s, eid, m in log
                     if not self.inj.has(s, eid)
                     and refusal(k.log_role(k.prefix + ":" + s) or "", m) is not None]
        if misplaced:
            fails.append(f"facts written to a stream whose role may not state them: "
                         f"{misplaced[:5]}")
        events = [(eid, m) for s, eid, m in log if not self.inj.has(s, eid)]
        msgs = [m for _, m in events]
        total = steps + 1

        # Steps: the last copy counts.
        finished: dict[int, StepFinished] = {}
        finished_ids: dict[int, str] = {}
        for eid, m in events:
            if isinstance(m, StepFinished):
                finished[m.step] = m
                finished_ids[m.step] = eid
        if sorted(finished) != list(range(1, total + 1)):
            missing = sorted(set(range(1, total + 1)) - set(finished))
            fails.append(f"steps missing from the log: {missing[:10]}")
        trained: list[str] = [sid for s in sorted(finished) for sid in finished[s].sample_ids]
        twice = [sid for sid, c in Counter(trained).items() if c > 1]
        if twice:
            fails.append(f"{len(twice)} sample(s) trained twice: {twice[:5]}")
        trained_entries = {eid for s in finished.values() for eid in s.entry_ids}
        forged_trained = [eid for eid in trained_entries if self.inj.has("samples", eid)
                          and "duplicate" not in self.inj.ids["samples", eid]]
        if forged_trained:
            fails.append(f"forged entries trained: {forged_trained[:5]}")
        # The recorded entries hold the trained samples (what a replay reads); entries
        # below a durable checkpoint may have been trimmed (run.retention=checkpoint).
        mismatched = retained = 0
        for s in finished.values():
            found = await self.b.read_ids(k.samples, s.entry_ids)
            for e, sid in zip(s.entry_ids, s.sample_ids, strict=True):
                if e in found:
                    retained += 1
                    got = found[e]
                    mismatched += not (isinstance(got, Sample) and got.sample_id == sid)
        if mismatched:
            fails.append(f"{mismatched} StepFinished entry id(s) do not hold the sample recorded")
        resumed = [m for m in msgs if isinstance(m, TrainerResumed)]
        if any(m.weights_match is False for m in resumed):
            fails.append("a resumed trainer did not rebuild the weights it had published")
        corrupt_told = [m.message for m in msgs if isinstance(m, WarningRaised)
                        and m.code == "checkpoint_corrupt"]
        flood_lines = self.refusal_lines()
        flood_bound = (time.monotonic() - T0) / REFUSAL_LOG_S + self.parts["trainer"].starts + 1
        if self.flooded and flood_lines > flood_bound:
            fails.append(f"the trainer said {flood_lines} lines about refused samples entries "
                         f"(the flood's {self.flooded['entries']} among them), more than one "
                         f"per {REFUSAL_LOG_S:g} s interval and incarnation ({flood_bound:.0f})")
        for step, path in self.corrupted:
            if not any(path in text for text in corrupt_told):
                fails.append(f"the checkpoint of step {step} the bench corrupted ({path}) was "
                             "never named in a checkpoint_corrupt warning")
        runs_finished = [m.steps for m in msgs if isinstance(m, RunFinished)]

        # The total-queue invariant, from the ledger and independently.
        ledger = fold_ledger(msgs)
        issued: dict[int, int] = {}  # index -> n
        reissues: Counter[str] = Counter()
        for m in msgs:
            if isinstance(m, TicketsIssued):
                for tid in m.ticket_ids:
                    i = ticket_index(tid)
                    if i is not None:
                        issued.setdefault(i, m.n)
                if m.attempt > 0:
                    reissues[re.sub(r"\d+", "N", m.reason)] += len(m.ticket_ids)
        closed: dict[int, str] = {}
        closed_why: Counter[str] = Counter()
        for m in msgs:
            if isinstance(m, TicketsClosed):
                closed_why[m.reason] += len(m.ticket_ids)
                for tid in m.ticket_ids:
                    i = ticket_index(tid)
                    if i is not None:
                        closed.setdefault(i, m.reason)
        steps_of: dict[int, set[int]] = defaultdict(set)
        count_of: Counter[int] = Counter()
        for s in finished.values():
            for sid in s.sample_ids:
                i = ticket_of_sample(sid)
                if i is not None:
                    steps_of[i].add(s.step)
                    count_of[i] += 1
        open_ = set(ledger.open)
        lost = sorted(i for i in issued if i not in steps_of and i not in closed
                      and i not in open_)
        trained_twice = sorted(i for i, st in steps_of.items() if len(st) > 1)
        partial = sorted(i for i in steps_of if count_of[i] != issued.get(i, -1))
        never_issued = sorted(i for i in steps_of if i not in issued)
        no_reason = sorted(i for i, r in closed.items() if not r.strip())
        both = sorted(i for i in closed if i in steps_of)
        gaps = sorted(set(range(ledger.issued)) - set(issued))
        if lost:
            fails.append(f"{len(lost)} ticket(s) lost (issued, neither trained, closed nor open): "
                         f"{[f't{i}' for i in lost[:10]]}")
        if trained_twice:
            fails.append(f"tickets trained in two steps: {[f't{i}' for i in trained_twice[:10]]}")
        if partial:
            fails.append(f"tickets trained with the wrong number of samples: {partial[:10]}")
        if never_issued:
            fails.append(f"samples of never-issued tickets trained: {never_issued[:10]}")
        if no_reason:
            fails.append(f"tickets closed without a reason: {no_reason[:10]}")
        if both:
            fails.append(f"tickets both trained and closed: {both[:10]}")
        # Numbers whose only issue was in the lost tail are skipped for good (harmless: the
        # log never promised them); any other gap is a ticket lost.
        unexplained = [i for i in gaps if i not in self.tail_tickets]
        if unexplained:
            fails.append(f"ticket numbers below the ledger's count never issued: "
                         f"{unexplained[:10]}")
        # Every ticket in the prompts stream (ours excluded) was recorded as issued.
        unrecorded = set()
        async for eid, m in self.b.read_all(k.prompts):
            if isinstance(m, PromptTicket) and not self.inj.has("prompts", eid):
                i = ticket_index(m.ticket_id)
                if i is None or i not in issued:
                    unrecorded.add(m.ticket_id)
        if unrecorded:
            fails.append(f"tickets in the prompts stream never recorded: {sorted(unrecorded)[:10]}")

        # Dead letters.
        letters: list[tuple[str, DeadLetter]] = []
        async for eid, m in self.b.read_all(k.dlq):
            if isinstance(m, DeadLetter) and not self.inj.has("dlq", eid):
                letters.append((eid, m))
        empty = [eid for eid, m in letters if not m.reason.strip()]
        if empty:
            fails.append(f"{len(empty)} dead letter(s) without a reason")
        reasons = Counter(re.sub(r"\d+", "N", m.reason)[:90] for _, m in letters)
        lettered = {(m.source_stream, m.entry_id) for _, m in letters}

        # What became of every injected entry.
        fate: dict[str, Counter[str]] = defaultdict(Counter)
        silent_drop: list[str] = []
        groups = {k.samples: "trainer", k.prompts: "rollouter"}
        last_delivered: dict[str, str] = {}
        for stream, group in groups.items():
            for g in await self.b.groups(stream):
                if g.name == group:
                    last_delivered[stream] = g.last_delivered_id
        for (stream, eid), kind in self.inj.ids.items():
            key = self.key(stream)
            exists = bool(await self.raw("XRANGE", key, eid, eid))
            if key in groups:
                if (key, eid) in lettered:
                    outcome = "dead-lettered"
                elif not exists and (key, eid) in self.tail_ids:
                    outcome = "lost with the AOF tail"
                elif _id_gt(eid, last_delivered.get(key, "0-0")):
                    outcome = "unread at the end"
                elif exists and await self.raw("XPENDING", key, groups[key], eid, eid, 1):
                    outcome = "pending at the end"
                else:
                    outcome = ("acked (duplicate or served)" if exists
                               else "acked, then trimmed (retention)")
                    if (stream, kind) in MALFORMED:
                        silent_drop.append(f"{stream}:{kind}:{eid}")
            else:
                outcome = ("in the log (skipped by readers)" if exists
                           else "lost with the AOF tail" if (key, eid) in self.tail_ids
                           else "gone (trimmed?)")
            fate[stream][outcome] += 1
        if silent_drop:
            fails.append(f"malformed entries acked without a dead letter: {silent_drop[:5]}")

        # Death declarations: mistaken when the bench saw the peer's key within the window.
        failures = [(m, self._mistaken(m, at)) for at, m in self.watch.failures]
        for m, mistaken in failures:
            if mistaken:
                fails.append(f"{m.role}{m.rank} declared a live peer dead: {m.error[:160]}")
            elif "no progress" in m.error:
                fails.append(f"{m.role}{m.rank} hung: {m.error[:200]}")
        stalls = [m for m in msgs if isinstance(m, WarningRaised) and m.code == "trainer_stalled"]
        warnings = Counter(f"{m.source}:{m.code}" for m in msgs if isinstance(m, WarningRaised))
        notes = self.profile_notes()
        silent = {name: s for name, s in self.watch.silent.items() if s > TIMEOUT_S}
        if silent:
            fails.append(f"running components silent (no liveness key) longer than "
                         f"{TIMEOUT_S:.0f} s: {silent}")

        # The long update.
        long_s = finished[total].metrics.get("trainer/update_s", 0.0) if total in finished else 0.0
        if "ran" not in phase2:
            fails.append("the long-update phase did not run (phase 1 failed)")
        elif long_s <= LONG_UPDATE_MIN_S:
            fails.append(f"the long update took {long_s:.1f} s, not > {LONG_UPDATE_MIN_S:.0f} s "
                         "(raise --long-update-s)")
        if phase2["failures"]:
            fails.append(f"declared dead during the long-update phase: "
                         f"{[m.error[:100] for _, m in phase2['failures']]}")
        if phase2["unplanned"]:
            fails.append(f"unplanned exits during the long-update phase: {phase2['unplanned']}")
        if phase2["missing"]:
            fails.append(f"liveness keys missing during the long update: "
                         f"{dict(phase2['missing'])} of {phase2['samples']} samples")

        # Silent waits from the log: gaps between consecutive events while the run was live.
        def ms(eid: str) -> int:
            return int(eid.split("-")[0])

        live = events
        gap, gap_at = 0.0, ""
        paused = False  # between the two phases (RunFinished .. the trainer's RunStarted)
        for (a, ma), (b_, mb) in itertools.pairwise(live):
            if isinstance(ma, RunFinished) and ma.steps < total:
                paused = True
            if paused and isinstance(mb, RunStarted | TrainerResumed):
                paused = False
                continue
            if paused:
                continue
            d = (ms(b_) - ms(a)) / 1000
            if d > gap:
                gap, gap_at = d, f"{type(ma).__name__} -> {type(mb).__name__}"
        sf = sorted((ms(e), s) for s, e in finished_ids.items())
        sf_gap, sf_at = 0.0, 0
        for (a, _), (b_, sb) in itertools.pairwise(sf):
            if (b_ - a) / 1000 > sf_gap:
                sf_gap, sf_at = (b_ - a) / 1000, sb
        sf_gap_p1 = max(((b_ - a) / 1000 for (a, _), (b_, sb) in itertools.pairwise(sf)
                         if sb <= steps), default=0.0)

        # ---------------------------------------------------------------- print
        by_role = Counter(v for _, v, _ in self.kill_log)
        restarts = {p.name: p.starts - 1 for p in self.parts.values()}
        unplanned = [(p.name, e) for p in self.parts.values() for e in p.exits
                     if e[1] != 0 and not e[2]]
        print()
        print(f"chaos run {self.run_id} (seed {self.args.seed}): {total} steps "
              f"({steps} under chaos + 1 long update), output {self.out}")
        print(f"  kills survived      {len(self.kill_log)} SIGKILL ("
              + ", ".join(f"{r} {by_role[r]}" for r in ROLES) + ") + Redis kill -9 with AOF cut"
              f" ({self.redis_kill.get('removed_bytes', 0)} bytes cut at step "
              f"{self.redis_kill.get('at_step', '?')}, down {self.redis_kill.get('down_s', 0):.2f}"
              " s)")
        print("  restarts            " + ", ".join(f"{n} {c}" for n, c in restarts.items())
              + f"; unplanned non-zero exits {len(unplanned)}")
        for name, (t, rc, _, why) in unplanned:
            print(f"      {name} exit {rc} at {t:.0f} s: {why[:220]}")
        n_inj = sum(sum(c.values()) for c in self.inj.by_stream.values())
        print(f"  entries injected    {n_inj}")
        for stream, kinds in self.inj.by_stream.items():
            print(f"      {stream:8s} {sum(kinds.values()):4d}: "
                  + ", ".join(f"{kd} {c}" for kd, c in sorted(kinds.items())))
            print(f"      {'':8s}       -> " + ", ".join(f"{o} {c}" for o, c in
                                                          sorted(fate[stream].items())))
        print(f"  undecodable events  {sum(bad_events.values())} skipped by the log reader")
        print(f"  trained entries     {retained} of {len(trained)} still in the samples "
              "stream (the rest trimmed below a checkpoint), every one the sample recorded"
              if not mismatched else f"  trained entries     {mismatched} MISMATCHED")
        print(f"  tickets             issued {len(issued)}, trained {len(steps_of)}, "
              f"closed {len(closed)}, open at the end {len(open_)} "
              f"({', '.join(f't{i}' for i in sorted(open_)[:12])}), reissued attempts "
              f"{sum(reissues.values())} ({dict(reissues.most_common(4))})")
        if closed_why:
            print("  tickets closed      " + "; ".join(f"{c} {r}" for r, c in closed_why.items()))
        print(f"  samples lost        {len(lost)}"
              + (f" (ticket numbers issued only in the lost AOF tail, never in the log: "
                 f"{', '.join(f't{i}' for i in gaps)})" if gaps else ""))
        print(f"  trained twice       {len(twice)} samples, {len(trained_twice)} tickets")
        print(f"  dead-lettered       {len(letters)}; top reasons:")
        for reason, c in reasons.most_common(8):
            print(f"      {c:4d}  {reason}")
        if self.flooded:
            f = self.flooded
            print(f"  junk flood          {f['entries']} entries in {f['s']:.1f} s at "
                  f"{f['at']:.0f} s (step {f['from_step']}); the trainer's lines about refused "
                  f"samples entries in the whole run: {flood_lines} (bound {flood_bound:.0f})")
        print(f"  corrupt checkpoints {len(self.corrupted)} flipped (steps "
              f"{[step for step, _ in self.corrupted]}), {len(corrupt_told)} "
              "checkpoint_corrupt warnings"
              + "".join(f"\n      {text[:200]}" for text in corrupt_told[:4]))
        print(f"  resumes             {len(resumed)} TrainerResumed (weights_match "
              f"{dict(Counter(str(m.weights_match) for m in resumed))}); RunFinished "
              f"{runs_finished}")
        print(f"  declared dead       {len(failures)} ComponentFailed"
              + "".join(f"\n      {m.role}{m.rank} ({'MISTAKEN' if mk else 'peer really absent'}"
                        f"): {m.error[:160]}" for m, mk in failures))
        print(f"  warnings            {dict(warnings.most_common())}")
        print(f"  stall warnings      {len(stalls)}"
              + "".join(f"\n      {m.message[:200]}" for m in stalls[:3]))
        print(f"  longest silent wait {gap:.1f} s between events ({gap_at}); "
              f"{sf_gap:.1f} s between StepFinished (before step {sf_at}; "
              f"{sf_gap_p1:.1f} s under chaos); longest a running component's liveness key "
              "was missing: " + ", ".join(
                  f"{n} {self.watch.silent.get(n, 0.0):.1f} s"
                  + (f" (ended at {self.watch.silent_at[n]:.0f} s)" if n in self.watch.silent_at
                     else "") for n in ROLES))
        print(f"  long update         step {total}: update {long_s:.1f} s "
              f"(trainer.ppo_epochs={self.epochs2}, heartbeat.timeout_s={TIMEOUT_S:g}); "
              f"liveness sampled {phase2['samples']} times during it, missing "
              f"{dict(phase2['missing']) or 'never'}; ComponentFailed during the phase "
              f"{len(phase2['failures'])}")
        for note in notes:
            print(f"  profiling           {note}")
        print(f"  steps               ppo_epochs={self.epochs1} under chaos; the long update's "
              f"epochs from {self.per_epoch_s * 1000:.1f} ms/epoch (a fast update then)")
        if self.trust is not None:
            fails += await self.trust.verify(log, set(issued))
        fails += self.faults.verify()
        return fails

    def refusal_lines(self) -> int:
        """Lines of the trainer's log (every incarnation) about refused samples entries."""
        try:
            text = self.parts["trainer"].log.read_text(errors="replace")
        except OSError:
            return 0
        return len(re.findall(r"refused \d+ entr(?:y|ies) of \S*samples", text))

    def profile_notes(self) -> list[str]:
        """The profiler service's manifest against the trace files on disk (reported, not a
        check of issue 7)."""
        folder = self.out / "run" / "profiles" / self.run_id
        try:
            sessions = json.loads((folder / "manifest.json").read_text())["sessions"]
        except (OSError, ValueError, KeyError):
            return [f"no readable manifest.json in {folder}"]
        traces = sorted(p.name for p in folder.glob("*.json.gz"))
        status = Counter(s.get("status") for s in sessions)
        listed = {s.get("path") for s in sessions if s.get("status") == "ok"}
        unlisted = [t for t in traces if t not in listed]
        notes = [f"manifest: {len(sessions)} sessions {dict(status)}; {len(traces)} trace files "
                 "on disk"]
        if unlisted:
            notes.append(f"FINDING: trace files on disk the manifest does not list as ok: "
                         f"{', '.join(unlisted)}")
        return notes

    def _mistaken(self, m: ComponentFailed, seen_at: float) -> bool:
        """A death declaration is mistaken when a peer it names was running (its process,
        when the bench read the declaration at ``seen_at``) and had its key (seen by the
        bench) inside the timeout window before it was said. A peer that had exited is
        really absent, whatever its key said meanwhile (one that failed on Redis out of
        memory could not refresh it, then deleted it at exit)."""
        if "no rollouter is alive" in m.error:
            named = [self.parts["rollouter0"], self.parts["rollouter1"]]
            keys = [p.alive_key for p in named]
        elif "trainer" in m.error and ("gone" in m.error or "no trainer" in m.error):
            named, keys = [self.parts["trainer"]], [self.keys.trainer_lease]
        else:
            return False
        if not any(p.running_at(seen_at - T0 - 0.5) for p in named):
            return False
        lo, hi = m.ts - TIMEOUT_S + 1.0, m.ts - 0.5
        return any(present.get(key, False) for wall, _, present in self.watch.samples
                   if lo <= wall <= hi for key in keys)

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        steps = self.args.steps or 4 * self.args.kills + 15
        _say(f"calibrating the update ({self.out})")
        self.calibrate()
        _say(f"{self.per_epoch_s * 1000:.1f} ms per PPO epoch here: ppo_epochs {self.epochs1} "
             "under chaos")
        self.fault_config = self.faults.mount()
        self.server.start()
        self.bus = Bus.from_url(self.server.url)
        await self.raw("CONFIG", "SET", "auto-aof-rewrite-percentage", "0")  # a plain AOF
        self.watch.redis_up.set()
        helpers = [asyncio.create_task(c()) for c in (self.supervise, self.follow, self.monitor)]
        fails: list[str] = []
        try:
            _say(f"phase 1: {steps} steps, {self.args.kills} kills, Redis kill, injections")
            ok = await self.phase1(steps)
            phase2: dict[str, Any] = {"failures": [], "unplanned": [], "window": (None, None),
                                      "samples": 0, "missing": Counter()}
            if ok and self.trust is not None:
                a = self.args
                _say(f"trust phase: {a.trust_steps} more steps, forgeries, a dead rollouter "
                     f"with a fresh key, {a.zombies} zombie trainer(s), Redis SIGSTOP "
                     f"{a.redis_stop_s:.0f} s")
                ok = await self.trust.phase(steps, a.trust_steps, a.zombies, a.redis_stop_s)
                steps += a.trust_steps
            if ok:
                _say("phase 2: one more step with a long update")
                phase2 = await self.phase2(steps)
            fails = await self.verify(steps, phase2)
        finally:
            for t in helpers:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, BusError):
                    await t
            for part in self.parts.values():
                part.terminate()
            with contextlib.suppress(Exception):
                await self.b.close()
            self.server.stop()
            self.faults.unmount(keep=self.args.keep or bool(fails))
        print(f"  wall time           {time.monotonic() - T0:.0f} s")
        if fails:
            print("\nFAILED:")
            for f in fails:
                print(f"  - {f}")
            return 1
        print("\nall checks passed")
        return 0


def _flip_middle(path: Path, n: int) -> None:
    """Invert ``n`` bytes in the middle of the file at ``path``."""
    with path.open("r+b") as f:
        at = max(0, path.stat().st_size // 2 - n // 2)
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


async def _until(pred: Callable[[], bool], every_s: float = 0.1) -> None:
    """Poll ``pred`` (state kept by the bench's own tasks) until it holds."""
    while True:
        if pred():
            return
        await asyncio.sleep(every_s)


def _id_gt(a: str, b: str) -> bool:
    def key(x: str) -> tuple[int, int]:
        ms, _, seq = x.partition("-")
        return int(ms), int(seq or 0)

    return key(a) > key(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs under chaos (20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0,
                        help="steps under chaos (default 4 * kills + 15)")
    parser.add_argument("--long-update-s", type=float, default=50.0,
                        help="the long update's length at a fast pace seen under chaos "
                        "(50 s; it must come out > 40 s)")
    parser.add_argument("--epochs", type=int, default=0, help="ppo_epochs under chaos "
                        "(default: calibrated to ~0.35 s an update)")
    parser.add_argument("--long-epochs", type=int, default=0,
                        help="ppo_epochs of the long update (default: calibrated)")
    parser.add_argument("--redis-kill", choices=("random", "checkpoint"), default="random",
                        help="when Redis is killed: after a random step (default), or inside "
                        "the update of a step that ends with a checkpoint")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: a "
                        "temporary one, removed when every check passed unless --keep)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--redis-binary", default=None,
                        help="redis-server to run (default: the embedded one, as rlbus up; "
                             "a Redis >= 7 adds the ACL forgeries, refused by Redis)")
    parser.add_argument("--no-trust", action="store_true", help="leave out issue 22's "
                        "forgeries and its trust phase (bench/chaos_trust.py)")
    parser.add_argument("--trust-steps", type=int, default=80,
                        help="steps of the trust phase (80)")
    parser.add_argument("--weights-transport", default="",
                        help="rollout.weights_transport of the run (default: the run's "
                             "default); collective: every kill of a rollouter may land in a "
                             "broadcast round")
    parser.add_argument("--flood-s", type=float, default=3.0,
                        help="seconds of the junk flood into the samples stream (3; 0: none)")
    parser.add_argument("--flood-rate", type=int, default=3000,
                        help="junk entries per second of the flood (3000)")
    parser.add_argument("--corrupt", type=int, default=2,
                        help="trainer kills after which the newest checkpoint file is "
                             "corrupted before the restart (2)")
    parser.add_argument("--zombies", type=int, default=2,
                        help="zombie trainers in the trust phase (2)")
    parser.add_argument("--redis-stop-s", type=float, default=60.0,
                        help="how long Redis is SIGSTOPped in the trust phase (60 s)")
    parser.add_argument("--named-faults", default=",".join(FAULTS),
                        help="issue 36's faults in the trust phase, comma-separated "
                             f"(default {','.join(FAULTS)}; '' for none)")
    args = parser.parse_args(argv)
    unknown = set(args.named_faults.split(",")) - {"", *FAULTS}
    if unknown:
        parser.error(f"--named-faults: unknown {sorted(unknown)} (known: {', '.join(FAULTS)})")
    logging.getLogger("bus").setLevel(logging.ERROR)  # the readers' notes on our garbage
    out = args.out or Path(tempfile.mkdtemp(prefix="rlbus-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    rc = asyncio.run(Chaos(args, out.resolve()).run())
    if rc == 0 and args.out is None and not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    elif rc != 0 or args.keep:
        print(f"logs and data kept in {out}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
