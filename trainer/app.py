"""The trainer process: issues prompt tickets, trains on samples, publishes steps and weights.

One step ``k`` (1-based), as in docs/architecture.md:

1. apply the profiling commands due at ``k`` (profiler agent), publish ``StepStarted(k)``;
2. gather ``require_batches * ppo_mini_batch_size`` complete prompt groups from the samples
   stream (own pending entries first, duplicates of trained samples acked and skipped);
3. GRPO update (group-normalised advantages, PPO-clip with rollout log-probs as old log-probs,
   truncated importance weights for stale samples, grad clipping, Adam);
4. every ``trigger_parameter_sync_step`` steps publish weights (claim check + WeightsPublished),
   checkpoint when due, publish ``StepFinished(k, sample_ids, metrics)``, then ack the samples;
5. issue new tickets up to the staleness budget, tagged with the current weights version.

A restarted trainer folds the events log (trainer.state), loads the latest checkpoint and
re-applies the finished steps after it from their recorded sample ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from bus import Bus, Consumer, Delivery, RunKeys, read_commands, run_with_bus
from bus.blobs import DirBlobStore, RedisBlobStore
from bus.keys import RUNS_STREAM
from bus.messages import (
    BlobRef,
    CheckpointSaved,
    ComponentFailed,
    DeadLetter,
    Event,
    Heartbeat,
    ProfilerReady,
    PromptTicket,
    RolloutFailed,
    RunFinished,
    RunStarted,
    Sample,
    StepFinished,
    StepStarted,
    TrainerResumed,
    WarningRaised,
    WeightsPublished,
)
from policy import build_policy, resolve_device
from profiling import create_agent
from runconfig import Config, config_to_dict, load_or_exit
from tasks import build_prompt_source
from trainer.budget import TicketBudget, max_staleness, ticket_budget
from trainer.grpo import approx_kl, build_batch, group_advantages, masked_mean, ppo_clip_loss
from trainer.state import TrainerState, fold

__all__ = ["PeerDead", "Trainer", "main"]

GROUP = "trainer"
# Consecutive rollout failures (with no sample in between) after which the run fails loudly.
FAILURE_LIMIT = 10
ROLLOUTER_GROUP = "rollouter"
CONSUMER = "trainer-0"
# Above this many bytes the weights go to a directory blob store instead of Redis chunks.
REDIS_BLOB_LIMIT = 64 * 1024 * 1024
KEEP_WEIGHTS = 3  # weight versions whose blobs stay readable


class PeerDead(RuntimeError):
    """A component the trainer depends on has gone silent; the message names it."""


class _Group(msgspec.Struct):
    """The responses of one ticket gathered so far (entry ids kept for the ack)."""

    ticket_id: str
    n: int
    samples: dict[int, tuple[str, Sample]] = {}
    arrived: float = 0.0

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.n


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
        self.budget = TicketBudget(
            ticket_budget(ac.staleness_threshold, ac.trigger_parameter_sync_step,
                          ac.require_batches, tc.ppo_mini_batch_size)
        )
        self.max_staleness = max_staleness(
            ac.staleness_threshold, ac.trigger_parameter_sync_step, ac.require_batches,
            tc.ppo_mini_batch_size,
        )
        self.device = resolve_device(tc.device)
        self.prompts = build_prompt_source(
            {"kind": cfg.task.kind, "path": cfg.task.path, "min_digits": cfg.task.min_digits,
             "max_digits": cfg.task.max_digits, "seed": cfg.task.seed}
        )
        self.version = 0
        self.state = TrainerState()
        self.groups: dict[str, _Group] = {}
        self.ready: list[_Group] = []
        self.consumer = Consumer(bus, self.keys.samples, GROUP, CONSUMER, dlq_stream=self.keys.dlq)
        self.heartbeats: dict[tuple[str, int], Heartbeat] = {}
        self.last_sample_at = time.monotonic()
        self.rollout_failures = 0
        self.failures_since_sample = 0
        self.last_failure = ""
        self.dead_tickets = 0  # dead-lettered tickets whose budget slot is not freed yet
        self.dlq_last = "0"
        self.discarded = 0
        self.profiler_ready = asyncio.Event()
        self.agent: Any = None  # created only when profiling is configured
        self.control_last = "0"
        self.events_last = "0"
        self.wait_s = 0.0
        self.blobs: RedisBlobStore | DirBlobStore = RedisBlobStore(bus, self.keys)
        self.published: list[tuple[RedisBlobStore | DirBlobStore, BlobRef]] = []

    # ------------------------------------------------------------------ set-up

    async def _read_log(self) -> None:
        events = [msg async for _, msg in self.bus.read_all(self.keys.events)]
        self.state = fold(events)

    def _build(self) -> None:
        tc = self.cfg.trainer
        torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.policy = build_policy(msgspec.to_builtins(self.cfg.model), self.device)
        self.policy.train()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=tc.lr)
        # None when profiling is off: then no profiler object exists at all.
        self.agent = create_agent(
            self.cfg, "trainer", 0, str(self.device), after_step=self.state.last_step
        )

    async def _publish(self, *events: Event) -> None:
        if events:
            await self.bus.publish_many(self.keys.events, list(events))

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
        """Background: heartbeats of peers, rollout failures, ProfilerReady."""
        while True:
            entries, self.events_last = await self.bus.read_after(
                self.keys.events, self.events_last, count=1000, block_ms=1000
            )
            for _, msg in entries:
                match msg:
                    case Heartbeat(role="rollouter"):
                        self.heartbeats[(msg.role, msg.rank)] = msg
                    case RolloutFailed():
                        self.rollout_failures += 1
                        self.failures_since_sample += 1
                        self.last_failure = f"rollouter{msg.rank}: {msg.error}"
                    case ProfilerReady():
                        self.profiler_ready.set()
            dead, self.dlq_last = await self.bus.read_after(
                self.keys.dlq, self.dlq_last, count=1000
            )
            # A ticket that failed max_deliveries times will never come back as samples: free
            # its budget slot (in the main loop) so the run does not starve on lost tickets.
            self.dead_tickets += sum(
                1 for _, m in dead
                if isinstance(m, DeadLetter) and m.source_stream == self.keys.prompts
            )

    async def _heartbeat(self) -> None:
        while True:
            await self._publish(Heartbeat(role="trainer", rank=0, pid=os.getpid(),
                                          state=f"step {self.state.last_step}"))
            await asyncio.sleep(self.cfg.heartbeat.interval_s)

    async def _wait_for_profiler(self) -> None:
        timeout = self.cfg.global_profiler.handshake_timeout_s
        try:
            await asyncio.wait_for(self.profiler_ready.wait(), timeout)
        except TimeoutError:
            print(f"trainer: no ProfilerReady from the profiler service within {timeout} s; "
                  "going on without waiting", file=sys.stderr, flush=True)
            await self._publish(WarningRaised(
                source="trainer", code="profiler_handshake_timeout",
                message=f"profiler service sent no ProfilerReady within {timeout} s "
                        "(global_profiler.handshake_timeout_s); step-1 commands may be missed",
            ))

    async def _publish_weights(self, step: int) -> None:
        blob = self.policy.state_bytes()
        if len(blob) > REDIS_BLOB_LIMIT and not isinstance(self.blobs, DirBlobStore):
            self.blobs = DirBlobStore(self.run_dir / "blobs")
        ref = await self.blobs.put(f"weights-v{self.version}", blob)
        await self._publish(WeightsPublished(version=self.version, ref=ref, step=step))
        # Only the newest versions are ever loaded (rollouters take the latest); dropping
        # older blobs keeps Redis (and its AOF) from growing by one model per step.
        self.published.append((self.blobs, ref))
        while len(self.published) > KEEP_WEIGHTS:
            store, old = self.published.pop(0)
            await store.delete(old)

    # ------------------------------------------------------------------ tickets

    async def _issue_tickets(self) -> None:
        room = self.budget.room()
        if room <= 0:
            return
        tickets = []
        for _ in range(room):
            index = self.budget.issued
            prompt = self.prompts.get(index)
            tickets.append(PromptTicket(
                ticket_id=f"t{index}", prompt_id=prompt.prompt_id, prompt=prompt.prompt,
                answer=prompt.answer, n=self.cfg.rollout.n, min_version=self.version,
            ))
            self.budget.take(1)
        await self.bus.publish_many(self.keys.prompts, tickets)

    # ------------------------------------------------------------------ samples

    def _check_peers(self) -> None:
        """Raise PeerDead when no rollouter has been heard from within the heartbeat timeout,
        or when rollouts keep failing and nothing else arrives."""
        if self.failures_since_sample >= FAILURE_LIMIT:
            raise PeerDead(
                f"rollouts keep failing: {self.failures_since_sample} failures and no sample "
                f"since the last one; last failure from {self.last_failure}"
            )
        timeout = self.cfg.heartbeat.timeout_s
        now = time.time()
        silent_for = time.monotonic() - self.last_sample_at
        if silent_for < timeout:
            return
        alive = [hb for hb in self.heartbeats.values() if now - hb.ts < timeout]
        if alive:
            return
        if not self.heartbeats:
            raise PeerDead(
                f"no rollouter: none has sent a heartbeat and no sample arrived in "
                f"{silent_for:.0f} s (heartbeat.timeout_s={timeout}); is a rollouter running "
                f"for run {self.run_id!r} at this Redis?"
            )
        last = max(self.heartbeats.values(), key=lambda hb: hb.ts)
        raise PeerDead(
            f"rollouter{last.rank} (and every other rollouter) is silent: last heartbeat "
            f"{now - last.ts:.0f} s ago, no sample for {silent_for:.0f} s "
            f"(heartbeat.timeout_s={timeout})"
        )

    async def _take(self, delivery: Delivery) -> None:
        entry_id, msg = delivery.id, delivery.msg
        if not isinstance(msg, Sample):
            await self.consumer.dead_letter(
                delivery, f"expected a Sample, got {type(msg).__name__}"
            )
            return
        if msg.sample_id in self.state.trained:
            await self.consumer.ack(entry_id)  # redelivered after a crash: trained already
            return
        group = self.groups.get(msg.ticket_id)
        if group is None:
            group = self.groups[msg.ticket_id] = _Group(msg.ticket_id, msg.n, {})
        if msg.index in group.samples:
            await self.consumer.ack(entry_id)  # a duplicate publication of the same response
            return
        group.samples[msg.index] = (entry_id, msg)
        if not group.complete:
            return
        del self.groups[msg.ticket_id]
        group.arrived = time.monotonic()
        oldest = min(s.min_version for _, s in group.samples.values())
        if self.version - oldest > self.max_staleness:
            # Only a ticket held far longer than its peers gets here; training on it would break
            # the staleness bound, so it is dropped loudly and its budget slot is freed.
            self.discarded += 1
            self.budget.complete(1)
            await self.consumer.ack(*(eid for eid, _ in group.samples.values()))
            await self._publish(WarningRaised(
                source="trainer", code="stale_group_discarded",
                message=f"ticket {group.ticket_id} generated with weights {oldest} is "
                        f"{self.version - oldest} versions old (max {self.max_staleness})",
            ))
            await self._issue_tickets()
            return
        self.ready.append(group)

    async def _free_dead_tickets(self) -> None:
        if not self.dead_tickets:
            return
        count, self.dead_tickets = self.dead_tickets, 0
        self.budget.complete(min(count, self.budget.outstanding))
        await self._publish(WarningRaised(
            source="trainer", code="tickets_dead_lettered",
            message=f"{count} prompt ticket(s) failed too often and went to {self.keys.dlq}; "
                    "issuing new ones in their place",
        ))
        await self._issue_tickets()

    async def _gather(self) -> list[_Group]:
        t0 = time.monotonic()
        while len(self.ready) < self.need:
            await self._free_dead_tickets()
            deliveries = await self.consumer.read(count=256, block_ms=500)
            if deliveries:
                self.last_sample_at = time.monotonic()
                self.failures_since_sample = 0
            for d in deliveries:
                await self._take(d)
            if not deliveries:
                self._check_peers()
        self.wait_s = time.monotonic() - t0
        batch, self.ready = self.ready[: self.need], self.ready[self.need :]
        return batch

    # ------------------------------------------------------------------ update

    def _update(self, groups: Sequence[_Group]) -> dict[str, float]:
        tc = self.cfg.trainer
        mb = tc.ppo_mini_batch_size
        samples = [[s for _, (_, s) in sorted(g.samples.items())] for g in groups]
        rewards = torch.tensor([[s.reward for s in group] for group in samples])
        adv = group_advantages(rewards)
        stats: dict[str, list[float]] = {k: [] for k in ("loss", "clip", "ent", "gn", "kl")}
        temperature = self.cfg.rollout.temperature
        minibatches = []
        for start in range(0, len(samples), mb):
            flat = [s for group in samples[start : start + mb] for s in group]
            batch = build_batch(
                # copies: Array.numpy() views read-only message bytes
                [(s.prompt_tokens.numpy().copy(), s.response_tokens.numpy().copy(),
                  s.logprobs.numpy().copy()) for s in flat],
                pad_id=self.policy.pad_id, device=self.device,
            )
            old = batch.old_logprobs
            stale = any(s.min_version < self.version for s in flat)
            if tc.tis_cap is not None and stale:
                # Decoupled PPO for stale samples: the ratio is taken against the current
                # (proximal) weights and the rollout policy enters only through a truncated
                # importance weight, so a very stale sample cannot dominate the step.
                with torch.no_grad():
                    old, _ = self.policy.logprobs_and_entropy(
                        batch.input_ids, batch.attention_mask, batch.response_len,
                        temperature=temperature,
                    )
            a = adv[start : start + mb].reshape(-1).to(self.device)
            minibatches.append((batch, old, a, stale))
        for _ in range(tc.ppo_epochs):
            for batch, old, a, stale in minibatches:
                logp, entropy = self.policy.logprobs_and_entropy(
                    batch.input_ids, batch.attention_mask, batch.response_len,
                    temperature=temperature,
                )
                use_tis = tc.tis_cap is not None and stale
                loss, clipfrac = ppo_clip_loss(
                    logp, old, a, batch.response_mask, tc.clip_ratio_low, tc.clip_ratio_high,
                    logp_behaviour=batch.old_logprobs if use_tis else None,
                    tis_cap=tc.tis_cap if use_tis else None,
                )
                ent = masked_mean(entropy, batch.response_mask)
                if tc.entropy_coeff:
                    loss = loss - tc.entropy_coeff * ent
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), tc.grad_clip)
                self.optimizer.step()
                stats["loss"].append(loss.item())
                stats["clip"].append(clipfrac.item())
                stats["ent"].append(ent.item())
                stats["gn"].append(float(grad_norm))
                stats["kl"].append(float(approx_kl(logp, old, batch.response_mask)))
        flat_all = [s for group in samples for s in group]
        staleness = [self.version - s.min_version for s in flat_all]
        lengths = [len(s.response_tokens) for s in flat_all]

        def mean(xs: Sequence[float]) -> float:
            return float(sum(xs) / len(xs)) if xs else 0.0

        return {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "staleness/mean": mean(staleness),
            "staleness/max": float(max(staleness)),
            "actor/loss": mean(stats["loss"]),
            "actor/pg_clipfrac": mean(stats["clip"]),
            "actor/entropy": mean(stats["ent"]),
            "actor/grad_norm": mean(stats["gn"]),
            "actor/approx_kl": mean(stats["kl"]),
            "response/length_mean": mean(lengths),
        }

    def _samples_of(self, groups: Sequence[_Group]) -> list[tuple[str, Sample]]:
        return [pair for g in groups for _, pair in sorted(g.samples.items())]

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, step: int) -> Path:
        folder = self.run_dir / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{step:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "version": self.version,
                    "model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "tickets_issued": self.budget.issued}, tmp)
        os.replace(tmp, path)  # atomic: a crash leaves the old checkpoint or the new one
        return path

    def _load_checkpoint(self, path: str) -> None:
        ckpt = torch.load(path, map_location=self.device, weights_only=True)
        self.policy.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])

    async def _resume(self) -> None:
        """Rebuild the model the trainer had: checkpoint, then re-apply the steps after it."""
        st = self.state
        ckpt_step, ckpt_path = st.checkpoint()
        if ckpt_path is not None:
            if not await asyncio.to_thread(os.path.exists, ckpt_path):
                raise RuntimeError(f"checkpoint {ckpt_path} named in the log is missing")
            self._load_checkpoint(ckpt_path)
        replay = st.steps_after_checkpoint()
        trigger = self.cfg.async_training.trigger_parameter_sync_step
        if replay:
            wanted = {sid for rec in replay for sid in rec.sample_ids}
            found: dict[str, Sample] = {}
            async for _, msg in self.bus.read_all(self.keys.samples):
                if isinstance(msg, Sample) and msg.sample_id in wanted:
                    found[msg.sample_id] = msg
            for rec in replay:
                missing = [sid for sid in rec.sample_ids if sid not in found]
                if missing:
                    raise RuntimeError(
                        f"cannot re-apply step {rec.step}: samples {missing[:3]} are no longer "
                        "in the samples stream"
                    )
                by_ticket: dict[str, _Group] = {}
                for sid in rec.sample_ids:
                    s = found[sid]
                    g = by_ticket.setdefault(s.ticket_id, _Group(s.ticket_id, s.n, {}))
                    g.samples[s.index] = ("", s)
                # The version the trainer held while training that step (metrics only).
                self.version = (rec.step - 1) // trigger
                self._update(list(by_ticket.values()))
        # Derived from finished steps, not from the newest WeightsPublished: weights published
        # by a step that never finished are superseded when that step is trained again.
        self.version = st.last_step // trigger
        published = st.weights_of(self.version)
        match = None
        if published is not None:
            match = hashlib.sha256(self.policy.state_bytes()).hexdigest() == published.sha256
        await self._publish(TrainerResumed(
            step=st.last_step, param_version=self.version, checkpoint_step=ckpt_step,
            replayed_steps=len(replay), weights_match=match,
        ))
        if match is False:
            await self._publish(WarningRaised(
                source="trainer", code="resume_weights_mismatch",
                message=f"the resumed model does not hash to weights version {self.version} "
                        "that the trainer published before it stopped",
            ))
        # Tickets: every issued ticket is in the prompts stream; those not trained yet are
        # still out (pending or unread), so the budget counts them.
        issued = await self.bus.length(self.keys.prompts)
        trained_groups = len({sid.rsplit("/", 1)[0] for sid in st.trained})
        self.budget = TicketBudget(self.budget.capacity, issued, min(trained_groups, issued))

    # ------------------------------------------------------------------ the run

    async def run(self) -> int:
        await self._read_log()
        if self.state.finished:
            print(f"trainer: run {self.run_id} already finished at step {self.state.last_step}")
            return 0
        self._build()
        resumed = self.state.started
        await self.consumer.ensure_group()
        await Consumer(self.bus, self.keys.prompts, ROLLOUTER_GROUP, "trainer",
                       dlq_stream=self.keys.dlq).ensure_group()
        if resumed:
            await self._resume()
        cfg_tree = config_to_dict(self.cfg)
        await self._publish(RunStarted(run_id=self.run_id, config=cfg_tree, resumed=resumed))
        if not resumed:
            await self.bus.publish(RUNS_STREAM, RunStarted(run_id=self.run_id, config=cfg_tree))
        tasks = [asyncio.create_task(self._follow_events()), asyncio.create_task(self._heartbeat())]
        try:
            return await self._loop(resumed)
        except PeerDead as exc:
            print(f"trainer: {exc}", file=sys.stderr, flush=True)
            await self._publish(ComponentFailed(role="trainer", rank=0, error=str(exc)))
            return 1
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if self.agent is not None:
                with contextlib.suppress(Exception):
                    await self._publish(*self.agent.close())

    async def _loop(self, resumed: bool) -> int:
        cfg, tc = self.cfg, self.cfg.trainer
        if self.agent is not None and not resumed:
            await self._wait_for_profiler()
        await self._apply_commands()
        first = self.state.last_step + 1
        # Step barrier (docs/profiling.md): close commands for step `first` before weights
        # (version 0) let a rollouter begin it; guarded StartProfiles for it now fail.
        await self.bus.set_barrier(self.keys.barrier, first)
        if not resumed:
            await self._publish_weights(step=0)
        await self._issue_tickets()
        trigger = cfg.async_training.trigger_parameter_sync_step
        for step in range(first, tc.total_training_steps + 1):
            t0 = time.monotonic()
            await self._apply_commands()
            if self.agent is not None:
                await self._publish(*self.agent.step_begin(step))
            await self._publish(StepStarted(step=step, param_version=self.version))
            groups = await self._gather()
            t_update = time.monotonic()
            metrics = self._update(groups)
            update_s = time.monotonic() - t_update
            # Close step+1 to commands before its weights (or our next control read) exist.
            await self.bus.set_barrier(self.keys.barrier, step + 1)
            if step % trigger == 0:
                self.version += 1
                await self._publish_weights(step)
            if (tc.save_freq and step % tc.save_freq == 0) or step == tc.total_training_steps:
                path = self._save_checkpoint(step)
                await self._publish(CheckpointSaved(step=step, path=str(path),
                                                    param_version=self.version))
            pairs = self._samples_of(groups)
            duration = time.monotonic() - t0
            metrics.update(self._run_metrics(duration, update_s, len(pairs)))
            ids = [s.sample_id for _, s in pairs]
            await self._publish(StepFinished(step=step, sample_ids=ids, metrics=metrics,
                                             duration_s=duration, param_version=self.version))
            self.state = msgspec.structs.replace(
                self.state, last_step=step, trained=self.state.trained | frozenset(ids)
            )
            await self.consumer.ack(*(eid for eid, _ in pairs))
            self.budget.complete(len(groups))
            if self.agent is not None:
                await self._publish(*self.agent.step_end(step))
            if step < tc.total_training_steps:
                await self._issue_tickets()
        if self.agent is not None:
            await self._publish(*self.agent.close())
            self.agent = None
        await self._publish(RunFinished(run_id=self.run_id, steps=tc.total_training_steps))
        print(f"trainer: run {self.run_id} finished ({tc.total_training_steps} steps)", flush=True)
        return 0

    def _run_metrics(self, duration: float, update_s: float, n_samples: int) -> dict[str, float]:
        now = time.time()
        fresh = [hb for hb in self.heartbeats.values()
                 if now - hb.ts < self.cfg.heartbeat.timeout_s]
        idle = [hb.metrics["rollouter/idle_ratio"] for hb in fresh
                if "rollouter/idle_ratio" in hb.metrics]
        return {
            "trainer/idle_ratio": min(1.0, self.wait_s / duration) if duration > 0 else 0.0,
            "trainer/update_s": update_s,
            "rollouter/idle_ratio": sum(idle) / len(idle) if idle else math.nan,
            "samples/queue_depth": float(
                sum(len(g.samples) for g in self.ready)
                + sum(len(g.samples) for g in self.groups.values())
            ),
            "throughput/samples_per_s": n_samples / duration if duration > 0 else 0.0,
            "tickets/issued": float(self.budget.issued),
            "tickets/outstanding": float(self.budget.outstanding),
            "tickets/budget": float(self.budget.capacity),
            "rollout/failures": float(self.rollout_failures),
            "staleness/discarded_groups": float(self.discarded),
        }


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
    return run_with_bus(cfg.redis.url or "", "trainer", lambda bus: Trainer(cfg, bus).run())
