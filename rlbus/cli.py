"""The ``rlbus`` command: ``up``, one component, ``redis``, ``profile`` and ``inspect``.

Every sub-command takes ``--config FILE`` and dotted ``KEY=VALUE`` overrides and validates the
whole config before it does anything: an invalid config or argument exits with code 2 and a
message naming the key.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runconfig import ConfigError, load_config, parse_config_args

__all__ = ["main"]

USAGE = """\
usage: rlbus COMMAND [--config FILE] [KEY=VALUE ...]

commands:
  up          the main job on one machine: embedded Redis, profiler, rollouter(s), trainer
  trainer     run the trainer component
  rollouter   run one rollouter component (rollout.rank=I selects the replica)
  profiler    run the standalone profiler service
  redis       run the embedded redis-server in the foreground and print its URL
  profile     profile a live run: rlbus profile --run RUN --steps SPEC [--roles trainer,rollouter]
  inspect     a run's log: rlbus inspect --run RUN [--json] [--plot FILE.png]
"""


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so every bad argument maps to exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _split(prog: str, argv: Sequence[str], extra: list[tuple[str, dict]]) -> tuple[
    argparse.Namespace, list[str]
]:
    parser = _Parser(prog=prog, add_help=True)
    parser.add_argument("--config", default=None)
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    ns, rest = parser.parse_known_args(list(argv))
    for arg in rest:
        if arg.startswith("-"):
            raise _ArgError(f"unrecognized argument {arg}")
    return ns, rest


def _component(name: str, argv: list[str]) -> int:
    # Imported here so `rlbus redis` or `rlbus inspect` do not pay for torch.
    if name == "trainer":
        from trainer.app import main as component_main
    elif name == "rollouter":
        from rollouter.app import main as component_main
    else:
        from profiler_service.__main__ import main as component_main
    return int(component_main(argv) or 0)


def _redis(argv: list[str]) -> int:
    from bus.server import serve_forever

    file, overrides = parse_config_args(argv)
    cfg = load_config(file, overrides)
    from pathlib import Path

    return serve_forever(
        Path(cfg.run.output_dir) / "redis", port=cfg.redis.port, binary=cfg.redis.binary
    )


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
    from profiler_service.request import parse_spec, run_profile_request

    try:
        parse_spec(ns.steps)
    except ValueError as exc:
        raise _ArgError(f"--steps: {exc}") from None
    from rlbus.launcher import redis_for_reading

    with redis_for_reading(cfg) as url:
        return run_profile_request(url, ns.run, ns.steps, roles, ns.timeout)


def _inspect(argv: list[str]) -> int:
    ns, overrides = _split(
        "rlbus inspect",
        argv,
        [
            ("--run", {"required": True}),
            ("--json", {"action": "store_true"}),
            ("--plot", {"default": None}),
        ],
    )
    cfg = load_config(ns.config, [*overrides, f"run.id={ns.run}"])
    from rlbus.inspect import inspect_run

    return inspect_run(cfg, as_json=ns.json, plot=ns.plot)


def _up(argv: list[str]) -> int:
    file, overrides = parse_config_args(argv)
    cfg = load_config(file, overrides)
    from rlbus.launcher import run_up

    return run_up(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlbus`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    prog = f"rlbus {command}"
    try:
        if command in ("trainer", "rollouter", "profiler"):
            return _component(command, rest)
        if command == "redis":
            return _redis(rest)
        if command == "profile":
            return _profile(rest)
        if command == "inspect":
            return _inspect(rest)
        if command == "up":
            return _up(rest)
    except ConfigError as exc:
        return _fail(prog, str(exc))
    except _ArgError as exc:
        return _fail(prog, str(exc))
    print(USAGE, end="", file=sys.stderr)
    return _fail("rlbus", f"unknown command {command!r}")


if __name__ == "__main__":
    raise SystemExit(main())
