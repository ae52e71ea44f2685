"""A command line's config: ``[--config FILE] KEY=VALUE ...``, loaded or exit 2."""

from __future__ import annotations

import sys

from runconfig.errors import ConfigError
from runconfig.load import load_config
from runconfig.schema import Config

__all__ = ["load_or_exit", "parse_config_args"]


def parse_config_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Split ``[--config FILE] KEY=VALUE ...`` into the file and the overrides."""
    config_file: str | None = None
    overrides: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config_file = next(it, None)
            if config_file is None:
                raise ConfigError("--config", "needs a file")
        elif arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(arg, "unknown option")
        else:
            overrides.append(arg)
    return config_file, overrides


def load_or_exit(argv: list[str], prog: str) -> Config:
    """Load the config from command-line arguments; on error print it and exit with code 2.
    ``-h``/``--help`` prints the usage and exits 0."""
    if "-h" in argv or "--help" in argv:
        print(f"usage: {prog} [--config FILE] [KEY=VALUE ...]\n\n"
              "KEY=VALUE: a dotted config override (YAML value; Hydra's +KEY=, ++KEY=, ~KEY\n"
              "and verl's spellings accepted; --config verl: verl's defaults). Every key, its\n"
              "default and meaning: runconfig/"
              "defaults.yaml and docs/config.md;\n`rlbus config [--show KEY]` prints the "
              "effective config.")
        raise SystemExit(0)
    try:
        file, overrides = parse_config_args(argv)
        return load_config(
            file, overrides, on_warning=lambda m: print(f"{prog}: warning: {m}", file=sys.stderr),
            on_note=lambda m: print(f"{prog}: {m}", file=sys.stderr),
        )
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
