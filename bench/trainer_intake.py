"""The trainer's intake ceiling: samples/s and MB/s one trainer judges and trains on, fed as
fast as Redis gives them, against a bare redis-py consumer of the same entries.

No rollouter: a fake one (the feeder, a process of its own) answers every ticket the trainer
issues at once, with samples of a target size, through the rollouter's own path: it reads
the prompts stream as member ``rollouter-0`` of group ``rollouter``, states
``TicketsClaimed`` in the rollouters' log stream, publishes the ticket's ``rollout.n``
samples with the ticket's ack in one script (``Consumer.publish_and_ack``), and pulses a
liveness key with a progress counter. Its samples answer their tickets exactly (the ticket's
prompt, ids, attempt, weights version; rewards 0/1 by index), with one response of
``rollout.max_new_tokens`` tokens and as many log-probs, sized so that a sample encodes to
about the target: 2.5 KiB is ~290 response tokens, 64 KiB ~8 160 (an 8k-token reasoning
answer). Each size, side by side on one embedded redis-server per run (AOF on, as
``rlbus up`` runs it):

  trainer  the real trainer process (``python -m trainer``'s code: lease, fenced consumer
           group, decode, intake and sample checks, ledger, GRPO batch and loss, weights
           published every step, StepFinished with the acks) on a tiny model, fed by the
           feeder; ``--steps`` steps counted after ``--warmup`` (by default 2560 / KiB
           steps, within 20..200: 200 at 2.5 KiB, 40 at 64 KiB, each about as long)
  bare     redis-py by hand: XREADGROUP COUNT 256 (the trainer's read size) + decode of
           every entry (runschema.messages.decode) + XACK, fed by the same feeder
           publishing the same samples without tickets

The update is not what is measured: with ``--update stub`` (the default) the tiny model's
forward (``TinyGPT.logprobs_and_entropy``) is replaced, in the trainer process only, by
zeros of the right shape tied to one parameter, so everything around it still runs (the
batch built from the samples, advantages, loss, backward, optimizer step); an 8k-token
forward of even a one-layer model on a CPU would hide the intake behind it. ``--update
tiny`` keeps the real forward (a one-layer, 16-wide model): cheap at 2.5 KiB only.

The trainer's figures come from its StepFinished events: samples/s = the samples of steps
``warmup+1..warmup+steps`` over the time between StepFinished(warmup) and the last one;
MB/s the same times the encoded sample size; per step, the means of ``duration_s``,
``trainer/update_s`` (the worker's compute) and ``trainer/loop_cpu_s`` (the event loop's
CPU). CPU shares (100% = one core) are read from /proc over the same window: the trainer
process, its event-loop thread alone, the redis-server and the feeder.

The fleet line: a 7B GRPO job with ``--fleet`` rollouters (64), each one vLLM engine on one
H100 generating ``--fleet-tokens`` output tokens/s (12 500: Llama 3.1 8B, BF16, one H100,
vLLM, peak batched throughput, as compiled at morphllm.com/vllm-benchmarks (2026); a high
figure on purpose: an RL rollout with a long tail of lengths runs below peak), sends
fleet x tokens/s / response tokens samples/s, each of the size measured. It fits when that
is below the trainer's measured samples/s.

    python bench/trainer_intake.py                      # 2.5 and 64 KiB (~1 min, 2 cores)
    python bench/trainer_intake.py --sizes 2.5 --steps 10
    python bench/trainer_intake.py --fleet-tokens 5000 --json
    python bench/trainer_intake.py --sizes 2.5 --update tiny   # the real tiny forward

Prints one table row per size (trainer and bare samples/s and MB/s, their ratio, per-step
means of the step's duration, the update and the event loop's CPU, CPU shares), the Redis
calls per step by command (every client's: the feeder's too; INFO commandstats, so a
per-sample round trip would show as a count near the step's samples), then the fleet line
per size; ``--json`` adds one JSON object.
Every process shares the machine's cores (trainer, its worker thread, Redis, the feeder):
on 2 cores the ceiling is the machine's as much as the trainer's; the CPU shares say where
the time went.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bus import ROLE_LOG_MAXLEN, Bus, Consumer, RunKeys, pulse
from rlbus.redis_server import EmbeddedRedis
from runschema.messages import (
    FIELD,
    Array,
    Heartbeat,
    PromptTicket,
    RunFinished,
    Sample,
    StepFinished,
    TicketsClaimed,
    decode,
    encode,
)

ROOT = Path(__file__).resolve().parent.parent
RUN = "intake"
BARE_STREAM = "rlbus:{bare}:samples"
READ_COUNT = 256  # the trainer's read size (trainer.core: 256 unless a flood doubles it)
FEED_TICKETS = 32  # tickets the feeder answers per publication (rollout.prompts_per_batch: 8)
PROMPT_TOKENS = 7  # the digits task's prompt: bos + 4 digits + '>' (+1 to spare)
FLEET_TOKENS = 12_500.0
TICK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the samples


def response_tokens(kib: float) -> int:
    """Response tokens that make a sample of the digits task encode to about ``kib`` KiB
    (4 bytes a token id, 4 a log-prob, plus what the rest of a sample takes)."""
    base = len(encode(_sample(_ticket("t0", 0), 0, _arrays(1))))
    return max(1, round((kib * 1024 - base) / 8) + 1)


def _ticket(ticket_id: str, version: int) -> PromptTicket:
    return PromptTicket(ticket_id=ticket_id, prompt_id=f"p{ticket_id}", prompt="1234>",
                        answer="4321", n=8, min_version=version)


def _arrays(tokens: int) -> tuple[Array, Array]:
    """One response and its log-probs, shared by every sample of a run (ids 3..12: digits
    of the char tokenizer; log-probs in (-1, 0])."""
    rng = np.random.default_rng(0)
    return (Array.of(rng.integers(3, 13, tokens, dtype=np.int32)),
            Array.of(-rng.random(tokens, dtype=np.float32)))


def _sample(t: PromptTicket, index: int, arrays: tuple[Array, Array],
            prompt: Array | None = None) -> Sample:
    response, logprobs = arrays
    return Sample(sample_id=f"{t.ticket_id}/{index}", ticket_id=t.ticket_id,
                  prompt_id=t.prompt_id, index=index, n=t.n,
                  prompt_tokens=(prompt if prompt is not None
                                 else Array.of(np.asarray([1, 4, 5, 6, 7, 13], np.int32))),
                  response_tokens=response, logprobs=logprobs, reward=float(index % 2),
                  min_version=t.min_version, max_version=t.min_version, rank=0,
                  attempt=t.attempt)


# --------------------------------------------------------------------------- the feeder


async def _feed_tickets(url: str, tokens: int, config: list[str]) -> None:
    """A fake rollouter of run RUN, rank 0: every ticket answered at once, until killed."""
    from policy.text import build_tokenizer
    from runconfig import load_config

    cfg = load_config(overrides=config)
    tokenizer = build_tokenizer(cfg.model)
    keys = RunKeys(RUN)
    arrays = _arrays(tokens)
    prompts: dict[str, Array] = {}
    async with Bus.from_url(url) as bus:
        consumer = Consumer(bus, keys.prompts, "rollouter", RunKeys.rollouter_consumer(0),
                            dlq_stream=keys.dlq)
        await consumer.ensure_group()
        published = 0

        async def beat() -> None:
            while True:
                await pulse(bus, keys.alive("rollouter", 0),
                            Heartbeat(role="rollouter", rank=0, pid=os.getpid(),
                                      state="bench feeder", progress=published,
                                      metrics={"rollouter/idle_ratio": 0.0}),
                            cfg.heartbeat.timeout_s)
                await asyncio.sleep(cfg.heartbeat.interval_s)

        pulses = asyncio.create_task(beat())
        try:
            while True:
                deliveries = await consumer.read(count=FEED_TICKETS, block_ms=200)
                tickets = [d.msg for d in deliveries if isinstance(d.msg, PromptTicket)]
                if tickets:  # the claim precedes the answers in the log (trainer.claims)
                    await bus.publish_many(keys.log("rollouter"), [TicketsClaimed(
                        ticket_ids=[t.ticket_id for t in tickets],
                        attempts=[t.attempt for t in tickets], rank=0)],
                        maxlen=ROLE_LOG_MAXLEN)
                samples = []
                for t in tickets:
                    key = t.prompt_digest or t.prompt  # a ticket's n answers share it
                    prompt = prompts.get(key)
                    if prompt is None:  # as a rollouter encodes it (rollouter.context)
                        ids = (list(t.prompt_ids) if t.prompt_ids is not None
                               else tokenizer.encode(t.prompt, bos=True))
                        prompt = prompts[key] = Array.of(np.asarray(ids, np.int32))
                    samples += [_sample(t, i, arrays, prompt) for i in range(t.n)]
                if deliveries:
                    await consumer.publish_and_ack(keys.samples, samples, *deliveries)
                    published += len(samples)
        finally:
            pulses.cancel()


async def _feed_free(url: str, tokens: int, total: int) -> None:
    """The same samples, ``total`` of them, to the bare stream: no tickets, the same call."""
    arrays = _arrays(tokens)
    per = FEED_TICKETS * 8
    async with Bus.from_url(url) as bus:
        consumer = Consumer(bus, BARE_STREAM, "feeder", "feeder-0")
        for start in range(0, total, per):
            batch = [_sample(_ticket(f"t{i // 8}", 0), i % 8, arrays)
                     for i in range(start, min(total, start + per))]
            await consumer.publish_and_ack(BARE_STREAM, batch)


# --------------------------------------------------------------------------- the trainer


def _serve_trainer(update: str, config: list[str]) -> int:
    """The trainer component (``python -m trainer``), its model's forward stubbed out
    (``update == "stub"``)."""
    if update == "stub":
        import torch

        from policy.model import TinyGPT

        def logprobs_and_entropy(self: TinyGPT, input_ids: torch.Tensor,
                                 attention_mask: torch.Tensor, response_len: int,
                                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            # Zeros of the forward's shape, on the graph of one parameter: backward and
            # the optimizer step still run, the transformer does not.
            tie = self.head.weight.sum() * 0.0
            shape = (input_ids.shape[0], response_len)
            return torch.zeros(shape) + tie, torch.zeros(shape) + tie

        TinyGPT.logprobs_and_entropy = logprobs_and_entropy  # type: ignore[method-assign]
    from trainer import main

    return main(config)


def steps_for(kib: float, a: argparse.Namespace) -> int:
    """Steps measured at ``kib``: ``--steps``, else about as many seconds for every size."""
    return a.steps if a.steps is not None else min(200, max(20, round(2560 / kib)))


def trainer_config(url: str, out: Path, tokens: int, steps: int, a: argparse.Namespace
                   ) -> list[str]:
    return [
        f"redis.url={url}", f"run.id={RUN}", f"run.output_dir={out}",
        "model.kind=tiny", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        f"model.max_len={tokens + PROMPT_TOKENS + 8}", f"rollout.max_new_tokens={tokens}",
        f"rollout.n={a.n}", f"trainer.ppo_mini_batch_size={a.prompts}",
        f"async_training.require_batches={a.require_batches}",
        "async_training.staleness_threshold=1.0", "async_training.trigger_parameter_sync_step=1",
        f"trainer.total_training_steps={a.warmup + steps}", "trainer.save_freq=0",
        "trainer.logger=[console]", "heartbeat.interval_s=0.5",
    ]


# --------------------------------------------------------------------------- measuring


def cpu_s(pid: int | None, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid`` (all its threads), or of its thread
    ``tid``; 0 once it is gone."""
    if pid is None:
        return 0.0
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Mark:
    """CPU seconds of the processes that share the machine, at one moment."""

    t: float
    cpu: dict[str, float]


def mark(pids: dict[str, tuple[int | None, int | None]]) -> Mark:
    return Mark(time.monotonic(), {name: cpu_s(pid, tid) for name, (pid, tid) in pids.items()})


def shares(a: Mark, b: Mark) -> dict[str, float]:
    """Each process's CPU between two marks, in % of one core."""
    wall = max(b.t - a.t, 1e-9)
    return {name: 100 * (b.cpu[name] - a.cpu[name]) / wall for name in a.cpu}


async def command_calls(bus: Bus) -> dict[str, int]:
    """Calls per Redis command so far, every client's (INFO commandstats; a script's own
    commands count too)."""
    info = await bus.command("INFO", "commandstats")
    if isinstance(info, bytes | str):  # unparsed: "cmdstat_xadd:calls=3,usec=..." lines
        text = info.decode() if isinstance(info, bytes) else info
        info = {k: dict(kv.split("=") for kv in v.split(","))
                for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}
    assert isinstance(info, dict)
    return {str(k).removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()
            if str(k).startswith("cmdstat_")}


@dataclass
class Result:
    kib: float
    sample_bytes: int
    response_tokens: int
    samples: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    commands: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mb_s(self) -> float:
        return self.rate * self.sample_bytes / 1e6


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


async def run_trainer(kib: float, a: argparse.Namespace, tmp: Path) -> Result:
    """One trainer fed by the feeder for ``warmup + steps`` steps; its StepFinished events
    followed live, CPU marked at each."""
    tokens = response_tokens(kib)
    size = len(encode(_sample(_ticket("t1234", 0), 7, _arrays(tokens))))
    out = tmp / f"trainer-{kib:g}"
    out.mkdir()
    server = EmbeddedRedis(out / "redis")
    server.start()
    keys = RunKeys(RUN)
    steps_n = steps_for(kib, a)
    config = trainer_config(server.url, out, tokens, steps_n, a)
    feeder = _spawn(["--serve-feeder", str(tokens), "--", *config], out / "feeder.log")
    trainer = _spawn(["--serve-trainer", a.update, "--", *config], out / "trainer.log")
    pids: dict[str, tuple[int | None, int | None]] = {
        "trainer": (trainer.pid, None), "trainer loop": (trainer.pid, trainer.pid),
            "redis": (server.pid, None), "feeder": (feeder.pid, None)}
    marks: dict[int, Mark] = {}
    calls: dict[int, dict[str, int]] = {}
    steps: dict[int, StepFinished] = {}
    total = a.warmup + steps_n
    try:
        async with Bus.from_url(server.url) as bus:
            last, deadline = "0-0", time.monotonic() + a.timeout
            finished = False
            while not finished:
                if time.monotonic() > deadline or trainer.poll() is not None:
                    raise RuntimeError(f"trainer ended or timed out before step {total}; "
                                       f"see {out / 'trainer.log'}:\n"
                                       + (out / "trainer.log").read_text()[-3000:])
                entries, last = await bus.read_after(keys.events, last, count=100,
                                                     block_ms=200)
                for _, msg in entries:
                    if isinstance(msg, StepFinished):
                        marks[msg.step] = mark(pids)
                        steps[msg.step] = msg
                        if msg.step in (a.warmup, total):
                            calls[msg.step] = await command_calls(bus)
                    finished |= isinstance(msg, RunFinished)
        if trainer.wait(60) != 0:
            raise RuntimeError(f"trainer exited {trainer.returncode}: see {out / 'trainer.log'}")
    finally:
        _stop(trainer)
        _stop(feeder)
        server.stop()
    missing = [k for k in range(a.warmup, total + 1) if k not in steps]
    if missing:
        raise RuntimeError(f"steps {missing} not seen in the events stream")
    window = [steps[k] for k in range(a.warmup + 1, total + 1)]
    res = Result(kib, size, tokens, samples=sum(len(s.sample_ids) for s in window),
                 seconds=steps[total].ts - steps[a.warmup].ts,
                 cpu=shares(marks[a.warmup], marks[total]))

    def mean(key: str) -> float:
        return sum(s.metrics.get(key, 0.0) for s in window) / len(window)

    before, after = calls[a.warmup], calls[total]
    res.commands = dict(sorted(((cmd, (n - before.get(cmd, 0)) / len(window))
                                for cmd, n in after.items() if n > before.get(cmd, 0)),
                               key=lambda kv: -kv[1]))
    res.extra = {"step_s": sum(s.duration_s for s in window) / len(window),
                 "update_s": mean("trainer/update_s"), "loop_cpu_s": mean("trainer/loop_cpu_s"),
                 "idle_ratio": mean("trainer/idle_ratio"), "refused": mean("samples/refused"),
                 "samples_per_step": res.samples / len(window)}
    return res


def run_bare(kib: float, a: argparse.Namespace, tmp: Path) -> Result:
    """The feeder's samples, as many as the trainer run took, read by redis-py by hand."""
    import redis

    tokens = response_tokens(kib)
    size = len(encode(_sample(_ticket("t1234", 0), 7, _arrays(tokens))))
    per_step = a.prompts * a.n * a.require_batches
    warm, total = a.warmup * per_step, (a.warmup + steps_for(kib, a)) * per_step
    out = tmp / f"bare-{kib:g}"
    out.mkdir()
    server = EmbeddedRedis(out / "redis")
    server.start()
    r = redis.Redis.from_url(server.url)
    r.xgroup_create(BARE_STREAM, "trainer", id="0", mkstream=True)
    feeder = _spawn(["--serve-free", str(tokens), str(total), server.url], out / "feeder.log")
    pids: dict[str, tuple[int | None, int | None]] = {
        "bare": (os.getpid(), None), "redis": (server.pid, None),
            "feeder": (feeder.pid, None)}
    got, first, deadline = 0, None, time.monotonic() + a.timeout
    try:
        while got < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bare consumer got {got} of {total} samples")
            # redis-py types the nested reply loosely: read as Any.
            reply: Any = r.xreadgroup("trainer", "bare", {BARE_STREAM: ">"}, count=READ_COUNT,
                                      block=500)
            if not reply:
                continue
            entries = reply[0][1]
            for _, fields in entries:
                decode(fields[FIELD])
            r.xack(BARE_STREAM, "trainer", *(eid for eid, _ in entries))
            got += len(entries)
            if first is None and got >= warm:
                first, counted = mark(pids), got
        end = mark(pids)
    finally:
        r.close()
        _stop(feeder)
        server.stop()
    assert first is not None
    return Result(kib, size, tokens, samples=got - counted, seconds=end.t - first.t,
                  cpu=shares(first, end))


# --------------------------------------------------------------------------- report


def fleet(res: Result, a: argparse.Namespace) -> dict[str, Any]:
    need = a.fleet * a.fleet_tokens / res.response_tokens
    return {"rollouters": a.fleet, "tokens_per_s_each": a.fleet_tokens,
            "samples_per_s": need, "mb_per_s": need * res.sample_bytes / 1e6,
            "trainer_samples_per_s": res.rate, "headroom": res.rate / need,
            "fits": res.rate >= need}


def report(pairs: list[tuple[Result, Result]], a: argparse.Namespace) -> dict[str, Any]:
    steps = "/".join(str(steps_for(t.kib, a)) for t, _ in pairs)
    print(f"trainer intake, update={a.update}, {a.prompts} prompts x {a.n} x "
          f"{a.require_batches} mini-batches a step, {steps} steps after {a.warmup}; "
          f"{os.cpu_count()} cores")
    head = (f"{'size':>8} {'bytes':>6} {'tokens':>6} | {'trainer/s':>9} {'MB/s':>6} | "
            f"{'bare/s':>8} {'MB/s':>6} | {'ratio':>5} | {'step s':>6} {'upd s':>6} "
            f"{'loop s':>6} | CPU% trainer (loop) redis feeder | bare: self redis feeder")
    print(head)
    print("-" * len(head))
    for t, b in pairs:
        c, d = t.cpu, b.cpu
        ratio = t.rate / b.rate if b.rate else float("nan")
        print(f"{t.kib:>5g}KiB {t.sample_bytes:>6} {t.response_tokens:>6} | {t.rate:>9.0f} "
              f"{t.mb_s:>6.1f} | {b.rate:>8.0f} {b.mb_s:>6.1f} | {ratio:>5.2f} | "
              f"{t.extra['step_s']:>6.3f} {t.extra['update_s']:>6.3f} "
              f"{t.extra['loop_cpu_s']:>6.3f} | {c['trainer']:>5.0f} ({c['trainer loop']:.0f}) "
              f"{c['redis']:>4.0f} {c['feeder']:>4.0f} | {d['bare']:>4.0f} {d['redis']:>4.0f} "
              f"{d['feeder']:>4.0f}")
    for t, _ in pairs:
        top = ", ".join(f"{cmd} {n:.0f}" for cmd, n in list(t.commands.items())[:8])
        print(f"  {t.kib:g} KiB, Redis calls per step of {t.extra['samples_per_step']:.0f} "
              f"samples (every client, scripts' commands included): {top}")
    print(f"fleet: a 7B GRPO job, {a.fleet} rollouters x {a.fleet_tokens:,.0f} output tokens/s "
          "each (vLLM, one H100 each, peak; --fleet-tokens):")
    out: dict[str, Any] = {"update": a.update, "warmup": a.warmup,
                           "cores": os.cpu_count(), "sizes": []}
    for t, b in pairs:
        f = fleet(t, a)
        verdict = (f"fits, {f['headroom']:.1f}x headroom" if f["fits"]
                   else f"does NOT fit ({f['headroom']:.2f}x of the need)")
        print(f"  {t.kib:g} KiB samples ({t.response_tokens} tokens): needs "
              f"{f['samples_per_s']:,.0f} samples/s, {f['mb_per_s']:.1f} MB/s; the trainer "
              f"took {t.rate:,.0f} samples/s, {t.mb_s:.1f} MB/s here: {verdict}")
        out["sizes"].append({"kib": t.kib, "steps": steps_for(t.kib, a),
                             "sample_bytes": t.sample_bytes,
                             "response_tokens": t.response_tokens,
                             "trainer": {"samples_per_s": t.rate, "mb_per_s": t.mb_s,
                                         "samples": t.samples, "seconds": t.seconds,
                                         **t.extra, "cpu_pct": t.cpu,
                                         "redis_calls_per_step": t.commands},
                             "bare": {"samples_per_s": b.rate, "mb_per_s": b.mb_s,
                                      "samples": b.samples, "seconds": b.seconds,
                                      "cpu_pct": b.cpu},
                             "ratio": t.rate / b.rate if b.rate else None, "fleet": f})
    return out


async def _main(a: argparse.Namespace) -> None:
    pairs = []
    with tempfile.TemporaryDirectory(prefix="intake-") as tmp:
        for kib in a.sizes:
            t = await run_trainer(kib, a, Path(tmp))
            b = await asyncio.to_thread(run_bare, kib, a, Path(tmp))
            pairs.append((t, b))
    summary = report(pairs, a)
    if a.json:
        print(json.dumps(summary))


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--serve-trainer"]:
        raise SystemExit(_serve_trainer(argv[1], argv[3:]))
    if argv[:1] == ["--serve-feeder"]:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_feed_tickets(_url_of(argv[3:]), int(argv[1]), argv[3:]))
        return
    if argv[:1] == ["--serve-free"]:
        asyncio.run(_feed_free(argv[3], int(argv[1]), int(argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.5, 64.0],
                        help="sample sizes in KiB (default 2.5 64)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps measured per size (default: 2560 / KiB within 20..200: "
                             "200 at 2.5 KiB, 40 at 64 KiB)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before (default 3)")
    parser.add_argument("--prompts", type=int, default=32, help="ppo_mini_batch_size (32)")
    parser.add_argument("--n", type=int, default=8, help="rollout.n (8)")
    parser.add_argument("--require-batches", type=int, default=2, help="mini-batches a step (2)")
    parser.add_argument("--update", choices=["stub", "tiny"], default="stub",
                        help="stub: the model's forward replaced (default); tiny: real")
    parser.add_argument("--fleet", type=int, default=64, help="rollouters (64)")
    parser.add_argument("--fleet-tokens", type=float, default=FLEET_TOKENS,
                        help="output tokens/s of one rollouter (12 500)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--json", action="store_true", help="also print one JSON object")
    a = parser.parse_args(argv)
    if (a.steps is not None and a.steps < 1) or a.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    asyncio.run(_main(a))


def _url_of(config: list[str]) -> str:
    return next(c.split("=", 1)[1] for c in config if c.startswith("redis.url="))


if __name__ == "__main__":
    main()
