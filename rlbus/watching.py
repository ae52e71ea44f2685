"""How ``rlbus up`` watches a run it started: the progress bar or lines from the run's events
stream, the children's exits, and the summary at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from bus import RunKeys
from rlbus.children import POLL_S, Console
from rlbus.runlog import trace_key
from rlbus.supervise import Supervisor
from runconfig import Config

if TYPE_CHECKING:
    from bus import Bus
    from runschema.messages import (
        Message,
        ProfileStopped,
        RunFinished,
        StepFinished,
        ValidationFinished,
        WarningRaised,
        WeightsPublished,
    )
    from runtime import LogFollower

__all__ = [
    "RESTARTABLE",
    "Progress",
    "RestartPolicy",
    "RunWatch",
    "Summary",
    "manifest_traces",
    "placement_verdict",
]

RESTARTABLE = ("rollouter", "profiler", "logger")
"""Components whose loss the run survives (the bus keeps their work: a rollouter's tickets
are reissued, the profiler and the logger read the log from where they were): restarted."""

WARNING_SOURCE = "rlbus up"

PLACEMENT_WARN_S = 30.0
"""How long a Ray task may wait to be placed before ``rlbus up`` says so (once); half the
bound (``run.ray.placement_timeout_s``) when that is shorter."""


def placement_verdict(waited_s: float, bound_s: float, warned: bool) -> str:
    """What to do about a Ray task submitted ``waited_s`` seconds ago that no node has
    started yet (``warned``: whether that was already said): ``wait``; ``warn`` (once, past
    :data:`PLACEMENT_WARN_S` or half the bound, then wait on); ``fail`` past ``bound_s``
    (``run.ray.placement_timeout_s``): no node has had room for it that long. Pure."""
    if waited_s >= bound_s:
        return "fail"
    if not warned and waited_s >= min(PLACEMENT_WARN_S, bound_s / 2):
        return "warn"
    return "wait"


class RestartPolicy(msgspec.Struct):
    """Which lost component is started again: a rollouter, the profiler service or the
    logger, at most ``max_restarts`` times each (``run.max_restarts``); never the trainer
    (its loss stops the run: it holds the run's state and fences)."""

    max_restarts: int
    restarts: dict[str, int] = msgspec.field(default_factory=dict)

    def restart(self, name: str, rc: int = 1) -> bool:
        """Whether ``name`` (trainer, rollouterN, profiler, logger), which exited with ``rc``,
        is restarted now; counts the restart. Exit code 2 is a bad config or an unreadable
        file (the components' convention): a restart would fail the same way. Pure."""
        if not name.startswith(RESTARTABLE) or rc == 2:
            return False
        done = self.restarts.get(name, 0)
        if done >= self.max_restarts:
            return False
        self.restarts[name] = done + 1
        return True


class Summary(msgspec.Struct):
    steps: int = 0
    first_reward: float | None = None
    last_reward: float | None = None
    best_reward: float | None = None
    target_step: int | None = None
    target_s: float | None = None
    samples: int = 0
    step_s: float = 0.0
    profiles: int = 0
    past_profiles: int = 0
    warnings: int = 0
    val_reward: float | None = None
    """The latest validation's val-core reward (runtime.progress.val_core_reward)."""
    val_version: int | None = None
    val_step: int | None = None
    resumed_after: int = 0
    """The last step an earlier session of the run finished (0: a new run)."""
    validation_only: bool = False
    """The run validated the weights it started from and trained nothing (trainer.val_only)."""
    earlier_target: int | None = None
    """The first step of an earlier session whose reward reached the target, as far as the
    log's stream still holds them (from step ``earlier_from``; older steps are archived)."""
    earlier_from: int | None = None

    def resumed(self, last_step: int, target_step: int | None, first_step: int | None
                ) -> None:
        """The run was resumed after ``last_step``; what its stream says of earlier steps."""
        self.resumed_after, self.earlier_target, self.earlier_from = (
            last_step, target_step, first_step)

    def add(self, ev: StepFinished, started: float, target: float = 0.9) -> None:
        from runschema.facts import step_reward

        r = step_reward(ev.metrics)
        self.steps += 1
        self.samples += len(ev.sample_ids)
        self.step_s += ev.duration_s
        if r != r:  # NaN: the step has no reward
            return
        self.first_reward = r if self.first_reward is None else self.first_reward
        self.last_reward = r
        self.best_reward = r if self.best_reward is None else max(self.best_reward, r)
        if self.target_step is None and self.earlier_target is None and r >= target:
            self.target_step = ev.step
            self.target_s = time.monotonic() - started

    def validated(self, ev: ValidationFinished) -> None:
        from runtime.progress import val_core_reward

        reward = val_core_reward(ev.metrics)
        if reward is not None:
            self.val_reward, self.val_version, self.val_step = reward, ev.version, ev.step

    def line(self, run_id: str, total: int, wall_s: float) -> str:
        if self.validation_only:
            parts = [f"run {run_id}: validation only (trainer.val_only), nothing trained, in "
                     f"{wall_s:.1f} s"]
        else:
            parts = [f"run {run_id}: {self.steps} step(s) this session (of {total}) in "
                     f"{wall_s:.1f} s"]
        if self.resumed_after:
            parts[0] += f", resumed after step {self.resumed_after}"
        if self.first_reward is not None:
            parts.append(f"reward {self.first_reward:.3f} -> {self.last_reward:.3f} "
                         f"(best {self.best_reward:.3f})")
        if self.val_reward is not None:
            parts.append(f"val-core reward {self.val_reward:.3f} (weights v{self.val_version}, "
                         f"step {self.val_step})")
        if self.earlier_target is not None:
            parts.append(f"reward >= 0.9 first at step {self.earlier_target}, before this "
                         "session" + ("" if self.earlier_from == 1 else
                                      f" (of the steps from {self.earlier_from} on: the "
                                      "older ones are archived)"))
        elif self.target_step is not None:
            into = " into this session" if self.resumed_after else ""
            parts.append(f"reward >= 0.9 first at step {self.target_step} "
                         f"({self.target_s:.1f} s{into})")
        if self.step_s > 0:
            parts.append(f"{self.samples / self.step_s:.0f} samples/s")
        traces = f"{self.profiles} trace(s)"
        if self.past_profiles:
            traces += f" (and {self.past_profiles} written before this session)"
        parts.append(f"{traces}, {self.warnings} warning(s)")
        return "summary: " + "; ".join(parts)


class Progress:
    """A tqdm bar on a terminal; plain lines (logs, pipes, tests) otherwise."""

    def __init__(self, total: int, initial: int, console: Console) -> None:
        self.total = total
        self.console = console
        self.bar: Any = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stdout)

    def step(self, ev: StepFinished) -> None:
        if self.bar is None:
            from runtime.progress import step_line

            self.console.out(step_line(ev, self.total))
            return
        from runschema.facts import step_reward

        m = ev.metrics
        self.bar.update(max(0, ev.step - self.bar.n))
        self.bar.set_postfix_str(
            f"reward {step_reward(m):.3f} staleness "
            f"{m.get('staleness/mean', 0.0):.2f} {m.get('throughput/samples_per_s', 0.0):.0f}/s"
        )

    def say(self, text: str, err: bool = False) -> None:
        if self.bar is not None:
            with contextlib.suppress(OSError):
                self.bar.write(text, file=sys.stderr if err else sys.stdout)
        elif err:
            self.console.err(text)
        else:
            self.console.out(text)

    def close(self) -> None:
        if self.bar is not None:
            with contextlib.suppress(OSError):
                self.bar.close()


class RunWatch:
    """Shows a run's events until it finishes, a child fails or a signal arrives."""

    LINGER_S = 60.0
    """How long components may take to exit after the run finished before they are stopped."""

    SHOW_GATHER_S = 0.05
    """After a read that found events, how long the watch lets the next ones gather before it
    reads again: a step's events come in a burst, and a wake-up an event cost ``rlbus up``
    5.5 ms of CPU a step of the default run (2.8 ms with it). Progress lines show up to this
    much later; a child's exit is judged only after the log is read to its end, so no wait
    hides the events a child wrote before it exited."""

    def __init__(self, run_id: str, children: list[Any], sup: Supervisor, progress: Progress,
                 summary: Summary, past_traces: set[tuple[str, str, int]],
                 last_step: int = 0, policy: RestartPolicy | None = None,
                 env: dict[str, str] | None = None,
                 placement_timeout_s: float = float("inf")) -> None:
        self.keys = RunKeys(run_id)
        self.placement_timeout_s = placement_timeout_s
        """How long a Ray task may wait for a node with room (``run.ray.placement_timeout_s``)."""
        self.unplaced_warned: set[str] = set()
        """Children whose wait to be placed was already said (once per submission)."""
        self.policy = policy if policy is not None else RestartPolicy(0)
        self.env = env if env is not None else {}
        self.pending: list[tuple[str, str]] = []
        """(code, message) of warnings to append to the run's log (the operator stream)."""
        self.last_step = last_step
        """The last finished step read (a RunFinished must say it: runschema.facts)."""
        self.children = children
        self.sup = sup
        self.progress = progress
        self.summary = summary
        self.past_traces = past_traces
        self.started = time.monotonic()
        self.finished_at: float | None = None

    async def run(self, url: str, ends: Mapping[str, str] | None = None,
                  give_up_s: float | None = None) -> int:
        """Show the run's log (every role's stream, merged) after ``ends`` (each stream's
        newest entry before this session's components started: what an earlier session
        stated, a failure included, is not this session's news; None: a new run, from the
        start) until the run ends; the exit code. ``give_up_s``: redis.give_up_s (the
        watch waits out a silent Redis as long as the parts do; None: the bus's default)."""
        from bus import Bus, RetryPolicy
        from runtime import LogFollower

        bus = Bus.from_url(url, retry=None if give_up_s is None else RetryPolicy(
            budget_s=give_up_s))
        try:
            log = LogFollower(bus, self.keys, count=500)
            log.start_at_end(ends or {})
            while True:
                if any(c.returncode() is not None for c in self.children):
                    # An exit is judged by what the child wrote before it (its
                    # ComponentFailed, the RunFinished): read the log to its end first.
                    await self._show_all(log)
                if (rc := self._verdict()) is not None:
                    break
                await self._publish_pending(bus)
                shown = await self._show_all(log, block_ms=int(POLL_S * 1000))
                if shown:  # what comes next gathers meanwhile: one wake-up a SHOW_GATHER_S
                    await asyncio.sleep(self.SHOW_GATHER_S)  # at most, not one an event
            await self._publish_pending(bus)
            return rc
        finally:
            await bus.close()

    async def _show_all(self, log: LogFollower, block_ms: int | None = None) -> int:
        """Show what the log holds after its position, reading until caught up (the first
        read waits up to ``block_ms`` for something new); how many events were read."""
        read = 0
        while True:
            entries = await log.poll(block_ms=block_ms)
            for _, msg in entries:
                self._show(msg)
            read += len(entries)
            if log.caught_up:
                return read
            block_ms = None

    async def _publish_pending(self, bus: Bus) -> None:
        """XADD each pending warning to the operator's log stream (``rlbus up`` states it):
        a loss and a restart are in the run's event log, not only on this console."""
        from bus import ROLE_LOG_MAXLEN, BusError
        from runschema.messages import WarningRaised

        while self.pending:
            code, text = self.pending.pop(0)
            msg = WarningRaised(source=WARNING_SOURCE, code=code, message=text)
            try:
                await bus.publish(self.keys.log("operator"), msg, maxlen=ROLE_LOG_MAXLEN)
            except BusError as exc:  # Redis gone: the console line is all there is
                self.progress.say(f"rlbus up: could not log {code}: {exc}", err=True)

    def _verdict(self) -> int | None:
        """The exit code once watching is over, else None."""
        if self.sup.signals:
            return self.sup.exit_code
        # The trainer first: rollouters that exit because it is gone are not restarted.
        for child in sorted(self.children, key=lambda c: c.name != "trainer"):
            rc = child.returncode()
            if rc is not None and rc != 0 and not self._restarted(child, rc):
                return 1
            if rc is None and not self._placed_in_time(child):
                return 1
        if all(c.returncode() is not None for c in self.children):
            if self.finished_at is None:
                self.progress.say("rlbus up: every component exited but the run did not "
                                  f"finish; see the logs in {self.children[0].log_path.parent}",
                                  err=True)
                return 1
            return 0
        if self.finished_at is not None and time.monotonic() - self.finished_at > self.LINGER_S:
            waiting = [c.name for c in self.children if c.returncode() is None]
            self.progress.say(f"rlbus up: run finished but {', '.join(waiting)} did not exit "
                              f"within {self.LINGER_S:g} s; stopping them", err=True)
            return 0
        return None

    def _restarted(self, child: Any, rc: int) -> bool:
        """A child that failed: restarted (True) when the policy allows and the run is not
        over, else reported as the run's failure (False). Either is one warning in the log."""
        what = _loss(child, rc)
        if self.finished_at is not None and bool(getattr(child, "lost", "")) and \
                child.name.startswith("rollouter"):
            # Its node went down, and Ray said so once the run had finished: nothing of the
            # run is missing (a rollouter has nothing to do after the end).
            self.pending.append(("component_lost", f"{what}; after the run finished"))
            self.progress.say(f"rlbus up: {what}; after the run finished", err=True)
            return True
        if self.finished_at is None and self.policy.restart(child.name, rc):
            n = self.policy.restarts[child.name]
            self.pending.append(("component_restarted", f"{what}; restarted ({n} of "
                                 f"{self.policy.max_restarts}, run.max_restarts)"))
            child.start(self.env)
            return True
        budget = (f"; restarted {self.policy.restarts[child.name]} time(s) already "
                  "(run.max_restarts)" if child.name in self.policy.restarts else "")
        self.pending.append(("component_failed", f"{what}{budget}; the run stops"))
        lost = getattr(child, "lost", "")
        detail = "" if lost else f"; last lines of {child.log_path}:\n{child.log_tail()}"
        self.progress.say(f"rlbus up: {what}{budget}{detail}", err=True)
        return False

    def _placed_in_time(self, child: Any) -> bool:
        """False once a Ray task has waited past ``run.ray.placement_timeout_s`` for a node
        with room (named: ``component_failed``, the run stops, as a loss past
        ``run.max_restarts`` does); a long wait is said once (``component_unplaced``)."""
        if not getattr(child, "started", True) or getattr(child, "placed", True):
            self.unplaced_warned.discard(child.name)
            return True
        waited = time.monotonic() - child.submitted_at
        verdict = placement_verdict(waited, self.placement_timeout_s,
                                    child.name in self.unplaced_warned)
        what = (f"{child.name} not placed by Ray after {waited:.0f} s: no live node has room "
                f"for what it asks ({child.asks()})")
        if verdict == "warn":
            self.unplaced_warned.add(child.name)
            text = (f"{what}; still waiting (up to {self.placement_timeout_s:g} s, "
                    "run.ray.placement_timeout_s)")
            self.pending.append(("component_unplaced", text))
            self.progress.say(f"rlbus up: {text}", err=True)
        elif verdict == "fail":
            text = f"{what}; gave up (run.ray.placement_timeout_s); the run stops"
            self.pending.append(("component_failed", text))
            self.progress.say(f"rlbus up: {text}", err=True)
            return False
        return True

    def _show(self, msg: Message) -> None:
        from runschema import messages as m

        handlers: dict[type, Callable[[Any], None]] = {
            m.StepFinished: self._step,
            m.WeightsPublished: self._weights,
            m.ProfileStopped: self._profile,
            m.ProfilerFinished: lambda e: self.progress.say(
                f"profiler manifest: {e.manifest_path}"),
            m.WarningRaised: self._warning,
            m.ComponentFailed: lambda e: self.progress.say(
                f"{e.role}{e.rank} failed: {e.error}", err=True),
            m.RunFinished: self._finished,
            m.ValidationFinished: self._validated,
        }
        handler = handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _step(self, ev: StepFinished) -> None:
        self.last_step = max(self.last_step, ev.step)
        self.summary.add(ev, self.started)
        self.progress.step(ev)

    def _validated(self, ev: ValidationFinished) -> None:
        from runtime.progress import validation_line

        self.summary.validated(ev)
        self.progress.say(validation_line(ev), err=bool(ev.error))

    def _weights(self, ev: WeightsPublished) -> None:
        if ev.version == 0:
            self.progress.say("weights version 0 published; rollouters start")

    def _profile(self, ev: ProfileStopped) -> None:
        if ev.status != "ok" and trace_key(ev) in self.past_traces:
            # A resumed component reports the sessions it finds in the past as missed; the
            # trace an earlier incarnation wrote stands (as in the manifest).
            return
        self.summary.profiles += ev.status == "ok"
        self.progress.say(f"profile {ev.session_id} {ev.role}{ev.rank} steps "
                          f"{ev.first_step}-{ev.last_step}: {ev.status} {ev.path}")

    def _warning(self, ev: WarningRaised) -> None:
        self.summary.warnings += 1
        self.progress.say(f"warning from {ev.source}: {ev.message}")

    def _finished(self, ev: RunFinished) -> None:
        from runschema.facts import run_finished_refusal

        why = run_finished_refusal(ev, self.last_step)
        if why is not None:  # not the trainer's: the run goes on
            self.progress.say(f"rlbus up: ignored a RunFinished: {why}", err=True)
            return
        if ev.validation_only:
            self.summary.validation_only = True
            self.progress.say(f"run {ev.run_id} finished: the weights after step {ev.steps} "
                              f"validated, nothing trained (trainer.val_only; {ev.status})")
        else:
            self.progress.say(f"run {ev.run_id} finished after {ev.steps} steps ({ev.status})")
        self.finished_at = time.monotonic()


def _loss(child: Any, rc: int) -> str:
    """``NAME failed (exit code N)``, or under Ray what was lost (the node, named by Ray)."""
    lost = getattr(child, "lost", "")
    return f"{child.name} lost: {lost}" if lost else f"{child.name} failed (exit code {rc})"


def manifest_traces(cfg: Config) -> set[tuple[str, str, int]]:
    """``(session, role, rank)`` of the traces the run's manifest lists as written (the
    profiler service keeps it up to date; it also covers sessions archived from the log)."""
    from profiling import profile_root

    try:
        data = json.loads((profile_root(cfg) / "manifest.json").read_text())
        # A partial trace (its process died inside the session, some steps lost) is a
        # trace written all the same.
        return {(s["id"], s["role"], int(s["rank"])) for s in data.get("sessions", [])
                if s.get("status") in ("ok", "partial")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
