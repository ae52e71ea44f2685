"""Load a config: package defaults, then a user YAML file, then dotted ``KEY=VALUE`` overrides.

Every error is a :class:`ConfigError` that names the offending key; command-line entry points
turn it into exit code 2 (:func:`runconfig.cli.load_or_exit`). The checks across keys are
:mod:`runconfig.checks`; the schema's keys and the suggestions for misspelt ones are
:mod:`runconfig.keys`.
"""

from __future__ import annotations

import copy
import functools
import re
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import msgspec
import msgspec.inspect
import yaml

from runconfig import verl as verl_table
from runconfig import yaml12
from runconfig.checks import check_cross_fields
from runconfig.errors import ConfigError
from runconfig.keys import config_shape, known_keys, suggest_key
from runconfig.schema import Config

__all__ = [
    "PRESET",
    "Assignment",
    "ConfigError",
    "apply_override",
    "config_to_dict",
    "default_dict",
    "known_keys",
    "load_config",
    "parse_override",
    "resolve_run_id",
    "suggest_key",
    "verl_default_dict",
    "verl_differences",
    "verl_heads",
    "verl_preset",
]


def default_dict() -> dict[str, Any]:
    """The package defaults (``runconfig/defaults.yaml``) as a plain dict."""
    text = resources.files("runconfig").joinpath("defaults.yaml").read_text()
    return yaml12.safe_load(text)


PRESET = "verl"
"""``--config verl`` (when no file of that name exists) selects verl's defaults."""


def verl_preset() -> dict[str, Any]:
    """verl's defaults where they differ from rlbus's (``runconfig/verl_defaults.yaml``),
    in rlbus keys, as a nested dict (``trainer.default_local_dir`` still interpolated)."""
    text = resources.files("runconfig").joinpath("verl_defaults.yaml").read_text()
    return yaml12.safe_load(text)


def _merge(tree: dict[str, Any], over: dict[str, Any]) -> None:
    for name, value in over.items():
        if isinstance(value, dict) and isinstance(tree.get(name), dict):
            _merge(tree[name], value)
        else:
            tree[name] = copy.deepcopy(value)


def verl_default_dict() -> dict[str, Any]:
    """rlbus's defaults with verl's on top: what a verl line starts from (interpolations
    in ``trainer.default_local_dir`` resolved against these defaults)."""
    tree = default_dict()
    _merge(tree, verl_preset())
    _interpolate(tree, {})
    return tree


@functools.cache
def verl_heads() -> frozenset[str]:
    """Sections only verl has (``actor_rollout_ref``, ``algorithm``, ``critic``, ...): a key
    in one of them makes a line a verl line."""
    own = {k.split(".", 1)[0] for k in config_shape().leaves} - _VERLS_OWN
    return frozenset({k.split(".", 1)[0] for k in verl_table.verl_keys()} - own)


_VERLS_OWN = frozenset({"reward"})
"""Sections that stay verl's although rlbus has keys there (``reward.max_failure_ratio``,
``reward.bounds``): ``reward.num_workers=8`` is a verl line, rlbus's own keys alone are not
(:func:`_verl_line`)."""


# --------------------------------------------------------------------------- override grammar

Verb = Literal["set", "add", "force", "delete"]


class Assignment(msgspec.Struct, frozen=True):
    """One parsed ``KEY=VALUE`` (Hydra grammar: ``+`` add, ``++`` add or set, ``~`` delete)."""

    verb: Verb
    key: str
    value: Any = None
    has_value: bool = True  # False for a bare ``~KEY``


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*$")


def _parse_value(key: str, text: str) -> Any:
    try:
        return yaml12.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {text!r}: {exc}") from None


def parse_override(text: str) -> Assignment:
    """``KEY=VALUE``, ``+KEY=VALUE``, ``++KEY=VALUE``, ``~KEY`` or ``~KEY=VALUE``.

    VALUE is YAML with YAML 1.2 numbers (``[1,3]``, ``null``, ``1e-6``).
    """
    verb: Verb = "set"
    body = text
    if text.startswith("++"):
        body, verb = text[2:], "force"
    elif text.startswith("+"):
        body, verb = text[1:], "add"
    elif text.startswith("~"):
        body, verb = text[1:], "delete"
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not key or not _KEY_RE.match(key):
        raise ConfigError(key or text, f"override {text!r} is not KEY=VALUE")
    if verb == "delete":
        if not sep:
            return Assignment("delete", key, has_value=False)
        return Assignment("delete", key, _parse_value(key, raw))
    if not sep:
        raise ConfigError(key, f"override {text!r} is not KEY=VALUE")
    return Assignment(verb, key, _parse_value(key, raw))


def _flatten(user: dict[str, Any]) -> list[Assignment]:
    """A config file's nested mapping as dotted assignments, in file order."""
    shape = config_shape()
    out: list[Assignment] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in node.items():
            dotted = f"{prefix}{name}"
            if dotted in shape.mappings:
                # Replaces the default mapping (as a key=VALUE override does), so a config
                # written out by config_to_dict reads back unchanged.
                out.extend(_mapping_value(dotted, value))
            elif dotted in shape.sections and value is None:
                continue  # an empty section (`trainer:` with everything commented out)
            elif dotted in shape.sections and not isinstance(value, dict):
                raise ConfigError(dotted, f"expected a mapping, got {value!r}")
            elif isinstance(value, dict) and value and dotted not in shape.leaves:
                walk(value, f"{dotted}.")
            else:
                out.append(Assignment("set", dotted, value))

    walk(user, "")
    return out


def _mapping_value(dotted: str, value: Any) -> list[Assignment]:
    """A mapping leaf's value from a file; a nested mapping that verl's table spells key by
    key (``reward_model.reward_kwargs.overlong_buffer_cfg`` -> ``reward_model.overlong_buffer``)
    is taken out as those keys."""
    if not isinstance(value, dict):
        return [Assignment("set", dotted, value)]
    rest, spelled = dict(value), []
    for name, sub in value.items():
        keys = [f"{dotted}.{name}.{k}" for k in sub] if isinstance(sub, dict) else []
        if keys and all(verl_table.lookup(k) is not None for k in keys):
            spelled += [Assignment("set", k, v) for k, v in zip(keys, sub.values(), strict=True)]
            del rest[name]
    return [Assignment("set", dotted, rest), *spelled]


# --------------------------------------------------------------------------- applying


def _warn_stderr(message: str) -> None:
    print(f"rlbus: warning: {message}", file=sys.stderr, flush=True)


class _Builder:
    """Applies assignments to the defaults tree, remembering who set what."""

    def __init__(self, tree: dict[str, Any], warn: Callable[[str], None],
                 note: Callable[[str], None] | None = None,
                 derived: Callable[[verl_table.Derivation], None] | None = None) -> None:
        self.tree = tree
        self.defaults = copy.deepcopy(tree)
        self.warn = warn
        self.note = note  # how a derived value was computed (the run's length)
        self.on_derived = derived  # each rlbus key a verl key set (config --show)
        self.origin: dict[str, str] = {}  # rlbus key -> the key the user wrote
        self.explicit: set[str] = set()  # rlbus keys the user set
        self.derived: dict[str, Any] = {}  # verl keys resolved at the end
        self.warned: set[str] = set()

    # ---- tree access
    @staticmethod
    def _get(tree: dict[str, Any], key: str) -> Any:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        return node

    def _put(self, key: str, value: Any) -> None:
        *parents, leaf = key.split(".")
        node = self.tree
        for part in parents:
            node = node[part]
        node[leaf] = value

    def set(self, key: str, value: Any, by: str) -> None:
        self._put(key, copy.deepcopy(value))
        self.origin[key] = by
        self.explicit.add(key)

    def reset(self, key: str) -> None:
        self._put(key, copy.deepcopy(self._get(self.defaults, key)))
        self.origin.pop(key, None)
        self.explicit.discard(key)

    # ---- one assignment
    def apply(self, a: Assignment) -> None:
        shape = config_shape()
        if a.key.rsplit(".", 1)[-1] == "_target_":
            return  # Hydra's instantiation target in a verl YAML file: no meaning here
        if a.key in shape.leaves:
            self._own(a, a.key)
            return
        # verl's spellings first: reward_model.reward_kwargs.overlong_buffer_cfg.len is a row
        # although reward_model.reward_kwargs is an rlbus mapping.
        row = verl_table.lookup(a.key)
        if row is not None:
            self._verl(a, row)
            return
        parent = next((m for m in shape.mappings if a.key.startswith(f"{m}.")), None)
        if parent is not None:
            self._option(a, parent, a.key[len(parent) + 1:])
            return
        leaf = next((k for k in shape.leaves if a.key.startswith(f"{k}.")), None)
        if leaf is not None:
            raise ConfigError(a.key, f"{leaf} is a value, not a section")
        head = a.key.split(".", 1)[0]
        if head not in shape.sections and head not in verl_heads():
            raise ConfigError(head, "unknown config section", suggest_key(a.key))
        raise ConfigError(a.key, "unknown config key", suggest_key(a.key))

    def _own(self, a: Assignment, key: str, by: str | None = None,
             value: Any = None, convert: bool = False) -> None:
        by = by or a.key
        if a.verb == "add":
            raise ConfigError(by, "'+' adds a key the config does not have, and it has this "
                                  f"one: write {by}=VALUE (or ++{by}=VALUE)")
        if a.verb == "delete":
            if a.has_value and self._get(self.tree, key) != (value if convert else a.value):
                raise ConfigError(by, f"not deleted: its value is {self._get(self.tree, key)!r}, "
                                      f"not {a.value!r}")
            self.reset(key)
            return
        self.set(key, value if convert else a.value, by)

    def _option(self, a: Assignment, parent: str, name: str) -> None:
        options = dict(self._get(self.tree, parent))
        if a.verb == "delete":
            if name not in options:
                raise ConfigError(a.key, f"not deleted: {parent} has no option {name!r}")
            del options[name]
        elif a.verb == "add" and name in options:
            raise ConfigError(a.key, f"'+' adds an option {parent} does not have, and it has "
                                     f"this one: write {a.key}=VALUE (or ++{a.key}=VALUE)")
        elif a.verb == "set" and name not in options:
            raise ConfigError(a.key, f"{parent} has no option {name!r}; add it with "
                                     f"+{a.key}=VALUE", suggest_key(name, list(options)))
        else:
            options[name] = a.value
        self.set(parent, options, self.origin.get(parent, a.key))

    def _verl(self, a: Assignment, row: verl_table.VerlKey) -> None:
        handler = {"ignored": self._verl_ignored, "fixed": self._verl_fixed,
                   "derived": self._verl_derived}.get(row.kind, self._verl_alias)
        handler(a, row)

    def _verl_ignored(self, a: Assignment, row: verl_table.VerlKey) -> None:
        if a.key not in self.warned:
            self.warned.add(a.key)
            self.warn(f"config key '{a.key}' is verl's and has no meaning in rlbus: "
                      f"ignored ({row.note})")

    @staticmethod
    def _verl_fixed(a: Assignment, row: verl_table.VerlKey) -> None:
        if a.verb == "delete" or a.value in row.values:
            return
        allowed = " or ".join(repr(v) for v in row.values)
        raise ConfigError(a.key, f"rlbus supports only {allowed}, got {a.value!r}: {row.note}")

    def _verl_derived(self, a: Assignment, row: verl_table.VerlKey) -> None:
        if a.verb == "add":
            raise ConfigError(a.key, "'+' adds a key the config does not have, and it has "
                                     f"this one: write {a.key}=VALUE")
        if a.verb == "delete":
            self.derived.pop(a.key, None)
        else:
            self.derived[a.key] = a.value

    def _verl_alias(self, a: Assignment, row: verl_table.VerlKey) -> None:
        if row.key.endswith(".*"):
            self._verl_option(a, row)
            return
        value = a.value
        if row.convert is not None and a.verb != "delete":
            try:
                value = row.convert(a.key, value)
            except verl_table.VerlError as exc:
                raise ConfigError(exc.key, exc.message) from None
            if value is verl_table.SKIP:
                return
        if a.verb == "add" and row.plus:
            a = msgspec.structs.replace(a, verb="set")  # verl's config lacks it: +KEY=V
        for target, what in row.targets:
            if what is verl_table.VALUE:
                self._own(a, target, by=a.key, value=value, convert=True)
            elif a.verb == "delete":
                self.reset(target)
            else:
                self.set(target, what, a.key)

    def _verl_option(self, a: Assignment, row: verl_table.VerlKey) -> None:
        """A subtree alias: ``prefix.NAME`` is option NAME of the rlbus mapping (verl's
        ``+KEY=V`` and a file's plain ``KEY: V`` both add or set it)."""
        target = row.targets[0][0]
        name = a.key[len(row.key) - 1:]
        options = dict(self._get(self.tree, target))
        if a.verb != "delete":
            options[name] = a.value
        elif name in options:
            del options[name]
        else:
            raise ConfigError(a.key, f"not deleted: {target} has no option {name!r}")
        self.set(target, options, self.origin.get(target, a.key))

    # ---- after every assignment
    def finish(self) -> None:
        try:
            derived = verl_table.derive(self.derived, self.tree, frozenset(self.explicit))
        except verl_table.VerlError as exc:
            raise ConfigError(exc.key, exc.message) from None
        for derivation in derived:
            key, value, by, how = derivation
            self.set(key, value, by)
            if how and self.note is not None:
                self.note(how)
            if self.on_derived is not None:
                self.on_derived(derivation)
        prof = self.tree["global_profiler"]
        if prof.get("steps", ()) is None:
            prof["steps"] = []  # verl's default: profile no step
        if self.tree["trainer"].get("save_freq") == -1:
            self.tree["trainer"]["save_freq"] = 0  # verl's "never": no periodic checkpoint
        _interpolate(self.tree, self.origin)
        tool = prof.get("tool")
        if tool is not None and tool not in TOOLS:
            why = _VERL_TOOLS.get(str(tool), "")
            raise ConfigError(self.origin.get("global_profiler.tool", "global_profiler.tool"),
                              f"unknown tool {tool!r}{why}; the tools are "
                              f"{', '.join(TOOLS)}, or null (off)")
        nsys = "global_profiler.global_tool_config.nsys.worker_nsight_options"
        options = self._get(self.tree, nsys)
        if isinstance(options, dict) and options.get("capture-range", NSYS_RANGE) != NSYS_RANGE:
            raise ConfigError(f"{nsys}.capture-range",
                              f"must be {NSYS_RANGE}: rlbus opens the capture ranges itself "
                              "(cudaProfilerStart/Stop at step boundaries)")

    def error(self, key: str, message: str) -> ConfigError:
        """An error about rlbus ``key``, named as the user wrote it (maybe a verl spelling)."""
        by = self.origin.get(key, key)
        return ConfigError(by, message if by == key else f"{message} (it sets {key})")


_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")
_INTERPOLATED = ("trainer.default_local_dir",)


def _interpolate(tree: dict[str, Any], origin: dict[str, str]) -> None:
    """verl's ``${trainer.project_name}`` in the keys of ``_INTERPOLATED``, from the final
    values (as OmegaConf resolves verl's default ``checkpoints/${...}/${...}``)."""
    for key in _INTERPOLATED:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        value = node.get(leaf)
        if isinstance(value, str) and "${" in value:
            def resolved(m: re.Match[str], k: str = key) -> str:
                return _resolve(tree, m.group(1), k, origin)

            node[leaf] = _REF.sub(resolved, value)


def _resolve(tree: dict[str, Any], ref: str, key: str, origin: dict[str, str]) -> str:
    node: Any = tree
    for part in ref.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(origin.get(key, key), f"refers to ${{{ref}}}, not a config key")
        node = node[part]
    if node is None or isinstance(node, dict | list):
        raise ConfigError(origin.get(key, key), f"refers to ${{{ref}}}, which is {node!r}")
    return str(node)


TOOLS = ("torch", "torch_memory", "nsys")
NSYS_RANGE = "cudaProfilerApi"
_VERL_TOOLS = {
    "npu": " (verl's npu profiles Ascend NPUs; rlbus runs on CPU and CUDA)",
    "precision_debugger": " (verl's msprobe precision debugger has no counterpart here)",
}

_PATH = re.compile(r"at `\$\.?([^`]*)`")


def _key_of(message: str) -> str:
    match = _PATH.search(message)
    if not match:
        return "<config>"
    return re.sub(r"\[[^\]]*\]", "", match.group(1)) or "<config>"


def _warn_profiling_off(builder: _Builder, cfg: Config) -> None:
    """Steps given without a tool profile nothing: say so (once, naming both keys)."""
    p = cfg.global_profiler
    given = builder.defaults["global_profiler"].get("steps")
    if (p.tool is None and p.steps and p.steps != given
            and "global_profiler.steps" in builder.explicit):
        by = builder.origin.get("global_profiler.steps", "global_profiler.steps")
        builder.warn(f"config key '{by}' ({p.steps}) has no effect: profiling is off "
                     f"(global_profiler.tool is null; set it to {', '.join(TOOLS)})")


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one override (Hydra grammar, rlbus or verl keys) to a config tree in place.

    Ignored verl keys warn on stderr; derived verl keys are resolved against ``tree``.
    """
    builder = _Builder(tree, _warn_stderr)
    builder.apply(parse_override(override))
    builder.finish()


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    on_derived: Callable[[verl_table.Derivation], None] | None = None,
) -> Config:
    """Defaults (or ``base``), then ``config_file``, then ``overrides``; validated as a whole.

    Keys may be rlbus's or verl's spellings (:mod:`runconfig.verl`); overrides follow Hydra's
    grammar (``+KEY=V``, ``++KEY=V``, ``~KEY``). Each ignored verl key is reported once through
    ``on_warning`` (default: a line on stderr).

    A verl line (a key in a section only verl has, :func:`verl_heads`), ``config_file``
    ``"verl"`` when no such file exists, or ``run.defaults=verl`` starts from verl's defaults
    (:func:`verl_preset` over rlbus's) instead of rlbus's; ``run.defaults=rlbus`` never does.
    ``on_note`` (default: a line on stderr) says so once. With ``base`` (the config a run
    recorded) nothing is re-defaulted. ``on_derived`` is told each rlbus key a verl key
    set and how (``rlbus config --show``).
    """
    tree = copy.deepcopy(base) if base is not None else default_dict()
    preset = config_file is not None and str(config_file) == PRESET and not Path(
        config_file).exists()
    assignments = [] if preset or config_file is None else _read_file(Path(config_file))
    assignments += [parse_override(o) for o in overrides]
    why = None if base is not None else _verl_line(assignments, preset)
    if why is not None:
        _merge(tree, verl_preset())
        (on_note or _note_stderr)(
            f"verl's defaults for every key this line leaves out ({why}; "
            "runconfig/verl_defaults.yaml); run.defaults=rlbus keeps rlbus's")
    builder = _Builder(tree, on_warning or _warn_stderr, on_note or _note_stderr, on_derived)
    for assignment in assignments:
        builder.apply(assignment)
    builder.finish()
    try:
        cfg = msgspec.convert(tree, Config, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        key = _key_of(text)
        if text.startswith("Object contains unknown field"):
            field = re.search(r"`([^`]*)`", text)
            key = f"{key}.{field.group(1)}" if field and key != "<config>" else key
        raise builder.error(key, text.split(" - at ")[0]) from None
    try:
        check_cross_fields(cfg)
    except ConfigError as exc:  # named as the user wrote it (maybe a verl spelling)
        raise builder.error(exc.key, exc.message) from None
    _warn_profiling_off(builder, cfg)
    return cfg


def _note_stderr(message: str) -> None:
    print(f"rlbus: {message}", file=sys.stderr, flush=True)


def _read_file(path: Path) -> list[Assignment]:
    try:
        user = yaml12.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(user, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections")
    return _flatten(user)


def _verl_line(assignments: list[Assignment], preset: bool) -> str | None:
    """Why a line gets verl's defaults (None: it keeps rlbus's). ``run.defaults`` given
    in the line decides; else ``--config verl``; else its first key in a verl-only section."""
    mode = "auto"
    for a in assignments:
        if a.key == "run.defaults":
            mode = "auto" if a.verb == "delete" else a.value
    if mode == "verl":
        return "run.defaults=verl"
    if mode != "auto":
        return None  # rlbus (or a bad value, which the schema refuses naming the key)
    if preset:
        return f"--config {PRESET}"
    heads, own = verl_heads(), config_shape().leaves
    first = next((a.key for a in assignments
                  if a.key.split(".", 1)[0] in heads and a.key not in own), None)
    return None if first is None else f"{first} is verl's key"


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain builtins (for RunStarted events and child processes), as they
    read back from the log: a pair such as ``reward.bounds`` is a list, so a config compared
    with the one a run recorded differs only where a value does."""
    tree: dict[str, Any] = _as_lists(msgspec.to_builtins(cfg))
    return tree


def _as_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_lists(v) for v in value]
    return value


# Not compared: locations verl's defaults only hold placeholders for (~/models/...,
# ~/data/...), and the run length, which verl derives from the data (null: len x epochs).
_PLACEHOLDERS = frozenset({"model.path", "data.train_files", "data.val_files",
                           "trainer.total_training_steps"})


def verl_differences(cfg: Config) -> list[tuple[str, Any, Any, str]]:
    """``(rlbus key, effective value, verl's default, verl's key)`` for every key with a verl
    counterpart (:func:`runconfig.verl.counterpart`) whose value is not verl's default.

    verl's default is :func:`verl_default_dict`'s, its ``default_local_dir`` interpolated
    with the effective ``trainer.project_name``/``experiment_name`` as verl's would be.
    """
    effective = config_to_dict(cfg)
    verl_tree = default_dict()
    _merge(verl_tree, verl_preset())
    probe = copy.deepcopy(effective)
    probe["trainer"]["default_local_dir"] = verl_tree["trainer"]["default_local_dir"]
    try:
        _interpolate(probe, {})
        verl_tree["trainer"]["default_local_dir"] = probe["trainer"]["default_local_dir"]
    except ConfigError:  # experiment_name null here: verl's own names
        _interpolate(verl_tree, {})
    out: list[tuple[str, Any, Any, str]] = []
    for key in config_shape().leaves:
        verl_key = verl_table.counterpart(key)
        if verl_key is None or key in _PLACEHOLDERS:
            continue
        mine, theirs = _Builder._get(effective, key), _Builder._get(verl_tree, key)
        if mine != theirs:
            out.append((key, mine, theirs, verl_key))
    return out


def resolve_run_id(cfg: Config) -> Config:
    """Fill ``run.id`` with a fresh time-based id when it is null."""
    if cfg.run.id is not None:
        return cfg
    run_id = time.strftime("run-%Y%m%d-%H%M%S")
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, id=run_id))
