"""``rlbus inspect --samples --step K``: the prompts, responses and scores a step trained.

Read from the run's record (trainer.record: what retention trimmed, and the whole run once it
ended), else from the samples stream (a live run's newest steps: the entries the step's
StepFinished names, decoded with the run's tokenizer). One line per sample, or one JSON
object per sample with ``--json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from bus import Bus, RunKeys
from runconfig import Config
from runconfig.paths import events_dir, record_dir
from runschema.messages import Sample, StepFinished
from runtime.history import find_archive, read_history
from storage.record import RecordCorrupt, read_rows

__all__ = ["print_step_samples"]

_SHOWN = ("step", "verdict", "sample_id", "score", "data_source", "prompt", "response",
          "ground_truth", "min_version", "max_version", "finish_reason", "reward_error")


async def _from_stream(url: str, run_id: str, step: int, archive: Path) -> list[Sample]:
    """The samples step ``step``'s StepFinished names that the stream still holds."""
    bus = Bus.from_url(url)
    keys = RunKeys(run_id)
    try:
        folder = await find_archive(bus, keys, archive)
        ids: list[str] = []
        async for entry in read_history(bus, keys.events, folder or archive):
            if isinstance(entry.msg, StepFinished) and entry.msg.step == step:
                ids = list(entry.msg.entry_ids)
        found = await bus.read_ids(keys.samples, ids) if ids else {}
        return [m for eid in ids if isinstance(m := found.get(eid), Sample)]
    finally:
        await bus.close()


def _rows_of_stream(cfg: Config, step: int, samples: list[Sample]) -> list[dict[str, Any]]:
    from trainer.record import TextDecoder

    decode = TextDecoder(cfg.model).decode
    return [{"step": step, "verdict": "trained", "sample_id": s.sample_id,
             "score": s.reward, "data_source": "", "prompt": decode(s.prompt_tokens.numpy()),
             "response": decode(s.response_tokens.numpy()), "ground_truth": "",
             "min_version": s.min_version, "max_version": s.max_version,
             "finish_reason": s.finish_reason, "reward_error": s.reward_error}
            for s in samples]


def _line(row: dict[str, Any]) -> str:
    prompt = " ".join(str(row["prompt"]).split())
    response = " ".join(str(row["response"]).split())
    truth = f" (truth {row['ground_truth']})" if row.get("ground_truth") else ""
    return (f"{row['sample_id']:<12} score {row['score']:.3f} v{row['min_version']}"
            f"{'' if row['min_version'] == row['max_version'] else '-' + str(row['max_version'])}"
            f"  {prompt!r} -> {response!r}{truth}")


def print_step_samples(cfg: Config, step: int, as_json: bool) -> int:
    """Print step ``step``'s samples; exit 1 when none are found, 2 for a corrupt record."""
    from rlbus.launcher import RunDataMissing, redis_for_reading
    from rlbus.replay import fetch_record

    run_id = cfg.run.id or ""
    fetch_record(cfg, run_id, "rlbus inspect")
    try:
        rows = [r for r in read_rows(record_dir(cfg, run_id), steps={step},
                                     columns=list(_SHOWN)) if r["verdict"] == "trained"]
    except RecordCorrupt as exc:
        print(f"rlbus inspect: error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        try:
            with redis_for_reading(cfg) as url:
                samples = asyncio.run(_from_stream(url, run_id, step, events_dir(cfg, run_id)))
        except RunDataMissing as exc:
            print(f"rlbus inspect: error: {exc}", file=sys.stderr)
            return 1
        rows = _rows_of_stream(cfg, step, samples)
    if not rows:
        print(f"rlbus inspect: run {run_id!r}: no samples of step {step} in its record "
              f"({record_dir(cfg, run_id)}) or its samples stream", file=sys.stderr)
        return 1
    try:
        for row in rows:
            print(json.dumps({k: row[k] for k in _SHOWN}, ensure_ascii=False) if as_json
                  else _line(row))
        if not as_json:
            mean = sum(float(r["score"]) for r in rows) / len(rows)
            print(f"step {step}: {len(rows)} samples, mean score {mean:.3f}", flush=True)
    except BrokenPipeError:  # `... | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
