"""Who may state what: the facts each writing role of a run's log may append.

Each role appends to its own stream of the log (:meth:`bus.keys.RunKeys.log`), and Redis's
ACL lets only that role's user append there (deploy/redis/users.acl). A reader still checks
every entry against this table before it folds it: an entry a role may not state (a
``RunFinished`` in the rollouters' stream, a ``ProfileStarted`` of the trainer's role written
by the profiler) is a forgery or a bug, and is refused with its reason, never folded. That
holds where no ACL is set up too (a Redis without users).

Functions
    ``refusal(role, msg) -> str | None``   why ``role`` may not state ``msg`` (None: it may)
"""

from __future__ import annotations

from runschema.messages import (
    CheckpointSaved,
    ComponentFailed,
    Message,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RolloutFailed,
    RunFinished,
    RunForked,
    RunStarted,
    StepFinished,
    StepStarted,
    TicketsClaimed,
    TicketsClosed,
    TicketsIssued,
    TrainerResumed,
    ValidationFinished,
    WarningRaised,
    WeightsPublished,
)

__all__ = ["FACTS", "refusal"]

_ANYONE: tuple[type, ...] = (WarningRaised, ComponentFailed)

FACTS: dict[str, tuple[type, ...]] = {
    "trainer": (RunStarted, StepStarted, StepFinished, WeightsPublished, TrainerResumed,
                CheckpointSaved, TicketsIssued, TicketsClosed, RunFinished, RunForked,
                ProfileStarted,
                ProfileStopped, *_ANYONE),
    "rollouter": (RolloutFailed, ValidationFinished, TicketsClaimed, ProfileStarted, ProfileStopped,
                  *_ANYONE),
    "profiler": (ProfilerReady, ProfilerFinished, ProfileRequestRefused, *_ANYONE),
    "operator": (ProfileRequest, ProfileRequestRefused, *_ANYONE),
    "logger": _ANYONE,
}
"""The message types each role's stream may hold."""


def _speaks_for(msg: Message) -> str | None:
    """The role a message says it comes from, where it names one."""
    if isinstance(msg, ProfileStarted | ProfileStopped | ComponentFailed):
        return msg.role
    return None


def refusal(role: str, msg: Message) -> str | None:
    """Why ``role``'s stream may not hold ``msg`` (None: it may).

    >>> refusal("rollouter", RunFinished(run_id="r", steps=3))
    "the rollouter role may not state RunFinished (a fact of the trainer's)"
    """
    allowed = FACTS.get(role, ())
    if not isinstance(msg, allowed):
        owners = [r for r, types in FACTS.items() if isinstance(msg, types)]
        whose = f"a fact of the {' or '.join(owners)}'s" if owners else "not a fact of the log"
        return f"the {role} role may not state {type(msg).__name__} ({whose})"
    speaker = _speaks_for(msg)
    if speaker is not None and speaker != role:
        return f"the {role} role may not state {type(msg).__name__} for role {speaker!r}"
    return None
