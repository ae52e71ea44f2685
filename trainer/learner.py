"""The trainer's model: the policy, its optimizer and lr schedule, the frozen reference of
the KL loss, and the weights version they hold.

Every method that touches torch is blocking: the trainer calls them on its worker thread
(:meth:`runtime.Component.off`), so its event loop stays free for the lease and the pulse, and
torch.profiler sees every profiled call on the thread it was started on.

With several trainer ranks (trainer.ranks) every rank has a Learner. Rank 0's public methods
first tell the other ranks the operation (``_tell``: one broadcast on the op channel), then
run it; the other ranks run :meth:`Learner.follow`, which runs each operation they are told.
An operation is one ``_op_*`` method, the same code on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import psutil
import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from policy import build_policy, resolve_device
from runconfig import Config, TrainerConfig
from runschema.messages import FileDigest, Sample, decode, encode
from runtime import Failure, settle_heap
from trainer.integrity import folder_digests
from trainer.ranks import RankGroup
from trainer.sharding import (
    compute_dtype,
    gather_state,
    local_part,
    scatter_state,
    shard_policy,
    skeleton,
)
from trainer.update import GrpoStep, grpo_update

__all__ = ["Learner", "RankedStep", "frozen_copy", "lr_factor", "make_optimizer", "memory_metrics",
           "warmup_steps"]

_SCHEDULER_KEY = "lr_scheduler"
"""Where the lr schedule's state rides in the optimizer's state dict (so in checkpoints)."""


def warmup_steps(tc: TrainerConfig) -> int:
    """verl's warm-up length: ``lr_warmup_steps``, or when that is <= 0 (-1 by default)
    ``int(lr_warmup_steps_ratio x total_training_steps)``, in training steps."""
    if tc.lr_warmup_steps > 0:
        return tc.lr_warmup_steps
    return int(tc.lr_warmup_steps_ratio * tc.total_training_steps)


def lr_factor(step: int, tc: TrainerConfig) -> float:
    """The lr multiplier of training step ``step`` (0 = the first), verl's formulas
    (verl.utils.torch_functional, zero-indexed steps): a linear warm-up step / warm-up from
    0, then constant 1, or cosine: max(min_lr_ratio, (1 + min_lr_ratio) / 2 + (1 -
    min_lr_ratio) / 2 x cos(2 pi num_cycles progress)), progress = (step - warm-up) /
    (total_training_steps - warm-up)."""
    warm = warmup_steps(tc)
    if step < warm:
        return float(step) / float(max(1, warm))
    if tc.lr_scheduler_type == "constant":
        return 1.0
    progress = float(step - warm) / float(max(1, tc.total_training_steps - warm))
    x = math.cos(math.pi * float(tc.num_cycles) * 2.0 * progress)
    return max(tc.min_lr_ratio, x * (1 - tc.min_lr_ratio) * 0.5 + (1 + tc.min_lr_ratio) * 0.5)


def make_optimizer(params: Any, tc: TrainerConfig
                   ) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW (verl's: betas 0.9 / 0.999, decoupled ``weight_decay`` on every parameter) and
    its lr schedule (:func:`lr_factor`, one ``step()`` per training step).

    The schedule's state is saved inside the optimizer's state dict (key
    ``lr_scheduler``) and restored by ``optimizer.load_state_dict``, so a checkpoint of the
    optimizer carries it and a resume continues the schedule where it was."""
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.999),
                                  weight_decay=tc.weight_decay, foreach=_foreach(params))
    scheduler = LambdaLR(optimizer, _factor_of(tc))
    _carry_scheduler(optimizer, scheduler)
    return optimizer, scheduler


def _foreach(params: list[Any]) -> bool | None:
    """True for plain tensors: torch updates CPU parameters one tensor at a time by default
    (its multi-tensor path only on GPUs); that path is the same arithmetic, bit for bit,
    in fewer ops (the tiny policy's optimizer step 0.77 -> 0.55 ms here). None (torch's
    choice) for FSDP2's DTensors and parameter groups."""
    plain = all(isinstance(p, torch.Tensor) and not isinstance(p, DTensor) for p in params)
    return True if plain and params else None


def _factor_of(tc: TrainerConfig) -> Callable[[int], float]:
    return lambda step: lr_factor(step, tc)


def _carry_scheduler(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
    loaded: list[dict[str, Any]] = []

    def save(_opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state[_SCHEDULER_KEY] = scheduler.state_dict()
        return state

    def take(_opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        if (sched := state.pop(_SCHEDULER_KEY, None)) is not None:
            loaded.append(sched)
        return state

    def restore(_opt: torch.optim.Optimizer) -> None:
        if loaded:  # a checkpoint written without a schedule leaves it where it is
            scheduler.load_state_dict(loaded.pop())

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(take)
    optimizer.register_load_state_dict_post_hook(restore)


def frozen_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` that is never trained (the KL loss's reference): no gradients,
    eval mode for good."""
    ref = copy.deepcopy(policy)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def _vocab_size(policy: torch.nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in policy.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


def publish_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype weights are published in (``rollout.weights_dtype``): ``auto`` is the
    rollouter's model dtype (bf16 for an HF model of ``model.dtype`` bf16; the trainer's own
    dtype otherwise, None: unchanged)."""
    want = cfg.rollout.weights_dtype
    if want == "auto":
        hf_bf16 = cfg.model.kind == "hf" and cfg.model.dtype in ("bf16", "bfloat16")
        return torch.bfloat16 if hf_bf16 else None
    return torch.bfloat16 if want == "bf16" else torch.float32


def _encode_groups(groups: Sequence[Sequence[Sample]]) -> list[list[bytes]]:
    return [[encode(s) for s in g] for g in groups]


def _decode_groups(blobs: list[list[bytes]]) -> list[list[Sample]]:
    return [[decode(b) for b in g] for g in blobs]  # type: ignore[misc]


class NonFiniteWeights(Failure):
    """An update left a weight NaN or infinite: publishing it would make every rollouter
    sample garbage (or fail), and every later step train on that. The trainer stops before
    the weights leave it, naming the tensor; the resume restarts from the last checkpoint."""


def check_finite(tensors: dict[str, torch.Tensor], version: int) -> None:
    """Raise :class:`NonFiniteWeights` naming the first tensor of ``tensors`` (weights
    ``version``, about to be published) holding a NaN or an infinity (blocking: one pass
    over the weights, on the worker)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise NonFiniteWeights(
                f"NonFiniteWeights: weights v{version} hold {bad} NaN or infinite values in "
                f"{name} ({t.numel()} values): not published; the update that made them (a "
                f"sample, a reward or the learning rate) is the cause, and a resume restarts "
                f"from the last checkpoint")


class RankedStep:
    """A :class:`~trainer.update.GrpoStep` run by every rank: each call is told to the
    other ranks before rank 0 runs it (trainer.stepwork calls these on the worker)."""

    def __init__(self, learner: Learner, version: int) -> None:
        self.learner, self.version = learner, version

    def add(self, groups: Sequence[Sequence[Sample]]) -> None:
        self.learner._tell("add", (self.version, _encode_groups(groups)))
        self.learner._op_add((self.version, groups))

    def train(self) -> None:
        self.learner._tell("train", self.version)
        self.learner._op_train(self.version)

    def finish(self) -> dict[str, float]:
        self.learner._tell("finish", self.version)
        return self.learner._op_finish(self.version)


class Learner:
    """The policy being trained, its optimizer and its weights version."""

    def __init__(self, cfg: Config, group: RankGroup | None = None) -> None:
        self.cfg = cfg
        self.group = group or RankGroup(None, resolve_device(cfg.trainer.device),
                                        cfg.trainer.dist_timeout_s)
        self.device = self.group.device
        self.version = 0
        """The weights version the policy holds (one more after every sync)."""
        self.vocab_size: int | None = None
        self.max_len: int | None = cfg.model.max_len if cfg.model.kind == "tiny" else None
        self.building: asyncio.Future[None] | None = None  # the optimizer, see build_optimizer
        self.reference: torch.nn.Module | None = None
        """use_kl_loss: the initial weights, frozen (see :meth:`build`)."""
        self.scheduler: LambdaLR | None = None
        self._step: GrpoStep | None = None  # the step being trained (RankedStep)
        self.agent: Any = None  # ranks > 0: this rank's profiler agent (trainer.rankprofile)
        self.remote_checkpoints: str | None = None
        """On a remote run.storage, the URL of the run's checkpoint folder there: dcp shards
        are written to it by every rank and read from it (the trainer sets it)."""

    def build(self) -> None:
        """The policy, and with ``use_kl_loss`` its frozen reference (blocking).

        The reference is a copy of the weights as built from the model config (model.path,
        or the tiny model's seed), taken before any checkpoint is loaded: a resumed trainer
        rebuilds the very same reference."""
        tc = self.cfg.trainer
        torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        model = msgspec.to_builtins(self.cfg.model)
        model["dtype"] = compute_dtype(self.cfg.model.dtype, tc.fsdp_param_dtype)
        self.policy = build_policy(model, self.device, training=True)
        self.policy.train()
        self.reference = frozen_copy(self.module) if tc.use_kl_loss else None
        self.vocab_size = _vocab_size(self.module)
        shard_policy(self.module, tc, self.group)
        if self.reference is not None:
            shard_policy(self.reference, tc, self.group)

    @property
    def module(self) -> torch.nn.Module:
        """The policy as the torch module every :class:`policy.Policy` is (for torch's
        calls: sharding, state dicts, optimizer steps)."""
        assert isinstance(self.policy, torch.nn.Module)
        return self.policy

    def build_optimizer(self) -> None:
        """Start building the optimizer on a thread of its own: the first torch optimizer of a
        process imports torch._dynamo (about a second), while the worker serialises weights
        version 0. :meth:`optimizer_ready` waits for it."""
        def build() -> None:
            self.optimizer, self.scheduler = make_optimizer(self.policy.parameters(),
                                                            self.cfg.trainer)

        self.building = asyncio.ensure_future(asyncio.to_thread(build))

    async def optimizer_ready(self) -> None:
        """Wait for the optimizer; that ends the trainer's start-up: the garbage collector
        comes back on (settle_heap)."""
        task, self.building = self.building, None
        if task is not None:
            await task
            settle_heap()

    # ------------------------------------------------------------------ ranks

    def _tell(self, op: str, payload: Any = None) -> None:
        """Rank 0: the other ranks run ``op`` next (nothing with one rank)."""
        self.group.send(op, payload)

    def keepalive(self) -> None:
        """Rank 0, when idle: tell the other ranks it is alive (their wait for the next
        operation is bounded by trainer.dist_timeout_s)."""
        self._tell("ping")

    def stop_ranks(self) -> None:
        """Rank 0: the other ranks leave :meth:`follow` and exit."""
        self._tell("stop")

    def relay_profile(self, method: str, args: tuple[Any, ...], commands: list[Any]) -> None:
        """Rank 0: the other ranks apply ``commands`` and cross the profiler's step
        boundary ``method(*args)`` (trainer.rankprofile)."""
        self._tell("profile", (method, args, commands))

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 tells, until it says stop."""
        while True:
            op, payload = self.group.receive()
            if op == "stop":
                return
            if op == "ping":
                continue
            if op in ("add", "update"):  # a mini-batch / a step's groups, msgpack-encoded
                version, blobs = payload
                payload = (version, _decode_groups(blobs))
            getattr(self, f"_op_{op}")(payload)

    # ------------------------------------------------------------------ operations

    def state_bytes(self) -> bytes:
        """The weights as one ``torch.save`` blob (blocking; the publication before weight
        transports)."""
        if not self.group.active:
            return self.policy.state_bytes()
        from policy.weights import to_bytes

        self._tell("weights")
        return to_bytes(self._op_weights())

    def _op_weights(self, _: Any = None) -> dict[str, torch.Tensor]:
        return gather_state(self.policy.weights(), self.group)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The weights as published (blocking, on the worker): a CPU copy of every tensor in
        :func:`publish_dtype` (floating ones only), contiguous. A copy, because the next
        step updates the policy in place while the copy is chunked and written. With
        several ranks, gathered whole on rank 0 one tensor at a time (the others get
        ``{}``)."""
        self._tell("snapshot")
        return self._op_snapshot()

    def _op_snapshot(self, _: Any = None) -> dict[str, torch.Tensor]:
        dtype = publish_dtype(self.cfg)

        def published(t: torch.Tensor) -> torch.Tensor:
            want = dtype if dtype is not None and t.is_floating_point() else t.dtype
            return t.detach().to(device="cpu", dtype=want, copy=True).contiguous()

        # Each tensor cast as soon as it is whole (gathered, with ranks); a parameter tied
        # under two names is one object in weights(keep_vars=True): published once.
        tensors = gather_state(self.policy.weights(keep_vars=True), self.group, cast=published)
        check_finite(tensors, self.version)
        return tensors

    def update(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """One whole step's update on ``groups`` (a resume's replay; blocking)."""
        if self.group.active:
            self._tell("update", (self.version, _encode_groups(groups)))
        return self._op_update((self.version, groups))

    def _op_update(self, payload: tuple[int, Sequence[Sequence[Sample]]]) -> dict[str, float]:
        version, groups = payload
        return grpo_update(self.module, self.optimizer, groups, self.cfg.trainer,
                           temperature=self.cfg.rollout.temperature, version=version,
                           device=self.device, reference=self.reference,
                           scheduler=self.scheduler, group=self.group)

    def step(self) -> RankedStep:
        """A step trained as its mini-batches arrive (trainer.update.GrpoStep, on every
        rank)."""
        return RankedStep(self, self.version)

    def _grpo_step(self, version: int) -> GrpoStep:
        if self._step is None:
            self._step = GrpoStep(self.module, self.optimizer, self.cfg.trainer,
                                  temperature=self.cfg.rollout.temperature, version=version,
                                  device=self.device, reference=self.reference,
                                  scheduler=self.scheduler, group=self.group)
        return self._step

    def _op_add(self, payload: tuple[int, Sequence[Sequence[Sample]]]) -> None:
        version, groups = payload
        self._grpo_step(version).add(groups)

    def _op_train(self, version: int) -> None:
        self._grpo_step(version).train()

    def _op_finish(self, version: int) -> dict[str, float]:
        step, self._step = self._grpo_step(version), None
        return step.finish()

    def checkpoint_format(self) -> str:
        """``trainer.checkpoint_format``, ``auto`` resolved: ``dcp`` with several ranks,
        ``full`` with one."""
        want = self.cfg.trainer.checkpoint_format
        if want != "auto":
            return want
        return "dcp" if self.group.active else "full"

    def shards_of(self, pt: Path) -> str:
        """Where the dcp shards of the checkpoint file ``pt`` go: the folder ``step-K.dcp``
        beside it, or of that name in the remote checkpoint folder (every rank writes its
        own there; a node's disk holds only its own ranks' shards)."""
        name = pt.with_suffix(".dcp").name
        if self.remote_checkpoints is None:
            return str(pt.with_suffix(".dcp"))
        return f"{self.remote_checkpoints.rstrip('/')}/{name}"

    def checkpoint_payload(self, pt: Path) -> dict[str, Any]:
        """What the checkpoint file ``pt`` (``step-K.pt``) holds besides its step and
        version: the whole model and optimizer (format full), or (dcp) the name of the
        folder (``step-K.dcp``, :meth:`shards_of`) every rank has just written its shard
        into, and the lr schedule. Blocking; every rank takes part."""
        if self.checkpoint_format() != "dcp":
            model, optimizer = self.checkpoint_state()
            return {"model": model, "optimizer": optimizer}
        shards = self.shards_of(pt)
        remove_shards(shards)  # an earlier attempt at this step
        self._tell("save_dcp", shards)
        self._op_save_dcp(shards)
        check_shards(shards)
        return {"format": "dcp", "shards": Path(shards).name,
                "lr_scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def shard_digests(self, pt: Path, contents: dict[str, Any]) -> dict[str, FileDigest]:
        """The digests of the dcp shards the checkpoint ``pt`` names in ``contents`` (none
        for a ``full`` one), by name under the checkpoint folder (trainer.integrity)."""
        if contents.get("format") != "dcp":
            return {}
        return folder_digests(self.shards_of(pt), str(contents["shards"]))

    def shards_at(self, pt: Path, name: str) -> str:
        """Where the shards folder ``name`` of the checkpoint file ``pt`` is on this node:
        beside the file when it is there (written with a local storage), else where this
        trainer writes them (the remote storage's checkpoint folder)."""
        beside = pt.with_name(name)
        return str(beside) if beside.is_dir() else self.shards_of(beside.with_suffix(".pt"))

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return {"model": get_model_state_dict(self.module),
                "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}

    def _op_save_dcp(self, folder: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), storage_writer=shards_writer(folder))

    def _op_load_dcp(self, payload: tuple[str, dict[str, Any] | None]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        folder, schedule = payload
        state = self._dcp_state()
        dcp.load(state, storage_reader=shards_reader(folder))
        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        if schedule is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(schedule)

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state dicts as a one-rank trainer has them (rank
        0; every tensor whole and on the CPU with several ranks)."""
        if not self.group.active:
            return self.module.state_dict(), self.optimizer.state_dict()
        self._tell("checkpoint_state")
        return self._op_checkpoint_state()

    def _op_checkpoint_state(self, _: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        return (gather_state(self.module.state_dict(), self.group),
                gather_state(self.optimizer.state_dict(), self.group))

    def load_checkpoint(self, path: str) -> None:
        """Model and optimizer from the checkpoint file ``path`` (read by rank 0 alone; the
        other ranks get their shards from it)."""
        ckpt = torch.load(path, map_location=self.device if not self.group.active else "cpu",
                          weights_only=True)
        if ckpt.get("format") == "dcp":  # every rank reads its shards from where they went
            payload = (self.shards_at(Path(path), ckpt["shards"]), ckpt.get("lr_scheduler"))
            self._tell("load_dcp", payload)
            self._op_load_dcp(payload)
            return
        if not self.group.active:
            self.module.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            return
        state = {"model": ckpt["model"], "optimizer": ckpt["optimizer"]}
        self._tell("load", skeleton(state))
        self._op_load(skeleton(state), state)

    def _op_load(self, shape: dict[str, Any], full: dict[str, Any] | None = None) -> None:
        current = self.module.state_dict()
        model = scatter_state(None if full is None else full["model"], shape["model"],
                              current, self.group)
        with torch.no_grad():
            for name, t in current.items():
                local_part(t).copy_(local_part(model[name]))
        like = _optimizer_like(self.optimizer, shape["optimizer"])
        optim = scatter_state(None if full is None else full["optimizer"], shape["optimizer"],
                              like, self.group)
        self.optimizer.load_state_dict(optim)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the Hugging Face model's state dict for an HF export (rank 0;
        gathered whole with several ranks)."""
        from trainer.export import capture_state

        if not self.group.active:
            return capture_state(self.module)
        self._tell("hf_state")
        return self._op_hf_state()

    def _op_profile(self, payload: tuple[str, tuple[Any, ...], list[Any]]) -> None:
        from trainer.rankprofile import follow_profile

        follow_profile(self.agent, self, payload)

    def _op_hf_state(self, _: Any = None) -> dict[str, torch.Tensor]:
        model = getattr(self.policy, "model", None)
        if model is None:
            raise TypeError(f"{type(self.policy).__name__} holds no Hugging Face model")
        # Copies: the export's thread writes them while the next step trains (a ddp replica's
        # tensors are whole already, and would be the live ones).
        return gather_state(model.state_dict(), self.group, cast=_cpu_copy)


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _remote(folder: str) -> bool:
    return "://" in folder


def shards_writer(folder: str) -> Any:
    """The dcp writer of the shards folder ``folder``: a local path, or an fsspec URL (a
    remote run.storage; torch's fsspec writer, a private module of the pinned torch)."""
    import torch.distributed.checkpoint as dcp

    if not _remote(folder):
        return dcp.FileSystemWriter(folder)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(folder)


def shards_reader(folder: str) -> Any:
    """The dcp reader of the shards folder ``folder`` (:func:`shards_writer`)."""
    import torch.distributed.checkpoint as dcp

    if not _remote(folder):
        return dcp.FileSystemReader(folder)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(folder)


def remove_shards(folder: str) -> None:
    """Remove the shards folder ``folder`` and what it holds (nothing when absent)."""
    if not _remote(folder):
        shutil.rmtree(folder, ignore_errors=True)
        return
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(folder)
    with contextlib.suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def check_shards(folder: str) -> None:
    """Every file a DCP checkpoint's metadata names is in ``folder`` (rank 0, after a save):
    ranks on other nodes write theirs on their own disk unless the folder is shared (or
    remote: then every rank writes there)."""
    meta = shards_reader(folder).read_metadata()
    storage = meta.storage_data or {}
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    if _remote(folder):
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(folder)
        missing = sorted(n for n in names if n and not fs.isfile(f"{root.rstrip('/')}/{n}"))
    else:
        missing = sorted(n for n in names if n and not (Path(folder) / n).is_file())
    if missing:
        raise RuntimeError(
            f"checkpoint shards {', '.join(missing)} are not in {folder}: the other nodes' "
            "ranks wrote them on their own disks; trainer.default_local_dir must be a folder "
            "every trainer node shares (or trainer.checkpoint_format=full)")


def _optimizer_like(optimizer: torch.optim.Optimizer, shape: dict[str, Any]) -> dict[str, Any]:
    """For each optimizer state tensor of a checkpoint (``shape``), the parameter it
    belongs to (its shard layout): params are numbered in param-group order, as in
    ``Optimizer.state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {i: {k: params[int(i)] for k in v} for i, v in shape.get("state", {}).items()
             if int(i) < len(params)}
    return {"state": state}


def memory_metrics(device: torch.device | str) -> dict[str, float]:
    """verl's ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb`` (the
    device's peaks since the trainer started; CUDA only) and ``perf/cpu_memory_used_gb``
    (the machine's used memory, as psutil says)."""
    gib = float(1 << 30)
    out = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / gib}
    dev = torch.device(device)
    if dev.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / gib
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / gib
    return out
