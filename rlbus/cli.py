"""The ``rlbus`` command: ``up``, one component, ``redis``, ``profile``, ``inspect``,
``replay``, ``model``, ``config``.

Every sub-command takes ``--config FILE`` and dotted ``KEY=VALUE`` overrides and validates the
whole config before it does anything: an invalid config or argument exits with code 2 and a
message naming the key. ``--help`` on any command prints its usage. A Redis that cannot be
reached is one line naming its URL (exit code 1), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import yaml

from bus import BusAuthError, BusClusterError, BusUnavailable, redact_url
from runconfig import ConfigError, load_config, parse_config_args

__all__ = ["COMMANDS", "main"]

CONFIG_REF = (
    "Config keys: docs/config.md (every key, default and meaning), or `rlbus config` for the\n"
    "effective config and `rlbus config --show KEY` for one key. Overrides are verl-style\n"
    "dotted KEY=VALUE, VALUE in YAML: trainer.total_training_steps=50 global_profiler.steps=[1,3]\n"
)

COMMON = "[--config FILE] [KEY=VALUE ...]"

COMMANDS: dict[str, tuple[str, str]] = {
    "up": (f"rlbus up {COMMON}",
           "The main job on one machine: embedded Redis (unless redis.url is set), the profiler\n"
           "service (global_profiler.tool set), the metrics logger (trainer.logger has\n"
           "tensorboard or wandb), rollout.replicas rollouters and the trainer, each a process.\n"
           "Ctrl-C, SIGTERM or SIGHUP stop every part (a second one kills at once) and print\n"
           "the command that resumes the run; the same run.id resumes it."),
    "trainer": (f"rlbus trainer {COMMON}",
                "Run the trainer component (needs redis.url and run.id). Prints one progress\n"
                "line per step."),
    "rollouter": (f"rlbus rollouter {COMMON}",
                  "Run one rollouter component (needs redis.url and run.id). It joins the run\n"
                  "with the lowest free rank, or rollout.rank=I (exit 2 if another process\n"
                  "holds it). Prints a progress line every run.progress_interval_s."),
    "profiler": (f"rlbus profiler {COMMON}",
                 "Run the standalone profiler service for run.id (needs redis.url)."),
    "logger": (f"rlbus logger {COMMON}",
               "Run the metrics logger for run.id: writes StepFinished metrics to TensorBoard\n"
               "files under run.output_dir/RUN/tensorboard (and wandb, offline, when\n"
               "trainer.logger has it and wandb is installed). Restarts continue where it was."),
    "redis": (f"rlbus redis [--bind ADDR] {COMMON}",
              "Run the embedded redis-server in the foreground (data in run.output_dir/redis)\n"
              "and print its URL on the first line. --bind ADDR listens on ADDR too (other\n"
              "machines; 0.0.0.0 for all) with a password: $RLBUS_REDIS_PASSWORD, else one\n"
              "generated and shown once, on the second line (their redis.url)."),
    "profile": (f"rlbus profile --run RUN --steps SPEC [--roles trainer,rollouter] "
                f"[--timeout S] {COMMON}",
                "Profile a live run. SPEC is K, A-B or next:N. Exit 0: the session is\n"
                "scheduled and will write a trace; 2: refused (profiling off, past step, bad\n"
                "SPEC), with the reason; 1: no answer within --timeout (the request is then\n"
                "withdrawn so it is never served later)."),
    "inspect": ("rlbus inspect --run RUN [--json] [--heartbeats] [--plot FILE.png] "
                f"[--target R] [--trace FILE.json] [--samples --step K] {COMMON}",
                "A run's log: a timeline with wall-clock times, one JSON object per event\n"
                "(--json), a metrics and validation plot (--plot, only the plot; needs\n"
                "matplotlib), or the whole run as one Chrome/Perfetto trace (--trace: a track per\n"
                "component; open it at ui.perfetto.dev). --heartbeats adds the components alive\n"
                "now with their latest pulse (pulses are liveness keys, not log entries).\n"
                "--samples --step K: the prompts, responses and scores step K trained (the\n"
                "run's record, else the samples stream)."),
    "replay": (f"rlbus replay --run RUN [--step K] [--check] {COMMON}",
               "Rebuild a run's model after step K (default: its last step) on this machine:\n"
               "the newest intact checkpoint at or before K, then each later step re-applied\n"
               "on the samples it trained (the run's record, else the samples stream); the\n"
               "model is compared with the weights the run published at the last version\n"
               "boundary replayed. --check compares at every boundary and names the first step\n"
               "that differs. Exit 0: it matches (or nothing to compare, said), 1: it differs,\n"
               "2: the step cannot be replayed (the reason in one line)."),
    "retrain": (f"rlbus retrain --from RUN [--steps A-B] [--name NAME] {COMMON}",
                "Train a copy of a run's model as it was before step A on exactly the samples\n"
                "the run trained in steps A..B (default: all), with the trainer settings given\n"
                "as KEY=VALUE (clip ratios, KL, entropy, zero_adv, lr): the controlled\n"
                "comparison of losses on identical data. Writes the run's curves and the\n"
                "retrain's side by side under run.output_dir/RUN/retrain/NAME/tensorboard.\n"
                "A key that changes the samples or the model is refused (exit 2)."),
    "fork": (f"rlbus fork --run RUN --at K --new-run NEW {COMMON}",
             "A new run NEW that goes on from RUN's state after step K with the settings given\n"
             "as KEY=VALUE (lr, clip ratios, KL, staleness, reward function, ...): its\n"
             "checkpoint is RUN's model and optimizer after K (rebuilt and checked against\n"
             "RUN's published weights), its data position RUN's, its log RUN's steps 1-K and\n"
             "a RunForked naming RUN. Then `rlbus up run.id=NEW` trains from step K+1."),
    "model": (f"rlbus model --run RUN --out DIR [--step K] {COMMON}",
              "Copy the Hugging Face directory of a run's checkpoint (the newest exported step,\n"
              "or --step K) to DIR, from this node's checkpoint folder or from run.storage:\n"
              "what from_pretrained and vLLM load. Exit 2 when there is none, naming the steps\n"
              "there are."),
    "config": (f"rlbus config [--show KEY | --verl-diff] {COMMON}",
               "Print the effective config (defaults + file + overrides) as YAML, or one key's\n"
               "value with --show KEY. Passwords in redis.url are shown as ***. The data files\n"
               "(data.train_files, data.val_files) are loaded and checked as the run would.\n"
               "--verl-diff: every value that is not verl's default, one per line: rlbus key,\n"
               "value here, verl's default, verl's key. `--config verl` starts from verl's\n"
               "defaults."),
}

USAGE = "usage: rlbus COMMAND [--config FILE] [KEY=VALUE ...]\n\ncommands:\n" + "".join(
    f"  {name:<10}  {text.splitlines()[0]}\n" for name, (_, text) in COMMANDS.items()
) + "\n`rlbus COMMAND --help` for one command. " + CONFIG_REF


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every bad argument maps to exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise _ArgError(message)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _help(command: str) -> int:
    usage, text = COMMANDS[command]
    print(f"usage: {usage}\n\n{text}\n\n{CONFIG_REF}", end="")
    return 0


def _split(prog: str, argv: Sequence[str], extra: list[tuple[str, dict[str, Any]]]) -> tuple[
    argparse.Namespace, list[str]
]:
    parser = _Parser(prog=prog, add_help=False)
    parser.add_argument("--config", default=None)
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    ns, rest = parser.parse_known_args(list(argv))
    for arg in rest:
        if arg.startswith("-"):
            raise _ArgError(f"unrecognized argument {arg}")
    return ns, rest


def _component(name: str, argv: list[str]) -> int:
    """One component process: the same code path as ``python -m ROLE`` (runtime.main).
    Each package's ``main`` imports its component (and torch) only once the config is
    valid."""
    if name == "trainer":
        from trainer import main as component_main
    elif name == "rollouter":
        from rollouter import main as component_main
    elif name == "logger":
        from metrics_logger import main as component_main
    else:
        from profiler_service.__main__ import main as component_main
    return int(component_main(argv) or 0)


def _redis(argv: list[str]) -> int:
    from pathlib import Path

    from rlbus.serve_redis import serve_forever

    ns, overrides = _split("rlbus redis", argv, [("--bind", {"default": None})])
    cfg = load_config(ns.config, overrides)
    password, shown = _bind_password(ns.bind)
    return serve_forever(
        Path(cfg.run.output_dir) / "redis", port=cfg.redis.port, binary=cfg.redis.binary,
        bind=ns.bind, password=password, shown_password=shown,
    )


def _bind_password(bind: str | None) -> tuple[str | None, str | None]:
    """``(password, as shown)`` for ``rlbus redis --bind ADDR``: beyond 127.0.0.1 the server
    needs one, from ``$RLBUS_REDIS_PASSWORD`` (shown as that placeholder) or generated (shown
    once, on the URL line); ``(None, None)`` without ``--bind``."""
    import ipaddress
    import os
    import secrets

    if bind is None:
        return None, None
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise _ArgError(f"--bind: {bind!r} is not an IP address of this host "
                        "(0.0.0.0 for all)") from None
    env = os.environ.get("RLBUS_REDIS_PASSWORD")
    if env:
        return env, "${RLBUS_REDIS_PASSWORD}"
    generated = secrets.token_urlsafe(24)
    return generated, generated


def _profile(argv: list[str]) -> int:
    ns, overrides = _split(
        "rlbus profile",
        argv,
        [
            ("--run", {"required": True}),
            ("--steps", {"required": True}),
            ("--roles", {"default": "trainer,rollouter"}),
            ("--timeout", {"type": float, "default": 30.0}),
        ],
    )
    cfg = load_config(ns.config, [*overrides, f"run.id={ns.run}"])
    roles = [r.strip() for r in ns.roles.split(",") if r.strip()]
    bad = [r for r in roles if r not in ("trainer", "rollouter")]
    if bad or not roles:
        raise _ArgError(f"--roles: unknown role(s) {bad or roles}; use trainer,rollouter")
    if ns.timeout <= 0:
        raise _ArgError(f"--timeout: must be > 0 seconds, got {ns.timeout:g}")
    from profiler_service.request import parse_spec

    try:
        parse_spec(ns.steps)
    except ValueError as exc:
        raise _ArgError(f"--steps: {exc}") from None
    from rlbus.launcher import RunDataMissing, redis_for_reading
    from rlbus.profile import profile_live_run

    try:
        with redis_for_reading(cfg) as url:
            return profile_live_run(url, ns.run, ns.steps, roles, ns.timeout)
    except RunDataMissing as exc:
        print(f"rlbus profile: error: {exc}", file=sys.stderr)
        return 1


def _inspect(argv: list[str]) -> int:
    ns, overrides = _split(
        "rlbus inspect",
        argv,
        [
            ("--run", {"required": True}),
            ("--json", {"action": "store_true"}),
            ("--heartbeats", {"action": "store_true"}),
            ("--plot", {"default": None}),
            ("--target", {"type": float, "default": 0.9}),
            ("--trace", {"default": None}),
            ("--samples", {"action": "store_true"}),
            ("--step", {"type": int, "default": None}),
        ],
    )
    cfg = load_config(ns.config, [*overrides, f"run.id={ns.run}"])
    if ns.samples != (ns.step is not None):
        raise _ArgError("--samples and --step K go together: the samples step K trained")
    if ns.samples:
        from rlbus.step_samples import print_step_samples

        return print_step_samples(cfg, ns.step, ns.json)
    from rlbus.inspect import inspect_run

    return inspect_run(cfg, as_json=ns.json, plot=ns.plot, heartbeats=ns.heartbeats,
                       target=ns.target, trace=ns.trace)


def _replay(argv: list[str]) -> int:
    ns, overrides = _split("rlbus replay", argv, [
        ("--run", {"required": True}),
        ("--step", {"type": int, "default": None}),
        ("--check", {"action": "store_true"}),
    ])
    cfg = load_config(ns.config, [*overrides, f"run.id={ns.run}"])
    from rlbus.replay import replay_run

    return replay_run(cfg, ns.step, ns.check)


def _retrain(argv: list[str]) -> int:
    ns, overrides = _split("rlbus retrain", argv, [
        ("--from", {"required": True, "dest": "run"}),
        ("--steps", {"default": None}),
        ("--name", {"default": None}),
    ])
    # The overrides are the retrain's settings, applied on the config the run recorded; only
    # where the run's data lives (run.*, redis.*) is read from them here.
    where = [o for o in overrides if o.lstrip("+~").startswith(("run.", "redis."))]
    cfg = load_config(ns.config, [*where, f"run.id={ns.run}"])
    from rlbus.retrain import retrain_run

    return retrain_run(cfg, overrides, ns.steps, ns.name)


def _fork(argv: list[str]) -> int:
    ns, overrides = _split("rlbus fork", argv, [
        ("--run", {"required": True}),
        ("--at", {"type": int, "required": True}),
        ("--new-run", {"required": True}),
    ])
    # As retrain: the overrides are the fork's settings, applied on the parent's recorded config.
    where = [o for o in overrides if o.lstrip("+~").startswith(("run.", "redis."))]
    cfg = load_config(ns.config, [*where, f"run.id={ns.run}"])
    load_config(None, [f"run.id={ns.new_run}"])  # a bad run id exits 2 naming run.id
    from rlbus.fork import fork_run

    return fork_run(cfg, ns.at, ns.new_run, overrides)


def _model(argv: list[str]) -> int:
    ns, overrides = _split("rlbus model", argv, [("--run", {"required": True}),
                                                 ("--out", {"required": True}),
                                                 ("--step", {"type": int, "default": None})])
    cfg = load_config(ns.config, [*overrides, f"run.id={ns.run}"])
    from pathlib import Path

    from rlbus.model import ModelNotFound, fetch_model
    from rlbus.runlog import with_recorded_locations
    from storage.run_storage import StorageError

    cfg, taken = with_recorded_locations(cfg, ns.run)
    for text in taken:
        print(f"rlbus model: {text}", file=sys.stderr)
    try:
        step, source = fetch_model(cfg, ns.run, ns.step, Path(ns.out))
    except (ModelNotFound, FileExistsError, StorageError) as exc:
        print(f"rlbus model: error: {exc}", file=sys.stderr)
        return 2
    print(f"step {step}: {source} -> {ns.out}")
    return 0


def _config(argv: list[str]) -> int:
    ns, overrides = _split("rlbus config", argv, [("--show", {"default": None}),
                                                  ("--verl-diff", {"action": "store_true"})])
    if ns.show is not None and ns.verl_diff:
        raise _ArgError("--show and --verl-diff: give one of them")
    from runconfig.verl import Derivation

    derivations: list[Derivation] = []
    cfg = load_config(ns.config, overrides, on_derived=derivations.append)
    from runconfig import config_to_dict, known_keys, suggest_key
    from tasks.verl_data import check_data

    check_data(cfg)  # the data files as the run would load them (exit 2 naming the file)

    if ns.verl_diff:
        _print_verl_diff(cfg)
        return 0
    tree = config_to_dict(cfg)
    if tree["redis"]["url"]:
        tree["redis"]["url"] = redact_url(tree["redis"]["url"])
    if ns.show is None:
        print(yaml.safe_dump(tree, sort_keys=False), end="")
        return 0
    node: Any = tree
    for part in ns.show.split("."):
        if not isinstance(node, dict) or part not in node:
            verl = _show_verl_key(ns.show, tree, derivations)
            if verl is None:
                raise ConfigError(ns.show, "unknown config key",
                                  suggest_key(ns.show, known_keys()))
            print(verl)
            return 0
        node = node[part]
    print(_yaml_value(node))
    for d in derivations:  # a value a verl key derived: how (YAML comments)
        if d.key == ns.show:
            print(f"# {d.how}" if d.how else f"# derived from {d.by}")
    return 0


def _yaml_value(node: Any) -> str:
    text = yaml.safe_dump(node, sort_keys=False, default_flow_style=not isinstance(node, dict))
    return text.removesuffix("...\n").rstrip("\n")


def _show_verl_key(key: str, tree: dict[str, Any], derivations: list[Any]) -> str | None:
    """What verl's ``key`` is here, for ``config --show``: the rlbus key(s) it sets and their
    effective values, or how it is taken (fixed, derived: what it derived here and how,
    ignored), with the table's note; None when verl has no such key either."""
    from runconfig.verl import VALUE, lookup

    row = lookup(key)
    if row is None:
        return None
    note = f" ({row.note})" if row.note else ""
    if row.kind == "alias":
        lines = [f"{key} is verl's name of {target}{note}:" if value is VALUE else
                 f"{key} sets {target} to {_show_value(value)}{note}:"
                 for target, value in row.targets]
        values = [f"{target}: {_yaml_value(_tree_get(tree, target))}"
                  for target, _ in row.targets]
        return "\n".join([*lines, *values])
    if row.kind == "fixed":
        accepted = ", ".join(_show_value(v) for v in row.values)
        return f"{key} (verl's) is accepted only as {accepted} here{note}"
    if row.kind == "derived":
        mine = [d for d in derivations if d.by == key]
        if not mine:
            return f"{key} (verl's) is derived into rlbus keys when given{note}"
        return "\n".join([f"{key} (verl's) set these rlbus keys:",
                           *(f"{d.key}: {_yaml_value(_tree_get(tree, d.key))}" for d in mine),
                           *(f"# {d.how}" for d in mine if d.how)])
    return f"{key} (verl's) is accepted and ignored here{note}"


def _tree_get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def _show_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _print_verl_diff(cfg: Any) -> None:
    """The effective values that are not verl's defaults, in aligned columns."""
    from runconfig import verl_differences

    rows = [("key", "rlbus", "verl default", "verl key")] + [
        (key, _show_value(mine), _show_value(theirs), verl_key)
        for key, mine, theirs, verl_key in verl_differences(cfg)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3],
              sep="  ")


def _up(argv: list[str]) -> int:
    from rlbus.supervise import Supervisor

    # First: a signal from here on is recorded, and the launcher stops at its first check.
    sup = Supervisor().install()
    try:
        file, overrides = parse_config_args(argv)
        cfg = load_config(file, overrides)
        from rlbus.launcher import run_up

        return run_up(cfg, argv, sup)
    finally:
        sup.restore()


def _working_directory_importable() -> None:
    """The working directory on the import path, as ``python -m`` puts it there: how ``rlbus
    up`` starts its components and how verl's jobs run, so that a user's file (a reward
    function, a dataset class, a tool) importing modules of the launch directory (verl's
    recipes: ``recipe.retool.*``) loads in the console script's checks as in the components.
    Appended, not prepended: an installed package is never shadowed here."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under us: nothing to add
        return
    if cwd not in sys.path:
        sys.path.append(cwd)


_HANDLERS = {
    "up": _up,
    "redis": _redis,
    "profile": _profile,
    "inspect": _inspect,
    "replay": _replay,
    "retrain": _retrain,
    "fork": _fork,
    "model": _model,
    "config": _config,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlbus`` console script; returns the exit code."""
    _working_directory_importable()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    prog = f"rlbus {command}"
    if command not in COMMANDS:
        print(USAGE, end="", file=sys.stderr)
        return _fail("rlbus", f"unknown command {command!r}")
    if "-h" in rest or "--help" in rest:
        return _help(command)
    try:
        if command in ("trainer", "rollouter", "profiler", "logger"):
            return _component(command, rest)
        return _HANDLERS[command](rest)
    except ConfigError as exc:
        return _fail(prog, str(exc))
    except _ArgError as exc:
        return _fail(prog, str(exc))
    except (BusUnavailable, BusAuthError) as exc:
        from bus import bus_error_line

        print(bus_error_line(prog, exc), file=sys.stderr)
        return 1
    except BusClusterError as exc:
        return _fail(prog, str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
