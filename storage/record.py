"""The run's record: every sample the trainer consumed, kept as parquet segment files.

Pure file code (no Redis): :mod:`trainer.record` decides what goes in and when (as retention
trims the samples stream, and at the run's end); this module writes and reads the files.

Layout: a folder (``run.output_dir/RUN/record/``) of segment files ``samples-000001.parquet``,
``samples-000002.parquet``, ... in samples-stream order, each one parquet table of
:data:`COLUMNS` (verl's field names where verl has them: ``prompt``, ``response``, ``score``,
``data_source``, ``step``; then rlbus's), readable with pyarrow, pandas or
``datasets.load_dataset("parquet", data_files=...)``. ``raw`` holds the sample exactly as the
stream held it (runschema.messages.encode): what a replay trains on, bit for bit.

A segment's schema metadata (key :data:`MARK_KEY`) holds the writer's tracking position
(:class:`RecordMark`): the samples entry it recorded through, the events and dead-letter
positions its verdicts were folded up to, and the verdicts it read for samples not recorded
yet. A writer that starts again continues from the newest segment's mark, so state is folded
incrementally and nothing is recorded twice.

Crash safety: a segment is written whole (a temporary file, fsynced, renamed, the folder
fsynced): a crash leaves it or nothing. Its pages carry checksums, verified on reading: a
segment that does not read (flipped bytes, a truncated copy) is :class:`RecordCorrupt`, one
line naming the file, never a wrong value.

Functions (all blocking: call them from a worker thread)
    ``write_segment(folder, rows, mark) -> Path``
    ``last_mark(folder) -> RecordMark | None``
    ``read_rows(folder, steps=None, columns=None) -> list[dict]``
    ``segments(folder) -> list[Path]``
    ``write_validation(folder, step, version, rank, columns) -> Path``

Validations: every answer of each validation, written by the rollouter that served it as
``validation-STEP-vVERSION-rRANK.parquet`` in the same folder (on that rollouter's node).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from storage.files import atomic_file, fsync_path, numbered_files

__all__ = ["COLUMNS", "MARK_KEY", "VALIDATION_COLUMNS", "RecordCorrupt", "RecordMark",
           "last_mark", "read_rows", "segments", "write_segment", "write_validation"]

MARK_KEY = b"rlbus.record"

_NAME = re.compile(r"^samples-(\d{6,})\.parquet$")


class RecordCorrupt(Exception):
    """A record segment that does not read: its path and why, in one line."""


class RecordMark(msgspec.Struct, frozen=True):
    """Where the record's writer stands (kept in every segment's metadata)."""

    through: str = "0-0"
    """The samples-stream entry recorded through (every entry at or before it is in a segment
    or was not a sample)."""
    events_position: str = "0-0"
    """The events entry its StepFinished fold read through."""
    dead_letters_position: str = "0-0"
    """The dead-letter entry its refusal fold read through."""
    trained: dict[str, int] = {}
    """Samples entries trained (by step) that are not recorded yet."""
    refused: dict[str, str] = {}
    """Samples entries dead-lettered (with the reason) that are not recorded yet."""
    segment: int = 0
    """The number of the segment this mark was written with."""


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([
        ("step", pa.int64()),  # the step that trained it; null: not trained
        ("verdict", pa.string()),  # trained | refused | not_trained
        ("reason", pa.string()),  # why refused (the dead letter's reason)
        ("data_source", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("ground_truth", pa.string()),
        ("score", pa.float64()),
        ("entry_id", pa.string()),
        ("sample_id", pa.string()),
        ("ticket_id", pa.string()),
        ("prompt_id", pa.string()),
        ("index", pa.int32()),
        ("n", pa.int32()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("min_version", pa.int64()),
        ("max_version", pa.int64()),
        ("finish_reason", pa.string()),
        ("reward_error", pa.string()),
        ("gen_time_s", pa.float64()),
        ("ts", pa.float64()),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("response_tokens", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("raw", pa.binary()),
    ])


COLUMNS = ("step", "verdict", "reason", "data_source", "prompt", "response", "ground_truth",
           "score", "entry_id", "sample_id", "ticket_id", "prompt_id", "index", "n", "attempt",
           "rank", "min_version", "max_version", "finish_reason", "reward_error", "gen_time_s",
           "ts", "prompt_tokens", "response_tokens", "logprobs", "raw")
"""The columns of a segment, in order."""


def _number(path: Path) -> int:
    match = _NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name!r} is not the name of a record segment")
    return int(match[1])


def segments(folder: Path) -> list[Path]:
    """The segment files of ``folder`` in order ([] when it does not exist)."""
    return numbered_files(folder, _NAME)


def _mark_of(path: Path) -> RecordMark:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
        return msgspec.json.decode(meta[MARK_KEY], type=RecordMark)
    except (OSError, KeyError, ValueError, msgspec.DecodeError) as exc:
        raise RecordCorrupt(f"record segment {path} does not read "
                            f"({type(exc).__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"


def last_mark(folder: Path) -> RecordMark | None:
    """The newest segment's mark (None: no segment yet); :class:`RecordCorrupt` when it
    does not read."""
    found = segments(folder)
    return _mark_of(found[-1]) if found else None


def write_segment(folder: Path, rows: Sequence[dict[str, Any]] | Mapping[str, Any],
                  mark: RecordMark) -> Path:
    """Write ``rows`` (dicts of :data:`COLUMNS`, or the columns themselves: lists or arrow
    arrays by name) as the next segment, with ``mark`` as its metadata (its ``segment`` set
    to the new number); whole or not at all. Returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    found = segments(folder)
    number = _number(found[-1]) + 1 if found else 1
    mark = msgspec.structs.replace(mark, segment=number)
    schema = _schema().with_metadata({MARK_KEY: msgspec.json.encode(mark)})
    if isinstance(rows, Mapping):
        table = pa.Table.from_pydict(dict(rows), schema=schema)
    else:
        table = pa.Table.from_pylist(list(rows), schema=schema)
    path = folder / f"samples-{number:06d}.parquet"
    with atomic_file(path) as fh:
        # Page checksums: a flipped byte in a value is an error on reading, never a value a
        # replay would train on.
        pq.write_table(table, fh, compression="zstd", write_page_checksum=True)
    fsync_path(folder)
    return path


VALIDATION_COLUMNS = ("step", "version", "rank", "data_source", "prompt", "response",
                      "ground_truth", "score", "response_length")
"""The columns of a validation's answers (``validation-STEP-vVERSION-rRANK.parquet``)."""


def write_validation(folder: Path, step: int, version: int, rank: int,
                     columns: Mapping[str, Sequence[Any]]) -> Path:
    """Every answer of one validation (weights ``version``, requested at ``step``, served
    by rollouter ``rank``) as one parquet file of :data:`VALIDATION_COLUMNS` in ``folder``
    (the run's record folder), written whole. Returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"validation-{step:06d}-v{version}-r{rank}.parquet"
    table = pa.table({name: list(columns[name]) for name in VALIDATION_COLUMNS})
    with atomic_file(path) as fh:
        pq.write_table(table, fh, compression="zstd", write_page_checksum=True)
    fsync_path(folder)
    return path


def read_rows(folder: Path, steps: Collection[int] | None = None,
              columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The rows of every segment in order, those of ``steps`` only when given;
    :class:`RecordCorrupt` names the first segment that does not read, or is missing."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = list(columns) if columns is not None else None
    if wanted is not None and steps is not None and "step" not in wanted:
        wanted.append("step")
    rows: list[dict[str, Any]] = []
    found = segments(folder)
    for number, path in enumerate(found, 1):
        if _number(path) != number:  # segments are numbered 1, 2, ... as they are written
            raise RecordCorrupt(f"record segment {folder / f'samples-{number:06d}.parquet'} "
                                f"is missing (the folder holds up to {found[-1].name})")
        try:
            table = pq.read_table(path, columns=wanted, page_checksum_verification=True)
            if steps is not None:
                table = table.filter(pc.is_in(table["step"], value_set=_int_array(steps)))
            rows.extend(table.to_pylist())
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise RecordCorrupt(f"record segment {path} does not read "
                                f"({type(exc).__name__}: {_first_line(exc)})") from None
    return rows


def _int_array(values: Collection[int]) -> Any:
    import pyarrow as pa

    return pa.array(sorted(values), type=pa.int64())
