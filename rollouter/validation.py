"""Validation on a rollouter: the ``data.val_files`` records, generated with
``rollout.val_kwargs``, scored, and reduced to verl's metrics (:mod:`tasks.valmetrics`).

The rollouter serves a ``ValidationRequested`` between two ticket batches (training goes on:
the trainer never waits for it), with the weights it holds once they are at least the
requested version (newer ones are fine; the answer names the version used). Every record's
``val_kwargs.n`` responses are generated on the rollouter's worker thread in batches of
``rollout.prompts_per_batch`` records; a batch is scored (the injected scoring callable, a
pool off the event loop) while the next one generates. ``val_kwargs.do_sample=false`` is
greedy decoding (temperature 0), as verl's; with sampling, ``top_p``/``top_k`` go to the
policy when its ``generate`` takes them.

:class:`ValidationServer` serves the requests a replica's ticket desk read: one already answered
in the log (a redelivery) is acked without work; the others get the weights they ask for,
the :class:`Validator`, and their answer published in the log with the ack of the request.

Variables, as verl's ``_validate``: ``reward`` is each response's score, and each extra key a
reward function returns is a variable of its own (a response whose scorer failed counts 0 for
every key). The prompt of a record is its uid (verl gives every validation record one).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from policy.text import TextTokenizer, decode_conversation
from rollouter.answers import Seq
from rollouter.engine import Engine, Off
from rollouter.events import EventPoller
from rollouter.scoring import Scorer, conversation_extra_info
from rollouter.tickets import TicketDesk, TicketSource
from rollouter.weights import WeightsHolder
from runconfig import Config
from runconfig.paths import record_dir
from runschema.messages import PromptTicket, ValidationFinished, ValidationRequested
from runtime import Failure
from storage.record import write_validation
from tasks.valmetrics import validation_metrics

if TYPE_CHECKING:  # rollouter.conversations builds on this module's neighbours
    from rollouter.conversations import Conversations

__all__ = ["GEN_SEED", "Answer", "ValidationServer", "Validator", "build_validator", "sampling",
           "val_generate"]

class Answer(NamedTuple):
    """One validation response: its record, its text, its length in tokens, and the
    ``extra_info`` its score is given (None: the record's)."""

    record: Any
    text: str
    length: int
    extra_info: dict[str, Any] | None = None


def _ticket_of(record: Any, n: int) -> PromptTicket:
    """A validation record as the ticket a conversation is made from (its agent loop, its
    tools' per-sample arguments)."""
    return PromptTicket(ticket_id=f"val{record.index}", prompt_id=f"val{record.index}",
                        prompt=record.text, answer="", n=n, min_version=0,
                        prompt_ids=list(record.prompt_ids), extra_info=record.extra_info,
                        agent_name=getattr(record, "agent_name", ""))


GEN_SEED = 42
"""verl's seed of the logged generations' shuffle (``_maybe_log_val_generations``)."""

ScoreFn = Callable[[list[Any]], Awaitable[Sequence[Any]]]


def sampling(cfg: Config) -> dict[str, float]:
    """Generation settings from ``rollout.val_kwargs``: greedy (temperature 0) unless
    ``do_sample``; then its temperature, top_p and top_k."""
    vk = cfg.rollout.val_kwargs
    if not vk.do_sample:
        return {"temperature": 0.0}
    return {"temperature": vk.temperature, "top_p": vk.top_p, "top_k": vk.top_k}


def _accepts(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def val_generate(policy: Any, prompts: list[list[int]], max_new_tokens: int,
                 eos_id: int | Sequence[int] | None, params: dict[str, float],
                 generator: torch.Generator | None) -> list[list[int]]:
    """Responses (token ids) for ``prompts`` (worker thread). ``top_p``/``top_k`` are passed
    only to a ``generate`` that takes them (at their defaults they change nothing)."""
    accepted = _accepts(policy.generate)
    extra = {k: v for k, v in params.items() if k != "temperature" and k in accepted}
    out = policy.generate(prompts, max_new_tokens=max_new_tokens,
                          temperature=params["temperature"], eos_id=eos_id,
                          generator=generator, **extra)
    return [list(t) for t in out.tokens]


class Validator:
    """Validates weights on ``records`` (``tasks.verl_data.VerlRecord``: ``index``,
    ``prompt_ids``, ``text``, ``data_source``, ``ground_truth``, ``extra_info``), scored by
    ``score`` (``RewardPool.score``: a list of ``ScoreItem`` -> a list of ``Score`` with
    ``reward``, ``extra``, ``failed``). ``item``: the ScoreItem class (default: the
    rollouter's own, :mod:`rollouter.scoring`)."""

    def __init__(self, records: Sequence[Any], score: ScoreFn, cfg: Config, tokenizer: Any,
                 *, item: Callable[..., Any] | None = None,
                 conversations: Conversations | None = None) -> None:
        if item is None:
            from rollouter.scoring import ScoreItem

            item = ScoreItem
        self.records = list(records)
        self.score = score
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.item = item
        self.conversations = conversations
        """The rollouter's multi-turn side: ``tool_agent`` records are validated as
        conversations (verl validates through its agent loop too)."""

    def _batches(self) -> list[list[Any]]:
        size = self.cfg.rollout.prompts_per_batch
        return [self.records[i:i + size] for i in range(0, len(self.records), size)]

    def _generate(self, policy: Any, batch: list[Any],
                  generator: torch.Generator | None) -> list[Answer]:
        """(record, response text, response length) per response of ``batch`` (worker)."""
        n = self.cfg.rollout.val_kwargs.n
        prompts = [list(r.prompt_ids) for r in batch for _ in range(n)]
        # Every EOS id ends a response, as in training (tokenizer's and generation_config's).
        eos = [i for i in (getattr(self.tokenizer, "eos_id", None),
                           *getattr(policy, "eos_ids", ())) if i is not None]
        tokens = val_generate(policy, prompts, self.cfg.rollout.max_new_tokens, eos or None,
                              sampling(self.cfg), generator)
        owners = [r for r in batch for _ in range(n)]
        return [Answer(r, self.tokenizer.decode(t), len(t)) for r, t in zip(owners, tokens,
                                                                           strict=True)]

    async def _converse(self, policy: Any, batch: list[Any], generator: torch.Generator | None,
                        off: Off) -> list[Answer]:
        """``batch``'s responses where some records are conversations (``tool_agent``): turn
        by turn as the built-in engine's loop trains them, with validation's sampling."""
        talks = self.conversations
        assert talks is not None
        n = self.cfg.rollout.val_kwargs.n
        seqs = [talks.start(Seq(_ticket_of(r, n), i, list(r.prompt_ids), [], []))
                for r in batch for i in range(n)]
        owners = [r for r in batch for _ in range(n)]
        while True:
            await off(self._extend, policy, seqs, generator)
            turned = [s for s in seqs if s.dialogue is not None and not s.dialogue.over]
            if not turned or not any(await asyncio.gather(*(talks.after_turn(s)
                                                            for s in turned))):
                break
        return await off(lambda: [self._answer(r, s) for r, s in zip(owners, seqs,
                                                                     strict=True)])

    def _extend(self, policy: Any, seqs: list[Seq], generator: torch.Generator | None) -> None:
        """Every response not at the end of its turn, to that end (worker)."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return
        budget = self.cfg.rollout.max_new_tokens
        asked = budget - min(len(s.tokens) for s in live)
        eos = {i for i in (getattr(self.tokenizer, "eos_id", None),
                           *getattr(policy, "eos_ids", ())) if i is not None}
        out = val_generate(policy, [s.prompt + s.tokens for s in live], asked,
                           sorted(eos) or None, sampling(self.cfg), generator)
        for s, toks in zip(live, out, strict=True):
            s.tokens.extend(toks)
            s.logprobs.extend([0.0] * len(toks))
            s.finished = (bool(toks) and toks[-1] in eos) or len(toks) < asked \
                or len(s.tokens) >= budget

    def _answer(self, record: Any, s: Seq) -> Answer:
        """A response as scored: a conversation's whole text and verl's extra_info."""
        if s.dialogue is None:
            return Answer(record, self.tokenizer.decode(s.tokens), len(s.tokens))
        keep = min(len(s.tokens), self.cfg.rollout.max_new_tokens)
        return Answer(record, decode_conversation(self.tokenizer, s.tokens[:keep]), keep,
                      conversation_extra_info(record.extra_info, s.dialogue))

    def _items(self, done: list[Answer]) -> list[Any]:
        return [self.item(data_source=a.record.data_source, solution_str=a.text,
                          ground_truth=a.record.ground_truth,
                          extra_info=a.record.extra_info if a.extra_info is None
                          else a.extra_info, response_len=a.length) for a in done]

    async def run(self, request: ValidationRequested, *, policy: Any, off: Off, version: int,
                  rank: int) -> ValidationFinished:
        """Generate, score and reduce every record's responses with ``policy`` (holding
        weights ``version``), generation through ``off`` (the worker thread)."""
        t0 = time.monotonic()
        generator = _generator(policy, self.cfg.rollout.seed * 1000 + version)
        done: list[Answer] = []
        scoring: list[asyncio.Future[Sequence[Any]]] = []
        for batch in self._batches():
            if self.conversations is not None and any(
                    r.agent_name == "tool_agent" for r in batch):
                out = await self._converse(policy, batch, generator, off)
            else:
                out = await off(self._generate, policy, batch, generator)
            done.extend(out)
            # Scored while the next batch generates.
            scoring.append(asyncio.ensure_future(self.score(self._items(out))))
        scores = [s for part in await asyncio.gather(*scoring) for s in part]
        metrics = self._metrics(done, scores)
        await asyncio.to_thread(self._keep, request.step, version, rank, done, scores)
        return ValidationFinished(
            request_id=request.request_id, version=version, step=request.step, rank=rank,
            metrics=metrics, generations=self._logged(done, scores),
            duration_s=time.monotonic() - t0)

    def _keep(self, step: int, version: int, rank: int, done: list[Answer],
              scores: Sequence[Any]) -> None:
        """Every answer into the run's record (``run.record``; this node's record folder)
        and verl's ``trainer.validation_data_dir`` JSONL (``{step}.jsonl``); blocking. A
        file that cannot be written is one line here, and the validation goes on."""
        columns: dict[str, list[Any]] = {
            "step": [step] * len(done), "version": [version] * len(done),
            "rank": [rank] * len(done),
            "data_source": [r.data_source or "" for r, *_ in done],
            "prompt": [r.text for r, *_ in done], "response": [a.text for a in done],
            "ground_truth": ["" if r.ground_truth is None else str(r.ground_truth)
                             for r, *_ in done],
            "score": [float(s.reward) for s in scores],
            "response_length": [a.length for a in done]}
        try:
            if self.cfg.run.record != "none":
                write_validation(record_dir(self.cfg, self.cfg.run.id or ""), step, version,
                                 rank, columns)
            if self.cfg.trainer.validation_data_dir is not None:
                _write_jsonl(Path(self.cfg.trainer.validation_data_dir), step, columns)
        except OSError as exc:
            print(f"rollouter: validation v{version}'s answers not kept: {exc}",
                  file=sys.stderr, flush=True)

    def _metrics(self, done: list[Answer], scores: Sequence[Any]
                 ) -> dict[str, float]:
        keys = sorted({k for s in scores for k in (s.extra or {})} - {"reward"})
        variables: dict[str, Sequence[float]] = {"reward": [float(s.reward) for s in scores]}
        for key in keys:
            variables[key] = [float((s.extra or {}).get(key, 0.0)) for s in scores]
        return validation_metrics([r.data_source or "unknown" for r, *_ in done],
                                  [r.index for r, *_ in done], variables, None)

    def _logged(self, done: list[Answer], scores: Sequence[Any]
                ) -> list[tuple[str, str, float]]:
        """verl's choice of generations to log: sorted by prompt, shuffled with seed 42,
        the first ``trainer.log_val_generations``."""
        want = self.cfg.trainer.log_val_generations
        if want <= 0:
            return []
        rows = sorted(((a.record.text, a.text, float(s.reward)) for a, s
                       in zip(done, scores, strict=True)), key=lambda row: row[0])
        order = np.arange(len(rows))
        np.random.RandomState(GEN_SEED).shuffle(order)
        return [rows[i] for i in order[:want]]


def _write_jsonl(folder: Path, step: int, columns: dict[str, list[Any]]) -> None:
    """verl's validation dump: ``{step}.jsonl`` (``input``, ``output``, ``gts``, ``score``,
    ``step``), one line per answer."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{step}.jsonl", "a", encoding="utf-8") as fh:
        for i in range(len(columns["score"])):
            fh.write(json.dumps({"input": columns["prompt"][i], "output": columns["response"][i],
                                 "gts": columns["ground_truth"][i],
                                 "score": columns["score"][i], "step": step},
                                ensure_ascii=False) + "\n")


def _generator(policy: Any, seed: int) -> torch.Generator:
    """A generator of its own per validation (the training stream is not disturbed; a
    version's validation samples the same way on any replica)."""
    gen = torch.Generator(device=getattr(policy, "device", "cpu"))
    gen.manual_seed(seed)
    return gen


def build_validator(cfg: Config, tokenizer: Any, score: ScoreFn | None = None,
                    conversations: Conversations | None = None) -> Validator:
    """The validator of ``data.val_files`` (read once, here): verl records
    (:func:`tasks.verl_data.load_records`) scored by ``score`` (default: a
    :class:`rollouter.scoring.RewardPool` of its own)."""
    from tasks.verl_data import agent_options, load_records

    if score is None:
        from rollouter.scoring import RewardPool

        score = RewardPool(cfg).score
    files = cfg.data.val_files
    records = load_records([files] if isinstance(files, str) else list(files or []),
                           cfg.data, tokenizer, split="val", agent=agent_options(cfg))
    return Validator(records, score, cfg, tokenizer, conversations=conversations)


class ValidationServer:
    """Replica ``rank``'s validations: the requests ``tickets`` read, served between batches
    or on the emptied engine. A request is acked through ``source`` (the replica's member of
    the group) with its answer on ``answers`` (the rollouters' stream of the log); ``busy``
    is told the seconds each validation took (the heartbeat's idle share). The
    :attr:`validator` is built at the first request (``data.val_files``, scored by
    ``scorer``) unless one was given."""

    def __init__(self, cfg: Config, *, rank: int, tickets: TicketDesk, source: TicketSource,
                 answers: str, events: EventPoller, weights: WeightsHolder, scorer: Scorer,
                 tokenizer: TextTokenizer, off: Off, busy: Callable[[float], None],
                 complain: Callable[[str], None]) -> None:
        self.cfg, self.rank, self.tickets, self.source = cfg, rank, tickets, source
        self.answers, self.events, self.weights, self.scorer = answers, events, weights, scorer
        self.tokenizer, self.off, self.busy, self.complain = tokenizer, off, busy, complain
        self.validator: Validator | None = None
        self.conversations: Conversations | None = None
        """The replica's multi-turn side (set with the context's): conversations validated."""
        self.serving: str | None = None
        """The request being served (the heartbeat's state)."""
        self.answered: set[str] = set()
        """The requests this replica answered (the log's answers: ``events.validated``)."""

    async def serve(self, engine: Engine) -> None:
        """Serve the validation requests read with the last batch on ``engine``; one already
        answered in the log (a redelivery) is acked without work."""
        while self.tickets.validations_waiting and not self.events.finished:
            d = self.tickets.next_validation()
            assert d is not None and isinstance(d.msg, ValidationRequested)
            await self.events.poll()
            rid = d.msg.request_id
            if rid in self.events.validated or rid in self.answered:
                await self.source.ack(d)
                continue
            self.serving = rid
            try:
                finished = await self._validate(d.msg, engine)
            finally:
                self.serving = None
            await self.source.publish_and_ack(self.answers, [finished], d.id)
            self.answered.add(finished.request_id)
            self.busy(finished.duration_s)

    async def _validate(self, request: ValidationRequested, engine: Engine
                        ) -> ValidationFinished:
        """Validate with the newest weights once they are at least ``request.version``."""
        if not await self.weights.at_least(request.version):
            return self._failed(request, f"weights v{request.version} are not in the log "
                                         "(a stretch of log Redis lost)")
        try:
            if self.validator is None:
                # Scored by this rollouter's reward pool (validation runs between batches).
                self.validator = await asyncio.to_thread(build_validator, self.cfg,
                                                         self.tokenizer,
                                                         self.scorer.score_items,
                                                         self.conversations)
            return await self.validator.run(request, policy=engine, off=self.off,
                                            version=self.weights.version, rank=self.rank)
        except Failure:
            raise
        except Exception as exc:  # a failed validation is an answer, never a dead rollouter
            return self._failed(request, f"{type(exc).__name__}: {exc}")

    def _failed(self, request: ValidationRequested, error: str) -> ValidationFinished:
        self.complain(f"validation {request.request_id} failed: {error}")
        return ValidationFinished(request_id=request.request_id, version=self.weights.version,
                                  step=request.step, rank=self.rank, metrics={}, error=error)
