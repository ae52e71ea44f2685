"""Cut the tail of a Redis append-only file at a command boundary: what Redis with
``appendfsync everysec`` loses when the machine dies (its last second of writes).

Used by the fault tests and bench/chaos.py. Only the plain RESP form is handled (no RDB
preamble: the small files of a test are never rewritten).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["aof_commands", "aof_path", "cut_aof_before"]


def aof_path(redis_dir: Path) -> Path:
    """The AOF of a server whose ``dir`` is ``redis_dir``: Redis 6's single file, or the
    newest incremental file of Redis 7's ``appendonlydir``."""
    single = redis_dir / "appendonly.aof"
    if single.exists():
        return single
    incr = sorted((redis_dir / "appendonlydir").glob("*.incr.aof"))
    if not incr:
        raise FileNotFoundError(f"no append-only file under {redis_dir}")
    return incr[-1]


def aof_commands(data: bytes) -> list[tuple[int, list[bytes]]]:
    """``(offset, args)`` of every complete command in ``data``."""
    if data.startswith(b"REDIS"):
        raise ValueError("AOF with an RDB preamble: not supported here")
    out: list[tuple[int, list[bytes]]] = []
    pos = 0
    while pos < len(data):
        start = pos
        if data[pos : pos + 1] != b"*":
            raise ValueError(f"no command at byte {pos}")
        end = data.index(b"\r\n", pos)
        count = int(data[pos + 1 : end])
        pos = end + 2
        args = []
        try:
            for _ in range(count):
                end = data.index(b"\r\n", pos)
                length = int(data[pos + 1 : end])
                pos = end + 2
                if pos + length + 2 > len(data):
                    raise ValueError("truncated")
                args.append(data[pos : pos + length])
                pos += length + 2
        except ValueError:
            break  # a torn last command: not complete
        out.append((start, args))
    return out


def cut_aof_before(path: Path, pick: Callable[[list[bytes]], bool], which: int = -1) -> int:
    """Truncate ``path`` just before the ``which``-th command matching ``pick`` (the last by
    default), or before the MULTI that opens its transaction. Returns bytes removed."""
    data = path.read_bytes()
    commands = aof_commands(data)
    hits = [i for i, (_, args) in enumerate(commands) if pick(args)]
    if not hits:
        raise ValueError(f"no matching command in {path}")
    i = hits[which]
    cut = commands[i][0]
    for j in range(i - 1, -1, -1):
        name = commands[j][1][0].upper()
        if name == b"EXEC":
            break
        if name == b"MULTI":
            cut = commands[j][0]
            break
    with path.open("r+b") as f:
        f.truncate(cut)
    return len(data) - cut
