"""Blob stores: one contract suite run against every store (round trips, verification, the
reference travelling in an event, cleanup), then what each store adds (Redis chunks, safe
file keys)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bus import BlobCorrupt, BlobError, BlobNotFound, Bus, RunKeys
from bus.client import _UNCOPIED_BYTES, _wire_args
from runschema.messages import BlobRef, WeightsPublished, decode, encode
from weights.blobs import BlobStore, DirBlobStore, RedisBlobStore, open_store

CHUNK = 1024  # the Redis store's chunk size here: blobs of several chunks


@dataclass
class StoreCase:
    """One store under test, and how to damage what it holds: ``flip(ref, data, i)`` flips
    one bit of byte ``i`` as stored; ``grow(ref)`` appends bytes to the stored blob,
    ``cut(ref)`` drops some from its end; ``stored(ref)`` whether anything of the blob is
    left where the store keeps it."""

    store: BlobStore
    flip: Callable[[BlobRef, bytes, int], Awaitable[None]]
    grow: Callable[[BlobRef], Awaitable[None]]
    cut: Callable[[BlobRef], Awaitable[None]]
    stored: Callable[[BlobRef], Awaitable[bool]]


def redis_case(bus: Bus, run_keys: RunKeys) -> StoreCase:
    async def flip(ref: BlobRef, data: bytes, i: int) -> None:
        await bus.command("SETRANGE", f"{ref.key}:{i // CHUNK}", i % CHUNK,
                          bytes([data[i] ^ 1]))

    async def grow(ref: BlobRef) -> None:
        await bus.command("APPEND", f"{ref.key}:{max(ref.chunks, 1) - 1}", b"extra")

    async def cut(ref: BlobRef) -> None:
        last = f"{ref.key}:{max(ref.chunks, 1) - 1}"
        await bus.command("SET", last, (await bus.command("GET", last))[:-5])

    async def stored(ref: BlobRef) -> bool:
        keys = [f"{ref.key}:{i}" for i in range(max(ref.chunks, 1))]
        listed = {k.decode() for k in await bus.command("SMEMBERS", run_keys.blobs)}
        return bool(await bus.command("EXISTS", *keys)) or bool(listed & set(keys))

    return StoreCase(RedisBlobStore(bus, run_keys, chunk_size=CHUNK), flip, grow, cut, stored)


def dir_case(root: Path) -> StoreCase:
    store = DirBlobStore(root)

    async def flip(ref: BlobRef, data: bytes, i: int) -> None:
        path = store.path_of(ref.key)
        path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])

    async def grow(ref: BlobRef) -> None:
        with store.path_of(ref.key).open("ab") as f:
            f.write(b"extra")

    async def cut(ref: BlobRef) -> None:
        path = store.path_of(ref.key)
        path.write_bytes(path.read_bytes()[:-5])

    async def stored(ref: BlobRef) -> bool:
        return store.path_of(ref.key).exists()

    return StoreCase(store, flip, grow, cut, stored)


@pytest.fixture(params=["redis", "dir"])
def case(request: pytest.FixtureRequest, bus: Bus, run_keys: RunKeys,
         tmp_path: Path) -> StoreCase:
    if request.param == "redis":
        return redis_case(bus, run_keys)
    return dir_case(tmp_path / "blobs")


# ---------------------------------------------------------------------- the contract


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 10_000])
async def test_a_blob_comes_back_as_it_was_put(case: StoreCase, size: int) -> None:
    data = os.urandom(size)
    ref = await case.store.put("run1/weights-v1", data)
    assert ref.store == case.store.store
    assert ref.size == size and ref.sha256 == hashlib.sha256(data).hexdigest()
    assert await case.store.get(ref) == data
    # The reference travels inside an event (claim check).
    event = decode(encode(WeightsPublished(version=1, ref=ref)))
    assert isinstance(event, WeightsPublished) and await case.store.get(event.ref) == data


@pytest.mark.asyncio
async def test_a_put_overwrites_the_blob_of_that_name(case: StoreCase) -> None:
    await case.store.put("w", os.urandom(3000))
    data = os.urandom(2000)
    ref = await case.store.put("w", data)
    assert await case.store.get(ref) == data


@pytest.mark.asyncio
async def test_a_flipped_bit_is_refused(case: StoreCase) -> None:
    data = os.urandom(3500)
    for i in (0, 1500, len(data) - 1):  # the first, a middle and the last byte
        ref = await case.store.put("w", data)
        await case.flip(ref, data, i)
        with pytest.raises(BlobCorrupt, match="sha256"):
            await case.store.get(ref)


@pytest.mark.asyncio
async def test_a_blob_of_another_size_is_refused(case: StoreCase) -> None:
    data = os.urandom(3500)
    for change in (case.grow, case.cut):
        ref = await case.store.put("w", data)
        await change(ref)
        with pytest.raises(BlobCorrupt, match="bytes"):
            await case.store.get(ref)


@pytest.mark.asyncio
async def test_a_deleted_blob_is_gone_and_deleting_again_is_fine(case: StoreCase) -> None:
    ref = await case.store.put("w", os.urandom(3500))
    assert await case.stored(ref)
    await case.store.delete(ref)
    assert not await case.stored(ref)
    with pytest.raises(BlobNotFound):
        await case.store.get(ref)
    await case.store.delete(ref)


@pytest.mark.asyncio
async def test_another_stores_reference_is_refused(case: StoreCase) -> None:
    ref = await case.store.put("w", b"abc")
    other = "dir" if case.store.store == "redis" else "redis"
    with pytest.raises(BlobError, match=other):
        await case.store.get(BlobRef(store=other, key=ref.key, size=ref.size,
                                     sha256=ref.sha256, chunks=ref.chunks))


# ---------------------------------------------------------------------- what each store adds


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 1000, 1024, 1025, 10_000])
async def test_redis_chunks_live_under_the_runs_blob_key(
    bus: Bus, run_keys: RunKeys, size: int
) -> None:
    store = RedisBlobStore(bus, run_keys, chunk_size=CHUNK)
    ref = await store.put("weights-v1", os.urandom(size))
    assert ref.key == run_keys.blob("weights-v1")
    assert ref.chunks == max(1, -(-size // CHUNK))
    assert await store.names() == sorted(f"{ref.key}:{i}" for i in range(ref.chunks))


@pytest.mark.asyncio
async def test_redis_a_missing_chunk_is_named(bus: Bus, run_keys: RunKeys) -> None:
    store = RedisBlobStore(bus, run_keys, chunk_size=100)
    ref = await store.put("w", os.urandom(350))
    assert ref.chunks == 4
    await bus.delete(f"{ref.key}:1")
    with pytest.raises(BlobCorrupt, match="missing chunk"):
        await store.get(ref)


@pytest.mark.asyncio
async def test_dir_writes_one_file_atomically(tmp_path: Path) -> None:
    store = DirBlobStore(tmp_path / "blobs")
    data = os.urandom(5000)
    ref = await store.put("run1/weights/v3.bin", data)
    assert ref == BlobRef(
        store="dir", key="run1/weights/v3.bin", size=5000, sha256=hashlib.sha256(data).hexdigest()
    )
    path = tmp_path / "blobs" / "run1" / "weights" / "v3.bin"
    assert path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == ["v3.bin"]  # no temp file left behind


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


def test_long_bytes_go_to_redis_py_as_views_short_ones_as_they_are() -> None:
    long, short = os.urandom(_UNCOPIED_BYTES + 1), os.urandom(_UNCOPIED_BYTES)
    args = ("SET", "k", long, short, 7)
    wired = _wire_args(args)
    assert isinstance(wired[2], memoryview) and wired[2].obj is long  # the same bytes, no copy
    assert [type(a) for a in wired] == [str, str, memoryview, bytes, int]
    plain = ("SET", "k", short)
    assert _wire_args(plain) is plain


@pytest.mark.asyncio
async def test_a_long_value_arrives_whole_by_every_way_the_bus_sends(bus: Bus,
                                                                     run_id: str) -> None:
    """A weights chunk's size of random bytes, sent as a view (bus.client._wire_args) by a
    command, a transaction and a script: Redis holds exactly those bytes."""
    data = os.urandom(420_000)
    key = f"rlbus:{{{run_id}}}:blob:view"
    await bus.command("SET", f"{key}:1", data)
    await bus.pipeline([("SET", f"{key}:2", data), ("SET", f"{key}:3", b"m")], atomic=True)
    await bus.run_script("return redis.call('SET', KEYS[1], ARGV[1])", [f"{key}:4"], [data])
    held = await bus.pipeline([("GET", f"{key}:{i}") for i in (1, 2, 4)])
    assert all(h == data for h in held)
    assert await bus.command("STRLEN", f"{key}:2") == len(data)
