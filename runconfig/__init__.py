"""The config of a run: defaults, loading with overrides, validation (exit 2 naming the key)."""

from runconfig.load import (
    ConfigError,
    apply_override,
    config_to_dict,
    default_dict,
    known_keys,
    load_config,
    load_or_exit,
    parse_config_args,
    resolve_run_id,
    suggest_key,
)
from runconfig.schema import (
    AsyncTrainingConfig,
    Config,
    HeartbeatConfig,
    ModelConfig,
    ProfilerConfig,
    RedisConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "AsyncTrainingConfig",
    "Config",
    "ConfigError",
    "HeartbeatConfig",
    "ModelConfig",
    "ProfilerConfig",
    "RedisConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TrainerConfig",
    "apply_override",
    "config_to_dict",
    "default_dict",
    "known_keys",
    "load_config",
    "load_or_exit",
    "parse_config_args",
    "resolve_run_id",
    "suggest_key",
]
