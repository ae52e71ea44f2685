"""The test tiers: ``make test`` runs every test, ``make test-fast`` (``pytest --fast``) the
ones that start no component process and load no vLLM, each within :data:`FAST_TIMEOUT_S`.

A test that runs a component as a process (``python -m trainer|rollouter|profiler_service|
metrics_logger|rlbus``, the ``rlbus`` or ``ray`` commands, a script or module of ``tests/``
run as a process, or a local Ray) is marked ``procs``: by the ``procs`` fixture it asks for,
by its ``e2e``/``chaos`` marker, or by hand (``@pytest.mark.procs``, or ``pytestmark`` for a
module of them). ``vllm`` tests load vLLM (tens of seconds each), and ``whole_tree`` tests run
a tool over the whole tree (mypy: a minute cold; `make lint` while you work): not fast either.

``--fast`` deselects those, and keeps the tier from rotting:

- a process test that was not marked fails, naming itself and the command it started: the
  spawn is refused (``subprocess.Popen`` raises), and the test fails even where the code under
  test caught that error; so does a test that imports vLLM;
- each test gets at most :data:`FAST_TIMEOUT_S` (pytest-timeout), its fixtures included: a
  test that grew slow fails there instead of slowing the tier down.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import shlex
import subprocess
import sys
from collections.abc import Generator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

FAST_TIMEOUT_S = 60.0
"""A fast-tier test's bound, setup and teardown included. The slowest test of the tier took
7-8 s on the shared 2-core machine lightly loaded, 19 s with it busy (load 5): a test that grows
several times slower fails here instead of slowing the tier down; load alone does not reach it."""

SLOW_MARKERS = ("procs", "vllm", "whole_tree")
"""Markers whose tests ``--fast`` leaves out."""

PROCS_MARKERS = ("e2e", "chaos")
"""Markers that mean component processes (their own definitions say so)."""

COMPONENT_PACKAGES = frozenset(
    {"trainer", "rollouter", "profiler_service", "metrics_logger", "rlbus", "tests"}
)
"""``python -m X``: a component when X is in one of these packages (``tests`` holds harnesses
that run components, e.g. ``tests.wedged_rollouter``)."""

COMPONENT_COMMANDS = frozenset({"rlbus", "ray"})
"""Commands that start components or a Ray node."""

ROOT = Path(__file__).resolve().parents[1]


def _ray_dir() -> Path | None:
    """Where Ray is installed (its binaries run from there), without importing it."""
    spec = importlib.util.find_spec("ray")
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


RAY_DIR = _ray_dir()


def _argv(args: Any) -> list[str]:
    if isinstance(args, str | bytes | Path):
        text = args.decode() if isinstance(args, bytes) else str(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [a.decode() if isinstance(a, bytes) else str(a) for a in args]


def _within(arg: str, folder: Path) -> bool:
    return arg.startswith(str(folder) + "/")


def _python_entry(argv: list[str]) -> tuple[str, str] | None:
    """("module", M) for ``python [opts] -m M``, ("script", S) for ``python [opts] S``, else
    None (``-c``, or not python)."""
    if not Path(argv[0]).name.startswith("python"):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return ("module", next(args, ""))
        if arg == "-c":
            return None
        if arg in ("-X", "-W"):
            next(args, None)
        elif not arg.startswith("-"):
            return ("script", arg)
    return None


def component_in(args: Any) -> str | None:
    """What in ``args`` (a command as Popen takes it) makes it a process test, or None."""
    argv = _argv(args)
    if not argv:
        return None
    if Path(argv[0]).name in COMPONENT_COMMANDS:
        return f"the {Path(argv[0]).name} command"
    if RAY_DIR is not None and any(_within(a, RAY_DIR) for a in argv):
        return "a Ray process"
    entry = _python_entry(argv)
    if entry is None:
        return None
    kind, name = entry
    if kind == "module" and name.split(".")[0] in COMPONENT_PACKAGES:
        return f"python -m {name}"
    script = Path(name).resolve()
    if kind == "script" and _within(str(script), ROOT):
        return f"the script {script.relative_to(ROOT)}"
    return None


class Guard:
    """In the fast tier: refuses component processes (``subprocess.Popen``, which asyncio's
    subprocesses use too) and ``import vllm``, and remembers each refusal for the running
    test's report (the code under test may catch the error, or retry)."""

    def __init__(self) -> None:
        self.test = "(no test running)"
        self.refused: list[str] = []
        self.popen_init = subprocess.Popen.__init__
        self.imports = RefusedImports(self)

    def install(self) -> None:
        guard = self
        original = self.popen_init

        def checked_init(popen: subprocess.Popen[Any], args: Any, *rest: Any,
                         **kwargs: Any) -> None:
            what = component_in(args)
            if what is not None:
                command = " ".join(_argv(args))[:300]
                guard.refuse(f"starts {what} ({command})", "procs")
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = checked_init  # type: ignore[method-assign,assignment]
        sys.meta_path.insert(0, self.imports)

    def uninstall(self) -> None:
        sys.meta_path.remove(self.imports)
        subprocess.Popen.__init__ = self.popen_init  # type: ignore[method-assign]

    def refuse(self, action: str, marker: str) -> None:
        message = (f"{self.test} {action} in the fast tier (pytest --fast): mark it "
                   f"@pytest.mark.{marker}; it belongs to make test")
        if message not in self.refused:  # said once, however often the code retries
            self.refused.append(message)
        raise RuntimeError(message)


class RefusedImports(importlib.abc.MetaPathFinder):
    """``import vllm`` refused; asking whether it is installed (``importlib.util.find_spec``)
    answers as without the guard (the import is refused when it runs)."""

    REFUSED = frozenset({"vllm"})

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.REFUSED or importlib.machinery.PathFinder.find_spec(name) is None:
            return None
        return importlib.util.spec_from_loader(name, RefusingLoader(self.guard), is_package=True)


class RefusingLoader(importlib.abc.Loader):
    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        self.guard.refuse(f"imports {module.__name__}", module.__name__)


GUARD = Guard()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true",
        help="the fast tier (make test-fast): no test marked procs or vllm; a component "
             f"process started by a test fails it; each test within {FAST_TIMEOUT_S:.0f} s",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml: the tier is defined in this file alone.
    config.addinivalue_line("markers", "procs: starts component processes or Ray; not in "
                            "make test-fast (tests/tiers.py)")
    config.addinivalue_line("markers", "whole_tree: checks the whole tree with a tool (mypy: a "
                            "minute cold); not in make test-fast: `make lint` while you work")
    if config.getoption("--fast"):
        GUARD.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.getoption("--fast"):
        GUARD.uninstall()


def _is_procs(item: pytest.Item) -> bool:
    return "procs" in getattr(item, "fixturenames", ()) or any(
        item.get_closest_marker(name) is not None for name in PROCS_MARKERS
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_procs(item) and item.get_closest_marker("procs") is None:
            item.add_marker(pytest.mark.procs)
    if not config.getoption("--fast"):
        return
    fast, slow = _split(items)
    if slow:
        config.hook.pytest_deselected(items=slow)
    items[:] = fast
    for item in fast:
        _bound(item)


def _split(items: Sequence[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    fast: list[pytest.Item] = []
    slow: list[pytest.Item] = []
    for item in items:
        is_slow = any(item.get_closest_marker(name) is not None for name in SLOW_MARKERS)
        (slow if is_slow else fast).append(item)
    return fast, slow


def _bound(item: pytest.Item) -> None:
    """At most FAST_TIMEOUT_S, whatever the test's own timeout marker says (the closest
    marker wins: this one goes first)."""
    own = item.get_closest_marker("timeout")
    raw = None if own is None else (own.args[0] if own.args else own.kwargs.get("timeout"))
    own_s = 0.0 if raw is None else float(raw)  # pytest-timeout: 0 is no timeout
    bound = FAST_TIMEOUT_S if own_s <= 0 else min(own_s, FAST_TIMEOUT_S)
    item.add_marker(pytest.mark.timeout(bound), append=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    GUARD.test = item.nodeid
    GUARD.refused.clear()
    yield
    GUARD.test = "(no test running)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
    outcome = yield
    if not GUARD.refused:
        return
    report = outcome.get_result()
    message = "\n".join(GUARD.refused)
    GUARD.refused.clear()
    if report.failed:
        report.sections.append(("fast tier", message))
    else:
        report.outcome = "failed"
        report.longrepr = message
