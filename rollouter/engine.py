"""The engine boundary: what the rollouter generates with, chosen by ``rollout.name`` (verl's
``actor_rollout_ref.rollout.name``).

``hf`` (the default) is the built-in decode loop on the policy (:class:`PolicyEngine`);
``vllm`` is vLLM in the rollouter's process (:mod:`rollouter.vllm_engine`, imported only
when asked for, so a venv without vLLM runs everything else). Both take token-id prompts and
give token ids, each token's log-prob under softmax(logits / temperature) of the whole
vocabulary (what the trainer recomputes) and whether an eos id ended the response, and both
load each published weights version in place and say which one they hold: the rollouter tags
a sample with :attr:`Engine.version`, never with the version it asked for.

Every method runs on the rollouter's worker thread (``Component.off``), never on its event
loop: generation and weight loads are the heavy work of the process.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import msgspec
import torch

from policy import EosIds, Generation, Policy, build_policy, decode_steps
from runconfig import Config
from runtime import Failure

__all__ = ["Delta", "Engine", "EngineBroken", "Off", "PolicyEngine", "StreamingEngine",
           "build_engine", "streams", "vllm_installed"]

T = TypeVar("T")


class EngineBroken(Failure):
    """The engine can no longer generate (a weights load failed inside it midway, leaving
    tensors no version describes): the rollouter exits naming it, to be restarted, rather
    than failing every ticket it claims."""

class Off(Protocol):
    """How the rollouter runs blocking work (an engine's calls, decoding) on its worker thread
    and awaits it (:meth:`runtime.Component.off`)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Awaitable[T]:
        """``fn(*args, **kwargs)`` on the worker thread (its arguments, whatever they are)."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What the rollouter generates with. The attributes are read, never set, by the
    rollouter: an engine may hold them as plain attributes or as properties."""

    @property
    def name(self) -> str:
        """``rollout.name`` of this engine (``hf``, ``vllm``), in the rollouter's lines."""
        ...

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a response by default (the model's generation_config lists)."""
        ...

    @property
    def version(self) -> int:
        """The weights version the engine holds now (-1: none loaded yet)."""
        ...

    @property
    def steps(self) -> int:
        """Engine steps run so far (a prefill or a decode step): only grows; the heartbeat's
        progress, so a long generate shows as progress and a wedged one as none."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        eos_id: EosIds = None,
        *,
        generator: torch.Generator | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> Generation:
        """One response per prompt (``policy.Generation``); temperature <= 0 is greedy."""
        ...

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Hold the weights ``state`` (the trainer's publication, HF ``state_dict`` names)
        as ``version`` from now on, without restarting the engine."""
        ...

    def close(self) -> None:
        """Free what the engine holds (an engine process, its cache)."""
        ...


class Delta(msgspec.Struct, frozen=True):
    """What one streamed request generated since the last time it was reported: new tokens,
    their log-probs (as :attr:`policy.Generation.logprobs`) and whether it has ended (an eos id
    or its ``max_new_tokens``)."""

    key: str
    tokens: list[int]
    logprobs: list[float]
    finished: bool


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """An engine that takes requests one by one while it generates (continuous batching):
    the rollouter feeds each ticket's responses as the ticket is claimed
    (:mod:`rollouter.continuous`) instead of calling :meth:`Engine.generate` per batch."""

    @property
    def in_flight(self) -> int:
        """Streamed requests submitted and not yet finished or aborted."""
        ...

    def submit(self, key: str, prompt: Sequence[int], max_new_tokens: int,
               temperature: float, eos_id: EosIds, *, generator: torch.Generator | None,
               top_p: float, top_k: int) -> None:
        """Start one response to ``prompt``, reported under ``key`` (unique while it runs)."""
        ...

    def advance(self, max_steps: int) -> list[Delta]:
        """Run up to ``max_steps`` engine steps (fewer once a request finishes) and report
        what every streamed request generated in them, with the weights of :attr:`version`."""
        ...

    def abort(self) -> list[Delta]:
        """End every streamed request now; returns what they generated that was not reported
        yet (none of it ``finished``). A request is resumed by submitting it again with its
        tokens so far appended to its prompt."""
        ...

    def cancel(self, keys: Sequence[str]) -> None:
        """End the streamed requests ``keys`` now (those still running; a newer attempt of
        their ticket replaced them): what they generated is dropped, never reported."""
        ...


def streams(engine: Engine | None) -> TypeGuard[StreamingEngine]:
    """Whether ``engine`` takes requests one by one (:class:`StreamingEngine`)."""
    return engine is not None and callable(getattr(engine, "advance", None))


class PolicyEngine:
    """The built-in engine: :func:`policy.decode_loop` on the rollouter's own copy of the
    policy (a static batch per call; rows that finish early idle until the batch ends)."""

    name = "hf"

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.policy.eval()
        self.version = -1

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.policy.eos_ids

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def steps(self) -> int:
        """Forward passes of the decode loop in this process (``policy.decode_steps``)."""
        return decode_steps()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        eos_id: EosIds = None,
        *,
        generator: torch.Generator | None = None,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> Generation:
        return self.policy.generate(prompts, max_new_tokens=max_new_tokens,
                                    temperature=temperature, eos_id=eos_id,
                                    generator=generator, top_p=top_p, top_k=top_k)

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.policy.load_state(state)
        self.version = version

    def close(self) -> None:
        """Nothing to free: the policy goes with the process."""


def vllm_installed() -> bool:
    """Whether this venv has vLLM (``make vllm``), without importing it (that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def build_engine(cfg: Config, device: torch.device, warn: Callable[[str], None]) -> Engine:
    """The engine ``rollout.name`` names (on the worker thread: building one loads weights,
    and vLLM's starts its engine core). A verl line says ``rollout.name=vllm`` as a matter of
    course: in a venv without vLLM the job still runs, on the built-in engine, and ``warn``
    says so once (the rollouter publishes it as a WarningRaised)."""
    if cfg.rollout.name == "vllm" and vllm_installed():
        from rollouter.vllm_engine import VllmEngine

        return VllmEngine(cfg, device)
    if cfg.rollout.name == "vllm":
        warn("rollout.name=vllm, but vLLM is not installed in this venv (make vllm): "
             "generating with the built-in engine")
    return PolicyEngine(build_policy(msgspec.to_builtins(cfg.model), device))
