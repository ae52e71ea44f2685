"""The component processes of ``rlbus up``: how each is started (:class:`Child`: its own
session, PDEATHSIG, CPUs of its own), and how they are all stopped (:func:`stop_children`:
SIGTERM, then SIGKILL after the grace, and whatever they left behind).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from rlbus.redis_server import pdeathsig_hook
from rlbus.supervise import Supervisor
from runconfig import Config

if TYPE_CHECKING:
    pass

__all__ = [
    "POLL_S",
    "Child",
    "Console",
    "build_children",
    "cpu_plan",
    "pin",
    "say",
    "stop_children",
    "wants_logger",
]

POLL_S = 0.2
"""How often the supervisor looks at its children and at signals while stopping them."""


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


class Console:
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


def say(text: str) -> None:
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
    say(f"stopping {', '.join(c.name for c in local)} (SIGTERM; SIGKILL after {grace_s:g} s"
         + (" or at a second signal)" if sup is not None else ")"))
    for c in local:
        c.send(signal.SIGTERM)
    _wait_or_kill(local, grace_s, sup, seen)
    for c in local:
        leftovers.update({p.pid: p for p in _descendants(c)})
    _kill_leftovers(list(leftovers.values()))
    say("stopped " + ", ".join(f"{c.name} (exit {c.returncode()})" for c in local))


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
            say(f"{why}: killing {', '.join(c.name for c in running)} (SIGKILL)")
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


def pin(cfg: Config, children: Sequence[Child]) -> None:
    """run.cpu_affinity=auto: the trainer, then each rollouter, on CPUs of their own (the
    trainer's for all its ranks on this node: they inherit its CPUs)."""
    if cfg.run.cpu_affinity != "auto" or not hasattr(os, "sched_getaffinity"):
        return
    demands = [("trainer", cfg.trainer.threads * cfg.trainer.n_gpus_per_node)] + [
        (f"rollouter{rank}", cfg.rollout.threads) for rank in range(cfg.rollout.replicas)]
    plan = cpu_plan(list(os.sched_getaffinity(0)), demands)
    for child in children:
        child.cpus = plan.get(child.name)


def build_children(cfg: Config, config_path: Path, logs: Path, url: str | None) -> list[Child]:
    # `python -m rlbus ROLE`: each component prints its own progress lines into its log.
    # `url`: the embedded server's, on the command line (config.yaml never names it: it
    # changes at every start).
    py = [sys.executable, "-m", "rlbus"]
    base = ["--config", str(config_path), *([f"redis.url={url}"] if url else [])]
    children: list[Child] = []
    if cfg.global_profiler.tool is not None:
        children.append(Child("profiler", [*py, "profiler", *base], logs / "profiler.log"))
    if wants_logger(cfg):
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
    pin(cfg, children)
    return children


def wants_logger(cfg: Config) -> bool:
    names = cfg.trainer.logger
    names = [names] if isinstance(names, str) else names
    return bool({"tensorboard", "wandb"} & set(names))
