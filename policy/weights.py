"""Weights blob format: a state dict as bytes (torch.save zip), for publish and load.

torch.save is deterministic for equal tensors (same bytes, same sha256), keeps any dtype and
tied weights, and `from_bytes` loads with `weights_only=True`, so a blob read from Redis cannot
run code.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import torch

__all__ = ["from_bytes", "to_bytes"]


def to_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise a state dict as CPU tensors."""
    cpu: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        # torch.save writes a tensor's whole storage; copy views so a slice stays small.
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        cpu[name] = t
    buf = io.BytesIO()
    torch.save(cpu, buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `to_bytes`: a state dict of CPU tensors."""
    sd = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError("weights blob does not hold a state dict of tensors")
    return sd
