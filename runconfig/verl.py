"""verl's spellings: the table of verl config keys rlbus accepts, and what each one does here.

A verl user's launch line (``python -m verl.experimental.fully_async_policy.fully_async_main
KEY=VALUE ...``) runs as ``rlbus up KEY=VALUE ...``. Each verl key is one of:

``alias``
    Same meaning, same unit as an rlbus key: the value is set on ``target``
    (``actor_rollout_ref.actor.optim.lr`` -> ``trainer.lr``). Some set a second key too
    (``actor_rollout_ref.model.path`` also selects ``model.kind=hf``). A subtree alias
    (``actor_rollout_ref.model.override_config.*``) sets one option of an rlbus mapping.
``derived``
    Computed after every key is read, from the final values (``rollout.total_rollout_steps``
    -> ``trainer.total_training_steps``); :func:`derive` does it.
``fixed``
    Describes something rlbus does one way only: accepted when the value is that way
    (``algorithm.adv_estimator=grpo``), refused (exit 2, saying why) otherwise.
``ignored``
    Infrastructure or features with no meaning here (``trainer.nnodes``,
    ``actor_rollout_ref.rollout.gpu_memory_utilization``): accepted, with one warning naming
    the key. A key ending in ``.*`` covers a whole subtree.

rlbus's own keys always win: a key in :func:`runconfig.known_keys` is never looked up here.
The table is documented, row for row, in docs/config.md. Sections whose names are verl's
(``data``, ``custom_reward_function``, ``reward_model``, ``trainer``, ``async_training``,
``global_profiler``) are rlbus's own; the rows here cover the rest of them. ``reward`` stays
verl's (its rows are here) beside the one key rlbus has there, ``reward.max_failure_ratio``.

A line with a key in a section only verl has (``runconfig.verl_heads()``) is a verl line and
gets verl's defaults (``runconfig/verl_defaults.yaml``; see :func:`runconfig.load_config`).
:func:`counterpart` names the verl key of an rlbus key, for ``rlbus config --verl-diff``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import msgspec

__all__ = [
    "DERIVED_KEYS",
    "SHARED",
    "SKIP",
    "TABLE",
    "VerlError",
    "VerlKey",
    "counterpart",
    "derive",
    "lookup",
    "verl_keys",
]

Kind = Literal["alias", "derived", "fixed", "ignored"]
VALUE = object()
"""In ``VerlKey.targets``: the value the user gave (after ``convert``)."""
SKIP = object()
"""Returned by a ``convert``: the key sets nothing (verl's null meaning "not set")."""


class VerlError(ValueError):
    """A verl key whose value rlbus cannot honour; ``key`` is the user's (verl) key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class VerlKey(msgspec.Struct, frozen=True):
    """One row: verl's dotted ``key`` (``prefix.*`` for a subtree) and what it does here."""

    key: str
    kind: Kind
    targets: tuple[tuple[str, Any], ...] = ()  # alias: (rlbus key, VALUE or a constant)
    values: tuple[Any, ...] = ()  # fixed: the values accepted
    note: str = ""  # how it maps, or why it is ignored / fixed (messages and docs)
    convert: Callable[[str, Any], Any] | None = None  # alias: value -> rlbus value
    plus: bool = False  # alias: verl's config lacks the key, so verl lines write +KEY=V


def _alias(key: str, target: str, note: str = "", **kw: Any) -> VerlKey:
    return VerlKey(key, "alias", targets=((target, VALUE),), note=note, **kw)


def _ignored(key: str, note: str) -> VerlKey:
    return VerlKey(key, "ignored", note=note)


def _fixed(key: str, values: tuple[Any, ...], note: str) -> VerlKey:
    return VerlKey(key, "fixed", values=values, note=note)


def _warmup_style(key: str, value: Any) -> Any:
    """verl's deprecated ``warmup_style``: null leaves ``lr_scheduler_type`` as it is."""
    return SKIP if value is None else value


def _top_k(key: str, value: Any) -> Any:
    """vLLM and Hugging Face read top_k 0 as off, as -1."""
    return -1 if value == 0 and not isinstance(value, bool) else value


_INFRA = "infrastructure rlbus does not have (one process per role, placed by rlbus up)"
_VLLM = "a vLLM engine limit (rollout.name=vllm; the built-in engine has none)"
_CKPT = "rlbus checkpoints to trainer.default_local_dir (trainer.checkpoint_contents)"
_OPTIM = "rlbus's optimiser is torch.optim.AdamW with verl's schedule keys"
_PROF_ROLE = "rlbus profiles the roles of global_profiler.roles and ranks global_profiler.ranks"
_NO_RM = "no model reward: rewards are rule-based (custom_reward_function, built-in scorers)"
_REF = ("the reference policy is a frozen copy of the initial weights in the trainer "
        "(trainer.use_kl_loss); it has no settings of its own")
_MM = "rlbus reads text prompts only (no images, videos or audio)"
_OB = "overlong_buffer_cfg"
_TOOLS_IN_PROMPT = "conversations' prompts are rendered with the tools of rollout.multi_turn"

TABLE: tuple[VerlKey, ...] = (
    # ---- the actor: PPO/GRPO update
    _alias("actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.ppo_mini_batch_size",
           "prompts per mini-batch in both (each with rollout.n responses); a step is "
           "async_training.require_batches mini-batches in both"),
    _alias("actor_rollout_ref.actor.ppo_epochs", "trainer.ppo_epochs"),
    _alias("actor_rollout_ref.actor.clip_ratio_low", "trainer.clip_ratio_low"),
    _alias("actor_rollout_ref.actor.clip_ratio_high", "trainer.clip_ratio_high"),
    _alias("actor_rollout_ref.actor.clip_ratio_c", "trainer.clip_ratio_c"),
    _alias("actor_rollout_ref.actor.entropy_coeff", "trainer.entropy_coeff"),
    _alias("actor_rollout_ref.actor.grad_clip", "trainer.grad_clip"),
    _alias("actor_rollout_ref.actor.optim.clip_grad", "trainer.grad_clip"),
    _alias("actor_rollout_ref.actor.optim.lr", "trainer.lr"),
    _alias("actor_rollout_ref.actor.optim.weight_decay", "trainer.weight_decay",
           "AdamW's decoupled weight decay"),
    _alias("actor_rollout_ref.actor.optim.lr_warmup_steps", "trainer.lr_warmup_steps",
           "linear warm-up steps; -1: lr_warmup_steps_ratio x total_training_steps"),
    _alias("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
           "trainer.lr_warmup_steps_ratio"),
    _alias("actor_rollout_ref.actor.optim.lr_scheduler_type", "trainer.lr_scheduler_type",
           "constant or cosine after the warm-up"),
    _alias("actor_rollout_ref.actor.optim.warmup_style", "trainer.lr_scheduler_type",
           "verl's older name of lr_scheduler_type; null leaves it as it is",
           convert=_warmup_style),
    _alias("actor_rollout_ref.actor.optim.lr_decay_style", "trainer.lr_scheduler_type",
           "verl's Megatron name of lr_scheduler_type (constant or cosine here)"),
    _alias("actor_rollout_ref.actor.optim.min_lr_ratio", "trainer.min_lr_ratio"),
    _alias("actor_rollout_ref.actor.optim.num_cycles", "trainer.num_cycles"),
    _ignored("actor_rollout_ref.actor.optim.lr_decay_steps",
             "the decay spans the run after the warm-up (verl's default, null)"),
    _alias("actor_rollout_ref.actor.use_kl_loss", "trainer.use_kl_loss",
           "KL to the frozen initial policy in the loss"),
    _alias("actor_rollout_ref.actor.kl_loss_coef", "trainer.kl_loss_coef"),
    _alias("actor_rollout_ref.actor.kl_loss_type", "trainer.kl_loss_type"),
    _alias("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size",
           "responses per forward/backward (gradient accumulation); one trainer process"),
    _alias("actor_rollout_ref.actor.ppo_micro_batch_size", "trainer.micro_batch_size",
           "verl's global micro-batch; one trainer process, so the same as per GPU"),
    _alias("actor_rollout_ref.actor.use_dynamic_bsz", "trainer.use_dynamic_bsz"),
    _alias("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "trainer.max_token_len",
           "use_dynamic_bsz: most tokens per micro-batch"),
    _alias("actor_rollout_ref.actor.checkpoint.save_contents", "trainer.checkpoint_contents",
           "model, optimizer, extra, hf_model"),
    _ignored("actor_rollout_ref.actor.clip_ratio",
             "verl uses it only where clip_ratio_low/high are null; set those"),
    _fixed("actor_rollout_ref.actor.loss_agg_mode", ("token-mean",),
           "rlbus averages the loss over every token of a mini-batch (verl's token-mean)"),
    _fixed("actor_rollout_ref.actor.policy_loss.loss_mode", ("vanilla",),
           "rlbus's loss is the clipped PPO surrogate (verl's vanilla)"),
    _ignored("actor_rollout_ref.actor.policy_loss.*", "loss_mode vanilla takes no options"),
    _fixed("actor_rollout_ref.actor.optim.optimizer", ("AdamW",), _OPTIM),
    _fixed("actor_rollout_ref.actor.optim.betas", ([0.9, 0.999],), _OPTIM),
    _ignored("actor_rollout_ref.actor.optim.total_training_steps",
             "set by verl itself; the run length is trainer.total_training_steps"),
    _ignored("actor_rollout_ref.actor.optim.optimizer_impl", _INFRA),
    _ignored("actor_rollout_ref.actor.optim.override_optimizer_config", _INFRA),
    _ignored("actor_rollout_ref.actor.optim.override_optimizer_config.*", _INFRA),
    _ignored("actor_rollout_ref.actor.optim.zero_indexed_step", _INFRA),
    _ignored("actor_rollout_ref.actor.use_rollout_log_probs",
             "rlbus trains on the rollout's log-probs; see trainer.tis_cap"),
    _alias("actor_rollout_ref.actor.strategy", "trainer.strategy",
           "fsdp and fsdp2 both shard with FSDP2 (fully_shard); ddp replicates"),
    _alias("actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
           "trainer.fsdp_reshard_after_forward"),
    _alias("actor_rollout_ref.actor.fsdp_config.offload_policy", "trainer.fsdp_offload_policy",
           "FSDP2's CPUOffloadPolicy (GPU ranks)"),
    _alias("actor_rollout_ref.nccl_timeout", "trainer.dist_timeout_s",
           "seconds a rank waits in one collective"),
    _alias("actor_rollout_ref.actor.fsdp_config.model_dtype", "model.dtype",
           "the weights' dtype (fp32 or bf16); one dtype for trainer and rollouter"),
    _alias("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
           "trainer.fsdp_param_dtype", "the dtype the trainer computes and FSDP2 gathers in"),
    _alias("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype",
           "trainer.fsdp_reduce_dtype", "the dtype gradients are summed across ranks in"),
    _ignored("actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype",
             "FSDP2 has no buffer dtype (verl's fsdp2 path does not pass it either): buffers "
             "keep the model's dtype"),
    _ignored("actor_rollout_ref.actor.fsdp_config.*", _INFRA),
    _ignored("actor_rollout_ref.actor.megatron.*", _INFRA),
    _ignored("actor_rollout_ref.actor.checkpoint.*", _CKPT),
    _ignored("actor_rollout_ref.actor.ulysses_sequence_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.actor.use_torch_compile", _INFRA),
    _ignored("actor_rollout_ref.actor.use_fused_kernels", _INFRA),
    _ignored("actor_rollout_ref.actor.entropy_from_logits_with_chunking", _INFRA),
    _ignored("actor_rollout_ref.actor.entropy_checkpointing", _INFRA),
    _ignored("actor_rollout_ref.actor.shuffle", "rlbus trains a step's mini-batches in order"),
    _ignored("actor_rollout_ref.actor.data_loader_seed", "see trainer.seed"),
    # ---- the rollout: sampling
    _alias("actor_rollout_ref.rollout.n", "rollout.n"),
    _alias("actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    _alias("actor_rollout_ref.rollout.response_length", "rollout.max_new_tokens",
           "the longest response, in tokens"),
    _alias("actor_rollout_ref.rollout.top_p", "rollout.top_p", "nucleus sampling; 1: off"),
    _alias("actor_rollout_ref.rollout.top_k", "rollout.top_k", "top-k sampling; -1 (or 0): off",
           convert=_top_k),
    *(
        _alias(f"actor_rollout_ref.rollout.val_kwargs.{leaf}", f"rollout.val_kwargs.{leaf}",
               "sampling for validation", **({"convert": _top_k} if leaf == "top_k" else {}))
        for leaf in ("n", "temperature", "top_p", "top_k", "do_sample")
    ),
    _alias("actor_rollout_ref.rollout.dtype", "model.dtype",
           "one dtype for trainer and rollouter (verl's rollout default bf16, actor fp32)"),
    _fixed("actor_rollout_ref.rollout.do_sample", (True,), "rlbus samples"),
    _fixed("actor_rollout_ref.rollout.calculate_log_probs", (True,),
           "a rollouter always returns the sampling log-probs"),
    _ignored("actor_rollout_ref.rollout.prompt_length",
             "prompts are cut to data.max_prompt_length (verl's default for this key)"),
    _alias("actor_rollout_ref.rollout.name", "rollout.name",
           "the engine: hf (the built-in decode loop) or vllm"),
    _ignored("actor_rollout_ref.rollout.mode", _INFRA),
    _alias("actor_rollout_ref.rollout.seed", "rollout.seed", "the sampling seed"),
    *(
        _alias(f"actor_rollout_ref.rollout.{leaf}", f"rollout.{leaf}", _VLLM)
        for leaf in ("gpu_memory_utilization", "tensor_model_parallel_size", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "enforce_eager",
                     "enable_chunked_prefill", "enable_prefix_caching")
    ),
    _ignored("actor_rollout_ref.rollout.standalone_gpu_memory_utilization", _INFRA),
    _ignored("actor_rollout_ref.rollout.data_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.expert_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.pipeline_model_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.free_cache_engine", _INFRA),
    _ignored("actor_rollout_ref.rollout.load_format", _INFRA),
    _ignored("actor_rollout_ref.rollout.disable_log_stats", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_micro_batch_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", _INFRA),
    _ignored("actor_rollout_ref.rollout.ignore_eos", "responses end at EOS"),
    _ignored("actor_rollout_ref.rollout.engine_kwargs.*", _INFRA),
    _ignored("actor_rollout_ref.rollout.checkpoint_engine.*", _INFRA),
    _ignored("actor_rollout_ref.rollout.prometheus.*", _INFRA),
    _alias("actor_rollout_ref.rollout.agent.default_agent_loop",
           "rollout.agent.default_agent_loop",
           "single_turn_agent or tool_agent, for records without agent_name"),
    _fixed("actor_rollout_ref.rollout.agent.agent_loop_config_path", (None,),
           "rlbus's agent loops are single_turn_agent and tool_agent; a custom loop class "
           "is not run"),
    _ignored("actor_rollout_ref.rollout.agent.*", _INFRA),
    *(
        _alias(f"actor_rollout_ref.rollout.multi_turn.{leaf}", f"rollout.multi_turn.{leaf}",
               "conversations with tools (docs/agents.md)")
        for leaf in ("enable", "max_assistant_turns", "max_user_turns", "max_parallel_calls",
                     "max_tool_response_length", "tool_response_truncate_side",
                     "tool_config_path", "function_tool_path", "format")
    ),
    _fixed("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", (False,),
           "a conversation trains on the tokens generated, as verl's default"),
    _fixed("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", (None,),
           "each response is one conversation"),
    _ignored("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
             "tool turns are rendered once, never re-tokenized"),
    _ignored("actor_rollout_ref.rollout.multi_turn.*", _INFRA),
    _ignored("actor_rollout_ref.rollout.trace.*", _INFRA),
    # ---- the model, the reference policy, the hybrid engine
    VerlKey("actor_rollout_ref.model.path", "alias",
            targets=(("model.path", VALUE), ("model.kind", "hf")),
            note="a local Hugging Face model directory (model.kind=hf); rlbus never downloads"),
    _alias("actor_rollout_ref.model.enable_gradient_checkpointing",
           "model.enable_gradient_checkpointing"),
    _alias("actor_rollout_ref.model.override_config", "model.override_config",
           "keys set on the model's config before loading"),
    VerlKey("actor_rollout_ref.model.override_config.*", "alias",
            targets=(("model.override_config", VALUE),),
            note="one key of model.override_config (+KEY=V adds it, as in verl)"),
    _ignored("actor_rollout_ref.model.use_remove_padding", _INFRA),
    _ignored("actor_rollout_ref.model.enable_activation_offload", _INFRA),
    _ignored("actor_rollout_ref.model.use_fused_kernels", _INFRA),
    _ignored("actor_rollout_ref.model.use_shm", _INFRA),
    _ignored("actor_rollout_ref.model.trust_remote_code", _INFRA),
    _ignored("actor_rollout_ref.model.external_lib", _INFRA),
    _ignored("actor_rollout_ref.model.mtp.*", "rlbus has no multi-token prediction"),
    _fixed("actor_rollout_ref.model.lora_rank", (0,),
           "rlbus trains every weight of the model (no LoRA adapters): the job would train "
           "the full model instead"),
    _ignored("actor_rollout_ref.model.lora_alpha", "only with lora_rank > 0 (refused)"),
    _ignored("actor_rollout_ref.model.target_modules", "only with lora_rank > 0 (refused)"),
    _ignored("actor_rollout_ref.model.exclude_modules", "only with lora_rank > 0 (refused)"),
    _ignored("actor_rollout_ref.ref.*", _REF),
    _ignored("actor_rollout_ref.hybrid_engine", _INFRA),
    # ---- per-role profiler switches (verl's profiler of each worker role)
    VerlKey("actor_rollout_ref.actor.profiler.enable", "derived",
            note="global_profiler.roles gets trainer when true (verl's default: false)"),
    VerlKey("actor_rollout_ref.rollout.profiler.enable", "derived",
            note="global_profiler.roles gets rollouter when true (verl's default: false)"),
    VerlKey("actor_rollout_ref.actor.profiler.tool_config.torch.contents", "derived",
            note="global_profiler.contents (one list for every role)"),
    VerlKey("actor_rollout_ref.rollout.profiler.tool_config.torch.contents", "derived",
            note="global_profiler.contents (one list for every role)"),
    *(
        _ignored(f"actor_rollout_ref.{role}.profiler.{leaf}", _PROF_ROLE)
        for role in ("actor", "rollout")
        for leaf in ("all_ranks", "ranks", "tool", "save_path", "discrete", "tool_config.*")
    ),
    # ---- data (the section is rlbus's own: verl's names; these are the rest)
    VerlKey("data.max_response_length", "derived",
            note="rollout.max_new_tokens, unless actor_rollout_ref.rollout.response_length "
                 "or rollout.max_new_tokens is given (verl's interpolation)"),
    _ignored("data.val_batch_size", "validation generates every data.val_files record"),
    _ignored("data.validation_shuffle", "validation reads data.val_files in order"),
    _ignored("data.filter_overlong_prompts_workers", _INFRA),
    VerlKey("data.train_batch_size", "derived",
            note="a classic line (no async_training.* keys, no rollout.total_rollout_steps): "
                 "prompts per step, async_training.require_batches = train_batch_size / "
                 "ppo_mini_batch_size, on-policy (trigger_parameter_sync_step 1, "
                 "staleness_threshold 0), each epoch ending with its last whole batch "
                 "(data.epoch_batch_size, verl's drop_last), and with data.train_files the "
                 "steps are (records // train_batch_size) x total_epochs unless "
                 "trainer.total_training_steps is given; a fully-async line: not used (a step "
                 "takes ppo_mini_batch_size x require_batches prompts, as in verl)"),
    _ignored("data.gen_batch_size", "see rollout.prompts_per_batch"),
    _ignored("data.return_raw_chat", "rlbus applies the chat template itself"),
    _ignored("data.return_full_prompt", "rlbus applies the chat template itself"),
    _ignored("data.return_raw_input_ids", "rlbus applies the chat template itself"),
    _ignored("data.dataloader_num_workers", _INFRA),
    _ignored("data.use_shm", _INFRA),
    _ignored("data.trust_remote_code", _INFRA),
    _ignored("data.tokenizer", "the tokenizer is model.path's"),
    _ignored("data.tool_config_path", _TOOLS_IN_PROMPT),
    _ignored("data.function_tool_path", _TOOLS_IN_PROMPT),
    _ignored("data.image_key", _MM),
    _ignored("data.video_key", _MM),
    _ignored("data.audio_key", _MM),
    _ignored("data.image_patch_size", _MM),
    _ignored("data.return_multi_modal_inputs", _MM),
    _ignored("data.mm_processor_kwargs.*", _MM),
    # ---- rewards: verl's reward section (newer name of custom_reward_function/reward_model)
    _alias("reward.custom_reward_function.path", "custom_reward_function.path"),
    _alias("reward.custom_reward_function.name", "custom_reward_function.name"),
    _alias("reward.reward_manager.name", "reward_model.reward_manager", "naive or dapo"),
    _fixed("reward.reward_manager.source", ("register",),
           "rlbus has the reward managers naive and dapo, chosen by name"),
    _ignored("reward.reward_manager.module.*", "rlbus has no custom reward manager class"),
    _alias("reward.num_workers", "rollout.reward_workers", "reward scoring processes"),
    _alias("reward_model.num_workers", "rollout.reward_workers", "reward scoring processes"),
    _alias("reward.reward_kwargs", "reward_model.reward_kwargs", plus=True),
    VerlKey("reward.reward_kwargs.*", "alias", targets=(("reward_model.reward_kwargs", VALUE),),
            note="one key of reward_model.reward_kwargs", plus=True),
    *(
        _alias(f"{section}.reward_kwargs.{_OB}.{leaf}", f"reward_model.overlong_buffer.{leaf}",
               "dapo's overlong buffer (verl's reward_kwargs.overlong_buffer_cfg)", plus=True)
        for section in ("reward", "reward_model")
        for leaf in ("enable", "len", "penalty_factor", "log")
    ),
    *(
        _ignored(f"{section}.reward_kwargs.max_resp_len",
                 "the overlong buffer ends at rollout.max_new_tokens (verl's recipes set "
                 "max_resp_len to max_response_length)")
        for section in ("reward", "reward_model")
    ),
    _fixed("reward.reward_model.enable", (False,), _NO_RM),
    _fixed("reward_model.enable", (False,), _NO_RM),
    _ignored("reward.reward_model.*", _NO_RM),
    _ignored("reward_model.model.*", _NO_RM),
    _ignored("reward_model.rollout.*", _NO_RM),
    _ignored("reward_model.enable_resource_pool", _NO_RM),
    _ignored("reward_model.n_gpus_per_node", _NO_RM),
    _ignored("reward_model.nnodes", _NO_RM),
    _ignored("reward_model.reward_loop_source", "rlbus has the reward managers naive and dapo"),
    _ignored("reward_model.reward_loop_module_path", "rlbus has no custom reward manager class"),
    _ignored("reward_model.reward_loop_class_name", "rlbus has no custom reward manager class"),
    _ignored("reward.sandbox_fusion.*", "rlbus has no sandbox service; a reward function may "
                                        "call one itself"),
    _ignored("sandbox_fusion.*", "rlbus has no sandbox service; a reward function may call "
                                 "one itself"),
    # ---- algorithm
    _fixed("algorithm.adv_estimator", ("grpo",), "rlbus computes GRPO advantages"),
    _fixed("algorithm.norm_adv_by_std_in_grpo", (True,),
           "rlbus divides by the group's std (population std; verl: sample std)"),
    _fixed("algorithm.use_kl_in_reward", (False,),
           "rlbus puts the KL in the loss (trainer.use_kl_loss), not in the reward"),
    _ignored("algorithm.kl_penalty", "no KL in the reward (use_kl_in_reward=False)"),
    _ignored("algorithm.kl_ctrl.*", "no KL in the reward (use_kl_in_reward=False)"),
    _ignored("algorithm.gamma", "GAE only; rlbus uses GRPO"),
    _ignored("algorithm.lam", "GAE only; rlbus uses GRPO"),
    _fixed("algorithm.filter_groups.enable", (False,), "rlbus has no dynamic sampling filter"),
    _ignored("algorithm.filter_groups.*", "no dynamic sampling filter"),
    VerlKey("algorithm.rollout_correction.rollout_is", "derived",
            note="token: trainer.tis_cap = rollout_is_threshold (token-level truncated "
                 "importance weights); null: trainer.tis_cap null; sequence: refused"),
    VerlKey("algorithm.rollout_correction.rollout_is_threshold", "derived",
            note="trainer.tis_cap, with rollout_is=token (a float; verl's lower_upper "
                 "bounds are refused)"),
    _alias("algorithm.rollout_correction.rollout_rs", "trainer.rollout_rs",
           "rejection of tokens or sequences whose rollout log-probs are too far from the "
           "trainer's (runconfig.rejection)"),
    _alias("algorithm.rollout_correction.rollout_rs_threshold",
           "trainer.rollout_rs_threshold"),
    _fixed("algorithm.rollout_correction.bypass_mode", (False,),
           "rlbus's is verl's decoupled mode (proximal log-probs for stale samples)"),
    _fixed("algorithm.rollout_correction.loss_type", ("ppo_clip",),
           "rlbus's loss is PPO's clipped objective"),
    _fixed("algorithm.rollout_correction.rollout_is_batch_normalize", (False,),
           "rlbus's importance weights are not normalised over the batch"),
    _ignored("algorithm.rollout_correction.*", "see trainer.tis_cap"),
    _fixed("algorithm.use_pf_ppo", (False,), "rlbus has no PF-PPO"),
    _ignored("algorithm.pf_ppo.*", "no PF-PPO"),
    # ---- trainer (verl's trainer section; rlbus's own trainer.* keys win)
    _ignored("trainer.default_hdfs_dir", _CKPT),
    _ignored("trainer.del_local_ckpt_after_load", _CKPT),
    _ignored("trainer.resume_from_path", "resume_mode auto resumes the run found in "
                                         "trainer.default_local_dir; see run.id"),
    _ignored("trainer.max_critic_ckpt_to_keep", "rlbus has no critic"),
    _ignored("trainer.esi_redundant_time", _CKPT),
    _ignored("trainer.critic_warmup", "rlbus has no critic"),
    _ignored("trainer.ray_wait_register_center_timeout", _INFRA),
    _ignored("trainer.use_legacy_worker_impl", _INFRA),
    _ignored("trainer.worker_env.*", "components inherit rlbus up's environment"),
    # ---- fully-async: the rollouter's resources and length, extra async_training knobs
    VerlKey("rollout.total_rollout_steps", "derived",
            note="prompts to generate; trainer.total_training_steps = total_rollout_steps // "
                 "(ppo_mini_batch_size x require_batches), as verl's trainer stops"),
    _ignored("rollout.nnodes", _INFRA),
    _ignored("rollout.n_gpus_per_node", _INFRA),
    _ignored("async_training.use_trainer_do_validate", "a rollouter validates between batches"),
    _ignored("async_training.use_dynamic_resource_scheduling", _INFRA),
    _ignored("async_training.dynamic_schedule_policy", _INFRA),
    _ignored("async_training.dynamic_schedule_deactivate_ratio", _INFRA),
    _ignored("async_training.dynamic_schedule_enable_rebalance", _INFRA),
    _ignored("async_training.concurrent_samples_per_replica", "see rollout.prompts_per_batch"),
    _ignored("async_training.compute_prox_log_prob", "see trainer.tis_cap"),
    # ---- global_profiler: verl keys without an rlbus counterpart
    _ignored("global_profiler.relocate_results",
             "rlbus always writes every trace into save_path/RUN"),
    _ignored("global_profiler.finish_hook_all_ranks",
             "the profiler service runs finish_hook_cmd once per run"),
    _ignored("global_profiler.finish_hook_ranks",
             "the profiler service runs finish_hook_cmd once per run"),
    _ignored("global_profiler.global_tool_config.nsys.controller_nsight_options.*",
             "rlbus has no Ray driver to run under nsys"),
    _ignored("global_profiler.global_tool_config.torch_memory.kw_args.*",
             "see the other torch_memory keys"),
    _ignored("global_profiler.global_tool_config.precision_debugger.*",
             "rlbus has no precision_debugger tool"),
    _ignored("global_profiler.global_tool_config.npu.*", "rlbus has no npu tool"),
    # ---- other verl sections, and Hydra's own
    _ignored("hydra.*", "Hydra's settings: rlbus reads one YAML file"),
    _ignored("defaults", "Hydra's composition list: rlbus reads one YAML file"),
    _ignored("critic.*", "rlbus has no critic (GRPO)"),
    _ignored("distillation.*", "rlbus has no distillation"),
    _ignored("ray_kwargs.*", _INFRA),
    _ignored("ray_init.*", _INFRA),
    _ignored("transfer_queue.*", _INFRA),
)

# rlbus keys that verl has under the same name (its trainer, data, async_training,
# global_profiler sections and its older reward sections).
SHARED: frozenset[str] = frozenset({
    *(f"trainer.{k}" for k in (
        "total_training_steps", "total_epochs", "save_freq", "max_actor_ckpt_to_keep",
        "rollout_data_dir", "validation_data_dir",
        "logger", "project_name", "experiment_name", "test_freq", "val_before_train",
        "val_only", "log_val_generations", "default_local_dir", "resume_mode")),
    *(f"data.{k}" for k in (
        "train_files", "val_files", "prompt_key", "reward_fn_key", "max_prompt_length",
        "truncation", "filter_overlong_prompts", "shuffle", "seed", "train_max_samples",
        "val_max_samples", "apply_chat_template_kwargs")),
    *(f"async_training.{k}" for k in (
        "staleness_threshold", "trigger_parameter_sync_step", "require_batches",
        "partial_rollout")),
    *(f"global_profiler.{k}" for k in (
        "tool", "steps", "profile_continuous_steps", "save_path", "finish_hook_cmd")),
    "custom_reward_function.path", "custom_reward_function.name",
    "reward_model.reward_manager", "reward_model.reward_kwargs",
})
# rlbus keys whose verl counterpart is no alias row: verl's key, or what verl does.
_OTHER: dict[str, str] = {
    "rollout.max_new_tokens": "data.max_response_length",
    "trainer.seed": "actor_rollout_ref.actor.fsdp_config.seed",
    "trainer.tis_cap": "algorithm.rollout_correction.rollout_is",
    "trainer.zero_adv": "(verl trains on every mini-batch)",
}


def counterpart(key: str) -> str | None:
    """verl's name of rlbus ``key`` (the same name, the first alias row, or another row's
    meaning); None when verl has nothing like it."""
    if key in _OTHER:
        return _OTHER[key]
    if key in SHARED:
        return key
    for row in TABLE:
        if row.kind == "alias" and any(t == key and v is VALUE for t, v in row.targets):
            return row.key
    return None


_EXACT: dict[str, VerlKey] = {row.key: row for row in TABLE if not row.key.endswith(".*")}
_PREFIXES: tuple[VerlKey, ...] = tuple(
    sorted((row for row in TABLE if row.key.endswith(".*")), key=lambda r: -len(r.key))
)
DERIVED_KEYS = frozenset(row.key for row in TABLE if row.kind == "derived")


def lookup(key: str) -> VerlKey | None:
    """The row for verl's dotted ``key`` (an exact row first, then the longest subtree)."""
    row = _EXACT.get(key)
    if row is not None:
        return row
    for row in _PREFIXES:
        if key.startswith(row.key[:-1]):  # "a.b.*" covers "a.b.c..."
            return row
    return None


def verl_keys() -> list[str]:
    """Every verl key of the table (subtrees as ``prefix.*``)."""
    return [row.key for row in TABLE]


def derive(
    given: Mapping[str, Any], tree: Mapping[str, Any], explicit: frozenset[str] | set[str]
) -> list[Derivation]:
    """rlbus assignments ``(rlbus key, value, verl key)`` for the derived keys in ``given``.

    ``given`` holds the derived verl keys the user set (last value wins); ``tree`` is the config
    with every other key applied; ``explicit`` the rlbus keys the user set (directly or
    through an alias). Raises :class:`VerlError` naming the verl key at fault.
    """
    out: list[Derivation] = []
    for rule in (_response_length, _total_steps, _profiler_roles, _profiler_contents,
                 _importance_weights):
        found = rule(given, tree, explicit)
        if found is not None:
            out.append(found)
    out += _classic_batch(given, tree, explicit)
    return out


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


class Derivation(NamedTuple):
    """An rlbus ``key`` set to ``value`` by the verl key ``by``; ``how``, when the value
    was computed (the run's length), says from what, for a note at load time."""

    key: str
    value: Any
    by: str
    how: str = ""


Derived = Derivation | None


def _response_length(given: Mapping[str, Any], tree: Mapping[str, Any],
                     explicit: frozenset[str] | set[str]) -> Derived:
    """data.max_response_length -> rollout.max_new_tokens, unless that is given itself."""
    key = "data.max_response_length"
    if key in given and "rollout.max_new_tokens" not in explicit:
        return Derivation("rollout.max_new_tokens", given[key], key)
    return None


def _total_steps(given: Mapping[str, Any], tree: Mapping[str, Any],
                 explicit: frozenset[str] | set[str]) -> Derived:
    """rollout.total_rollout_steps (prompts) -> trainer.total_training_steps (updates)."""
    key = "rollout.total_rollout_steps"
    if key not in given:
        return None
    total = given[key]
    mini, batches = _get(tree, "trainer.ppo_mini_batch_size"), _get(
        tree, "async_training.require_batches")
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        raise VerlError(key, f"expected a positive int, got {total!r}")
    if not (isinstance(mini, int) and isinstance(batches, int) and mini > 0 and batches > 0):
        return None  # the schema reports the bad batch key itself
    data, asked = _data_prompts(tree), total
    if data is not None and data < total:  # verl: min(total_rollout_steps, data x epochs)
        total = data
    steps = total // (mini * batches)
    if steps < 1:
        raise VerlError(key, f"{total} prompts make no step of ppo_mini_batch_size x "
                             f"require_batches = {mini * batches} prompts")
    configured = _get(tree, "trainer.total_training_steps")
    if "trainer.total_training_steps" in explicit and configured != steps:
        raise VerlError(key, f"gives {steps} steps but trainer.total_training_steps="
                             f"{configured}; give one of them")
    held = "" if data is None else f", the data hold {data} (records x trainer.total_epochs)"
    return Derivation("trainer.total_training_steps", steps, key,
                      f"trainer.total_training_steps={steps}: {total} prompts (of "
                      f"rollout.total_rollout_steps={asked}{held}) // {mini * batches} a step "
                      "(ppo_mini_batch_size x require_batches), as verl's fully-async "
                      "trainer counts them")


_ROLE_FLAGS = (("trainer", "actor_rollout_ref.actor.profiler.enable"),
               ("rollouter", "actor_rollout_ref.rollout.profiler.enable"))


def _profiler_roles(given: Mapping[str, Any], tree: Mapping[str, Any],
                    explicit: frozenset[str] | set[str]) -> Derived:
    """verl's per-role profiler.enable flags -> global_profiler.roles."""
    flags = {role: given.get(key) for role, key in _ROLE_FLAGS}
    set_keys = [key for role, key in _ROLE_FLAGS if flags[role] is not None]
    if not set_keys:
        return None
    for role, key in _ROLE_FLAGS:
        if flags[role] is not None and not isinstance(flags[role], bool):
            raise VerlError(key, f"expected true or false, got {flags[role]!r}")
    if "global_profiler.roles" in explicit:
        raise VerlError(set_keys[0], "conflicts with global_profiler.roles; give one of them")
    return Derivation("global_profiler.roles", [r for r, f in flags.items() if f],
                      set_keys[0])


_CONTENTS = ("actor_rollout_ref.actor.profiler.tool_config.torch.contents",
             "actor_rollout_ref.rollout.profiler.tool_config.torch.contents")


def _profiler_contents(given: Mapping[str, Any], tree: Mapping[str, Any],
                       explicit: frozenset[str] | set[str]) -> Derived:
    """verl's per-role torch contents -> global_profiler.contents (one list for all)."""
    lists = {k: given[k] for k in _CONTENTS if k in given}
    if not lists:
        return None
    key, value = next(iter(lists.items()))
    if len({repr(v) for v in lists.values()}) > 1:
        raise VerlError(key, "rlbus applies one contents list to every role; the actor's "
                             "and the rollout's differ")
    if "global_profiler.contents" in explicit and _get(tree, "global_profiler.contents") != value:
        raise VerlError(key, "conflicts with global_profiler.contents; give one of them")
    return Derivation("global_profiler.contents", value, key)


_IS, _IS_CAP = ("algorithm.rollout_correction.rollout_is",
                "algorithm.rollout_correction.rollout_is_threshold")


def _importance_weights(given: Mapping[str, Any], tree: Mapping[str, Any],
                        explicit: frozenset[str] | set[str]) -> Derived:
    """verl's rollout correction -> trainer.tis_cap: token-level weights min(pi_old / pi_rollout,
    threshold) are what rlbus applies (to mini-batches holding samples older than the
    trainer's weights); sequence-level weights and IcePop bounds are not built."""
    if _IS not in given:
        return None  # verl's default: no weights; a threshold alone does nothing in verl
    level = given[_IS]
    if level in (None, "null", "None"):
        cap = None
    elif level == "token":
        threshold = given.get(_IS_CAP, 2.0)
        try:
            cap = float(threshold)
        except (TypeError, ValueError):
            raise VerlError(_IS_CAP, f"rlbus takes one upper bound (a float), got "
                                     f"{threshold!r}: two-sided (IcePop) bounds are not "
                                     "built") from None
        if not cap > 0 or isinstance(threshold, bool):
            raise VerlError(_IS_CAP, f"expected a positive float, got {threshold!r}")
    else:
        raise VerlError(_IS, f"rlbus supports only 'token' or null, got {level!r}: its "
                             "importance weights are per token (trainer.tis_cap)")
    if "trainer.tis_cap" in explicit and _get(tree, "trainer.tis_cap") != cap:
        raise VerlError(_IS, "conflicts with trainer.tis_cap; give one of them")
    return Derivation("trainer.tis_cap", cap, _IS)


def _data_prompts(tree: Mapping[str, Any]) -> int | None:
    """The prompts ``trainer.total_epochs`` passes over ``data.train_files`` hold (None: no
    data files or no epoch count): verl's ``len(train_dataloader) * total_epochs``."""
    files, epochs = _get(tree, "data.train_files"), _get(tree, "trainer.total_epochs")
    if files is None or not isinstance(epochs, int) or isinstance(epochs, bool):
        return None
    if _get(tree, "data.custom_cls.path") is not None:
        return None  # its class makes the records: counted once loaded (tasks.verl_data)
    return _records(tree) * epochs


def _records(tree: Mapping[str, Any]) -> int:
    """The records of ``data.train_files`` after ``data.train_max_samples`` (a ConfigError
    naming the file when one cannot be read). Counted, not loaded: the data check loads
    them, and says when ``data.filter_overlong_prompts`` dropped enough to change the
    steps (tasks.verl_data)."""
    from tasks.verl_data import count_records

    return count_records(_get(tree, "data.train_files"), _get(tree, "data.train_max_samples"))


_CLASSIC = "data.train_batch_size"


def _classic_batch(given: Mapping[str, Any], tree: Mapping[str, Any],
                   explicit: frozenset[str] | set[str]) -> list[Derivation]:
    """A classic (synchronous) verl line's ``data.train_batch_size``: the prompts of one
    step, trained on-policy, and its step count from the data (verl's ``ray_trainer``:
    ``len(train_dataloader) * total_epochs``, the dataloader dropping the last partial
    batch: ``data.epoch_batch_size``). A fully-async line (any ``async_training.*`` key or
    ``rollout.total_rollout_steps``) takes its step size from those keys and reads every
    record of an epoch, as verl's does."""
    if _CLASSIC not in given or "rollout.total_rollout_steps" in given or any(
            k.startswith("async_training.") for k in explicit):
        return []
    batch, mini = given[_CLASSIC], _get(tree, "trainer.ppo_mini_batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise VerlError(_CLASSIC, f"expected a positive int, got {batch!r}")
    if not isinstance(mini, int) or mini < 1:
        return []  # the schema reports the bad mini-batch key itself
    if batch % mini:
        raise VerlError(_CLASSIC, f"{batch} prompts do not split into mini-batches of "
                                  f"ppo_mini_batch_size={mini}")
    out = [Derivation("async_training.require_batches", batch // mini, _CLASSIC),
           Derivation("async_training.trigger_parameter_sync_step", 1, _CLASSIC),
           Derivation("async_training.staleness_threshold", 0.0, _CLASSIC),
           Derivation("data.epoch_batch_size", batch, _CLASSIC)]
    epochs = _get(tree, "trainer.total_epochs")
    if (_get(tree, "data.train_files") is not None and isinstance(epochs, int)
            and "trainer.total_training_steps" not in explicit):
        if _get(tree, "data.custom_cls.path") is not None:
            raise VerlError("data.custom_cls.path", "a classic line's steps are counted from "
                            "the records, and this class makes them only as the data load: "
                            "give trainer.total_training_steps (records // "
                            "data.train_batch_size x trainer.total_epochs)")
        records = _records(tree)
        steps = records // batch * epochs
        if steps < 1:
            raise VerlError(_CLASSIC, f"data.train_files hold fewer than {batch} records: "
                                      "no step")
        out.append(Derivation(
            "trainer.total_training_steps", steps, _CLASSIC,
            f"trainer.total_training_steps={steps}: ({records} records // "
            f"data.train_batch_size={batch}) x trainer.total_epochs={epochs}, as verl's "
            "main_ppo counts them"))
    return out
