"""trainer.sharding.gather_state on rank 0 of a group of one (no collectives): a tensor
whole on the CPU comes back as is unless the cast copies it; each tensor is cast as it
comes; tied weights are gathered once."""

from __future__ import annotations

import torch
from torch import nn

from trainer.ranks import RankGroup
from trainer.sharding import gather_state


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # a head tied to the embedding
    return model


def test_a_whole_cpu_tensor_comes_back_as_is_unless_a_cast_copies_it() -> None:
    model, group = _tied(), RankGroup(None, torch.device("cpu"), 0.0)
    # A checkpoint (written before training goes on): no copy of model and optimizer.
    live = gather_state(model.state_dict(), group)
    assert live["0.weight"].data_ptr() == model[0].weight.data_ptr()
    # An HF export (written while the next step trains): its own copy.
    own = gather_state(model.state_dict(), group, cast=lambda t: t.to("cpu", copy=True))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(live["0.weight"], model[0].weight)
    assert not torch.equal(own["0.weight"], model[0].weight)


def test_tied_weights_are_gathered_once_and_cast_as_they_come() -> None:
    model = _tied()
    seen: list[torch.dtype] = []

    def cast(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return t.to(torch.bfloat16, copy=True)

    state = gather_state(model.state_dict(keep_vars=True),
                         RankGroup(None, torch.device("cpu"), 0.0), cast=cast)
    assert seen == [torch.float32]  # one tensor, named twice
    assert state["0.weight"] is state["1.weight"]
    assert state["0.weight"].dtype == torch.bfloat16
    assert torch.equal(state["0.weight"], model[0].weight.detach().to(torch.bfloat16))
