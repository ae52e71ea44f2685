"""The run's record (run.record): parquet segments (storage.record), the recorder that folds
each sample's verdict from the log and copies the samples stream into them (trainer.record)
against a real redis-server, the samples group's floor (Bus.trim_floor) and the record
written before retention trims the samples (trainer.retention)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import trainer.record as trainer_record
from bus import Bus, Consumer, RunKeys
from runschema.messages import (
    FIELD,
    Array,
    DeadLetter,
    Sample,
    StepFinished,
    StepStarted,
    WarningRaised,
    decode,
)
from storage.record import (
    COLUMNS,
    RecordCorrupt,
    RecordMark,
    last_mark,
    read_rows,
    segments,
    write_segment,
)
from trainer.record import Described, Recorder
from trainer.retention import trim_after_checkpoint

# --------------------------------------------------------------------------- helpers


def _row(k: int, step: int | None) -> dict[str, Any]:
    """A segment row with every column set (values that round-trip exactly)."""
    return {
        "step": step, "verdict": "trained" if step is not None else "not_trained",
        "reason": "", "data_source": "gsm8k", "prompt": f"question {k}: é ✓?",
        "response": f"answer {k}", "ground_truth": str(k), "score": k / 4,
        "entry_id": f"1700000000000-{k}", "sample_id": f"t{k}/1", "ticket_id": f"t{k}",
        "prompt_id": f"p{k}", "index": 1, "n": 2, "attempt": k % 3, "rank": 3,
        "min_version": 4 + k, "max_version": 5 + k, "finish_reason": "stop",
        "reward_error": "" if k % 2 else "ValueError: no number", "gen_time_s": 0.75,
        "ts": 1700000000.5 + k, "prompt_tokens": [1, 2, k], "response_tokens": [k, 9],
        "logprobs": [-0.5, -1.25], "raw": bytes([k, 0, 255]) * 3,
    }


def _sample(k: int, *, reward_error: str = "") -> Sample:
    return Sample(
        sample_id=f"t{k}/0", ticket_id=f"t{k}", prompt_id=f"p{k}", index=0, n=1,
        prompt_tokens=Array.of(np.asarray([k, k + 1], dtype=np.int32)),
        response_tokens=Array.of(np.asarray([100 + k, 7], dtype=np.int32)),
        logprobs=Array.of(np.asarray([-0.5, -0.25], dtype=np.float32)),
        reward=k / 8, min_version=k // 4, max_version=k // 4 + 1, rank=k % 2,
        gen_time_s=1.5, finish_reason="stop", ts=1000.0 + k, reward_error=reward_error)


def _describe(sample: Sample) -> Described:
    return Described(f"src-{sample.ticket_id}", f"prompt of {sample.ticket_id}",
                     f"gt-{sample.ticket_id}")


def _text(ids: Iterable[int]) -> str:
    return " ".join(str(i) for i in ids)


def _recorder(bus: Bus, keys: RunKeys, tmp_path: Path, folder: Path, *, mode: str = "all",
              jsonl_dir: Path | None = None) -> Recorder:
    return Recorder(bus, keys, folder, tmp_path / "events", mode=mode,  # type: ignore[arg-type]
                    describe=_describe, decode_text=_text, jsonl_dir=jsonl_dir)


async def _publish_samples(bus: Bus, keys: RunKeys, samples: list[Sample]) -> list[str]:
    return [await bus.publish(keys.samples, s) for s in samples]


async def _finished(bus: Bus, keys: RunKeys, step: int, entry_ids: list[str]) -> str:
    return await bus.publish(keys.events, StepFinished(
        step=step, sample_ids=[f"s{i}" for i in range(len(entry_ids))], metrics={},
        duration_s=0.1, param_version=step, entry_ids=entry_ids))


async def _refused(bus: Bus, keys: RunKeys, entry_id: str, reason: str,
                   source: str | None = None) -> str:
    return await bus.publish(keys.dlq, DeadLetter(
        source_stream=keys.samples if source is None else source, entry_id=entry_id,
        reason=reason, raw=b"", group="trainer", consumer="trainer-0"))


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, tuple[str, int | None, str]]:
    return {r["entry_id"]: (r["verdict"], r["step"], r["reason"]) for r in rows}


def _after(entry_id: str) -> str:
    """The id just past ``entry_id``."""
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


async def _ids(bus: Bus, stream: str) -> list[str]:
    return [e.id async for e in bus.read_all(stream)]


# --------------------------------------------------------------------------- storage.record


def test_segments_read_back_in_order_with_every_column_and_the_last_mark(
    tmp_path: Path
) -> None:
    folder = tmp_path / "record"
    rows = [_row(k, step) for k, step in enumerate([1, 1, None, 2, 2, None, 3])]
    assert all(set(r) == set(COLUMNS) for r in rows)
    first = RecordMark(through="1700000000000-2", events_position="5-0",
                       dead_letters_position="6-0", trained={"1700000000000-3": 2})
    second = RecordMark(through="1700000000000-6", events_position="9-1",
                        dead_letters_position="8-0", trained={"1700000000000-9": 4},
                        refused={"1700000000000-8": "stale"})
    p1 = write_segment(folder, rows[:3], first)
    assert last_mark(folder) == msgspec.structs.replace(first, segment=1)
    p2 = write_segment(folder, rows[3:], second)
    assert (p1.name, p2.name) == ("samples-000001.parquet", "samples-000002.parquet")
    assert segments(folder) == [p1, p2]
    # A stray file in the folder is not a segment.
    (folder / "notes.txt").write_text("not a segment")

    assert read_rows(folder) == rows  # every column, in order, across segments
    assert read_rows(folder, steps={2}) == rows[3:5]
    assert read_rows(folder, steps=[1, 3]) == [rows[0], rows[1], rows[6]]
    assert read_rows(folder, steps=[7]) == []
    picked = read_rows(folder, steps={2}, columns=["entry_id", "verdict"])
    assert [(r["entry_id"], r["verdict"]) for r in picked] == [
        (rows[3]["entry_id"], "trained"), (rows[4]["entry_id"], "trained")]
    mark = last_mark(folder)
    assert mark == msgspec.structs.replace(second, segment=2)
    assert mark is not None and mark.segment == 2


def test_no_segment_reads_as_nothing(tmp_path: Path) -> None:
    assert read_rows(tmp_path / "missing") == []
    assert last_mark(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert read_rows(tmp_path / "empty") == []
    assert last_mark(tmp_path / "empty") is None
    assert segments(tmp_path / "empty") == []


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])  # the trailing magic (PAR1)


def _flip_footer_length(data: bytes) -> bytes:
    at = len(data) - 6  # the footer's length, before the magic
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("damage", [_flip_last, _flip_footer_length, _truncate, _empty])
def test_a_damaged_segment_is_record_corrupt_naming_its_file(
    tmp_path: Path, damage: Any
) -> None:
    folder = tmp_path / "record"
    write_segment(folder, [_row(0, 1), _row(1, None)], RecordMark(through="1700000000000-1"))
    path = write_segment(folder, [_row(2, 2)], RecordMark(through="1700000000000-2"))
    path.write_bytes(damage(path.read_bytes()))
    for read in (last_mark, read_rows):
        with pytest.raises(RecordCorrupt) as caught:
            read(folder)
        message = str(caught.value)
        assert str(path) in message and "\n" not in message, message


def test_a_flipped_byte_in_a_text_value_is_record_corrupt(tmp_path: Path) -> None:
    """A flipped byte inside a stored text value (here the first byte of a ``reason``,
    stored literally in its page) makes the segment unreadable as text: read_rows says
    RecordCorrupt naming the file, like any other segment that does not read."""
    folder = tmp_path / "record"
    row = _row(0, None) | {"verdict": "refused", "reason": "refused: qwzx-unique-reason"}
    path = write_segment(folder, [row], RecordMark(through="1700000000000-0"))
    data = path.read_bytes()
    at = data.find(b"refused: qwzx-unique-reason")
    assert at > 0, "the reason is not stored literally: pick another way to damage it"
    path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])  # invalid UTF-8
    assert last_mark(folder) is not None  # the footer still reads
    with pytest.raises(RecordCorrupt) as caught:
        read_rows(folder)
    assert str(path) in str(caught.value)



def test_a_flipped_bit_in_a_samples_raw_bytes_is_record_corrupt(tmp_path: Path) -> None:
    """``raw`` is what a replay trains on, bit for bit: a segment whose stored bytes were
    flipped is RecordCorrupt (the module's promise), never read back as other bytes."""
    folder = tmp_path / "record"
    payload = b"RAW-PAYLOAD-unique-0123456789"
    path = write_segment(folder, [_row(0, 1) | {"raw": payload}],
                         RecordMark(through="1700000000000-0"))
    data = path.read_bytes()
    at = data.find(payload)
    assert at > 0, "the payload is not stored literally: pick another way to damage it"
    at += len(payload) // 2
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    try:
        got = read_rows(folder)
    except RecordCorrupt as exc:
        assert str(path) in str(exc)
    else:
        pytest.fail(f"a flipped bit read back without an error: raw {got[0]['raw']!r}, "
                    f"written {payload!r}")

# --------------------------------------------------------------------------- trainer.record


@pytest.mark.asyncio
async def test_recorder_records_below_the_cut_then_the_rest_each_once_with_verdicts(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    keys, folder = run_keys, tmp_path / "record"
    samples = [_sample(k, reward_error="ValueError: boom" if k == 4 else "")
               for k in range(12)]
    ids = await _publish_samples(bus, keys, samples[:4])
    junk = await bus.publish_raw(keys.samples, {FIELD: b"\xc1garbage"})
    ids += await _publish_samples(bus, keys, samples[4:6])
    other = await bus.publish(keys.samples, StepStarted(step=1, param_version=0))
    ids += await _publish_samples(bus, keys, samples[6:])
    assert len(ids) == 12
    await _finished(bus, keys, 1, [ids[0], ids[1], ids[2]])
    await _finished(bus, keys, 2, [ids[6], ids[9]])
    await _refused(bus, keys, ids[4], "invalid answer: reward failed")
    await _refused(bus, keys, junk, "undecodable bytes")  # the junk entry's own dead letter
    await _refused(bus, keys, ids[5], "not this stream's", source=keys.prompts)

    rec = _recorder(bus, keys, tmp_path, folder)
    assert await rec.record_below(ids[7]) == 7
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids[:7]  # the junk and the StepStarted skipped
    assert _verdicts(rows) == {
        ids[0]: ("trained", 1, ""), ids[1]: ("trained", 1, ""), ids[2]: ("trained", 1, ""),
        ids[3]: ("not_trained", None, ""),
        ids[4]: ("refused", None, "invalid answer: reward failed"),
        ids[5]: ("not_trained", None, ""),  # a dead letter of another stream
        ids[6]: ("trained", 2, ""),
    }
    mark = last_mark(folder)
    assert mark is not None and mark.through == ids[6] and mark.segment == 1

    # Every column of a row, from the sample, the data (describe) and the text decoder.
    raw4 = rows[4].pop("raw")
    assert decode(raw4) == samples[4]
    assert rows[4] == {
        "step": None, "verdict": "refused", "reason": "invalid answer: reward failed",
        "data_source": "src-t4", "prompt": "prompt of t4", "response": "104 7",
        "ground_truth": "gt-t4", "score": 0.5, "entry_id": ids[4], "sample_id": "t4/0",
        "ticket_id": "t4", "prompt_id": "p4", "index": 0, "n": 1, "attempt": 0, "rank": 0,
        "min_version": 1, "max_version": 2, "finish_reason": "stop",
        "reward_error": "ValueError: boom", "gen_time_s": 1.5, "ts": 1004.0,
        "prompt_tokens": [4, 5], "response_tokens": [104, 7], "logprobs": [-0.5, -0.25],
    }

    # A step finished after the first record: its verdict reaches the rest.
    await _finished(bus, keys, 3, [ids[10]])
    assert await rec.record_below(None) == 5
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids
    assert len(rows) == len(samples) and len({r["sample_id"] for r in rows}) == len(samples)
    assert {k: v for k, v in _verdicts(rows).items() if k in ids[7:]} == {
        ids[7]: ("not_trained", None, ""), ids[8]: ("not_trained", None, ""),
        ids[9]: ("trained", 2, ""), ids[10]: ("trained", 3, ""),
        ids[11]: ("not_trained", None, ""),
    }
    # ``raw`` is the very sample published, bit for bit.
    assert [decode(r["raw"]) for r in rows] == samples
    assert len(segments(folder)) == 2 and rec.recorded == 12
    mark = last_mark(folder)
    assert mark is not None and mark.through == ids[11] and mark.segment == 2
    assert other not in {r["entry_id"] for r in rows}

    # Nothing new: nothing written, no empty segment.
    assert await rec.record_below(None) == 0
    assert len(segments(folder)) == 2 and len(read_rows(folder)) == 12


@pytest.mark.asyncio
async def test_a_restarted_recorder_continues_from_the_last_segments_mark(
    bus: Bus, make_bus: Callable[..., Awaitable[Bus]], run_keys: RunKeys, tmp_path: Path
) -> None:
    keys, folder = run_keys, tmp_path / "record"
    samples = [_sample(k) for k in range(10)]
    ids = await _publish_samples(bus, keys, samples)
    step1 = await _finished(bus, keys, 1, [ids[0], ids[1], ids[7]])
    await _refused(bus, keys, ids[8], "stale")

    first = _recorder(bus, keys, tmp_path, folder)
    assert await first.record_below(ids[5]) == 5
    # The verdicts of samples not recorded yet are kept with the segment.
    mark = last_mark(folder)
    assert mark is not None and mark.through == ids[4]
    assert mark.trained == {ids[7]: 1} and mark.refused == {ids[8]: "stale"}

    # The trainer stops; step 1's StepFinished is gone from the stream (no archive holds it
    # either): only the record's mark knows its verdict for ids[7].
    await bus.command("XDEL", keys.events, step1)
    await _finished(bus, keys, 2, [ids[9]])

    again = _recorder(await make_bus(), keys, tmp_path, folder)
    assert await again.record_below(None) == 5
    assert again.recorded == 5
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids  # nothing twice, nothing missing
    assert len({r["sample_id"] for r in rows}) == len(samples)
    assert _verdicts(rows) == {
        ids[0]: ("trained", 1, ""), ids[1]: ("trained", 1, ""),
        **{ids[k]: ("not_trained", None, "") for k in (2, 3, 4, 5, 6)},
        ids[7]: ("trained", 1, ""), ids[8]: ("refused", None, "stale"),
        ids[9]: ("trained", 2, ""),
    }
    mark = last_mark(folder)
    assert mark is not None and mark.trained == {} and mark.refused == {}


@pytest.mark.asyncio
async def test_mode_trained_writes_trained_rows_and_verls_jsonl(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    keys = run_keys
    samples = [_sample(k) for k in range(6)]
    ids = await _publish_samples(bus, keys, samples)
    await _finished(bus, keys, 1, [ids[0], ids[2]])
    await _finished(bus, keys, 2, [ids[4]])
    await _refused(bus, keys, ids[1], "stale")

    trained = _recorder(bus, keys, tmp_path, tmp_path / "trained", mode="trained",
                        jsonl_dir=tmp_path / "rollout_data")
    assert await trained.record_below(ids[3]) == 2
    # A range with no trained sample: no row, but the record moves past it.
    assert await trained.record_below(ids[4]) == 0
    mark = last_mark(tmp_path / "trained")
    assert mark is not None and mark.through == ids[3] and mark.segment == 2
    assert await trained.record_below(None) == 1
    assert len(segments(tmp_path / "trained")) == 3
    rows = read_rows(tmp_path / "trained")
    assert _verdicts(rows) == {ids[0]: ("trained", 1, ""), ids[2]: ("trained", 1, ""),
                               ids[4]: ("trained", 2, "")}
    assert [r["entry_id"] for r in rows] == [ids[0], ids[2], ids[4]]

    def line(k: int, step: int) -> dict[str, Any]:
        return {"input": f"prompt of t{k}", "output": f"{100 + k} 7", "gts": f"gt-t{k}",
                "score": k / 8, "step": step}

    def jsonl(folder: Path) -> dict[str, list[dict[str, Any]]]:
        return {p.name: [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines()]
                for p in sorted(folder.iterdir())}

    expected = {"1.jsonl": [line(0, 1), line(2, 1)], "2.jsonl": [line(4, 2)]}
    assert jsonl(tmp_path / "rollout_data") == expected

    # mode "all": every sample in the record, only the trained ones in verl's dump.
    everything = _recorder(bus, keys, tmp_path, tmp_path / "all", mode="all",
                           jsonl_dir=tmp_path / "rollout_all")
    assert await everything.record_below(None) == 6
    assert [r["entry_id"] for r in read_rows(tmp_path / "all")] == ids
    assert jsonl(tmp_path / "rollout_all") == expected



@pytest.mark.asyncio
async def test_a_record_that_fails_midway_is_retried_from_its_last_segment(
    bus: Bus, run_keys: RunKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of two rows; the disk fails on the second: the call raises, the first
    segment stays, and the next call continues from it with every verdict."""
    keys, folder = run_keys, tmp_path / "record"
    samples = [_sample(k) for k in range(6)]
    ids = await _publish_samples(bus, keys, samples)
    await _finished(bus, keys, 1, ids)
    monkeypatch.setattr(trainer_record, "SEGMENT_ROWS", 2)
    calls = 0

    def failing_second(folder: Path, rows: Any, mark: RecordMark) -> Path:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(28, "No space left on device", str(folder))
        return write_segment(folder, rows, mark)

    monkeypatch.setattr(trainer_record, "write_segment", failing_second)
    rec = _recorder(bus, keys, tmp_path, folder)
    with pytest.raises(OSError):
        await rec.record_below(None)
    assert [r["entry_id"] for r in read_rows(folder)] == ids[:2]

    assert await rec.record_below(None) == 4
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids
    assert [(r["verdict"], r["step"]) for r in rows] == [("trained", 1)] * 6
    assert len(segments(folder)) == 3

# --------------------------------------------------------------------------- Bus.trim_floor


@pytest.mark.asyncio
async def test_trim_floor_is_the_oldest_pending_or_just_past_the_last_delivered(
    bus: Bus, run_keys: RunKeys
) -> None:
    stream = run_keys.samples
    assert await bus.trim_floor(stream) is None  # no stream
    ids = await _publish_samples(bus, run_keys, [_sample(k) for k in range(8)])
    assert await bus.trim_floor(stream) is None  # no group
    trainer = Consumer(bus, stream, "trainer", "trainer-0")
    await trainer.ensure_group()
    got = await trainer.read(count=5, block_ms=100)
    assert [d.id for d in got] == ids[:5]
    await trainer.ack(*got[:2])
    assert await bus.trim_floor(stream) == ids[2]  # the oldest pending
    await trainer.ack(got[3])
    assert await bus.trim_floor(stream) == ids[2]
    await trainer.ack(got[2], got[4])
    floor = await bus.trim_floor(stream)
    assert floor == _after(ids[4])  # none pending: just past the last delivered
    # What a trim below the floor removes is exactly what was delivered and acked.
    assert await bus.trim_safely(stream, minid=ids[7]) == 5
    assert await _ids(bus, stream) == ids[5:]
    assert await bus.trim_floor(stream) == floor

    # The lowest of every group's: the trainer done with all, a second group with one entry
    # pending.
    await trainer.ack(*await trainer.read(count=8, block_ms=100))
    assert await bus.trim_floor(stream) == _after(ids[7])
    other = Consumer(bus, stream, "other", "other-0")
    await other.ensure_group("0")
    late = await other.read(count=1, block_ms=100)
    assert [d.id for d in late] == [ids[5]]
    assert await bus.trim_floor(stream) == ids[5]
    await other.ack(*late)
    assert await bus.trim_floor(stream) == _after(ids[5])


# --------------------------------------------------------------------------- retention


async def _consumed(bus: Bus, keys: RunKeys, n: int, acked: int) -> list[str]:
    """``n`` samples, all delivered to the trainer's group, the first ``acked`` acked."""
    ids = await _publish_samples(bus, keys, [_sample(k) for k in range(n)])
    consumer = Consumer(bus, keys.samples, "trainer", "trainer-0")
    await consumer.ensure_group()
    got = await consumer.read(count=n, block_ms=100)
    assert [d.id for d in got] == ids
    await consumer.ack(*got[:acked])
    return ids


async def _trim(bus: Bus, keys: RunKeys, tmp_path: Path, trained: list[str],
                recorder: Recorder) -> WarningRaised | None:
    return await trim_after_checkpoint(
        bus, keys, tmp_path / keys.run_id, trained, keep_weights=3, keep_checkpoints=None,
        last_step=1, current=None, fence=(keys.trainer_lease, "host:1:token"),
        rollouter_ranks=(), recorder=recorder)


@pytest.mark.asyncio
async def test_retention_records_exactly_what_it_trims(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    keys, folder = run_keys, tmp_path / "record"
    ids = await _consumed(bus, keys, 10, acked=6)  # 6.. pending: the group's floor is ids[6]
    await _finished(bus, keys, 1, ids[:4])
    rec = _recorder(bus, keys, tmp_path, folder)
    assert await _trim(bus, keys, tmp_path, ids[:8], rec) is None
    assert await _ids(bus, keys.samples) == ids[6:]  # trimmed below the floor, not ids[7]
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids[:6]
    assert [r["verdict"] for r in rows] == ["trained"] * 4 + ["not_trained"] * 2


@pytest.mark.asyncio
async def test_a_record_that_cannot_be_written_trims_no_sample(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    keys = run_keys
    ids = await _consumed(bus, keys, 10, acked=10)
    await _finished(bus, keys, 1, ids[:5])
    folder = tmp_path / "record"
    folder.write_text("a file where the record folder should be")
    rec = _recorder(bus, keys, tmp_path, folder)
    warning = await _trim(bus, keys, tmp_path, ids[:5], rec)
    assert isinstance(warning, WarningRaised)
    assert warning.code == "record_not_written" and warning.source == "trainer"
    assert str(folder) in warning.message
    assert await _ids(bus, keys.samples) == ids  # nothing trimmed
    assert rec.recorded == 0

    # Once the folder can be written, the next retention records them, each once, and trims.
    folder.unlink()
    assert await _trim(bus, keys, tmp_path, ids[:5], rec) is None
    assert await _ids(bus, keys.samples) == ids[4:]
    rows = read_rows(folder)
    assert [r["entry_id"] for r in rows] == ids[:4]
    assert [(r["verdict"], r["step"]) for r in rows] == [("trained", 1)] * 4


def test_a_missing_segment_is_record_corrupt_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "record"
    for i in range(3):
        write_segment(folder, [_row(i, 1)], RecordMark(through=f"1700000000000-{i}"))
    (folder / "samples-000002.parquet").unlink()
    with pytest.raises(RecordCorrupt) as caught:
        read_rows(folder)
    line = str(caught.value)
    assert str(folder / "samples-000002.parquet") in line and "missing" in line
    assert "\n" not in line
