"""The events archive file format (storage.archive), without Redis: round trip, torn tails,
re-archiving without duplicates, truncation, segments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage import archive
from storage.archive import MAGIC, append, last_archived, read_archive, segments, truncate_from


def _entries(n: int, start_ms: int = 1_700_000_000_000) -> list[tuple[str, list[bytes]]]:
    return [(f"{start_ms + i // 3}-{i % 3}", [b"m", f"payload {i}".encode() * (1 + i % 5)])
            for i in range(n)]


def _ids(folder: Path, **kw: str) -> list[str]:
    return [e.id for e in read_archive(folder, **kw)]


def test_round_trip_and_ranges(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    entries = _entries(50)
    assert append(folder, entries[:20]) == 20
    assert append(folder, entries[20:]) == 30
    got = list(read_archive(folder))
    assert [(e.id, e.fields) for e in got] == entries
    assert last_archived(folder) == entries[-1][0]
    ids = [i for i, _ in entries]
    assert _ids(folder, after=ids[9]) == ids[10:]
    assert _ids(folder, before=ids[5]) == ids[:5]
    assert _ids(folder, after=ids[9], before=ids[12]) == ids[10:12]
    assert list(read_archive(tmp_path / "missing")) == []
    assert last_archived(tmp_path / "missing") is None


def test_appending_an_archived_range_again_adds_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    entries = _entries(30)
    append(folder, entries[:20])
    archive._TAILS.clear()  # as a new process would see it
    assert append(folder, entries[:20]) == 0
    assert append(folder, entries[10:30]) == 10
    assert _ids(folder) == [i for i, _ in entries]


@pytest.mark.parametrize("cut_bytes", [1, 5, 9, 20])
def test_a_torn_last_record_is_ignored_then_replaced(tmp_path: Path, cut_bytes: int) -> None:
    folder = tmp_path / "events"
    entries = _entries(10)
    append(folder, entries)
    (path,) = segments(folder)
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # a crash in the middle of writing the last record
        fh.truncate(size - cut_bytes)
    archive._TAILS.clear()
    assert _ids(folder) == [i for i, _ in entries[:9]]
    assert last_archived(folder) == entries[8][0]
    # The next append cuts the torn record off and writes after the last whole one.
    assert append(folder, entries[9:] + _entries(3, start_ms=1_800_000_000_000)) == 4
    assert len(_ids(folder)) == 13


def test_a_corrupt_record_ends_its_segment(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    append(folder, _entries(5))
    (path,) = segments(folder)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the last payload: its CRC no longer matches
    path.write_bytes(bytes(data))
    archive._TAILS.clear()
    assert len(_ids(folder)) == 4


def test_truncate_from_drops_records_at_and_after_an_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(archive, "SEGMENT_BYTES", 300)  # many small segments
    folder = tmp_path / "events"
    entries = _entries(40)
    append(folder, entries)
    assert len(segments(folder)) > 3
    ids = [i for i, _ in entries]
    assert truncate_from(folder, ids[25]) == 15
    assert _ids(folder) == ids[:25]
    assert truncate_from(folder, ids[30]) == 0  # nothing at or after it
    # Rewritten from the stream: no duplicate, nothing lost, in order.
    assert append(folder, entries[20:]) == 15
    assert _ids(folder) == ids
    assert _ids(folder, after=ids[17]) == ids[18:]
    for path in segments(folder):
        assert path.read_bytes().startswith(MAGIC)


def test_segments_rotate_and_reads_skip_older_ones(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(archive, "SEGMENT_BYTES", 1000)
    folder = tmp_path / "events"
    entries = _entries(200)
    for i in range(0, 200, 7):
        append(folder, entries[i:i + 7])
    paths = segments(folder)
    assert len(paths) > 5
    assert all(p.stat().st_size < 1000 + 200 for p in paths)
    ids = [i for i, _ in entries]
    assert _ids(folder) == ids
    assert _ids(folder, after=ids[150]) == ids[151:]


def test_a_segment_torn_before_its_magic(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    entries = _entries(6)
    append(folder, entries[:3])
    bad = folder / "archive-000002.rlev"
    bad.write_bytes(MAGIC[:3])  # crashed while creating the next segment
    archive._TAILS.clear()
    assert _ids(folder) == [i for i, _ in entries[:3]]
    assert append(folder, entries) == 3
    assert _ids(folder) == [i for i, _ in entries]
    assert os.path.getsize(bad) > len(MAGIC)
