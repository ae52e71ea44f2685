"""Paths made absolute before a Ray submission (rlbus.abspaths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.abspaths import PATH_KEYS, absolute_paths
from runconfig import load_config


def test_relative_paths_become_absolute_against_the_submitting_dir() -> None:
    cfg = load_config(None, [
        "run.output_dir=out", "model.path=models/m", "data.train_files=[a.parquet,/d/b.parquet]",
        "data.val_files=v.parquet", "custom_reward_function.path=r.py",
        "trainer.default_local_dir=~/ckpt", "global_profiler.save_path=/abs/prof",
        "redis.binary=bin/redis-server", "task.path=t.jsonl",
    ], on_warning=lambda _m: None)
    out = absolute_paths(cfg, Path("/work/here"))
    assert out.run.output_dir == "/work/here/out"
    assert out.model.path == "/work/here/models/m"
    assert out.task.path == "/work/here/t.jsonl"
    assert out.data.train_files == ["/work/here/a.parquet", "/d/b.parquet"]
    assert out.data.val_files == "/work/here/v.parquet"
    assert out.custom_reward_function.path == "/work/here/r.py"
    assert out.trainer.default_local_dir == str(Path("~/ckpt").expanduser())
    assert out.global_profiler.save_path == "/abs/prof"
    assert out.redis.binary == "/work/here/bin/redis-server"
    # the input is not changed (frozen structs, a new config)
    assert cfg.run.output_dir == "out"


def test_nulls_and_bare_binary_names_are_kept() -> None:
    cfg = load_config(None, ["redis.binary=redis-server"], on_warning=lambda _m: None)
    out = absolute_paths(cfg, Path("/w"))
    assert out.redis.binary == "redis-server"
    assert out.model.path is None and out.data.train_files is None
    assert out.run.output_dir == "/w/outputs"


@pytest.mark.parametrize("key", PATH_KEYS)
def test_every_path_key_names_a_config_field(key: str) -> None:
    cfg = load_config(None, [], on_warning=lambda _m: None)
    *sections, field = key.split(".")
    for name in sections:
        cfg = getattr(cfg, name)
    assert hasattr(cfg, field)


def test_nested_path_keys_become_absolute() -> None:
    cfg = load_config(None, ["rollout.multi_turn.tool_config_path=tools.yaml"],
                      on_warning=lambda _m: None)
    out = absolute_paths(cfg, Path("/work/here"))
    assert out.rollout.multi_turn.tool_config_path == "/work/here/tools.yaml"
    assert out.rollout.multi_turn.function_tool_path is None


def test_storage_paths_become_absolute_and_urls_are_kept() -> None:
    cwd = Path("/work/here")
    local = load_config(None, ["run.storage=shared/runs"], on_warning=lambda _m: None)
    assert absolute_paths(local, cwd).run.storage == "/work/here/shared/runs"
    remote = load_config(None, ["run.storage=s3://bucket/runs"], on_warning=lambda _m: None)
    assert absolute_paths(remote, cwd).run.storage == "s3://bucket/runs"
