"""Blob stores: round trips, verification, safe keys."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from bus import (
    BlobCorrupt,
    BlobError,
    BlobNotFound,
    BlobRef,
    Bus,
    DirBlobStore,
    RedisBlobStore,
    RunKeys,
    WeightsPublished,
    decode,
    encode,
    open_store,
)


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 10_000])
async def test_redis_round_trip(bus: Bus, run_keys: RunKeys, size: int) -> None:
    store = RedisBlobStore(bus, run_keys, chunk_size=1024)
    data = os.urandom(size)
    ref = await store.put("weights-v1", data)
    assert ref.store == "redis" and ref.key == run_keys.blob("weights-v1")
    assert ref.size == size and ref.sha256 == hashlib.sha256(data).hexdigest()
    assert ref.chunks == max(1, -(-size // 1024))
    assert await store.get(ref) == data
    # The reference travels inside an event (claim check).
    event = decode(encode(WeightsPublished(version=1, ref=ref)))
    assert isinstance(event, WeightsPublished) and await store.get(event.ref) == data
    await store.delete(ref)
    with pytest.raises(BlobNotFound):
        await store.get(ref)


@pytest.mark.asyncio
async def test_redis_corrupted_and_missing_chunk(bus: Bus, run_keys: RunKeys) -> None:
    store = RedisBlobStore(bus, run_keys, chunk_size=100)
    data = os.urandom(350)
    ref = await store.put("w", data)
    assert ref.chunks == 4
    # Flip one bit of one chunk (byte 5 of chunk 2 is data[205]; writing a fixed byte would
    # leave the chunk as it was whenever the random data already held it, 1 run in 256).
    await bus.command("SETRANGE", f"{ref.key}:2", 5, bytes([data[205] ^ 1]))
    with pytest.raises(BlobCorrupt, match="sha256"):
        await store.get(ref)
    ref = await store.put("w", data)
    await bus.delete(f"{ref.key}:1")
    with pytest.raises(BlobCorrupt, match="missing chunk"):
        await store.get(ref)
    ref = await store.put("w", data)
    await bus.command("APPEND", f"{ref.key}:3", b"extra")
    with pytest.raises(BlobCorrupt, match="bytes"):
        await store.get(ref)


@pytest.mark.asyncio
async def test_dir_round_trip_and_corruption(tmp_path: Path) -> None:
    store = DirBlobStore(tmp_path / "blobs")
    data = os.urandom(5000)
    ref = await store.put("run1/weights/v3.bin", data)
    assert ref == BlobRef(
        store="dir", key="run1/weights/v3.bin", size=5000, sha256=hashlib.sha256(data).hexdigest()
    )
    path = tmp_path / "blobs" / "run1" / "weights" / "v3.bin"
    assert path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == ["v3.bin"]  # no temp file left behind
    assert await store.get(ref) == data
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(BlobCorrupt, match="sha256"):
        await store.get(ref)
    path.write_bytes(data[:10])
    with pytest.raises(BlobCorrupt, match="bytes"):
        await store.get(ref)
    await store.delete(ref)
    await store.delete(ref)  # idempotent
    with pytest.raises(BlobNotFound):
        await store.get(ref)


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "", "a\\b"])
async def test_dir_rejects_unsafe_keys(tmp_path: Path, key: str) -> None:
    store = DirBlobStore(tmp_path)
    with pytest.raises(BlobError):
        await store.put(key, b"x")
    with pytest.raises(BlobError):
        await store.get(BlobRef(store="dir", key=key, size=1, sha256="0"))


@pytest.mark.asyncio
async def test_open_store_dispatch(bus: Bus, run_keys: RunKeys, tmp_path: Path) -> None:
    redis_store = open_store("redis", bus=bus, run_keys=run_keys)
    dir_store = open_store("dir", root=tmp_path)
    assert isinstance(redis_store, RedisBlobStore) and isinstance(dir_store, DirBlobStore)
    with pytest.raises(BlobError):
        open_store("s3")
    with pytest.raises(BlobError):
        open_store("redis")
    ref = await dir_store.put("x", b"abc")
    with pytest.raises(BlobError):
        await redis_store.get(ref)  # a dir reference handed to the redis store
