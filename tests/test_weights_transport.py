"""Weight transports: one contract suite run against every transport (redis, storage, the
collective broadcast): a state dict published comes back bit-identical (any dtype, bf16
included, odd shapes, 0-dim and empty tensors), a chunk that does not match its digest is
refused and named, a deleted publication leaves nothing behind. Then what each transport adds:
a manifest that contradicts itself is refused, and a rollouter that cannot read the weights
says so at once and fails, named, within its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import torch

from bus import BlobCorrupt, BlobError, BlobNotFound, Bus, RunKeys, pulse_forever
from rollouter.app import Rollouter
from rollouter.weights import WeightsLost
from runconfig import load_config
from runschema.messages import BlobRef, Heartbeat, WarningRaised, WeightsPublished
from tests.procs import Procs, events_of, run_args
from tests.waits import event, wait_for, wait_until
from trainer.learner import publish_dtype
from weights.collective import Broadcaster, Receiver
from weights.collective_round import Member
from weights.transport import (
    Manifest,
    RedisTransport,
    StorageTransport,
    TensorEntry,
    TransportUnreachable,
    WeightsFetcher,
    WeightsPublisher,
    check_manifest,
    manifest_of,
    weights_digest,
)

pytestmark = pytest.mark.asyncio

CHUNK = 1000  # small chunks: many of them, and tensors that straddle chunk boundaries

State = dict[str, torch.Tensor]


def _state() -> State:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(37, 53, generator=g),
        "bf": torch.randn(17, 3, 5, generator=g).to(torch.bfloat16),
        "half": torch.randn(101, generator=g).to(torch.float16),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "ids": torch.arange(-50, 50, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "view": torch.arange(30.0).reshape(5, 6)[:, ::2],  # not contiguous
    }


def _bf16(state: State) -> State:
    """``state`` with every float in bf16 (a bf16 publication: half the bytes)."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def _same(a: State, b: State) -> None:
    assert list(a) == list(b)
    for name, t in a.items():
        u = b[name]
        assert (u.dtype, u.shape) == (t.dtype, t.shape), name
        # Bit-identical: compare the raw bytes, not the values (NaN, -0.0).
        assert u.contiguous().reshape(-1).view(torch.uint8).tolist() == \
            t.contiguous().reshape(-1).view(torch.uint8).tolist(), name


# ---------------------------------------------------------------------- the transports


@dataclass
class TransportCase:
    """One transport under test: the trainer's side, a rollouter's side, and ``fetch(ref)``,
    the rollouter's fetch with what brings it the publication (the collective: a round);
    ``flip(ref, i)`` flips one bit of chunk ``i`` of a publication (as stored, or as the
    trainer sends it); ``leftovers(ref)``: what is left of it where the transport keeps it."""

    publisher: WeightsPublisher
    fetcher: WeightsFetcher
    fetch: Callable[[BlobRef], Awaitable[State]]
    flip: Callable[[BlobRef, int], Awaitable[None]]
    leftovers: Callable[[BlobRef], Awaitable[list[str]]]


def _flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def redis_case(bus: Bus, keys: RunKeys) -> TransportCase:
    fetcher = RedisTransport(bus, keys, chunk_size=CHUNK, concurrency=3)

    async def flip(ref: BlobRef, i: int) -> None:
        chunk = await bus.command("GET", f"{ref.key}:{i}")
        await bus.command("SET", f"{ref.key}:{i}", _flip_byte(chunk, 10))

    async def leftovers(ref: BlobRef) -> list[str]:
        listed = [k.decode() for k in await bus.command("SMEMBERS", keys.blobs)]
        return sorted(k for k in [*await bus.scan(f"{ref.key}:*"), *listed]
                      if k.startswith(f"{ref.key}:"))

    return TransportCase(RedisTransport(bus, keys, chunk_size=CHUNK, concurrency=3), fetcher,
                         fetcher.fetch, flip, leftovers)


def storage_case(root: Path) -> TransportCase:
    fetcher = StorageTransport(root, chunk_size=CHUNK, concurrency=3)

    async def flip(ref: BlobRef, i: int) -> None:
        path = root / ref.key / f"{i:06d}"
        path.write_bytes(_flip_byte(path.read_bytes(), 10))

    async def leftovers(ref: BlobRef) -> list[str]:
        return await asyncio.to_thread(lambda: sorted(map(str, root.glob(f"{ref.key}/**/*"))))

    return TransportCase(StorageTransport(root, chunk_size=CHUNK, concurrency=3), fetcher,
                         fetcher.fetch, flip, leftovers)


@contextlib.asynccontextmanager
async def collective_case(bus: Bus, keys: RunKeys) -> AsyncIterator[TransportCase]:
    """The trainer's broadcaster and one receiver (with its heartbeat), in this process: a
    round is one gloo group of two ranks on two threads."""
    broadcaster = Broadcaster(bus, keys, epoch="e", host="127.0.0.1", timeout_s=20,
                              join_timeout_s=10, chunk_size=CHUNK)
    me = Member(0, os.getpid())
    receiver = Receiver(bus, keys, me, poll_s=0.05, wait_s=3)
    tasks = [asyncio.create_task(pulse_forever(
        bus, keys.alive("rollouter", 0),
        lambda: Heartbeat(role="rollouter", rank=0, pid=os.getpid(), weights_receiver=True),
        0.2, 1.5)), asyncio.create_task(receiver.run())]

    async def seen() -> bool | None:
        return True if me in await broadcaster.receivers() else None

    async def fetch(ref: BlobRef) -> State:
        serving = asyncio.create_task(broadcaster.serve())
        try:
            tensors = await receiver.fetch(ref)
        except BaseException:
            serving.cancel()  # the round in flight stops when the broadcaster closes
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await serving
            raise
        await serving
        return tensors

    async def flip(ref: BlobRef, i: int) -> None:
        latest = broadcaster.latest
        assert latest is not None and latest.ref.key == ref.key
        latest.buf[i * CHUNK + 10] ^= 1  # the bytes the rounds send; the manifest is as made

    async def leftovers(ref: BlobRef) -> list[str]:
        listed = [k.decode() for k in await bus.command("SMEMBERS", keys.blobs)]
        return sorted(k for k in [*await bus.scan(f"{ref.key}:*"), *listed]
                      if k.startswith(f"{ref.key}:"))

    try:
        await wait_until(seen, "the receiver's heartbeat", 30)
        yield TransportCase(broadcaster, receiver, fetch, flip, leftovers)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await broadcaster.worker.close()


@pytest_asyncio.fixture(params=["redis", "storage", "collective"])
async def case(request: pytest.FixtureRequest, bus: Bus, run_keys: RunKeys,
               tmp_path: Path) -> AsyncIterator[TransportCase]:
    if request.param == "redis":
        yield redis_case(bus, run_keys)
    elif request.param == "storage":
        yield storage_case(tmp_path)
    else:
        async with collective_case(bus, run_keys) as collective:
            yield collective


# ---------------------------------------------------------------------- the contract


@pytest.mark.parametrize("dtype", ["as_made", "bf16"])
async def test_a_publication_comes_back_bit_for_bit(case: TransportCase, dtype: str) -> None:
    state = _state() if dtype == "as_made" else _bf16(_state())
    ref = await case.publisher.publish("weights-v1-e", state, 1)
    assert ref.chunks > 4 and ref.store == case.publisher.store == case.fetcher.store
    _same(state, await case.fetch(ref))
    # The digest is the content's: what the resume check computes, whatever the transport.
    assert ref.sha256 == weights_digest(state, CHUNK)


async def test_a_flipped_chunk_is_refused_naming_it(case: TransportCase) -> None:
    ref = await case.publisher.publish("weights-v2-e", _state(), 2)
    await case.flip(ref, 3)
    with pytest.raises(BlobError, match=r"chunk 3\b"):
        await case.fetch(ref)


async def test_a_deleted_publication_leaves_nothing(case: TransportCase) -> None:
    ref = await case.publisher.publish("weights-v3-e", _state(), 3)
    _same(_state(), await case.fetch(ref))
    assert await case.leftovers(ref)
    await case.publisher.delete(ref)
    assert await case.leftovers(ref) == []
    with pytest.raises(BlobError):
        await case.fetch(ref)


@pytest.mark.parametrize("kind", ["redis", "storage"])
async def test_weights_that_fit_one_chunk_are_written_whole(
    kind: str, bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    """A small model's publication (one chunk) takes the one-write path (Redis: the blobs
    set, the chunk and the manifest in one transaction): the same weights, digest and
    cleanup as the chunk-by-chunk path."""
    big = 1 << 20
    t = (RedisTransport(bus, run_keys, chunk_size=big) if kind == "redis"
         else StorageTransport(tmp_path, chunk_size=big))
    ref = await t.publish("weights-v9-e", _state())
    assert ref.chunks == 1 and ref.sha256 == weights_digest(_state(), big)
    _same(_state(), await t.fetch(ref))
    if kind == "redis":
        listed = {k.decode() for k in await bus.command("SMEMBERS", run_keys.blobs)}
        assert listed == {f"{ref.key}:0", f"{ref.key}:m"}
    await t.delete(ref)
    with pytest.raises(BlobNotFound):
        await t.fetch(ref)
    if kind == "redis":
        assert await bus.command("SMEMBERS", run_keys.blobs) in ([], set())


# ---------------------------------------------------------------------- what each adds


async def test_the_transports_at_rest_refuse_a_missing_or_short_chunk(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    redis_t = RedisTransport(bus, run_keys, chunk_size=CHUNK)
    ref = await redis_t.publish("weights-v2-e", _state())
    await bus.command("SETRANGE", f"{ref.key}:3", 10, b"\xff\x00")
    with pytest.raises(BlobCorrupt, match="chunk 3"):
        await redis_t.fetch(ref)
    store_t = StorageTransport(tmp_path, chunk_size=CHUNK)
    ref = await store_t.publish("weights-v2-e", _state())
    (tmp_path / ref.key / "000004").write_bytes(b"short")
    with pytest.raises(BlobCorrupt, match="chunk 4"):
        await store_t.fetch(ref)
    (tmp_path / ref.key / "000004").unlink()
    with pytest.raises(BlobCorrupt, match="chunk 4 is missing"):
        await store_t.fetch(ref)


async def test_tied_weights_are_sent_once(bus: Bus, run_keys: RunKeys) -> None:
    w = torch.randn(4, 4)
    state = {"embed": w, "bias": torch.ones(2), "head": w}  # one tensor, two names
    t = RedisTransport(bus, run_keys, chunk_size=CHUNK)
    ref = await t.publish("weights-v8-e", state)
    assert ref.size == w.nbytes + 8
    _same(state, await t.fetch(ref))
    data, _ = manifest_of(state, CHUNK)
    m = msgspec.msgpack.decode(data, type=Manifest)
    assert m.aliases == {"head": "embed"}
    for bad in ({"head": "nothing"}, {"bias": "embed"}, {"": "embed"}):
        with pytest.raises(BlobCorrupt, match="alias"):
            check_manifest(_forge(m, aliases=bad))


async def test_every_transport_gives_the_same_weights(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    state = _bf16(_state())  # bf16 publishes half the bytes
    refs, got = {}, {}
    for kind, t in (("redis", redis_case(bus, run_keys)), ("storage", storage_case(tmp_path))):
        refs[kind] = await t.publisher.publish("weights-v1-e", state, 1)
        got[kind] = await t.fetch(refs[kind])
    assert refs["redis"].sha256 == refs["storage"].sha256
    _same(got["redis"], got["storage"])
    _same(state, got["redis"])


class _Counting(StorageTransport):
    """Counts the chunk reads in flight (each holds its slot for a moment)."""

    in_flight = peak = 0

    async def _get(self, key: str, part: str) -> bytes | None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            return await super()._get(key, part)
        finally:
            self.in_flight -= 1


async def test_chunks_are_fetched_in_parallel_within_the_bound(tmp_path: Path) -> None:
    state = _state()
    ref = await StorageTransport(tmp_path, chunk_size=CHUNK).publish("weights-v9-e", state)
    reader = _Counting(tmp_path, chunk_size=CHUNK, concurrency=4)
    _same(state, await reader.fetch(ref))
    assert reader.peak == 4, reader.peak  # several at once, never more than asked


async def test_a_publication_deleted_while_read_is_missing_not_corrupt(
    bus: Bus, run_keys: RunKeys
) -> None:
    t = RedisTransport(bus, run_keys, chunk_size=CHUNK, concurrency=1)
    ref = await t.publish("weights-v6-e", _state())
    reads = 0

    async def get(key: str, part: str) -> bytes | None:
        nonlocal reads
        reads += 1
        if reads == 3:  # the manifest and one chunk read, then the trainer deletes it
            await t.delete(ref)
        return await RedisTransport._get(t, key, part)

    t._get = get  # type: ignore[method-assign]
    with pytest.raises(BlobNotFound, match="deleted while"):
        await t.fetch(ref)


def _forge(m: Manifest, **change: object) -> Manifest:
    return msgspec.structs.replace(m, **change)


async def test_a_manifest_that_contradicts_itself_is_refused() -> None:
    data, _ = manifest_of({"a": torch.zeros(4, 4), "b": torch.zeros(3)}, CHUNK)
    m = msgspec.msgpack.decode(data, type=Manifest)
    check_manifest(m)
    a = m.tensors[0]
    forged = [
        _forge(m, size=m.size + 4),  # size says more than the tensors hold
        _forge(m, chunks=[*m.chunks, b"\0" * 32]),  # a chunk too many
        _forge(m, chunks=[b"short"]),  # not a sha256
        _forge(m, tensors=[a, TensorEntry("b", "float32", [3], a.nbytes + 4, 12)]),  # a gap
        _forge(m, tensors=[a, TensorEntry("b", "float32", [4], a.nbytes, 12)]),  # shape/size
        _forge(m, tensors=[a, TensorEntry("b", "object", [3], a.nbytes, 12)]),  # dtype
        _forge(m, tensors=[a, TensorEntry("a", "float32", [3], a.nbytes, 12)]),  # twice
        _forge(m, tensors=[a, TensorEntry("b", "float32", [-3], a.nbytes, 12)]),
        _forge(m, format=99), _forge(m, chunk_size=0),
    ]
    for bad in forged:
        with pytest.raises(BlobCorrupt):
            check_manifest(bad)


async def test_a_forged_manifest_is_refused_on_fetch(bus: Bus, run_keys: RunKeys) -> None:
    t = RedisTransport(bus, run_keys, chunk_size=CHUNK)
    ref = await t.publish("weights-v3-e", {"a": torch.ones(10)})
    m = msgspec.msgpack.decode(await bus.command("GET", f"{ref.key}:m"), type=Manifest)
    # A forged manifest that matches the forged event's digest: still refused (it claims
    # a tensor bigger than its bytes).
    forged = msgspec.msgpack.encode(_forge(m, tensors=[TensorEntry("a", "float32", [1000],
                                                                   0, 40)]))
    await bus.command("SET", f"{ref.key}:m", forged)
    forged_ref = msgspec.structs.replace(ref, sha256=hashlib.sha256(forged).hexdigest())
    with pytest.raises(BlobCorrupt, match="do not match shape"):
        await t.fetch(forged_ref)
    with pytest.raises(BlobCorrupt, match="sha256"):  # the real event's digest: no match
        await t.fetch(ref)


async def test_storage_that_is_not_there_is_unreachable_not_missing(tmp_path: Path) -> None:
    t = StorageTransport(tmp_path, chunk_size=CHUNK)
    ref = await t.publish("weights-v4-e", {"a": torch.ones(3)})
    elsewhere = StorageTransport(tmp_path / "not-mounted")
    with pytest.raises(TransportUnreachable, match="not-mounted"):
        await elsewhere.fetch(ref)
    gone = BlobRef(store=ref.store, key="weights-v5-e", size=ref.size, sha256=ref.sha256)
    with pytest.raises(BlobNotFound):
        await t.fetch(gone)


async def test_the_learners_snapshot_is_a_copy_in_the_published_dtype_tied_once() -> None:
    from trainer.learner import Learner

    learner = Learner(load_config(overrides=["rollout.weights_dtype=bf16"]))
    learner.build()
    snap = learner.snapshot()
    assert snap["head.weight"] is snap["tok_emb.weight"]  # TinyGPT ties them
    assert all(t.dtype == torch.bfloat16 for t in snap.values() if t.is_floating_point())
    before = snap["tok_emb.weight"].clone()
    with torch.no_grad():
        learner.policy.tok_emb.weight.add_(1.0)  # the next step trains in place
    assert torch.equal(snap["tok_emb.weight"], before)


async def test_publish_dtype_follows_the_rollouters_model() -> None:
    def cfg(*o: str) -> object:
        return load_config(overrides=list(o))

    assert publish_dtype(cfg()) is None  # tiny model, auto: as trained (today's)
    assert publish_dtype(cfg("rollout.weights_dtype=bf16")) is torch.bfloat16
    assert publish_dtype(cfg("rollout.weights_dtype=fp32")) is torch.float32


async def test_a_rollouter_with_no_loadable_weights_fails_named(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[f"redis.url={redis_url}", f"run.id={run_id}",
                                 f"run.output_dir={tmp_path}",
                                 "rollout.weights_fetch_timeout_s=1"])
    r = Rollouter(cfg, bus)
    r.build()
    t = RedisTransport(bus, run_keys)
    ref = await t.publish("weights-v0-e", r.engine.policy.state_dict())
    await t.delete(ref)  # lost before this rollouter read it
    await bus.publish(run_keys.events,
                      WeightsPublished(version=0, ref=ref, step=0, manifest=ref))
    with pytest.raises(WeightsLost, match="v0"):
        await r.context.weights.first()
    r.worker.shutdown()


@pytest.mark.e2e
async def test_a_rollouter_without_access_to_the_weights_fails_fast_named(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    common = (f"redis.url={redis_url}", "rollout.weights_transport=storage",
              "rollout.weights_fetch_timeout_s=2")
    trainer_args = run_args(redis_url, run_id, tmp_path / "trainer-node", *common)
    # The rollouter's node does not have the trainer's run directory.
    rollouter_args = run_args(redis_url, run_id, tmp_path / "other-node", *common)
    procs.spawn("trainer", "trainer", *trainer_args)
    await wait_for(bus, run_keys.events, event(WeightsPublished), 60, procs.watch("trainer"))
    procs.spawn("rollouter0", "rollouter", *rollouter_args)
    assert procs.wait("rollouter0", 90) == 1, procs.log("rollouter0")
    assert "WeightsUnreachable" in procs.log("rollouter0")
    assert "weights v0" in procs.log("rollouter0")
    warned = [e for e in await events_of(bus, run_keys.events)
              if isinstance(e, WarningRaised) and e.code == "weights_unreachable"]
    assert len(warned) == 1, warned
    assert "v0" in warned[0].message and str(tmp_path / "other-node") in warned[0].message
    procs.kill("trainer")


async def test_a_resumed_trainer_sweeps_storage_publications_no_event_names(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from trainer.weights import Weights

    t = StorageTransport(tmp_path / "blobs", chunk_size=CHUNK)
    kept = await t.publish("weights-v1-old", {"a": torch.ones(3)})
    await t.publish("weights-v2-old", {"a": torch.ones(3)})  # written, never announced
    await t.publish("other", {"a": torch.ones(3)})  # not weights: left alone
    writer = SimpleNamespace(state=SimpleNamespace(weights=((1, kept),)))
    await Weights(bus, run_keys, writer, tmp_path / "blobs", "new").sweep()  # type: ignore[arg-type]
    assert await t.names("") == ["other", "weights-v1-old"]


async def test_weights_that_cannot_be_written_are_a_named_failure(
    bus: Bus, run_keys: RunKeys, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from trainer.weights import Weights, WeightsUnwritable

    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")  # the storage root is a file: nothing can be written under it
    writer = SimpleNamespace(state=SimpleNamespace(weights=()))
    w = Weights(bus, run_keys, writer, blocker, "e",  # type: ignore[arg-type]
                transport="storage")
    snapshot: asyncio.Future[dict[str, torch.Tensor]] = asyncio.get_running_loop().create_future()
    snapshot.set_result({"a": torch.ones(3)})
    with pytest.raises(WeightsUnwritable, match="weights v0 could not be written to"):
        await w.publish(0, 0, snapshot)


async def test_a_fetch_gives_up_only_when_nothing_tries_to_bring_the_weights() -> None:
    """The fetch bound counts from the sender's last try: a receiver whose broadcast rounds
    keep failing (another member killed mid-round) while the trainer keeps inviting it never
    gives up; one that no round invites gives up after the bound."""
    from rollouter.weights import WeightsUnreachable, fetch_within

    msg = WeightsPublished(version=3, ref=BlobRef(store="collective", key="k", size=1,
                                                  sha256=""))
    warned: list[WarningRaised] = []

    async def warn(w: WarningRaised) -> None:
        warned.append(w)

    def failing(rounds: list[int], good_after: int) -> Callable[[], Awaitable[dict]]:
        async def fetch() -> dict:
            rounds[0] += 1  # one round per try: the trainer invited us again
            await asyncio.sleep(0.02)  # each try outlasts the bound below
            if rounds[0] > good_after:
                return {"w": 1}
            raise TransportUnreachable("round failed: Connection closed by peer")
        return fetch

    rounds = [0]
    got = await fetch_within(failing(rounds, 6), msg, "the broadcast", 0.01, "r0", warn,
                             tries=lambda: rounds[0])
    assert got == {"w": 1} and rounds[0] == 7 and len(warned) == 1
    with pytest.raises(WeightsUnreachable, match="stayed unreadable"):
        await fetch_within(failing([0], 6), msg, "the broadcast", 0.01, "r0", warn,
                           tries=lambda: 0)
