"""YAML with YAML 1.2 numbers, for config files and ``KEY=VALUE`` override values.

PyYAML implements YAML 1.1, where ``1e-6`` is a *string* (a 1.1 float needs a dot and a signed
exponent), ``010`` is octal 8, ``1:30`` is the integer 90 and ``2026-12-02`` a date. Hydra and
OmegaConf, which verl users write their configs for, read ``1e-6`` as a float. This loader
resolves plain scalars as YAML 1.2's core schema does for numbers:

* integers: ``[-+]?[0-9]+`` (decimal, leading zeros included), ``0o17``, ``0x1F``; ``_``
  separators are accepted as in YAML 1.1 (verl's own configs write ``100_000``);
* floats: ``1.5``, ``.5``, ``1.``, ``1e-6``, ``-2.5E+3``, ``.inf``, ``-.inf``, ``.nan``;
* no sexagesimal numbers and no timestamps (they stay strings).

Booleans and null are PyYAML's (``true``/``false``/``null``/``~``, and 1.1's ``yes``/``no``).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["Loader", "safe_load"]

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"

_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 numbers (see the module docstring)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# Order matters: every integer also matches the float pattern, so integers are tried first.
Loader.add_implicit_resolver(_INT, _INT_RE, list("-+0123456789"))
Loader.add_implicit_resolver(_FLOAT, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("-+")
    if digits.startswith("0o"):
        return sign * int(digits[2:], 8)
    if digits.startswith("0x"):
        return sign * int(digits[2:], 16)
    return sign * int(digits, 10)


Loader.add_constructor(_INT, _construct_int)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2 numbers."""
    return yaml.load(text, Loader=Loader)  # Loader derives from SafeLoader: safe
