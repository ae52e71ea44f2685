"""The run's record (``run.record``): every sample the trainer consumed, with its verdict,
copied to parquet segments (storage.record) before retention trims it from the samples stream,
and the rest at the run's end.

A follower in the eventsourcing sense: its output (the segments) carries its tracking
positions (storage.record.RecordMark), so a trainer that starts again continues where the
last segment stops. A sample's verdict is folded from the log, not from the trainer's memory:

- ``trained`` at step K: its entry id is in step K's StepFinished (``entry_ids``);
- ``refused``: a dead letter of the samples stream names its entry id (the reason is the
  dead letter's; dead letters beyond ``redis.dead_letter_max`` are gone, and so is their
  reason: then ``not_trained``);
- ``not_trained``: neither (a second copy of a sample already trained, an attempt another
  attempt beat, a sample left when the run ended).

Only what a trim may remove is recorded before it: entries below the samples group's floor
(bus.Bus.trim_floor), all of them done with. With ``run.record=trained`` only trained rows
are written; ``trainer.rollout_data_dir`` gets verl's JSONL of the trained rows as well
(``{step}.jsonl``: ``input``, ``output``, ``gts``, ``score``, ``step``).

All file work and text decoding run on a worker thread (asyncio.to_thread), never on the loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from bus import Bus, RunKeys, entry_key
from runschema.messages import (
    FIELD,
    Array,
    DeadLetter,
    DecodeError,
    Sample,
    StepFinished,
    decode,
)
from runtime.history import read_history
from storage.record import RecordMark, last_mark, write_segment

__all__ = ["Described", "Recorder", "TextDecoder", "columns_of"]

SEGMENT_ROWS = 2048
"""Rows per segment at most (a segment is built in memory before it is written)."""

SEGMENT_BYTES = 32 * 1024 * 1024
"""Raw sample bytes per segment at most."""

_PAGE = 500


class Described(NamedTuple):
    """What the data say of a sample's prompt: its source, text and ground truth."""

    data_source: str
    prompt: str
    ground_truth: str


class _Pending(NamedTuple):
    entry_id: str
    sample: Sample
    raw: bytes
    step: int | None
    verdict: str
    reason: str
    described: Described


def columns_of(pending: Sequence[_Pending], decode_text: Callable[..., str] | None
            ) -> dict[str, Any]:
    """The columns of storage.record.COLUMNS for ``pending`` (blocking: the text decoding).
    Token ids and log-probs go from each sample's bytes to arrow lists without Python lists;
    a prompt without text from the data is decoded once per ticket; a conversation's
    response is decoded whole (``decode_text(ids, whole=True)``: :meth:`TextDecoder.decode`),
    tool answers included, as its reward function read it."""
    import numpy as np
    import pyarrow as pa

    samples = [p.sample for p in pending]
    dtypes: dict[str, np.dtype[Any]] = {}

    def view(a: Array) -> np.ndarray:  # Array.numpy without building its dtype each time
        dtype = dtypes.get(a.dtype)
        if dtype is None:
            dtype = dtypes.setdefault(a.dtype, np.dtype(a.dtype))
        return np.frombuffer(a.data, dtype=dtype)

    asked = [view(s.prompt_tokens) for s in samples]
    answered = [view(s.response_tokens) for s in samples]
    prompts: dict[str, str] = {}
    prompt_text, responses = [], []
    for p, tokens, response in zip(pending, asked, answered, strict=True):
        text = p.described.prompt
        if not text and decode_text is not None:
            tid = p.sample.ticket_id
            text = prompts.get(tid) or prompts.setdefault(tid, decode_text(tokens.tolist()))
        prompt_text.append(text)
        if decode_text is None:
            responses.append("")
        elif p.sample.num_turns:  # a conversation: every turn, as its reward read it
            responses.append(decode_text(response.tolist(), whole=True))
        else:
            responses.append(decode_text(response.tolist()))

    def listed(arrays: list[np.ndarray], dtype: Any) -> Any:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        values = np.concatenate(arrays) if arrays else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(dtype)))

    return {
        "step": [p.step for p in pending], "verdict": [p.verdict for p in pending],
        "reason": [p.reason for p in pending],
        "data_source": [p.described.data_source for p in pending], "prompt": prompt_text,
        "response": responses, "ground_truth": [p.described.ground_truth for p in pending],
        "score": [float(s.reward) for s in samples],
        "entry_id": [p.entry_id for p in pending], "sample_id": [s.sample_id for s in samples],
        "ticket_id": [s.ticket_id for s in samples], "prompt_id": [s.prompt_id for s in samples],
        "index": [s.index for s in samples], "n": [s.n for s in samples],
        "attempt": [s.attempt for s in samples], "rank": [s.rank for s in samples],
        "min_version": [s.min_version for s in samples],
        "max_version": [s.max_version for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "reward_error": [s.reward_error for s in samples],
        "gen_time_s": [float(s.gen_time_s) for s in samples],
        "ts": [float(s.ts) for s in samples],
        "prompt_tokens": listed(asked, np.int32), "response_tokens": listed(answered, np.int32),
        "logprobs": listed([view(s.logprobs) for s in samples], np.float32),
        "raw": [p.raw for p in pending],
    }


def _write_jsonl(folder: Path, columns: dict[str, Any]) -> None:
    """verl's ``rollout_data_dir`` dump of the trained rows: ``{step}.jsonl``, appended."""
    by_step: dict[int, list[int]] = {}
    for i, step in enumerate(columns["step"]):
        if step is not None:
            by_step.setdefault(step, []).append(i)
    folder.mkdir(parents=True, exist_ok=True)
    for step, rows in by_step.items():
        with open(folder / f"{step}.jsonl", "a", encoding="utf-8") as fh:
            for i in rows:
                fh.write(json.dumps({"input": columns["prompt"][i],
                                     "output": columns["response"][i],
                                     "gts": columns["ground_truth"][i],
                                     "score": columns["score"][i], "step": step},
                                    ensure_ascii=False) + "\n")


class TextDecoder:
    """Token ids to text with the run's tokenizer, built on first use on the thread that
    decodes (the recorder's worker thread: its own instance, not the loop's)."""

    def __init__(self, model_cfg: Any) -> None:
        self.model_cfg = model_cfg
        self.tokenizer: Any = None

    def decode(self, ids: Iterable[int], whole: bool = False) -> str:
        """The text of ``ids`` up to the first end token; ``whole``: all of them, special
        tokens skipped (a conversation's turns, as verl's reward managers decode them)."""
        if self.tokenizer is None:
            from policy.text import build_tokenizer

            self.tokenizer = build_tokenizer(self.model_cfg)
        if whole:
            from policy.text import decode_conversation

            return decode_conversation(self.tokenizer, ids)
        return self.tokenizer.decode(ids)  # type: ignore[no-any-return]


class Recorder:
    """Writes run ``keys``'s record into ``folder`` (one per trainer incarnation).

    ``describe(sample)``: the data's source, prompt text and ground truth of a sample's
    prompt (cheap: a lookup); ``decode_text``: token ids to text (run on the worker thread;
    None: no text columns). ``archive``: the events archive folder (the fold reads it, then
    the stream: runtime.history). ``push``: uploads the folder's new segments to
    ``run.storage`` (blocking; before :meth:`record_below` returns, so before the trim)."""

    def __init__(self, bus: Bus, keys: RunKeys, folder: Path, archive: Path, *,
                 mode: Literal["all", "trained"], describe: Callable[[Sample], Described],
                 decode_text: Callable[..., str] | None = None,
                 jsonl_dir: Path | None = None, push: Callable[[], None] | None = None
                 ) -> None:
        self.bus, self.keys, self.folder, self.archive = bus, keys, folder, archive
        self.mode, self.describe, self.decode_text = mode, describe, decode_text
        self.jsonl_dir = jsonl_dir
        self.push = push
        """Uploads the new segments to run.storage (trainer.mirror), before the trim."""
        self.mark: RecordMark | None = None
        self.recorded = 0
        """Rows this incarnation wrote."""

    async def _start(self) -> RecordMark:
        if self.mark is None:
            self.mark = await asyncio.to_thread(last_mark, self.folder) or RecordMark()
        return self.mark

    async def _fold(self, mark: RecordMark) -> RecordMark:
        """The verdicts the log gave since ``mark``'s positions."""
        trained, refused = dict(mark.trained), dict(mark.refused)
        events_at = mark.events_position
        async for entry in read_history(self.bus, self.keys.events, self.archive,
                                        events_at if events_at != "0-0" else "0"):
            events_at = entry.id
            if isinstance(entry.msg, StepFinished):
                for eid in entry.msg.entry_ids:
                    trained[eid] = entry.msg.step
        letters_at = mark.dead_letters_position
        while True:
            entries, cursor = await self.bus.read_after(self.keys.dlq, letters_at, count=_PAGE)
            for entry in entries:
                msg = entry.msg
                if isinstance(msg, DeadLetter) and msg.source_stream == self.keys.samples:
                    refused[msg.entry_id] = msg.reason
            if cursor == letters_at:
                break
            letters_at = cursor
        return msgspec.structs.replace(mark, events_position=events_at,
                                       dead_letters_position=letters_at, trained=trained,
                                       refused=refused)

    def _judge(self, mark: RecordMark, entry_id: str, fields: list[bytes]) -> _Pending | None:
        """A samples entry with its verdict (None: not a sample, or not recorded)."""
        step = mark.trained.pop(entry_id, None)
        reason = mark.refused.pop(entry_id, "")  # junk's dead letters too: the mark stays small
        raw = _field(fields)
        try:
            msg = decode(raw)
        except DecodeError:
            return None  # junk: its dead letter holds its bytes
        if not isinstance(msg, Sample) or raw is None:
            return None
        verdict = "trained" if step is not None else "refused" if reason else "not_trained"
        if verdict != "trained" and self.mode == "trained":
            return None
        return _Pending(entry_id, msg, raw, step, verdict, reason, self.describe(msg))

    async def record_below(self, cut: str | None) -> int:
        """Record the samples entries after the last recorded one and before ``cut`` (None:
        all of them: the run's end). Returns the rows written. Raises OSError when a segment
        could not be written (then the caller must not trim)."""
        try:
            return await self._record(cut)
        except BaseException:
            self.mark = None  # its verdict maps were consumed: read the last segment's again
            raise

    async def _record(self, cut: str | None) -> int:
        mark = await self._fold(await self._start())
        end = "+" if cut is None else f"({cut}"
        written = 0
        batch: list[_Pending] = []
        size = 0
        after = mark.through
        while True:
            _, page = await self.bus.read_page(self.keys.samples, after, end, count=_PAGE)
            for entry_id, fields in page:
                after = entry_id
                item = self._judge(mark, entry_id, fields)
                if item is None:
                    continue
                batch.append(item)
                size += len(item.raw)
                if len(batch) >= SEGMENT_ROWS or size >= SEGMENT_BYTES:
                    mark = await self._write(batch, mark, after)
                    written, batch, size = written + len(batch), [], 0
            if len(page) < _PAGE:
                break
        if batch or entry_key(after) > entry_key(mark.through):
            mark = await self._write(batch, mark, after)
            written += len(batch)
        if self.push is not None:  # on a remote storage: there before the trim
            await asyncio.to_thread(self.push)
        self.mark = mark
        self.recorded += written
        return written

    async def _write(self, batch: list[_Pending], mark: RecordMark, through: str
                     ) -> RecordMark:
        mark = msgspec.structs.replace(mark, through=through)
        rows = await asyncio.to_thread(columns_of, batch, self.decode_text)
        if self.jsonl_dir is not None:  # first: a failed segment is written again, lines too
            await asyncio.to_thread(_write_jsonl, self.jsonl_dir, rows)
        await asyncio.to_thread(write_segment, self.folder, rows, mark)
        self.mark = mark
        return mark


def _field(fields: list[bytes]) -> bytes | None:
    """The message bytes of a raw entry's fields (``[name, value, ...]``)."""
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == FIELD:
            return bytes(fields[i + 1])
    return None
