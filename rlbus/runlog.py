"""What a run's log says to ``rlbus up`` and ``rlbus profile``: whether and how far the run
got (:func:`run_status`), and the config its latest RunStarted recorded, which a continued
run reuses with this command's overrides on top (:func:`recorded_config`).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import yaml

# Only what `rlbus up` needs before its components start; the bus client, the message
# schemas (numpy) and redis load after that (the components import torch meanwhile).
from bus import RunKeys
from runconfig import (
    Config,
    config_to_dict,
    default_dict,
    known_keys,
    load_config,
)

if TYPE_CHECKING:
    from bus import Bus
    from runschema.messages import Message, ProfileStopped, RunStarted

__all__ = [
    "FILE_LOCATIONS",
    "HERE_AND_NOW",
    "RunStatus",
    "config_changes",
    "recorded_config",
    "recorded_tree",
    "run_status",
    "trace_key",
    "with_recorded_locations",
]

HERE_AND_NOW = ("redis", "run.id", "run.output_dir", "run.launcher", "run.ray_address",
                 "run.ray_connect_timeout_s", "rollout.rank")
"""Keys a continued run takes from the command given now, never from its recorded config:
where its data lives and how this command places the components (the recorded
``redis.url`` may name an embedded server that is gone), and ``rollout.rank``, which is one
process's (a run recorded with ``rank: 0`` must not make every rollouter started from its
config.yaml ask for rank 0)."""


REWARD_TARGET = 0.9
"""The step reward a run's summary reports reaching (``rlbus up``'s last line)."""


class RunStatus(msgspec.Struct):
    """What a run's log says about it (from its latest RunStarted on)."""

    started: bool = False
    last_step: int = 0
    finished_steps: int | None = None
    validation_only: bool = False
    """The believed RunFinished says the run only validated (trainer.val_only)."""
    forked_at: int | None = None
    """The step its RunForked names (rlbus fork), None when it was not forked."""
    config: dict[str, Any] | None = None
    traces: set[tuple[str, str, int]] = msgspec.field(default_factory=set)
    ignored: list[str] = msgspec.field(default_factory=list)
    """Why each RunFinished that contradicts the log was not believed (runschema.facts)."""
    first_step: int | None = None
    """The oldest StepFinished the stream still holds (older ones are archived)."""
    target_step: int | None = None
    """The first step of those whose reward (runschema.facts.step_reward) reached
    :data:`REWARD_TARGET`."""

    def fold(self, msg: Message) -> None:
        """Take one event of the log, in log order. A RunFinished is believed only when it
        says the last finished step (runschema.facts.run_finished_refusal)."""
        from runschema.facts import run_finished_refusal, step_reward
        from runschema.messages import (
            ProfileStopped,
            RunFinished,
            RunForked,
            RunStarted,
            StepFinished,
        )

        match msg:
            case RunStarted():
                self.started = True
                self.finished_steps = None
                self.config = msg.config
            case StepFinished():
                self.last_step = max(self.last_step, msg.step)
                self.first_step = msg.step if self.first_step is None else min(
                    self.first_step, msg.step)
                if self.target_step is None and step_reward(msg.metrics) >= REWARD_TARGET:
                    self.target_step = msg.step
            case RunFinished():
                why = run_finished_refusal(msg, self.last_step)
                if why is None:
                    self.finished_steps = msg.steps
                    self.validation_only = msg.validation_only
                else:
                    self.ignored.append(why)
            case RunForked():
                self.forked_at = msg.step
            case ProfileStopped(status="ok"):
                self.traces.add(trace_key(msg))


def trace_key(msg: ProfileStopped) -> tuple[str, str, int]:
    return msg.session_id, msg.role, msg.rank


async def run_status(url: str, run_id: str, archive: Path | None = None) -> RunStatus:
    """Fold run ``run_id``'s events stream into a :class:`RunStatus` (one XRANGE pass).

    The stream only: under ``run.retention=checkpoint`` it holds a few checkpoint windows
    (older events are archived), and a resume must not read the whole past. A run whose
    RunStarted was archived still has entries: it has started, and its config is the one of
    the newest RunStarted in ``archive`` (the run's events folder), when that is here."""
    from bus import Bus
    from runschema.authority import refusal
    from runschema.messages import ProfileStopped

    status = RunStatus()
    stream = RunKeys(run_id).events
    bus = Bus.from_url(url, client_name="rlbus-status")
    try:
        async for _, msg in bus.read_all(stream):
            status.fold(msg)
        # The rollouters' traces are their own facts, in their stream of the log.
        async for _, msg in bus.read_all(RunKeys(run_id).log("rollouter")):
            if isinstance(msg, ProfileStopped) and refusal("rollouter", msg) is None:
                status.fold(msg)
        if not status.started:
            status.started = await bus.length(stream) > 0
        if status.started and status.config is None and archive is not None:
            found = await asyncio.to_thread(_archived_start, bus, stream, archive)
            status.config = None if found is None else found.config
    finally:
        await bus.close()
    return status


def _archived_start(bus: Bus, stream: str, folder: Path) -> RunStarted | None:
    """The newest RunStarted in a run's events archive (read only when the stream has none:
    a run resumed long ago). Blocking: file reads."""
    from runschema.messages import RunStarted
    from storage.archive import read_archive

    newest = None
    for entry in read_archive(folder):
        # The event's type name is in its bytes: decode only the candidates.
        if not any(b"RunStarted" in bytes(f) for f in entry.fields):
            continue
        decoded = bus.decode_entry(stream, entry.id, list(entry.fields))
        if decoded is not None and isinstance(decoded[1], RunStarted):
            newest = decoded[1]
    return newest





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
    :data:`HERE_AND_NOW` keys from ``now``."""
    keys = known_keys()
    base = default_dict()
    for key in keys:
        value = _get(recorded, key)
        if value is not None or _leaf_is_null(recorded, key):
            _put(base, key, value)
    for key in _unknown_leaves(recorded, "", keys):
        warn(f"the recorded config's key '{key}' is unknown to this rlbus: ignored")
    current = config_to_dict(now)
    for key in HERE_AND_NOW:
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
    the :data:`HERE_AND_NOW` keys."""
    out = []
    for key in known_keys():
        if any(key == k or key.startswith(f"{k}.") for k in HERE_AND_NOW):
            continue
        old, new = _get(before, key), _get(after, key)
        if old != new:
            out.append((key, old, new))
    return out


FILE_LOCATIONS = ("trainer.default_local_dir", "run.storage")
"""Where a run's files live, as its recorded config says: a command that reads them
(``rlbus model``) takes these from the record when its own line leaves them unset."""


def recorded_tree(cfg: Config, run_id: str) -> dict[str, Any] | None:
    """Run ``run_id``'s recorded config: the ``config.yaml`` ``rlbus up`` wrote in its run
    folder, else the latest RunStarted of its log (its embedded Redis or ``redis.url``);
    None when neither is here."""
    from rlbus.launcher import RunDataMissing, redis_for_reading
    from runconfig.paths import events_dir

    written = Path(cfg.run.output_dir) / run_id / "config.yaml"
    if written.is_file():
        tree = yaml.safe_load(written.read_text())
        return tree if isinstance(tree, dict) else None
    try:
        with redis_for_reading(cfg) as url:
            return asyncio.run(run_status(url, run_id, events_dir(cfg, run_id))).config
    except RunDataMissing:
        return None


def with_recorded_locations(cfg: Config, run_id: str) -> tuple[Config, list[str]]:
    """``cfg`` with each :data:`FILE_LOCATIONS` key this line leaves unset taken from the
    run's recorded config (a verl launch line sets ``trainer.default_local_dir``; the command
    that reads its files afterwards need not repeat it); and what was taken, in words."""
    recorded = recorded_tree(cfg, run_id)
    if recorded is None:
        return cfg, []
    tree, taken = config_to_dict(cfg), []
    for key in FILE_LOCATIONS:
        value = _get(recorded, key)
        if _get(tree, key) is None and value is not None:
            _put(tree, key, value)
            taken.append(f"{key}={value} (recorded by run {run_id})")
    if not taken:
        return cfg, []
    return load_config(None, [], base=tree), taken
