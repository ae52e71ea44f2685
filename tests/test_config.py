"""Config loading: defaults, files, dotted overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from runconfig import (
    Config,
    ConfigError,
    config_to_dict,
    known_keys,
    load_config,
    resolve_run_id,
)


def test_yaml_defaults_match_the_schema_defaults() -> None:
    # Two places declare defaults (the YAML users read, the Structs code builds): keep them equal.
    assert load_config() == Config()


def test_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  total_training_steps: 7\nglobal_profiler:\n  steps: [1, 2]\n")
    cfg = load_config(f, ["trainer.total_training_steps=9", "global_profiler.tool=torch"])
    assert cfg.trainer.total_training_steps == 9
    assert cfg.global_profiler.steps == [1, 2]
    assert cfg.global_profiler.tool == "torch"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.total_training_steps=abc", "trainer.total_training_steps"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps"),
        ("async_training.staleness_threshold=-0.5", "async_training.staleness_threshold"),
        ("global_profiler.steps=[0]", "global_profiler.steps"),
        ("global_profiler.steps=[-1]", "global_profiler.steps"),
        ("global_profiler.steps=[a]", "global_profiler.steps"),
        ("global_profiler.steps=[1.5]", "global_profiler.steps"),
        ("global_profiler.steps=[2,2]", "global_profiler.steps"),
        ("global_profiler.tool=foo", "global_profiler.tool"),
        ("global_profiler.roles=[x]", "global_profiler.roles"),
        ("trainer.bogus=1", "trainer.bogus"),
        ("bogus.key=1", "bogus"),
        ("model.n_heads=3", "model.n_heads"),
        ("task.min_digits=9", "task.min_digits"),
        ("rollout.max_new_tokens=40", "model.max_len"),
        ("rollout.rank=1", "rollout.rank"),
        ("run.id=../etc", "run.id"),
        ("no_equals_sign", "no_equals_sign"),
    ],
)
def test_bad_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


def test_profile_steps_past_the_run_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["global_profiler.tool=torch", "trainer.total_training_steps=5",
                           "global_profiler.steps=[1,6]"])
    assert info.value.key == "global_profiler.steps"


def test_bad_file_names_config(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("trainer: [1, 2]\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert info.value.key == "trainer"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.key == "--config"


def test_null_run_id_is_resolved_once() -> None:
    cfg = resolve_run_id(load_config())
    assert cfg.run.id and cfg.run.id.startswith("run-")
    assert resolve_run_id(cfg) == cfg


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("trainer.totl_training_steps=3", "trainer.totl_training_steps",
         "trainer.total_training_steps"),
        ("global_profiler.step=[1]", "global_profiler.step", "global_profiler.steps"),
        ("trainr.lr=0.1", "trainr", "trainer.lr"),
        ("bogus.key=1", "bogus", None),
    ],
)
def test_unknown_keys_suggest_the_closest_known_key(
    override: str, key: str, suggestion: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert info.value.suggestion == suggestion
    if suggestion:
        assert str(info.value).endswith(f"did you mean '{suggestion}'?")
    else:
        assert "did you mean" not in str(info.value)


def test_known_keys_are_the_dotted_leaves_of_the_config() -> None:
    keys = known_keys()
    assert "trainer.lr" in keys and "global_profiler.steps" in keys
    assert "trainer" not in keys and len(keys) == len(set(keys))
    tree = config_to_dict(Config())
    for key in keys:  # each names a leaf value of the config
        node = tree
        for part in key.split("."):
            node = node[part]
        assert not isinstance(node, dict), key
