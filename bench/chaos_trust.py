"""Issue 22's scenarios for bench/chaos.py: trust nobody on the bus.

:class:`Trust` adds to the chaos run (on by default; ``--no-trust`` leaves them out):

- **forgeries**, cycled with the other injected entries in phase 1 and every 1-2 s through
  the trust phase: into the trainer's stream a RunFinished(steps=10**9), a StepFinished of
  the next step without samples, a CheckpointSaved naming a missing file, a TicketsClosed of
  open tickets, a ProfileStopped of a session nobody ran and a WeightsPublished of the next
  version naming a missing blob; into the other roles' streams facts those roles may not
  state (a RunFinished and a trainer's ProfileStopped in ``events:rollouter``, a
  ProfileStopped and a TicketsClosed in ``events:profiler``, a CheckpointSaved in
  ``events:operator``, a StepFinished in ``events:logger``). Where the Redis binary has ACL
  selectors (7+), the same forgeries are also tried as each non-trainer component user of
  bus/acl.py (XADD to the trainer's or another role's stream, SET of the trainer's lease, DEL
  of the trainer's stream): Redis must refuse every one. What each reader did with each
  forged entry is counted from the components' logs (a line naming the entry's id).
- then a **trust phase** (a continuation of the finished run by ``--trust-steps`` steps, as
  ``rlbus up`` continues a run), whose scenarios run one after the other:

  * a **fresh-key-but-dead rollouter**: rollouter0 is SIGSTOPped while it holds tickets and
    the bench keeps its liveness key fresh (SET PX of the value it last wrote, so its
    heartbeat's ``progress`` stands still); the delay until the trainer reissues one of the
    tickets it held is measured; then SIGCONT;
  * a **zombie trainer** (``--zombies`` times): the trainer is SIGSTOPped until its lease
    expires, a new trainer is started (the takeover), and once it has finished two steps the
    old one gets SIGCONT. Counted: the zombie's exit (code, seconds after SIGCONT), trainer
    facts that repeat a fact of the log (a second StepFinished or StepStarted of a step, a
    second issue of a ticket at the same attempt, a second WeightsPublished of a version)
    written while a zombie was awake, and dead letters of valid samples (the sample is no
    forgery and its ticket was issued) written then;
  * a **60 s Redis SIGSTOP**: Redis is stopped for ``--redis-stop-s`` (60) seconds, then
    continued. Measured: the longest stretch without a new line on any component's log
    (stdout and stderr) during the stop and until the run made its next two steps, per
    component and for all together, and whether the run recovered (two more steps within
    180 s of SIGCONT).

Figures printed at the end: lost, trained twice (chaos.py's own accounting, which excludes
every entry the bench wrote), longest silence, wrong dead letters, forgeries refused (by
Redis / by readers), the dead rollouter's reissue delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus import BusError, acl_rules, entry_key
from runschema.messages import (
    BlobRef,
    CheckpointSaved,
    DeadLetter,
    ProfileStopped,
    RunFinished,
    Sample,
    StepFinished,
    StepStarted,
    TicketsClosed,
    TicketsIssued,
    WarningRaised,
    WeightsPublished,
    decode,
    encode,
)
from trainer.ledger import ticket_index

__all__ = ["Trust"]

PASSWORD = "chaos-trust"
RECOVER_STEPS = 2  # steps a scenario waits for after it ends (the run goes on)
SCENARIO_TIMEOUT_S = 180.0
FORGED = 10**9  # RunFinished(steps=FORGED): chaos.py's follow passes over it


@dataclass
class Figures:
    """What the trust scenarios saw."""

    acl_tries: Counter[str] = field(default_factory=Counter)  # user:what -> tries
    acl_refused: Counter[str] = field(default_factory=Counter)
    acl_accepted: list[str] = field(default_factory=list)
    acl_note: str = ""
    reissue_delay_s: float | None = None
    no_progress_warning_s: float | None = None
    dead_held: list[str] = field(default_factory=list)
    zombies: list[dict[str, Any]] = field(default_factory=list)
    zombie_windows: list[tuple[int, int]] = field(default_factory=list)  # ms, Redis clock
    redis_stop: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    reissued_at: dict[str, float] = field(default_factory=dict)  # ticket id -> bench time
    warnings_at: dict[str, float] = field(default_factory=dict)  # code -> first bench time


class Trust:
    """Issue 22's scenarios, run by :class:`bench.chaos.Chaos` (see the module docstring)."""

    def __init__(self, chaos: Any, t0: float, say: Callable[[str], None],
                 timeout_s: float) -> None:
        self.c = chaos
        """The :class:`Chaos` bench (chaos.py runs as a script: no import of it here)."""
        self.t0, self.say, self.timeout_s = t0, say, timeout_s
        self.fig = Figures()
        self.log_growth: dict[str, float] = {}  # part name -> bench time its log last grew
        chaos.watch.listeners.append(self._listen)

    def now(self) -> float:
        """Bench time (seconds since the bench started), as chaos.py prints it."""
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ the log, live

    def _listen(self, stream: str, eid: str, msg: Any, now: float) -> None:
        t = now - self.t0
        if isinstance(msg, TicketsIssued) and msg.attempt > 0:
            for tid in msg.ticket_ids:
                self.fig.reissued_at.setdefault(tid, t)
        elif isinstance(msg, WarningRaised):
            self.fig.warnings_at.setdefault(msg.code, t)

    # ------------------------------------------------------------------ forgeries

    def actions(self) -> list[tuple[str, str, Callable[[], Awaitable[None]]]]:
        """Forged facts, each an injection action of chaos.py's cycle."""
        c, k = self.c, self.c.keys
        n = iter(range(10**9))

        def step() -> int:
            return c.watch.last_step

        def missing_blob(version: int) -> WeightsPublished:
            ref = BlobRef(store="redis", key=k.blob(f"forged-missing-{next(n)}"), size=1,
                          sha256="0" * 64, chunks=1)
            return WeightsPublished(version=version, ref=ref, step=step() + 1)

        def stopped(role: str) -> ProfileStopped:
            return ProfileStopped(session_id=f"forged-{next(n)}", role=role, rank=0,
                                  first_step=step(), last_step=step(), tool="torch",
                                  path="forged.json.gz", bytes=1, duration_s=0.1)

        def checkpoint() -> CheckpointSaved:
            return CheckpointSaved(step=step(), param_version=step(),
                                   path=str(c.out / "run" / "missing" / f"step-{step()}.pt"))

        def next_step() -> StepFinished:
            return StepFinished(step=step() + 1, sample_ids=[], metrics={}, duration_s=0.1)

        async def closed(stream: str) -> None:
            tid = await c.open_ticket()
            if tid is not None:
                await self.forge(stream, "forged-TicketsClosed",
                                 TicketsClosed(ticket_ids=[tid], reason="forged by chaos"))

        def forge(stream: str, name: str, make: Callable[[], Any],
                  ) -> tuple[str, str, Callable[[], Awaitable[None]]]:
            return (stream, name, lambda: self.forge(stream, name, make()))

        return [
            forge("events", "forged-RunFinished", lambda: RunFinished(run_id=k.run_id,
                                                                       steps=FORGED)),
            forge("events", "forged-StepFinished", next_step),
            forge("events", "forged-CheckpointSaved", checkpoint),
            ("events", "forged-TicketsClosed", lambda: closed("events")),
            forge("events", "forged-ProfileStopped", lambda: stopped("trainer")),
            forge("events", "forged-WeightsPublished-next", lambda: missing_blob(step() + 1)),
            forge("events:rollouter", "forged-RunFinished",
                  lambda: RunFinished(run_id=k.run_id, steps=FORGED)),
            forge("events:rollouter", "forged-ProfileStopped", lambda: stopped("trainer")),
            forge("events:rollouter", "forged-WeightsPublished", lambda: missing_blob(step())),
            forge("events:profiler", "forged-ProfileStopped", lambda: stopped("rollouter")),
            ("events:profiler", "forged-TicketsClosed", lambda: closed("events:profiler")),
            forge("events:operator", "forged-CheckpointSaved", checkpoint),
            forge("events:logger", "forged-StepFinished", next_step),
        ]

    async def forge(self, stream: str, kind: str, msg: Any) -> None:
        self.c.inj.add(stream, kind, await self.c.b.publish(self.c.key(stream), msg))

    async def acl_forgeries(self) -> None:
        """Each non-trainer component user (bus/acl.py's rules, made here with ACL SETUSER)
        tries to write what it may not: Redis must refuse every try."""
        c, k = self.c, self.c.keys
        info = await c.raw("INFO", "server")
        version = str(info.get("redis_version", info.get(b"redis_version", "0")))
        if int(version.split(".")[0]) < 7:
            self.fig.acl_note = f"Redis {version} has no ACL selectors: not tried"
            return
        from bus import Bus

        forged = encode(RunFinished(run_id=k.run_id, steps=FORGED))
        for user, rules in acl_rules(k.run_id).items():
            if user == "trainer":
                continue
            await c.raw("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules.split())
            host_port = c.server.url.split("://", 1)[1]
            bus = Bus.from_url(f"redis://{user}:{PASSWORD}@{host_port}")
            other = next(r for r in ("rollouter", "profiler") if r != user)
            tries: list[tuple[str, tuple[Any, ...]]] = [
                ("XADD events", ("XADD", k.events, "*", "m", forged)),
                (f"XADD events:{other}", ("XADD", k.log(other), "*", "m", forged)),
                ("SET trainer-lease", ("SET", k.trainer_lease, "forged", "PX", 1000)),
                ("DEL events", ("DEL", k.events)),
            ]
            try:
                for what, cmd in tries:
                    self.fig.acl_tries[f"{user}:{what}"] += 1
                    try:
                        reply = await bus.command(*cmd)
                    except Exception as exc:  # NOPERM: the refusal we want
                        if "NOPERM" in str(exc) or "permission" in str(exc).lower():
                            self.fig.acl_refused[f"{user}:{what}"] += 1
                        else:
                            self.fig.acl_accepted.append(f"{user}:{what}: error {exc}")
                        continue
                    self.fig.acl_accepted.append(f"{user}:{what} -> {reply!r}")
                    if cmd[0] == "XADD":  # not a fact of the run: the oracle leaves it out
                        c.inj.add(c.short(cmd[1]), "forged-acl", reply.decode())
            finally:
                with contextlib.suppress(Exception):
                    await bus.close()

    async def inject(self, stop: asyncio.Event) -> None:
        """Forgeries every 1-2 s until ``stop``, in a shuffled cycle."""
        acts, order = self.actions(), []
        while not stop.is_set():
            await asyncio.sleep(self.c.rng.uniform(1.0, 2.0))
            await self.c.watch.redis_up.wait()
            if not order:
                order = list(range(len(acts)))
                self.c.rng.shuffle(order)
            with contextlib.suppress(BusError):
                await acts[order.pop()][2]()

    # ------------------------------------------------------------------ the trust phase

    def config(self) -> list[str]:
        """Overrides of the trust phase: a shorter reward timeout, so a rollouter without
        progress loses its tickets after max(ticket lease, heartbeat.timeout_s, 10 s)."""
        return ["rollout.reward_timeout_s=10"]

    async def phase(self, steps: int, trust_steps: int, zombies: int,
                    redis_stop_s: float) -> bool:
        """Continue the finished run by ``trust_steps`` steps and run the scenarios in it."""
        c = self.c
        c.phase = 3  # the parts' log banners say which run this is
        total = steps + trust_steps
        try:
            await self.acl_forgeries()
        except Exception as exc:  # reported, the phase goes on
            self.fig.acl_note = f"not tried: {type(exc).__name__}: {exc}"
        c.make_parts(total, c.epochs1, extra=self.config())
        for name in ("profiler", "rollouter0", "rollouter1", "trainer"):
            c.parts[name].spawn()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.inject(stop)), asyncio.create_task(self.logs()),
                 asyncio.create_task(self.scenarios(total, zombies, redis_stop_s))]
        ok = await c.wait_phase(total, c.phase_deadline(trust_steps) + redis_stop_s
                                + 120.0 * (zombies + len(c.faults.scenarios())))
        stop.set()
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await t
        return ok

    async def scenarios(self, total: int, zombies: int, redis_stop_s: float) -> None:
        c = self.c
        plan: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("dead rollouter", self.dead_rollouter),
            *((f"zombie trainer {i + 1}", self.zombie) for i in range(zombies)),
            (f"Redis SIGSTOP {redis_stop_s:.0f} s", lambda: self.redis_stop(redis_stop_s)),
            *c.faults.scenarios(),  # bench/chaos_faults.py
        ]
        for name, scenario in plan:
            if not await self._steps(1, SCENARIO_TIMEOUT_S) or c.watch.last_step >= total - 3:
                self.fig.skipped.append(f"{name} (the run was at step {c.watch.last_step} "
                                        f"of {total}: raise --trust-steps)")
                continue
            self.say(f"trust: {name} at step {c.watch.last_step}")
            try:
                await scenario()
            except (BusError, TimeoutError) as exc:
                self.fig.skipped.append(f"{name}: {type(exc).__name__}: {exc}")

    async def _steps(self, n: int, timeout_s: float) -> bool:
        """Until ``n`` more steps finished (True) or ``timeout_s`` passed (False)."""
        w = self.c.watch
        target, t0 = w.progress + n, time.monotonic()
        while w.progress < target:
            if time.monotonic() - t0 > timeout_s:
                return False
            await asyncio.sleep(0.1)
        return True

    # ------------------------------------------------------------------ dead rollouter

    async def dead_rollouter(self) -> None:
        """SIGSTOP rollouter0 while it holds tickets; keep its liveness key fresh with the
        value it last wrote (its progress counter stands still); measure until one of the
        tickets it held is reissued; SIGCONT."""
        c, k = self.c, self.c.keys
        part = c.parts["rollouter0"]
        consumer = k.rollouter_consumer(0)
        held: list[str] = []
        for _ in range(200):  # a moment when it holds tickets
            if part.running and part.proc is not None:
                pending = await c.raw("XPENDING", k.prompts, "rollouter", "-", "+", 50, consumer)
                if pending:
                    os.killpg(part.proc.pid, signal.SIGSTOP)
                    t_stop = self.now()
                    pending = await c.raw("XPENDING", k.prompts, "rollouter", "-", "+", 50,
                                          consumer)
                    held = await self._tickets([p[0].decode() for p in pending])
                    break
            await asyncio.sleep(0.05)
        if not held:
            self.fig.skipped.append("dead rollouter: rollouter0 never held a ticket")
            return
        assert part.proc is not None
        pid = part.proc.pid
        self.fig.dead_held = held
        value = await c.raw("GET", part.alive_key)
        warnings_before = self.fig.warnings_at.get("rollouter_no_progress")
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < SCENARIO_TIMEOUT_S:
                if value is not None:
                    with contextlib.suppress(BusError):
                        await c.raw("SET", part.alive_key, value, "PX",
                                    int(1000 * self.timeout_s))
                at = [self.fig.reissued_at[t] for t in held if t in self.fig.reissued_at]
                if at:
                    self.fig.reissue_delay_s = min(at) - t_stop
                    break
                await asyncio.sleep(0.5)
            w = self.fig.warnings_at.get("rollouter_no_progress")
            if w is not None and w != warnings_before:
                self.fig.no_progress_warning_s = w - t_stop
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
        await self._steps(RECOVER_STEPS, SCENARIO_TIMEOUT_S)

    async def _tickets(self, entry_ids: list[str]) -> list[str]:
        """The ticket ids of prompts entries."""
        from runschema.messages import PromptTicket

        found = await self.c.b.read_ids(self.c.keys.prompts, entry_ids)
        return [m.ticket_id for m in found.values() if isinstance(m, PromptTicket)]

    # ------------------------------------------------------------------ zombie trainer

    async def zombie(self) -> None:
        """SIGSTOP the trainer until its lease expires, start a new one, SIGCONT the old one
        once the new one finished two steps; wait for the old one's exit (60 s, then
        SIGKILL)."""
        c, k = self.c, self.c.keys
        part = c.parts["trainer"]
        proc = part.proc
        if proc is None or not part.running:
            raise TimeoutError("no trainer running")
        lease = await c.raw("GET", k.trainer_lease)
        c.watch.paused.add("trainer")
        os.killpg(proc.pid, signal.SIGSTOP)
        t_stop = self.now()
        info: dict[str, Any] = {"at_step": c.watch.last_step, "pid": proc.pid}
        self.fig.zombies.append(info)
        try:
            t0 = time.monotonic()
            while await c.raw("GET", k.trainer_lease) == lease and lease is not None:
                if time.monotonic() - t0 > SCENARIO_TIMEOUT_S:
                    raise TimeoutError("the stopped trainer's lease never expired")
                await asyncio.sleep(0.2)
            info["lease_gone_s"] = self.now() - t_stop
            part.handled_pid = proc.pid  # the supervisor looks after the new one only
            part.spawn()
            c.watch.paused.discard("trainer")
            took = await self._steps(RECOVER_STEPS, SCENARIO_TIMEOUT_S)
            info["takeover_s"] = self.now() - t_stop if took else None
        finally:
            c.watch.paused.discard("trainer")
            t_cont_ms = await self._redis_ms()
            t_cont = self.now()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
        try:
            rc = await asyncio.to_thread(proc.wait, 60)
            info["exit"] = rc
            info["exit_after_s"] = self.now() - t_cont
        except subprocess.TimeoutExpired:
            info["exit"] = "still running 60 s after SIGCONT (SIGKILLed)"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 30)
        self.fig.zombie_windows.append((t_cont_ms, await self._redis_ms()))
        info["lines"] = self._zombie_lines(part.log, proc.pid)
        await self._steps(RECOVER_STEPS, SCENARIO_TIMEOUT_S)

    async def _redis_ms(self) -> int:
        sec, usec = await self.c.raw("TIME")
        return int(sec) * 1000 + int(usec) // 1000

    @staticmethod
    def _zombie_lines(log: Path, pid: int) -> list[str]:
        """Lines of the trainer log naming the lease or fencing (both trainers write it)."""
        try:
            text = log.read_text(errors="replace")
        except OSError:
            return []
        return [ln.strip()[:200] for ln in text.splitlines()
                if "ence" in ln or "lease" in ln.lower()][-4:]

    # ------------------------------------------------------------------ Redis SIGSTOP

    async def logs(self) -> None:
        """Every 0.1 s: the bench time each part's log last grew."""
        sizes: dict[str, int] = {}
        while True:
            now = self.now()
            for part in self.c.parts.values():
                with contextlib.suppress(OSError):
                    size = part.log.stat().st_size
                    if size != sizes.get(part.name):
                        sizes[part.name] = size
                        self.log_growth[part.name] = now
            await asyncio.sleep(0.1)

    async def redis_stop(self, stop_s: float) -> None:
        """SIGSTOP Redis for ``stop_s``; SIGCONT; the longest stretch without a new log line
        until the run made two more steps (or 180 s passed)."""
        c = self.c
        pid = c.server.pid
        if pid is None:
            raise TimeoutError("Redis is not running")
        c.watch.redis_up.clear()
        os.kill(pid, signal.SIGSTOP)
        t_stop = self.now()
        longest: dict[str, float] = dict.fromkeys(c.parts, 0.0)
        longest_any = 0.0
        last = {n: max(self.log_growth.get(n, t_stop), t_stop) for n in c.parts}

        def sample() -> None:
            nonlocal longest_any
            now = self.now()
            for n in c.parts:
                grew = self.log_growth.get(n, 0.0)
                if grew > last[n]:
                    last[n] = grew
                if c.parts[n].running:
                    longest[n] = max(longest[n], now - last[n])
            longest_any = max(longest_any, now - max(last.values()))

        try:
            while self.now() - t_stop < stop_s:
                sample()
                await asyncio.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        t_cont = self.now()
        c.watch.redis_up.set()
        target = c.watch.progress + RECOVER_STEPS
        while c.watch.progress < target and self.now() - t_cont < SCENARIO_TIMEOUT_S:
            sample()
            await asyncio.sleep(0.1)
        self.c.redis_kill.setdefault("stopped_s", stop_s)
        self.fig.redis_stop = {
            "stop_s": stop_s, "recovered": c.watch.progress >= target,
            "recovered_after_s": self.now() - t_cont if c.watch.progress >= target else None,
            "longest_any_s": longest_any, "longest_s": longest,
        }

    # ------------------------------------------------------------------ verdict

    async def verify(self, log: list[tuple[str, str, Any]], issued: set[int]) -> list[str]:
        """Check and print issue 22's figures; the failures."""
        c, fig = self.c, self.fig
        fails = [f"trust scenario skipped: {s}" for s in fig.skipped]
        # Forgeries: Redis's refusals, and what each reader did (a line naming the entry).
        forged = {(s, eid): kind for (s, eid), kind in c.inj.ids.items()
                  if kind.startswith("forged")}
        texts = {}
        for part in c.parts.values():
            with contextlib.suppress(OSError):
                texts[part.name] = part.log.read_text(errors="replace")
        named: Counter[str] = Counter()
        unnamed = 0
        for (_, eid), _kind in forged.items():
            who = [n for n, t in texts.items() if eid in t]
            named.update(who)
            unnamed += not who
        refusals = Counter(m.code for s, eid, m in log
                           if isinstance(m, WarningRaised) and not c.inj.has(s, eid)
                           and m.code in ("fact_refused", "weights_unloadable",
                                          "checkpoint_missing"))
        if fig.acl_accepted:
            fails.append(f"Redis accepted forgeries of component users: {fig.acl_accepted[:4]}")
        # Before the RunFinished of its own phase (a finished run continued has an older one).
        early = [(p.name, round(t)) for p in c.parts.values() for t, total in p.clean_exits
                 if t < c.watch.run_finished_at.get(total, math.inf) - 1.0]
        if early:
            fails.append(f"components exited 0 before the run finished (a forgery "
                         f"believed?): {early}")
        # The zombie: repeated trainer facts and wrong dead letters inside its windows.
        repeats, repeats_zombie = self._repeats(log)
        wrong, wrong_zombie = await self._wrong_letters(issued, _first_issues(log, c.inj))
        if wrong:
            fails.append(f"{len(wrong)} dead letter(s) of valid samples: {wrong[:3]}")
        if repeats_zombie:
            fails.append(f"{len(repeats_zombie)} trainer fact(s) repeated while a zombie was "
                         f"awake: {repeats_zombie[:3]}")
        stop = fig.redis_stop
        if stop and not stop["recovered"]:
            fails.append(f"the run did not make {RECOVER_STEPS} steps within "
                         f"{SCENARIO_TIMEOUT_S:.0f} s of Redis's SIGCONT")
        if fig.dead_held and fig.reissue_delay_s is None:
            fails.append(f"tickets of the stopped rollouter with a fresh key never reissued "
                         f"within {SCENARIO_TIMEOUT_S:.0f} s: {fig.dead_held}")

        by_kind = Counter(f"{s}:{kind}" for (s, _), kind in forged.items())
        print("  issue 22 (trust)")
        print(f"    forgeries          {len(forged)} written ("
              + ", ".join(f"{n} {kd}" for kd, n in sorted(by_kind.items())) + ")")
        print(f"    refused by Redis   {sum(fig.acl_refused.values())} of "
              f"{sum(fig.acl_tries.values())} tries as component users"
              + (f" ({fig.acl_note})" if fig.acl_note else "")
              + (f"; ACCEPTED: {fig.acl_accepted}" if fig.acl_accepted else ""))
        print("    refused by readers lines naming a forged entry: "
              + ", ".join(f"{n} {named[n]}" for n in c.parts) + f"; named by none {unnamed}; "
              f"warnings {dict(refusals) or 'none'}")
        print(f"    dead rollouter     held {fig.dead_held or 'nothing'}; reissued after "
              + (f"{fig.reissue_delay_s:.1f} s" if fig.reissue_delay_s is not None else "NEVER")
              + (f"; rollouter_no_progress warning after {fig.no_progress_warning_s:.1f} s"
                 if fig.no_progress_warning_s is not None else ""))
        for i, z in enumerate(fig.zombies, 1):
            print(f"    zombie trainer {i}   stopped at step {z.get('at_step')}; lease gone "
                  f"after {z.get('lease_gone_s', float('nan')):.1f} s, new trainer 2 steps "
                  f"after {z.get('takeover_s') or float('nan'):.1f} s; after SIGCONT: exit "
                  f"{z.get('exit')} in {z.get('exit_after_s', float('nan')):.1f} s")
        print(f"    fenced-epoch facts {len(repeats_zombie)} repeated trainer facts while a "
              f"zombie was awake ({len(repeats)} in the whole run{': ' if repeats else ''}"
              f"{', '.join(repeats[:4])})")
        print(f"    wrong dead letters {len(wrong)} ({len(wrong_zombie)} while a zombie was "
              "awake)")
        if stop:
            per = ", ".join(f"{n} {s:.1f} s" for n, s in stop["longest_s"].items())
            rec = (f"recovered {stop['recovered_after_s']:.1f} s after SIGCONT"
                   if stop["recovered"] else "NOT RECOVERED")
            print(f"    Redis SIGSTOP      {stop['stop_s']:.0f} s: longest silence without a "
                  f"line {stop['longest_any_s']:.1f} s (all components), per component: "
                  f"{per}; {rec}")
        return fails

    def _repeats(self, log: list[tuple[str, str, Any]]) -> tuple[list[str], list[str]]:
        """Trainer facts that repeat one already in the log (a second StepFinished or
        StepStarted of a step, a ticket issued twice at one attempt, a version published
        twice): all of them, and those written while a zombie was awake."""
        c = self.c
        seen: set[tuple[Any, ...]] = set()
        out, zombie = [], []
        for s, eid, m in log:
            if s != "events" or c.inj.has(s, eid):
                continue
            keys: list[tuple[Any, ...]] = []
            if isinstance(m, StepFinished | StepStarted):
                keys = [(type(m).__name__, m.step)]
            elif isinstance(m, TicketsIssued):
                keys = [("TicketsIssued", t, m.attempt) for t in m.ticket_ids]
            elif isinstance(m, WeightsPublished):
                keys = [("WeightsPublished", m.version)]
            again = [key for key in keys if key in seen]
            seen.update(keys)
            if again:
                what = f"{type(m).__name__}({again[0][1]}) at {eid}"
                out.append(what)
                ms = entry_key(eid)[0]
                if any(a <= ms <= b for a, b in self.fig.zombie_windows):
                    zombie.append(what)
        return out, zombie

    async def _wrong_letters(self, issued: set[int], first_issue: dict[int, tuple[int, int]]
                             ) -> tuple[list[str], list[str]]:
        """Dead letters saying "never issued" of valid samples (not the bench's, the sample
        decodes, its ticket is issued in the log): all, and those written while a zombie
        was awake. Not wrong: an answer to an issue the AOF cut took away, dead-lettered
        before the trainer issued that ticket number again (``first_issue``: where each
        ticket's first issue the log kept is): the log never issued what it answers."""
        c = self.c
        wrong, zombie = [], []
        async for eid, m in c.b.read_all(c.keys.dlq):
            if not isinstance(m, DeadLetter) or c.inj.has("dlq", eid):
                continue
            if m.source_stream != c.keys.samples or c.inj.has("samples", m.entry_id):
                continue
            try:
                sample = decode(m.raw)
            except Exception:
                continue
            i = ticket_index(sample.ticket_id) if isinstance(sample, Sample) else None
            if i is None or i not in issued or "issued" not in m.reason:
                continue
            if i in c.tail_tickets and entry_key(eid) < first_issue.get(i, (0, 0)):
                continue  # its issue went with the AOF's tail; the log's came later
            what = f"{m.entry_id} ({m.consumer or m.group}): {m.reason[:80]}"
            wrong.append(what)
            if any(a <= entry_key(eid)[0] <= b for a, b in self.fig.zombie_windows):
                zombie.append(what)
        return wrong, zombie


def _first_issues(log: list[tuple[str, str, Any]], injected: Any) -> dict[int, tuple[int, int]]:
    """Where each ticket's first TicketsIssued the log kept is (its entry id's key); the
    bench's own entries left out."""
    first: dict[int, tuple[int, int]] = {}
    for stream, eid, m in log:
        if isinstance(m, TicketsIssued) and not injected.has(stream, eid):
            for tid in m.ticket_ids:
                i = ticket_index(tid)
                if i is not None:
                    first.setdefault(i, entry_key(eid))
    return first
