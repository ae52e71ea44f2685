"""Typed config of a run: msgspec Structs that mirror ``defaults.yaml`` key for key.

Keys keep verl's vocabulary where the concept is the same (``async_training.*``,
``global_profiler.*``). Unknown keys are errors (``forbid_unknown_fields``), and every range
is declared next to its field, so a bad value is refused before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "AsyncTrainingConfig",
    "Config",
    "CustomRewardConfig",
    "DataConfig",
    "GlobalToolConfig",
    "HeartbeatConfig",
    "ModelConfig",
    "NsysToolConfig",
    "OverlongBufferConfig",
    "ProfilerConfig",
    "RedisConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TorchMemoryToolConfig",
    "TrainerConfig",
    "ValKwargs",
]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Step = Annotated[int, Meta(ge=1)]
Role = Literal["trainer", "rollouter"]
# verl's torch profiler contents: cpu (always recorded), cuda (CUDA activity), shapes, memory,
# stack. An empty list records CPU and CUDA activity; a list without "cuda" records no CUDA.
Content = Literal["cpu", "cuda", "shapes", "memory", "stack"]
Tool = Literal["torch", "torch_memory", "nsys"]
NsysOption = str | int | float | bool | None
# verl's trainer.logger values; the metrics logger writes tensorboard and wandb (offline),
# console is the progress lines, the others are accepted with a warning.
LoggerName = Literal[
    "console", "tensorboard", "wandb", "mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio",
    "file",
]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class RedisConfig(_Section, frozen=True):
    url: str | None = None
    binary: str | None = None
    port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    cluster: bool = False
    # About how many dead letters the run's dead-letter stream keeps (bus.keys.DLQ_MAXLEN);
    # what its cap trims is counted in rlbus:{RUN}:dlq:dropped.
    dead_letter_max: PosInt = 100_000
    give_up_s: PosFloat = 600.0  # = bus.retry.BUDGET_S (bus is not imported by the schema)


class RayPlacementConfig(_Section, frozen=True):
    """``run.ray``: where Ray places each role (rlbus.ray_launcher.ray_options)."""

    trainer_resources: dict[str, PosFloat] = msgspec.field(default_factory=dict)
    rollouter_resources: dict[str, PosFloat] = msgspec.field(default_factory=dict)
    rollouter_strategy: Literal["SPREAD", "DEFAULT"] = "SPREAD"
    placement_timeout_s: PosFloat = 300.0


class RunConfig(_Section, frozen=True):
    id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")] | None = None
    output_dir: str = "outputs"
    launcher: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    ray_connect_timeout_s: PosFloat = 60.0
    stop_grace_s: PosFloat = 10.0
    progress_interval_s: PosFloat = 10.0
    retention: Literal["checkpoint", "all"] = "checkpoint"
    # The run's record (trainer.record): every consumed sample with its verdict, as parquet
    # beside the events archive; "trained": the trained ones only; "none": not kept.
    record: Literal["all", "trained", "none"] = "all"
    # The trainer's own checkpoints (trainer.resumepoints): the streams stay bounded however
    # rarely the user checkpoints (0: off).
    resume_point_steps: NonNegInt = 100
    resume_point_mb: NonNegFloat = 1024.0
    cpu_affinity: Literal["auto", "none"] = "auto"
    defaults: Literal["auto", "verl", "rlbus"] = "auto"
    storage: str | None = None
    max_restarts: NonNegInt = 3
    ray: RayPlacementConfig = RayPlacementConfig()


# verl's dtype spellings (fsdp_config.model_dtype / rollout.dtype) and torch's.
DType = Literal["fp32", "float32", "bf16", "bfloat16"]
# verl's kl_loss_type values (core_algos.kl_penalty): k1 = kl, k2 = mse, k3 = low_var_kl.
KlLossType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
Truncation = Literal["error", "left", "right", "middle"]
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]


class ModelConfig(_Section, frozen=True):
    kind: Literal["tiny", "hf"] = "tiny"
    path: str | None = None
    dtype: DType = "fp32"
    override_config: dict[str, Any] = msgspec.field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    d_model: PosInt = 64
    n_layers: PosInt = 2
    n_heads: PosInt = 4
    max_len: PosInt = 32
    seed: int = 0


class TaskConfig(_Section, frozen=True):
    kind: Literal["digits", "jsonl"] = "digits"
    path: str | None = None
    min_digits: PosInt = 4
    max_digits: PosInt = 4
    reward_fn: str | None = None
    seed: int = 0


class CustomClsConfig(_Section, frozen=True):
    """verl's ``data.custom_cls``: the class that makes the records (tasks.dataset_class)."""

    path: str | None = None
    name: str | None = None


class DataConfig(_Section, frozen=True):
    """verl's ``data`` section (verl-format parquet or JSONL records)."""

    train_files: str | list[str] | None = None
    val_files: str | list[str] | None = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: PosInt = 512
    truncation: Truncation = "error"
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int = 1
    train_max_samples: int = -1
    val_max_samples: int = -1
    epoch_batch_size: NonNegInt = 0
    custom_cls: CustomClsConfig = CustomClsConfig()
    apply_chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class CustomRewardConfig(_Section, frozen=True):
    """verl's ``custom_reward_function``: a file and the function in it."""

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class OverlongBufferConfig(_Section, frozen=True):
    """verl's DAPO ``overlong_buffer``: a length penalty in the last ``len`` tokens."""

    enable: bool = False
    len: NonNegInt = 0
    penalty_factor: NonNegFloat = 0.0
    log: bool = False


class RewardModelConfig(_Section, frozen=True):
    """verl's ``reward_model`` section, its rule-based part (no reward model)."""

    reward_manager: Literal["naive", "dapo"] = "naive"
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    reward_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class RewardConfig(_Section, frozen=True):
    """What a run does with rewards that fail or are absurd. ``reward`` is verl's section
    name (its newer reward settings, read through runconfig.verl's table); these keys are
    rlbus's own: verl has no such settings. It stops at the first reward function error, as
    ``max_failure_ratio`` 0 does here, and trains whatever finite or infinite reward it is
    given, where ``bounds`` refuses a group with a reward outside them (or NaN/inf)."""

    max_failure_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.0
    bounds: tuple[float, float] = (-1e6, 1e6)


class TrainerConfig(_Section, frozen=True):
    total_training_steps: PosInt = 300
    total_epochs: PosInt | None = None
    ppo_mini_batch_size: PosInt = 8
    ppo_epochs: PosInt = 1
    save_freq: NonNegInt = 100
    max_actor_ckpt_to_keep: PosInt | None = None
    rollout_data_dir: str | None = None  # verl's: each step's trained generations as JSONL
    validation_data_dir: str | None = None  # verl's: each validation's answers as JSONL
    lr: PosFloat = 1e-3
    clip_ratio_low: NonNegFloat = 0.2
    clip_ratio_high: NonNegFloat = 0.28
    clip_ratio_c: Annotated[float, Meta(gt=1)] | None = 3.0  # verl's dual-clip bound
    grad_clip: PosFloat = 1.0
    entropy_coeff: NonNegFloat = 0.01
    tis_cap: PosFloat | None = 2.0
    rollout_rs: str | None = None  # verl's rejection sampling options (runconfig.rejection)
    rollout_rs_threshold: str | float | None = None
    kl_guard: PosFloat | None = None
    weight_decay: NonNegFloat = 0.0
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.0
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.0
    num_cycles: float = 0.5
    use_kl_loss: bool = False
    kl_loss_coef: NonNegFloat = 0.001
    kl_loss_type: KlLossType = "low_var_kl"
    micro_batch_size: PosInt | None = None
    use_dynamic_bsz: bool = False
    max_token_len: PosInt = 16384
    zero_adv: Literal["skip", "keep", "no_entropy", "drop"] = "skip"
    device: str = "auto"
    threads: PosInt = 1
    seed: int = 0
    logger: LoggerName | list[LoggerName] = msgspec.field(
        default_factory=lambda: ["console", "tensorboard"]
    )
    project_name: str = "rlbus"
    experiment_name: str | None = None
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False  # verl's: validate the weights the run starts from, train nothing
    log_val_generations: NonNegInt = 0
    default_local_dir: str | None = None
    resume_mode: Literal["auto", "disable"] = "auto"
    checkpoint_contents: list[CheckpointContent] = msgspec.field(
        default_factory=lambda: ["model", "optimizer", "extra"]
    )
    # Data-parallel ranks (docs/training.md, "Trainer ranks"): nnodes x n_gpus_per_node
    # processes in one torch.distributed group (CPU ranks on a machine without GPUs); rank 0
    # is the trainer that owns the lease and writes to the bus.
    nnodes: PosInt = 1
    n_gpus_per_node: PosInt = 1
    node_rank: NonNegInt = 0
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    strategy: Literal["fsdp", "fsdp2", "ddp"] = "fsdp"
    fsdp_reshard_after_forward: bool = True
    fsdp_offload_policy: bool = False
    # The trainer's compute dtype (verl's fsdp_config.mixed_precision.param_dtype): auto
    # follows model.dtype; FSDP2 all-gathers parameters in it (MixedPrecisionPolicy), one
    # rank and ddp compute in it under autocast. Master weights stay float32.
    fsdp_param_dtype: Literal["auto", "fp32", "float32", "bf16", "bfloat16"] = "auto"
    # The dtype gradients are summed across ranks in (mixed_precision.reduce_dtype).
    fsdp_reduce_dtype: DType = "fp32"
    dist_timeout_s: PosFloat = 600.0
    checkpoint_format: Literal["auto", "full", "dcp"] = "auto"
    # A resume whose rebuilt model does not hash to the weights it had published: fail
    # stops the trainer before it publishes anything; warn goes on (trainer.resume).
    resume_weights_mismatch: Literal["fail", "warn"] = "fail"
    balance_batch: bool = True  # split a mini-batch over the ranks by tokens (trainer.rowsplit)


class ValKwargs(_Section, frozen=True):
    """verl's ``rollout.val_kwargs``: sampling for validation."""

    n: PosInt = 1
    temperature: NonNegFloat = 0.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: int = -1
    do_sample: bool = False


class MultiTurnConfig(_Section, frozen=True):
    """verl's ``rollout.multi_turn``: conversations with tools (docs/agents.md), verl's
    defaults; ``tool_timeout_s`` and ``tool_threads`` are rlbus's (a call's bound, and the
    threads the tools run on, off the event loop and the engine's thread)."""

    enable: bool = False
    max_assistant_turns: PosInt | None = None
    max_user_turns: PosInt | None = None
    max_parallel_calls: PosInt = 1
    max_tool_response_length: PosInt = 256
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_config_path: str | None = None
    function_tool_path: str | None = None
    format: Literal["hermes"] = "hermes"
    tool_timeout_s: PosFloat = 60.0
    tool_threads: PosInt = 4


class AgentLoopConfig(_Section, frozen=True):
    """verl's ``rollout.agent``: the agent loop of a record without ``agent_name``."""

    default_agent_loop: Literal["single_turn_agent", "tool_agent"] = "single_turn_agent"


class RolloutConfig(_Section, frozen=True):
    n: PosInt = 8
    replicas: PosInt = 1
    # Elastic replicas (docs/operations.md): null = the lowest rank no live rollouter
    # holds, claimed on the bus at join; replicas = how many `rlbus up` starts, not a cap.
    rank: NonNegInt | None = None
    temperature: PosFloat = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: int = -1
    max_new_tokens: PosInt = 5
    prompts_per_batch: PosInt = 8
    partial_chunk_tokens: PosInt = 2
    device: str = "auto"
    threads: PosInt = 1
    seed: int = 0
    reward_workers: PosInt = 1
    reward_timeout_s: PosFloat = 30.0
    val_kwargs: ValKwargs = ValKwargs()
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    agent: AgentLoopConfig = AgentLoopConfig()
    # Weight sync (docs/architecture.md, "Weight sync"): the dtype published, where the chunks
    # go (auto: Redis up to 64 MiB, the run's storage above; collective: broadcast), how long
    # a rollouter keeps trying to read a publication before it fails (WeightsUnreachable),
    # and the address rollouters reach the trainer's broadcasts at.
    weights_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    weights_transport: Literal["auto", "redis", "storage", "collective"] = "auto"
    weights_fetch_timeout_s: PosFloat = 60.0
    # The engine's start-up (weights load, vLLM's profiling and CUDA graph capture): the
    # rollouter claims no ticket before it ends, and exits 1 past this bound.
    engine_start_timeout_s: PosFloat = 1800.0
    weights_collective_host: str = ""
    # The engine (docs/engines.md): hf = the built-in decode loop, vllm = vLLM in the
    # rollouter's process. The vLLM limits are verl's keys with verl's defaults, except
    # tensor_model_parallel_size (verl: 2; here 1, which every machine has; docs/config.md).
    name: Literal["hf", "vllm"] = "hf"
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.5
    max_num_seqs: PosInt = 256
    max_num_batched_tokens: PosInt = 8192
    max_model_len: PosInt | None = None
    enforce_eager: bool = False
    tensor_model_parallel_size: PosInt = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True


class AsyncTrainingConfig(_Section, frozen=True):
    staleness_threshold: NonNegFloat = 0.5
    trigger_parameter_sync_step: PosInt = 1
    require_batches: PosInt = 4
    partial_rollout: bool = False


class HeartbeatConfig(_Section, frozen=True):
    interval_s: PosFloat = 1.0
    timeout_s: PosFloat = 30.0
    ticket_lease_s: PosFloat | None = None
    stall_warn_s: PosFloat = 60.0
    stall_timeout_s: PosFloat = 1800.0


class TorchMemoryToolConfig(_Section, frozen=True):
    """verl's ``global_tool_config.torch_memory``: CUDA allocator history for snapshots."""

    trace_alloc_max_entries: PosInt = 100_000
    stack_depth: PosInt = 32
    context: Literal["alloc", "state", "all"] | None = "all"
    stacks: Literal["python", "all"] = "all"


def _nsight_options() -> dict[str, NsysOption]:
    return {
        "trace": "cuda,nvtx",
        "cuda-memory-usage": "true",
        "capture-range": "cudaProfilerApi",
        "capture-range-end": "repeat",
        "kill": "none",
    }


class NsysToolConfig(_Section, frozen=True):
    """verl's ``global_tool_config.nsys``, for processes that rlbus opens capture ranges in."""

    discrete: bool = False
    worker_nsight_options: dict[str, NsysOption] = msgspec.field(default_factory=_nsight_options)


class GlobalToolConfig(_Section, frozen=True):
    torch_memory: TorchMemoryToolConfig = TorchMemoryToolConfig()
    nsys: NsysToolConfig = NsysToolConfig()


class ProfilerConfig(_Section, frozen=True):
    tool: Tool | None = None
    steps: list[Step] = msgspec.field(default_factory=lambda: [1])
    profile_continuous_steps: bool = False
    save_path: str | None = None
    roles: list[Role] = msgspec.field(default_factory=lambda: ["trainer", "rollouter"])
    ranks: list[NonNegInt] = msgspec.field(default_factory=list)
    contents: list[Content] = msgspec.field(default_factory=list)
    handshake_timeout_s: PosFloat = 20.0
    finish_hook_cmd: str | None = None
    global_tool_config: GlobalToolConfig = GlobalToolConfig()


class Config(_Section, frozen=True):
    """The whole config of a run (see ``runconfig/defaults.yaml`` for the meaning of each key)."""

    redis: RedisConfig = RedisConfig()
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    custom_reward_function: CustomRewardConfig = CustomRewardConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    rollout: RolloutConfig = RolloutConfig()
    async_training: AsyncTrainingConfig = AsyncTrainingConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    global_profiler: ProfilerConfig = ProfilerConfig()
