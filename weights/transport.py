"""Weight transports: a state dict published tensor by tensor, fetched chunk by chunk.

A publication is a byte stream (every tensor's raw little-endian bytes, one after the other
in the state dict's order) cut into chunks of ``chunk_size`` bytes (4 MiB), plus a
**manifest** (msgpack, never pickle): per tensor its name, dtype, shape, byte offset and
size; per chunk its sha256. The manifest is written last, so a publication exists only once
all of its chunks do. Its sha256 is the weights' digest: it covers every chunk's digest, so
two equal state dicts (same dtypes, same bytes) have the same digest wherever they are stored.

- The publisher never holds a second copy of the model nor hashes it in one piece: chunks
  are produced and hashed one at a time on a worker thread and written while the next ones
  are produced (bounded in flight).
- A reader refuses a manifest that contradicts itself (:func:`check_manifest`: sizes,
  offsets, dtypes), fetches the chunks in parallel (bounded), checks each one's sha256 and
  writes it in place in one buffer; the tensors are views of that buffer.

Transports (the reference's ``store`` names the one that wrote it). Each has a trainer's side
(:class:`WeightsPublisher`: publish, delete) and a rollouter's side (:class:`WeightsFetcher`:
fetch); where both read the same storage one object is both (:class:`Transport`):

- :class:`RedisTransport` (``"weights:redis"``): chunks ``KEY:0 .. KEY:N-1`` and the manifest
  ``KEY:m`` under the run's ``blob(name)`` prefix (the run's hash slot), listed in the run's
  blobs set (SADD/SREM) so the trainer's sweep finds them.
- :class:`StorageTransport` (``"weights:storage"``): files ``NAME/000000 ..`` and
  ``NAME/manifest`` under a root, a local path or an fsspec URL. A root that cannot be read
  at all is :class:`TransportUnreachable` (a node without the run's storage), a publication
  missing under a readable root :class:`~bus.errors.BlobNotFound`.
- the collective transport (``"weights:collective"``, :mod:`weights.collective`): the
  manifest in Redis, the bytes broadcast from the trainer's
  :class:`~weights.collective.Broadcaster` to each rollouter's
  :class:`~weights.collective.Receiver`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec
import torch

from bus import BlobCorrupt, BlobError, BlobNotFound, Bus, RunKeys
from runschema.messages import BlobRef
from storage.files import atomic_write

__all__ = [
    "CHUNK_SIZE", "DTYPES", "FETCH_CONCURRENCY", "HASH_THREADS", "Manifest", "RedisTransport",
    "StorageTransport", "TensorEntry", "Transport", "TransportUnreachable", "WeightsFetcher",
    "WeightsPublisher", "check_manifest",
    "chunk_digests", "decode_manifest", "encode_manifest", "flat_buffer", "is_manifest_ref",
    "manifest_of", "open_transport", "weights_digest",
]

CHUNK_SIZE = 4 * 1024 * 1024
"""4 MiB chunks: far below Redis' bulk limit; thousands of them for a 7B model."""

FETCH_CONCURRENCY = 8
"""Chunks a reader fetches (or a writer writes) at once."""

HASH_THREADS = 4
"""Threads that hash one buffer's chunks at once (sha256 runs ~1.5 GB/s on one core here)."""

FORMAT = 1
MAX_CHUNK = 512 * 1024 * 1024
MAX_DIMS = 32

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
"""The dtypes a manifest may name (nothing else is decoded)."""

_NAMES = {v: k for k, v in DTYPES.items()}


class TransportUnreachable(BlobError):
    """The transport's storage cannot be read at all from here (not one publication)."""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One tensor of a publication: its bytes are ``[offset, offset + nbytes)``."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a publication holds; ``chunks``: each chunk's raw sha256 (32 bytes);
    ``aliases``: names whose tensor is another name's (tied weights, sent once)."""

    format: int
    chunk_size: int
    size: int
    tensors: list[TensorEntry]
    chunks: list[bytes]
    aliases: dict[str, str] = {}


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Manifest)


def _raw(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes without a copy (bf16 and bool included)."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def flat_buffer(size: int) -> memoryview:
    """``size`` writable bytes, not zeroed (a ``bytearray`` zero-fills: 90 ms for 250 MB
    here, as long as copying the weights in)."""
    return torch.empty(size, dtype=torch.uint8).numpy().data.cast("B")


def chunk_digests(data: memoryview, chunk_size: int) -> list[bytes]:
    """The sha256 of each ``chunk_size`` piece of ``data``, on up to :data:`HASH_THREADS`
    threads (hashlib lets go of the GIL on large buffers)."""
    starts = range(0, len(data), chunk_size)

    def one(start: int) -> bytes:
        return hashlib.sha256(data[start:start + chunk_size]).digest()

    if len(starts) < 2:
        return [one(start) for start in starts]
    with ThreadPoolExecutor(min(HASH_THREADS, len(starts))) as pool:
        return list(pool.map(one, starts))


def _unique(tensors: Mapping[str, torch.Tensor]
            ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to send, and the names whose tensor is the same object as an earlier
    name's (tied weights: the trainer's snapshot keeps them one object), sent once."""
    first: dict[int, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            unique[name] = t
    return unique, aliases


def _entries(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    entries, offset = [], 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise BlobError(f"tensor {name!r} has dtype {t.dtype}, which no manifest carries")
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, _NAMES[t.dtype], list(t.shape), offset, nbytes))
        offset += nbytes
    return entries, offset


def _chunks(tensors: Mapping[str, torch.Tensor], chunk_size: int) -> Iterator[bytes]:
    """The byte stream of ``tensors`` in chunks of ``chunk_size`` (the last may be short)."""
    buf = bytearray()
    for t in tensors.values():
        view = _raw(t.detach().cpu().contiguous())
        while len(view):
            take = chunk_size - len(buf)
            buf += view[:take]
            view = view[take:]
            if len(buf) == chunk_size:
                yield bytes(buf)
                buf.clear()
    if buf:
        yield bytes(buf)


def check_manifest(m: Manifest) -> None:
    """Refuse (:class:`BlobCorrupt`) a manifest that contradicts itself: tensors must tile
    ``[0, size)`` in order, each ``nbytes`` must be its shape times its dtype's size, names
    unique, dtypes known, and there must be one 32-byte digest per chunk."""
    if m.format != FORMAT:
        raise BlobCorrupt(f"manifest format {m.format} is not {FORMAT}")
    if not 1 <= m.chunk_size <= MAX_CHUNK:
        raise BlobCorrupt(f"manifest chunk size {m.chunk_size} is out of range")
    if m.size < 0 or len(m.chunks) != -(-m.size // m.chunk_size):
        raise BlobCorrupt(f"manifest of {m.size} bytes lists {len(m.chunks)} chunks of "
                          f"{m.chunk_size}")
    if any(len(d) != 32 for d in m.chunks):
        raise BlobCorrupt("manifest holds a chunk digest that is not a sha256")
    _check_tensors(m)


def _check_tensors(m: Manifest) -> None:
    """The tensors tile ``[0, m.size)`` in order, each as big as its shape and dtype say."""
    offset, names = 0, set()
    for e in m.tensors:
        if not e.name or e.name in names:
            raise BlobCorrupt(f"manifest names tensor {e.name!r} twice or empty")
        names.add(e.name)
        dtype = DTYPES.get(e.dtype)
        if dtype is None:
            raise BlobCorrupt(f"tensor {e.name!r}: dtype {e.dtype!r} is not allowed")
        if len(e.shape) > MAX_DIMS or any(d < 0 for d in e.shape):
            raise BlobCorrupt(f"tensor {e.name!r}: shape {e.shape} is not a shape")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if e.offset != offset or e.nbytes != math.prod(e.shape) * itemsize:
            raise BlobCorrupt(f"tensor {e.name!r}: {e.nbytes} bytes at {e.offset} do not "
                              f"match shape {e.shape} of {e.dtype} at {offset}")
        offset += e.nbytes
    if offset != m.size:
        raise BlobCorrupt(f"manifest tensors cover {offset} bytes, not {m.size}")
    for alias, target in m.aliases.items():
        if not alias or alias in names or target not in names:
            raise BlobCorrupt(f"manifest alias {alias!r} -> {target!r} names no tensor or "
                              "shadows one")


def manifest_of(tensors: Mapping[str, torch.Tensor],
                chunk_size: int = CHUNK_SIZE) -> tuple[bytes, list[bytes]]:
    """The encoded manifest of ``tensors`` and their chunks (in memory: tests, small
    models and the resume check; publication streams instead)."""
    unique, aliases = _unique(tensors)
    entries, size = _entries(unique)
    chunks = list(_chunks(unique, chunk_size))
    m = Manifest(FORMAT, chunk_size, size, entries,
                 [hashlib.sha256(c).digest() for c in chunks], aliases)
    return _ENCODER.encode(m), chunks


def weights_digest(tensors: Mapping[str, torch.Tensor], chunk_size: int = CHUNK_SIZE) -> str:
    """The digest a publication of ``tensors`` carries (sha256 of its manifest), computed
    chunk by chunk without keeping the chunks (blocking: run it off the event loop)."""
    unique, aliases = _unique(tensors)
    entries, size = _entries(unique)
    digests = [hashlib.sha256(c).digest() for c in _chunks(unique, chunk_size)]
    return hashlib.sha256(_ENCODER.encode(
        Manifest(FORMAT, chunk_size, size, entries, digests, aliases))).hexdigest()


def encode_manifest(m: Manifest) -> bytes:
    """The manifest's msgpack bytes (deterministic: equal manifests, equal bytes)."""
    return _ENCODER.encode(m)


def decode_manifest(ref: BlobRef, data: bytes) -> Manifest:
    """The manifest ``data`` that ``ref`` names, checked: its sha256 is the reference's
    digest, it decodes, it does not contradict itself, and its size is the reference's."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise BlobCorrupt(f"weights manifest {ref.key!r} sha256 {digest} != reference "
                          f"{ref.sha256}")
    try:
        m = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise BlobCorrupt(f"weights manifest {ref.key!r} does not decode: {exc}") from None
    check_manifest(m)
    if m.size != ref.size:
        raise BlobCorrupt(f"weights manifest {ref.key!r} holds {m.size} bytes, reference "
                          f"says {ref.size}")
    return m


def _place(m: Manifest, buf: memoryview, index: int, data: bytes | None, key: str) -> None:
    """Check chunk ``index`` against the manifest and copy it into ``buf``."""
    if data is None:
        raise BlobCorrupt(f"weights {key!r} chunk {index} is missing")
    start = index * m.chunk_size
    want = min(m.chunk_size, m.size - start)
    if len(data) != want or hashlib.sha256(data).digest() != m.chunks[index]:
        raise BlobCorrupt(f"weights {key!r} chunk {index} ({len(data)} bytes) does not "
                          f"match its sha256 in the manifest")
    buf[start:start + want] = data


def _tensors(m: Manifest, buf: memoryview) -> dict[str, torch.Tensor]:
    """The manifest's tensors as views of ``buf`` (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for e in m.tensors:
        dtype = DTYPES[e.dtype]
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
        out[e.name] = raw.view(dtype).reshape(e.shape)
    for alias, target in m.aliases.items():
        out[alias] = out[target]
    return out


def is_manifest_ref(ref: BlobRef) -> bool:
    """Whether ``ref`` names a manifest written by a :class:`Transport` (not a whole blob)."""
    return ref.store.startswith("weights:")


class WeightsPublisher(Protocol):
    """The trainer's side of a weight transport: writes (or holds) a publication and returns
    the reference its ``WeightsPublished`` event carries (``sha256``: the weights' digest,
    whatever the transport), and deletes it once no kept event names it."""

    store: str
    """The ``BlobRef.store`` of its publications."""

    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor],
                      version: int) -> BlobRef:
        """Publish ``tensors`` as ``name``, the weights of ``version``."""
        ...

    async def delete(self, ref: BlobRef) -> None: ...

    def location(self, ref: BlobRef) -> str:
        """Where ``ref``'s bytes are, for messages."""
        ...


class WeightsFetcher(Protocol):
    """A rollouter's side: the tensors a reference names, bit for bit as published, every
    chunk checked against the manifest (a chunk that does not match is refused, named);
    storage it cannot read at all is :class:`TransportUnreachable`."""

    store: str

    async def fetch(self, ref: BlobRef) -> dict[str, torch.Tensor]: ...

    def location(self, ref: BlobRef) -> str: ...


class Transport(WeightsPublisher, WeightsFetcher, Protocol):
    """Both sides in one object: the publication lies where the trainer and the rollouters
    read it (:class:`RedisTransport`, :class:`StorageTransport`)."""


class _Chunked(Transport):
    """Publication and fetch over ``_put``/``_get``/``_key`` that the transports provide."""

    store = ""

    def __init__(self, chunk_size: int = CHUNK_SIZE,
                 concurrency: int = FETCH_CONCURRENCY) -> None:
        if chunk_size < 1 or concurrency < 1:
            raise ValueError("chunk_size and concurrency must be >= 1")
        self.chunk_size, self.concurrency = chunk_size, concurrency

    def _key(self, name: str) -> str:
        raise NotImplementedError

    async def _start(self, key: str, chunks: int) -> None:
        """Before the first chunk is written."""

    async def _put(self, key: str, part: str, data: bytes) -> None:
        raise NotImplementedError

    async def _put_whole(self, key: str, chunks: Sequence[bytes], manifest: bytes) -> None:
        """A publication of one chunk (or none) and its manifest, at once (the manifest
        last): what :meth:`_start` and :meth:`_put` do for a larger one."""
        await self._start(key, len(chunks))
        for i, chunk in enumerate(chunks):
            await self._put(key, str(i), chunk)
        await self._put(key, "m", manifest)

    async def _get(self, key: str, part: str) -> bytes | None:
        raise NotImplementedError

    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor],
                      version: int = 0) -> BlobRef:
        """Write ``tensors`` as publication ``name``: chunks produced and hashed one at a time
        on a worker thread, written as they come (``concurrency`` in flight), then the
        manifest. Returns the reference an event carries (sha256: the weights' digest).
        ``version``: unused (the name carries it; the collective transport's rounds need
        it)."""
        key = self._key(name)
        tensors, aliases = _unique(tensors)
        entries, size = _entries(tensors)
        if size <= self.chunk_size:  # a small model: one thread hop, one write
            return await self._publish_whole(key, tensors, entries, size, aliases)
        await self._start(key, -(-size // self.chunk_size))
        produce = _chunks(tensors, self.chunk_size)

        def step() -> tuple[bytes, bytes] | None:
            chunk = next(produce, None)
            return None if chunk is None else (chunk, hashlib.sha256(chunk).digest())

        digests: list[bytes] = []
        writing: set[asyncio.Task[None]] = set()
        try:
            while (got := await asyncio.to_thread(step)) is not None:
                if len(writing) >= self.concurrency:
                    done, writing = await asyncio.wait(writing,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
                writing.add(asyncio.create_task(self._put(key, str(len(digests)), got[0])))
                digests.append(got[1])
            for t in writing:
                await t
        finally:
            for t in writing:
                t.cancel()
        data = self._manifest(entries, size, digests, aliases)
        await self._put(key, "m", data)
        return self._ref(key, size, data, len(digests))

    async def _publish_whole(self, key: str, tensors: Mapping[str, torch.Tensor],
                             entries: list[TensorEntry], size: int,
                             aliases: dict[str, str]) -> BlobRef:
        """:meth:`publish` of weights that fit one chunk: the chunk and its digest made in
        one hop of a worker thread, written with the manifest by :meth:`_put_whole` (the
        Redis transport: one round trip where the chunk-by-chunk path takes three and two
        more thread hops, on the step's critical path between the update and the next
        tickets)."""

        def produce() -> tuple[list[bytes], list[bytes]]:
            chunks = list(_chunks(tensors, self.chunk_size))
            return chunks, [hashlib.sha256(c).digest() for c in chunks]

        chunks, digests = await asyncio.to_thread(produce)
        data = self._manifest(entries, size, digests, aliases)
        await self._put_whole(key, chunks, data)
        return self._ref(key, size, data, len(digests))

    def _manifest(self, entries: list[TensorEntry], size: int, digests: list[bytes],
                  aliases: dict[str, str]) -> bytes:
        return _ENCODER.encode(Manifest(FORMAT, self.chunk_size, size, entries, digests,
                                        aliases))

    def _ref(self, key: str, size: int, manifest: bytes, chunks: int) -> BlobRef:
        return BlobRef(store=self.store, key=key, size=size,
                       sha256=hashlib.sha256(manifest).hexdigest(), chunks=chunks)

    async def fetch(self, ref: BlobRef) -> dict[str, torch.Tensor]:
        """The tensors ``ref`` names, every chunk checked. No manifest →
        :class:`BlobNotFound`; a manifest or chunk that does not match →
        :class:`BlobCorrupt`."""
        if ref.store != self.store:
            raise BlobError(f"reference to a {ref.store!r} publication given to {self.store}")
        data = await self._get(ref.key, "m")
        if data is None:
            raise BlobNotFound(f"weights {self.location(ref)} do not exist (deleted, or "
                               "never written here)")
        m = decode_manifest(ref, data)
        buf = flat_buffer(m.size)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> None:
            async with gate:
                part = await self._get(ref.key, str(i))
                if part is None and await self._get(ref.key, "m") is None:
                    # Deleted while we read it (the trainer keeps the newest three only):
                    # a publication gone, not a corrupt one.
                    raise BlobNotFound(f"weights {self.location(ref)} were deleted while "
                                       "being read")
            await asyncio.to_thread(_place, m, buf, i, part, ref.key)

        await asyncio.gather(*(one(i) for i in range(len(m.chunks))))
        return await asyncio.to_thread(_tensors, m, buf)

    def location(self, ref: BlobRef) -> str:
        return ref.key


class RedisTransport(_Chunked):
    """Chunks and manifest as strings under ``run_keys.blob(name)`` (the run's slot)."""

    store = "weights:redis"

    def __init__(self, bus: Bus, run_keys: RunKeys, chunk_size: int = CHUNK_SIZE,
                 concurrency: int = FETCH_CONCURRENCY) -> None:
        super().__init__(chunk_size, concurrency)
        self.bus, self.run_keys = bus, run_keys

    def _key(self, name: str) -> str:
        return self.run_keys.blob(name)

    @staticmethod
    def _keys(key: str, chunks: int) -> list[str]:
        return [*(f"{key}:{i}" for i in range(chunks)), f"{key}:m"]

    async def _start(self, key: str, chunks: int) -> None:
        """List the publication's keys in the run's blobs set first (wraps SADD): a trainer
        that dies half-way leaves keys its successor's sweep finds."""
        await self.bus.command("SADD", self.run_keys.blobs, *self._keys(key, chunks))

    async def _put(self, key: str, part: str, data: bytes) -> None:
        """Wraps SET."""
        await self.bus.command("SET", f"{key}:{part}", data)

    async def _put_whole(self, key: str, chunks: Sequence[bytes], manifest: bytes) -> None:
        """The keys listed in the run's blobs set, the chunk and the manifest, in one
        transaction (all or nothing). Wraps SADD, SET (MULTI/EXEC)."""
        keys = self._keys(key, len(chunks))
        await self.bus.pipeline(
            [("SADD", self.run_keys.blobs, *keys),
             *(("SET", k, chunk) for k, chunk in zip(keys[:-1], chunks, strict=True)),
             ("SET", keys[-1], manifest)], atomic=True, op="SET")

    async def _get(self, key: str, part: str) -> bytes | None:
        """Wraps GET."""
        data: bytes | None = await self.bus.command("GET", f"{key}:{part}")
        return data

    async def delete(self, ref: BlobRef) -> None:
        """Remove the chunks and the manifest. Wraps DEL and SREM (one transaction)."""
        keys = self._keys(ref.key, ref.chunks)
        await self.bus.pipeline([("DEL", *keys), ("SREM", self.run_keys.blobs, *keys)],
                                atomic=True)

    def location(self, ref: BlobRef) -> str:
        return f"redis key {ref.key}:*"


class StorageTransport(_Chunked):
    """Chunks and manifest as files ``NAME/000000 ..``, ``NAME/manifest`` under ``root``
    (a local directory or an fsspec URL)."""

    store = "weights:storage"

    def __init__(self, root: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE,
                 concurrency: int = FETCH_CONCURRENCY) -> None:
        super().__init__(chunk_size, concurrency)
        from fsspec.core import url_to_fs  # a dependency of the storage transport only

        self.url = os.fspath(root)
        self.fs, self.root = url_to_fs(self.url)
        self.local = "file" in _protocols(self.fs)

    def _key(self, name: str) -> str:
        rel = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in rel) \
                or "\\" in name or "\0" in name:
            raise BlobError(f"weights name {name!r} must be a relative path without '..'")
        return name

    def _path(self, key: str, part: str) -> str:
        self._key(key)
        leaf = "manifest" if part == "m" else f"{int(part):06d}"
        return f"{self.root.rstrip('/')}/{key}/{leaf}"

    async def _put(self, key: str, part: str, data: bytes) -> None:
        path = self._path(key, part)
        if self.local:
            # 0600 as the blobs before: weights are for the run's user only; atomic, so a
            # reader never sees half a manifest.
            await asyncio.to_thread(_local_write, path, data, part == "m")
        else:
            await asyncio.to_thread(self.fs.pipe_file, path, data)

    async def _get(self, key: str, part: str) -> bytes | None:
        path = self._path(key, part)
        try:
            data: bytes = await asyncio.to_thread(self.fs.cat_file, path)
            return data
        except FileNotFoundError:
            if part == "m" and not await asyncio.to_thread(self._root_readable):
                raise TransportUnreachable(
                    f"weights storage {self.url} is not readable from this host") from None
            return None
        except OSError as exc:
            raise TransportUnreachable(f"weights storage {self.url}: {exc}") from None

    def _root_readable(self) -> bool:
        try:
            return bool(self.fs.isdir(self.root))
        except OSError:
            return False

    async def delete(self, ref: BlobRef) -> None:
        """Remove the publication's directory (missing is fine)."""
        await self.delete_name(ref.key)

    async def names(self, prefix: str) -> list[str]:
        """The publications under the root whose name starts with ``prefix`` (a sweep)."""
        def ls() -> list[str]:
            if not self.fs.isdir(self.root):
                return []
            found = (str(p).rstrip("/").rsplit("/", 1)[-1]
                     for p in self.fs.ls(self.root, detail=False))
            return sorted(n for n in found if n.startswith(prefix))

        return await asyncio.to_thread(ls)

    async def delete_name(self, name: str) -> None:
        """Remove publication ``name``'s directory (missing is fine)."""
        path = f"{self.root.rstrip('/')}/{self._key(name)}"

        def rm() -> None:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

        await asyncio.to_thread(rm)

    def location(self, ref: BlobRef) -> str:
        return f"{self.url.rstrip('/')}/{ref.key}"


class _Filesystem(Protocol):
    """What is read of an fsspec filesystem here (fsspec ships no type information)."""

    protocol: str | tuple[str, ...]


def _protocols(fs: _Filesystem) -> Sequence[str]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _local_write(path: str, data: bytes, durable: bool) -> None:
    # Only the manifest is fsynced: a chunk lost in a crash fails its sha256 at the reader
    # (BlobCorrupt), and the resumed trainer publishes again.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, data, mode=0o600, durable=durable)


def open_transport(store: str, *, bus: Bus | None = None, run_keys: RunKeys | None = None,
                   root: str | os.PathLike[str] | None = None) -> Transport:
    """The transport a reference's ``store`` names, or a configured one (``redis``,
    ``storage``)."""
    kind = store.removeprefix("weights:")
    if kind == "redis":
        if bus is None or run_keys is None:
            raise BlobError("the redis weights transport needs bus= and run_keys=")
        return RedisTransport(bus, run_keys)
    if kind == "storage":
        if root is None:
            raise BlobError("the storage weights transport needs root=")
        return StorageTransport(root)
    raise BlobError(f"unknown weights transport {store!r} (expected 'redis' or 'storage')")
