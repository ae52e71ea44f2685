"""storage.files: atomic writes in a real folder (content, no temp file left, a file replaced
whole)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.archive import fsync_path as archive_fsync_path
from storage.files import atomic_file, atomic_write, fsync_path


def test_atomic_write_creates_the_file_and_leaves_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    atomic_write(target, b'{"a": 1}\n')
    assert target.read_bytes() == b'{"a": 1}\n'
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_an_existing_file_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    target.write_bytes(b"old content, longer than the new one")
    with open(target, "rb") as old:  # a reader that opened the old file keeps reading it
        atomic_write(target, memoryview(b"new"))
        assert old.read() == b"old content, longer than the new one"
    assert target.read_bytes() == b"new"  # not the new bytes over the old file's head
    assert os.listdir(tmp_path) == ["blob"]


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "trace.json.gz"
    target.write_bytes(b"complete")
    with pytest.raises(RuntimeError, match="export failed"), atomic_file(target) as fh:
        fh.write(b"half of a")
        raise RuntimeError("export failed")
    assert target.read_bytes() == b"complete"
    assert os.listdir(tmp_path) == ["trace.json.gz"]


def test_streaming_writes_not_durable_and_mode(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.pickle"
    with atomic_file(target, durable=False, mode=0o600) as fh:
        for part in (b"a", b"b", b"c"):
            fh.write(part)
    assert target.read_bytes() == b"abc"
    assert target.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["snapshot.pickle"]


def test_fsync_path_takes_files_and_folders_and_stays_importable_from_archive(
    tmp_path: Path,
) -> None:
    (tmp_path / "f").write_bytes(b"x")
    fsync_path(tmp_path / "f")
    fsync_path(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "missing")
    assert archive_fsync_path is fsync_path
