"""The config's keys: every dotted leaf of the schema, and the closest one to a misspelt key."""

from __future__ import annotations

import difflib
import functools

import msgspec
import msgspec.inspect

from runconfig import verl as verl_table
from runconfig.schema import Config

__all__ = ["ConfigShape", "config_shape", "known_keys", "suggest_key"]


class ConfigShape(msgspec.Struct, frozen=True):
    """The shape of the config: dotted leaves, mapping-valued leaves, sections."""

    leaves: tuple[str, ...]
    mappings: frozenset[str]  # leaves whose value is an open mapping (nsys options)
    sections: frozenset[str]  # dotted prefixes of leaves ("trainer", "global_profiler...")


def _walk(info: msgspec.inspect.StructType, prefix: str, out: list[tuple[str, bool]]) -> None:
    for field in info.fields:
        dotted = f"{prefix}{field.name}"
        if isinstance(field.type, msgspec.inspect.StructType):
            _walk(field.type, f"{dotted}.", out)
        else:
            out.append((dotted, isinstance(field.type, msgspec.inspect.DictType)))


@functools.cache
def config_shape() -> ConfigShape:
    """The config's keys, from the schema (runconfig.schema.Config)."""
    info = msgspec.inspect.type_info(Config)
    assert isinstance(info, msgspec.inspect.StructType)
    found: list[tuple[str, bool]] = []
    _walk(info, "", found)
    leaves = tuple(k for k, _ in found)
    sections = {k.rsplit(".", i)[0] for k in leaves for i in range(1, k.count(".") + 1)}
    return ConfigShape(leaves, frozenset(k for k, m in found if m), frozenset(sections))


def known_keys(verl: bool = False) -> list[str]:
    """Every dotted key of rlbus's config (``trainer.lr``, ``global_profiler.steps``, ...).

    With ``verl=True`` also verl's spellings that rlbus accepts (see
    :mod:`runconfig.verl`; a subtree is listed as ``prefix.*``).
    """
    keys = list(config_shape().leaves)
    return keys + [k for k in verl_table.verl_keys() if k not in keys] if verl else keys


def suggest_key(key: str, candidates: list[str] | tuple[str, ...] | None = None) -> str | None:
    """The known dotted key closest to ``key`` (difflib), or None when nothing is close.

    Candidates default to rlbus's keys and verl's exact spellings.
    """
    if candidates is None:
        exact = [k for k in verl_table.verl_keys() if not k.endswith(".*")]
        candidates = [*config_shape().leaves, *exact]
    pool = list(candidates)
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
    if match:
        return match[0]
    # A misspelt section with a right leaf (``trainr.lr``): compare within that leaf name.
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in pool if k.rsplit(".", 1)[-1] == leaf]
    match = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.4)
    return match[0] if match else None
