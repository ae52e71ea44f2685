"""verl's spellings: the table of verl config keys rlbus accepts, and what each one does here.

A verl user's launch line (``python -m verl.experimental.fully_async_policy.fully_async_main
KEY=VALUE ...``) runs as ``rlbus up KEY=VALUE ...``. Each verl key is one of:

``alias``
    Same meaning, same unit as an rlbus key: the value is set on ``target``
    (``actor_rollout_ref.actor.optim.lr`` -> ``trainer.lr``). Some set a second key too
    (``actor_rollout_ref.model.path`` also selects ``model.kind=hf``).
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
The table is documented, row for row, in docs/config.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

__all__ = [
    "DERIVED_KEYS",
    "TABLE",
    "VerlError",
    "VerlKey",
    "derive",
    "lookup",
    "verl_keys",
]

Kind = Literal["alias", "derived", "fixed", "ignored"]
VALUE = object()
"""In ``VerlKey.targets``: the value the user gave (after ``convert``)."""


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


def _alias(key: str, target: str, note: str = "", **kw: Any) -> VerlKey:
    return VerlKey(key, "alias", targets=((target, VALUE),), note=note, **kw)


def _ignored(key: str, note: str) -> VerlKey:
    return VerlKey(key, "ignored", note=note)


def _fixed(key: str, values: tuple[Any, ...], note: str) -> VerlKey:
    return VerlKey(key, "fixed", values=values, note=note)


def _train_file(key: str, value: Any) -> str:
    files = value if isinstance(value, list) else [value]
    if len(files) != 1 or not isinstance(files[0], str) or not files[0]:
        raise VerlError(key, f"needs one JSONL file, got {value!r}")
    path = files[0]
    if path.endswith(".parquet"):
        raise VerlError(
            key, f"{path!r} is parquet; rlbus reads one JSONL file of {{\"prompt\", \"answer\"}} "
            "lines (convert it, e.g. pandas.read_parquet(...).to_json(lines=True))"
        )
    return path


_INFRA = "infrastructure rlbus does not have (one process per role, placed by rlbus up)"
_NO_VAL = "rlbus has no validation loop"
_CKPT = "rlbus checkpoints to run.output_dir/RUN/checkpoints and resumes a run by its run.id"
_DIFF = "rlbus's optimiser is Adam with a constant learning rate and no weight decay"
_PROF_ROLE = "rlbus profiles the roles of global_profiler.roles and ranks global_profiler.ranks"

TABLE: tuple[VerlKey, ...] = (
    # ---- the actor: PPO/GRPO update
    _alias("actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.ppo_mini_batch_size",
           "prompts per mini-batch in both (each with rollout.n responses); a step is "
           "async_training.require_batches mini-batches in both"),
    _alias("actor_rollout_ref.actor.ppo_epochs", "trainer.ppo_epochs"),
    _alias("actor_rollout_ref.actor.clip_ratio_low", "trainer.clip_ratio_low"),
    _alias("actor_rollout_ref.actor.clip_ratio_high", "trainer.clip_ratio_high"),
    _alias("actor_rollout_ref.actor.entropy_coeff", "trainer.entropy_coeff"),
    _alias("actor_rollout_ref.actor.grad_clip", "trainer.grad_clip"),
    _alias("actor_rollout_ref.actor.optim.clip_grad", "trainer.grad_clip"),
    _alias("actor_rollout_ref.actor.optim.lr", "trainer.lr"),
    _ignored("actor_rollout_ref.actor.clip_ratio",
             "verl uses it only where clip_ratio_low/high are null; set those"),
    _ignored("actor_rollout_ref.actor.clip_ratio_c", "rlbus applies no dual-clip bound"),
    _fixed("actor_rollout_ref.actor.loss_agg_mode", ("token-mean",),
           "rlbus averages the loss over every token of a mini-batch (verl's token-mean)"),
    _fixed("actor_rollout_ref.actor.use_kl_loss", (False,),
           "rlbus has no reference model, hence no KL loss"),
    _ignored("actor_rollout_ref.actor.kl_loss_coef", "no KL loss (use_kl_loss=False)"),
    _ignored("actor_rollout_ref.actor.kl_loss_type", "no KL loss (use_kl_loss=False)"),
    _fixed("actor_rollout_ref.actor.policy_loss.loss_mode", ("vanilla",),
           "rlbus's loss is the clipped PPO surrogate (verl's vanilla)"),
    _ignored("actor_rollout_ref.actor.policy_loss.*", "loss_mode vanilla takes no options"),
    _fixed("actor_rollout_ref.actor.optim.optimizer", ("AdamW", "Adam"), _DIFF),
    _fixed("actor_rollout_ref.actor.optim.betas", ([0.9, 0.999],), _DIFF),
    _ignored("actor_rollout_ref.actor.optim.weight_decay", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.lr_warmup_steps", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.warmup_style", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.lr_scheduler_type", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.min_lr_ratio", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.num_cycles", _DIFF),
    _ignored("actor_rollout_ref.actor.optim.total_training_steps",
             "set by verl itself; the run length is trainer.total_training_steps"),
    _ignored("actor_rollout_ref.actor.optim.optimizer_impl", _INFRA),
    _ignored("actor_rollout_ref.actor.optim.override_optimizer_config", _INFRA),
    _ignored("actor_rollout_ref.actor.optim.zero_indexed_step", _INFRA),
    _ignored("actor_rollout_ref.actor.use_rollout_log_probs",
             "rlbus trains on the rollout's log-probs; see trainer.tis_cap"),
    _ignored("actor_rollout_ref.actor.strategy", _INFRA),
    _ignored("actor_rollout_ref.actor.fsdp_config.*", _INFRA),
    _ignored("actor_rollout_ref.actor.megatron.*", _INFRA),
    _ignored("actor_rollout_ref.actor.checkpoint.*", _CKPT),
    _ignored("actor_rollout_ref.actor.use_dynamic_bsz", _INFRA),
    _ignored("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", _INFRA),
    _ignored("actor_rollout_ref.actor.ppo_micro_batch_size", _INFRA),
    _ignored("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", _INFRA),
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
    _fixed("actor_rollout_ref.rollout.top_p", (1.0, 1),
           "rlbus samples from the whole distribution"),
    _fixed("actor_rollout_ref.rollout.top_k", (-1, 0),
           "rlbus samples from the whole distribution"),
    _fixed("actor_rollout_ref.rollout.do_sample", (True,), "rlbus samples"),
    _fixed("actor_rollout_ref.rollout.calculate_log_probs", (True,),
           "a rollouter always returns the sampling log-probs"),
    _ignored("actor_rollout_ref.rollout.prompt_length", "rlbus does not truncate prompts"),
    _ignored("actor_rollout_ref.rollout.name", _INFRA),
    _ignored("actor_rollout_ref.rollout.mode", _INFRA),
    _ignored("actor_rollout_ref.rollout.dtype", _INFRA),
    _ignored("actor_rollout_ref.rollout.gpu_memory_utilization", _INFRA),
    _ignored("actor_rollout_ref.rollout.standalone_gpu_memory_utilization", _INFRA),
    _ignored("actor_rollout_ref.rollout.tensor_model_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.data_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.expert_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.pipeline_model_parallel_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.enable_chunked_prefill", _INFRA),
    _ignored("actor_rollout_ref.rollout.enable_prefix_caching", _INFRA),
    _ignored("actor_rollout_ref.rollout.max_num_batched_tokens", _INFRA),
    _ignored("actor_rollout_ref.rollout.max_num_seqs", _INFRA),
    _ignored("actor_rollout_ref.rollout.max_model_len", _INFRA),
    _ignored("actor_rollout_ref.rollout.enforce_eager", _INFRA),
    _ignored("actor_rollout_ref.rollout.free_cache_engine", _INFRA),
    _ignored("actor_rollout_ref.rollout.load_format", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_micro_batch_size", _INFRA),
    _ignored("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", _INFRA),
    _ignored("actor_rollout_ref.rollout.ignore_eos", "responses end at EOS"),
    _ignored("actor_rollout_ref.rollout.val_kwargs.*", _NO_VAL),
    _ignored("actor_rollout_ref.rollout.engine_kwargs.*", _INFRA),
    _ignored("actor_rollout_ref.rollout.checkpoint_engine.*", _INFRA),
    _ignored("actor_rollout_ref.rollout.agent.*", "rlbus has no agent loop"),
    _ignored("actor_rollout_ref.rollout.multi_turn.*", "rlbus has no multi-turn rollout"),
    _ignored("actor_rollout_ref.rollout.trace.*", _INFRA),
    # ---- the model, the reference policy, the hybrid engine
    VerlKey("actor_rollout_ref.model.path", "alias",
            targets=(("model.path", VALUE), ("model.kind", "hf")),
            note="a local Hugging Face model directory (model.kind=hf); rlbus never downloads"),
    _ignored("actor_rollout_ref.model.use_remove_padding", _INFRA),
    _ignored("actor_rollout_ref.model.enable_gradient_checkpointing", _INFRA),
    _ignored("actor_rollout_ref.model.enable_activation_offload", _INFRA),
    _ignored("actor_rollout_ref.model.use_fused_kernels", _INFRA),
    _ignored("actor_rollout_ref.model.use_shm", _INFRA),
    _ignored("actor_rollout_ref.model.trust_remote_code", _INFRA),
    _ignored("actor_rollout_ref.model.external_lib", _INFRA),
    _ignored("actor_rollout_ref.model.override_config.*", _INFRA),
    _ignored("actor_rollout_ref.ref.*", "rlbus has no reference model"),
    _ignored("actor_rollout_ref.hybrid_engine", _INFRA),
    _ignored("actor_rollout_ref.nccl_timeout", _INFRA),
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
    # ---- data
    VerlKey("data.train_files", "alias",
            targets=(("task.path", VALUE), ("task.kind", "jsonl")), convert=_train_file,
            note="one JSONL file of {\"prompt\", \"answer\"} lines (verl: parquet)"),
    VerlKey("data.max_response_length", "derived",
            note="rollout.max_new_tokens, unless actor_rollout_ref.rollout.response_length "
                 "or rollout.max_new_tokens is given (verl's interpolation)"),
    _fixed("data.prompt_key", ("prompt",), "rlbus reads the prompt from the \"prompt\" field"),
    _ignored("data.val_files", _NO_VAL),
    _ignored("data.val_batch_size", _NO_VAL),
    _ignored("data.max_prompt_length", "rlbus does not truncate or filter prompts"),
    _ignored("data.truncation", "rlbus does not truncate prompts"),
    _ignored("data.filter_overlong_prompts", "rlbus does not filter prompts"),
    _ignored("data.filter_overlong_prompts_workers", _INFRA),
    _ignored("data.train_batch_size",
             "fully-async: a step takes ppo_mini_batch_size x require_batches prompts"),
    _ignored("data.gen_batch_size", "see rollout.prompts_per_batch"),
    _ignored("data.return_raw_chat", "prompts are used as written"),
    _ignored("data.return_full_prompt", "prompts are used as written"),
    _ignored("data.shuffle", "the JSONL prompts are shuffled each epoch (task.seed)"),
    _ignored("data.seed", "see task.seed"),
    _ignored("data.dataloader_num_workers", _INFRA),
    _ignored("data.reward_fn_key", "see task.reward_fn"),
    _ignored("data.use_shm", _INFRA),
    _ignored("data.trust_remote_code", _INFRA),
    _ignored("data.tokenizer", "the tokenizer is model.path's"),
    # ---- algorithm
    _fixed("algorithm.adv_estimator", ("grpo",), "rlbus computes GRPO advantages"),
    _fixed("algorithm.norm_adv_by_std_in_grpo", (True,),
           "rlbus divides by the group's std (population std; verl: sample std)"),
    _fixed("algorithm.use_kl_in_reward", (False,), "rlbus has no reference model"),
    _ignored("algorithm.kl_penalty", "no KL in the reward (use_kl_in_reward=False)"),
    _ignored("algorithm.kl_ctrl.*", "no KL in the reward (use_kl_in_reward=False)"),
    _ignored("algorithm.gamma", "GAE only; rlbus uses GRPO"),
    _ignored("algorithm.lam", "GAE only; rlbus uses GRPO"),
    _fixed("algorithm.filter_groups.enable", (False,), "rlbus has no dynamic sampling filter"),
    _ignored("algorithm.filter_groups.*", "no dynamic sampling filter"),
    _ignored("algorithm.rollout_correction.*", "see trainer.tis_cap"),
    _fixed("algorithm.use_pf_ppo", (False,), "rlbus has no PF-PPO"),
    _ignored("algorithm.pf_ppo.*", "no PF-PPO"),
    # ---- trainer (verl's trainer section; rlbus's own trainer.* keys win)
    _ignored("trainer.nnodes", _INFRA),
    _ignored("trainer.n_gpus_per_node", _INFRA),
    _ignored("trainer.test_freq", _NO_VAL),
    _ignored("trainer.val_before_train", _NO_VAL),
    _ignored("trainer.val_only", _NO_VAL),
    _ignored("trainer.log_val_generations", _NO_VAL),
    _ignored("trainer.validation_data_dir", _NO_VAL),
    _ignored("trainer.total_epochs",
             "the run length is trainer.total_training_steps (or rollout.total_rollout_steps)"),
    _ignored("trainer.default_local_dir", _CKPT),
    _ignored("trainer.default_hdfs_dir", _CKPT),
    _ignored("trainer.del_local_ckpt_after_load", _CKPT),
    _ignored("trainer.resume_mode", _CKPT),
    _ignored("trainer.resume_from_path", _CKPT),
    _ignored("trainer.max_critic_ckpt_to_keep", _CKPT),
    _ignored("trainer.esi_redundant_time", _CKPT),
    _ignored("trainer.balance_batch", _INFRA),
    _ignored("trainer.critic_warmup", "rlbus has no critic"),
    _ignored("trainer.rollout_data_dir", "every sample is in the run's samples stream"),
    _ignored("trainer.ray_wait_register_center_timeout", _INFRA),
    _ignored("trainer.use_legacy_worker_impl", _INFRA),
    # ---- fully-async: the rollouter's resources and length, extra async_training knobs
    VerlKey("rollout.total_rollout_steps", "derived",
            note="prompts to generate; trainer.total_training_steps = total_rollout_steps // "
                 "(ppo_mini_batch_size x require_batches), as verl's trainer stops"),
    _ignored("rollout.nnodes", _INFRA),
    _ignored("rollout.n_gpus_per_node", _INFRA),
    _ignored("async_training.use_trainer_do_validate", _NO_VAL),
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
    _ignored("reward_model.*", "rewards come from task.reward_fn"),
    _ignored("reward.*", "rewards come from task.reward_fn"),
    _ignored("custom_reward_function.*", "rewards come from task.reward_fn"),
    _ignored("ray_kwargs.*", _INFRA),
    _ignored("ray_init.*", _INFRA),
    _ignored("transfer_queue.*", _INFRA),
)

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
) -> list[tuple[str, Any, str]]:
    """rlbus assignments ``(rlbus key, value, verl key)`` for the derived keys in ``given``.

    ``given`` holds the derived verl keys the user set (last value wins); ``tree`` is the config
    with every other key applied; ``explicit`` the rlbus keys the user set (directly or
    through an alias). Raises :class:`VerlError` naming the verl key at fault.
    """
    out: list[tuple[str, Any, str]] = []
    for rule in (_response_length, _total_steps, _profiler_roles, _profiler_contents):
        found = rule(given, tree, explicit)
        if found is not None:
            out.append(found)
    return out


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


Derived = tuple[str, Any, str] | None


def _response_length(given: Mapping[str, Any], tree: Mapping[str, Any],
                     explicit: frozenset[str] | set[str]) -> Derived:
    """data.max_response_length -> rollout.max_new_tokens, unless that is given itself."""
    key = "data.max_response_length"
    if key in given and "rollout.max_new_tokens" not in explicit:
        return "rollout.max_new_tokens", given[key], key
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
    steps = total // (mini * batches)
    if steps < 1:
        raise VerlError(key, f"{total} prompts make no step of ppo_mini_batch_size x "
                             f"require_batches = {mini * batches} prompts")
    configured = _get(tree, "trainer.total_training_steps")
    if "trainer.total_training_steps" in explicit and configured != steps:
        raise VerlError(key, f"gives {steps} steps but trainer.total_training_steps="
                             f"{configured}; give one of them")
    return "trainer.total_training_steps", steps, key


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
    return "global_profiler.roles", [r for r, f in flags.items() if f], set_keys[0]


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
    return "global_profiler.contents", value, key
