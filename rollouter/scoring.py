"""Reward scoring off the event loop: a pool of ``rollout.reward_workers`` processes, each
with the run's reward function loaded once (:mod:`tasks.rewards`), and the rollouter's
:class:`Scorer` in front of it (responses decoded, scored, the one warning published).

A batch is scored by every worker at once, each taking the next samples when it is done with
its last; the waiting happens on a thread per worker, so the rollouter's loop stays free for
its heartbeat however slow the scorer. A call longer than ``rollout.reward_timeout_s`` gets
its worker killed and replaced (a hung scorer never wedges the pool). A call that raises, times
out or kills its worker scores 0, ``failed``: counted (:attr:`RewardPool.failures`,
:attr:`RewardPool.timeouts`) and, for verl's rewards, told once with the first traceback
(:meth:`RewardPool.take_warning`); its sample carries the error (``Sample.reward_error``),
which the trainer counts in each step's metrics and stops the run on above
``reward.max_failure_ratio``.

Fast scorers get their samples in chunks, one round trip per chunk (a round trip per sample
cost the default task ~15 ms of a 2-core machine's CPU a step: :func:`chunk_size`). A chunk
must end within one call's timeout; one that does not, or whose worker dies, has its samples
scored again one at a time, so a sample times out or fails only for what it does itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec

from policy.text import decode_conversation
from tasks.rewards import RewardSpec, spec_from_config

if TYPE_CHECKING:  # types only: rollouter.answers imports this module
    from agent.conversation import Dialogue
    from policy.text import TextTokenizer
    from rollouter.answers import Seq
    from rollouter.engine import Off
    from runconfig import Config
    from runschema.messages import PromptTicket

__all__ = ["MAX_CHUNK", "RewardPool", "Rewards", "Score", "ScoreItem", "Scorer", "chunk_size",
           "conversation_extra_info"]

STARTUP_S = 300.0
"""Most seconds a new worker may take to load the reward function (imports included): a
file importing verl (ReTool's) took over 60 s on 2 cores busy with a vLLM engine's warm-up,
and a slow import is not a dead worker. A worker that dies while loading is told at once
(its pipe closes); only a hung import waits the whole bound."""


class ScoreItem(msgspec.Struct, frozen=True):
    """One response to score: verl's arguments, and its length in tokens (dapo)."""

    data_source: str
    solution_str: str
    ground_truth: Any  # whatever the data set's reward_model.ground_truth holds
    extra_info: dict[str, Any] | None
    response_len: int


class Score(NamedTuple):
    """One response's reward: ``failed`` ones score 0; ``error`` says why (``Type: message``),
    ``timed_out`` whether it was the timeout."""

    reward: float
    extra: dict[str, float]
    seconds: float
    failed: bool
    error: str = ""
    timed_out: bool = False


MAX_CHUNK = 32
"""Most samples sent to a worker in one round trip."""

CHUNK_SHARE_OF_TIMEOUT = 0.05
"""A chunk is sized so that its samples, at the slowest call of the last batch, take at most
this share of ``rollout.reward_timeout_s``: a chunk that runs past the timeout is scored
again sample by sample, a cost paid only by a scorer that suddenly got 20 times slower."""


def chunk_size(slowest_s: float | None, timeout_s: float, samples: int, workers: int) -> int:
    """How many samples a worker takes at a time: 1 before any call was timed (a new
    scorer), else as many as fit :data:`CHUNK_SHARE_OF_TIMEOUT` of the timeout at the
    slowest call seen, at most :data:`MAX_CHUNK`, and small enough that every worker gets
    two chunks of the batch."""
    if slowest_s is None:
        return 1
    fit = int(CHUNK_SHARE_OF_TIMEOUT * timeout_s / max(slowest_s, 1e-6))
    share = -(-samples // (2 * workers))
    return max(1, min(fit, MAX_CHUNK, share))


class _Timeout(Exception):
    pass


class _Died(Exception):
    def __init__(self, error: str, detail: str) -> None:
        super().__init__(error)
        self.error, self.detail = error, detail


class _Worker:
    """One scoring process and its pipe, driven by one thread at a time (``lock``).

    A plain ``python -c`` child that inherits one end of a pipe (not multiprocessing's
    spawn or forkserver: those re-run the parent's ``__main__`` in every child, a script
    that may not exist or may start a run). It imports only :mod:`tasks.rewards`."""

    def __init__(self, spec: RewardSpec, index: int) -> None:
        self.spec, self.index = spec, index
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.broken: _Died | None = None
        """Why the last start failed: the rest of the batch fails at once (no start per
        sample); the next batch tries again."""

    def _start(self) -> None:
        if self.broken is not None:
            raise self.broken
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tasks.rewards import serve_fd; serve_fd({fd})"],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, start_new_session=False,
        )
        theirs.close()  # ours closed: the worker's death reads as EOF here
        self.conn = Connection(ours.detach())
        try:
            self.conn.send((self.spec, list(sys.path)))  # legacy reward modules resolve as here
            reply = self._wait_ready()
        except _Died as exc:
            self.kill()
            self.broken = exc
            raise
        if reply[0] != "ready":
            self.kill()
            self.broken = _Died("reward worker could not load the reward function", reply[1])
            raise self.broken

    def _wait_ready(self) -> Any:
        assert self.conn is not None
        if not self.conn.poll(STARTUP_S):
            raise _Died("reward worker did not start",
                        f"the reward worker took over {STARTUP_S:.0f} s to load the function")
        return self._recv()

    def _recv(self) -> Any:
        assert self.conn is not None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            proc = self.proc
            code = proc.wait(timeout=5) if proc is not None else None
            self.kill()
            raise _Died(f"reward worker died (exit code {code})",
                        f"the reward worker process died (exit code {code}) while scoring; "
                        "a new one replaces it") from None

    def warm(self) -> None:
        """Start the process now (in the background, while the rollouter builds its model):
        the first batch does not wait for it. A failed start is retried at that batch."""
        with self.lock, contextlib.suppress(Exception):
            self._ensure()

    def _ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self._start()

    def call(self, item: Any, timeout_s: float) -> Any:
        """The worker's reply to ``item`` (a list of replies to a list of items); _Timeout
        (the worker is killed) or _Died."""
        self._ensure()
        assert self.conn is not None
        try:
            self.conn.send(item)
        except (OSError, ValueError):
            self.kill()
            raise _Died("reward worker died", "the reward worker's pipe closed") from None
        if not self.conn.poll(timeout_s):
            self.kill()
            raise _Timeout
        return self._recv()

    def __del__(self) -> None:
        # A pool dropped without close() (a rollouter built without its teardown) must not
        # leave its process running, nor Popen's "still running" warning at collection.
        with contextlib.suppress(Exception):
            self.kill()

    def kill(self) -> None:
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if conn is not None:
            conn.close()


class RewardPool:
    """The rollouter's reward scoring (see the module's doc). Raises ConfigError at
    construction for a bad reward setting (a missing or broken reward file, a bad dapo
    overlong buffer), before any process starts."""

    def __init__(self, cfg: Config) -> None:
        self.spec = spec_from_config(cfg)
        self.timeout_s = float(cfg.rollout.reward_timeout_s)
        self.size = int(cfg.rollout.reward_workers)
        # Never a fork of the rollouter (it holds torch's threads and locks): a fresh
        # interpreter that imports only tasks.rewards starts in a fraction of a second.
        self._workers = [_Worker(self.spec, i) for i in range(self.size)]
        self._threads = ThreadPoolExecutor(max_workers=self.size,
                                           thread_name_prefix="rlbus-reward")
        for worker in self._workers:
            self._threads.submit(worker.warm)
        self._lock = threading.Lock()
        self._batch = asyncio.Lock()
        self._closed = False
        self._warned = False
        self._warning: str | None = None
        self.failures = 0
        """Calls that raised (or whose worker died), every batch so far."""
        self.timeouts = 0
        """Calls that ran past ``rollout.reward_timeout_s``."""
        self.scored = 0
        """Calls that ended (scored, failed or timed out): the rollouter's progress while it
        scores, one call at a time."""
        self._slowest_s: float | None = None
        """The slowest call of the last batch (what sizes the next batch's chunks)."""

    def fails_ticket(self, data_source: str) -> bool:
        """Whether a failed score fails its ticket rather than scoring 0: rlbus's own
        ``task.reward_fn`` (a sample without a data source and no custom function) keeps its
        contract (the ticket is retried, then dead-lettered); verl's rewards score 0."""
        return self.spec.legacy(data_source)

    async def score(self, items: list[ScoreItem]) -> list[Score]:
        """Every item's score, in order; the loop is free while the workers score."""
        if not items:
            return []
        async with self._batch:
            todo: queue.SimpleQueue[tuple[int, ScoreItem]] = queue.SimpleQueue()
            for i, item in enumerate(items):
                todo.put((i, item))
            results: list[Score | None] = [None] * len(items)
            stop = threading.Event()
            loop = asyncio.get_running_loop()
            for worker in self._workers:
                worker.broken = None  # a worker that failed to start gets another chance
            chunk = chunk_size(self._slowest_s, self.timeout_s, len(items), self.size)
            drains = [loop.run_in_executor(self._threads, self._drain, w, todo, results, stop,
                                           chunk)
                      for w in self._workers[:len(items)]]
            try:
                await asyncio.gather(*drains)
            finally:
                stop.set()  # cancelled: the threads stop after their current samples
            timed = [r.seconds for r in results if r is not None]  # a timeout: timeout_s
            self._slowest_s = max(timed) if timed else None
        return [r if r is not None else self._fail(it, "scoring stopped", "", 0.0)
                for r, it in zip(results, items, strict=True)]

    def _drain(self, worker: _Worker, todo: queue.SimpleQueue[tuple[int, ScoreItem]],
               results: list[Score | None], stop: threading.Event, chunk: int) -> None:
        with worker.lock:
            while not stop.is_set() and not self._closed:
                taken = _take(todo, chunk)
                if not taken:
                    return
                try:
                    scores = self._score_chunk(worker, [item for _, item in taken])
                except Exception as exc:  # closed under it, or a fault of the pool itself
                    scores = [self._fail(item, f"reward pool: {type(exc).__name__}: {exc}",
                                         "", 0.0) for _, item in taken]
                for (i, _), score in zip(taken, scores, strict=True):
                    results[i] = score
                with self._lock:
                    self.scored += len(taken)

    def _score_chunk(self, worker: _Worker, items: list[ScoreItem]) -> list[Score]:
        """``items``' scores in one round trip; a chunk that timed out or killed its worker
        is scored again one sample at a time (only the sample at fault fails)."""
        if len(items) == 1:
            return [self._score_one(worker, items[0])]
        try:
            replies = worker.call([_wire(item) for item in items], self.timeout_s)
        except (_Timeout, _Died):
            return [self._score_one(worker, item) for item in items]
        return [self._scored(item, reply) for item, reply in zip(items, replies, strict=True)]

    def _score_one(self, worker: _Worker, item: ScoreItem) -> Score:
        try:
            reply = worker.call(_wire(item), self.timeout_s)
        except _Timeout:
            return self._fail(item, f"reward function timed out after {self.timeout_s:g} s "
                                    "(rollout.reward_timeout_s)", "", self.timeout_s,
                              timeout=True)
        except _Died as exc:
            return self._fail(item, exc.error, exc.detail, 0.0)
        return self._scored(item, reply)

    def _scored(self, item: ScoreItem, reply: tuple[Any, ...]) -> Score:
        if reply[0] == "ok":
            return Score(float(reply[1]), dict(reply[2]), float(reply[3]), False)
        return self._fail(item, reply[2], reply[1], float(reply[3]))

    def _fail(self, item: ScoreItem, error: str, detail: str, seconds: float,
              timeout: bool = False) -> Score:
        with self._lock:
            if timeout:
                self.timeouts += 1
            else:
                self.failures += 1
            if not self._warned and not self.spec.legacy(item.data_source):
                self._warned = True
                self._warning = _warning_text(item, error, detail, self.timeout_s)
        return Score(0.0, {}, seconds, True, error, timeout)

    def take_warning(self) -> str | None:
        """The one warning about failed scoring (the first failure's traceback), once."""
        with self._lock:
            text, self._warning = self._warning, None
        return text

    def close(self) -> None:
        """Kill the workers; a batch being scored ends with its remaining samples failed."""
        self._closed = True
        for worker in self._workers:
            with contextlib.suppress(Exception):
                worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _wire(item: ScoreItem) -> tuple[Any, ...]:
    """What a worker is sent for ``item`` (tasks.rewards.worker_main)."""
    return (item.data_source, item.solution_str, item.ground_truth, item.extra_info,
            item.response_len)


def _take(todo: queue.SimpleQueue[tuple[int, ScoreItem]],
          most: int) -> list[tuple[int, ScoreItem]]:
    """Up to ``most`` items off ``todo``, without waiting."""
    taken: list[tuple[int, ScoreItem]] = []
    while len(taken) < most:
        try:
            taken.append(todo.get_nowait())
        except queue.Empty:
            break
    return taken


def _warning_text(item: ScoreItem, error: str, detail: str, timeout_s: float) -> str:
    where = f"data_source {item.data_source!r}" if item.data_source else "a sample"
    head = (f"reward scoring failed for {where}: {error}. Such samples score 0, counted in "
            "each step's reward/failed_count and reward/timeout_count; above "
            "reward.max_failure_ratio of a step's samples the run stops (this warning is "
            "given once)")
    if detail:
        return f"{head}; first failure:\n{detail.rstrip()}"
    return f"{head}; a call longer than {timeout_s:g} s has its worker killed and replaced"


class Rewards(Protocol):
    """The reward scoring a :class:`Scorer` uses: :class:`RewardPool`, or an in-memory one in
    tests."""

    @property
    def failures(self) -> int: ...

    @property
    def timeouts(self) -> int: ...

    @property
    def scored(self) -> int: ...

    async def score(self, items: list[ScoreItem]) -> list[Score]: ...

    def take_warning(self) -> str | None: ...

    def fails_ticket(self, data_source: str) -> bool: ...

    def close(self) -> None: ...


class Scorer:
    """A rollouter's responses to rewards: decoded on the worker thread (``off``) with
    ``tokenizer``, scored a batch at a time by ``rewards`` (:class:`RewardPool` of ``cfg``,
    made at :meth:`open` or at the first batch); the one warning about failed scoring goes to
    ``warn(code, text)`` when it first happens."""

    def __init__(self, cfg: Config, tokenizer: TextTokenizer, *, off: Off,
                 warn: Callable[[str, str], Awaitable[None]],
                 rewards: Rewards | None = None) -> None:
        self.cfg, self.tokenizer, self.off, self.warn = cfg, tokenizer, off, warn
        self.rewards = rewards

    def open(self) -> None:
        """Start the reward pool now (its workers load while the engine builds); a bad
        reward setting raises ConfigError."""
        if self.rewards is None:
            self.rewards = RewardPool(self.cfg)

    async def score(self, seqs: Sequence[Seq]) -> list[Score]:
        """Every response's reward (off the loop, a batch at once)."""
        return await self.score_items(self.items(seqs, await self.decode(seqs)))

    async def decode(self, seqs: Sequence[Seq]) -> list[str]:
        """The responses' texts (on the worker thread)."""
        return await self.off(lambda: [self._text(s) for s in seqs])

    def _text(self, s: Seq) -> str:
        """A response's text; a conversation's is every turn after the prompt, tool answers
        included, special tokens skipped, as verl's reward managers decode it (the cut to
        the response budget is the sample's: rollouter.answers)."""
        if s.dialogue is None:
            return self.tokenizer.decode(s.tokens)
        return decode_conversation(self.tokenizer, s.tokens[:self.cfg.rollout.max_new_tokens])

    @staticmethod
    def items(seqs: Sequence[Seq], texts: Sequence[str]) -> list[ScoreItem]:
        """What the reward function is called with, per response; a conversation's
        ``extra_info`` gains verl's ``num_turns``, ``tool_rewards`` and ``turn_scores``."""
        return [ScoreItem(
            data_source=s.ticket.data_source, solution_str=text,
            ground_truth=s.ticket.answer if s.ticket.ground_truth is None
            else s.ticket.ground_truth,
            extra_info=conversation_extra_info(s.ticket.extra_info, s.dialogue),
            response_len=len(s.tokens),
        ) for s, text in zip(seqs, texts, strict=True)]

    async def score_items(self, items: list[ScoreItem]) -> list[Score]:
        """Score ``items``; the one warning about failed scoring is published when it first
        happens."""
        self.open()  # a rollouter driven without its setup (tests)
        assert self.rewards is not None
        scores = await self.rewards.score(items)
        warning = self.rewards.take_warning()
        if warning is not None:
            await self.warn("reward_failed", warning)
        return scores

    def fails_ticket(self, ticket: PromptTicket) -> bool:
        """Whether a failed score fails ``ticket`` (:meth:`RewardPool.fails_ticket`)."""
        return self.rewards is not None and self.rewards.fails_ticket(ticket.data_source)

    @property
    def scored(self) -> int:
        """Reward calls ended so far (part of the heartbeat's progress)."""
        return self.rewards.scored if self.rewards is not None else 0

    def metrics(self) -> dict[str, float]:
        """The heartbeat's reward counters (none before the pool exists)."""
        if self.rewards is None:
            return {}
        return {"reward/failed_count": float(self.rewards.failures),
                "reward/timeout_count": float(self.rewards.timeouts)}

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()


def conversation_extra_info(extra_info: dict[str, Any] | None, d: Dialogue | None
                            ) -> dict[str, Any] | None:
    """The ``extra_info`` a response is scored with: the record's, and for a conversation
    what verl's agent loop adds (``num_turns``, ``tool_rewards``, ``turn_scores``)."""
    if d is None:
        return extra_info
    return {**(extra_info or {}), "num_turns": d.num_turns,
            "tool_rewards": list(d.tool_rewards), "turn_scores": []}
