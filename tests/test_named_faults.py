"""Faults that used to hide their cause (issue 36 item 6): a full disk, Redis out of memory
or unable to persist. Each is one line naming the cause (where, how much), a ComponentFailed
when the log can still take one, and no traceback.

The decisions are tested without processes; a real redis-server with a ``maxmemory`` shows the
bus's error, and two live runs show the shell: a trainer whose checkpoint folder is a 3 MiB
tmpfs (the third checkpoint does not fit) and a run whose Redis reaches its ``maxmemory``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus import Bus, BusCannotPersist, BusOutOfMemory, RunKeys, server_refusal
from rollouter.presence import TrainerGone, TrainerPresence
from runschema.messages import ComponentFailed, StepFinished, WarningRaised
from runtime.faults import DiskFull, disk_full, space_warning
from tests.procs import Procs, events_of, run_args
from tests.waits import event, wait_for

# --------------------------------------------------------------------------- decisions


def test_server_refusals_are_named_by_their_reply() -> None:
    assert server_refusal("OOM command not allowed when used memory > 'maxmemory'.") is (
        BusOutOfMemory)
    assert server_refusal("Error running script (call to f_1): @user_script:1: "
                          "@user_script: 1: -OOM command not allowed when used memory") is (
        BusOutOfMemory)
    assert server_refusal("MISCONF Errors writing to the AOF file: No space left on "
                          "device") is BusCannotPersist
    assert server_refusal("BUSYGROUP Consumer Group name already exists") is None
    assert server_refusal("NOGROUP No such key 'x' or consumer group 'g'") is None


def test_a_full_disk_is_named_with_where_and_what(tmp_path: Path) -> None:
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "step-000004.pt"))
    full = disk_full(exc, tmp_path, "the checkpoint of step 4")
    assert isinstance(full, DiskFull)
    line = str(full)
    assert "\n" not in line and line.startswith("disk full: writing the checkpoint of step 4")
    assert "step-000004.pt" in line and "free there" in line
    # Another error where there is room is not a full disk.
    assert disk_full(RuntimeError("unexpected pos 512"), tmp_path, "x") is None
    assert disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path, "x") is None


def test_a_checkpoint_that_cannot_fit_is_said_before_it_is_written(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    line = space_warning(tmp_path, free * 2, "the checkpoint of step 8")
    assert line is not None and "the checkpoint of step 8 needs about" in line
    assert str(tmp_path) in line
    assert space_warning(tmp_path, 1024, "x") is None
    assert space_warning("s3://bucket/run", 10**15, "x") is None  # cannot be told: no line


@pytest.mark.asyncio
async def test_redis_out_of_memory_names_used_and_max(redis_factory, make_bus) -> None:
    server = redis_factory()
    bus: Bus = await make_bus(server.url)
    await bus.command("CONFIG", "SET", "maxmemory", "2mb")
    with pytest.raises(BusOutOfMemory) as raised:
        for i in range(10_000):
            await bus.command("SET", f"k{i}", "x" * 1000)
    line = str(raised.value)
    assert "out of memory: used_memory" in line and "of maxmemory 2.00M" in line
    assert "noeviction" in line and "\n" not in line
    # A transaction's refusal (the weights' MULTI/EXEC): redis-py's quote of the command
    # it refused, binary arguments and all, is left out of the line. Written until refused:
    # used_memory can dip back under maxmemory once the refused write's buffers are freed.
    with pytest.raises(BusOutOfMemory) as raised:
        for i in range(1000):
            await bus.pipeline([("SADD", "blobs", f"w{i}:0", f"w{i}:m"),
                                ("SET", f"w{i}:0", b"\x00\n\xff" * 999),
                                ("SET", f"w{i}:m", b"m")], atomic=True, op="SET")
    line = str(raised.value)
    assert "it refused SET (" in line and "of pipeline" not in line and "\\x" not in line
    assert "\n" not in line and line.isprintable(), line


# --------------------------------------------------------------------------- live runs


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (the test is skipped, saying why, where
    this machine cannot mount one: no root, no CAP_SYS_ADMIN)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(where)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the full-disk "
                    "run needs root or CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_a_checkpoint_on_a_full_disk_is_one_line(
    redis_url: str, bus: Bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    with _tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", "3m") as disk:
        args = run_args(redis_url, run_id, tmp_path, "trainer.total_training_steps=20",
                        "trainer.save_freq=2", f"trainer.default_local_dir={disk}")
        procs.spawn("rollouter0", "rollouter", *args)
        procs.spawn("trainer", "trainer", *args)
        assert await asyncio.to_thread(procs.wait, "trainer", 240) == 1, procs.log("trainer")
    log = procs.log("trainer")
    assert "Traceback" not in log, log
    lines = [ln for ln in log.splitlines() if "disk full" in ln]
    assert len(lines) == 1, log
    assert "writing the checkpoint of step 6" in lines[0] and "free there" in lines[0]
    events = await events_of(bus, run_keys.events)
    failed = [e for e in events if isinstance(e, ComponentFailed) and e.role == "trainer"]
    assert len(failed) == 1 and failed[0].error.startswith("disk full"), failed
    warned = [e for e in events if isinstance(e, WarningRaised) and e.code == "checkpoint_space"]
    assert warned and "the checkpoint of step 6 needs about" in warned[0].message, warned


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_redis_at_its_maxmemory_ends_each_part_with_one_line(
    redis_factory, make_bus, run_id: str, run_keys: RunKeys, tmp_path: Path, procs: Procs
) -> None:
    server = redis_factory()
    bus: Bus = await make_bus(server.url)
    args = run_args(server.url, run_id, tmp_path, "trainer.total_training_steps=100000")
    procs.spawn("rollouter0", "rollouter", *args)
    procs.spawn("trainer", "trainer", *args)
    await wait_for(bus, run_keys.events, event(StepFinished, step=3), 180,
                   procs.watch("trainer"))
    used = int((await bus.command("INFO", "memory"))["used_memory"])
    await bus.command("CONFIG", "SET", "maxmemory", str(used + 256 * 1024))
    for name in ("trainer", "rollouter0"):
        assert await asyncio.to_thread(procs.wait, name, 240) == 1, procs.log(name)
        log = procs.log(name)
        assert "Traceback" not in log, log
        lines = [ln for ln in log.splitlines() if "is out of memory" in ln]
        assert len(lines) == 1, log
        assert "used_memory" in lines[0] and "of maxmemory" in lines[0]


@pytest.mark.asyncio
async def test_a_rollouter_repeats_the_trainers_stated_cause(
    bus: Bus, run_id: str, run_keys: RunKeys
) -> None:
    """The trainer's lease lapsed: the rollouter's line is the trainer's own last word (its
    ComponentFailed), not just "lease lapsed"; with no such word, nothing is made up."""
    presence = TrainerPresence(bus, run_keys.trainer_lease, run_id, 0.0,
                               run_keys.log("trainer"))
    presence.seen = True
    with pytest.raises(TrainerGone) as silent:
        await presence.check()
    assert str(silent.value).startswith("trainer is gone: its lease ")
    await bus.publish(run_keys.events, ComponentFailed(
        role="trainer", rank=0, error="disk full: writing the checkpoint of step 6 to /c"))
    with pytest.raises(TrainerGone) as stated:
        await presence.check()
    assert str(stated.value).startswith(
        "trainer is gone: it failed: disk full: writing the checkpoint of step 6 to /c; its "
        "lease ")


@pytest.mark.asyncio
async def test_a_rollouter_names_writes_refused_for_memory_after_the_memory_came_back(
    redis_factory, make_bus, run_id: str
) -> None:
    """The trainer's large write (a batch of samples) counts its own request against
    ``maxmemory`` and is refused; its memory is freed with the refusal, so Redis is below the
    limit again when the lease lapses. The rollouter still names memory: Redis counted the
    refusal while the trainer was there."""
    server = redis_factory()
    bus: Bus = await make_bus(server.url)
    keys = RunKeys(run_id)
    presence = TrainerPresence(bus, keys.trainer_lease, run_id, 0.0, keys.log("trainer"))
    await bus.command("SET", keys.trainer_lease, "token")
    await presence.check()  # the trainer is there: Redis's count of refusals is read
    used = int((await bus.command("INFO", "memory"))["used_memory"])
    await bus.command("CONFIG", "SET", "maxmemory", str(used + 256 * 1024))
    trainer: Bus = await make_bus(server.url)
    with pytest.raises(BusOutOfMemory):
        await trainer.command("SET", "a-batch-of-samples", "x" * (2 << 20))
    await trainer.close()  # the trainer exits: its request's buffer is freed with its client
    await _memory_below_its_limit(bus)
    await bus.command("SET", "a-small-write", "x")  # it passes: memory came back
    await bus.command("DEL", keys.trainer_lease)
    await presence.check()  # absent from now on
    await asyncio.sleep(0.01)
    with pytest.raises(TrainerGone) as gone:
        await presence.check()
    line = str(gone.value)
    assert line.startswith(f"trainer is gone: Redis at {server.url} is out of memory: "
                           "used_memory "), line
    assert "it refused 1 write(s) for memory in the last 0 s; its lease" in line, line


@pytest.mark.asyncio
async def test_a_trainer_gone_without_a_refusal_is_not_blamed_on_memory(
    redis_factory, make_bus, run_id: str
) -> None:
    """Writes refused for memory before the trainer was last counted are not why it went."""
    server = redis_factory()
    bus: Bus = await make_bus(server.url)
    keys = RunKeys(run_id)
    used = int((await bus.command("INFO", "memory"))["used_memory"])
    await bus.command("CONFIG", "SET", "maxmemory", str(used + 256 * 1024))
    old: Bus = await make_bus(server.url)
    with pytest.raises(BusOutOfMemory):
        await old.command("SET", "an-old-episode", "x" * (2 << 20))
    await old.close()
    await _memory_below_its_limit(bus)
    presence = TrainerPresence(bus, keys.trainer_lease, run_id, 0.0, keys.log("trainer"))
    await bus.command("SET", keys.trainer_lease, "token")
    await presence.check()
    await bus.command("DEL", keys.trainer_lease)
    await presence.check()  # absent from now on
    await asyncio.sleep(0.01)
    with pytest.raises(TrainerGone) as gone:
        await presence.check()
    assert str(gone.value).startswith("trainer is gone: its lease "), gone.value


async def _memory_below_its_limit(bus: Bus) -> None:
    """Wait (30 s at most) until the server has freed a closed client's buffers."""
    async with asyncio.timeout(30):
        while True:
            memory = await bus.command("INFO", "memory")
            if int(memory["used_memory"]) < int(memory["maxmemory"]):
                return
            await asyncio.sleep(0.05)
