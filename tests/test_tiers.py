"""The fast tier (tests/tiers.py, ``make test-fast``) leaves out the process tests and fails
one that is not marked, whatever the code under test does with the refusal."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.tiers import FAST_TIMEOUT_S, ROOT, component_in

pytest_plugins = ("pytester",)

INNER_TESTS = '''
import importlib.util
import subprocess
import sys

import pytest


def test_pure():
    assert 1 + 1 == 2


def test_spawns_a_component_and_swallows_the_error():
    try:
        subprocess.run([sys.executable, "-m", "rlbus.no_such_module"], check=False)
    except Exception:
        pass  # the code under test may catch it: the test still fails


@pytest.mark.procs
def test_marked():
    raise AssertionError("a procs test ran in the fast tier")


def test_asks_for_the_procs_fixture(procs):
    raise AssertionError("a test on the procs fixture ran in the fast tier")


@pytest.mark.e2e
def test_e2e():
    raise AssertionError("an e2e test ran in the fast tier")


@pytest.mark.vllm
def test_vllm():
    raise AssertionError("a vllm test ran in the fast tier")


@pytest.mark.timeout(600)
def test_its_own_timeout_is_capped(request):
    assert request.node.get_closest_marker("timeout").args[0] == TIMEOUT


def test_a_plain_subprocess_runs():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
'''

INNER_VLLM = '''
import importlib.util


def test_asking_whether_vllm_is_installed_is_allowed():
    assert importlib.util.find_spec("vllm") is not None


def test_imports_vllm():
    try:
        import vllm  # noqa: F401
    except Exception:
        pass
'''


def _inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tests: str,
           *args: str) -> pytest.RunResult:
    """``tests`` run by a pytest of their own (a process: the tier's plugin patches its
    process), with tests/tiers.py and a ``procs`` fixture as the suite's conftest has."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(
        'import pytest\npytest_plugins = ("tests.tiers",)\n\n\n'
        "@pytest.fixture\ndef procs():\n    return None\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    e2e\n    vllm\n    procs\n")
    pytester.makepyfile(test_inner=tests.replace("TIMEOUT", repr(FAST_TIMEOUT_S)))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", *args, timeout=120)


def test_the_fast_tier_runs_the_rest_and_fails_an_unmarked_process_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _inner(pytester, monkeypatch, INNER_TESTS, "--fast")
    res.assert_outcomes(passed=3, failed=1, deselected=4)
    out = res.stdout.str()
    assert ("test_inner.py::test_spawns_a_component_and_swallows_the_error starts python -m "
            "rlbus.no_such_module") in out
    assert "mark it @pytest.mark.procs" in out


def test_without_fast_every_test_runs(pytester: pytest.Pytester,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    res = _inner(pytester, monkeypatch, INNER_TESTS.replace("== TIMEOUT", "== 600"))
    res.assert_outcomes(passed=4, failed=4)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_fast_tier_refuses_import_vllm(pytester: pytest.Pytester,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    res = _inner(pytester, monkeypatch, INNER_VLLM, "--fast")
    res.assert_outcomes(passed=1, failed=1)
    assert "test_inner.py::test_imports_vllm imports vllm" in res.stdout.str()
    assert "mark it @pytest.mark.vllm" in res.stdout.str()


@pytest.mark.parametrize(("argv", "what"), [
    ([sys.executable, "-m", "trainer", "x=1"], "python -m trainer"),
    ([sys.executable, "-X", "dev", "-u", "-m", "metrics_logger"], "python -m metrics_logger"),
    (["python", "-m", "tests.wedged_rollouter"], "python -m tests.wedged_rollouter"),
    ([sys.executable, "-m", "trainer.rank", "--rank", "1"], "python -m trainer.rank"),
    ("/venv/bin/rlbus up run.id=x", "the rlbus command"),
    (["/venv/bin/ray", "start", "--head"], "the ray command"),
    ([sys.executable, str(ROOT / "tests" / "ranks_harness.py")],
     "the script tests/ranks_harness.py"),
])
def test_component_commands_are_named(argv: list[str] | str, what: str) -> None:
    assert component_in(argv) == what


@pytest.mark.parametrize("argv", [
    [sys.executable, "-c", "from tasks.rewards import serve_fd; serve_fd(3)"],
    [sys.executable, "-m", "ruff", "check", "."],
    [sys.executable, "-m", "pytest"],
    ["/usr/bin/redis-server", "--port", "0"],
    [sys.executable, "-c", "import sys; print(sys.argv)", "-m", "trainer"],
    [],
])
def test_other_commands_are_not_components(argv: list[str]) -> None:
    assert component_in(argv) is None


def test_a_ray_binary_is_a_ray_process() -> None:
    ray = importlib.util.find_spec("ray")
    if ray is None or not ray.submodule_search_locations:
        pytest.skip("Ray is not installed")
    gcs = Path(next(iter(ray.submodule_search_locations))) / "core/src/ray/gcs/gcs_server"
    assert component_in([str(gcs), "--log_dir=/tmp/x"]) == "a Ray process"
