"""``rlbus up``: the whole run on one machine, each component a separate process.

Order: with ``run.launcher=ray`` and ``run.ray_address`` set, the address is checked first
(nothing listening within ``run.ray_connect_timeout_s`` is one line and nothing is created);
``redis.url`` is checked next (an unreachable server is one line and nothing is created on
disk), else the embedded Redis of ``run.output_dir`` starts (one per folder: a second
``rlbus up`` on a folder whose server is live is refused with one line naming it). A run
whose log already holds events is continued with the config its latest RunStarted recorded,
the file and overrides given now applied on top (each change printed as ``key: old ->
new``); a run whose log holds its RunFinished is not started again. Then the profiler
service (when ``global_profiler.tool`` is set), the metrics logger (``trainer.logger`` has
tensorboard or wandb), the rollouter replicas and the trainer. Progress comes from the run's
events stream, not from the children's output (that goes to ``RUN/logs/*.log``): a progress
bar on a terminal, one line per step otherwise, then a summary.

Supervision: SIGINT, SIGTERM and SIGHUP (unless it was ignored when ``rlbus up`` started, as
under ``nohup``) are recorded, never raised, from the moment ``rlbus up`` has loaded its
config; a closed stdout (``rlbus up | head``) counts as SIGPIPE. Each stage checks for one
before it starts, so a signal at any moment stops what has started (children that never
started are not waited for). The first one sends SIGTERM to every child at once; a child
still alive after ``run.stop_grace_s`` (or at a second signal) gets SIGKILL, and so do any
processes it left behind. The exit code is 128 + the signal, and the exact command that
resumes the run is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil
import yaml

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from bus.errors import RedisBinaryNotFound, RedisStartError
from bus.keys import RunKeys
from bus.server import (
    EmbeddedRedis,
    RedisDirInUse,
    RedisStartCancelled,
    dir_owner,
    pdeathsig_hook,
)
from rlbus.credentials import expanded_url
from rlbus.ray_launcher import RayUnavailable
from rlbus.supervise import Interrupted, Supervisor
from runconfig import (
    Config,
    config_to_dict,
    default_dict,
    known_keys,
    load_config,
    parse_config_args,
    resolve_run_id,
)

if TYPE_CHECKING:
    from bus.messages import Message, ProfileStopped, RunStarted, StepFinished

__all__ = [
    "Child",
    "Interrupted",
    "RunDataMissing",
    "RunStatus",
    "Supervisor",
    "config_changes",
    "cpu_plan",
    "ping",
    "recorded_config",
    "redis_for_reading",
    "resume_command",
    "run_status",
    "run_up",
    "stop_children",
]

POLL_S = 0.2
"""How often the supervisor looks at its children and at signals while stopping them."""

_HERE_AND_NOW = ("redis", "run.id", "run.output_dir", "run.launcher", "run.ray_address",
                 "run.ray_connect_timeout_s")
"""Keys a continued run takes from the command given now, never from its recorded config:
where its data lives and how this command places the components (the recorded
``redis.url`` may name an embedded server that is gone)."""


class RunDataMissing(Exception):
    """No ``redis.url`` and no embedded Redis data where the config points."""


class _Refused(Exception):
    """``rlbus up`` will not run: one line says why (exit code 1)."""


def _data_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / "redis"


@contextlib.contextmanager
def redis_for_reading(cfg: Config) -> Iterator[str]:
    """A Redis URL holding ``cfg``'s runs: ``redis.url``, the live embedded server of
    ``run.output_dir`` (the one holding its lock), or a temporary server started on that
    directory's saved data.

    Creates nothing: without ``redis.url`` and without saved data it raises
    :class:`RunDataMissing` (a typo in ``run.output_dir`` must not leave folders behind)."""
    url = expanded_url(cfg)
    if url is not None:
        asyncio.run(_ping(url))
        yield url
        return
    data_dir = _data_dir(cfg)
    owner = dir_owner(data_dir)
    if owner is not None and owner.url:
        yield owner.url
        return
    if not data_dir.is_dir():
        raise RunDataMissing(
            f"no redis.url given and no embedded Redis data in {data_dir}: pass the "
            "run.output_dir the run used, or redis.url=redis://HOST:PORT/0"
        )
    server = EmbeddedRedis(data_dir, port=cfg.redis.port, binary=cfg.redis.binary)
    try:
        server.start()
    except RedisDirInUse as exc:  # a server started meanwhile: read through it
        if not exc.owner.url:
            raise
        yield exc.owner.url
        return
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
    traces: set[tuple[str, str, int]] = msgspec.field(default_factory=set)

    def fold(self, msg: Message) -> None:
        """Take one event of the log, in log order."""
        from bus.messages import ProfileStopped, RunFinished, RunStarted, StepFinished

        match msg:
            case RunStarted():
                self.started = True
                self.finished_steps = None
                self.config = msg.config
            case StepFinished():
                self.last_step = max(self.last_step, msg.step)
            case RunFinished():
                self.finished_steps = msg.steps
            case ProfileStopped(status="ok"):
                self.traces.add(_trace_key(msg))


def _trace_key(msg: ProfileStopped) -> tuple[str, str, int]:
    return msg.session_id, msg.role, msg.rank


async def run_status(url: str, run_id: str, archive: Path | None = None) -> RunStatus:
    """Fold run ``run_id``'s events stream into a :class:`RunStatus` (one XRANGE pass).

    The stream only: under ``run.retention=checkpoint`` it holds a few checkpoint windows
    (older events are archived), and a resume must not read the whole past. A run whose
    RunStarted was archived still has entries: it has started, and its config is the one of
    the newest RunStarted in ``archive`` (the run's events folder), when that is here."""
    from bus import Bus

    status = RunStatus()
    stream = RunKeys(run_id).events
    bus = Bus.from_url(url, client_name="rlbus-status")
    try:
        async for _, msg in bus.read_all(stream):
            status.fold(msg)
        if not status.started:
            status.started = await bus.length(stream) > 0
        if status.started and status.config is None and archive is not None:
            found = await asyncio.to_thread(_archived_start, bus, stream, archive)
            status.config = None if found is None else found.config
    finally:
        await bus.close()
    return status


def _archived_start(bus: Any, stream: str, folder: Path) -> RunStarted | None:
    """The newest RunStarted in a run's events archive (read only when the stream has none:
    a run resumed long ago). Blocking: file reads."""
    from bus.archive import read_archive
    from bus.messages import RunStarted

    newest = None
    for entry in read_archive(folder):
        # The event's type name is in its bytes: decode only the candidates.
        if not any(b"RunStarted" in bytes(f) for f in entry.fields):
            continue
        decoded = bus.decode_entry(stream, entry.id, list(entry.fields))
        if decoded is not None and isinstance(decoded[1], RunStarted):
            newest = decoded[1]
    return newest


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


# --------------------------------------------------------------------------- recorded config


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def _known(dotted: str, keys: list[str]) -> bool:
    return any(k == dotted or k.startswith(f"{dotted}.") for k in keys)


def recorded_config(recorded: dict[str, Any], now: Config, warn: Callable[[str], None]) -> (
    dict[str, Any]
):
    """The base tree a continued run loads on: the package defaults, the recorded config's
    keys over them (a key this rlbus does not know is dropped, with a warning), and the
    :data:`_HERE_AND_NOW` keys from ``now``."""
    keys = known_keys()
    base = default_dict()
    for key in keys:
        value = _get(recorded, key)
        if value is not None or _leaf_is_null(recorded, key):
            _put(base, key, value)
    for key in _unknown_leaves(recorded, "", keys):
        warn(f"the recorded config's key '{key}' is unknown to this rlbus: ignored")
    current = config_to_dict(now)
    for key in _HERE_AND_NOW:
        _put(base, key, _get(current, key))
    return base


def _leaf_is_null(tree: dict[str, Any], dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node = _get(tree, ".".join(parents)) if parents else tree
    return isinstance(node, dict) and leaf in node and node[leaf] is None


def _unknown_leaves(tree: dict[str, Any], prefix: str, keys: list[str]) -> Iterator[str]:
    for name, value in tree.items():
        dotted = f"{prefix}{name}"
        if dotted in keys:
            continue
        if isinstance(value, dict) and _known(dotted, keys):
            yield from _unknown_leaves(value, f"{dotted}.", keys)
        else:
            yield dotted


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every config key whose value differs, in key order, except
    the :data:`_HERE_AND_NOW` keys."""
    out = []
    for key in known_keys():
        if any(key == k or key.startswith(f"{k}.") for k in _HERE_AND_NOW):
            continue
        old, new = _get(before, key), _get(after, key)
        if old != new:
            out.append((key, old, new))
    return out


# --------------------------------------------------------------------------- children


class Child(msgspec.Struct):
    """One component process of the run."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    nice: int = 0  # > 0: off the critical path (its CPU goes to the others first)
    cpus: frozenset[int] | None = None  # CPUs of its own (run.cpu_affinity); None: any

    @property
    def started(self) -> bool:
        """Whether its process was started (a child never started has nothing to stop)."""
        return self.proc is not None

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

    def wait(self, timeout_s: float) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)

    def stop(self, grace_s: float = 10.0) -> None:
        stop_children([self], grace_s, None)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class _Console:
    """Where ``rlbus up`` writes: stdout (stderr for errors) until stdout's reader goes
    away; then the supervisor stops the run and what is left to say goes to stderr."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.stdout_open = True

    def out(self, text: str) -> None:
        if self.stdout_open:
            try:
                print(text, flush=True)
                return
            except (BrokenPipeError, ValueError):
                self._closed()
        self.err(text)

    def err(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(text, file=sys.stderr, flush=True)

    def say(self, text: str) -> None:
        self.err(f"rlbus up: {text}")

    def _closed(self) -> None:
        self.stdout_open = False
        self.sup.stdout_closed()
        # Later writes (and the flush at exit) go nowhere instead of raising again.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
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
    at the next signal ``sup`` records; then SIGKILL processes they left behind. Children
    that never started are left alone."""
    started = [c for c in children if c.started]
    for c in started:
        if not hasattr(c, "send"):  # Ray tasks: ray.cancel
            c.stop(grace_s)
    local = [c for c in started if hasattr(c, "send") and c.returncode() is None]
    if not local:
        return
    # Counted before the line below: a signal sent on reading it is the second one.
    seen = len(sup.signals) if sup is not None else 0
    leftovers = {p.pid: p for c in local for p in _descendants(c)}
    _say(f"stopping {', '.join(c.name for c in local)} (SIGTERM; SIGKILL after {grace_s:g} s"
         + (" or at a second signal)" if sup is not None else ")"))
    for c in local:
        c.send(signal.SIGTERM)
    _wait_or_kill(local, grace_s, sup, seen)
    for c in local:
        leftovers.update({p.pid: p for p in _descendants(c)})
    _kill_leftovers(list(leftovers.values()))
    _say("stopped " + ", ".join(f"{c.name} (exit {c.returncode()})" for c in local))


def _wait_or_kill(local: list[Child], grace_s: float, sup: Supervisor | None, seen: int) -> None:
    """Wait for ``local`` to exit; SIGKILL those still running after ``grace_s`` or once
    ``sup`` holds more than ``seen`` signals."""
    deadline = time.monotonic() + grace_s
    while True:
        running = [c for c in local if c.returncode() is None]
        if not running:
            return
        again = sup is not None and len(sup.signals) > seen
        if again or time.monotonic() >= deadline:
            why = "second signal" if again else f"still running after {grace_s:g} s"
            _say(f"{why}: killing {', '.join(c.name for c in running)} (SIGKILL)")
            for c in running:
                c.send(signal.SIGKILL)
            for c in running:
                c.wait(10)
            return
        time.sleep(POLL_S)


def _kill_leftovers(procs: list[psutil.Process]) -> None:
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


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


def _children(cfg: Config, config_path: Path, logs: Path, url: str | None) -> list[Child]:
    # `python -m rlbus ROLE`: each component prints its own progress lines into its log.
    # `url`: the embedded server's, on the command line (config.yaml never names it: it
    # changes at every start).
    py = [sys.executable, "-m", "rlbus"]
    base = ["--config", str(config_path), *([f"redis.url={url}"] if url else [])]
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
    past_profiles: int = 0
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
        traces = f"{self.profiles} trace(s)"
        if self.past_profiles:
            traces += f" (and {self.past_profiles} written before this session)"
        parts.append(f"{traces}, {self.warnings} warning(s)")
        return "summary: " + "; ".join(parts)


class _Progress:
    """A tqdm bar on a terminal; plain lines (logs, pipes, tests) otherwise."""

    def __init__(self, total: int, initial: int, console: _Console) -> None:
        self.total = total
        self.console = console
        self.bar: Any = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stdout)

    def step(self, ev: StepFinished) -> None:
        if self.bar is None:
            from bus.progress import step_line

            self.console.out(step_line(ev, self.total))
            return
        m = ev.metrics
        self.bar.update(max(0, ev.step - self.bar.n))
        self.bar.set_postfix_str(
            f"reward {m.get('reward/mean', float('nan')):.3f} staleness "
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


class _Watch:
    """Shows a run's events until it finishes, a child fails or a signal arrives."""

    LINGER_S = 60.0
    """How long components may take to exit after the run finished before they are stopped."""

    def __init__(self, run_id: str, children: list[Any], sup: Supervisor, progress: _Progress,
                 summary: _Summary, past_traces: set[tuple[str, str, int]]) -> None:
        self.keys = RunKeys(run_id)
        self.children = children
        self.sup = sup
        self.progress = progress
        self.summary = summary
        self.past_traces = past_traces
        self.started = time.monotonic()
        self.finished_at: float | None = None

    async def run(self, url: str, since: str) -> int:
        from bus import Bus

        bus = Bus.from_url(url)
        try:
            last = since
            while (rc := self._verdict()) is None:
                entries, last = await bus.read_after(self.keys.events, last, count=500,
                                                     block_ms=int(POLL_S * 1000))
                for _, msg in entries:
                    self._show(msg)
            return rc
        finally:
            await bus.close()

    def _verdict(self) -> int | None:
        """The exit code once watching is over, else None."""
        if self.sup.signals:
            return self.sup.exit_code
        for child in self.children:
            rc = child.returncode()
            if rc is not None and rc != 0:
                self.progress.say(f"rlbus up: {child.name} failed (exit code {rc}); last lines "
                                  f"of {child.log_path}:\n{child.log_tail()}", err=True)
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

    def _show(self, msg: Message) -> None:
        from bus import messages as m

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
        }
        handler = handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _step(self, ev: StepFinished) -> None:
        self.summary.add(ev, self.started)
        self.progress.step(ev)

    def _weights(self, ev: Any) -> None:
        if ev.version == 0:
            self.progress.say("weights version 0 published; rollouters start")

    def _profile(self, ev: ProfileStopped) -> None:
        if ev.status != "ok" and _trace_key(ev) in self.past_traces:
            # A resumed component reports the sessions it finds in the past as missed; the
            # trace an earlier incarnation wrote stands (as in the manifest).
            return
        self.summary.profiles += ev.status == "ok"
        self.progress.say(f"profile {ev.session_id} {ev.role}{ev.rank} steps "
                          f"{ev.first_step}-{ev.last_step}: {ev.status} {ev.path}")

    def _warning(self, ev: Any) -> None:
        self.summary.warnings += 1
        self.progress.say(f"warning from {ev.source}: {ev.message}")

    def _finished(self, ev: Any) -> None:
        self.progress.say(f"run {ev.run_id} finished after {ev.steps} steps ({ev.status})")
        self.finished_at = time.monotonic()


def _manifest_traces(cfg: Config) -> set[tuple[str, str, int]]:
    """``(session, role, rank)`` of the traces the run's manifest lists as written (the
    profiler service keeps it up to date; it also covers sessions archived from the log)."""
    from profiling import profile_root

    try:
        data = json.loads((profile_root(cfg) / "manifest.json").read_text())
        return {(s["id"], s["role"], int(s["rank"])) for s in data.get("sessions", [])
                if s.get("status") == "ok"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


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


def run_up(cfg: Config, argv: Sequence[str] = (), sup: Supervisor | None = None) -> int:
    """Run the whole job; returns the exit code (0 when the run finished).

    ``sup``: a :class:`Supervisor` the caller installed as early as it could (else one is
    installed now); restored before returning. ``argv``: the command's arguments, for the
    resume command and for the overrides a continued run applies to its recorded config."""
    sup = sup if sup is not None else Supervisor().install()
    try:
        return _Up(cfg, argv, sup).run()
    finally:
        sup.restore()


class _Up:
    """One ``rlbus up``: each method one stage; ``run`` stops whatever started."""

    def __init__(self, cfg: Config, argv: Sequence[str], sup: Supervisor) -> None:
        self.cfg = resolve_run_id(cfg)
        self.argv = list(argv)
        self.sup = sup
        self.console = _Console(sup)
        self.run_id = self.cfg.run.id or ""
        self.run_dir = Path(self.cfg.run.output_dir) / self.run_id
        self.url = ""
        self.server: EmbeddedRedis | None = None
        self.ray = False
        self.children: list[Any] = []
        self.started = False
        self.fresh = False
        self.status = RunStatus()
        self.summary = _Summary()
        self.wall0 = time.monotonic()

    def run(self) -> int:
        rc = 1
        try:
            rc = self._run()
        except Interrupted:
            rc = self.sup.exit_code
        except (_Refused, RedisStartError, RedisBinaryNotFound, RayUnavailable) as exc:
            self.console.say(f"error: {exc}")
        finally:
            rc = self._stop(rc)
        self._report(rc)
        return rc

    def _run(self) -> int:
        self.sup.check()
        self._check_ray_address()
        self._connect()
        self.sup.check()
        done = self._consult_log()
        if done is not None:
            return done
        config_path = self._write_config()
        self._place(config_path)
        self._start_children()
        return self._watch()

    # ---- stages

    def _check_ray_address(self) -> None:
        """An unreachable ``run.ray_address`` is one line before anything is created."""
        run = self.cfg.run
        if run.launcher == "ray" and run.ray_address:
            from rlbus.ray_launcher import probe_address, ray_endpoint

            ray_endpoint(run.ray_address)  # a malformed address: exit 2 before the wait line
            self.console.out(f"waiting for Ray at {run.ray_address} (up to "
                             f"{run.ray_connect_timeout_s:g} s, run.ray_connect_timeout_s)")
            probe_address(run.ray_address, run.ray_connect_timeout_s, lambda: self.sup.cancelled)
            self.sup.check()

    def _connect(self) -> None:
        url = expanded_url(self.cfg)
        if url is not None:
            asyncio.run(_ping(url))  # BusUnavailable: one line from the CLI, nothing on disk
            self.url = url
            return
        data = _data_dir(self.cfg)
        self.server = EmbeddedRedis(data, port=self.cfg.redis.port, binary=self.cfg.redis.binary)
        try:
            self.server.start(cancelled=lambda: self.sup.cancelled)
        except RedisStartCancelled:
            raise Interrupted from None
        except RedisDirInUse as exc:
            self.server = None  # not ours: never stopped by this command
            owner = exc.owner
            raise _Refused(
                f"run.output_dir={self.cfg.run.output_dir} is in use: its embedded Redis "
                f"(pid {owner.pid}, {owner.url or 'starting'}) belongs to another rlbus "
                f"process (pid {owner.owner_pid}); wait for that one to end, or give this run "
                "another run.output_dir") from None
        self.url = self.server.url
        self.console.out(f"embedded Redis at {self.url} (data in {data})")

    def _consult_log(self) -> int | None:
        """Read the run's log: a continued run takes its recorded config (with this
        command's on top); a finished one ends here (the exit code), else None."""
        # A new run (embedded Redis, no run folder yet) has no log to consult: its
        # components start at once.
        self.fresh = self.server is not None and not self.run_dir.exists()
        if self.fresh:
            return None
        archive = self.run_dir / "events"
        self.status = asyncio.run(run_status(self.url, self.run_id, archive))
        if self.status.config is not None:
            self._take_recorded_config(self.status.config)
        total, done = self.cfg.trainer.total_training_steps, self.status.finished_steps
        if done is None:
            return None
        if done >= total:
            self.console.out(
                f"run {self.run_id} already finished after {done} steps: nothing to do (a new "
                f"run needs a new run.id; inspect it with `{_prog()} inspect --run "
                f"{self.run_id} run.output_dir={self.cfg.run.output_dir}`)")
            return 0
        self.console.out(f"run {self.run_id} finished after {done} steps: continuing it to "
                         f"{total} (trainer.total_training_steps)")
        return None

    def _take_recorded_config(self, recorded: dict[str, Any]) -> None:
        file, overrides = parse_config_args(self.argv)
        base = recorded_config(recorded, self.cfg, self.console.say)
        merged = load_config(file, overrides, base=base,
                             on_warning=lambda m: self.console.say(f"warning: {m}"))
        changes = config_changes(base, config_to_dict(merged))
        self.console.out(f"run {self.run_id}: the config recorded in its log"
                         + (", changed here:" if changes else " (nothing changed)"))
        for key, old, new in changes:
            self.console.out(f"  {key}: {_show_value(old)} -> {_show_value(new)}")
        self.cfg = merged

    def _write_config(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tree = config_to_dict(self.cfg)  # an embedded server's URL is never in it
        path = self.run_dir / "config.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    def _place(self, config_path: Path) -> None:
        embedded = self.url if self.server is not None else None
        children = _children(self.cfg, config_path, self.run_dir / "logs", embedded)
        if self.cfg.run.launcher == "ray":
            children = self._on_ray(children)
        self.children = children

    def _on_ray(self, children: list[Child]) -> list[Any]:
        from rlbus.ray_launcher import init_ray, ray_children

        self.ray = True
        run = self.cfg.run
        try:
            init_ray(run.ray_address, max(2, len(children)), run.ray_connect_timeout_s,
                     lambda: self.sup.cancelled)
        except SystemExit:  # Ray's own SIGTERM handler, active during ray.init
            self.sup.signals.append(signal.SIGTERM)
        finally:
            self.sup.install()  # ray.init replaced our SIGTERM handler
        self.sup.check()
        gpus = 1.0 if self.cfg.trainer.device.startswith("cuda") else 0.0
        placed = ray_children(children, trainer_gpus=gpus)
        self.console.out(f"Ray launcher: {len(placed)} tasks")
        return placed

    def _start_children(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.status.started:
            self.console.out(f"resuming run {self.run_id} after step {self.status.last_step}")
        for child in self.children:
            self.sup.check()
            child.start(env)
            self.started = True
        pids = ", ".join(
            f"{c.name} (pid {c.pid})" if getattr(c, "pid", None) else c.name
            for c in self.children
        )
        self.console.out(f"run {self.run_id}: {pids}; logs in {self.run_dir / 'logs'}")
        from metrics_logger import logger_warnings

        for warning in logger_warnings(self.cfg):
            self.console.say(f"warning: {warning}")

    def _watch(self) -> int:
        # A new run's stream is empty: its progress is read from the start.
        events = RunKeys(self.run_id).events
        since = "0" if self.fresh else asyncio.run(_latest_id(self.url, events))
        past = self.status.traces | _manifest_traces(self.cfg) if self.status.started else set()
        self.summary.past_profiles = len(past)
        progress = _Progress(self.cfg.trainer.total_training_steps, self.status.last_step,
                             self.console)
        watch = _Watch(self.run_id, self.children, self.sup, progress, self.summary, past)
        try:
            return asyncio.run(watch.run(self.url, since))
        finally:
            progress.close()

    # ---- the end

    def _stop(self, rc: int) -> int:
        """Stop what started (children, Ray, the embedded server); the exit code."""
        signalled = bool(self.sup.signals)
        if signalled:
            self.console.say(f"{self.sup.first} received; stopping the run")
        stop_children(self.children, self.cfg.run.stop_grace_s, self.sup)
        if self.ray:
            from rlbus.ray_launcher import shutdown_ray

            shutdown_ray()
        if self.server is not None:
            self.server.stop()
            if signalled and not self.started:
                self.console.say(f"stopped the embedded Redis ({self.server.dir})")
        return self.sup.exit_code if signalled else rc

    def _report(self, rc: int) -> None:
        if self.started:
            self.console.out(self.summary.line(self.run_id, self.cfg.trainer.total_training_steps,
                                               time.monotonic() - self.wall0))
            self._outputs(rc)
        if rc != 0 and (self.started or self.sup.signals):
            self.console.out(f"  resume       {resume_command(self.argv, self.run_id)}")

    def _outputs(self, rc: int) -> None:
        from profiling import profile_root

        cfg, out = self.cfg, self.console.out
        out(f"\noutputs of run {self.run_id}{'' if rc == 0 else ' (stopped before the end)'}:")
        out(f"  config       {self.run_dir / 'config.yaml'}")
        out(f"  checkpoints  {self.run_dir / 'checkpoints'}")
        out(f"  logs         {self.run_dir / 'logs'}")
        if _wants_logger(cfg):
            out(f"  tensorboard  tensorboard --logdir {self.run_dir / 'tensorboard'}")
        if cfg.global_profiler.tool is not None:
            out(f"  traces       {profile_root(cfg)} (manifest.json)")
        if cfg.redis.url is None:
            out(f"  event log    {_data_dir(cfg)} (Redis AOF)")
        out(f"  inspect      {_prog()} inspect --run {self.run_id}"
            + (f" --config {self.run_dir / 'config.yaml'}" if cfg.redis.url else "")
            + f" run.output_dir={cfg.run.output_dir}")


def _show_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


async def _latest_id(url: str, stream: str) -> str:
    from bus import Bus

    bus = Bus.from_url(url)
    try:
        latest = await bus.latest(stream)
        return latest[0] if latest else "0"
    finally:
        await bus.close()
