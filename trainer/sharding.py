"""How a policy is spread over the trainer's ranks, and how its whole state is gathered to
rank 0 and sent back from it.

``trainer.strategy`` ``fsdp``/``fsdp2`` shards with FSDP2 (``fully_shard``): each decoder
layer is one unit, the rest of the model (embeddings, final norm, head) the root unit;
gradients are *summed* across ranks (the divide factor is 1), because each rank's loss is
already its share of the mini-batch's token mean. ``ddp`` keeps a whole replica on every
rank (rank 0's weights broadcast at start) and sums the gradients with one ``all_reduce``
per optimizer step.

Mixed precision (verl's ``fsdp_config.mixed_precision``): the master weights and the
optimizer state are float32 on every strategy. The policy computes in
:func:`compute_dtype` (``trainer.fsdp_param_dtype``; an HF policy runs its forward in
autocast of it); FSDP2 all-gathers the parameters in that dtype (``MixedPrecisionPolicy``:
half the bytes of a float32 gather for bf16), and gradients are summed across ranks in
``trainer.fsdp_reduce_dtype`` (float32 by default, as in verl), ddp's ``all_reduce`` too.

The checkpoint format does not depend on the number of ranks: rank 0 gathers every tensor
whole, one at a time (:func:`gather_state`), and writes what a one-rank trainer writes; a
load sends each tensor from rank 0 and every rank keeps its shard (:func:`scatter_state`).
So a checkpoint written with 2 ranks resumes with 1, and the other way round.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from runconfig import TrainerConfig
from trainer.ranks import RankGroup

__all__ = [
    "TensorSpec",
    "compute_dtype",
    "gather_state",
    "local_part",
    "reduce_gradients",
    "scatter_state",
    "shard_policy",
    "skeleton",
    "unit_layers",
]


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def _reduce_dtype(tc: TrainerConfig) -> torch.dtype:
    """``trainer.fsdp_reduce_dtype`` as a torch dtype."""
    return torch.bfloat16 if _DTYPE_NAMES[tc.fsdp_reduce_dtype] == "bf16" else torch.float32


def compute_dtype(model_dtype: str, param_dtype: str) -> str:
    """The trainer's compute dtype, ``fp32`` or ``bf16``: ``trainer.fsdp_param_dtype``, whose
    ``auto`` follows ``model.dtype``."""
    return _DTYPE_NAMES[model_dtype if param_dtype == "auto" else param_dtype]


def _mixed_precision(policy: nn.Module, tc: TrainerConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy: parameters gathered in the dtype the policy computes in
    (an HF policy's autocast dtype; None, their own, for one without), gradients reduced in
    ``trainer.fsdp_reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = getattr(policy, "autocast", None)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=_reduce_dtype(tc))


def unit_layers(policy: nn.Module) -> list[nn.Module]:
    """The policy's repeated layers (the longest ``ModuleList`` in it: TinyGPT's blocks, a
    Hugging Face model's decoder layers): each becomes one FSDP2 unit."""
    longest: nn.ModuleList | None = None  # the first of the longest, as max() would pick
    for m in policy.modules():
        if isinstance(m, nn.ModuleList) and (longest is None or len(m) > len(longest)):
            longest = m
    return list(longest) if longest is not None else []


def shard_policy(policy: nn.Module, tc: TrainerConfig, group: RankGroup) -> None:
    """Spread ``policy`` over ``group`` in place (nothing on a group of one)."""
    if not group.active:
        return
    if tc.strategy == "ddp":
        with torch.no_grad():
            for t in _unique(policy.state_dict().values()):
                group.broadcast_(t)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    # FSDP2 warns that a unit returns views (TinyGPT's KV cache, the log-probs' slice) in
    # case an in-place op drops its pre-backward hook; the trainer never writes into them.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    mesh = init_device_mesh(group.device.type, (group.world,))
    kwargs: dict[str, Any] = {"mesh": mesh,
                              "reshard_after_forward": tc.fsdp_reshard_after_forward,
                              "mp_policy": _mixed_precision(policy, tc)}
    if tc.fsdp_offload_policy and group.device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in unit_layers(policy):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)
    # The trainer calls logprobs_and_entropy, not forward: gather the root's parameters
    # around it as around a forward.
    register_fsdp_forward_method(policy, "logprobs_and_entropy")
    for unit in (*unit_layers(policy), policy):  # each FSDP unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        # Gloo has no PREMUL_SUM: plain sums (a divide factor of 1 needs no scaling).
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def _unique(tensors: Any) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def reduce_gradients(policy: nn.Module, tc: TrainerConfig, group: RankGroup) -> None:
    """``ddp``: sum every gradient across ranks (one flat ``all_reduce`` in
    ``trainer.fsdp_reduce_dtype``). FSDP2 has reduce-scattered them in the backward
    already."""
    if not group.active or tc.strategy != "ddp":
        return
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if not grads:
        return
    summed = torch.cat([g.reshape(-1).to(_reduce_dtype(tc)) for g in grads])
    group.sum_(summed)
    at = 0
    for g in grads:
        n = g.numel()
        g.copy_(summed[at:at + n].view_as(g).to(g.dtype))
        at += n


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its shard of a DTensor (the parameter's own storage),
    ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a sharded one: every rank must call this)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_state(state: Mapping[str, Any], group: RankGroup,
                 cast: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
    """``state`` (a state dict, nested dicts and lists allowed) with every tensor whole, on
    rank 0 (every rank calls this; the others get ``{}``). Tensors are gathered one at a
    time, in the dict's order, and each goes through ``cast`` as soon as it is whole (by
    default moved to the CPU; one that is whole there already is returned as is, the live
    tensor: pass a copying ``cast`` to keep it), so rank 0 never holds more than the result
    plus one whole tensor: a publication in bf16 never needs the float32 model whole. One
    tensor object named
    twice (tied weights in a ``state_dict(keep_vars=True)``) is gathered once and stays one
    object."""
    out = _gather_tree(dict(state), group, cast, {})
    return out if group.rank == 0 else {}


def _gather_tree(node: Any, group: RankGroup,
                 cast: Callable[[torch.Tensor], torch.Tensor] | None, done: dict[int, Any]
                 ) -> Any:
    if isinstance(node, torch.Tensor):
        # Every rank holds the same objects in the same places (one model, sharded): the
        # memo skips the same collectives on every rank.
        if id(node) not in done:
            done[id(node)] = _whole(node, group, cast)
        return done[id(node)]
    if isinstance(node, dict):
        return {k: _gather_tree(v, group, cast, done) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(_gather_tree(v, group, cast, done) for v in node)
    return node


def _whole(t: torch.Tensor, group: RankGroup,
           cast: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
    full = _full(t).detach()
    if group.rank != 0:
        return None
    if cast is not None:
        return cast(full)
    # A tensor whole and on the CPU already comes back as is (its live storage): a
    # checkpoint is written before training goes on, and a copy of the model and its Adam
    # state would double rank 0's memory. Callers that keep it longer pass a copying cast.
    return full if full.device.type == "cpu" else full.to("cpu")


class TensorSpec:
    """A tensor's place in a :func:`skeleton`: its shape and dtype."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype

    def __reduce__(self) -> tuple[Any, ...]:
        return (_spec, (self.shape, self.dtype))


def _spec(shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
    return TensorSpec(torch.empty(shape, dtype=dtype, device="meta"))


def skeleton(node: Any) -> Any:
    """``node`` with its tensors replaced by :class:`TensorSpec` (what rank 0 sends before
    the tensors of a checkpoint it loads)."""
    if isinstance(node, torch.Tensor):
        return TensorSpec(node)
    if isinstance(node, dict):
        return {k: skeleton(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return type(node)(skeleton(v) for v in node)
    return node


def scatter_state(full: Any, shape: Any, like: Any, group: RankGroup) -> Any:
    """Rank 0's ``full`` state (the others pass ``None``; every rank passes the same
    ``shape``, a :func:`skeleton` of it) sent to every rank, each tensor shaped like its
    counterpart in ``like`` (sharded like it when ``like``'s is a DTensor of the same global
    shape; whole otherwise). Tensors go one at a time, in the skeleton's order."""
    if isinstance(shape, TensorSpec):
        mine = full if group.rank == 0 else torch.empty(shape.shape, dtype=shape.dtype)
        return _send(mine, like, group)
    if isinstance(shape, dict):
        return {k: scatter_state(None if full is None else full[k], v, _at(like, k), group)
                for k, v in shape.items()}
    if isinstance(shape, list | tuple):
        return type(shape)(scatter_state(None if full is None else full[i], v, _at(like, i),
                                         group) for i, v in enumerate(shape))
    return shape


def _at(like: Any, key: Any) -> Any:
    try:
        return like[key]
    except (KeyError, IndexError, TypeError):
        return None


def _send(t: torch.Tensor, like: Any, group: RankGroup) -> torch.Tensor:
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(t.shape):
        src = t.to(device=like.to_local().device, dtype=like.dtype)
        return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=0)
    if not group.active:
        return t
    device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
    out = t.to(device)
    group.broadcast_(out)
    return out
