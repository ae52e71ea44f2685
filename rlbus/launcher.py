"""``rlbus up``: the whole run on one machine, each component a separate process.

Order: embedded Redis (unless ``redis.url`` is set, which is checked first: an unreachable
server is one line and nothing is created on disk), then the profiler service (when
``global_profiler.tool`` is set), the metrics logger (``trainer.logger`` has tensorboard or
wandb), the rollouter replicas and the trainer. A run whose log already holds its RunFinished
is not started again. Progress comes from the run's events stream, not from the children's
output (that goes to ``RUN/logs/*.log``): a progress bar on a terminal, one line per step
otherwise, then a summary.

Supervision: SIGINT, SIGTERM and SIGHUP are recorded, never raised, so stopping cannot be
interrupted half-way. The first one sends SIGTERM to every child at once; a child still
alive after ``run.stop_grace_s`` (or at a second signal) gets SIGKILL, and so do any
processes it left behind. The exact command that resumes the run is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec
import psutil
import yaml

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from bus.keys import RunKeys
from bus.server import EmbeddedRedis, pdeathsig_hook
from rlbus.credentials import expanded_url
from runconfig import Config, config_to_dict, resolve_run_id

if TYPE_CHECKING:
    from bus.messages import StepFinished

__all__ = [
    "Child",
    "RunDataMissing",
    "RunStatus",
    "Supervisor",
    "cpu_plan",
    "ping",
    "redis_for_reading",
    "resume_command",
    "run_status",
    "run_up",
    "server_file",
    "stop_children",
]

POLL_S = 0.2
"""How often the supervisor looks at its children and at signals while stopping them."""

_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM",
                 signal.SIGHUP: "SIGHUP"}


class RunDataMissing(Exception):
    """No ``redis.url`` and no embedded Redis data where the config points."""


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
    ``run.output_dir``, or a temporary server started on that directory's saved data.

    Creates nothing: without ``redis.url`` and without saved data it raises
    :class:`RunDataMissing` (a typo in ``run.output_dir`` must not leave folders behind)."""
    url = expanded_url(cfg)
    if url is not None:
        asyncio.run(_ping(url))
        yield url
        return
    info_path = server_file(cfg)
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if _alive(int(info.get("pid", -1))):
            yield str(info["url"])
            return
    data_dir = Path(cfg.run.output_dir) / "redis"
    if not data_dir.is_dir():
        raise RunDataMissing(
            f"no redis.url given and no embedded Redis data in {data_dir}: pass the "
            "run.output_dir the run used, or redis.url=redis://HOST:PORT/0"
        )
    server = EmbeddedRedis(data_dir, port=cfg.redis.port, binary=cfg.redis.binary)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


# --------------------------------------------------------------------------- run status


class RunStatus(msgspec.Struct):
    """What a run's log says about it (from its latest RunStarted on)."""

    started: bool = False
    last_step: int = 0
    finished_steps: int | None = None
    config: dict[str, Any] | None = None


async def run_status(url: str, run_id: str) -> RunStatus:
    """Fold run ``run_id``'s events stream into a :class:`RunStatus` (one XRANGE pass).

    The stream only: under ``run.retention=checkpoint`` it holds a few checkpoint windows
    (older events are archived), and a resume must not read the whole past. A run whose
    RunStarted was archived still has entries: it has started."""
    from bus import Bus
    from bus.messages import RunFinished, RunStarted, StepFinished

    status = RunStatus()
    bus = Bus.from_url(url, client_name="rlbus-status")
    try:
        async for _, msg in bus.read_all(RunKeys(run_id).events):
            match msg:
                case RunStarted():
                    status.started = True
                    status.finished_steps = None
                    status.config = msg.config
                case StepFinished():
                    status.last_step = max(status.last_step, msg.step)
                case RunFinished():
                    status.finished_steps = msg.steps
        if not status.started:
            status.started = await bus.length(RunKeys(run_id).events) > 0
    finally:
        await bus.close()
    return status


async def _ping(url: str, quick: bool = True) -> None:
    # quick: a wrong URL is one line within a couple of seconds (interactive commands);
    # else the bus's usual retry bound, for components that may start just before Redis.
    from bus import Bus, RetryPolicy

    retry = RetryPolicy(attempts=3, base_s=0.2, max_s=1.0) if quick else None
    bus = Bus.from_url(url, retry=retry)
    try:
        await bus.ping()
    finally:
        await bus.close()


def ping(url: str, quick: bool = True) -> None:
    """PING ``url`` (raises :class:`bus.BusUnavailable` / :class:`bus.BusAuthError`)."""
    asyncio.run(_ping(url, quick))


# --------------------------------------------------------------------------- children


class Child(msgspec.Struct):
    """One component process of the run."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    nice: int = 0  # > 0: off the critical path (its CPU goes to the others first)
    cpus: frozenset[int] | None = None  # CPUs of its own (run.cpu_affinity); None: any

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        death = pdeathsig_hook()
        nice, cpus = self.nice, self.cpus

        def preexec() -> None:
            if death is not None:
                death()
            if nice:
                os.nice(nice)
            if cpus:
                # Before exec: every thread the component starts inherits the set.
                os.sched_setaffinity(0, cpus)

        try:
            # A new session: Ctrl-C reaches the launcher only, which stops the children.
            # PDEATHSIG: a launcher killed with SIGKILL still takes its children down.
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=preexec,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> None:
        stop_children([self], grace_s, None)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Records SIGINT/SIGTERM/SIGHUP instead of raising (``install`` / ``restore``)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)

    def install(self) -> Supervisor:
        for sig in _SIGNAL_NAMES:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, old in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return 128 + self.signals[0] if self.signals else 0


def _say(text: str) -> None:
    print(f"rlbus up: {text}", file=sys.stderr, flush=True)


def _descendants(child: Any) -> list[psutil.Process]:
    if getattr(child, "pid", None) is None:
        return []
    try:
        return psutil.Process(child.pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_children(children: Sequence[Any], grace_s: float, sup: Supervisor | None) -> None:
    """SIGTERM every running child at once; SIGKILL whatever is left after ``grace_s`` or
    at the next signal ``sup`` records; then SIGKILL processes they left behind."""
    local = [c for c in children if hasattr(c, "send") and c.returncode() is None]
    others = [c for c in children if not hasattr(c, "send")]
    for c in others:  # Ray tasks: ray.cancel
        c.stop(grace_s)
    if not local:
        return
    seen = len(sup.signals) if sup is not None else 0
    leftovers = {p.pid: p for c in local for p in _descendants(c)}
    _say(f"stopping {', '.join(c.name for c in local)} (SIGTERM; SIGKILL after {grace_s:g} s"
         + (" or at a second signal)" if sup is not None else ")"))
    for c in local:
        c.send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        running = [c for c in local if c.returncode() is None]
        if not running:
            break
        again = sup is not None and len(sup.signals) > seen
        if again or time.monotonic() >= deadline:
            why = "second signal" if again else f"still running after {grace_s:g} s"
            _say(f"{why}: killing {', '.join(c.name for c in running)} (SIGKILL)")
            for c in running:
                c.send(signal.SIGKILL)
            for c in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=10)
            break
        time.sleep(POLL_S)
    for c in local:
        leftovers.update({p.pid: p for p in _descendants(c)})
    alive = [p for p in leftovers.values() if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    _say("stopped " + ", ".join(f"{c.name} (exit {c.returncode()})" for c in local))


def cpu_plan(
    available: Sequence[int], demands: Sequence[tuple[str, int]]
) -> dict[str, frozenset[int]]:
    """CPUs of their own for components, in the order of ``demands`` ((name, CPUs wanted)),
    from ``available``, while enough are left: the first that does not fit, and every one
    after it, gets none (runs on any CPU). Nothing is pinned on fewer than 2 CPUs.

    Why: on a small machine the OS keeps moving the trainer's and the rollouters' threads
    (an event loop and a torch worker each) between the same cores, and a pinned layout
    measured a generation-heavy step 1.5-1.9x faster (docs/architecture.md, "CPU
    placement")."""
    free = sorted(set(available))
    plan: dict[str, frozenset[int]] = {}
    if len(free) < 2:
        return plan
    for name, want in demands:
        want = max(1, want)
        if want > len(free):
            break
        plan[name], free = frozenset(free[:want]), free[want:]
    return plan


def _pin(cfg: Config, children: Sequence[Child]) -> None:
    """run.cpu_affinity=auto: the trainer, then each rollouter, on CPUs of their own."""
    if cfg.run.cpu_affinity != "auto" or not hasattr(os, "sched_getaffinity"):
        return
    demands = [("trainer", cfg.trainer.threads)] + [
        (f"rollouter{rank}", cfg.rollout.threads) for rank in range(cfg.rollout.replicas)]
    plan = cpu_plan(list(os.sched_getaffinity(0)), demands)
    for child in children:
        child.cpus = plan.get(child.name)


def _children(cfg: Config, config_path: Path, logs: Path) -> list[Child]:
    # `python -m rlbus ROLE`: each component prints its own progress lines into its log.
    py = [sys.executable, "-m", "rlbus"]
    base = ["--config", str(config_path)]
    children: list[Child] = []
    if cfg.global_profiler.tool is not None:
        children.append(Child("profiler", [*py, "profiler", *base], logs / "profiler.log"))
    if _wants_logger(cfg):
        # The logger only reads the log: at start-up, while everyone imports, the trainer
        # and rollouters get the CPU first.
        children.append(Child("logger", [*py, "logger", *base], logs / "logger.log", nice=10))
    for rank in range(cfg.rollout.replicas):
        children.append(
            Child(
                f"rollouter{rank}",
                [*py, "rollouter", *base, f"rollout.rank={rank}"],
                logs / f"rollouter{rank}.log",
            )
        )
    children.append(Child("trainer", [*py, "trainer", *base], logs / "trainer.log"))
    _pin(cfg, children)
    return children


def _wants_logger(cfg: Config) -> bool:
    names = cfg.trainer.logger
    names = [names] if isinstance(names, str) else names
    return bool({"tensorboard", "wandb"} & set(names))


# --------------------------------------------------------------------------- watching


class _Summary(msgspec.Struct):
    steps: int = 0
    first_reward: float | None = None
    last_reward: float | None = None
    best_reward: float | None = None
    target_step: int | None = None
    target_s: float | None = None
    samples: int = 0
    step_s: float = 0.0
    profiles: int = 0
    warnings: int = 0

    def add(self, ev: StepFinished, started: float, target: float = 0.9) -> None:
        r = ev.metrics.get("reward/mean")
        self.steps += 1
        self.samples += len(ev.sample_ids)
        self.step_s += ev.duration_s
        if r is None or r != r:  # NaN
            return
        self.first_reward = r if self.first_reward is None else self.first_reward
        self.last_reward = r
        self.best_reward = r if self.best_reward is None else max(self.best_reward, r)
        if self.target_step is None and r >= target:
            self.target_step = ev.step
            self.target_s = time.monotonic() - started

    def line(self, run_id: str, total: int, wall_s: float) -> str:
        parts = [f"run {run_id}: {self.steps} step(s) this session (of {total}) in {wall_s:.1f} s"]
        if self.first_reward is not None:
            parts.append(f"reward {self.first_reward:.3f} -> {self.last_reward:.3f} "
                         f"(best {self.best_reward:.3f})")
        if self.target_step is not None:
            parts.append(f"reward >= 0.9 first at step {self.target_step} "
                         f"({self.target_s:.1f} s)")
        if self.step_s > 0:
            parts.append(f"{self.samples / self.step_s:.0f} samples/s")
        parts.append(f"{self.profiles} trace(s), {self.warnings} warning(s)")
        return "summary: " + "; ".join(parts)


class _Progress:
    """A tqdm bar on a terminal; plain lines (logs, pipes, tests) otherwise."""

    def __init__(self, total: int, initial: int) -> None:
        self.total = total
        self.bar: Any = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stdout)

    def step(self, ev: StepFinished) -> None:
        if self.bar is None:
            from bus.progress import step_line

            print(step_line(ev, self.total), flush=True)
            return
        m = ev.metrics
        self.bar.update(max(0, ev.step - self.bar.n))
        self.bar.set_postfix_str(
            f"reward {m.get('reward/mean', float('nan')):.3f} staleness "
            f"{m.get('staleness/mean', 0.0):.2f} {m.get('throughput/samples_per_s', 0.0):.0f}/s"
        )

    def say(self, text: str, err: bool = False) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr if err else sys.stdout)
        else:
            print(text, file=sys.stderr if err else sys.stdout, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _watch(cfg: Config, url: str, children: list[Any], since: str, sup: Supervisor,
                 progress: _Progress, summary: _Summary) -> int:
    """Show progress until the run finishes, a child fails or a signal arrives."""
    from bus import Bus
    from bus.messages import (
        CheckpointSaved,
        ComponentFailed,
        Heartbeat,
        ProfilerFinished,
        ProfileStopped,
        RunFinished,
        StepFinished,
        WarningRaised,
        WeightsPublished,
    )

    keys = RunKeys(cfg.run.id or "")
    finished_at: float | None = None
    started = time.monotonic()
    bus = Bus.from_url(url)
    try:
        last = since
        while True:
            if sup.signals:
                return sup.exit_code
            for child in children:
                rc = child.returncode()
                if rc is not None and rc != 0:
                    progress.say(f"rlbus up: {child.name} failed (exit code {rc}); last lines "
                                 f"of {child.log_path}:\n{child.log_tail()}", err=True)
                    return 1
            if all(c.returncode() is not None for c in children):
                if finished_at is None:
                    progress.say("rlbus up: every component exited but the run did not finish; "
                                 f"see the logs in {children[0].log_path.parent}", err=True)
                    return 1
                return 0
            if finished_at is not None and time.monotonic() - finished_at > 60:
                waiting = [c.name for c in children if c.returncode() is None]
                progress.say(f"rlbus up: run finished but {', '.join(waiting)} did not exit "
                             "within 60 s; stopping them", err=True)
                return 0
            entries, last = await bus.read_after(keys.events, last, count=500,
                                                 block_ms=int(POLL_S * 1000))
            for _, msg in entries:
                match msg:
                    case StepFinished():
                        summary.add(msg, started)
                        progress.step(msg)
                    case WeightsPublished(version=0):
                        progress.say("weights version 0 published; rollouters start")
                    case ProfileStopped():
                        summary.profiles += msg.status == "ok"
                        progress.say(f"profile {msg.session_id} {msg.role}{msg.rank} steps "
                                     f"{msg.first_step}-{msg.last_step}: {msg.status} {msg.path}")
                    case ProfilerFinished():
                        progress.say(f"profiler manifest: {msg.manifest_path}")
                    case WarningRaised():
                        summary.warnings += 1
                        progress.say(f"warning from {msg.source}: {msg.message}")
                    case ComponentFailed():
                        progress.say(f"{msg.role}{msg.rank} failed: {msg.error}", err=True)
                    case RunFinished():
                        progress.say(f"run {msg.run_id} finished after {msg.steps} steps "
                                     f"({msg.status})")
                        finished_at = time.monotonic()
                    case CheckpointSaved() | Heartbeat():
                        pass
    finally:
        await bus.close()


# --------------------------------------------------------------------------- rlbus up


def _prog() -> str:
    """How the user called rlbus: ``rlbus`` when that is on PATH, else the path they used."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "rlbus" and shutil.which("rlbus") is None:
        return argv0
    return "rlbus"


def resume_command(argv: Sequence[str], run_id: str) -> str:
    """``rlbus up ARGS run.id=RUN``: the user's arguments with the run id pinned."""
    kept = [a for a in argv if not a.startswith("run.id=")]
    return shlex.join([_prog(), "up", *kept, f"run.id={run_id}"])


def run_up(cfg: Config, argv: Sequence[str] = ()) -> int:
    """Run the whole job; returns the exit code (0 when the run finished)."""
    cfg = resolve_run_id(cfg)
    run_id = cfg.run.id or ""
    out = Path(cfg.run.output_dir)
    run_dir = out / run_id
    url = expanded_url(cfg)
    if url is not None:
        asyncio.run(_ping(url))  # BusUnavailable: one line from the CLI, nothing on disk
    sup = Supervisor().install()
    server: EmbeddedRedis | None = None
    children: list[Any] = []
    summary = _Summary()
    rc = 1
    started_children = False
    wall0 = time.monotonic()
    try:
        if url is None:
            server = EmbeddedRedis(out / "redis", port=cfg.redis.port, binary=cfg.redis.binary)
            server.start()
            url = server.url
            server_file(cfg).write_text(json.dumps({"url": url, "pid": server.pid}))
            print(f"embedded Redis at {url} (data in {out / 'redis'})", flush=True)
        total = cfg.trainer.total_training_steps
        # A new run (embedded Redis, no run folder yet) has no log to consult: its
        # components start at once, and the checks below run while they import torch.
        fresh = server is not None and not run_dir.exists()
        status = RunStatus() if fresh else asyncio.run(run_status(url, run_id))
        if status.finished_steps is not None:
            if status.finished_steps >= total:
                print(f"run {run_id} already finished after {status.finished_steps} steps: "
                      f"nothing to do (a new run needs a new run.id; inspect it with "
                      f"`{_prog()} inspect --run {run_id} run.output_dir={cfg.run.output_dir}`)",
                      flush=True)
                return 0
            print(f"run {run_id} finished after {status.finished_steps} steps: continuing it "
                  f"to {total} (trainer.total_training_steps)", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        tree = config_to_dict(cfg)
        if cfg.redis.url is None:
            tree["redis"]["url"] = url  # the embedded server: no credentials in it
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(tree, sort_keys=False))
        children = _children(cfg, config_path, run_dir / "logs")
        if cfg.run.launcher == "ray":
            from rlbus.ray_launcher import init_ray, ray_children

            init_ray(cfg.run.ray_address, num_cpus=max(2, len(children)))
            gpus = 1.0 if cfg.trainer.device.startswith("cuda") else 0.0
            children = ray_children(children, trainer_gpus=gpus)
            print(f"Ray launcher: {len(children)} tasks", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A new run's stream is empty: its progress is read from the start.
        since = "0" if fresh else asyncio.run(_latest_id(url, RunKeys(run_id).events))
        if status.started:
            print(f"resuming run {run_id} after step {status.last_step}", flush=True)
        if not sup.signals:
            for child in children:
                child.start(env)
            started_children = True
            pids = ", ".join(
                f"{c.name} (pid {c.pid})" if getattr(c, "pid", None) else c.name
                for c in children
            )
            print(f"run {run_id}: {pids}; logs in {run_dir / 'logs'}", flush=True)
            from metrics_logger import logger_warnings

            for warning in logger_warnings(cfg):
                _say(f"warning: {warning}")
            progress = _Progress(total, status.last_step)
            try:
                rc = asyncio.run(_watch(cfg, url, children, since, sup, progress, summary))
            finally:
                progress.close()
        else:
            rc = sup.exit_code
        if sup.signals:
            _say(f"{_SIGNAL_NAMES.get(sup.signals[0], str(sup.signals[0]))} received; "
                 "stopping the run")
            rc = sup.exit_code
    finally:
        stop_children(children, cfg.run.stop_grace_s, sup)
        if server is not None:
            server.stop()
            with contextlib.suppress(OSError):
                server_file(cfg).unlink()
        sup.restore()
    if started_children:
        print(summary.line(run_id, cfg.trainer.total_training_steps,
                           time.monotonic() - wall0), flush=True)
        _print_outputs(cfg, run_dir, rc)
        if rc != 0:
            print(f"  resume       {resume_command(argv, run_id)}", flush=True)
    return rc


async def _latest_id(url: str, stream: str) -> str:
    from bus import Bus

    bus = Bus.from_url(url)
    try:
        latest = await bus.latest(stream)
        return latest[0] if latest else "0"
    finally:
        await bus.close()


def _print_outputs(cfg: Config, run_dir: Path, rc: int) -> None:
    from profiling import profile_root

    print(f"\noutputs of run {cfg.run.id}{'' if rc == 0 else ' (stopped before the end)'}:")
    print(f"  config       {run_dir / 'config.yaml'}")
    print(f"  checkpoints  {run_dir / 'checkpoints'}")
    print(f"  logs         {run_dir / 'logs'}")
    if _wants_logger(cfg):
        print(f"  tensorboard  tensorboard --logdir {run_dir / 'tensorboard'}")
    if cfg.global_profiler.tool is not None:
        print(f"  traces       {profile_root(cfg)} (manifest.json)")
    if cfg.redis.url is None:
        print(f"  event log    {Path(cfg.run.output_dir) / 'redis'} (Redis AOF)")
    print(f"  inspect      {_prog()} inspect --run {cfg.run.id}"
          + (f" --config {run_dir / 'config.yaml'}" if cfg.redis.url else "")
          + f" run.output_dir={cfg.run.output_dir}", flush=True)
