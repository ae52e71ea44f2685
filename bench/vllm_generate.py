"""Generation: vLLM (rollout.name=vllm) vs HFPolicy's own decode loop (rollout.name=hf), on the
same random Qwen2 built here, the same prompts, side by side; plus the vLLM engine's start-up
and in-place weight load times.

Each batch size runs one warm-up generate per engine, then ``--repeat`` timed ones; every
response runs to ``--new-tokens`` (no eos), at temperature 1. tokens/s counts generated
tokens. Both engines get ``--threads`` CPU threads (vLLM's worker: OMP_NUM_THREADS, unbound).
A load is ``VllmEngine.load_state`` of a perturbed copy of the weights (safetensors written to
a private tmpfs directory, reloaded in place by the worker, prefix cache reset); publish ->
loaded adds the way there, as a run with the storage transport takes it: the trainer's
publication (tensor by tensor, 4 MiB chunks hashed) into a local directory, the rollouter's
fetch (chunks read 8 at a time, each checked), then the load.

    python bench/vllm_generate.py                          # tiny (~0.5 MB) and ~100 MB models
    python bench/vllm_generate.py --sizes tiny --batches 16 --repeat 1   # smoke

Then responses of mixed lengths (each its own, drawn from 8..``--new-tokens``, as RL
responses end at their own eos), ``4 x width`` of them through the same vLLM engine two
ways: in batches of ``width`` (the next batch starts when the whole batch has ended: how the
rollouter fed vLLM before continuous admission) and continuously (a response joins as soon
as one ends, ``width`` at most at once: ``rollouter.continuous``).

Needs the vllm extra (make vllm). The engine core is a spawned process: hence the __main__
guard.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

# name -> (hidden, layers, heads, intermediate, vocab): head_dim 64 (vLLM's CPU attention
# needs >= 32); "100mb" is ~26M parameters, ~105 MB in fp32.
SIZES = {
    "tiny": (128, 2, 2, 256, 512),
    "100mb": (512, 6, 8, 1408, 8192),
}


def build_model(size: str, path: Path) -> int:
    """A random Qwen2 of ``size`` saved at ``path``; returns its parameter count."""
    import transformers

    hidden, layers, heads, inter, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def time_loads(engine: object, policy: object, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` in-place loads of perturbed weights."""
    out = []
    for v in range(repeat):
        state = {k: t + 1e-3 * torch.randn_like(t) for k, t in policy.weights().items()}
        t0 = time.perf_counter()
        engine.load_state(state, v)
        out.append(time.perf_counter() - t0)
    return out


def time_publish_to_loaded(engine: object, policy: object, repeat: int) -> list[float]:
    """Seconds from the start of each of ``repeat`` publications (storage transport, fp32)
    to the engine holding them."""
    import asyncio

    from weights.transport import StorageTransport

    async def one(transport: StorageTransport, v: int) -> float:
        state = {k: t + 1e-3 * torch.randn_like(t) for k, t in policy.weights().items()}
        t0 = time.perf_counter()
        ref = await transport.publish(f"weights-v{v}", state)
        fetched = await transport.fetch(ref)
        engine.load_state(fetched, v)
        took = time.perf_counter() - t0
        await transport.delete(ref)
        return took

    with tempfile.TemporaryDirectory() as root:
        transport = StorageTransport(root)
        return [asyncio.run(one(transport, 1000 + v)) for v in range(repeat)]


def time_generate(fn: object, prompts: list[list[int]], new_tokens: int, repeat: int) -> float:
    """Generated tokens per second, best of ``repeat`` after one warm-up."""
    fn(prompts, new_tokens, torch.Generator().manual_seed(0))
    best = float("inf")
    n = 0
    for r in range(repeat):
        t0 = time.perf_counter()
        gen = fn(prompts, new_tokens, torch.Generator().manual_seed(r + 1))
        best = min(best, time.perf_counter() - t0)
        n = sum(len(t) for t in gen.tokens)
    return n / best


def time_mixed(engine: object, prompts: list[list[int]], lengths: list[int], width: int,
               continuous: bool) -> float:
    """Tokens/s of streaming ``prompts`` (response ``i`` exactly ``lengths[i]`` tokens) at
    most ``width`` at a time: in batches, or refilled as each ends."""
    todo = list(range(len(prompts)))
    made = 0
    t0 = time.perf_counter()
    while todo or engine.in_flight:
        if continuous or not engine.in_flight:
            while todo and engine.in_flight < width:
                i = todo.pop(0)
                engine.submit(str(i), prompts[i], lengths[i], 1.0, [],
                              generator=None, top_p=1.0, top_k=-1)
        made += sum(len(d.tokens) for d in engine.advance(8))
    return made / (time.perf_counter() - t0)


def run_mixed(engine: object, vocab: int, args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1)
    print(f"{'width':>6} {'batches tok/s':>14} {'continuous tok/s':>17} {'ratio':>6}")
    for width in args.batches:
        n = 4 * width
        prompts = [[1, *torch.randint(3, vocab, (args.prompt_len - 1,), generator=g).tolist()]
                   for _ in range(n)]
        lengths = torch.randint(8, args.new_tokens + 1, (n,), generator=g).tolist()
        time_mixed(engine, prompts[:width], lengths[:width], width, True)  # warm-up
        best = {False: 0.0, True: 0.0}
        for _ in range(args.repeat):
            for continuous in (False, True):
                best[continuous] = max(best[continuous], time_mixed(
                    engine, prompts, lengths, width, continuous))
        print(f"{width:>6} {best[False]:>14.0f} {best[True]:>17.0f} "
              f"{best[True] / best[False]:>6.2f}", flush=True)


def run_size(size: str, args: argparse.Namespace) -> None:
    from policy.hf import HFPolicy
    from rollouter.vllm_engine import VllmEngine, VllmOptions

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / size
        n_params = build_model(size, path)
        mb = n_params * 4 / 1e6
        torch.set_num_threads(args.threads)
        policy = HFPolicy.from_pretrained(path, device="cpu").eval()
        t0 = time.perf_counter()
        engine = VllmEngine.open(path, VllmOptions(
            max_new_tokens=args.new_tokens, prompt_room=args.prompt_len + 8,
            threads=args.threads, kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=max(args.batches)))
        startup = time.perf_counter() - t0
        try:
            loads = time_loads(engine, policy, args.load_repeat)
            print(f"\n== {size}: {n_params / 1e6:.1f}M params, {mb:.0f} MB fp32 ==")
            print(f"vLLM engine start-up: {startup:.1f} s")
            print(f"load_state: median {statistics.median(loads):.3f} s, "
                  f"min {min(loads):.3f} s over {len(loads)}")
            synced = time_publish_to_loaded(engine, policy, args.load_repeat)
            print(f"publish -> loaded (storage transport, fp32): median "
                  f"{statistics.median(synced):.3f} s, min {min(synced):.3f} s over "
                  f"{len(synced)}")
            engine.load_state(policy.weights(), 100)  # both engines on the same weights
            print(f"{'batch':>6} {'vLLM tok/s':>11} {'HF tok/s':>10} {'ratio':>6}")
            g = torch.Generator().manual_seed(0)
            vocab = SIZES[size][4]
            for b in args.batches:
                prompts = [[1, *torch.randint(3, vocab, (args.prompt_len - 1,), generator=g)
                            .tolist()] for _ in range(b)]

                def vgen(p: list[list[int]], n: int, gen: torch.Generator) -> object:
                    return engine.generate(p, n, temperature=1.0, eos_id=[], generator=gen)

                def hgen(p: list[list[int]], n: int, gen: torch.Generator) -> object:
                    return policy.generate(p, n, temperature=1.0, eos_id=[], generator=gen)

                v = time_generate(vgen, prompts, args.new_tokens, args.repeat)
                h = time_generate(hgen, prompts, args.new_tokens, args.repeat)
                print(f"{b:>6} {v:>11.0f} {h:>10.0f} {v / h:>6.2f}", flush=True)
            print("mixed lengths, vLLM:")
            run_mixed(engine, vocab, args)
        finally:
            engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,100mb")
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--load-repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    print(f"vllm_generate {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"threads={args.threads}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, T=1")
    for size in args.sizes.split(","):
        run_size(size, args)


if __name__ == "__main__":
    main()
