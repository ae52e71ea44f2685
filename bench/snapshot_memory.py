"""Rank 0's memory while it gathers a bf16 publication of FSDP2-sharded float32 weights.

``python bench/snapshot_memory.py [--hidden 512 --layers 8]``: two gloo ranks shard a random
Qwen2 with FSDP2 (``trainer.sharding.shard_policy``); rank 0 then gathers the weights for a
bf16 publication two ways, alternately, three times each:

- *whole, then cast*: every tensor gathered whole in float32 (``gather_state`` without a
  cast), then each copied to bf16: what the trainer did before;
- *cast as gathered*: ``gather_state(..., cast=...)``, each tensor turned into its bf16 copy
  as soon as it is whole (what ``Learner.snapshot`` does now).

Printed: rank 0's resident memory above its level before the gather (peak, sampled every
millisecond by a thread; freed memory is handed back with glibc's ``malloc_trim`` before each
round, so reuse does not hide a peak), the publication's size, and the time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policy.hf import HFPolicy  # noqa: E402
from runconfig import load_config  # noqa: E402
from trainer.ranks import RankGroup, RankSpec  # noqa: E402
from trainer.sharding import gather_state, shard_policy  # noqa: E402

MIB = 1024 * 1024


class PeakRss:
    """The highest resident set size seen while it runs, in bytes above the start."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def above(self) -> int:
        return self.peak - self.base


def _give_back_freed() -> None:
    """glibc's malloc_trim: memory freed by the last round goes back to the system, so the
    next round's peak is not hidden by reuse of it."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()


def _whole_then_cast(model: HFPolicy, group: RankGroup) -> dict[str, Any]:
    whole = gather_state(model.weights(keep_vars=True), group)
    return {k: _bf16(t) for k, t in whole.items()}


def _cast_as_gathered(model: HFPolicy, group: RankGroup) -> dict[str, Any]:
    return gather_state(model.weights(keep_vars=True), group, cast=_bf16)


def _rank(rank: int, port: int, hidden: int, layers: int) -> None:
    import transformers

    torch.set_num_threads(1)
    group = RankGroup(RankSpec(rank=rank, world=2, local_rank=rank, addr="127.0.0.1", port=port),
                      torch.device("cpu"), 600.0)
    group.open()
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=8192, hidden_size=hidden,
                                   intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=8)
    model = HFPolicy(transformers.Qwen2ForCausalLM(cfg))
    shard_policy(model, load_config(None, ["trainer.strategy=fsdp2"]).trainer, group)
    fp32 = sum(p.numel() for p in model.parameters()) * 4
    for _ in range(3):
        for name, way in (("whole, then cast", _whole_then_cast),
                          ("cast as gathered", _cast_as_gathered)):
            _give_back_freed()
            dist.barrier()
            t0 = time.perf_counter()
            with PeakRss() as rss:
                out = way(model, group)
            took = time.perf_counter() - t0
            if rank == 0:
                size = sum(t.numel() * t.element_size() for t in out.values())
                print(f"{name:17s} peak +{rss.above / MIB:7.1f} MiB  publication "
                      f"{size / MIB:6.1f} MiB  (fp32 model {fp32 / MIB:6.1f} MiB)  "
                      f"{took:.3f} s", flush=True)
            del out
    group.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    from rlbus.redis_binary import free_port

    mp.spawn(_rank, args=(free_port(), args.hidden, args.layers), nprocs=2)


if __name__ == "__main__":
    main()
