"""The extras a test or Ray venv installs pull no notebook server: jupyterlab (through
HolisticTraceAnalysis's requirements) brought rfc3987_syntax, which compiles a grammar when
jsonschema imports it, and made every `import ray` (each Ray worker, each `ray start`) 1 s
slower. The requirement graph is walked through the installed distributions' metadata."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = {"jupyterlab", "notebook", "jupyter-server", "jupyter", "holistictraceanalysis"}


def _extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["optional-dependencies"]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pulled(reqs: list[str]) -> dict[str, str]:
    """Every distribution ``reqs`` pull (without their extras' own optional parts), mapped to
    the requirement that pulled it first; walked through installed metadata (a distribution
    not installed here is listed but not walked further)."""
    seen: dict[str, str] = {}
    todo = [(Requirement(r), "(extra)") for r in reqs]
    while todo:
        req, parent = todo.pop()
        name = _norm(req.name)
        if name in seen:
            continue
        seen[name] = parent
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            wanted = {""} | set(req.extras)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in wanted):
                todo.append((r, name))
    return seen


@pytest.mark.parametrize("extra", ["dev", "ray", "traces"])
def test_extra_pulls_no_notebook_server(extra: str) -> None:
    pulled = _pulled(_extras()[extra])
    found = {n: by for n, by in pulled.items() if n in NOTEBOOK}
    assert not found, f"the {extra} extra pulls {found} (name: pulled by)"


def test_the_walk_sees_what_hta_would_pull() -> None:
    """The check can fail: HolisticTraceAnalysis's own requirements reach jupyterlab (when
    HTA is installed here, as `make test` does with --no-deps)."""
    try:
        metadata.distribution("HolisticTraceAnalysis")
    except metadata.PackageNotFoundError:
        pytest.skip("HolisticTraceAnalysis is not installed")
    assert "jupyterlab" in _pulled(["HolisticTraceAnalysis"])


def test_ray_is_walked() -> None:
    pulled = _pulled(_extras()["ray"])
    assert {"ray", "jsonschema"} <= set(pulled), sorted(pulled)
