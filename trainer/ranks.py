"""Trainer ranks: ``trainer.nnodes x trainer.n_gpus_per_node`` processes in one
``torch.distributed`` group (docs/training.md, "Trainer ranks").

Rank 0 is the trainer component: it holds the run's lease, reads the samples and is the only
one that writes to the bus. The other ranks know nothing of Redis: rank 0 drives them through
an *op channel*, one ``broadcast`` from rank 0 per model operation (a mini-batch added, an
epoch trained, the weights gathered, a checkpoint loaded), sent from its worker thread just
before it runs the same operation itself. Every rank therefore runs the same operations in
the same order, so their collectives (FSDP2's all-gathers and reduce-scatters, the metric
reductions) always pair up, and a replay of the log drives the ranks exactly as the first run
did.

Gloo on CPUs, NCCL on GPUs (``cuda:<local rank>``). A rank that dies fails the next
collective of the others (a closed connection, or ``trainer.dist_timeout_s``); rank 0 names it
and exits, and the run resumes as after a trainer kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from policy import resolve_device
from runconfig import TrainerConfig
from runtime.component import Failure

__all__ = [
    "ChannelBroke",
    "LocalRanks",
    "RankFailed",
    "RankGroup",
    "RankSpec",
    "backend_line",
    "collective_failure",
    "rank_device",
    "rank_zero_group",
    "spawn_ranks",
    "wait_ranks",
    "world_size",
]

RANK_EXIT_SETTLE_S = 2.0
"""How long a failure of rank 0 waits to see one of its ranks exit before it is taken as its
own (a killed rank's sockets reset before its exit can be reaped: trainer.ranks.LocalRanks)."""


class RankFailed(Failure):
    """A trainer rank died or stopped answering (its collective failed): one line naming
    it, a ComponentFailed, exit 1; the run resumes from the log as after a trainer kill."""


class ChannelBroke(RankFailed):
    """The op channel's broadcast failed: on rank 0 another rank is gone, on another rank
    rank 0 is (:func:`collective_failure` takes it as a lost peer)."""


# What a backend's error says when a peer rank went away mid-collective: gloo raises plain
# RuntimeErrors ("Connection closed by peer", "Read error ... Connection reset by peer"), NCCL
# DistBackendErrors; a timeout names the operation it waited for.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "gloo", "nccl", "timed out waiting", "socket timeout")


def backend_line(text: str) -> str:
    """A backend's error in one line: its first, without gloo's advice after it ("This is
    typically caused by ... GLHF!")."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.split(" This is typically caused by")[0][:300]


def collective_failure(exc: BaseException) -> str | None:
    """The first line of ``exc`` when it is a collective of the trainer ranks that failed
    (torch.distributed's errors, or a backend's RuntimeError naming a lost peer), else
    None: a failure of rank 0's own code is not blamed on the other ranks."""
    if isinstance(exc, ChannelBroke):
        return str(exc)
    if isinstance(exc, Failure):  # a failure the trainer named already
        return None
    text = str(exc).strip()
    first = backend_line(text) if text else type(exc).__name__
    if isinstance(exc, dist.DistError):
        return first
    if isinstance(exc, RuntimeError) and any(m in text.lower() for m in _PEER_GONE):
        return first
    return None


def world_size(tc: TrainerConfig) -> int:
    """How many trainer ranks the run has."""
    return tc.nnodes * tc.n_gpus_per_node


def rank_device(tc: TrainerConfig, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of its node: ``cuda:<local rank>`` when the
    trainer's device is CUDA, else the CPU."""
    device = resolve_device(tc.device)
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device


@dataclass(frozen=True)
class RankSpec:
    """Where a rank stands in the group and where the group meets."""

    rank: int
    world: int
    local_rank: int
    addr: str
    port: int


class RankGroup:
    """This process's membership of the trainer's group: the op channel and the reductions.

    A group of one never touches torch.distributed: every method is then the identity, so a
    one-rank trainer computes exactly what it did before ranks existed."""

    def __init__(self, spec: RankSpec | None, device: torch.device, timeout_s: float,
                 store: Any = None) -> None:
        self.spec = spec
        self.store = store  # rank 0's rendezvous, already listening (rank_zero_group)
        self.device = device
        self.timeout_s = timeout_s
        self.rank = spec.rank if spec is not None else 0
        self.world = spec.world if spec is not None else 1
        self.sent_at = time.monotonic()  # the last op rank 0 sent (keepalive)

    @property
    def active(self) -> bool:
        return self.world > 1

    def open(self) -> None:
        """``init_process_group`` over TCP at the spec's address (blocking until every rank
        joined, at most ``timeout_s``)."""
        if not self.active:
            return
        assert self.spec is not None
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            if self.store is None:  # rank 0 listens there, the others connect
                self.store = dist.TCPStore(self.spec.addr, self.spec.port, self.world,
                                           is_master=self.rank == 0, timeout=timeout,
                                           wait_for_workers=False)
            dist.init_process_group(backend, store=self.store, rank=self.rank,
                                    world_size=self.world, timeout=timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise RankFailed(f"trainer ranks did not all join at {self.spec.addr}:"
                             f"{self.spec.port} within {self.timeout_s:g} s "
                             f"(trainer.dist_timeout_s): {exc}") from exc

    def close(self) -> None:
        if self.active and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.store = None  # its listening socket goes with it

    # ------------------------------------------------------------------ the op channel

    def send(self, op: str, payload: Any = None) -> None:
        """Rank 0: tell every rank the next operation (``broadcast_object_list``)."""
        if not self.active:
            return
        self.sent_at = time.monotonic()
        self._broadcast([op, payload])

    def receive(self) -> tuple[str, Any]:
        """Ranks > 0: the next operation rank 0 sent (blocks up to ``timeout_s``)."""
        box: list[Any] = [None, None]
        self._broadcast(box)
        return box[0], box[1]

    def _broadcast(self, box: list[Any]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, device=self._comm_device())
        except (RuntimeError, ValueError) as exc:
            raise ChannelBroke(f"the trainer ranks' op channel broke: "
                               f"{backend_line(str(exc))}") from exc

    def _comm_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    # ------------------------------------------------------------------ reductions

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``all_reduce(SUM)`` of a float tensor across ranks (a new CPU tensor)."""
        if not self.active:
            return values.detach().clone().cpu()
        t = values.detach().to(device=self._reduce_device(), dtype=torch.float64).clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def sum_(self, t: torch.Tensor) -> None:
        """``all_reduce(SUM)`` of ``t`` in place, in its own dtype (gradients: no copy off
        the device, no widening)."""
        if not self.active:
            return
        if t.device.type == self.device.type:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return
        moved = t.to(self.device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        t.copy_(moved)

    def max_int(self, value: int) -> int:
        """The largest ``value`` of all ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._reduce_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``all_gather_object``)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_(self, t: torch.Tensor) -> None:
        """Rank 0's ``t`` into every rank's ``t`` (in place)."""
        if not self.active:
            return
        if t.device.type == self.device.type:
            dist.broadcast(t, src=0)
            return
        moved = t.to(self.device)
        dist.broadcast(moved, src=0)
        t.copy_(moved)

    def _reduce_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL when the process that spawned it dies (no orphan rank
    waits on a trainer that is gone)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn_ranks(ranks: range, per_node: int, world: int, addr: str, port: int, *,
                device: str, timeout_s: float) -> list[subprocess.Popen[bytes]]:
    """Start ``ranks`` of this node as processes (``python -m trainer.rank``), each on local
    rank ``rank % per_node``; their output goes where this process's goes."""
    procs = []
    for rank in ranks:
        local = rank % per_node
        cmd = [sys.executable, "-m", "trainer.rank", "--rank", str(rank), "--world",
               str(world), "--local-rank", str(local), "--addr", addr, "--port", str(port),
               "--device", device, "--timeout", str(timeout_s)]
        env = dict(os.environ, RLBUS_TRAINER_RANK=str(rank))
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
    return procs


def rank_zero_group(tc: TrainerConfig) -> RankGroup:
    """Rank 0's membership (a group of one when the run has one rank): the rendezvous at
    ``trainer.master_addr``, on ``trainer.master_port`` or, on one node, a free port."""
    device = rank_device(tc, 0)
    world = world_size(tc)
    if world == 1:
        return RankGroup(None, device, tc.dist_timeout_s)
    if tc.master_port is not None:
        spec = RankSpec(0, world, 0, tc.master_addr, tc.master_port)
        return RankGroup(spec, device, tc.dist_timeout_s)
    # No port given (one node): the rendezvous listens now, on a port the OS picks, so no
    # other process can take it between choosing it and the ranks meeting there.
    store = dist.TCPStore(tc.master_addr, 0, world, is_master=True,
                          timeout=timedelta(seconds=tc.dist_timeout_s), wait_for_workers=False)
    spec = RankSpec(0, world, 0, tc.master_addr, int(store.port))
    return RankGroup(spec, device, tc.dist_timeout_s, store)


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` for ``procs`` to exit, then kill what is left; their exit
    codes."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


class LocalRanks:
    """Rank 0's side of the group: its membership and this node's other ranks, as
    processes started, watched and stopped by the trainer (trainer.process)."""

    def __init__(self, tc: TrainerConfig) -> None:
        self.tc = tc
        self.group = rank_zero_group(tc)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pinging: asyncio.Future[None] | None = None  # a keepalive to the ranks

    def start(self) -> list[str]:
        """Start ranks ``1 .. n_gpus_per_node - 1``; the lines to say about them."""
        spec, tc = self.group.spec, self.tc
        if spec is None:
            return []
        self.procs = spawn_ranks(range(1, tc.n_gpus_per_node), tc.n_gpus_per_node,
                                 spec.world, spec.addr, spec.port, device=tc.device,
                                 timeout_s=tc.dist_timeout_s)
        pids = ", ".join(str(p.pid) for p in self.procs)
        here = (f"ranks 0..{tc.n_gpus_per_node - 1} here (1.. pids {pids})" if self.procs
                else "rank 0 here")
        lines = [f"{spec.world} trainer ranks ({tc.strategy}); {here}"
                 + ("" if tc.nnodes == 1 else f", the others on {tc.nnodes - 1} other node(s)")]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        if self.group.device.type == "cpu" and tc.n_gpus_per_node * tc.threads > cpus:
            lines.append(f"{tc.n_gpus_per_node} CPU ranks of {tc.threads} thread(s) share "
                         f"{cpus} CPU(s): without GPUs trainer.n_gpus_per_node counts CPU "
                         "processes")
        return lines

    def joining(self) -> str | None:
        """What rank 0 waits for until the group is whole (None: a group of one)."""
        spec = self.group.spec
        if spec is None:
            return None
        return f"waiting for {spec.world - 1} trainer rank(s) to join at {spec.addr}:{spec.port}"

    def _wait_any_exit(self, timeout_s: float) -> None:
        """Block until one of this node's ranks has exited, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                return
            time.sleep(0.02)

    def dead(self) -> str | None:
        """This node's ranks that exited, in words (None: all alive)."""
        gone = [f"trainer rank {i} (pid {p.pid}) exited with code {p.returncode}"
                for i, p in enumerate(self.procs, start=1) if p.poll() is not None]
        return "; ".join(gone) or None

    async def failure(self, exc: BaseException,
                      settle_s: float = RANK_EXIT_SETTLE_S) -> RankFailed | None:
        """``exc`` as the failure of the ranks that died (None when none did). A rank killed
        outright resets its sockets while it exits, before its parent can reap it: rank 0's
        broken collective may be seen first, so a rank is given ``settle_s`` to be seen
        exiting (off the loop) before ``exc`` is taken as not theirs."""
        dead = self.dead()
        if dead is None and self.procs:
            await asyncio.to_thread(self._wait_any_exit, settle_s)
            dead = self.dead()
        if dead is not None:
            return RankFailed(f"{dead} ({type(exc).__name__}: {backend_line(str(exc))})")
        spec = self.group.spec
        lost = collective_failure(exc)
        if spec is None or spec.world == 1 or lost is None:
            return None
        # None of this node's ranks died: a rank of another node did, or its node is gone or
        # unreachable; that node's `rlbus trainer` says which rank and why.
        alive = f"ranks 0..{len(self.procs)} are" if self.procs else "rank 0 is"
        return RankFailed(
            f"a trainer rank on another node is gone or unreachable: rank 0's collective with "
            f"the {spec.world} ranks failed ({type(exc).__name__}: {lost}); this node's "
            f"{alive} alive; see the other nodes' `rlbus trainer trainer.node_rank=N` logs")

    def keep_alive(self, submit: Callable[[Callable[[], None]], asyncio.Future[None]],
                   ping: Callable[[], None], busy: bool) -> None:
        """The other ranks wait for rank 0's next operation at most trainer.dist_timeout_s:
        when rank 0 has told them nothing for a quarter of that, ``submit`` a ``ping`` to its
        worker (one at a time; not while the worker is ``busy`` building). A failed ping
        fails the next operation, which says why."""
        idle_s = time.monotonic() - self.group.sent_at
        if (self.group.active and not busy and self._pinging is None
                and idle_s > self.group.timeout_s / 4):
            self._pinging = submit(ping)
            self._pinging.add_done_callback(self._pinged)

    def _pinged(self, future: asyncio.Future[None]) -> None:
        self._pinging = None
        if not future.cancelled():
            future.exception()  # retrieved: the next operation raises it

    async def stop(self, stop_ranks: Callable[[], Awaitable[Any]], timeout_s: float) -> None:
        """Tell the other ranks to stop (``stop_ranks``, bounded by ``timeout_s``: a broken
        group is moot), wait for this node's, kill what is left, leave the group."""
        if not self.group.active:
            return
        if self.dead() is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stop_ranks(), timeout_s)
        await asyncio.to_thread(self.close, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for this node's ranks to exit (killing what is left),
        then leave the group (blocking)."""
        wait_ranks(self.procs, timeout_s)
        self.group.close()
