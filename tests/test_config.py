"""Config loading: defaults, files, dotted overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runconfig import (
    Config,
    ConfigError,
    config_to_dict,
    known_keys,
    load_config,
    resolve_run_id,
    verl,
)
from tests.procs import run_cli


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
        ("global_profiler.ranks=[-1]", "global_profiler.ranks"),
        ("trainer.bogus=1", "trainer.bogus"),
        ("bogus.key=1", "bogus"),
        ("model.n_heads=3", "model.n_heads"),
        ("task.min_digits=9", "task.min_digits"),
        ("rollout.max_new_tokens=40", "model.max_len"),
        ("rollout.rank=-1", "rollout.rank"),
        ("run.id=../etc", "run.id"),
        ("no_equals_sign", "no_equals_sign"),
    ],
)
def test_bad_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


def test_profiler_ranks_may_name_rollouters_past_the_replicas() -> None:
    # rollout.replicas is what `rlbus up` starts, not a cap: rank 3 may join the running run.
    cfg = load_config(None, ["global_profiler.tool=torch", "global_profiler.steps=[1]",
                             "global_profiler.roles=[rollouter]", "global_profiler.ranks=[3]",
                             "rollout.replicas=2"])
    assert cfg.global_profiler.ranks == [3]


@pytest.mark.parametrize("tool", [["global_profiler.tool=torch"], []], ids=["torch", "off"])
def test_profile_steps_past_the_run_are_refused(tool: list[str]) -> None:
    # With profiling off too: a step the run never reaches is a mistake either way.
    with pytest.raises(ConfigError) as info:
        load_config(None, [*tool, "trainer.total_training_steps=5",
                           "global_profiler.steps=[1,6]"])
    assert info.value.key == "global_profiler.steps"
    assert "[6]" in str(info.value) and "total_training_steps=5" in str(info.value)


def test_profile_steps_without_a_tool_warn_that_profiling_is_off(tmp_path: Path) -> None:
    warnings: list[str] = []
    cfg = load_config(None, ["global_profiler.steps=[1,3]"], on_warning=warnings.append)
    assert cfg.global_profiler.tool is None
    assert len(warnings) == 1, warnings
    assert "'global_profiler.steps'" in warnings[0] and "profiling is off" in warnings[0]
    assert "global_profiler.tool" in warnings[0]
    # Nothing to say: the tool is set, or the steps are the defaults (a saved config.yaml).
    for quiet in (["global_profiler.steps=[1,3]", "global_profiler.tool=torch"],
                  ["global_profiler.steps=[1]"], []):
        warnings.clear()
        load_config(None, quiet, on_warning=warnings.append)
        assert warnings == [], (quiet, warnings)
    f = tmp_path / "c.yaml"
    f.write_text("global_profiler:\n  steps: [2]\n")
    load_config(f, on_warning=warnings.append)
    assert len(warnings) == 1 and "profiling is off" in warnings[0]


@pytest.mark.procs
def test_cli_says_profiling_is_off_and_refuses_a_late_step() -> None:
    res = run_cli("config", "--show", "global_profiler.steps", "global_profiler.steps=[1,3]")
    assert res.returncode == 0 and res.stdout == "[1, 3]\n", res.stderr
    assert res.stderr.count("\n") == 1 and "profiling is off" in res.stderr, res.stderr
    res = run_cli("config", "global_profiler.steps=[500]")
    assert res.returncode == 2 and "'global_profiler.steps'" in res.stderr, res.stderr
    assert "trainer.total_training_steps=300" in res.stderr and "Traceback" not in res.stderr


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
        # Open mappings (nsys options, kwargs passed on, a model's config overrides).
        assert not isinstance(node, dict) or key.endswith(
            ("_options", "_kwargs", "override_config", "_resources")), key


# --------------------------------------------------------------------------- YAML 1.2, Hydra


@pytest.mark.parametrize(
    ("override", "expected"),
    [("trainer.lr=1e-6", 1e-6), ("trainer.lr=1E-3", 1e-3), ("trainer.lr=.5", 0.5),
     ("trainer.lr=2", 2.0), ("trainer.lr=1.0e-6", 1e-6)],
)
def test_yaml_1_2_floats(override: str, expected: float) -> None:
    assert load_config(None, [override]).trainer.lr == expected


def test_yaml_1_2_numbers_in_files(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1e-6\n  seed: 010\nglobal_profiler:\n  global_tool_config:\n"
                 "    torch_memory:\n      trace_alloc_max_entries: 100_000\n")
    cfg = load_config(f)
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.seed == 10
    assert cfg.global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries == 100_000


def test_hydra_add_force_and_delete() -> None:
    cfg = load_config(None, ["++trainer.lr=0.5", "trainer.ppo_epochs=3"])
    assert (cfg.trainer.lr, cfg.trainer.ppo_epochs) == (0.5, 3)
    cfg = load_config(None, ["trainer.lr=0.5", "~trainer.lr", "trainer.ppo_epochs=3",
                             "~trainer.ppo_epochs=3"])
    assert (cfg.trainer.lr, cfg.trainer.ppo_epochs) == (Config().trainer.lr, 1)
    with pytest.raises(ConfigError, match="'\\+' adds a key") as info:
        load_config(None, ["+trainer.lr=0.5"])
    assert info.value.key == "trainer.lr"
    with pytest.raises(ConfigError, match="not deleted") as info:
        load_config(None, ["~trainer.ppo_epochs=7"])
    assert info.value.key == "trainer.ppo_epochs"
    with pytest.raises(ConfigError, match="unknown config key") as info:
        load_config(None, ["++trainer.no_such_key=1"])
    assert info.value.key == "trainer.no_such_key"


def test_hydra_grammar_on_mapping_options() -> None:
    nsys = "global_profiler.global_tool_config.nsys.worker_nsight_options"
    cfg = load_config(None, [f"+{nsys}.sample=cpu", f"{nsys}.trace=cuda,nvtx,osrt",
                             f"~{nsys}.kill"])
    options = cfg.global_profiler.global_tool_config.nsys.worker_nsight_options
    assert options["sample"] == "cpu" and options["trace"] == "cuda,nvtx,osrt"
    assert "kill" not in options
    with pytest.raises(ConfigError, match="add it with") as info:
        load_config(None, [f"{nsys}.sample=cpu"])
    assert info.value.key == f"{nsys}.sample"
    with pytest.raises(ConfigError, match="must be cudaProfilerApi") as info:
        load_config(None, [f"{nsys}.capture-range=nvtx"])
    assert info.value.key == f"{nsys}.capture-range"


def test_verl_specials_steps_null_and_save_freq_minus_one() -> None:
    cfg = load_config(None, ["global_profiler.tool=torch", "global_profiler.steps=null",
                             "trainer.save_freq=-1"])
    assert cfg.global_profiler.steps == []
    assert cfg.trainer.save_freq == 0  # no periodic checkpoint (the last step is still saved)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.save_freq=-2"])
    assert info.value.key == "trainer.save_freq"


@pytest.mark.parametrize("tool", ["npu", "precision_debugger", "perf"])
def test_unknown_profiler_tool_lists_the_tools(tool: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"global_profiler.tool={tool}"])
    assert info.value.key == "global_profiler.tool"
    assert "torch, torch_memory, nsys, or null" in str(info.value)


@pytest.mark.parametrize("contents", ["[cpu]", "[cuda]", "[cpu,cuda,shapes,memory,stack]"])
def test_verl_torch_contents(contents: str) -> None:
    cfg = load_config(None, [f"global_profiler.contents={contents}"])
    assert cfg.global_profiler.contents == contents.strip("[]").split(",")


# --------------------------------------------------------------------------- verl spellings

TM = "global_profiler.global_tool_config.torch_memory"
RLBUS = "run.defaults=rlbus"  # the table alone, without verl's defaults under a verl line
ARR = "actor_rollout_ref"
OB = "reward_kwargs.overlong_buffer_cfg"


@pytest.mark.parametrize(
    ("override", "attr", "expected"),
    [
        ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.ppo_mini_batch_size", 16),
        ("actor_rollout_ref.actor.ppo_epochs=2", "trainer.ppo_epochs", 2),
        ("actor_rollout_ref.actor.clip_ratio_low=0.1", "trainer.clip_ratio_low", 0.1),
        ("actor_rollout_ref.actor.clip_ratio_high=0.3", "trainer.clip_ratio_high", 0.3),
        ("actor_rollout_ref.actor.entropy_coeff=0", "trainer.entropy_coeff", 0.0),
        ("actor_rollout_ref.actor.grad_clip=0.5", "trainer.grad_clip", 0.5),
        ("actor_rollout_ref.actor.optim.clip_grad=0.5", "trainer.grad_clip", 0.5),
        ("actor_rollout_ref.actor.optim.lr=1e-6", "trainer.lr", 1e-6),
        ("actor_rollout_ref.rollout.n=16", "rollout.n", 16),
        ("actor_rollout_ref.rollout.temperature=0.7", "rollout.temperature", 0.7),
        ("actor_rollout_ref.rollout.response_length=6", "rollout.max_new_tokens", 6),
        ("data.max_response_length=6", "rollout.max_new_tokens", 6),
        ("actor_rollout_ref.model.path=/m", "model.path", "/m"),
        ("actor_rollout_ref.model.path=/m", "model.kind", "hf"),
        (f"{ARR}.actor.optim.weight_decay=0.1", "trainer.weight_decay", 0.1),
        (f"{ARR}.actor.optim.lr_warmup_steps=10", "trainer.lr_warmup_steps", 10),
        (f"{ARR}.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.lr_warmup_steps_ratio", 0.1),
        (f"{ARR}.actor.optim.lr_scheduler_type=cosine", "trainer.lr_scheduler_type", "cosine"),
        (f"{ARR}.actor.optim.warmup_style=cosine", "trainer.lr_scheduler_type", "cosine"),
        (f"{ARR}.actor.optim.warmup_style=null", "trainer.lr_scheduler_type", "constant"),
        (f"{ARR}.actor.optim.min_lr_ratio=0.1", "trainer.min_lr_ratio", 0.1),
        (f"{ARR}.actor.optim.num_cycles=1.5", "trainer.num_cycles", 1.5),
        (f"{ARR}.actor.use_kl_loss=True", "trainer.use_kl_loss", True),
        (f"{ARR}.actor.kl_loss_coef=0.01", "trainer.kl_loss_coef", 0.01),
        (f"{ARR}.actor.kl_loss_type=mse", "trainer.kl_loss_type", "mse"),
        (f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4", "trainer.micro_batch_size", 4),
        (f"{ARR}.actor.use_dynamic_bsz=True", "trainer.use_dynamic_bsz", True),
        (f"{ARR}.actor.ppo_max_token_len_per_gpu=512", "trainer.max_token_len", 512),
        (f"{ARR}.actor.checkpoint.save_contents=[model,hf_model]",
         "trainer.checkpoint_contents", ["model", "hf_model"]),
        (f"{ARR}.actor.fsdp_config.model_dtype=bf16", "model.dtype", "bf16"),
        (f"{ARR}.rollout.dtype=bfloat16", "model.dtype", "bfloat16"),
        (f"{ARR}.rollout.top_p=0.9", "rollout.top_p", 0.9),
        (f"{ARR}.rollout.top_k=20", "rollout.top_k", 20),
        (f"{ARR}.rollout.top_k=0", "rollout.top_k", -1),  # 0 is off in vLLM and HF too
        (f"{ARR}.rollout.seed=7", "rollout.seed", 7),
        (f"{ARR}.rollout.val_kwargs.n=4", "rollout.val_kwargs.n", 4),
        (f"{ARR}.rollout.val_kwargs.temperature=0.6", "rollout.val_kwargs.temperature", 0.6),
        (f"{ARR}.rollout.val_kwargs.top_p=0.7", "rollout.val_kwargs.top_p", 0.7),
        (f"{ARR}.rollout.val_kwargs.top_k=5", "rollout.val_kwargs.top_k", 5),
        (f"{ARR}.rollout.val_kwargs.do_sample=True", "rollout.val_kwargs.do_sample", True),
        (f"{ARR}.model.enable_gradient_checkpointing=True",
         "model.enable_gradient_checkpointing", True),
        (f"+{ARR}.model.override_config.max_position_embeddings=64", "model.override_config",
         {"max_position_embeddings": 64}),
        (f"{ARR}.model.override_config={{attention_dropout: 0.1}}", "model.override_config",
         {"attention_dropout": 0.1}),
        ("reward.custom_reward_function.path=/r.py", "custom_reward_function.path", "/r.py"),
        ("reward.custom_reward_function.name=score", "custom_reward_function.name", "score"),
        ("reward.reward_manager.name=dapo", "reward_model.reward_manager", "dapo"),
        ("reward.num_workers=3", "rollout.reward_workers", 3),
        ("reward_model.num_workers=3", "rollout.reward_workers", 3),
        (f"+reward.{OB}.enable=True", "reward_model.overlong_buffer.enable", True),
        (f"+reward_model.{OB}.len=4", "reward_model.overlong_buffer.len", 4),
        ("+reward.reward_kwargs.extra=1", "reward_model.reward_kwargs", {"extra": 1}),
        ("data.train_files=/d.parquet", "data.train_files", "/d.parquet"),  # rlbus's own key
        (f"{TM}.trace_alloc_max_entries=5000", f"{TM}.trace_alloc_max_entries", 5000),
        (f"{TM}.stack_depth=8", f"{TM}.stack_depth", 8),
    ],
)
def test_verl_keys_set_rlbus_keys(override: str, attr: str, expected: object,
                                  tmp_path: Path) -> None:
    # An HF model directory is read at config time (its context length): give one.
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    extra = []
    if override == "actor_rollout_ref.model.path=/m":
        override = f"actor_rollout_ref.model.path={tmp_path}"
        expected = str(tmp_path) if expected == "/m" else expected
    elif "hf_model" in override:  # an HF export needs an HF model
        extra = [f"actor_rollout_ref.model.path={tmp_path}"]
    node: object = load_config(None, [override, *extra, RLBUS], on_warning=lambda m: None)
    for part in attr.split("."):
        node = getattr(node, part)
    assert node == expected


def test_response_length_wins_over_data_max_response_length_in_any_order() -> None:
    for args in (["data.max_response_length=3", "actor_rollout_ref.rollout.response_length=6"],
                 ["actor_rollout_ref.rollout.response_length=6", "data.max_response_length=3"],
                 ["rollout.max_new_tokens=6", "data.max_response_length=3"]):
        assert load_config(None, [*args, RLBUS]).rollout.max_new_tokens == 6


def test_total_rollout_steps_give_the_number_of_steps() -> None:
    cfg = load_config(None, ["rollout.total_rollout_steps=100",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "async_training.require_batches=2", RLBUS])
    assert cfg.trainer.total_training_steps == 12  # 100 // (4 * 2), as verl's trainer stops
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.total_rollout_steps=100", "trainer.total_training_steps=5",
                           "trainer.ppo_mini_batch_size=4", "async_training.require_batches=2"])
    assert info.value.key == "rollout.total_rollout_steps"


def test_per_role_profiler_switches() -> None:
    actor = "actor_rollout_ref.actor.profiler"
    rollout = "actor_rollout_ref.rollout.profiler"
    roles = load_config(None, [f"{actor}.enable=True", RLBUS]).global_profiler.roles
    assert roles == ["trainer"]
    cfg = load_config(None, [f"{actor}.enable=True", f"{rollout}.enable=True",
                             f"{actor}.tool_config.torch.contents=[cuda,shapes]",
                             f"{rollout}.tool_config.torch.contents=[cuda,shapes]", RLBUS])
    assert cfg.global_profiler.roles == ["trainer", "rollouter"]
    assert cfg.global_profiler.contents == ["cuda", "shapes"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{actor}.tool_config.torch.contents=[cuda]",
                           f"{rollout}.tool_config.torch.contents=[cpu]", RLBUS])
    assert info.value.key.endswith("torch.contents")


def test_a_bad_value_names_the_verl_key_the_user_wrote() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.actor.optim.lr=-1", RLBUS])
    assert info.value.key == "actor_rollout_ref.actor.optim.lr"
    assert "trainer.lr" in str(info.value)


@pytest.mark.parametrize(
    ("override", "ok"),
    [("algorithm.adv_estimator=grpo", True), ("algorithm.adv_estimator=gae", False),
     ("algorithm.use_kl_in_reward=False", True), ("algorithm.use_kl_in_reward=True", False),
     ("reward_model.enable=False", True), ("reward_model.enable=True", False),
     ("reward.reward_model.enable=True", False),
     ("actor_rollout_ref.actor.optim.optimizer=AdamW", True),
     ("actor_rollout_ref.actor.optim.optimizer=SGD", False),
     ("actor_rollout_ref.rollout.do_sample=False", False)],
)
def test_verl_keys_rlbus_does_one_way(override: str, ok: bool) -> None:
    if ok:
        load_config(None, [override, RLBUS])
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, [override, RLBUS])
    assert info.value.key == override.split("=")[0]


def test_ignored_verl_keys_warn_once_each_naming_the_key(tmp_path: Path) -> None:
    f = tmp_path / "verl.yaml"
    f.write_text("trainer:\n  critic_warmup: 0\n  use_legacy_worker_impl: auto\n"
                 "actor_rollout_ref:\n  rollout:\n    free_cache_engine: true\n")
    warnings: list[str] = []
    load_config(f, ["trainer.critic_warmup=1", "+actor_rollout_ref.model.override_config.x=1",
                    "trainer.test_freq=10", "reward_model.model.path=/rm",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", RLBUS],
                on_warning=warnings.append)
    named = [w.split("'")[1] for w in warnings]
    # override_config, test_freq, the vLLM limits and the trainer's ranks mean something now
    assert sorted(named) == sorted([
        "trainer.critic_warmup", "trainer.use_legacy_worker_impl",
        "actor_rollout_ref.rollout.free_cache_engine", "reward_model.model.path",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ])


def test_verl_nested_file(tmp_path: Path) -> None:
    f = tmp_path / "verl.yaml"
    f.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n"
                 "    ppo_mini_batch_size: 2\n  rollout:\n    n: 3\n"
                 "async_training:\n  require_batches: 2\nrun:\n  defaults: rlbus\n")
    cfg = load_config(f, on_warning=lambda m: None)
    assert (cfg.trainer.lr, cfg.trainer.ppo_mini_batch_size, cfg.rollout.n) == (1e-6, 2, 3)


def test_misspelt_verl_keys_are_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.actor.ppo_mini_batchsize=4", RLBUS])
    assert info.value.key == "actor_rollout_ref.actor.ppo_mini_batchsize"
    assert info.value.suggestion == "actor_rollout_ref.actor.ppo_mini_batch_size"


def test_verl_table_is_consistent_and_documented() -> None:
    own = set(known_keys())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    for row in verl.TABLE:
        assert row.key not in own, f"{row.key} is an rlbus key: the table row is dead"
        assert f"`{row.key}`" in docs, f"docs/config.md does not list {row.key}"
        for target, _ in row.targets:
            assert target in own, f"{row.key} -> unknown rlbus key {target}"
    assert set(known_keys(verl=True)) == own | {row.key for row in verl.TABLE}


def test_a_verl_yaml_files_hydra_entries_are_skipped(tmp_path: Path) -> None:
    f = tmp_path / "verl.yaml"
    f.write_text("hydra:\n  searchpath: [pkg://verl.trainer.config]\n"
                 "defaults:\n  - ppo_trainer\n  - _self_\n"
                 "global_profiler:\n  _target_: verl.utils.profiler.ProfilerConfig\n"
                 "  tool: null\n  steps: null\nrun:\n  defaults: rlbus\n")
    warnings: list[str] = []
    cfg = load_config(f, on_warning=warnings.append)
    assert cfg.global_profiler.steps == []
    assert sorted(w.split("'")[1] for w in warnings) == ["defaults", "hydra.searchpath"]


def test_a_written_config_reads_back_unchanged(tmp_path: Path) -> None:
    # rlbus up hands its children config_to_dict(cfg) as YAML: it must load as the same config.
    nsys = "global_profiler.global_tool_config.nsys.worker_nsight_options"
    # A verl line: verl's defaults (default_local_dir interpolated) are written out as values.
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6", "global_profiler.steps=null",
                             f"~{nsys}.kill", f"+{nsys}.sample=cpu", "trainer.save_freq=-1",
                             "rollout.max_new_tokens=5"])
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    assert load_config(f) == cfg


def test_every_key_has_a_package_default() -> None:
    """runconfig/defaults.yaml lists every key of the schema (a reset to the default, and
    `rlbus config --verl-diff`, read it there)."""
    from runconfig import default_dict, known_keys

    tree = default_dict()
    missing = []
    for key in known_keys():
        node = tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    assert missing == []
