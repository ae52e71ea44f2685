"""Load a config: package defaults, then a user YAML file, then dotted ``KEY=VALUE`` overrides.

Every error is a :class:`ConfigError` that names the offending key; command-line entry points
turn it into exit code 2 (see :func:`load_or_exit`).
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import yaml

from runconfig.schema import Config

__all__ = [
    "ConfigError",
    "apply_override",
    "config_to_dict",
    "default_dict",
    "known_keys",
    "load_config",
    "load_or_exit",
    "parse_config_args",
    "resolve_run_id",
    "suggest_key",
]


class ConfigError(ValueError):
    """An invalid config or argument; ``key`` is the dotted key at fault.

    ``suggestion`` is the closest known dotted key for an unknown one (else None); the message
    then ends with ``; did you mean 'x.y'?``.
    """

    def __init__(self, key: str, message: str, suggestion: str | None = None) -> None:
        text = f"invalid config key '{key}': {message}"
        if suggestion:
            text += f"; did you mean '{suggestion}'?"
        super().__init__(text)
        self.key = key
        self.message = message
        self.suggestion = suggestion


def _leaves(info: msgspec.inspect.StructType, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for field in info.fields:
        dotted = f"{prefix}{field.name}"
        if isinstance(field.type, msgspec.inspect.StructType):
            keys += _leaves(field.type, f"{dotted}.")
        else:
            keys.append(dotted)
    return keys


@functools.cache
def _known() -> tuple[str, ...]:
    info = msgspec.inspect.type_info(Config)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(_leaves(info))


def known_keys() -> list[str]:
    """Every dotted key rlbus's config has (``trainer.lr``, ``global_profiler.steps``, ...)."""
    return list(_known())


def suggest_key(key: str, candidates: list[str] | tuple[str, ...] | None = None) -> str | None:
    """The known dotted key closest to ``key`` (difflib), or None when nothing is close."""
    pool = list(candidates if candidates is not None else _known())
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if match:
        return match[0]
    # A misspelt section with a right leaf (``trainr.lr``): compare the leaf within sections.
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in pool if k.rsplit(".", 1)[-1] == leaf]
    match = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.4)
    return match[0] if match else None


def _unknown(key: str, full: str, what: str = "unknown config key") -> ConfigError:
    return ConfigError(key, what, suggest_key(full))


def default_dict() -> dict[str, Any]:
    """The package defaults (``runconfig/defaults.yaml``) as a plain dict."""
    text = resources.files("runconfig").joinpath("defaults.yaml").read_text()
    return yaml.safe_load(text)


def _parse_value(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {text!r}: {exc}") from None


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one ``a.b.c=VALUE`` override in place; VALUE is YAML (``[1,3]``, ``null``)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or override, f"override {override!r} is not KEY=VALUE")
    parts = key.split(".")
    node: Any = tree
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
            raise _unknown(".".join(parts[: depth + 1]), key, "unknown config section")
        node = node[part]
    if parts[-1] not in node:
        raise _unknown(key, key)
    node[parts[-1]] = _parse_value(key, raw)


def _merge(base: dict[str, Any], update: dict[str, Any], prefix: str = "") -> None:
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            raise _unknown(dotted, dotted)
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(dotted, f"expected a mapping, got {value!r}")
            _merge(base[key], value, f"{dotted}.")
        else:
            base[key] = value


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def _key_of(message: str) -> str:
    match = _PATH.search(message)
    if not match:
        return "<config>"
    return re.sub(r"\[\d+\]", "", match.group(1)) or "<config>"


def _check_cross_fields(cfg: Config) -> None:
    m, t, p = cfg.model, cfg.task, cfg.global_profiler
    if m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", f"must divide model.d_model={m.d_model}")
    if m.kind == "hf" and not m.path:
        raise ConfigError("model.path", "model.kind=hf needs a local model directory")
    if m.kind == "tiny" and t.kind == "digits":
        # Learned absolute positions: a prompt (bos, digits, separator) plus its response
        # (continuations re-enter as prompts) must fit in model.max_len.
        need = t.max_digits + 2 + cfg.rollout.max_new_tokens
        if need > m.max_len:
            raise ConfigError("model.max_len", f"{m.max_len} is too short: prompts of "
                              f"{t.max_digits + 2} tokens plus rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens} need model.max_len >= {need}")
    if t.min_digits > t.max_digits:
        raise ConfigError("task.min_digits", f"must be <= task.max_digits={t.max_digits}")
    if t.kind == "jsonl" and not t.path:
        raise ConfigError("task.path", "task.kind=jsonl needs a JSONL file")
    if cfg.rollout.rank >= cfg.rollout.replicas:
        raise ConfigError("rollout.rank", f"must be < rollout.replicas={cfg.rollout.replicas}")
    total = cfg.trainer.total_training_steps
    late = [s for s in p.steps if s > total]
    if p.tool is not None and late:
        raise ConfigError(
            "global_profiler.steps", f"steps {late} are past trainer.total_training_steps={total}"
        )
    if len(set(p.steps)) != len(p.steps):
        raise ConfigError("global_profiler.steps", f"steps {p.steps} repeat a step")
    if p.tool is not None and not p.roles:
        raise ConfigError("global_profiler.roles", "profiling needs at least one role")
    bad_ranks = [r for r in p.ranks if r >= cfg.rollout.replicas]
    if bad_ranks and p.roles == ["rollouter"]:
        raise ConfigError(
            "global_profiler.ranks", f"ranks {bad_ranks} >= rollout.replicas={cfg.rollout.replicas}"
        )


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> Config:
    """Defaults (or ``base``), then ``config_file``, then ``overrides``; validated as a whole."""
    tree = copy.deepcopy(base) if base is not None else default_dict()
    if config_file is not None:
        path = Path(config_file)
        try:
            user = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
        if not isinstance(user, dict):
            raise ConfigError("--config", f"{path} must hold a mapping of sections")
        _merge(tree, user)
    for override in overrides:
        apply_override(tree, override)
    try:
        cfg = msgspec.convert(tree, Config, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        key = _key_of(text)
        if text.startswith("Object contains unknown field"):
            field = re.search(r"`([^`]*)`", text)
            key = f"{key}.{field.group(1)}" if field and key != "<config>" else key
        raise ConfigError(key, text.split(" - at ")[0]) from None
    _check_cross_fields(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain builtins (for RunStarted events and child processes)."""
    return msgspec.to_builtins(cfg)


def resolve_run_id(cfg: Config) -> Config:
    """Fill ``run.id`` with a fresh time-based id when it is null."""
    if cfg.run.id is not None:
        return cfg
    run_id = time.strftime("run-%Y%m%d-%H%M%S")
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, id=run_id))


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
    """Load the config from command-line arguments; on error print it and exit with code 2."""
    try:
        file, overrides = parse_config_args(argv)
        return load_config(file, overrides)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
