"""Which package may import which (issue 35): ``bus`` knows Redis and nothing else, the
run's schema and the storage layer are leaves, and callers take bus's names from ``bus``.

Imports are read from the source (every ``import``, at any depth, TYPE_CHECKING included),
so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))

BUS_MAY_IMPORT = {"bus", "runschema"}
"""Of the project's packages, what bus/ may import: itself and the schema it carries."""

NOT_IN_BUS = {"torch", "fsspec", "numpy"}
"""Third-party packages bus/ never imports: tensors, file systems and arrays are not Redis
(numpy comes with the schema's arrays, through runschema)."""

LEAVES = ("runschema", "storage")
"""Packages that import nothing of the project's but themselves."""

WEIGHTS_MAY_IMPORT = {"weights", "bus", "runschema", "storage"}

DIRECT_ALLOWED: dict[str, str] = {}
"""``bus.MODULE`` a caller may import from directly, with the reason (none today)."""


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``; ``import a.b`` gives ("a.b", [])."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _py(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _top(module: str) -> str:
    return module.split(".")[0]


def test_bus_imports_no_torch_fsspec_numpy_storage_or_component() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {module}"
           for p in _py("bus") for line, module, _ in _imports(p)
           if _top(module) in NOT_IN_BUS
           or (_top(module) in PACKAGES and _top(module) not in BUS_MAY_IMPORT)]
    assert bad == []


@pytest.mark.parametrize("package", LEAVES)
def test_leaf_packages_import_nothing_of_the_project(package: str) -> None:
    assert _py(package), f"{package}/ is missing"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {module}"
           for p in _py(package) for line, module, _ in _imports(p)
           if _top(module) in PACKAGES and _top(module) != package]
    assert bad == []


def test_weight_transports_import_no_component() -> None:
    assert _py("weights"), "weights/ is missing"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {module}"
           for p in _py("weights") for line, module, _ in _imports(p)
           if _top(module) in PACKAGES and _top(module) not in WEIGHTS_MAY_IMPORT]
    assert bad == []


def _callers() -> list[Path]:
    """Every module outside bus/: the other packages, the tests, the benchmarks."""
    return [p for folder in (*PACKAGES, "tests", "bench") if folder != "bus"
            for p in _py(folder)]


def test_callers_import_bus_names_from_bus() -> None:
    """Outside bus/, ``from bus import X``: never a bus module (``from bus.keys import``,
    ``import bus.keys``, ``from bus import keys``). A private name a test imports from the
    module it tests is the one exception."""
    import bus

    modules = {p.stem for p in _py("bus")} - {"__init__"}
    bad = []
    for path in _callers():
        is_test = path.relative_to(ROOT).parts[0] == "tests"
        for line, module, names in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module.startswith("bus.") and module not in DIRECT_ALLOWED:
                rest = [n for n in names if not (is_test and n.startswith("_"))]
                if rest or not names:
                    bad.append(f"{where} imports {module} {rest}")
            elif module == "bus":
                bad += [f"{where} imports the module bus.{n}" for n in names if n in modules]
                bad += [f"{where} imports {n}, which bus does not export" for n in names
                        if n not in modules and n not in bus.__all__]
    assert bad == []
