"""Message schemas of a run: every entry of every stream is one of these Structs.

All messages form one tagged union (the ``type`` tag is the class name) and are encoded with
msgpack into a single stream field (:data:`FIELD`). Each carries a schema version ``v``.

Rules for evolving the schema: add fields only at the end and with defaults; never reorder,
rename or retype a field. A reader refuses a message whose ``v`` is newer than
:data:`SCHEMA_VERSION` (it cannot know what the new fields mean).

Token ids and log-probs travel as :class:`Array` (raw little-endian bytes plus dtype), never
as lists: a 256-token response is 1 KiB of int32 instead of ~700 msgpack ints.

>>> from runschema.messages import StepStarted, encode, decode
>>> decode(encode(StepStarted(step=1, param_version=0)))
StepStarted(v=1, step=1, param_version=0, ts=...)
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "FIELD",
    "SCHEMA_VERSION",
    "Array",
    "BlobRef",
    "CheckpointSaved",
    "Command",
    "ComponentFailed",
    "DeadLetter",
    "DecodeError",
    "Event",
    "FileDigest",
    "Heartbeat",
    "Message",
    "ProfileRequest",
    "ProfileRequestRefused",
    "ProfileStarted",
    "ProfileStopped",
    "ProfilerFinished",
    "ProfilerReady",
    "PromptTicket",
    "RolloutFailed",
    "RunFinished",
    "RunForked",
    "RunStarted",
    "Sample",
    "StartProfile",
    "StepFinished",
    "StepStarted",
    "StopProfile",
    "TicketsClaimed",
    "TicketsClosed",
    "TicketsIssued",
    "TrainerResumed",
    "ValidationFinished",
    "ValidationRequested",
    "WarningRaised",
    "WeightsPublished",
    "decode",
    "encode",
    "prompt_digest",
]

SCHEMA_VERSION = 1
"""The newest schema version this code understands and writes."""

FIELD = b"m"
"""The single stream-entry field that holds the msgpack-encoded message."""

Role = Literal["trainer", "rollouter"]
ProfilerTool = Literal["torch", "torch_memory", "nsys"]


def _now() -> float:
    return time.time()


class _Base(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """Common base: frozen records, keyword-only, tagged by class name."""

    v: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- payload pieces


class _Tensor(Protocol):
    """A torch tensor as :meth:`Array.of` reads it (torch is not imported here)."""

    def detach(self) -> _Tensor: ...

    def cpu(self) -> _Tensor: ...

    def numpy(self) -> np.ndarray: ...


class Array(msgspec.Struct, frozen=True, array_like=True):
    """A 1-D numeric array as raw little-endian bytes plus its numpy dtype string.

    ``Array.of(np.arange(4, dtype=np.int32))`` packs; ``.numpy()`` unpacks without a copy.
    """

    dtype: str
    data: bytes

    @classmethod
    def of(cls, values: npt.ArrayLike | _Tensor, dtype: str | None = None) -> Array:
        """Pack a numpy array, torch tensor or sequence (converted to little-endian)."""
        if hasattr(values, "detach"):  # torch.Tensor, without importing torch here
            values = values.detach().cpu().numpy()
        arr = np.asarray(values, dtype=dtype)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        return cls(dtype=arr.dtype.str, data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        """The values as a read-only numpy array (a view on ``data``)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype))

    def __len__(self) -> int:
        return len(self.data) // np.dtype(self.dtype).itemsize


class BlobRef(msgspec.Struct, frozen=True):
    """A claim check: where a large payload lives, how big it is and its sha256 (hex).

    ``store`` is ``"redis"`` (chunks under ``key``) or ``"dir"`` (a file named ``key`` under
    the store's root directory, never an absolute path).
    """

    store: str
    key: str
    size: int
    sha256: str
    chunks: int = 0


# --------------------------------------------------------------------------- run events


class RunStarted(_Base, frozen=True):
    """First event of a run (again on resume, with ``resumed=True``)."""

    run_id: str
    config: dict[str, Any]
    """The run's config as plain data (runconfig's shape, not the schema's: left untyped)."""
    ts: float = msgspec.field(default_factory=_now)
    resumed: bool = False


class StepStarted(_Base, frozen=True):
    """Trainer step ``step`` (1-based) begins with weights ``param_version``."""

    step: int
    param_version: int
    ts: float = msgspec.field(default_factory=_now)


class StepFinished(_Base, frozen=True):
    """Trainer step ``step`` is done: the update with these samples is applied."""

    step: int
    sample_ids: list[str]
    metrics: dict[str, float]
    duration_s: float
    param_version: int = 0
    ts: float = msgspec.field(default_factory=_now)
    entry_ids: list[str] = []
    """Samples-stream entry ids of the trained copies, in ``sample_ids`` order: replay reads
    exactly these (a sample id may have several copies in the stream; only one was trained)."""


class WeightsPublished(_Base, frozen=True):
    """Weights ``version`` are readable at ``ref``; version 0 is the initial policy.

    ``manifest``: set when the weights were published tensor by tensor through a weight
    transport (:mod:`weights.transport`); then it is the same reference as ``ref``,
    whose ``store`` names the transport and whose sha256 is the weights' digest (the
    manifest's). None: ``ref`` is one whole ``torch.save`` blob (logs written before)."""

    version: int
    ref: BlobRef
    step: int = 0
    ts: float = msgspec.field(default_factory=_now)
    manifest: BlobRef | None = None


class TrainerResumed(_Base, frozen=True):
    """A restarted trainer rebuilt its model: checkpoint ``checkpoint_step`` plus the steps
    after it re-applied from their recorded samples. ``weights_match`` says whether the result
    hashes to the weights it had published for ``param_version`` (None: nothing to compare)."""

    step: int
    param_version: int
    checkpoint_step: int
    replayed_steps: int
    weights_match: bool | None = None
    ts: float = msgspec.field(default_factory=_now)
    events_read: int = 0
    """Log entries the resume folded (those after the checkpoint's snapshot position)."""
    weights_gap: float | None = None
    """When the trainer ranks changed since the run's last start (float sums in another
    order, so no hash can match): how far the rebuilt model lies from the published weights
    of ``param_version``, relative to how far the run moved since the checkpoint
    (trainer.replay.TOLERANCE); None: not compared."""


class FileDigest(msgspec.Struct, frozen=True):
    """What one file of a checkpoint held when it was written: its size in bytes and the
    sha256 of its bytes (None where only the size could be had cheaply: dcp shards on a
    remote ``run.storage``, written there by every rank)."""

    size: int
    sha256: str | None = None


class CheckpointSaved(_Base, frozen=True):
    """A checkpoint after ``step`` was written (atomically) at ``path``."""

    step: int
    path: str
    param_version: int
    ts: float = msgspec.field(default_factory=_now)
    hf_path: str | None = None
    """With ``hf_model`` in ``trainer.checkpoint_contents``: the Hugging Face directory of
    these weights, written beside the checkpoint off the trainer's critical path (it
    appears whole, by a rename, once written)."""
    files: dict[str, FileDigest] = {}
    """Every file of the checkpoint, by its name relative to the checkpoint folder
    (``step-K.pt``, ``step-K.state``, ``step-K.dcp/...``): a resume verifies them before it
    loads the checkpoint (trainer.integrity). Empty in logs written before digests were."""
    resume_point: bool = False
    """The trainer's own checkpoint (trainer.resumepoints), not one ``trainer.save_freq``
    asked for: no Hugging Face export, deleted by retention once two newer checkpoints
    exist."""


class ProfilerReady(_Base, frozen=True):
    """The profiler service has sent every command due at step 1 (``session_ids``)."""

    session_ids: list[str] = []
    ts: float = msgspec.field(default_factory=_now)


class ProfileStarted(_Base, frozen=True):
    """A component began profiling session ``session_id`` at ``step``."""

    session_id: str
    role: str
    rank: int
    step: int
    tool: str
    ts: float = msgspec.field(default_factory=_now)


class ProfileStopped(_Base, frozen=True):
    """A component ended a session; ``path`` is relative to ``save_path/RUN``."""

    session_id: str
    role: str
    rank: int
    first_step: int
    last_step: int
    tool: str
    path: str
    bytes: int
    duration_s: float
    status: str = "ok"
    top_ops: list[str] = []
    ts: float = msgspec.field(default_factory=_now)


class ProfilerFinished(_Base, frozen=True):
    """Every session of the run has ended; the manifest is complete and the hook has run."""

    manifest_path: str
    sessions: int
    hook_rc: int | None = None
    ts: float = msgspec.field(default_factory=_now)


class ProfileRequest(_Base, frozen=True):
    """A runtime request (``rlbus profile``) to profile ``steps`` of a live run."""

    request_id: str
    steps: list[int] = []
    next_steps: int = 0
    roles: list[str] = msgspec.field(default_factory=lambda: ["trainer", "rollouter"])
    ts: float = msgspec.field(default_factory=_now)
    timeout_s: float = 30.0
    """How long the client waits for the answer. The profiler service never serves a request
    older than this (judged by Redis's clock: now vs the entry id); it refuses it instead."""


class ProfileRequestRefused(_Base, frozen=True):
    """The profiler service refused request ``request_id``."""

    request_id: str
    reason: str
    ts: float = msgspec.field(default_factory=_now)


class Heartbeat(_Base, frozen=True):
    """A component is alive; ``state`` says what it is doing. ``progress``: a counter of
    the process's work (a rollouter's decode steps, scored responses, published samples,
    loaded weights) that moves only when that work moves, never by the pulse alone, so a
    live process whose work is wedged shows as stuck; monotonic per ``pid``; None: not
    reported (an older process, or a role without it). ``weights_receiver``: the process
    takes part in the trainer's weight broadcasts (:mod:`weights.collective`)."""

    role: str
    rank: int
    pid: int
    state: str = "running"
    ts: float = msgspec.field(default_factory=_now)
    metrics: dict[str, float] = {}
    progress: int | None = None
    weights_receiver: bool = False


class RolloutFailed(_Base, frozen=True):
    """Generating for ticket ``ticket_id`` failed; the ticket is retried or dead-lettered."""

    ticket_id: str
    rank: int
    error: str
    ts: float = msgspec.field(default_factory=_now)


class ComponentFailed(_Base, frozen=True):
    """A component (or a peer it watches) failed; ``error`` names what and why."""

    role: str
    rank: int
    error: str
    ts: float = msgspec.field(default_factory=_now)


class WarningRaised(_Base, frozen=True):
    """Something worth a user's attention that did not stop the run."""

    source: str
    code: str
    message: str
    ts: float = msgspec.field(default_factory=_now)


class TicketsIssued(_Base, frozen=True):
    """Prompt tickets the trainer issued (appended with the tickets, atomically): the ticket
    ledger is folded from these, :class:`TicketsClosed` and :class:`StepFinished`."""

    ticket_ids: list[str]
    n: int
    param_version: int
    attempt: int = 0
    reason: str = ""
    """Why an ``attempt > 0`` was issued (lease expired, stale, invalid answer, ...)."""
    ts: float = msgspec.field(default_factory=_now)


class TicketsClosed(_Base, frozen=True):
    """Tickets the trainer gave up without training them (dead-lettered by the rollouters);
    their budget slots are free again."""

    ticket_ids: list[str]
    reason: str
    ts: float = msgspec.field(default_factory=_now)


class TicketsClaimed(_Base, frozen=True):
    """Rollouter ``rank`` (consumer ``rollouter-{rank}`` of the prompts group) took these
    tickets: Redis delivered them to it (a read, its own pending entries read again, or a
    reclaim from a dead replica). Stated before it generates for them, so a sample's claim
    precedes it in the log: the trainer trains an answer only from a rollouter that claimed
    that attempt of its ticket. ``attempts[i]`` is the attempt of ``ticket_ids[i]``."""

    ticket_ids: list[str]
    attempts: list[int]
    rank: int
    ts: float = msgspec.field(default_factory=_now)


class RunFinished(_Base, frozen=True):
    """Last event of a run. ``validation_only``: the run trained nothing, it validated the
    weights it started from (``trainer.val_only``); ``steps`` are those it started from."""

    run_id: str
    steps: int
    status: str = "ok"
    ts: float = msgspec.field(default_factory=_now)
    validation_only: bool = False


class RunForked(_Base, frozen=True):
    """This run goes on from run ``parent``'s state after ``step`` (``rlbus fork``): its log
    holds the parent's StepFinished events up to there (their metrics; their samples are in
    the parent's record), then this fact; its checkpoint ``checkpoint`` is the parent's model
    and optimizer after ``step``, rebuilt and checked against the weights the parent
    published (``weights_sha256``). ``overrides``: the settings changed from the parent's.
    ``dropped_tickets``: the parent's tickets open at ``step`` (issued, not trained), whose
    prompts this run does not train (it issues tickets from the parent's data position)."""

    run_id: str
    parent: str
    step: int
    parent_position: str
    """The parent's StepFinished of ``step`` (its entry id in the parent's log)."""
    checkpoint: str
    overrides: list[str] = []
    weights_sha256: str = ""
    dropped_tickets: list[str] = []
    ts: float = msgspec.field(default_factory=_now)


# --------------------------------------------------------------------------- work items


class PromptTicket(_Base, frozen=True):
    """The right to generate ``n`` responses for one prompt, issued within the staleness budget.

    A rollouter must hold weights of at least ``min_version`` before it generates.
    """

    ticket_id: str
    prompt_id: str
    prompt: str
    answer: str
    n: int
    min_version: int
    ts: float = msgspec.field(default_factory=_now)
    attempt: int = 0
    """0 for the first issue of ``ticket_id``; each lease reissue adds 1 (first answer wins)."""
    prompt_ids: list[int] | None = None
    """verl data: the prompt's token ids (chat template applied, truncated); None: encode
    ``prompt``."""
    data_source: str = ""
    """verl data: the record's ``data_source`` (picks the scorer; per-source metrics)."""
    ground_truth: Any = None
    """verl data: ``reward_model.ground_truth`` as stored (None: ``answer`` is the truth);
    untyped: its shape is the dataset's."""
    extra_info: dict[str, Any] | None = None
    """verl data: the record's ``extra_info``, passed to the reward function (untyped: the
    dataset's shape)."""
    prompt_digest: str = ""
    """The digest of the prompt's token ids as the rollouter generates from them
    (:func:`prompt_digest`), written by the trainer that issues the ticket: a sample whose
    ``prompt_tokens`` digest otherwise is not trained. Empty: not known (older logs, or a
    text prompt the issuer could not encode)."""
    agent_name: str = ""
    """verl data: the record's agent loop (``tool_agent``: a conversation with tools, with
    ``rollout.multi_turn.enable``); empty: a single response."""


class Sample(_Base, frozen=True):
    """One generated response (index ``index`` of ``n``) for ticket ``ticket_id``.

    ``sample_id`` is deterministic (``f"{ticket_id}/{index}"``) so a redelivered sample is
    recognised and trained at most once. ``min_version``/``max_version`` are the weight
    versions used while generating (they differ only with partial rollout).
    """

    sample_id: str
    ticket_id: str
    prompt_id: str
    index: int
    n: int
    prompt_tokens: Array
    response_tokens: Array
    logprobs: Array
    reward: float
    min_version: int
    max_version: int
    rank: int = 0
    gen_time_s: float = 0.0
    finish_reason: str = "length"
    ts: float = msgspec.field(default_factory=_now)
    attempt: int = 0
    """The attempt of the ticket this response answers (see :attr:`PromptTicket.attempt`)."""
    reward_s: float = 0.0
    """Seconds the scorer took for this response (``timing_s/reward``)."""
    reward_extra: dict[str, float] = {}
    """A verl reward function's other keys (its dict return form), as numbers."""
    reward_error: str = ""
    """Why the reward function gave no reward (``Type: message``, or that it timed out);
    the sample then has reward 0. Empty: it scored."""
    reward_timed_out: bool = False
    """The reward function ran past ``rollout.reward_timeout_s`` (``reward_error`` says so)."""
    response_mask: Array | None = None
    """verl's ``response_mask`` of a multi-turn response: one 0/1 per response token, 0 for
    the tokens the policy did not generate (a tool's output, a user turn appended to the
    conversation), which are context for the tokens after them but never trained. None:
    every response token was generated (a single-turn response)."""
    num_turns: int = 0
    """verl's ``num_turns`` of a multi-turn response (user turns + assistant turns + 1, the
    ``num_turns/*`` metrics); 0: a single-turn response."""
    tool_calls: int = 0
    """Tool calls the conversation made (``tool_call_counts/*``); of them ``tool_failures``
    ended in an error the model was told (unknown tool, bad arguments, raised, timed out)."""
    tool_failures: int = 0
    turn_versions: list[int] = []
    """The weights version each assistant turn of the conversation ended on, in order
    (between ``min_version`` and ``max_version``); empty for a single-turn response."""


class ValidationRequested(_Base, frozen=True):
    """Validate weights ``version`` on the validation set (``data.val_files``): written by the
    trainer into the prompts stream, served by one rollouter between its batches."""

    request_id: str  # "val-v{version}", unique within a run
    version: int
    step: int  # trainer updates done when it was requested (0: before training)
    ts: float = msgspec.field(default_factory=_now)


class ValidationFinished(_Base, frozen=True):
    """A validation's result (events): verl's metric names (``val-core/{data_source}/
    reward/mean@N``, ``best@``/``maj@`` for N > 1) and up to ``trainer.log_val_generations``
    generations as ``(prompt, response, score)``."""

    request_id: str
    version: int  # the weights version generated with (>= the version requested)
    step: int
    rank: int
    metrics: dict[str, float]
    generations: list[tuple[str, str, float]] = []
    duration_s: float = 0.0
    ts: float = msgspec.field(default_factory=_now)
    error: str = ""
    """Why the validation could not run (no metrics then); empty when it ran."""


# --------------------------------------------------------------------------- control


class StartProfile(_Base, frozen=True):
    """Profile steps ``first_step..last_step`` (inclusive) on ``roles``; stop by yourself after.

    ``ranks`` empty means every rank. Carries no path and no shell command: components derive
    the trace path from their own ``global_profiler.save_path`` and ``session_id``.
    """

    session_id: str
    roles: list[str]
    tool: str
    first_step: int
    last_step: int
    ranks: list[int] = []
    contents: list[str] = []
    request_id: str = ""
    ts: float = msgspec.field(default_factory=_now)


class StopProfile(_Base, frozen=True):
    """End session ``session_id`` now (at the next step boundary), before its last step."""

    session_id: str
    roles: list[str]
    reason: str = ""
    ts: float = msgspec.field(default_factory=_now)


# --------------------------------------------------------------------------- dead letters


class DeadLetter(_Base, frozen=True):
    """An entry a consumer could not handle: where it came from, why, and its raw bytes."""

    source_stream: str
    entry_id: str
    reason: str
    raw: bytes
    deliveries: int = 1
    group: str = ""
    consumer: str = ""
    ts: float = msgspec.field(default_factory=_now)


Event = (
    RunStarted
    | StepStarted
    | StepFinished
    | WeightsPublished
    | CheckpointSaved
    | TrainerResumed
    | ProfilerReady
    | ProfileStarted
    | ProfileStopped
    | ProfilerFinished
    | ProfileRequest
    | ProfileRequestRefused
    | Heartbeat
    | RolloutFailed
    | ComponentFailed
    | WarningRaised
    | TicketsIssued
    | TicketsClosed
    | TicketsClaimed
    | RunFinished
    | ValidationFinished
    | RunForked
)
"""Everything that goes to ``rlbus:{RUN}:events``."""

Command = StartProfile | StopProfile
"""Everything that goes to ``rlbus:{RUN}:control``."""

Message = Event | Command | PromptTicket | ValidationRequested | Sample | DeadLetter
"""Every message of every stream."""


def prompt_digest(tokens: Array | npt.ArrayLike) -> str:
    """The digest of a prompt's token ids: BLAKE2b-128 (hex) of them as little-endian int32,
    the form a rollouter packs them in (one hash over the buffer, no copy then). Ids
    outside int32 have no digest a ticket can carry (``"out of range"``)."""
    if isinstance(tokens, Array) and tokens.dtype == "<i4":
        data = tokens.data
    else:
        arr = tokens.numpy() if isinstance(tokens, Array) else np.asarray(tokens)
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < -(2**31)
                         or int(arr.max()) >= 2**31):
            return "out of range"
        data = arr.astype("<i4").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class DecodeError(ValueError):
    """Bytes that are not a valid message of this schema; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Encode one message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(raw: bytes | bytearray | memoryview | None) -> Message:
    """Decode msgpack bytes into a message; any problem raises :class:`DecodeError`."""
    if raw is None:
        raise DecodeError(f"entry has no field {FIELD.decode()!r}")
    try:
        msg = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"undecodable bytes: {exc}") from None
    if msg.v > SCHEMA_VERSION:
        raise DecodeError(
            f"{type(msg).__name__} has schema version {msg.v}, newer than {SCHEMA_VERSION}"
        )
    if msg.v < 1:
        raise DecodeError(f"{type(msg).__name__} has invalid schema version {msg.v}")
    return msg
