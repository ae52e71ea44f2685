"""The trainer process: issues prompt tickets, trains on samples, publishes steps and weights.

One step ``k`` (1-based), as in docs/architecture.md:

1. apply the profiling commands due at ``k`` (profiler agent), publish ``StepStarted(k)``;
2. gather ``require_batches * ppo_mini_batch_size`` complete prompt groups from the samples
   stream (own pending entries first; a sample is accepted only as an answer of an open
   ticket of the ledger, validated against it; any other copy is acked and dropped);
3. GRPO update (trainer.update) on the worker thread, so the event loop keeps the lease and
   the liveness key fresh however long the update takes;
4. every ``trigger_parameter_sync_step`` steps publish weights (claim check + WeightsPublished),
   checkpoint when due, then ``StepFinished(k, sample_ids, entry_ids, metrics)`` and the acks
   of those samples in one fenced script (an ack never lands without its StepFinished);
5. issue new tickets up to the staleness budget, tagged with the current weights version.

Every write goes through the run's fencing lease (bus.liveness.Lease): a second trainer, or
a paused zombie of this one, cannot write. Open tickets carry a lease too: one unanswered for
``heartbeat.ticket_lease_s`` is reissued (attempt + 1) and the first complete answer wins.
A restarted trainer folds the events log (trainer.state, trainer.ledger), loads the latest
checkpoint and re-applies the finished steps after it from their recorded entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch

from bus import (
    Bus,
    Consumer,
    Delivery,
    EntryGone,
    Fenced,
    Lease,
    RunKeys,
    read_commands,
    run_with_bus,
    settle_heap,
)
from bus.blobs import DirBlobStore, RedisBlobStore, open_store
from bus.keys import RUNS_STREAM
from bus.liveness import peers, pulse_forever
from bus.messages import (
    CheckpointSaved,
    ComponentFailed,
    DeadLetter,
    DecodeError,
    Event,
    Heartbeat,
    Message,
    ProfilerReady,
    PromptTicket,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TicketsClosed,
    TicketsIssued,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
    decode,
)
from bus.streams import entry_key
from policy import build_policy, resolve_device
from profiling import create_agent
from runconfig import Config, config_to_dict, load_or_exit
from tasks import build_prompt_source
from trainer.budget import max_staleness, ticket_budget
from trainer.lease import TrainerConflict, acquire, token
from trainer.ledger import OpenTicket, ticket_id, ticket_index
from trainer.resume import Snapshot, load_checkpoint, read_log, replay_groups, write_checkpoint
from trainer.retention import retain
from trainer.state import TrainerState, apply
from trainer.update import GrpoStep, grpo_update
from trainer.validate import check_sample, values_in_range

__all__ = ["LogBehind", "PeerDead", "Trainer", "TrainerConflict", "main"]

GROUP = "trainer"
# Consecutive rollout failures (with no sample in between) after which the run fails loudly.
FAILURE_LIMIT = 10
ROLLOUTER_GROUP = "rollouter"
CONSUMER = "trainer-0"
# Above this many bytes the weights go to a directory blob store instead of Redis chunks.
REDIS_BLOB_LIMIT = 64 * 1024 * 1024
KEEP_WEIGHTS = 3  # weight versions whose blobs stay readable
# In-process restarts after the log was found behind the trainer (Redis lost its tail).
MAX_LOG_RESTARTS = 5

T = TypeVar("T")


class PeerDead(RuntimeError):
    """A component the trainer depends on is gone, or the run cannot progress; the message
    names what it was waiting for."""


class LogBehind(RuntimeError):
    """The events log lost writes this trainer made (Redis restarted without its last
    second): the trainer must resume from the log as it is now."""


class _Group(msgspec.Struct):
    """The responses of one attempt of one ticket gathered so far (entry ids for the ack)."""

    index: int
    attempt: int
    n: int
    samples: dict[int, tuple[str, Sample]] = {}
    arrived: float = 0.0

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.n

    def ordered(self) -> list[tuple[str, Sample]]:
        return [pair for _, pair in sorted(self.samples.items())]


class _StepWork:
    """One step's training on the worker thread: the groups it took, in mini-batch order,
    and the queued calls (futures) of its GrpoStep, with their compute time."""

    def __init__(self, worker: ThreadPoolExecutor, step: GrpoStep) -> None:
        self.worker, self.step = worker, step
        self.taken: list[_Group] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.busy_s = 0.0

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - t

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = asyncio.get_running_loop()
        self.futures.append(
            loop.run_in_executor(self.worker, functools.partial(self._timed, fn, *args)))

    @property
    def running(self) -> bool:
        return any(not f.done() for f in self.futures)

    def raise_failures(self) -> None:
        """A failed mini-batch fails the step now, not at its end."""
        for f in self.futures:
            if f.done():
                f.result()

    async def wait(self) -> list[Any]:
        return await asyncio.gather(*self.futures)

    async def settle(self) -> None:
        """Never leave the worker's futures unawaited (their errors would be lost)."""
        await asyncio.gather(*self.futures, return_exceptions=True)


def _vocab_size(policy: torch.nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in policy.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


class Trainer:
    """The trainer of one run; :meth:`run` returns the process exit code."""

    def __init__(self, cfg: Config, bus: Bus) -> None:
        self.cfg = cfg
        self.bus = bus
        self.run_id = cfg.run.id or ""
        self.keys = RunKeys(self.run_id)
        self.run_dir = Path(cfg.run.output_dir) / self.run_id
        tc, ac = cfg.trainer, cfg.async_training
        self.need = ac.require_batches * tc.ppo_mini_batch_size
        self.capacity = ticket_budget(ac.staleness_threshold, ac.trigger_parameter_sync_step,
                                      ac.require_batches, tc.ppo_mini_batch_size)
        self.max_staleness = max_staleness(
            ac.staleness_threshold, ac.trigger_parameter_sync_step, ac.require_batches,
            tc.ppo_mini_batch_size,
        )
        self.device = resolve_device(tc.device)
        self.prompts = build_prompt_source(
            {"kind": cfg.task.kind, "path": cfg.task.path, "min_digits": cfg.task.min_digits,
             "max_digits": cfg.task.max_digits, "seed": cfg.task.seed}
        )
        self.epoch = secrets.token_hex(4)
        self.lease = Lease(bus, self.keys.trainer_lease, token(self.epoch),
                           cfg.heartbeat.timeout_s)
        self.version = 0
        self.state = TrainerState()
        self.groups: dict[tuple[int, int], _Group] = {}
        self.ready: list[_Group] = []
        self.taken: set[int] = set()  # tickets whose winning group waits in `ready`
        self.issued_at: dict[int, float] = {}  # ticket -> monotonic time of its latest attempt
        self.ticket_entry: dict[int, str] = {}  # ticket -> prompts entry of its latest attempt
        self.answer_s: deque[float] = deque(maxlen=64)  # issue -> complete group, recent
        self.consumer = Consumer(bus, self.keys.samples, GROUP, CONSUMER, dlq_stream=self.keys.dlq)
        self.rollouters: list[Heartbeat] = []
        self.rollouters_seen_at = time.monotonic()
        self.peers_read_at = 0.0
        self.last_progress = time.monotonic()
        self.last_stall_warning = 0.0
        self.rollout_failures = 0
        self.failures_since_sample = 0
        self.last_failure = ""
        self.dead_tickets: list[PromptTicket] = []  # dead-lettered by rollouters: to close
        self.lost_samples: list[Sample] = []  # dead-lettered from our group: reissue their ticket
        self.dlq_last = "0"
        self.discarded = 0
        self.reissued = 0
        self.refused = 0
        self.profiler_ready = asyncio.Event()
        self.agent: Any = None  # created only when profiling is configured
        self.control_last = "0"
        self.events_last = "0"
        self.last_finished_id: str | None = None
        self.events_position: str | None = None
        self.log_entries_read = 0
        self.wait_s = 0.0
        self.update_s = 0.0
        self.upcoming: _StepWork | None = None  # the next step, started early (_loop)
        self.building_optimizer: asyncio.Future[None] | None = None  # _build_optimizer
        self.loop_cpu_at = 0.0  # the event loop thread's CPU time at the last StepFinished
        self.window_groups = 0  # prompts trained in this sync window, and how many were stale
        self.window_stale = 0
        self.fenced: str | None = None
        self.blobs: RedisBlobStore | DirBlobStore = RedisBlobStore(bus, self.keys)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-work")
        self.vocab_size: int | None = None
        self.max_len: int | None = cfg.model.max_len if cfg.model.kind == "tiny" else None

    # ------------------------------------------------------------------ plumbing

    async def _off(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking work (update, serialisation, checkpoint I/O, profiler calls) on the
        one worker thread: the loop stays free for the lease and liveness, and
        torch.profiler sees every profiled call on the thread it was started on."""
        return await self._submit(functools.partial(fn, *args, **kwargs))

    async def _write(
        self, items: Sequence[tuple[str, Message]],
        ack: tuple[str, str, Sequence[str]] | None = None,
        require: tuple[str, str] | None = None,
    ) -> list[str]:
        """Every write of the trainer: fenced by the run's lease (see bus.liveness), and only
        while our last StepFinished is still in the log: a trainer that has not yet noticed
        that Redis lost its tail writes nothing into the log that replaced it."""
        if require is None and self.last_finished_id is not None:
            require = (self.keys.events, self.last_finished_id)
        try:
            ids = await self.lease.write(items, ack, require)
        except EntryGone as exc:
            raise LogBehind(f"StepFinished({self.state.last_step}) is gone from the log "
                            f"({exc})") from exc
        except Fenced as exc:
            if exc.holder is None and await self.lease.acquire() is None:
                # Our lease vanished (Redis restarted, maybe without its last writes): it is
                # ours again, but the state must come from the log as it is now.
                raise LogBehind(f"the lease {self.keys.trainer_lease} had vanished") from exc
            self.fenced = exc.holder or "nobody (the lease lapsed)"
            raise
        for (stream, _), entry_id in zip(items, ids, strict=True):
            if stream == self.keys.events:
                self.events_position = entry_id  # the snapshot's position in the log
        return ids

    async def _publish(self, *events: Event) -> list[str]:
        if not events:
            return []
        ids = await self._write([(self.keys.events, e) for e in events])
        for event in events:
            self.state = apply(self.state, event)
        return ids

    # ------------------------------------------------------------------ set-up

    async def _read_log(self) -> None:
        read = await read_log(self.bus, self.keys, self.run_dir / "checkpoints")
        self.state, self.events_position = read.state, read.position
        self.last_finished_id, self.log_entries_read = read.last_finished_id, read.entries_read
        # The follower needs only what comes next (failures, ProfilerReady), not the past.
        self.events_last = read.position or "0"

    async def _acquire_lease(self) -> None:
        await acquire(self.lease, self.run_id, self.cfg.heartbeat)

    def _build(self) -> None:
        tc = self.cfg.trainer
        torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.policy = build_policy(msgspec.to_builtins(self.cfg.model), self.device)
        self.policy.train()
        self.vocab_size = _vocab_size(self.policy)
        # None when profiling is off: then no profiler object exists at all.
        self.agent = create_agent(
            self.cfg, "trainer", 0, str(self.device), after_step=self.state.last_step
        )

    def _build_optimizer(self) -> None:
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.trainer.lr)

    async def _optimizer_ready(self) -> None:
        """Wait for the optimizer (built beside the first weights' publication: the first
        torch optimizer of a process imports torch._dynamo, about a second). That ends the
        trainer's start-up: the garbage collector comes back on (settle_heap)."""
        task, self.building_optimizer = self.building_optimizer, None
        if task is not None:
            await task
            settle_heap()

    async def _apply_commands(self) -> None:
        """Read new control commands (one non-blocking XREAD) and hand them to the agent."""
        if self.agent is None:
            return
        commands, self.control_last = await read_commands(
            self.bus, self.keys.control, self.control_last
        )
        for cmd in commands:
            await self._publish(*self.agent.on_command(cmd))

    async def _follow_events(self) -> None:
        """Background: rollout failures, ProfilerReady, dead-lettered tickets and samples."""
        while True:
            entries, self.events_last = await self.bus.read_after(
                self.keys.events, self.events_last, count=1000, block_ms=1000
            )
            for _, msg in entries:
                match msg:
                    case RolloutFailed():
                        self.rollout_failures += 1
                        self.failures_since_sample += 1
                        self.last_failure = f"rollouter{msg.rank}: {msg.error}"
                    case ProfilerReady():
                        self.profiler_ready.set()
            dead, self.dlq_last = await self.bus.read_after(
                self.keys.dlq, self.dlq_last, count=1000
            )
            for _, letter in dead:
                if not isinstance(letter, DeadLetter):
                    continue
                # Only a decodable ticket or sample of ours touches the ledger: garbage that
                # went to the DLQ never frees (or takes) a budget slot.
                try:
                    original = decode(letter.raw)
                except DecodeError:
                    continue
                if letter.source_stream == self.keys.prompts and isinstance(
                        original, PromptTicket):
                    self.dead_tickets.append(original)
                elif letter.source_stream == self.keys.samples and isinstance(original, Sample):
                    self.lost_samples.append(original)

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(role="trainer", rank=0, pid=os.getpid(),
                         state=f"step {self.state.last_step}",
                         metrics={"trainer/version": float(self.version)})

    async def _renew_lease(self) -> None:
        """At every pulse (bus.liveness.pulse_forever, never blocked by a step): renew the
        lease; take it back if Redis lost it; note a holder that is not us (fenced)."""
        if not await self.lease.renew():
            holder = await self.lease.holder()
            if holder is None:
                # The key vanished (Redis restarted): ours again. The log may have lost
                # its tail too: every write checks our last StepFinished (_write).
                await self.lease.acquire()
            elif holder != self.lease.token:
                self.fenced = holder

    async def _wait_for_profiler(self) -> None:
        timeout = self.cfg.global_profiler.handshake_timeout_s
        deadline = time.monotonic() + timeout
        try:
            # In slices: a trainer fenced out meanwhile (paused past its lease) stops at once.
            while not self.profiler_ready.is_set():
                self._check_fenced()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.profiler_ready.wait(),
                                           min(left, self.cfg.heartbeat.interval_s))
        except TimeoutError:
            print(f"trainer: no ProfilerReady from the profiler service within {timeout} s; "
                  "going on without waiting", file=sys.stderr, flush=True)
            await self._publish(WarningRaised(
                source="trainer", code="profiler_handshake_timeout",
                message=f"profiler service sent no ProfilerReady within {timeout} s "
                        "(global_profiler.handshake_timeout_s); step-1 commands may be missed",
            ))

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn`` on the worker now (in call order), without waiting for it."""
        return asyncio.get_running_loop().run_in_executor(self.worker, functools.partial(fn, *args))

    async def _publish_weights(self, step: int,
                               serialised: asyncio.Future[bytes] | None = None) -> None:
        blob = await (serialised if serialised is not None
                      else self._off(self.policy.state_bytes))
        if len(blob) > REDIS_BLOB_LIMIT and not isinstance(self.blobs, DirBlobStore):
            self.blobs = DirBlobStore(self.run_dir / "blobs")
        # The epoch in the name: a zombie trainer can never overwrite the live one's blob.
        ref = await self.blobs.put(f"weights-v{self.version}-{self.epoch}", blob)
        await self._publish(WeightsPublished(version=self.version, ref=ref, step=step))
        await self._drop_old_weights()

    async def _drop_old_weights(self) -> None:
        """Delete the blob of the publication that just fell out of the newest KEEP_WEIGHTS,
        so Redis does not grow by a model per sync. Older ones went the same way at earlier
        syncs (or, an earlier incarnation's, in _sweep_weight_blobs on resume): one delete
        per sync, not one per remembered publication."""
        refs = [ref for _, ref in self.state.weights]
        if len(refs) <= KEEP_WEIGHTS:
            return
        ref = refs[-KEEP_WEIGHTS - 1]
        if ref.key in {r.key for r in refs[-KEEP_WEIGHTS:]}:
            return
        store = open_store(ref.store, bus=self.bus, run_keys=self.keys,
                           root=self.run_dir / "blobs")
        with contextlib.suppress(Exception):  # already gone is fine
            await store.delete(ref)

    async def _sweep_weight_blobs(self) -> None:
        """On resume: delete weight blobs in Redis that no kept publication names (written
        by an earlier incarnation that died before publishing or deleting them)."""
        keep = {ref.key for _, ref in self.state.weights[-KEEP_WEIGHTS:]}
        stale = [key for key in await self.bus.scan(self.keys.blob("weights-*"))
                 if key.rsplit(":", 1)[0] not in keep]
        if stale:
            await self.bus.delete(*stale)

    # ------------------------------------------------------------------ tickets

    def _lease_s(self) -> float:
        hb = self.cfg.heartbeat
        if hb.ticket_lease_s is not None:
            return hb.ticket_lease_s
        slowest = max(self.answer_s, default=0.0)
        return max(hb.timeout_s, 4 * slowest)

    def _ticket(self, index: int, n: int, attempt: int = 0) -> PromptTicket:
        """Ticket ``index`` (its prompt from the task), for the current weights."""
        prompt = self.prompts.get(index)
        return PromptTicket(
            ticket_id=ticket_id(index), prompt_id=prompt.prompt_id, prompt=prompt.prompt,
            answer=prompt.answer, n=n, min_version=self.version, attempt=attempt,
        )

    async def _issue_tickets(self) -> None:
        """Issue what the sync window's staleness budget still allows (trainer.budget):
        right after a sync (or at the start) the window's new tickets, else nothing."""
        room = self.state.ledger.room(self.capacity)
        if room <= 0:
            return
        first = self.state.ledger.issued
        tickets = [self._ticket(index, self.cfg.rollout.n) for index in range(first, first + room)]
        event = TicketsIssued(ticket_ids=[t.ticket_id for t in tickets], n=self.cfg.rollout.n,
                              param_version=self.version)
        ids = await self._write([*((self.keys.prompts, t) for t in tickets),
                                 (self.keys.events, event)])
        for index, entry_id in zip(range(first, first + room), ids, strict=False):
            self.ticket_entry[index] = entry_id
        self.state = apply(self.state, event)
        now = time.monotonic()
        for index in range(first, first + room):
            self.issued_at[index] = now

    async def _reissue(self, indices: Sequence[int], reason: str) -> None:
        """Issue a new attempt of open tickets, tagged with the current weights: the first
        complete answer of any attempt wins."""
        by_attempt: dict[int, list[OpenTicket]] = {}
        for index in sorted(set(indices)):
            ticket = self.state.ledger.open.get(index)
            if ticket is not None and index not in self.taken:
                by_attempt.setdefault(ticket.attempt + 1, []).append(ticket)
        now = time.monotonic()
        for attempt, tickets in by_attempt.items():
            items: list[tuple[str, Message]] = [
                (self.keys.prompts, self._ticket(t.index, t.n, attempt)) for t in tickets
            ]
            event = TicketsIssued(ticket_ids=[ticket_id(t.index) for t in tickets], n=tickets[0].n,
                                  param_version=self.version, attempt=attempt, reason=reason)
            ids = await self._write([*items, (self.keys.events, event)])
            for t, entry_id in zip(tickets, ids, strict=False):
                self.ticket_entry[t.index] = entry_id
            self.state = apply(self.state, event)
            for t in tickets:
                self.issued_at[t.index] = now
                # Partial groups of older attempts may still complete first: they stay.
            self.reissued += len(tickets)

    async def _close_dead_tickets(self) -> None:
        """Tickets the rollouters dead-lettered (their rollouts kept failing): give them up
        and free their budget slots, unless a newer attempt is out."""
        dead, self.dead_tickets = self.dead_tickets, []
        close = []
        reasons = []
        for t in dead:
            index = ticket_index(t.ticket_id)
            ticket = self.state.ledger.open.get(index) if index is not None else None
            if ticket is None or ticket.attempt != t.attempt or index in self.taken:
                continue
            close.append(t.ticket_id)
            reasons.append(t.ticket_id)
        if not close:
            return
        await self._publish(TicketsClosed(
            ticket_ids=close,
            reason=f"dead-lettered in {self.keys.dlq} after failed rollouts",
        ))
        await self._publish(WarningRaised(
            source="trainer", code="tickets_dead_lettered",
            message=f"{len(close)} prompt ticket(s) failed too often and went to "
                    f"{self.keys.dlq} ({', '.join(reasons[:5])}); issuing new ones in their place",
        ))
        for tid in close:
            index = ticket_index(tid)
            if index is not None:
                self.issued_at.pop(index, None)
                self.ticket_entry.pop(index, None)
                self._drop_partial(index)

    async def _reissue_lost_samples(self) -> None:
        lost, self.lost_samples = self.lost_samples, []
        indices = {i for s in lost if (i := ticket_index(s.ticket_id)) is not None}
        indices = {i for i in indices if i in self.state.ledger.open and i not in self.taken}
        if indices:
            await self._reissue(sorted(indices), "an answer was dead-lettered")

    async def _expire_leases(self) -> None:
        """Reissue open tickets unanswered for longer than the ticket lease (lost with a
        crashed Redis tail, held by a stuck rollouter, answered with copies we refused)."""
        lease = self._lease_s()
        now = time.monotonic()
        expired = [i for i in self.state.ledger.open
                   if i not in self.taken and now - self.issued_at.get(i, now) > lease]
        if expired:
            await self._read_peers()  # who is alive now, not at the last peer check
            expired = await self._not_held(expired)
        if expired:
            await self._reissue(expired, f"unanswered for {lease:.0f} s (ticket lease)")

    async def _not_held(self, indices: list[int]) -> list[int]:
        """Of these tickets, those that are lost: gone from the prompts stream (a lost log
        tail, a trim) or pending on a replica whose liveness key lapsed. A ticket queued, held
        by a live rollouter (however slow), or already acked (answered: its samples are on the
        way) keeps its lease. Tickets issued before this trainer started (entry unknown) are
        judged by time alone."""
        known = {i: self.ticket_entry[i] for i in indices if i in self.ticket_entry}
        if not known:
            return indices
        live = {RunKeys.rollouter_consumer(hb.rank) for hb in self.rollouters}
        present = await self.bus.read_ids(self.keys.prompts, list(known.values()))
        rows = await self.bus.command("XPENDING", self.keys.prompts, ROLLOUTER_GROUP,
                                      "-", "+", 10 * self.capacity + 100)
        owner = {row[0].decode(): row[1].decode() for row in rows or []}
        keep = {i for i, e in known.items()
                if e in present and (e not in owner or owner[e] in live)}
        now = time.monotonic()
        for i in keep:
            self.issued_at[i] = now  # held: its lease starts again
        return [i for i in indices if i not in keep]

    # ------------------------------------------------------------------ samples

    def _drop_partial(self, index: int) -> None:
        for key in [k for k in self.groups if k[0] == index]:
            del self.groups[key]

    async def _refuse(self, delivery: Delivery, reason: str) -> None:
        self.refused += 1
        await self.consumer.dead_letter(delivery, reason)

    async def _take_all(self, deliveries: Sequence[Delivery]) -> None:
        """Take a read's deliveries in order; their token ids and log-probs are checked
        together first (values_in_range), each sample's on its own only if that fails."""
        checked = values_in_range([d.msg for d in deliveries if isinstance(d.msg, Sample)],
                                  self.vocab_size)
        for d in deliveries:
            await self._take(d, values_checked=checked)

    async def _take(self, delivery: Delivery, values_checked: bool = False) -> None:
        entry_id, msg = delivery.id, delivery.msg
        if not isinstance(msg, Sample):
            await self._refuse(delivery, f"expected a Sample, got {type(msg).__name__}")
            return
        ledger = self.state.ledger
        index = ticket_index(msg.ticket_id)
        if index is None or index >= ledger.issued:
            await self._refuse(delivery, f"ticket {msg.ticket_id!r} was never issued")
            return
        ticket = ledger.open.get(index)
        if ticket is None or index in self.taken:
            # Trained already, given up, or another copy won: a duplicate, dropped.
            await self.consumer.ack(entry_id)
            return
        problem = check_sample(msg, ticket, version=self.version,
                               max_new_tokens=self.cfg.rollout.max_new_tokens,
                               max_len=self.max_len, vocab_size=self.vocab_size,
                               values_checked=values_checked)
        if problem is not None:
            await self._refuse(delivery, f"invalid answer of {msg.ticket_id}: {problem}")
            self._drop_partial(index)
            await self._reissue([index], "an answer was invalid")
            return
        key = (index, msg.attempt)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(index, msg.attempt, ticket.n, {})
        if msg.index in group.samples:
            await self.consumer.ack(entry_id)  # a duplicate publication of the same response
            return
        group.samples[msg.index] = (entry_id, msg)
        if not group.complete:
            return
        # The first complete answer wins; every other attempt's partial copy is dropped
        # (their entries are acked when they are read again, as duplicates).
        self._drop_partial(index)
        group.arrived = time.monotonic()
        self.answer_s.append(group.arrived - self.issued_at.get(index, group.arrived))
        oldest = min(s.min_version for _, s in group.samples.values())
        if self.version - oldest > self.max_staleness:
            # Only a ticket held far longer than its peers gets here; training on it would
            # break the staleness bound, so it is answered again with current weights.
            self.discarded += 1
            await self.consumer.ack(*(eid for eid, _ in group.samples.values()))
            await self._publish(WarningRaised(
                source="trainer", code="stale_group_discarded",
                message=f"ticket {msg.ticket_id} generated with weights {oldest} is "
                        f"{self.version - oldest} versions old (max {self.max_staleness}); "
                        "reissued",
            ))
            await self._reissue([index], "answer too stale")
            return
        self.taken.add(index)
        self.ready.append(group)
        self.last_progress = time.monotonic()

    async def _check_peers(self) -> None:
        """Raise PeerDead when no rollouter is alive (by Redis's clock: their liveness keys
        have lapsed) for the heartbeat timeout, or when rollouts keep failing."""
        if self.failures_since_sample >= FAILURE_LIMIT:
            raise PeerDead(
                f"rollouts keep failing: {self.failures_since_sample} failures and no sample "
                f"since the last one; last failure from {self.last_failure}"
            )
        now = time.monotonic()
        if now - self.peers_read_at < self.cfg.heartbeat.interval_s:
            return
        await self._read_peers()
        if self.rollouters:
            self.rollouters_seen_at = now
            return
        timeout = self.cfg.heartbeat.timeout_s
        gone_for = now - self.rollouters_seen_at
        if gone_for >= timeout:
            raise PeerDead(
                f"no rollouter is alive: none has refreshed its liveness key "
                f"{self.keys.alive_pattern('rollouter')} for {gone_for:.0f} s "
                f"(heartbeat.timeout_s={timeout}); is a rollouter running for run "
                f"{self.run_id!r} at this Redis?"
            )

    async def _read_peers(self) -> None:
        """The rollouters' latest heartbeats, from their liveness keys."""
        self.peers_read_at = time.monotonic()
        self.rollouters = await peers(self.bus, self.keys.alive_pattern("rollouter"))

    def _waiting_for(self) -> str:
        """What the trainer waits for, in words (stall warnings and failures)."""
        ledger = self.state.ledger
        waiting = sorted(i for i in ledger.open if i not in self.taken)
        partial = [g for g in self.groups.values() if not g.complete]
        versions = sorted({ledger.open[i].version for i in waiting})
        alive = ", ".join(f"rollouter{h.rank} ({h.state})" for h in self.rollouters) or "none"
        shown = ", ".join(ticket_id(i) for i in waiting[:8]) + (" ..." if len(waiting) > 8 else "")
        return (f"{len(self.ready)}/{self.need} groups ready for step "
                f"{self.state.last_step + 1}; {len(waiting)} open ticket(s) unanswered "
                f"({shown}; weights versions {versions}; {len(partial)} partly answered); "
                f"trainer holds weights v{self.version}; rollouters alive: {alive}")

    async def _check_stall(self) -> None:
        hb = self.cfg.heartbeat
        now = time.monotonic()
        stalled = now - self.last_progress
        if stalled >= hb.stall_timeout_s:
            raise PeerDead(f"no progress for {stalled:.0f} s (heartbeat.stall_timeout_s="
                           f"{hb.stall_timeout_s}): {self._waiting_for()}")
        if stalled >= hb.stall_warn_s and now - self.last_stall_warning >= hb.stall_warn_s:
            self.last_stall_warning = now
            message = f"no progress for {stalled:.0f} s: {self._waiting_for()}"
            print(f"trainer: warning: {message}", file=sys.stderr, flush=True)
            await self._publish(WarningRaised(source="trainer", code="trainer_stalled",
                                              message=message))

    def _possibly_stale(self, group: _Group) -> bool:
        return any(s.min_version < self.version for _, s in group.samples.values())

    def _may_stream(self, missing: int) -> bool:
        """Whether the step may run optimizer steps before all its groups are here: only
        when none of its ``missing`` groups can be stale (a stale mini-batch's proximal
        log-probs need the weights the step started from; trainer.update). Open tickets of an
        older version, or reissued ones (an earlier attempt may still answer), may be."""
        if any(self._possibly_stale(g) for g in self.ready[:missing]):
            return False
        if missing <= len(self.ready):
            return True
        return not any(t.version < self.version or t.attempt > 0
                       for i, t in self.state.ledger.open.items() if i not in self.taken)

    def _begin_step(self) -> _StepWork:
        """A step's training, started: the mini-batches already complete go to the worker
        (behind whatever it has queued, e.g. the previous step's weights serialisation)."""
        work = _StepWork(self.worker, GrpoStep(
            self.policy, self.optimizer, self.cfg.trainer,
            temperature=self.cfg.rollout.temperature, version=self.version, device=self.device))
        self._feed(work)
        return work

    def _feed(self, work: _StepWork) -> None:
        """Hand each complete mini-batch of ready groups to the step; let its first-epoch
        optimizer step run now when no stale group can still join it (_may_stream)."""
        mb = self.cfg.trainer.ppo_mini_batch_size
        while len(work.taken) < self.need and len(self.ready) >= mb:
            chunk = self.ready[:mb]
            del self.ready[:mb]
            work.taken.extend(chunk)
            work.submit(work.step.add, [[s for _, s in g.ordered()] for g in chunk])
            if self._may_stream(self.need - len(work.taken)):
                work.submit(work.step.train)

    async def _train_step(self, work: _StepWork | None = None
                          ) -> tuple[list[_Group], dict[str, float]]:
        """Gather the step's groups and train on them as they come: each complete
        mini-batch goes to the worker at once, and its first-epoch optimizer step runs while
        later groups are still being generated (when _may_stream). The same computation as
        training on the whole batch at the end (trainer.update.grpo_update), which is what
        a resume replays."""
        work = work or self._begin_step()
        t0 = time.monotonic()
        self.last_progress = max(self.last_progress, t0)
        self.wait_s = 0.0
        try:
            while True:
                self._feed(work)
                if len(work.taken) >= self.need:
                    break
                self._check_fenced()
                if self.dead_tickets:
                    await self._close_dead_tickets()
                    await self._issue_tickets()
                if self.lost_samples:
                    await self._reissue_lost_samples()
                work.raise_failures()
                t_read = time.monotonic()
                deliveries = await self.consumer.read(count=256, block_ms=500)
                if not work.running:  # nothing to compute: the trainer waits for samples
                    self.wait_s += time.monotonic() - t_read
                if deliveries:
                    self.failures_since_sample = 0
                await self._take_all(deliveries)
                if not deliveries:
                    # Only when the stream has nothing for us: answers that arrived during a
                    # long update are read before any lease is judged expired.
                    await self._check_peers()
                    await self._expire_leases()
                    await self._check_stall()
            work.submit(work.step.finish)
            metrics: dict[str, float] = (await work.wait())[-1]
        finally:
            await work.settle()
        self.update_s = work.busy_s
        return work.taken, metrics

    def _check_fenced(self) -> None:
        if self.fenced is not None:
            raise Fenced(self.keys.trainer_lease, self.lease.token, self.fenced)

    # ------------------------------------------------------------------ checkpoints

    async def _resume(self) -> None:
        """Rebuild the model the trainer had: checkpoint, then re-apply the steps after it."""
        st = self.state
        await self._optimizer_ready()
        ckpt_step, ckpt_path = st.checkpoint()
        if ckpt_path is not None:
            if not await asyncio.to_thread(os.path.exists, ckpt_path):
                raise RuntimeError(f"checkpoint {ckpt_path} named in the log is missing")
            await self._off(load_checkpoint, ckpt_path, self.policy, self.optimizer,
                            self.device)
        replay = st.steps_after_checkpoint()
        trigger = self.cfg.async_training.trigger_parameter_sync_step
        for rec in replay:
            groups = await replay_groups(self.bus, self.keys, rec)
            # The version the trainer held while training that step.
            self.version = (rec.step - 1) // trigger
            await self._off(self._update, groups)
        # Derived from finished steps, not from the newest WeightsPublished: weights published
        # by a step that never finished are superseded when that step is trained again.
        self.version = st.last_step // trigger
        published = st.weights_of(self.version)
        match = None
        if published is not None:
            blob = await self._off(self.policy.state_bytes)
            match = hashlib.sha256(blob).hexdigest() == published.sha256
        await self._publish(TrainerResumed(
            step=st.last_step, param_version=self.version, checkpoint_step=ckpt_step,
            replayed_steps=len(replay), weights_match=match,
            events_read=self.log_entries_read,
        ))
        if match is False:
            await self._publish(WarningRaised(
                source="trainer", code="resume_weights_mismatch",
                message=f"the resumed model does not hash to weights version {self.version} "
                        "that the trainer published before it stopped",
            ))
        await self._sweep_weight_blobs()
        # Open tickets are still out (pending, unread, or lost with a Redis tail): their
        # leases start now.
        now = time.monotonic()
        self.issued_at = dict.fromkeys(st.ledger.open, now)

    # ------------------------------------------------------------------ the run

    async def run(self) -> int:
        try:
            await self._acquire_lease()
        except TrainerConflict as exc:
            print(f"trainer: {exc}", file=sys.stderr, flush=True)
            return 1
        # From here on the lease and liveness key stay fresh, whatever the start-up costs
        # (a large model can take minutes to build or load).
        hb = self.cfg.heartbeat
        pulse_task = asyncio.create_task(pulse_forever(
            self.bus, self.keys.alive("trainer", 0), self._heartbeat, hb.interval_s,
            hb.timeout_s, before=self._renew_lease))
        try:
            return await self._run()
        finally:
            pulse_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pulse_task
            self.worker.shutdown(wait=False, cancel_futures=True)
            with contextlib.suppress(Exception):
                await self.lease.release()

    async def _run(self) -> int:
        await self._read_log()
        total = self.cfg.trainer.total_training_steps
        if self.state.finished and self.state.last_step >= total:
            print(f"trainer: run {self.run_id} already finished at step {self.state.last_step}")
            return 0
        self.loop_cpu_at = time.thread_time()
        await self._off(self._build)
        # Its own thread: the worker serialises weights version 0 meanwhile.
        self.building_optimizer = asyncio.ensure_future(asyncio.to_thread(self._build_optimizer))
        resumed = self.state.started
        await self.consumer.ensure_group()
        await Consumer(self.bus, self.keys.prompts, ROLLOUTER_GROUP, "trainer",
                       dlq_stream=self.keys.dlq).ensure_group()
        tasks: list[asyncio.Task[None]] = []
        try:
            if resumed:
                await self._resume()
            cfg_tree = config_to_dict(self.cfg)
            await self._publish(RunStarted(run_id=self.run_id, config=cfg_tree, resumed=resumed))
            if not resumed:
                await self.bus.publish(RUNS_STREAM, RunStarted(run_id=self.run_id, config=cfg_tree))
            tasks.append(asyncio.create_task(self._follow_events()))
            return await self._loop(resumed)
        except PeerDead as exc:
            print(f"trainer: {exc}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                await self._publish(ComponentFailed(role="trainer", rank=0, error=str(exc)))
            return 1
        except Fenced as exc:
            print(f"trainer: fenced out, another trainer owns run {self.run_id!r}: {exc}",
                  file=sys.stderr, flush=True)
            return 1
        finally:
            if self.building_optimizer is not None:
                with contextlib.suppress(Exception):
                    await self.building_optimizer
            if self.upcoming is not None:
                await self.upcoming.settle()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if self.agent is not None:
                with contextlib.suppress(Exception):
                    await self._publish(*(await self._off(self.agent.close)))

    async def _trim(self, trained: Sequence[str]) -> None:
        """Retention (run.retention=checkpoint): after the durable checkpoint of this step,
        samples and tickets before it are needed by no resume; trim_safely never removes an
        entry any group still has pending or undelivered (those later steps need). Events
        before the safe point are archived to disk, then trimmed, and checkpoints beyond
        trainer.max_actor_ckpt_to_keep deleted (trainer.retention; file work on threads)."""
        if trained:
            newest = max(trained, key=entry_key)
            await self.bus.trim_safely(self.keys.samples, minid=newest)
        latest = await self.bus.latest(self.keys.prompts)
        if latest is not None:
            await self.bus.trim_safely(self.keys.prompts, minid=latest.id)
        try:
            await retain(self.bus, self.keys, self.run_dir, keep_weights=KEEP_WEIGHTS,
                         keep_checkpoints=self.cfg.trainer.max_actor_ckpt_to_keep,
                         last_step=self.state.last_step, current=self.state.checkpoint()[1],
                         fence=(self.keys.trainer_lease, self.lease.token),
                         rollouter_ranks=[hb.rank for hb in self.rollouters])
        except OSError as exc:  # the archive could not be written: nothing was trimmed
            await self._publish(WarningRaised(
                source="trainer", code="events_not_archived",
                message=f"events stream not trimmed: the archive failed: {exc}"))

    async def _loop(self, resumed: bool) -> int:
        cfg, tc = self.cfg, self.cfg.trainer
        self.rollouters_seen_at = time.monotonic()  # rollouters are judged from here on
        if self.agent is not None and not resumed:
            await self._wait_for_profiler()
        await self._apply_commands()
        first = self.state.last_step + 1
        # Step barrier (docs/profiling.md): close commands for step `first` before weights
        # (version 0) let a rollouter begin it; guarded StartProfiles for it now fail.
        await self.bus.set_barrier(self.keys.barrier, first)
        # Resumed too: rollouters may hold weights the log no longer vouches for (a lost
        # tail); the newest publication in log order is what they load.
        await self._publish_weights(step=self.state.last_step)
        await self._issue_tickets()
        await self._optimizer_ready()  # the rollouters generate step `first` meanwhile
        trigger = cfg.async_training.trigger_parameter_sync_step
        for step in range(first, tc.total_training_steps + 1):
            self._check_fenced()
            await self._apply_commands()
            # The step's clock starts where its profiled `step:K` annotation does.
            t0 = time.monotonic()
            if self.agent is not None:
                await self._publish(*(await self._off(self.agent.step_begin, step)))
            await self._publish(StepStarted(step=step, param_version=self.version))
            work, self.upcoming = self.upcoming, None
            groups, metrics = await self._train_step(work)
            # verl's per-window view: the share of this sync window's prompts generated with
            # weights older than the trainer's (at most staleness_threshold).
            self.window_groups += len(groups)
            self.window_stale += sum(1 for g in groups if self._possibly_stale(g))
            metrics["staleness/window_stale_share"] = self.window_stale / self.window_groups
            # Close step+1 to commands before its weights (or our next control read) exist.
            await self.bus.set_barrier(self.keys.barrier, step + 1)
            save = ((tc.save_freq > 0 and step % tc.save_freq == 0)
                    or step == tc.total_training_steps)
            serialised = None
            if step % trigger == 0:
                self.version += 1
                self.window_groups = self.window_stale = 0
                serialised = self._submit(self.policy.state_bytes)
            if self.agent is None and not save:
                # Off the critical path: the next step's ready mini-batches train (queued
                # behind the weights' serialisation) while this step's weights, StepFinished
                # and tickets go out. Profiled runs keep the boundary serial (the agent's
                # step_end/step_begin bracket each step's work), and so do checkpoint steps.
                self.upcoming = self._begin_step()
            if serialised is not None:
                await self._publish_weights(step, serialised)
            saved = None
            if save:
                snapshot = msgspec.msgpack.encode(Snapshot(
                    self.state, self.events_position or "0-0", self.last_finished_id))
                saved = await self._off(write_checkpoint, self.run_dir / "checkpoints", step,
                                        self.version, self.policy, self.optimizer, snapshot)
                await self._publish(CheckpointSaved(step=step, path=str(saved),
                                                    param_version=self.version))
            pairs = [pair for g in groups for pair in g.ordered()]
            if time.monotonic() - self.peers_read_at >= self.cfg.heartbeat.interval_s:
                await self._read_peers()  # for rollouter/idle_ratio: as fresh as their pulses
            duration = time.monotonic() - t0
            metrics.update(self._run_metrics(duration, self.update_s, len(pairs)))
            entry_ids = [eid for eid, _ in pairs]
            finished = StepFinished(step=step, sample_ids=[s.sample_id for _, s in pairs],
                                    metrics=metrics, duration_s=duration,
                                    param_version=self.version, entry_ids=entry_ids)
            # The acks ride in the same fenced script as the StepFinished that justifies them.
            # ... and only if the previous StepFinished is still in the log.
            require = (None if self.last_finished_id is None
                       else (self.keys.events, self.last_finished_id))
            ids = await self._write([(self.keys.events, finished)],
                                    ack=(self.keys.samples, GROUP, entry_ids), require=require)
            self.consumer.acked(entry_ids)
            self.state = apply(self.state, finished)
            self.last_finished_id = self.events_position = ids[0]
            for g in groups:
                self.taken.discard(g.index)
                self.issued_at.pop(g.index, None)
                self.ticket_entry.pop(g.index, None)
            self.last_progress = time.monotonic()
            if self.agent is not None:
                await self._publish(*(await self._off(self.agent.step_end, step)))
            if step < tc.total_training_steps:
                await self._issue_tickets()
            if saved is not None and cfg.run.retention == "checkpoint":
                await self._trim(entry_ids)  # after the step: off its critical path
        if self.agent is not None:
            await self._publish(*(await self._off(self.agent.close)))
            self.agent = None
        await self._publish(RunFinished(run_id=self.run_id, steps=tc.total_training_steps))
        print(f"trainer: run {self.run_id} finished ({tc.total_training_steps} steps)", flush=True)
        return 0

    def _update(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        return grpo_update(self.policy, self.optimizer, groups, self.cfg.trainer,
                           temperature=self.cfg.rollout.temperature, version=self.version,
                           device=self.device)

    def _run_metrics(self, duration: float, update_s: float, n_samples: int) -> dict[str, float]:
        idle = [hb.metrics["rollouter/idle_ratio"] for hb in self.rollouters
                if "rollouter/idle_ratio" in hb.metrics]
        ledger = self.state.ledger
        # Called on the event loop's thread: its CPU since the last step (reading, decoding
        # and checking samples, publishing), which shares the core with the update.
        now = time.thread_time()
        loop_cpu, self.loop_cpu_at = now - self.loop_cpu_at, now
        return {
            "trainer/idle_ratio": min(1.0, self.wait_s / duration) if duration > 0 else 0.0,
            "trainer/update_s": update_s,
            "trainer/loop_cpu_s": loop_cpu,
            "rollouter/idle_ratio": sum(idle) / len(idle) if idle else math.nan,
            "samples/queue_depth": float(
                sum(len(g.samples) for g in self.ready)
                + sum(len(g.samples) for g in self.groups.values())
            ),
            "throughput/samples_per_s": n_samples / duration if duration > 0 else 0.0,
            "tickets/issued": float(ledger.issued),
            "tickets/outstanding": float(ledger.outstanding),
            "tickets/budget": float(self.capacity),
            "tickets/reissued": float(self.reissued),
            "samples/refused": float(self.refused),
            "rollout/failures": float(self.rollout_failures),
            "staleness/discarded_groups": float(self.discarded),
        }


async def _serve(cfg: Config, bus: Bus) -> int:
    """Run the trainer; when the log turns out to be behind it (Redis lost its tail), start
    over from the log in this process, a bounded number of times."""
    for attempt in range(MAX_LOG_RESTARTS + 1):
        trainer = Trainer(cfg, bus)
        try:
            return await trainer.run()
        except LogBehind as exc:
            print(f"trainer: {exc}; resuming from the log ({attempt + 1}/{MAX_LOG_RESTARTS})",
                  file=sys.stderr, flush=True)
    print(f"trainer: the log kept falling behind {MAX_LOG_RESTARTS} times; giving up",
          file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer [--config FILE] [KEY=VALUE ...]``."""
    cfg = load_or_exit(list(sys.argv[1:] if argv is None else argv), "trainer")
    if not cfg.redis.url:
        print("trainer: error: invalid config key 'redis.url': the trainer needs a Redis URL "
              "(rlbus up starts one for you)", file=sys.stderr)
        return 2
    if not cfg.run.id:
        print("trainer: error: invalid config key 'run.id': the trainer needs a run id",
              file=sys.stderr)
        return 2
    return run_with_bus(cfg.redis.url or "", "trainer", lambda bus: _serve(cfg, bus))
