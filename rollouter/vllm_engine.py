"""The rollouter's vLLM engine (``rollout.name=vllm``): generation on ``vllm.LLM`` instead of
our own decode loop, behind the same :class:`rollouter.engine.Engine` boundary.

What it guarantees, the same as the HF engine:
- each response token's log-prob is log softmax(logits / temperature) over the *whole*
  vocabulary, whatever top-k / top-p drew it from, because the trainer recomputes exactly that
  (``policy.logprobs_from_logits``). vLLM's own ``processed_logprobs`` is taken after the
  top-k / top-p filter (log of the kept mass off); a worker extension (:class:`RlbusWorker`)
  makes the sampler return the unfiltered one. With the filters off both are the same.
- new weights go in place (no engine restart): the state is written once per load as one
  safetensors file in a private directory, and each worker reads it and reloads its model
  through vLLM's in-place reload, then reports the version it now holds. ``version`` is only
  ever what the workers reported, so samples are never tagged ahead of the weights.
- the engine core is a separate process that :meth:`VllmEngine.close` shuts down.

vLLM is an optional extra (``make vllm``): importing this module does not import it; the
engine does, with a clear error when it is missing.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policy import EosIds, Generation, eos_set
from rollouter.engine import Delta, EngineBroken
from rollouter.vllm_options import (
    DTYPES,
    VllmOptions,
    engine_env,
    environ,
    is_cpu,
    max_model_len,
    options_from_config,
)
from runconfig import Config

__all__ = ["RlbusWorker", "VllmEngine", "VllmOptions", "options_from_config"]

log = logging.getLogger(__name__)

_WEIGHTS_FILE = "model.safetensors"


class RlbusWorker:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called by name through
    ``LLM.collective_rpc``: a named method needs no pickled callables (vLLM's insecure
    serialisation stays off) and runs where the model lives."""

    def rlbus_load_weights(self, path: str, version: int) -> int:
        """Reload the model in place from the safetensors file at ``path``; returns the version
        this worker now holds. The tensors are read here, in the worker: an RPC argument would
        be re-serialised (lists, not tensors), and a directory reload would repoint the
        model config at a temporary path."""
        from safetensors import safe_open

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        self.rlbus_version = int(version)
        return self.rlbus_version

    def rlbus_weights_version(self) -> int:
        """The version of the last :meth:`rlbus_load_weights` (-1: the weights it started with)."""
        return int(getattr(self, "rlbus_version", -1))

    def rlbus_full_vocab_logprobs(self) -> bool:
        """Make the sampler return log softmax(logits / temperature) over the whole vocabulary
        (taken before top-k / top-p filter it) as the sampled token's log-prob; True once done.
        The engine runs with logprobs_mode=processed_logprobs, whose value is the same thing
        after the filter; when this patch cannot be made, the engine refuses top-k / top-p."""
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        tts = getattr(sampler, "topk_topp_sampler", None)
        if tts is None or not callable(getattr(tts, "forward", None)):
            return False
        if getattr(tts, "rlbus_full_vocab", False):
            return True
        inner = tts.forward
        # The inner sampler needs no log-probs of its own any more (one log_softmax, not two).
        tts.logprobs_mode = "raw_logprobs"

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[Any, Any]:
            # Before the filter: it may write -inf into ``logits`` in place.
            full = logits.log_softmax(dim=-1, dtype=torch.float32)
            sampled, _ = inner(logits, generators, k, p)
            return sampled, full

        tts.forward = forward
        tts.rlbus_full_vocab = True
        return True


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _model_facts(path: Path) -> tuple[tuple[int, ...], int | None]:
    """(eos ids, max_position_embeddings) from the model directory: the ids config.json and
    generation_config.json list, as HFPolicy takes them (vLLM, too, stops at every id the
    generation_config lists)."""
    cfg = _read_json(path / "config.json")
    gen = _read_json(path / "generation_config.json")
    text = cfg.get("text_config") or {}
    eos = eos_set(cfg.get("eos_token_id", text.get("eos_token_id")), gen.get("eos_token_id"))
    max_pos = cfg.get("max_position_embeddings", text.get("max_position_embeddings"))
    return eos, (int(max_pos) if max_pos else None)


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (what vLLM loaded
    at start); empty when there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ValueError(
            "invalid config key 'rollout.name': rollout.name=vllm needs the vllm extra "
            f"(make vllm): {e}") from e
    return vllm


def _write_state(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """``state`` as one safetensors file (write then rename: a worker never reads half a
    file). Tensors that share storage (tied embeddings) are written once each, cloned."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen or not t.is_contiguous():
            t = t.contiguous().clone()
        seen.add(key)
        out[name] = t
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp))
    tmp.replace(path)


class VllmEngine:
    """:class:`rollouter.engine.Engine` on a ``vllm.LLM`` (the synchronous API). Every method
    runs on one thread (the rollouter's worker thread)."""

    name = "vllm"

    def __init__(self, cfg: Config, device: torch.device | None = None) -> None:
        """The engine a run's config asks for (``model.*``, ``rollout.*``, ``data``'s prompt
        room: :func:`options_from_config`). ``device`` is vLLM's choice (its platform): it is
        not used. :meth:`open` takes a model directory and options instead."""
        self._start(*options_from_config(cfg))

    @classmethod
    def open(cls, path: str | Path, opts: VllmOptions | None = None) -> VllmEngine:
        """An engine on the model directory ``path`` (tests, benchmarks: no run config)."""
        engine = cls.__new__(cls)
        engine._start(Path(path), opts or VllmOptions())
        return engine

    def _start(self, path: Path, opts: VllmOptions) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"invalid config key 'model.path': {self.path} is not a local "
                             "model directory (no config.json); models are never downloaded")
        vllm = _import_vllm()
        self.opts = opts
        self.eos_ids, max_pos = _model_facts(self.path)
        max_pos = (opts.hf_overrides or {}).get("max_position_embeddings", max_pos)
        self._shapes = _checkpoint_shapes(self.path)
        self.max_model_len = max_model_len(opts, max_pos)
        self.version = -1
        self._vllm = vllm
        self._dirs: dict[str, Path] = {}  # private weight directories, by the base they are in
        self.steps = 0  # engine steps run so far (progress; see _run)
        self._broken: str | None = None  # why the engine can no longer be used (load_state)
        self._requests = 0  # generate's requests so far: their ids
        self._streamed: set[str] = set()  # the keys of the streamed requests running
        # Their tokens and log-probs not yet reported (advance, abort), by key, and the keys
        # of those that ended since the last report.
        self._pending: dict[str, tuple[list[int], list[float]]] = {}
        self._ended: set[str] = set()
        t0 = time.perf_counter()
        with environ(engine_env(opts)):
            self._llm = vllm.LLM(**self._llm_kwargs())
        self.full_vocab = all(self._llm.collective_rpc("rlbus_full_vocab_logprobs"))
        self.startup_s = time.perf_counter() - t0
        if not self.full_vocab:
            log.warning("vLLM's sampler could not be patched for whole-vocabulary log-probs: "
                        "rollout.top_k / rollout.top_p are refused with rollout.name=vllm")

    def _llm_kwargs(self) -> dict[str, Any]:
        o = self.opts
        # On a CPU, a prompt split across engine steps (chunked prefill) makes vLLM rewind
        # its request's seeded generator, which a CPU generator cannot do ("CPU Generator
        # does not use offset", every seeded request failing): there, prompts prefill whole.
        chunked = o.enable_chunked_prefill and not is_cpu()
        return dict(
            model=str(self.path),
            dtype=DTYPES.get(o.dtype, o.dtype),
            seed=o.seed,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=o.gpu_memory_utilization,
            max_num_seqs=o.max_num_seqs,
            max_num_batched_tokens=max(o.max_num_batched_tokens,
                                       0 if chunked else self.max_model_len),
            enforce_eager=o.enforce_eager,
            tensor_parallel_size=o.tensor_model_parallel_size,
            enable_prefix_caching=o.enable_prefix_caching,
            enable_chunked_prefill=chunked,
            # We send and take token ids: no tokenizer (the model directory need not have one).
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            worker_extension_cls=f"{__name__}.RlbusWorker",
            **({"hf_overrides": o.hf_overrides} if o.hf_overrides else {}),
        )

    # ------------------------------------------------------------------ generation

    def _params(self, n: int, max_new_tokens: int, temperature: float, eos: tuple[int, ...],
                top_p: float, top_k: int, generator: torch.Generator | None,
                delta: bool = False) -> list[Any]:
        """One SamplingParams per prompt; per-request seeds drawn from ``generator`` make a
        seeded run reproducible (vLLM's own seed would give every prompt the same draws).
        ``delta``: every engine step reports the new tokens (streamed requests), else only
        the whole response once it ends."""
        if (top_k > 0 or top_p < 1.0) and temperature > 0 and not self.full_vocab:
            raise ValueError("invalid config key 'rollout.top_k': top-k / top-p need the "
                             "whole-vocabulary log-prob patch, which this vLLM refused")
        seeds: list[int | None] = (
            torch.randint(0, 2**31 - 1, (n,), generator=generator,
                          device=generator.device).tolist()
            if generator is not None and temperature > 0 else [None] * n)
        greedy = temperature <= 0
        return [
            self._vllm.SamplingParams(
                n=1, max_tokens=max_new_tokens, seed=s,
                temperature=0.0 if greedy else float(temperature),
                top_p=1.0 if greedy else float(top_p),
                top_k=-1 if greedy or top_k <= 0 else int(top_k),
                # Exactly the caller's ids end a response (vLLM would add the model's own).
                ignore_eos=True, stop_token_ids=list(eos),
                logprobs=0, detokenize=False, flat_logprobs=True,
                output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA if delta
                else self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
            )
            for s in seeds
        ]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, eos_id: EosIds = None, *,
                 generator: torch.Generator | None = None, top_p: float = 1.0,
                 top_k: int = -1) -> Generation:
        """One response per prompt, in prompt order (see :class:`policy.Generation`)."""
        self._usable()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (e.g. bos)")
        n = len(prompts)
        if n == 0 or max_new_tokens <= 0:
            return Generation([[] for _ in range(n)], [np.zeros(0, np.float32)] * n,
                              [False] * n)
        eos = eos_set(self.eos_ids if eos_id is None else eos_id)
        params = self._params(n, max_new_tokens, temperature, eos, top_p, top_k, generator)
        reqs = [self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outs = self._run(reqs, params)
        tokens, logps, finished = [], [], []
        for out in outs:
            c = out.outputs[0]
            toks = list(c.token_ids)
            tokens.append(toks)
            logps.append(_sampled_logprobs(c.logprobs, toks))
            finished.append(bool(toks) and toks[-1] in eos)
        return Generation(tokens=tokens, logprobs=logps, finished=finished)

    def _run(self, reqs: list[Any], params: list[Any]) -> list[Any]:
        """``LLM.generate``'s loop, stepping the engine here: :attr:`steps` counts every
        engine step (a batch's prefill or one decode step), so a rollouter's heartbeat shows
        a long generate as progress, as ``policy.decode_steps`` does for the HF loop. Streamed
        requests in flight go on meanwhile; what they generate waits for :meth:`advance`."""
        engine = self._llm.llm_engine
        ids = []
        for req, sp in zip(reqs, params, strict=True):
            self._requests += 1
            ids.append(f"rlbus-generate-{self._requests}")  # outputs come back under it
            engine.add_request(ids[-1], req, sp)
        waiting = set(ids)
        done: dict[str, Any] = {}
        while waiting:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM finished {len(done)} of {len(reqs)} requests")
            for out in self._step():
                if out.finished and out.request_id in waiting:
                    waiting.discard(out.request_id)
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def _step(self) -> list[Any]:
        """One engine step: the streamed requests' new tokens go to :attr:`_pending` (merged
        per request), every other request's output is returned."""
        outs = self._llm.llm_engine.step()
        self.steps += 1  # only ever grows; read from other threads without a lock
        others = []
        for out in outs:
            if out.request_id not in self._streamed:
                others.append(out)
                continue
            c = out.outputs[0]
            toks = list(c.token_ids)
            got_tokens, got_logprobs = self._pending.setdefault(out.request_id, ([], []))
            got_tokens.extend(toks)
            if toks:
                got_logprobs.extend(_sampled_logprobs(c.logprobs, toks).tolist())
            if out.finished:
                self._ended.add(out.request_id)
                self._streamed.discard(out.request_id)
        return others

    # ------------------------------------------------------------------ streamed requests

    @property
    def in_flight(self) -> int:
        """Streamed requests submitted and not yet finished or aborted."""
        return len(self._streamed)

    def submit(self, key: str, prompt: Sequence[int], max_new_tokens: int,
               temperature: float, eos_id: EosIds, *, generator: torch.Generator | None,
               top_p: float, top_k: int) -> None:
        """Start one response to ``prompt`` now (the engine schedules it at its next step,
        beside the requests running); its tokens are reported under ``key``."""
        self._usable()
        if not prompt:
            raise ValueError("every prompt needs at least one token (e.g. bos)")
        if key in self._streamed:
            raise ValueError(f"a streamed request {key!r} is running already")
        eos = eos_set(self.eos_ids if eos_id is None else eos_id)
        (params,) = self._params(1, max_new_tokens, temperature, eos, top_p, top_k, generator,
                                 delta=True)
        prompt_ids = self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in prompt])
        self._llm.llm_engine.add_request(key, prompt_ids, params)
        self._streamed.add(key)

    def advance(self, max_steps: int) -> list[Delta]:
        """Up to ``max_steps`` engine steps, fewer once a streamed request finishes; what
        every streamed request generated since the last report."""
        self._usable()
        for _ in range(max_steps):
            if not self._streamed or self._ended:
                break
            if not self._llm.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM lost {len(self._streamed)} streamed requests")
            others = self._step()
            if others:  # nothing else runs between generate calls
                raise RuntimeError(f"vLLM reported {len(others)} requests nobody submitted")
        return self._take()

    def abort(self) -> list[Delta]:
        """End every streamed request (vLLM frees its KV blocks at once); what they
        generated that was not reported yet."""
        keys = list(self._streamed)
        if keys:
            self._llm.llm_engine.abort_request(keys)
        self._streamed.clear()
        return self._take()

    def cancel(self, keys: Sequence[str]) -> None:
        """End the streamed requests ``keys`` that still run (vLLM frees their KV blocks at
        once); what they generated and was not reported is dropped."""
        running = [k for k in keys if k in self._streamed]
        if running:
            self._llm.llm_engine.abort_request(running)
        for key in keys:
            self._streamed.discard(key)
            self._pending.pop(key, None)
            self._ended.discard(key)

    def _take(self) -> list[Delta]:
        out = [Delta(key, toks, logps, key in self._ended)
               for key, (toks, logps) in self._pending.items()]
        self._pending.clear()
        self._ended.clear()
        return out

    # ------------------------------------------------------------------ weights

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights in place (no restart). ``version`` is recorded only once every worker
        reports it holds it, and the prefix cache (KV of the old weights) is dropped. A state
        that does not fit is ValueError (the engine untouched); a load that fails inside
        vLLM is :class:`~rollouter.engine.EngineBroken`, and so is every later call."""
        self._usable()
        state = self._checked(state)
        path = self._weights_dir(_nbytes(state)) / _WEIGHTS_FILE
        _write_state(state, path)
        try:
            got = self._llm.collective_rpc("rlbus_load_weights",
                                           kwargs={"path": str(path), "version": int(version)})
            self._llm.reset_prefix_cache()
            if any(int(v) != int(version) for v in got):
                raise RuntimeError(f"vLLM workers report weights versions {got}, not {version}")
        except Exception as exc:
            # A reload that failed in the worker leaves weights no version describes, and
            # vLLM 0.32 cannot reload over them (measured: every later generate and load
            # fails, or its engine core is dead): no version, and no more use of it.
            self.version = -1
            self._broken = (f"the vLLM engine failed to load weights v{version} and is left "
                            f"unusable ({type(exc).__name__}: {exc}); restart the rollouter")
            raise EngineBroken(self._broken) from exc
        finally:
            path.unlink(missing_ok=True)
        self.version = int(version)

    def _usable(self) -> None:
        if self._broken is not None:
            raise EngineBroken(self._broken)

    def _checked(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``state`` restricted to the checkpoint's names, or ValueError before the engine is
        touched: a tensor vLLM cannot take fails inside its worker, and that kills the engine
        core. A name missing or of another shape is refused (it would leave old weights
        mixed in); another name the checkpoint does not have is dropped, except the output
        head: save_pretrained leaves a tied ``lm_head.weight`` out, yet vLLM's in-place reload
        needs it (without it the head keeps the old weights: measured, tests)."""
        if not self._shapes:  # a .bin checkpoint: nothing to check against
            return state
        missing = sorted(set(self._shapes) - set(state))
        wrong = sorted(n for n, shape in self._shapes.items()
                       if n in state and tuple(state[n].shape) != shape)
        if missing or wrong:
            raise ValueError(f"weights do not fit {self.path}: missing {missing[:5]}, "
                             f"other shapes {wrong[:5]}")
        return {n: t for n, t in state.items() if n in self._shapes or n == "lm_head.weight"}

    def _weights_dir(self, nbytes: int) -> Path:
        """A private directory with room for ``nbytes`` of weights: tmpfs (/dev/shm) when it
        has twice that free (a container's is often 64 MiB), else the temporary directory."""
        shm = Path("/dev/shm")
        base = ""
        if shm.is_dir() and shutil.disk_usage(shm).free >= 2 * nbytes:
            base = str(shm)
        if base not in self._dirs:
            self._dirs[base] = Path(tempfile.mkdtemp(prefix="rlbus-vllm-", dir=base or None))
        return self._dirs[base]

    def worker_versions(self) -> list[int]:
        """The weights version each worker reports it holds (tests, diagnostics)."""
        return [int(v) for v in self._llm.collective_rpc("rlbus_weights_version")]

    def close(self) -> None:
        """Shut the engine core (and its workers) down and remove the weights directory."""
        llm = getattr(self, "_llm", None)
        if llm is not None:
            self._llm = None
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
                _close_zmq(core)
        dirs = getattr(self, "_dirs", {})
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        dirs.clear()


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _sampled_logprobs(lp: Any, toks: list[int]) -> np.ndarray:
    """The sampled token's log-prob at each position (logprobs=0 returns just that one)."""
    if lp is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs=0 was set)")
    flat = getattr(lp, "logprobs", None)
    if flat is not None and hasattr(lp, "start_indices"):  # FlatLogprobs
        vals = [flat[s] for s in lp.start_indices]
    else:
        vals = [pos[t].logprob for pos, t in zip(lp, toks, strict=True)]
    return np.asarray(vals, dtype=np.float32)


def _close_zmq(core: Any) -> None:
    """End the engine client's ZMQ context, which vLLM's shutdown leaves to the garbage
    collector (a ResourceWarning then, at some later point of the process). Its output thread
    closes its own socket on shutdown: wait for it first, then nothing uses the context."""
    thread = getattr(core, "output_queue_thread", None)
    if thread is not None:
        thread.join(timeout=10)
    ctx = getattr(getattr(core, "resources", None), "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)
