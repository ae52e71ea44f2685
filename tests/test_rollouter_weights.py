"""The rollouter's weights double buffer: fetch and decode off the generation thread, swap in
between batches; an unloadable publication is skipped with a warning, never loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bus import Bus, RunKeys
from rollouter.app import Rollouter
from rollouter.engine import EngineBroken
from runconfig import load_config
from runschema.messages import WarningRaised, WeightsPublished
from tests.procs import events_of
from weights.blobs import RedisBlobStore

pytestmark = pytest.mark.asyncio


def _rollouter(redis_url: str, run_id: str, out: Path, bus: Bus) -> Rollouter:
    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={out}"])
    r = Rollouter(cfg, bus)
    r.build()
    return r


async def _publish(bus: Bus, keys: RunKeys, version: int, blob: bytes) -> None:
    ref = await RedisBlobStore(bus, keys).put(f"weights-v{version}-test", blob)
    await bus.publish(keys.events, WeightsPublished(version=version, ref=ref, step=version))


async def test_staged_weights_swap_in_only_when_ready_or_needed(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    r = _rollouter(redis_url, run_id, tmp_path, bus)
    trained = _rollouter(redis_url, run_id, tmp_path, bus).engine.policy
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)
    await _publish(bus, run_keys, 0, r.engine.policy.state_bytes())
    await r.context.events.poll()
    await r.context.weights.swap()
    assert r.context.weights.version == 0
    await _publish(bus, run_keys, 1, trained.state_bytes())
    await r.context.events.poll()
    held = r.context.weights.held
    held.stage()
    assert held.staging is not None and held.staging[0].version == 1
    await held.staging[1]  # fetched and decoded while "generation" would go on
    await r.context.weights.swap(wait=False)
    assert r.context.weights.version == 1 and held.staging is None
    assert r.engine.policy.state_bytes() == trained.state_bytes()
    r.worker.shutdown()


async def test_an_unloadable_publication_is_skipped_with_a_warning(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    r = _rollouter(redis_url, run_id, tmp_path, bus)
    good = r.engine.policy.state_bytes()
    await _publish(bus, run_keys, 0, good)
    await _publish(bus, run_keys, 1, b"not a state dict")  # intact blob, wrong content
    await r.context.events.poll()
    await r.context.weights.swap()
    assert r.context.weights.version == 0, "fell back to the newest loadable publication"
    assert r.engine.policy.state_bytes() == good
    warnings = [e for e in await events_of(bus, run_keys.events)
                if isinstance(e, WarningRaised) and e.code == "weights_unloadable"]
    assert len(warnings) == 1 and "v1" in warnings[0].message
    r.worker.shutdown()


async def test_an_engine_broken_by_a_load_ends_the_rollouter_with_no_fallback(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    """A load that fails inside the engine and leaves it unusable (vLLM's in-place reload
    failing midway) is the rollouter's named end: no fallback load into the broken engine,
    no publication marked unloadable for it."""
    r = _rollouter(redis_url, run_id, tmp_path, bus)
    good = r.engine.policy.state_bytes()
    await _publish(bus, run_keys, 0, good)
    await r.context.events.poll()
    await r.context.weights.swap()
    loads: list[int] = []

    def broken_load(state: object, version: int) -> None:
        loads.append(version)
        raise EngineBroken(f"the engine failed to load weights v{version}")

    r.engine.load_state = broken_load  # type: ignore[method-assign]
    await _publish(bus, run_keys, 1, good)
    await r.context.events.poll()
    with pytest.raises(EngineBroken, match="v1"):
        await r.context.weights.swap()
    assert loads == [1] and r.context.weights.version == 0 and not r.context.weights.held.bad
    warnings = [e for e in await events_of(bus, run_keys.events) if isinstance(e, WarningRaised)]
    assert warnings == []
    r.worker.shutdown()
