"""``rlbus up``: the whole run on one machine, each component a separate process.

Order: with ``run.launcher=ray`` and ``run.ray_address`` set, the address is checked first
(nothing listening within ``run.ray_connect_timeout_s`` is one line and nothing is created);
``redis.url`` is checked next (an unreachable server is one line and nothing is created on
disk), else the embedded Redis of ``run.output_dir`` starts (one per folder: a second
``rlbus up`` on a folder whose server is live is refused with one line naming it). A run
whose log already holds events is continued with the config its latest RunStarted recorded,
the file and overrides given now applied on top (each change printed as ``key: old ->
new``); a run whose log holds its RunFinished is not started again. Without ``run.id``, a
run recorded in ``trainer.default_local_dir`` is that run (``trainer.resume_mode=auto``;
:mod:`rlbus.localdir`), and a starting run records itself there. Then the profiler
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
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from bus import RedisBinaryNotFound, RedisStartError, RunKeys
from rlbus.children import Child, Console, build_children, stop_children, wants_logger
from rlbus.localdir import mark_local_dir, run_from_local_dir
from rlbus.ray_launcher import RayUnavailable
from rlbus.redis_server import EmbeddedRedis, RedisDirInUse, RedisStartCancelled, dir_owner
from rlbus.runlog import RunStatus, config_changes, recorded_config, run_status
from rlbus.supervise import Interrupted, Supervisor
from rlbus.watching import Progress, RestartPolicy, RunWatch, Summary, manifest_traces
from runconfig import (
    Config,
    config_to_dict,
    load_config,
    parse_config_args,
    resolve_run_id,
)
from runconfig.paths import checkpoint_dir, events_dir, record_dir
from runschema.facts import validation_only_refusal
from runtime.events_archive import fetch_for_reading
from runtime.process import expanded_url
from runtime.storage import check_storage
from storage.run_storage import StorageError
from tasks.verl_data import check_data

if TYPE_CHECKING:
    pass

__all__ = [
    "Interrupted",
    "RunDataMissing",
    "Supervisor",
    "ping",
    "redis_for_reading",
    "resume_command",
    "run_up",
]


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
        # The data files and the reward settings before anything starts: exit 2 naming the
        # file or key (ConfigError).
        check_data(cfg)
        return _Up(cfg, argv, sup).run()
    finally:
        sup.restore()


class _Up:
    """One ``rlbus up``: each method one stage; ``run`` stops whatever started."""

    def __init__(self, cfg: Config, argv: Sequence[str], sup: Supervisor) -> None:
        self.argv = list(argv)
        self.sup = sup
        self.console = Console(sup)
        # trainer.resume_mode=auto: the run recorded in trainer.default_local_dir
        self.cfg = _for_launcher(resolve_run_id(run_from_local_dir(cfg, self.console.out)))
        self.run_id = self.cfg.run.id or ""
        self.run_dir = Path(self.cfg.run.output_dir) / self.run_id
        self.url = ""
        self.server: EmbeddedRedis | None = None
        self.ray = False
        self.children: list[Any] = []
        self.started = False
        self.fresh = False
        self.log_ends: dict[str, str] | None = None  # None: a new run, read from its start
        self.status = RunStatus()
        self.summary = Summary()
        self.wall0 = time.monotonic()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

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
        why = check_storage(self.cfg, "up")  # run.storage: before anything starts
        if why is not None:
            self.console.say(f"error: {why}")
            return 2
        self._check_ray_address()
        self._connect()
        self.sup.check()
        done = self._consult_log()
        if done is not None:
            return done
        config_path = self._write_config()
        mark_local_dir(self.cfg)  # the same line finds this run again (localdir)
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

    def _fetch_archive(self) -> None:
        """On a remote run.storage, the archive segments the trainer mirrored there, into
        this node's events folder (download only), before the log is consulted."""
        try:
            fetch_for_reading(self.cfg, self.run_id)
        except StorageError as exc:
            self.console.say(f"warning: the events archive could not be fetched from "
                             f"run.storage ({exc})")

    def _consult_log(self) -> int | None:
        """Read the run's log: a continued run takes its recorded config (with this
        command's on top); a finished one ends here (the exit code), else None."""
        # A new run (embedded Redis, no run folder yet) has no log to consult: its
        # components start at once.
        self.fresh = self.server is not None and not self.run_dir.exists()
        if self.fresh:
            return None
        # Where each stream of the log ends before this session starts anything: what this
        # session shows and counts comes after (an earlier session's failure is not news).
        self.log_ends = asyncio.run(_log_ends(self.url, self.run_id))
        archive = events_dir(self.cfg, self.run_id)
        self._fetch_archive()
        self.status = asyncio.run(run_status(self.url, self.run_id, archive))
        if self.status.config is not None:
            self._take_recorded_config(self.status.config)
        for why in self.status.ignored:  # not the trainer's: the run is not finished
            self.console.say(f"warning: ignored a RunFinished of run {self.run_id}: {why}")
        if self.cfg.trainer.val_only and (refused := validation_only_refusal(
                self.run_id, self.status.last_step, self.status.forked_at)) is not None:
            self.console.say(f"error: {refused}")
            return 2
        total, done = self.cfg.trainer.total_training_steps, self.status.finished_steps
        if done is None:
            return None
        if done >= total or self.status.validation_only:
            what = (f", validating the weights after step {done} (trainer.val_only)"
                    if self.status.validation_only else f" after {done} steps")
            self.console.out(
                f"run {self.run_id} already finished{what}: nothing to do (a new "
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
        self.cfg = _for_launcher(merged)

    def _write_config(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tree = config_to_dict(self.cfg)  # an embedded server's URL is never in it
        path = self.run_dir / "config.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    def _place(self, config_path: Path) -> None:
        embedded = self.url if self.server is not None else None
        children = build_children(self.cfg, config_path, self.run_dir / "logs", embedded)
        if self.cfg.run.launcher == "ray":
            children = self._on_ray(children)
        self.children = children

    def _on_ray(self, children: list[Child]) -> list[Any]:
        from rlbus.ray_launcher import (
            init_ray,
            local_resources,
            place_trainer_nodes,
            ray_children,
            trainer_nodes,
        )

        self.ray = True
        run, tc = self.cfg.run, self.cfg.trainer
        try:
            # A local Ray: one CPU per component, and one per trainer rank beyond the first.
            init_ray(run.ray_address, max(2, len(children)) + tc.n_gpus_per_node - 1,
                     run.ray_connect_timeout_s,
                     lambda: self.sup.cancelled,
                     local_resources(run.ray, self.cfg.rollout.replicas))
        except SystemExit:  # Ray's own SIGTERM handler, active during ray.init
            self.sup.signals.append(signal.SIGTERM)
        finally:
            self.sup.install()  # ray.init replaced our SIGTERM handler
        self.sup.check()
        self._check_resources()
        # The trainer's task holds its node's ranks: a CPU, and on CUDA a GPU, each.
        gpus = float(tc.n_gpus_per_node) if tc.device.startswith("cuda") else 0.0
        if tc.nnodes > 1:
            children = trainer_nodes(children, tc)
        placed = ray_children(children, run.ray, trainer_gpus=gpus,
                              trainer_cpus=tc.n_gpus_per_node)
        if tc.nnodes > 1:
            addr = place_trainer_nodes(placed, tc, tc.n_gpus_per_node, gpus,
                                       run.ray.placement_timeout_s)
            self.console.out(f"Ray launcher: {tc.nnodes} trainer nodes, rank 0 at {addr}:"
                             f"{tc.master_port}")
        self.console.out(f"Ray launcher: {len(placed)} tasks")
        return placed

    def _check_resources(self) -> None:
        """A custom resource no node offers would leave its component waiting forever: one
        line naming the key, before anything is submitted."""
        import ray

        from rlbus.ray_launcher import missing_resources

        missing = missing_resources(self.cfg.run.ray, ray.cluster_resources())
        if missing:
            raise _Refused(f"no node of the Ray cluster offers {', '.join(missing)} "
                           "(start a node with `ray start ... --resources '{\"NAME\": N}'`)")

    def _start_children(self) -> None:
        env = self.env
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
        past = self.status.traces | manifest_traces(self.cfg) if self.status.started else set()
        self.summary.past_profiles = len(past)
        if self.status.started:
            self.summary.resumed(self.status.last_step, self.status.target_step,
                                 self.status.first_step)
        progress = Progress(self.cfg.trainer.total_training_steps, self.status.last_step,
                             self.console)
        watch = RunWatch(self.run_id, self.children, self.sup, progress, self.summary, past,
                         last_step=self.status.last_step,
                         policy=RestartPolicy(self.cfg.run.max_restarts), env=self.env,
                         placement_timeout_s=self.cfg.run.ray.placement_timeout_s)
        try:
            return asyncio.run(watch.run(self.url, self.log_ends, self.cfg.redis.give_up_s))
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
        ckpt = checkpoint_dir(cfg, self.run_id)
        out(f"  checkpoints  {ckpt}")
        if "hf_model" in cfg.trainer.checkpoint_contents:
            out(f"  hf models    {ckpt / 'global_step_K' / 'actor' / 'huggingface'} (each "
                "checkpoint K kept)")
        out(f"  logs         {self.run_dir / 'logs'}")
        if cfg.run.record != "none":
            out(f"  record       {record_dir(cfg, self.run_id)} (every sample, parquet; "
                f"{_prog()} replay --run {self.run_id} --step K)")
        if wants_logger(cfg):
            out(f"  tensorboard  tensorboard --logdir {self.run_dir / 'tensorboard'}")
        if cfg.global_profiler.tool is not None:
            out(f"  traces       {profile_root(cfg)} (manifest.json)")
        if cfg.redis.url is None:
            out(f"  event log    {_data_dir(cfg)} (Redis AOF)")
        out(f"  inspect      {_prog()} inspect --run {self.run_id}"
            + (f" --config {self.run_dir / 'config.yaml'}" if cfg.redis.url else "")
            + f" run.output_dir={cfg.run.output_dir}")


def _for_launcher(cfg: Config) -> Config:
    """Under Ray, every path key absolute against this directory (rlbus.abspaths): the
    components run wherever Ray started its workers."""
    if cfg.run.launcher != "ray":
        return cfg
    from rlbus.abspaths import absolute_paths

    return absolute_paths(cfg, Path.cwd())


def _show_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


async def _log_ends(url: str, run_id: str) -> dict[str, str]:
    """The id of each stream of the run's log's newest entry now."""
    from bus import Bus
    from runtime import LogFollower

    bus = Bus.from_url(url)
    try:
        return await LogFollower(bus, RunKeys(run_id)).ends()
    finally:
        await bus.close()
