"""A long run, fast: Redis memory, the profiler service's cost per new event and a trainer
resume's time to its first new step, at 1k, 10k and 100k steps of a synthetic run.

No model. One process and one :class:`bus.Bus` play every part of a run against an embedded
redis-server, with the real message types, the real Redis commands and the real order of
entries in every stream:

* trainer (``trainer.app.Trainer._step``, ``trainer.core.StepCore``), through the trainer's
  own parts: every write by its fenced writer (``trainer.writer.Writer``: the lease's EVAL,
  each write requiring the last StepFinished, the state folded from what it writes), tickets
  by its dispatch (``trainer.dispatch.Dispatch.issue``, written by ``Writer.issue``:
  TicketsIssued + PromptTickets within the folded ledger's budget); StepStarted, the step
  barrier, weights (``RedisBlobStore`` put + WeightsPublished, blobs of all but the newest
  ``KEEP_WEIGHTS`` publications deleted),
  StepFinished with the real sample ids, entry ids and the trainer's metric keys together
  with the acks of those samples (``Writer.finish_step``), the per-step log check and control
  read; every ``trainer.save_freq`` steps the snapshot file the writer makes
  (``Writer.snapshot`` into ``RUN/checkpoints/step-K.state``), CheckpointSaved, then the
  trainer's own ``trainer.retention.trim_after_checkpoint`` (samples below the newest entry
  the step trained, prompts below the newest ticket, the events archived to ``RUN/events``
  and trimmed below the safe point), as ``run.retention=checkpoint`` does
  (``--keep-events``: the events stream kept whole, as before events retention);
* rollouter: its ``rollouter`` group reads the tickets and acks them after publishing
  ``rollout.n`` Samples per ticket (~``--sample-bytes`` each: int32 prompt and response token
  ids, float32 log-probs) in one MULTI/EXEC;
* profiler service: tails the run's log (every role's stream, merged by entry id and checked
  against its role, as ``runtime.LogFollower`` does), folds each new entry into its state
  (``profiler_service.state.apply``, kept incrementally, never refolded), decides
  (``profiler_service.schedule.decide``) after a batch that changed it and publishes the
  decisions (the step-1 StartProfile to control, ProfilerReady to ``events:profiler``); the
  trainer (in its stream) and the rollouter (in ``events:rollouter``) report the step-1
  session (ProfileStarted / ProfileStopped);
* liveness: every ``--pulse-every`` steps (one "second" of synthetic time) the three parts
  refresh their TTL keys (``bus.pulse``: SET PX), the trainer renews its lease, and the
  trainer (the rollouters' and profiler's streams), the rollouter (the trainer's and the
  rollouters') and the profiler (all five) read what is new in the log (and the DLQ /
  control).

Per step: 2 prompts x 4 samples (``trainer.ppo_mini_batch_size=2``,
``async_training.require_batches=1``, ``rollout.n=4``; ``trigger_parameter_sync_step=1``:
new weights every step), so 8 samples of ~``--sample-bytes`` (~33 KB) go through the samples
stream per step. ``staleness_threshold=1`` (a budget of 4 tickets) lets the rollouter answer
the next step's tickets while the trainer trains this one, as in an async run, so a step is
two waves of concurrent round trips (``asyncio.gather``): [trainer reads its samples, puts
the weights blob, checks its log, reads control, raises the barrier; rollouter acks and
reads tickets], then [the trainer's writes in its order: WeightsPublished, (a checkpoint
step: the snapshot, CheckpointSaved), StepFinished + acks, the next tickets +
TicketsIssued, the next StepStarted, beside the rollouter publishing its answers and the old
blobs' DEL]. Old weight blobs go with one DEL per sync, as the trainer's.

At each point K (``--points``, default 1000 10000 100000; each a checkpoint step) it measures:

* Redis: ``INFO memory`` used_memory after step K (after its trim) and just before the trim,
  XLEN and ``MEMORY USAGE`` of each stream and of the weight blobs: which key grows;
* profiler: time per new event of ``apply`` (and of ``apply`` + ``decide`` whenever the state
  changed), over the next ``--window`` events after K from the state folded up to K, repeated
  ``--reps`` times (apply is pure; the points take turns): the best, and the median;
* resume, log part, the real code: ``trainer.resume.read_log`` (what the trainer's
  ``Writer.read_log`` runs: the newest snapshot whose position is in the log + fold the
  events after it);
  ``trainer.resume.snapshots`` (reading every snapshot file) timed alone; the same with the
  newest snapshot hidden (a crash just before checkpoint K: a checkpoint window of events to
  fold); and the old way, folding the whole events log from 0 with ``trainer.state.apply``.
  Each resumed state must equal the driver's own; the best of ``--resume-reps``. Also timed:
  a proposed ``read_log`` that stops at the newest snapshot the log confirms instead of
  decoding every snapshot file first (bench code, not the trainer's), and what a restarted
  trainer's watch (``trainer.watch.Watch.follow``) reads in the background (the whole log
  from "0", 1000 entries per XREAD, decoded);
* resume, whole: the real ``python -m trainer`` on this run (a real checkpoint .pt of the tiny
  model written at the path CheckpointSaved(K) names), from spawn to its StepStarted(K+1) in
  the log; then it is stopped (SIGTERM) and the synthetic run goes on from the log, as a
  resumed trainer would; the best of ``--trainer-runs`` starts (``--no-real-trainer`` skips
  this). The answers to step K+1's tickets are held back until then, so it finds nothing to
  gather (the synthetic samples would fail its validation).

Best-of figures, because the machine this runs on may be shared: other processes make single
timings bimodal (2-3x), and the best is what the code itself costs.

Under events retention, "the whole log" (the old way's fold, the lazy read's fallback) is
the archive and then the stream (``runtime.history.read_history``), as the trainer reads it.

It prints a table, the 100k/1k ratios (the aim: each at most 1.5, and Redis memory within a
few checkpoint windows of samples), and where memory goes: bytes per step in the events
stream vs one checkpoint window of samples, the events' bytes by message type, and, tried on
the Redis of the last point after its measurements, what archiving the events before the
newest checkpoint's snapshot (before its last StepFinished) to a file and trimming them leaves
in used_memory, and what a resume then costs (only with ``--keep-events``; ``--no-archive``
skips it). Exit 0.

    .venv/bin/python bench/long_run.py [--points 1000 10000 100000] [--sample-bytes 4096]
                                       [--no-real-trainer] [--keep] [--keep-events]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import msgspec
import numpy as np

from bus import (
    LOG_ROLES,
    RUNS_STREAM,
    Bus,
    Consumer,
    Delivery,
    Entry,
    Lease,
    RunKeys,
    log_order,
    pulse,
)
from profiler_service.records import Fact, ServiceState
from profiler_service.schedule import decide
from profiler_service.state import apply as service_apply
from rlbus.redis_server import EmbeddedRedis
from runconfig import Config, config_to_dict, load_config
from runschema.authority import refusal
from runschema.messages import (
    Array,
    CheckpointSaved,
    Heartbeat,
    Message,
    ProfileStarted,
    ProfileStopped,
    PromptTicket,
    RunStarted,
    Sample,
    StartProfile,
    StepFinished,
    StepStarted,
    StopProfile,
    TrainerResumed,
    WeightsPublished,
    decode,
    encode,
)
from runtime.history import events_folder, read_history
from storage.files import atomic_write
from tasks import build_prompt_source
from trainer.dispatch import ROLLOUTER_GROUP, Dispatch
from trainer.lease import token
from trainer.process import GROUP, consumer_name
from trainer.resume import Snapshot, read_log, snapshots, write_checkpoint
from trainer.retention import trim_after_checkpoint
from trainer.state import TrainerState
from trainer.state import apply as trainer_apply
from trainer.weights import KEEP_WEIGHTS
from trainer.writer import Writer
from weights.blobs import RedisBlobStore

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]

RUN_ID = "longrun"
PROMPTS_PER_STEP = 2
N = 4
SAVE_FREQ = 100
PROMPT_TOKENS = 128
COMPOSITION_ENTRIES = 4000
"""Newest events entries whose types and sizes are counted at each point."""
WEIGHTS_BLOB_BYTES = 4096
"""Bytes of each synthetic weights blob (a real one is the model; KEEP_WEIGHTS are kept)."""

# The keys of the trainer's StepFinished metrics (trainer.update.grpo_update, the window's
# stale share, trainer.metrics.step_gauges and verl_step_metrics): the real event's size.
METRIC_KEYS = (
    "critic/score/mean", "critic/score/max", "staleness/mean", "staleness/max",
    "staleness/stale_share", "actor/loss", "actor/pg_clipfrac", "actor/entropy",
    "actor/grad_norm", "actor/approx_kl", "response_length/mean",
    "staleness/window_stale_share", "trainer/idle_ratio", "trainer/update_s",
    "rollouter/idle_ratio", "samples/queue_depth", "throughput/samples_per_s",
    "tickets/issued", "tickets/outstanding", "tickets/budget", "tickets/reissued",
    "samples/refused", "rollout/failures", "staleness/discarded_groups",
)


def run_overrides(url: str, output_dir: Path, total_steps: int) -> list[str]:
    """The run's config (also what the real trainer is started with)."""
    return [
        f"run.id={RUN_ID}", f"run.output_dir={output_dir}", f"redis.url={url}",
        "run.retention=checkpoint", f"trainer.total_training_steps={total_steps}",
        f"trainer.save_freq={SAVE_FREQ}", f"trainer.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        "async_training.require_batches=1", "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1", f"rollout.n={N}",
        f"rollout.prompts_per_batch={PROMPTS_PER_STEP}", "trainer.device=cpu",
        "global_profiler.tool=torch", "global_profiler.steps=[1]",
    ]


async def read_commands(bus: Bus, control: str, cursor: str) -> tuple[list[Any], str]:
    """New profiling commands after ``cursor`` (what runtime.Component.read_commands reads)."""
    entries, cursor = await bus.read_after(control, cursor, count=1000)
    return [msg for _, msg in entries if isinstance(msg, StartProfile | StopProfile)], cursor


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Window:
    """The next events the profiler folds after point ``step``, from ``state``."""

    step: int
    state: ServiceState
    entries: list[tuple[str | None, Fact]] = field(default_factory=list)


@dataclass
class Point:
    """Everything measured at one point."""

    step: int
    used_memory: int = 0
    used_memory_pre_trim: int = 0
    samples_pre_trim: tuple[int, int] = (0, 0)  # (XLEN, MEMORY USAGE) just before the trim
    streams: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (XLEN, bytes)
    blob_bytes: int = 0
    archive_bytes: int = 0
    keys: int = 0
    snapshot_files: int = 0
    snapshots_s: float = float("nan")
    read_log_s: float = float("nan")
    read_log_events: int = 0
    window_read_log_s: float = float("nan")
    window_events: int = 0
    whole_fold_s: float = float("inf")
    whole_events: int = 0
    follow_s: float = float("inf")
    lazy_s: float = float("inf")
    lazy_window_s: float = float("inf")
    states_match: bool = True
    composition: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Newest events by type: (entries, encoded bytes)."""
    step_finished: StepFinished | None = None
    real_s: float | None = None
    real_runs: list[float] = field(default_factory=list)
    real_events_read: int | None = None
    real_phases: tuple[float, float] | None = None
    """Of the fastest start: spawn to TrainerResumed, TrainerResumed to StepStarted (s)."""
    real_note: str = ""
    apply_us: float = float("nan")
    decide_us: float = float("nan")
    apply_med_us: float = float("nan")
    decide_med_us: float = float("nan")
    prof_events: int = 0


class Driver:
    """Every part of a run, driven step by step against one Redis (see the module doc)."""

    def __init__(self, bus: Bus, cfg: Config, run_dir: Path, sample_bytes: int,
                 points: Sequence[int]) -> None:
        self.bus = bus
        self.cfg = cfg
        self.keys = RunKeys(RUN_ID)
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.points = set(points)
        self.epoch = secrets.token_hex(4)
        # A long TTL: the measurements pause the driver for seconds.
        self.lease = Lease(bus, self.keys.trainer_lease, token(self.epoch), 600.0)
        self.trainer_in = Consumer(bus, self.keys.samples, GROUP, consumer_name(self.epoch),
                                   dlq_stream=self.keys.dlq)
        self.rollouter_in = Consumer(bus, self.keys.prompts, ROLLOUTER_GROUP, "rollouter-0",
                                     dlq_stream=self.keys.dlq)
        self.blobs = RedisBlobStore(bus, self.keys)
        tc = cfg.task
        self.prompts = build_prompt_source({"kind": tc.kind, "path": tc.path,
                                            "min_digits": tc.min_digits,
                                            "max_digits": tc.max_digits, "seed": tc.seed})
        ac = cfg.async_training
        self.need = ac.require_batches * cfg.trainer.ppo_mini_batch_size * cfg.rollout.n
        # trainer: its own writer and ticket dispatch
        self.writer = Writer(bus, self.keys, self.lease)
        self.dispatch = Dispatch(cfg, self.prompts, self.keys.dlq)
        self.version = 0
        self.started_step = 0
        self.control_last = "0"
        # the trainer reads the rollouters' and the profiler's streams of the log
        self.events_last = self._cursors("rollouter", "profiler")
        self.dlq_last = "0"
        # rollouter: the trainer's and the rollouters' streams
        self.r_events = self._cursors("trainer", "rollouter")
        self.r_control = "0"
        self.r_version = 0
        self.r_unacked: list[Delivery] = []
        self.r_deferred: list[Sample] = []
        # armed profiling sessions per role (what the agents would run)
        self.sessions: dict[str, list[StartProfile]] = {"trainer": [], "rollouter": []}
        # profiler service
        self.prof = ServiceState()
        self.prof_cursor = self._cursors(*LOG_ROLES)  # every role's stream
        self.prof_own: set[str] = set()
        self.windows: list[Window] = []
        self.done_windows: list[Window] = []
        # samples: a small pool of ~sample_bytes payloads (Redis stores every copy anyway)
        rng = np.random.default_rng(0)
        resp = max(1, (sample_bytes - 200 - 4 * PROMPT_TOKENS) // 8)
        self.pool = [
            (Array.of(rng.integers(0, 14, PROMPT_TOKENS, dtype=np.int32)),
             Array.of(rng.integers(0, 14, resp, dtype=np.int32)),
             Array.of(-rng.random(resp, dtype=np.float32)))
            for _ in range(16)
        ]
        self.measured: dict[int, Point] = {}
        self.last_snapshot = b""
        self.events_retention = True  # Trainer._trim archives and trims the events stream
        self.archive = events_folder(run_dir.parent, RUN_ID)

    # ------------------------------------------------------------------ trainer side

    async def _issue(self, version: int) -> None:
        """The tickets the budget allows, written as the trainer writes them."""
        issued = self.dispatch.issue(self.writer.state.ledger, version)
        if issued is not None:
            await self.writer.issue(issued)

    @property
    def state(self) -> TrainerState:
        """The trainer's state, as its writer folded it."""
        return self.writer.state

    def _cursors(self, *roles: str) -> dict[str, str]:
        return {self.keys.log(role): "0" for role in roles}

    async def _poll_log(self, cursors: dict[str, str]) -> tuple[list[Entry], bool]:
        """runtime.LogFollower.poll: one XREAD of the log streams after ``cursors`` (which
        move on), merged by id (the trainer's facts first within a millisecond), each
        entry checked against its stream's role (runschema.authority); and whether a stream
        filled the read (more to come)."""
        read = await self.bus.read_after_many(dict(cursors), count=1000)
        merged: list[tuple[tuple[int, int, int], int, Entry]] = []
        full = False
        for stream, (entries, cursor, is_full) in read.items():
            cursors[stream] = cursor
            full |= is_full
            role = self.keys.log_role(stream) or ""
            merged += [(log_order(e.id, role), 0, e) for e in entries
                       if refusal(role, e.msg) is None]
        merged.sort(key=lambda t: t[:2])
        return [e for _, _, e in merged], full

    async def _publish(self, items: Sequence[tuple[str, Message]]) -> None:
        """Events through the trainer's writer (one fenced script, folded)."""
        if items:
            await self.writer.publish(*(msg for _, msg in items))  # type: ignore[arg-type]

    def _profile_events(self, role: str, step: int, *, begin: bool) -> list[Message]:
        """ProfileStarted (begin) / ProfileStopped (end) of ``role``'s sessions at ``step``."""
        out: list[Message] = []
        for cmd in self.sessions[role]:
            if begin and step == cmd.first_step:
                out.append(ProfileStarted(session_id=cmd.session_id, role=role, rank=0,
                                          step=step, tool=cmd.tool))
            if not begin and step == cmd.last_step:
                out.append(ProfileStopped(
                    session_id=cmd.session_id, role=role, rank=0, first_step=cmd.first_step,
                    last_step=cmd.last_step, tool=cmd.tool,
                    path=f"{role}0-{cmd.session_id}.json.gz", bytes=250_000, duration_s=0.2))
        return out

    def _begin_items(self, step: int) -> list[tuple[str, Message]]:
        items: list[tuple[str, Message]] = [
            (self.keys.events, m) for m in self._profile_events("trainer", step, begin=True)]
        items.append((self.keys.events, StepStarted(step=step, param_version=self.version)))
        return items

    async def _read_control(self) -> None:
        commands, self.control_last = await read_commands(
            self.bus, self.keys.control, self.control_last)
        self._arm("trainer", commands)

    def _arm(self, role: str, commands: Sequence[Any]) -> None:
        for cmd in commands:
            if isinstance(cmd, StartProfile) and role in cmd.roles:
                self.sessions[role].append(cmd)

    async def _check_log(self) -> None:
        last = self.writer.last_finished_id
        if last is not None and not await self.bus.read_ids(self.keys.events, [last]):
            raise RuntimeError(f"StepFinished at {last} left the log")

    def _old_blob_keys(self, state: TrainerState) -> list[str]:
        """Trainer._drop_old_weights: blobs of all but the newest KEEP_WEIGHTS publications
        ``state`` remembers."""
        refs = [ref for _, ref in state.weights]
        keep = {ref.key for ref in refs[-KEEP_WEIGHTS:]}
        return sorted({f"{ref.key}:{i}" for ref in refs[:-KEEP_WEIGHTS] if ref.key not in keep
                       for i in range(max(ref.chunks, 1))})

    async def _put_weights(self, version: int) -> Any:
        blob = version.to_bytes(8, "little") * (WEIGHTS_BLOB_BYTES // 8)
        return await self.blobs.put(f"weights-v{version}-{self.epoch}", blob)

    async def _drop(self, keys: list[str]) -> None:
        if keys:
            await self.bus.delete(*keys)

    def _metrics(self, step: int) -> dict[str, float]:
        x = (step % 997) / 997
        return {k: x + i for i, k in enumerate(METRIC_KEYS)}

    def _save_snapshot(self, step: int) -> None:
        """The .state file trainer.resume.write_checkpoint writes beside the .pt (the .pt
        itself only at the points, for the real trainer)."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        data = self.writer.snapshot()
        self.last_snapshot = data
        atomic_write(self.ckpt_dir / f"step-{step:06d}.state", data)

    def ckpt_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:06d}.pt"

    async def _trim(self, trained: Sequence[str]) -> None:
        """Trainer._trim: the trainer's own retention (without events retention, only the
        samples and prompts streams, as before it)."""
        if not self.events_retention:
            newest = max(trained, key=lambda i: tuple(int(p) for p in i.split("-")))
            await self.bus.trim_safely(self.keys.samples, minid=newest)
            latest = await self.bus.latest(self.keys.prompts)
            if latest is not None:
                await self.bus.trim_safely(self.keys.prompts, minid=latest.id)
            return
        warning = await trim_after_checkpoint(
            self.bus, self.keys, self.run_dir, trained, keep_weights=KEEP_WEIGHTS,
            keep_checkpoints=self.cfg.trainer.max_actor_ckpt_to_keep,
            last_step=self.state.last_step, current=self.state.checkpoint()[1],
            fence=(self.keys.trainer_lease, self.lease.token), rollouter_ranks=[0])
        if warning is not None:
            raise RuntimeError(warning.message)

    # ------------------------------------------------------------------ rollouter side

    def _samples(self, ticket: PromptTicket, step: int) -> list[Sample]:
        out = []
        for i in range(ticket.n):
            prompt, response, logprobs = self.pool[(step * 7 + i) % len(self.pool)]
            out.append(Sample(
                sample_id=f"{ticket.ticket_id}/{i}", ticket_id=ticket.ticket_id,
                prompt_id=ticket.prompt_id, index=i, n=ticket.n, prompt_tokens=prompt,
                response_tokens=response, logprobs=logprobs, reward=float(i % 2),
                min_version=ticket.min_version, max_version=ticket.min_version, rank=0,
                gen_time_s=0.05,
                finish_reason="eos", attempt=ticket.attempt))
        return out

    def _answers(self, deliveries: Sequence[Delivery]) -> list[Sample]:
        """The rollouter's answers to the tickets it read (``rollout.n`` samples each)."""
        return [s for d in deliveries if isinstance(d.msg, PromptTicket)
                for s in self._samples(d.msg, self.started_step)]

    async def _rollouter_follow(self) -> None:
        """The rollouter's event poll (newest weights) and control read."""
        while True:
            entries, more = await self._poll_log(self.r_events)
            for _, msg in entries:
                if isinstance(msg, WeightsPublished):
                    self.r_version = msg.version
            if not more:
                break
        commands, self.r_control = await read_commands(self.bus, self.keys.control,
                                                       self.r_control)
        self._arm("rollouter", commands)

    async def _trainer_follow(self) -> None:
        """trainer.watch.Watch.follow: the events log and the DLQ."""
        while True:
            _, more = await self._poll_log(self.events_last)
            if not more:
                break
        _, self.dlq_last = await self.bus.read_after(self.keys.dlq, self.dlq_last, count=1000)

    # ------------------------------------------------------------------ profiler service

    def _prof_fold(self, msg: Fact, entry_id: str | None) -> bool:
        new = service_apply(self.prof, msg, entry_id)
        for w in self.windows:
            if len(w.entries) < self.window_size:
                w.entries.append((entry_id, msg))
        changed = new is not self.prof
        self.prof = new
        return changed

    async def profiler_poll(self) -> None:
        """ProfilerService: fold the new events, decide after a batch that changed the
        state, publish the decisions (folded at once, skipped when read back)."""
        dirty = False
        while True:
            entries, more = await self._poll_log(self.prof_cursor)
            for entry_id, msg in entries:
                if entry_id in self.prof_own:
                    self.prof_own.discard(entry_id)
                    continue
                dirty |= self._prof_fold(msg, entry_id)
            if not more:
                break
        if dirty:
            barrier = await self.bus.get_barrier(self.keys.barrier)
            for out in decide(self.cfg.global_profiler, self.prof, barrier, None):
                out = msgspec.structs.replace(out, ts=time.time())
                if isinstance(out, StartProfile):
                    await self.bus.publish(self.keys.control, out)
                    self._prof_fold(out, None)
                else:
                    entry_id = await self.bus.publish(self.keys.log("profiler"), out)
                    self.prof_own.add(entry_id)
                    self._prof_fold(out, entry_id)
        for w in [w for w in self.windows if len(w.entries) >= self.window_size]:
            self.windows.remove(w)
            self.done_windows.append(w)

    window_size = 1000

    # ------------------------------------------------------------------ liveness

    async def _pulses(self, step: int) -> None:
        ttl = self.cfg.heartbeat.timeout_s
        ka = self.keys.alive
        await asyncio.gather(
            pulse(self.bus, ka("trainer", 0), Heartbeat(
                role="trainer", rank=0, pid=os.getpid(), state=f"step {step}",
                metrics={"trainer/version": float(self.version)}), ttl),
            pulse(self.bus, ka("rollouter", 0), Heartbeat(
                role="rollouter", rank=0, pid=os.getpid(), state=f"weights v{self.r_version}",
                metrics={"rollouter/idle_ratio": 0.1,
                         "rollouter/version": float(self.r_version)}), ttl),
            pulse(self.bus, ka("profiler", 0), Heartbeat(
                role="profiler", rank=0, pid=os.getpid(), state="following",
                metrics={"sessions": float(self.prof.sent),
                         "pending_requests": float(len(self.prof.pending)),
                         "last_started_step": float(self.prof.last_started_step)}), ttl),
            self.lease.renew(),
        )

    async def second(self, step: int) -> None:
        """What happens once per synthetic second."""
        await asyncio.gather(self._pulses(step), self.profiler_poll(),
                             self._rollouter_follow(), self._trainer_follow())

    # ------------------------------------------------------------------ the run

    async def start(self) -> None:
        """Trainer start-up (RunStarted, weights v0, the first tickets); the profiler sends
        its step-1 session; the rollouter answers the first tickets."""
        keys = self.keys
        holder = await self.lease.acquire()
        if holder is not None:
            raise RuntimeError(f"lease held by {holder}")
        await self.trainer_in.ensure_group()
        await self.rollouter_in.ensure_group()
        cfg_tree = config_to_dict(self.cfg)
        await self._publish([(keys.events, RunStarted(run_id=RUN_ID, config=cfg_tree))])
        await self.bus.publish(RUNS_STREAM, RunStarted(run_id=RUN_ID, config=cfg_tree))
        await self.second(0)  # the profiler sends the step-1 session and ProfilerReady
        await self._read_control()
        await self._rollouter_follow()
        await self.bus.set_barrier(keys.barrier, 1)
        ref = await self._put_weights(0)
        await self._publish([(keys.events, WeightsPublished(version=0, ref=ref, step=0))])
        await self._issue(self.version)
        started = self._profile_events("rollouter", 1, begin=True)
        if started:
            await self.bus.publish_many(keys.log("rollouter"), started)
        tickets = await self.rollouter_in.read(count=self.cfg.rollout.prompts_per_batch,
                                               block_ms=None)
        await self.bus.publish_many(keys.samples, self._answers(tickets), atomic=True)
        self.r_unacked = list(tickets)

    async def step(self, k: int) -> None:
        """Trainer step ``k``; meanwhile the rollouter answers the tickets of step ``k + 1``
        (a budget of two steps of tickets: ``staleness_threshold=1``)."""
        keys = self.keys
        t0 = time.monotonic()
        version = self.version + 1  # trigger_parameter_sync_step=1: new weights every step
        work: list[Awaitable[Any]] = [
            self.trainer_in.read(count=256, block_ms=None),
            self.rollouter_in.read(count=self.cfg.rollout.prompts_per_batch, block_ms=None),
            self._put_weights(version),
            self._check_log(),
            self._read_control(),
            self.bus.set_barrier(keys.barrier, k + 1),
        ]
        if self.r_unacked:
            work.append(self.rollouter_in.ack(*self.r_unacked))
        if self.started_step < k:
            work.append(self._publish(self._begin_items(k)))
            self.started_step = k
        got, tickets, ref, *_ = await asyncio.gather(*work)
        while len(got) < self.need:
            more = await self.trainer_in.read(count=256, block_ms=1000)
            if not more:
                raise RuntimeError(f"step {k}: {len(got)} of {self.need} samples arrived")
            got += more
        pairs = [(d.id, d.msg) for d in got if isinstance(d.msg, Sample)]
        self.version = version
        weights = WeightsPublished(version=version, ref=ref, step=k)
        entry_ids = [eid for eid, _ in pairs]
        finished = StepFinished(
            step=k, sample_ids=[s.sample_id for _, s in pairs], metrics=self._metrics(k),
            duration_s=time.monotonic() - t0, param_version=version, entry_ids=entry_ids)
        # The rollouter's answers to the next step's tickets (held back at a point, so that
        # the real trainer started there finds nothing to gather).
        answers = self._answers(tickets)
        self.r_unacked = list(tickets)
        rollout: list[Awaitable[Any]] = []
        if k in self.points:
            self.r_deferred = answers
        elif answers:
            rollout.append(self.bus.publish_many(keys.samples, answers, atomic=True))
        begin = [] if k in self.points else self._begin_items(k + 1)
        await asyncio.gather(self._trainer_writes(k, weights, finished), *rollout)
        await self._drop(self._old_blob_keys(self.state))
        if k % SAVE_FREQ == 0:
            if k in self.points:
                await self._measure_memory(k, pre_trim=True)
            await self._trim(entry_ids)
        await self._issue(version)
        await self._publish(begin)
        self.trainer_in.acked(entry_ids)
        if begin:
            self.started_step = k + 1
        stopped = self._profile_events("trainer", k, begin=False)
        if stopped:
            await self._publish([(keys.events, m) for m in stopped])
        stopped = self._profile_events("rollouter", k, begin=False)
        if stopped:
            await self.bus.publish_many(keys.log("rollouter"), stopped)

    async def _trainer_writes(self, k: int, weights: WeightsPublished,
                              finished: StepFinished) -> None:
        """The step's writes in the trainer's order: the weights, the checkpoint when due
        (the snapshot's position is the WeightsPublished entry), StepFinished + its acks."""
        await self.writer.publish(weights)
        if k % SAVE_FREQ == 0:
            self._save_snapshot(k)
            await self.writer.publish(CheckpointSaved(step=k, path=str(self.ckpt_path(k)),
                                                      param_version=weights.version))
        await self.writer.finish_step(finished, GROUP)

    async def release_rollout(self) -> None:
        """Publish the answers held back at a point."""
        if self.r_deferred:
            await self.bus.publish_many(self.keys.samples, self.r_deferred, atomic=True)
            self.r_deferred = []

    # ------------------------------------------------------------------ measurements

    async def _measure_memory(self, k: int, *, pre_trim: bool) -> None:
        point = self.measured.setdefault(k, Point(step=k))
        info = await self.bus.command("INFO", "memory")
        used = int(info["used_memory"])
        if pre_trim:
            point.used_memory_pre_trim = used
            point.samples_pre_trim = (await self.bus.length(self.keys.samples),
                                      await self._usage(self.keys.samples))
            return
        point.used_memory = used
        names = {"events": self.keys.events,
                 **{f"events:{r}": self.keys.log(r) for r in LOG_ROLES if r != "trainer"},
                 "samples": self.keys.samples,
                 "prompts": self.keys.prompts, "control": self.keys.control,
                 "dlq": self.keys.dlq, "runs": RUNS_STREAM}
        for name, key in names.items():
            point.streams[name] = (await self.bus.length(key), await self._usage(key))
        cursor: Any = 0
        blob_bytes = 0
        while True:
            cursor, batch = await self.bus.command(
                "SCAN", cursor, "MATCH", self.keys.blob("*"), "COUNT", 1000)
            for key in batch:
                blob_bytes += await self._usage(key)
            if int(cursor) == 0:
                break
        point.blob_bytes = blob_bytes
        point.archive_bytes = sum(f.stat().st_size for f in self.archive.glob("archive-*"))
        point.keys = int(await self.bus.command("DBSIZE"))
        newest = await self.bus.command("XREVRANGE", self.keys.events, "+", "-", "COUNT",
                                        COMPOSITION_ENTRIES)
        for _, fields in newest:
            raw = fields[1]
            msg = decode(raw)
            name = type(msg).__name__
            count, size = point.composition.get(name, (0, 0))
            point.composition[name] = (count + 1, size + len(raw))
            if isinstance(msg, StepFinished) and point.step_finished is None:
                point.step_finished = msg

    async def _usage(self, key: str | bytes) -> int:
        value = await self.bus.command("MEMORY", "USAGE", key, "SAMPLES", "0")
        return int(value or 0)

    async def _read_log(self) -> tuple[float, int, TrainerState]:
        """The trainer's resume log reading (Trainer._read_log = trainer.resume.read_log)."""
        t0 = time.perf_counter()
        read = await read_log(self.bus, self.keys, self.ckpt_dir)
        return time.perf_counter() - t0, read.entries_read, read.state

    async def _lazy_read_log(self) -> tuple[float, int, TrainerState]:
        """trainer.resume.read_log as it could be (a proposal, not the trainer's code):
        snapshot files newest first (names from os.scandir, sorted as strings: a glob of
        Path objects costs ~10 us a file), stopping at the first one that decodes and whose
        position and last StepFinished the log holds, instead of decoding every snapshot
        file before looking at any."""
        t0 = time.perf_counter()
        state, start = TrainerState(), "0"
        for name in await asyncio.to_thread(_snapshot_names, self.ckpt_dir):
            try:
                data = await asyncio.to_thread((self.ckpt_dir / name).read_bytes)
                snap = msgspec.msgpack.decode(data, type=Snapshot)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            wanted = [snap.position] + ([snap.last_finished_id] if snap.last_finished_id
                                        else [])
            if len(await self.bus.read_ids(self.keys.events, wanted)) == len(set(wanted)):
                state, start = snap.state, snap.position
                break
        count = 0
        async for entry in read_history(self.bus, self.keys.events, self.archive, start):
            state = trainer_apply(state, entry.msg)
            count += 1
        return time.perf_counter() - t0, count, state

    async def _measure_resume(self, k: int, reps: int) -> None:
        point = self.measured[k]
        times = []
        for _ in range(reps):
            gc.collect()  # no collector debt of the previous rep in this one
            t0 = time.perf_counter()
            snaps = list(snapshots(self.ckpt_dir))
            times.append(time.perf_counter() - t0)
        point.snapshot_files, point.snapshots_s = len(snaps), min(times)
        times = []
        for _ in range(reps):
            gc.collect()
            elapsed, point.read_log_events, state = await self._read_log()
            times.append(elapsed)
            point.states_match &= state == self.state
        point.read_log_s = min(times)
        for _ in range(reps):
            gc.collect()
            elapsed, _, state = await self._lazy_read_log()
            point.lazy_s = min(point.lazy_s, elapsed)
            point.states_match &= state == self.state
        # A crash just before checkpoint k: the newest snapshot is k - SAVE_FREQ's.
        newest = self.ckpt_dir / f"step-{k:06d}.state"
        hidden = newest.with_name(newest.name + ".hidden")
        os.replace(newest, hidden)
        try:
            times = []
            for _ in range(reps):
                gc.collect()
                elapsed, point.window_events, state = await self._read_log()
                times.append(elapsed)
                point.states_match &= state == self.state
            point.window_read_log_s = min(times)
            for _ in range(reps):
                gc.collect()
                elapsed, _, state = await self._lazy_read_log()
                point.lazy_window_s = min(point.lazy_window_s, elapsed)
                point.states_match &= state == self.state
        finally:
            os.replace(hidden, newest)
        # The old way: the whole log from its beginning (best of two).
        for _ in range(2):
            gc.collect()
            t0 = time.perf_counter()
            state, count = TrainerState(), 0
            async for entry in read_history(self.bus, self.keys.events, self.archive):
                state = trainer_apply(state, entry.msg)
                count += 1
            elapsed = time.perf_counter() - t0
            point.whole_fold_s, point.whole_events = min(point.whole_fold_s, elapsed), count
            point.states_match &= state == self.state
        # What a restarted trainer's watch (and a restarted rollouter) reads in the
        # background: the whole log from "0", 1000 entries per XREAD (best of two).
        for _ in range(2):
            gc.collect()
            t0 = time.perf_counter()
            cursor = "0"
            while True:
                entries, cursor = await self.bus.read_after(self.keys.events, cursor,
                                                            count=1000)
                if len(entries) < 1000:
                    break
            point.follow_s = min(point.follow_s, time.perf_counter() - t0)

    def _write_checkpoint_pt(self, k: int) -> None:
        """A real checkpoint of the tiny model, written by the trainer's own
        trainer.resume.write_checkpoint (with the snapshot already written for step k)."""
        import torch

        from policy import build_policy

        torch.set_num_threads(1)
        policy = build_policy(msgspec.to_builtins(self.cfg.model), "cpu")
        optimizer = torch.optim.Adam(policy.parameters(), lr=self.cfg.trainer.lr)
        path, _ = write_checkpoint(self.ckpt_dir, k, self.version,
                                lambda _: {"model": policy.state_dict(),
                                           "optimizer": optimizer.state_dict()},
                                self.last_snapshot)
        if path != self.ckpt_path(k):
            raise RuntimeError(f"the trainer writes {path}, CheckpointSaved names "
                               f"{self.ckpt_path(k)}")

    async def _measure_real_trainer(self, k: int, overrides: list[str], timeout_s: float,
                                    runs: int) -> None:
        """``python -m trainer`` on this run, ``runs`` times: spawn to its StepStarted(k + 1)
        in the log, then SIGTERM; the driver folds what it wrote (a resumed trainer)."""
        point = self.measured[k]
        await asyncio.to_thread(self._write_checkpoint_pt, k)
        for run in range(runs):
            elapsed, phases, note = await self._real_trainer_once(k, overrides, timeout_s, run)
            if elapsed is not None:
                if point.real_s is None or elapsed < point.real_s:
                    point.real_s, point.real_phases = elapsed, phases
                point.real_runs.append(elapsed)
            elif note:
                point.real_note = note

    async def _real_trainer_once(self, k: int, overrides: list[str], timeout_s: float,
                                 run: int) -> tuple[float | None, tuple[float, float] | None,
                                                    str]:
        point = self.measured[k]
        await self.lease.release()
        latest = await self.bus.latest(self.keys.events)
        cursor = latest.id if latest is not None else "0"
        log_path = self.run_dir / f"trainer-at-{k}-{run}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        elapsed: float | None = None
        resumed_ts: float | None = None
        phases: tuple[float, float] | None = None
        log = await asyncio.to_thread(log_path.open, "wb")
        try:
            wall0 = time.time()  # the events' ts are the trainer's time.time() (same host)
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainer", *overrides, cwd=ROOT, env=env,
                stdout=log, stderr=asyncio.subprocess.STDOUT)
            try:
                deadline = t0 + timeout_s
                while elapsed is None:
                    entries, cursor = await self.bus.read_after(
                        self.keys.events, cursor, count=100, block_ms=200)
                    for _, msg in entries:
                        if isinstance(msg, TrainerResumed):
                            point.real_events_read = msg.events_read
                            resumed_ts = msg.ts
                        if isinstance(msg, StepStarted) and msg.step == k + 1:
                            elapsed = time.perf_counter() - t0
                            if resumed_ts is not None:
                                phases = (resumed_ts - wall0, msg.ts - resumed_ts)
                    if elapsed is None and (proc.returncode is not None
                                            or time.perf_counter() > deadline):
                        break
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        finally:
            log.close()
        note = ""
        if elapsed is None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            note = f"no StepStarted({k + 1}) (rc {proc.returncode}): " + " | ".join(tail)
        # Go on from the log as a resumed trainer: fold what the real one wrote.
        start = self.writer.position or "0"
        async for entry in self.bus.read_all(self.keys.events, start=start):
            if entry.id == start:
                continue
            self.writer.fold(entry.msg)  # type: ignore[arg-type]
            self.writer.position = entry.id
            if isinstance(entry.msg, StepFinished):
                self.writer.last_finished_id = entry.id
            if isinstance(entry.msg, StepStarted) and entry.msg.step == k + 1:
                self.started_step = k + 1
        holder = await self.lease.acquire()
        if holder is not None and not await self.lease.steal(holder):
            raise RuntimeError(f"the trainer lease stays held by {holder}")
        return elapsed, phases, note

    async def archive_experiment(self) -> Archive:
        """A proposal tried on this Redis at the last point, after its measurements (the
        run then goes on with the trimmed log): the events before the newest checkpoint's
        snapshot go to a file under the run folder (msgpack ``[id, raw]`` pairs) and out of
        Redis. XTRIM MINID at the snapshot's last StepFinished, which comes before its
        position: a resume uses a snapshot only if the log holds both."""
        newest = max(self.ckpt_dir.glob("step-*.state"))
        snap = msgspec.msgpack.decode(newest.read_bytes(), type=Snapshot)
        cut = snap.last_finished_id or snap.position
        info = await self.bus.command("INFO", "memory")
        used_before = int(info["used_memory"])
        path = self.run_dir / "events-archive.msgpack"
        t0 = time.perf_counter()
        size = 0
        cursor = "-"
        with path.open("wb") as f:
            while True:
                page = await self.bus.command("XRANGE", self.keys.events, cursor,
                                              f"({cut}", "COUNT", 10_000)
                if not page:
                    break
                data = msgspec.msgpack.encode([[i, fields[1]] for i, fields in page])
                f.write(data)
                size += len(data)
                cursor = "(" + page[-1][0].decode()
        write_s = time.perf_counter() - t0
        removed = int(await self.bus.command("XTRIM", self.keys.events, "MINID", cut))
        info = await self.bus.command("INFO", "memory")
        gc.collect()
        elapsed, _, state = await self._read_log()
        gc.collect()
        lazy, _, lazy_state = await self._lazy_read_log()
        return Archive(
            step=int(newest.stem.split("-")[1]), removed=removed,
            events_left=await self.bus.length(self.keys.events), file_bytes=size,
            write_s=write_s, used_before=used_before, used_after=int(info["used_memory"]),
            read_log_s=elapsed, lazy_s=lazy,
            states_match=state == self.state and lazy_state == self.state)

    async def measure(self, k: int, args: argparse.Namespace, overrides: list[str]) -> None:
        await self.profiler_poll()
        await self._measure_memory(k, pre_trim=False)
        await self._measure_resume(k, args.resume_reps)
        if not args.no_real_trainer:
            await self._measure_real_trainer(k, overrides, args.trainer_timeout,
                                             args.trainer_runs)
            # Resumed: the real trainer's pending entries become ours, read first.
            self.trainer_in = Consumer(self.bus, self.keys.samples, GROUP,
                                       consumer_name(self.epoch), dlq_stream=self.keys.dlq)
            await self.trainer_in.adopt()
        await self.release_rollout()
        await self.profiler_poll()
        self.windows.append(Window(k, self.prof))


def _snapshot_names(folder: Path) -> list[str]:
    """``step-*.state`` names in ``folder``, newest first (zero-padded steps sort as text)."""
    with os.scandir(folder) as it:
        names = [e.name for e in it if e.name.startswith("step-") and e.name.endswith(".state")]
    return sorted(names, reverse=True)


def time_profiler(cfg: Config, windows: Sequence[Window], reps: int
                  ) -> dict[int, tuple[float, float, float, float]]:
    """Per window: s per event of ``apply``, and of ``apply`` + ``decide`` after each
    change, over its entries from its state: the best of ``reps`` and the median. The
    windows take turns, so that drift (other processes) hits them alike; the best is the
    figure least disturbed by processes sharing the cores."""
    prof_cfg = cfg.global_profiler
    apply_t: dict[int, list[float]] = {w.step: [] for w in windows}
    decide_t: dict[int, list[float]] = {w.step: [] for w in windows}
    gc.collect()
    for _ in range(reps):
        for w in windows:
            state = w.state
            t0 = time.perf_counter()
            for entry_id, msg in w.entries:
                state = service_apply(state, msg, entry_id)
            apply_t[w.step].append((time.perf_counter() - t0) / len(w.entries))
            state = w.state
            t0 = time.perf_counter()
            for entry_id, msg in w.entries:
                new = service_apply(state, msg, entry_id)
                if new is not state:
                    decide(prof_cfg, new, new.last_started_step, None)
                state = new
            decide_t[w.step].append((time.perf_counter() - t0) / len(w.entries))
    return {w.step: (min(apply_t[w.step]), min(decide_t[w.step]), _median(apply_t[w.step]),
                     _median(decide_t[w.step])) for w in windows}


def _small(p: Point) -> int:
    return sum(p.streams[s][1] for s in ("control", "dlq", "runs"))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or a != a or b != b:
        return float("nan")
    return a / b


def report(points: list[Point], sample_size: int, elapsed: float, steps: int,
           archive: Archive | None) -> None:
    print()
    print(f"synthetic run: {steps} steps in {elapsed:.0f} s ({steps / elapsed:.0f} steps/s); "
          f"{PROMPTS_PER_STEP} prompts x {N} samples of {sample_size} B per step; checkpoint "
          f"every {SAVE_FREQ} steps; load average now {os.getloadavg()[0]:.2f}")
    rows: list[tuple[str, list[str]]] = [
        ("Redis used_memory, MB (after the trim)", [_mb(p.used_memory) for p in points]),
        ("Redis used_memory, MB (just before it)", [_mb(p.used_memory_pre_trim)
                                                    for p in points]),
        ("  events: entries", [str(p.streams["events"][0]) for p in points]),
        ("  events: MB", [_mb(p.streams["events"][1]) for p in points]),
        ("  samples before trim: entries", [str(p.samples_pre_trim[0]) for p in points]),
        ("  samples before trim: MB", [_mb(p.samples_pre_trim[1]) for p in points]),
        ("  samples after trim: entries", [str(p.streams["samples"][0]) for p in points]),
        ("  prompts: entries / KB", [f"{p.streams['prompts'][0]} / "
                                     f"{p.streams['prompts'][1] / 1e3:.1f}" for p in points]),
        ("  control + dlq + runs: KB", [f"{_small(p) / 1e3:.1f}" for p in points]),
        ("  weight blobs: KB", [f"{p.blob_bytes / 1e3:.1f}" for p in points]),
        ("events archive on disk, MB", [_mb(p.archive_bytes) for p in points]),
        ("  keys (DBSIZE)", [str(p.keys) for p in points]),
        ("profiler: us/new event, apply (median)",
         [f"{p.apply_us:.2f} ({p.apply_med_us:.2f})" for p in points]),
        ("profiler: us/new event, +decide (median)",
         [f"{p.decide_us:.2f} ({p.decide_med_us:.2f})" for p in points]),
        ("resume: snapshot files read", [str(p.snapshot_files) for p in points]),
        ("resume: snapshots(), ms", [f"{p.snapshots_s * 1e3:.1f}" for p in points]),
        ("resume: read_log(), ms (events folded)",
         [f"{p.read_log_s * 1e3:.1f} ({p.read_log_events})" for p in points]),
        ("resume: read_log() a window late, ms",
         [f"{p.window_read_log_s * 1e3:.1f} ({p.window_events})" for p in points]),
        ("resume: proposed lazy snapshot read, ms", [f"{p.lazy_s * 1e3:.1f}" for p in points]),
        ("  ... a window late, ms", [f"{p.lazy_window_s * 1e3:.1f}" for p in points]),
        ("resume: old way, whole log, ms",
         [f"{p.whole_fold_s * 1e3:.0f} ({p.whole_events})" for p in points]),
        ("resume: _follow_events from 0, ms", [f"{p.follow_s * 1e3:.0f}" for p in points]),
        ("resume: states equal the driver's", ["yes" if p.states_match else "NO"
                                               for p in points]),
        ("real trainer: s to StepStarted(K+1), best",
         [("-" if p.real_s is None else f"{p.real_s:.2f}")
          + ("" if p.real_events_read is None else f" ({p.real_events_read})")
          for p in points]),
        ("real trainer: every start, s", [" ".join(f"{x:.1f}" for x in p.real_runs) or "-"
                                          for p in points]),
        ("  best: spawn->TrainerResumed->Step, s",
         ["-" if p.real_phases is None else f"{p.real_phases[0]:.2f} + {p.real_phases[1]:.2f}"
          for p in points]),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'steps':<{width}} " + " ".join(f"{p.step:>16}" for p in points))
    for name, cells in rows:
        print(f"{name:<{width}} " + " ".join(f"{c:>16}" for c in cells))
    for p in points:
        if p.real_note:
            print(f"real trainer at {p.step}: {p.real_note}")
    first, last = points[0], points[-1]
    ratios = {
        "Redis used_memory (after a trim)": _ratio(last.used_memory, first.used_memory),
        "Redis used_memory (just before it)": _ratio(last.used_memory_pre_trim,
                                                     first.used_memory_pre_trim),
        "profiler us/event (apply)": _ratio(last.apply_us, first.apply_us),
        "profiler us/event (apply+decide)": _ratio(last.decide_us, first.decide_us),
        "resume snapshots()": _ratio(last.snapshots_s, first.snapshots_s),
        "resume read_log()": _ratio(last.read_log_s, first.read_log_s),
        "resume read_log() a window late": _ratio(last.window_read_log_s,
                                                   first.window_read_log_s),
        "resume, proposed lazy snapshot read": _ratio(last.lazy_s, first.lazy_s),
        "  ... a window late": _ratio(last.lazy_window_s, first.lazy_window_s),
        "resume, old way (whole log)": _ratio(last.whole_fold_s, first.whole_fold_s),
        "resume, _follow_events from 0": _ratio(last.follow_s, first.follow_s),
        "real trainer to its first new step": _ratio(last.real_s, first.real_s),
    }
    print()
    print(f"ratios {last.step}/{first.step} (aim: <= 1.5):")
    for name, r in ratios.items():
        verdict = "" if r != r else ("  met" if r <= 1.5 else "  NOT met")
        print(f"  {name:<36} {r:8.2f}{verdict}")
    if last.step == first.step:
        return
    # Where the memory goes. After a trim the points differ only in the events stream, so
    # used_memory's growth between them is what the events cost (MEMORY USAGE of a stream
    # over-counts its radix tree: Redis adds 30 pointers per node).
    steps_between = last.step - first.step
    grow = (last.used_memory - first.used_memory) / steps_between
    entries_per_step = (last.streams["events"][0] - first.streams["events"][0]) / steps_between
    window = last.used_memory_pre_trim - last.used_memory  # what the trim at the point freed
    print()
    kept = "archived and trimmed" if last.archive_bytes else "never trimmed"
    every = f"every {window / grow:.0f} steps" if grow > 0 else "never: it does not grow"
    print(f"used_memory grows {grow:.0f} B per step ({entries_per_step:.2f} events entries per "
          f"step in Redis, {kept}); one checkpoint window of samples ({SAVE_FREQ} steps, "
          f"{last.samples_pre_trim[0]} entries) is {_mb(window)} MB (what a trim frees), so "
          f"the events stream adds a window's worth {every}")
    print(f"used_memory at {last.step} steps: {_mb(last.used_memory_pre_trim)} MB just before "
          f"a trim = {last.used_memory_pre_trim / window:.1f} checkpoint windows of samples "
          f"(aim: a few); at {first.step}: {_mb(first.used_memory_pre_trim)} MB = "
          f"{first.used_memory_pre_trim / window:.1f}")
    steps_seen = last.composition.get("StepFinished", (0, 0))[0]
    if steps_seen:
        print(f"the newest {sum(c for c, _ in last.composition.values())} events entries "
              f"({steps_seen} steps), encoded message bytes per step by type:")
        for name, (count, size) in sorted(last.composition.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:<18} {count / steps_seen:6.2f} per step x {size / count:5.0f} B "
                  f"= {size / steps_seen:5.0f} B per step")
        payload = sum(size for _, size in last.composition.values()) / steps_seen
        overhead = ((grow - payload) / entries_per_step if entries_per_step > 0
                    else float("nan"))
        print(f"  {'all':<18} {payload:5.0f} B of messages per step; used_memory grows "
              f"{grow:.0f} B per step ({overhead:.0f} B of stream overhead per entry)")
    sf = last.step_finished
    if sf is not None:
        whole = len(encode(sf))
        metrics = whole - len(encode(msgspec.structs.replace(sf, metrics={})))
        ids = whole - len(encode(msgspec.structs.replace(sf, entry_ids=[], sample_ids=[])))
        print(f"  one StepFinished: {whole} B, of which metrics ({len(sf.metrics)} keys) "
              f"{metrics} B, sample_ids + entry_ids ({len(sf.entry_ids)} each) {ids} B")
    if archive is not None:
        print(f"archiving (a proposal, tried on this Redis at step {archive.step} after its "
              f"measurements): the {archive.removed} events entries before the snapshot "
              f"of checkpoint {archive.step} (before its last StepFinished) written to a "
              f"file under the run folder ({_mb(archive.file_bytes)} MB, "
              f"{archive.write_s:.1f} s) and trimmed (XTRIM MINID): used_memory "
              f"{_mb(archive.used_before)} -> "
              f"{_mb(archive.used_after)} MB ({archive.events_left} events entries left), "
              f"vs {_mb(first.used_memory)} MB at {first.step} steps after its trim, with "
              f"{first.streams['events'][0]} events entries in Redis; the real "
              f"read_log() then takes {archive.read_log_s * 1e3:.1f} ms (the proposed lazy "
              f"snapshot read {archive.lazy_s * 1e3:.1f} ms) and resumes the same state: "
              f"{'yes' if archive.states_match else 'NO'}")


@dataclass
class Archive:
    """The archiving experiment at the end of the run."""

    step: int
    removed: int
    events_left: int
    file_bytes: int
    write_s: float
    used_before: int
    used_after: int
    read_log_s: float
    lazy_s: float
    states_match: bool


async def run(args: argparse.Namespace) -> int:
    points = sorted(set(args.points))
    if any(p % SAVE_FREQ for p in points):
        raise SystemExit(f"every point must be a multiple of {SAVE_FREQ} (a checkpoint step)")
    top = Path(tempfile.mkdtemp(prefix="rlbus-long-run-"))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"run folder {top}", flush=True)
    try:
        async with EmbeddedRedis(top / "redis", appendonly=False) as server:
            bus = Bus.from_url(server.url)
            last_step = points[-1]
            # The run's total: past the last point, so the profiler's window fits in it.
            total = last_step + 1000
            overrides = run_overrides(server.url, top / "outputs", total)
            cfg = load_config(None, overrides)
            driver = Driver(bus, cfg, top / "outputs" / RUN_ID, args.sample_bytes, points)
            driver.window_size = args.window
            driver.events_retention = not args.keep_events
            sample_size = len(msgspec.msgpack.encode(driver._samples(PromptTicket(
                ticket_id="t0", prompt_id="p", prompt="", answer="", n=1, min_version=0), 0)[0]))
            print(f"redis-server {'.'.join(map(str, server.version))} at {server.url}; "
                  f"samples of {sample_size} B", flush=True)
            try:
                await driver.start()
                t_start = time.perf_counter()
                paused = 0.0
                archive: Archive | None = None
                k = 0
                while k < last_step or driver.windows:
                    k += 1
                    if k >= total:
                        raise RuntimeError("the profiler window did not fill before the end")
                    await driver.step(k)
                    if k % args.pulse_every == 0:
                        await driver.second(k)
                    if k in driver.points:
                        t0 = time.perf_counter()
                        await driver.measure(k, args, overrides)
                        paused += time.perf_counter() - t0
                        if k == last_step and args.keep_events and not args.no_archive:
                            archive = await driver.archive_experiment()
                        p = driver.measured[k]
                        print(f"step {k}: {(k / (time.perf_counter() - t_start - paused)):.0f} "
                              f"steps/s; used_memory {_mb(p.used_memory)} MB; "
                              f"read_log {p.read_log_s * 1e3:.1f} ms; whole log "
                              f"{p.whole_fold_s * 1e3:.0f} ms; real trainer "
                              f"{p.real_s if p.real_s is None else round(p.real_s, 2)} s",
                              flush=True)
                    elif k % 10_000 == 0:
                        rate = k / (time.perf_counter() - t_start - paused)
                        print(f"step {k}: {rate:.0f} steps/s", flush=True)
                elapsed = time.perf_counter() - t_start - paused
                timed = time_profiler(cfg, driver.done_windows, args.reps)
                for w in driver.done_windows:
                    p = driver.measured[w.step]
                    p.apply_us, p.decide_us, p.apply_med_us, p.decide_med_us = (
                        x * 1e6 for x in timed[w.step])
                    p.prof_events = len(w.entries)
                report([driver.measured[p] for p in points], sample_size, elapsed, k, archive)
            finally:
                with contextlib.suppress(Exception):
                    await driver.lease.release()
                await bus.close()
    finally:
        if args.keep:
            print(f"kept {top}")
        else:
            shutil.rmtree(top, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, nargs="+", default=[1000, 10_000, 100_000],
                        help="steps at which to measure (multiples of 100)")
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--pulse-every", type=int, default=10,
                        help="steps per synthetic second (liveness pulses, event polls)")
    parser.add_argument("--window", type=int, default=1000,
                        help="events after each point over which the profiler is timed")
    parser.add_argument("--reps", type=int, default=50,
                        help="profiler timing repetitions (the best is reported)")
    parser.add_argument("--resume-reps", type=int, default=5,
                        help="repetitions of each log-reading resume (the best is reported)")
    parser.add_argument("--no-real-trainer", action="store_true",
                        help="do not time the real `python -m trainer` resume")
    parser.add_argument("--trainer-timeout", type=float, default=180.0)
    parser.add_argument("--trainer-runs", type=int, default=3,
                        help="real trainer starts per point (the fastest is reported)")
    parser.add_argument("--no-archive", action="store_true",
                        help="skip the archiving experiment at the end")
    parser.add_argument("--keep", action="store_true", help="keep the run folder")
    parser.add_argument("--keep-events", action="store_true",
                        help="keep the events stream whole (no events retention, as before)")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
