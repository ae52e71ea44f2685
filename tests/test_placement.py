"""Each component's Ray options (rlbus.ray_launcher.ray_options): placement per role."""

from __future__ import annotations

from pathlib import Path

from rlbus.children import Child
from rlbus.ray_launcher import ray_children, ray_options
from runconfig import load_config


def _placement(*overrides: str):
    return load_config(None, list(overrides), on_warning=lambda _m: None).run.ray


def test_logger_and_profiler_take_no_cpu() -> None:
    for name in ("logger", "profiler"):
        opts = ray_options(name, _placement(), trainer_gpus=1.0)
        assert opts["num_cpus"] == 0 and opts["num_gpus"] == 0
        assert "resources" not in opts


def test_trainer_asks_for_its_resources_and_gpu() -> None:
    opts = ray_options("trainer", _placement("run.ray.trainer_resources={trainer: 1}"), 1.0)
    assert opts == {"num_cpus": 1, "num_gpus": 1.0, "resources": {"trainer": 1.0}}
    assert "scheduling_strategy" not in opts  # its resource places it, not a spread


def test_rollouters_spread_by_default_with_their_resources() -> None:
    opts = ray_options("rollouter1", _placement("run.ray.rollouter_resources={gen: 0.5}"), 1.0)
    assert opts == {"num_cpus": 1, "num_gpus": 0, "resources": {"gen": 0.5},
                    "scheduling_strategy": "SPREAD"}
    packed = ray_options("rollouter0", _placement("run.ray.rollouter_strategy=DEFAULT"), 0.0)
    assert packed["scheduling_strategy"] == "DEFAULT" and packed["resources"] == {}


def test_ray_children_keep_argv_and_logs(tmp_path: Path) -> None:
    local = [Child("logger", ["x"], tmp_path / "logger.log"),
             Child("rollouter0", ["y"], tmp_path / "r0.log"),
             Child("trainer", ["z"], tmp_path / "t.log")]
    placed = ray_children(local, _placement(), trainer_gpus=0.0)
    assert [(c.name, c.argv, c.log_path) for c in placed] == [
        (c.name, c.argv, c.log_path) for c in local]
    assert [c.options["num_cpus"] for c in placed] == [0, 1, 1]


def test_bad_strategy_is_a_config_error() -> None:
    import pytest

    from runconfig import ConfigError

    with pytest.raises(ConfigError, match="rollouter_strategy"):
        _placement("run.ray.rollouter_strategy=PACKED")


def test_a_local_ray_offers_what_the_placement_asks_for() -> None:
    from rlbus.ray_launcher import local_resources

    placement = _placement("run.ray.trainer_resources={trainer: 1}",
                           "run.ray.rollouter_resources={gen: 0.5, trainer: 0.25}")
    assert local_resources(placement, replicas=2) == {"trainer": 1.5, "gen": 1.0}
    assert local_resources(_placement(), replicas=3) == {}


def test_missing_resources_name_their_key() -> None:
    from rlbus.ray_launcher import missing_resources

    placement = _placement("run.ray.trainer_resources={trainer: 1}",
                           "run.ray.rollouter_resources={gen: 1}")
    assert missing_resources(placement, {"CPU": 4.0, "trainer": 1.0, "gen": 0.5}) == [
        "run.ray.rollouter_resources: gen"]
    assert missing_resources(placement, {"CPU": 4.0}) == [
        "run.ray.trainer_resources: trainer", "run.ray.rollouter_resources: gen"]
    assert missing_resources(_placement(), {}) == []
