"""Multi-turn conversations with long-tailed tool latency: the continuous loop
(rollouter/continuous.py, a streaming engine such as vLLM) vs the built-in engine's
batch-per-turn loop (rollouter/batch.py), side by side in one run, over the same workload.

Both loops run in this one process as tests/test_agent_loops.py drives them (the rollout
context wired from in-memory parts: bench/agent_sim.py; no Redis, no processes), with
verl's tool agent loop (``rollout.multi_turn``), the agent demo's tokenizer and chat
template (tasks/agentdemo.py, built in a temp dir), and time that is simulated:

- the engine (bench/agent_sim.SimEngine) sleeps, on the rollouter's single worker thread,
  ``call_ms + step_ms x decode steps + token_ms x tokens`` per call (a batch ``generate`` of
  a turn: as many steps as its longest turn; a streaming ``advance``: up to 8 steps, fewer
  once a response ends); ``--capacity`` is both loops' batch (``rollout.max_num_seqs`` =
  ``rollout.prompts_per_batch``, one response per ticket);
- each conversation has ``--turns`` assistant turns (``--turn-tokens`` long, drawn
  uniformly), every one but the last calling the tool ``wait``, whose latency is drawn from
  a lognormal (median ``--tool-median-ms``, p99 ``--tool-p99x`` x the median; seeded): the
  draws are written into the scripted calls, so both loops see the very same workload.

The figures are ratios of simulated times: they do not depend on the machine's speed or
load except through the loops' own Python work between engine calls (decoding, rendering,
bookkeeping: a few ms per call, against tens of ms simulated per call), which only ever
adds time — on a loaded machine the busy shares fall a little, never rise.

Measured per loop, from the first ticket to the last sample published (wall clock):

- samples/s: conversations finished per second;
- engine busy: time inside generate/advance over that wall time;
- waiting on tools: the share of the conversations in flight (started, not ended) whose
  tool call is running, sampled every 10 ms, averaged over the samples with any in flight;
- both also "steady": only up to the moment the last conversation starts. A real run's
  ticket stream does not run dry; a finite workload ends in a drain whose length is its
  last slowest tool calls (a 16 s draw with seed 1), which the whole-run figures count;
- trainer idle: a simulated trainer that takes ``--train-batch`` samples per step, as they
  arrive, and ``--train-ms`` per step, starting with the rollouter (an async trainer that
  never blocks the rollouter: no weight syncs here; every sample is of v0): the share of
  its time, up to the end of its last full step, spent waiting for samples.

Prints one table, both loops side by side with continuous/batch, and whether the aim holds
(the continuous loop keeps the engine >= 80% busy while >= 25% of its conversations wait on
tools; steady figures).

    .venv/bin/python bench/agent_loops.py [--conversations 192] [--capacity 32] [--seed 0]
        [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.agent_sim import (
    KEYS,
    Costs,
    Log,
    Present,
    Rewards,
    SimEngine,
    Source,
    weights,
)
from rollouter.answers import Seq
from rollouter.batch import BatchRollout
from rollouter.context import RolloutContext
from rollouter.continuous import ContinuousRollout
from rollouter.conversations import Conversations
from runconfig import load_config
from runschema.messages import PromptTicket, RunFinished, StepFinished

__all__ = ["AIM_BUSY", "AIM_WAITING", "main", "run_bench"]

LOOPS = ("batch", "continuous")
AIM_BUSY, AIM_WAITING = 0.80, 0.25
SAMPLE_EVERY_S = 0.010
BOUND_S = 600.0
Z99 = 2.3263478740408408  # the standard normal's 99th percentile
CALL = '<tool_call>{{"name": "wait", "arguments": {{"ms": {ms}}}}}</tool_call>'

DEFAULTS: dict[str, Any] = {
    "conversations": 192, "capacity": 32, "turns": 3, "turn_tokens": (24, 40),
    "tool_median_ms": 300.0, "tool_p99x": 20.0, "call_ms": 2.0, "step_ms": 20.0,
    "token_ms": 0.25, "train_batch": 32, "train_ms": 3000.0, "seed": 0,
}
QUICK: dict[str, Any] = {
    "conversations": 24, "capacity": 8, "turn_tokens": (24, 32), "tool_median_ms": 100.0,
    "step_ms": 5.0, "token_ms": 0.1, "train_batch": 8, "train_ms": 500.0,
}


# --------------------------------------------------------------------------- the workload


class Workload:
    """The conversations, scripted: prompts (token ids, chat template applied), each one's
    assistant turns as token ids, and the tool latencies drawn (ms, per call)."""

    def __init__(self, tokenizer: Any, p: dict[str, Any]) -> None:
        rng = np.random.default_rng(p["seed"])
        hf = tokenizer.hf
        eos = tokenizer.eos_id
        filler = hf.encode(".", add_special_tokens=False)
        sigma = math.log(p["tool_p99x"]) / Z99
        lo, hi = p["turn_tokens"]
        self.tickets: list[PromptTicket] = []
        self.script: dict[tuple[int, ...], list[list[int]]] = {}
        self.latencies_ms: list[float] = []
        for c in range(p["conversations"]):
            text = hf.apply_chat_template([{"role": "user", "content": f"Task {c}: wait."}],
                                          add_generation_prompt=True, tokenize=False)
            ids = hf.encode(text, add_special_tokens=False)
            turns: list[list[int]] = []
            for k in range(p["turns"]):
                length = int(rng.integers(lo, hi + 1))
                if k < p["turns"] - 1:
                    ms = round(float(p["tool_median_ms"] * rng.lognormal(0.0, sigma)))
                    self.latencies_ms.append(ms)
                    body = hf.encode(CALL.format(ms=ms), add_special_tokens=False)
                else:
                    body = hf.encode("Done.", add_special_tokens=False)
                turns.append([*filler * max(0, length - len(body) - 1), *body, eos])
            self.script[tuple(ids)] = turns
            self.tickets.append(PromptTicket(
                ticket_id=f"c{c}", prompt_id=f"c{c}", prompt=text, answer="", n=1,
                min_version=0, prompt_ids=ids, agent_name="tool_agent"))
        self.response_tokens = max(sum(len(t) for t in turns) for turns in self.script.values())


# --------------------------------------------------------------------------- one loop


async def run_loop(kind: str, work: Workload, tokenizer: Any, model_dir: Path,
                   tmp: Path, p: dict[str, Any]) -> dict[str, Any]:
    """Serve the whole workload with the ``kind`` loop; its figures."""
    tools = tmp / "tools.yaml"
    tools.write_text("tools:\n  - class_name: bench.agent_sim.SleepyTool\n    config: {}\n")
    cfg = load_config(None, [
        "trainer.total_training_steps=1", f"rollout.prompts_per_batch={p['capacity']}",
        f"rollout.max_num_seqs={p['capacity']}",
        # Room for every turn and tool turn: no conversation is cut by its budget.
        f"rollout.max_new_tokens={work.response_tokens + 64 * p['turns']}",
        "rollout.weights_fetch_timeout_s=5", "model.kind=hf", f"model.path={model_dir}",
        "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}",
        f"rollout.multi_turn.max_assistant_turns={p['turns']}",
        "rollout.multi_turn.tool_timeout_s=600"])
    engine = SimEngine(tokenizer.eos_id, tokenizer.hf.convert_tokens_to_ids("<tool_response>"),
                       work.script, Costs(p["call_ms"], p["step_ms"], p["token_ms"]))
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-worker")
    loop = asyncio.get_running_loop()

    async def off(fn: Any, *args: Any, **kwargs: Any) -> Any:
        """The rollouter's worker thread (runtime.Component.off): one thread, the engine's
        calls, decoding and rendering queued on it; the event loop stays free."""
        return await loop.run_in_executor(worker, functools.partial(fn, *args, **kwargs))

    source, log = Source(), Log()

    async def publish(*msgs: Any) -> None:
        pass

    async def fetch(msg: Any) -> Any:
        return {"w": torch.full((1,), float(msg.version))}

    async def load(state: Any, version: int) -> None:
        await off(engine.load_state, state, version)

    async def nobody() -> list[str]:
        return []

    async def nothing() -> None:
        pass

    ctx = RolloutContext(
        cfg, rank=0, keys=KEYS, tokenizer=tokenizer, generator=torch.Generator(), off=off,
        source=source, log=log, trainer=Present(), fetch=fetch, load=load,
        stranded=lambda msg: False, find_dead=nobody, publish=publish,
        complain=lambda text: print(text, file=sys.stderr), commands=nothing,
        profiler=lambda: None, rewards=Rewards())
    talks = Conversations.build(cfg, tokenizer, off=off)
    assert talks is not None
    ctx.conversations = talks
    started: list[Seq] = []
    started_at: list[float] = []
    start = talks.start

    def tracked(seq: Seq) -> Seq:
        seq = start(seq)
        started.append(seq)
        started_at.append(time.monotonic())
        return seq

    talks.start = tracked  # type: ignore[method-assign]  # every conversation seen
    total = len(work.tickets)
    log.add(weights(0))
    log.add(StepFinished(step=1, sample_ids=[], metrics={}, duration_s=0.0),
            RunFinished(run_id="agentbench", steps=1), when=lambda: source.answered() >= total)
    shares: list[tuple[float, float]] = []  # (when, share)

    async def watch() -> None:
        live: list[Seq] = []
        seen = 0
        while True:
            live += started[seen:]
            seen = len(started)
            live = [s for s in live if s.dialogue is not None and not s.dialogue.over]
            if live:
                waiting = sum(s.dialogue.waiting for s in live if s.dialogue)
                shares.append((time.monotonic(), waiting / len(live)))
            await asyncio.sleep(SAMPLE_EVERY_S)

    rollout = ContinuousRollout(ctx, engine) if kind == "continuous" else BatchRollout(
        ctx, engine)
    try:
        await asyncio.wait_for(ctx.weights.first(), 30)
        began = time.monotonic()
        for ticket in work.tickets:
            source.add(ticket)
        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(rollout.run(), BOUND_S)
        await ctx.tickets.delivered()
        watcher.cancel()
    finally:
        await ctx.stop()
        talks.close()
        worker.shutdown(wait=True)
    arrivals = sorted(t - began for t, samples in source.published for _ in samples)
    if len(arrivals) != total or source.dead:
        raise RuntimeError(f"{kind}: {len(arrivals)} of {total} samples, "
                           f"{len(source.dead)} dead-lettered: {source.dead[:3]}")
    wall = arrivals[-1]
    # Steady: until the last conversation starts (a real run's stream does not run dry;
    # the end of a finite workload is a drain, as long as its slowest last tool calls).
    steady = max(started_at) - began
    if steady < 0.05 * wall:
        steady = wall

    def busy(until: float) -> float:
        return sum(min(e, began + until) - max(s, began) for s, e in engine.busy
                   if e > began and s < began + until) / until

    def waiting(until: float) -> float:
        kept = [share for t, share in shares if t - began <= until]
        return statistics.fmean(kept) if kept else 0.0

    return {
        "samples_per_s": total / wall,
        "engine_busy": busy(wall),
        "waiting_on_tools": waiting(wall),
        "engine_busy_steady": busy(steady),
        "waiting_on_tools_steady": waiting(steady),
        "steady_s": steady,
        "trainer_idle": trainer_idle(arrivals, p["train_batch"], p["train_ms"] / 1000),
        "wall_s": wall,
        "engine_calls": engine.calls,
        "steps_per_call": engine.steps / max(1, engine.calls),
        "tokens_per_step": engine.tokens / max(1, engine.steps),
    }


def trainer_idle(arrivals: list[float], batch: int, step_s: float) -> float:
    """The share of a simulated trainer's time spent waiting for samples: it starts at 0
    (with the rollouter), takes each step's ``batch`` samples once they have all arrived
    (and its step before has ended) and trains ``step_s``; up to its last full step's end."""
    end = waited = 0.0
    steps = len(arrivals) // batch
    for k in range(steps):
        start = max(end, arrivals[(k + 1) * batch - 1])
        waited += start - end
        end = start + step_s
    return waited / end if end else 1.0


# --------------------------------------------------------------------------- the bench


def params(quick: bool = False, **overrides: Any) -> dict[str, Any]:
    """The bench's parameters: defaults, --quick's, then ``overrides`` (None: kept)."""
    p = {**DEFAULTS, **(QUICK if quick else {})}
    p.update({k: v for k, v in overrides.items() if v is not None})
    return p


def run_bench(p: dict[str, Any], tmp: Path | None = None) -> dict[str, Any]:
    """Both loops over the same workload; the figures by loop, the ratios and the aim."""
    from policy.text import HFTokenizer
    from tasks.agentdemo import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="agentbench-") as scratch:
        root = Path(tmp or scratch)
        # The agent demo's tokenizer and chat template; no weights (nothing is loaded): the
        # config.json only says the context length, which the config's checks read.
        model_dir = root / "model"
        build_tokenizer(model_dir)
        (model_dir / "config.json").write_text(json.dumps(
            {"model_type": "qwen2", "max_position_embeddings": 1 << 16}))
        tokenizer = HFTokenizer(model_dir)
        work = Workload(tokenizer, p)
        loops = {}
        for kind in LOOPS:
            (root / kind).mkdir(exist_ok=True)
            loops[kind] = asyncio.run(run_loop(kind, work, tokenizer, model_dir,
                                               root / kind, p))
    lat = np.array(work.latencies_ms)
    ratio = {k: loops["continuous"][k] / loops["batch"][k] if loops["batch"][k] else math.inf
             for k in loops["batch"]}
    cont = loops["continuous"]
    return {
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()},
        "tool_ms": {"p50": float(np.percentile(lat, 50)), "p90": float(np.percentile(lat, 90)),
                    "p99": float(np.percentile(lat, 99)), "max": float(lat.max()),
                    "mean": float(lat.mean())},
        "loops": loops, "ratio": ratio,
        "aim": {"busy": cont["engine_busy_steady"], "waiting": cont["waiting_on_tools_steady"],
                "holds": cont["engine_busy_steady"] >= AIM_BUSY
                and cont["waiting_on_tools_steady"] >= AIM_WAITING},
    }


ROWS = [("samples/s", "samples_per_s", "{:.2f}"),
        ("engine busy, steady", "engine_busy_steady", "{:.1%}"),
        ("waiting on tools, steady", "waiting_on_tools_steady", "{:.1%}"),
        ("engine busy, whole run", "engine_busy", "{:.1%}"),
        ("waiting on tools, whole run", "waiting_on_tools", "{:.1%}"),
        ("steady s (last conversation in)", "steady_s", "{:.2f}"),
        ("trainer idle", "trainer_idle", "{:.1%}"), ("wall s", "wall_s", "{:.2f}"),
        ("engine calls", "engine_calls", "{:d}"),
        ("decode steps per call", "steps_per_call", "{:.2f}"),
        ("tokens per decode step", "tokens_per_step", "{:.1f}")]


def report(r: dict[str, Any]) -> str:
    p, t = r["params"], r["tool_ms"]
    lines = [
        f"agent_loops: {p['conversations']} conversations x {p['turns']} assistant turns "
        f"({p['turns'] - 1} tool calls), {p['turn_tokens'][0]}-{p['turn_tokens'][1]} tokens "
        f"a turn, capacity {p['capacity']}, seed {p['seed']}",
        f"simulated engine: {p['call_ms']:g} ms a call + {p['step_ms']:g} ms a decode step + "
        f"{p['token_ms']:g} ms a token; tool latency lognormal, drawn (ms): "
        f"p50 {t['p50']:.0f}, p90 {t['p90']:.0f}, p99 {t['p99']:.0f}, max {t['max']:.0f}, "
        f"mean {t['mean']:.0f}",
        f"simulated trainer: {p['train_batch']} samples a step, {p['train_ms']:g} ms a step",
        "",
        f"{'':32} {'batch':>10} {'continuous':>11} {'cont/batch':>11}",
    ]
    for label, key, fmt in ROWS:
        b, c = r["loops"]["batch"][key], r["loops"]["continuous"][key]
        lines.append(f"{label:32} {fmt.format(b):>10} {fmt.format(c):>11} "
                     f"{r['ratio'][key]:>10.2f}x")
    a = r["aim"]
    lines += ["", f"aim (continuous, steady: engine busy >= {AIM_BUSY:.0%} while >= "
              f"{AIM_WAITING:.0%} of conversations wait on tools): busy {a['busy']:.1%}, waiting "
              f"{a['waiting']:.1%}: {'holds' if a['holds'] else 'does NOT hold'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small, fast workload (smoke)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--capacity", type=int, help="max_num_seqs = prompts_per_batch")
    ap.add_argument("--turns", type=int, help="assistant turns per conversation (>= 2)")
    ap.add_argument("--turn-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--tool-median-ms", type=float)
    ap.add_argument("--tool-p99x", type=float, help="the tool latency's p99 / median")
    ap.add_argument("--call-ms", type=float)
    ap.add_argument("--step-ms", type=float)
    ap.add_argument("--token-ms", type=float)
    ap.add_argument("--train-batch", type=int)
    ap.add_argument("--train-ms", type=float)
    ap.add_argument("--json", action="store_true", help="also print the result as JSON")
    a = ap.parse_args(argv)
    p = params(a.quick, seed=a.seed, conversations=a.conversations, capacity=a.capacity,
               turns=a.turns, turn_tokens=tuple(a.turn_tokens) if a.turn_tokens else None,
               tool_median_ms=a.tool_median_ms, tool_p99x=a.tool_p99x, call_ms=a.call_ms,
               step_ms=a.step_ms, token_ms=a.token_ms, train_batch=a.train_batch,
               train_ms=a.train_ms)
    result = run_bench(p)
    print(report(result))
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
