"""An independent oracle for the profiler service's decisions and manifest (tests only).

``tests/test_profiler_state.py`` checks on random logs that
:func:`profiler_service.schedule.decide` (on the folded state) and
:func:`profiler_service.manifest.build_manifest` give what this module gives. For that to
catch a bug, nothing here may share logic with ``profiler_service``: this module imports
only its *constants* (limits, names, codes) and the message types, and restates every rule
from docs/profiling.md ("The protocol", "Session ids", "Runtime requests", "The step
barrier", "Outputs") and the docstrings, in another form:

* no incremental state: every question ("has the latest RunStarted a ProfilerReady after
  it?", "which requests have no answer?") is answered by scanning the whole log with plain
  loops, lists and sets, on every call;
* its own helpers for labels, ranks, step runs, overlaps and trace paths (string sets
  instead of regular expressions, list scans instead of the service's open-session index);
* a runtime request is judged by an ordered table of rules, the first that applies giving
  the refusal's reason; the reasons' texts are the service's documented messages.

Log items are messages or ``(events entry id, message)`` pairs, as
:func:`profiler_service.state.fold` takes them; the id of a ProfileRequest is its arrival
time (Redis ms) for the expiry rule.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable, Iterator, Sequence
from pathlib import PurePosixPath
from typing import Any

from profiler_service.records import TraceChecked
from profiler_service.schedule import (
    MANIFEST_NAME,
    MAX_LABEL_LEN,
    MAX_REQUEST_ID_LEN,
    MAX_REQUEST_STEPS,
    PROFILER_SOURCE,
    ROLES,
    SESSIONS_MISSING_CODE,
)
from runconfig.schema import ProfilerConfig
from runschema.messages import (
    Command,
    ComponentFailed,
    Event,
    ProfileRequest,
    ProfileRequestRefused,
    ProfilerFinished,
    ProfilerReady,
    ProfileStarted,
    ProfileStopped,
    RunFinished,
    RunStarted,
    StartProfile,
    StepFinished,
    StepStarted,
    TrainerResumed,
    WarningRaised,
)

__all__ = ["reference_decide", "reference_manifest"]

Fact = Event | Command | TraceChecked
Item = Fact | tuple[str, Fact]

_ALNUM = frozenset(string.ascii_letters + string.digits)
_LABEL_CHARS = _ALNUM | frozenset("_.-")


# --------------------------------------------------------------------------- the log, scanned


def _entries(log: Sequence[Item]) -> list[tuple[str | None, Fact]]:
    """Every item as ``(events entry id or None, message)``, in log order."""
    return [item if isinstance(item, tuple) else (None, item) for item in log]


def _msgs(log: Sequence[Item]) -> list[Fact]:
    return [msg for _, msg in _entries(log)]


def _last_index(msgs: Sequence[Fact], kind: type, after: int = -1) -> int | None:
    """Index of the last message of ``kind`` after position ``after``, or None."""
    found = None
    for i, msg in enumerate(msgs):
        if i > after and isinstance(msg, kind):
            found = i
    return found


def _last_believed_end(msgs: Sequence[Fact], start: int) -> int | None:
    """Index of the last RunFinished after ``start`` whose steps is the highest StepFinished
    step before it (any, when there is none)."""
    found, last_step = None, 0
    for i, msg in enumerate(msgs):
        if isinstance(msg, StepFinished):
            last_step = max(last_step, msg.step)
        elif i > start and isinstance(msg, RunFinished) and last_step in (0, msg.steps):
            found = i
    return found


class _Facts:
    """What the whole log says, each fact recomputed by a scan (docs/profiling.md)."""

    def __init__(self, log: Sequence[Item]) -> None:
        self.entries = _entries(log)
        msgs = [msg for _, msg in self.entries]
        start = _last_index(msgs, RunStarted)
        self.run_started: RunStarted | None = None if start is None else msgs[start]  # type: ignore[assignment]
        # One ProfilerReady per RunStarted: only one *after the latest* counts.
        self.ready = start is not None and _last_index(msgs, ProfilerReady, start) is not None
        # A RunFinished counts when it follows the latest RunStarted (a resumed run starts
        # again) and names the last StepFinished before it, if there is any (runschema.facts);
        # the latest such one is the run's end.
        end = None if start is None else _last_believed_end(msgs, start)
        self.run_finished: RunFinished | None = None if end is None else msgs[end]  # type: ignore[assignment]
        # The give-up warning counts only after that RunFinished.
        self.gave_up = end is not None and any(
            isinstance(m, WarningRaised) and m.source == PROFILER_SOURCE
            and m.code == SESSIONS_MISSING_CODE
            for m in msgs[end + 1:]
        )
        self.profiler_finished = any(isinstance(m, ProfilerFinished) for m in msgs)
        self.last_started = max((m.step for m in msgs if isinstance(m, StepStarted)), default=0)
        self.sent = self._first_commands(msgs)
        counted = _counted_reports(msgs)
        self.stopped = {(m.session_id, m.role, m.rank) for i, m in enumerate(msgs)
                        if isinstance(m, ProfileStopped) and counted[i]}

    @staticmethod
    def _first_commands(msgs: Sequence[Fact]) -> list[StartProfile]:
        """The first StartProfile of each session id, in log order (a repeat is a retry)."""
        seen: set[str] = set()
        out: list[StartProfile] = []
        for m in msgs:
            if isinstance(m, StartProfile) and m.session_id not in seen:
                seen.add(m.session_id)
                out.append(m)
        return out

    def answered(self) -> set[str]:
        """Request ids with an answer anywhere in the log (a StartProfile or a refusal)."""
        ids = {m.request_id for _, m in self.entries if isinstance(m, ProfileRequestRefused)}
        ids |= {m.request_id for _, m in self.entries
                if isinstance(m, StartProfile) and m.request_id}
        return ids

    def unanswered(self) -> list[tuple[ProfileRequest, int | None]]:
        """Requests without an answer, first copy of each id, in log order, with the Redis
        ms of their arrival (None without an entry id)."""
        answered = self.answered()
        seen: set[str] = set()
        out: list[tuple[ProfileRequest, int | None]] = []
        for entry_id, m in self.entries:
            if not isinstance(m, ProfileRequest) or m.request_id in seen:
                continue
            seen.add(m.request_id)
            if m.request_id not in answered:
                out.append((m, _arrival_ms(entry_id)))
        return out

    def config_count(self, section: str, key: str) -> int | None:
        """A positive int of the run's config (the latest RunStarted), else None."""
        config = self.run_started.config if self.run_started is not None else None
        node = config.get(section) if isinstance(config, dict) else None
        value = node.get(key) if isinstance(node, dict) else None
        if type(value) is int and value > 0:
            return value
        return None

    @property
    def total(self) -> int | None:
        return self.config_count("trainer", "total_training_steps")

    @property
    def replicas(self) -> int:
        return self.config_count("rollout", "replicas") or 1

    @property
    def run_profiling_off(self) -> bool:
        """The run's own config says ``global_profiler.tool: null``."""
        config = self.run_started.config if self.run_started is not None else None
        node = config.get("global_profiler") if isinstance(config, dict) else None
        return isinstance(node, dict) and "tool" in node and node["tool"] is None


def _arrival_ms(entry_id: str | None) -> int | None:
    if not entry_id:
        return None
    ms = entry_id.split("-")[0]
    return int(ms) if ms.isdigit() else None


# --------------------------------------------------------------------------- helpers


def _is_label(text: str, max_len: int) -> bool:
    """1..max_len characters of [A-Za-z0-9_.-], the first a letter or digit."""
    return (0 < len(text) <= max_len and text[0] in _ALNUM
            and all(c in _LABEL_CHARS for c in text))


def _label(text: str) -> str:
    """``text`` with every other character as ``_``, cut to the label length, no leading
    ``.``/``-`` (never empty)."""
    out = "".join(c if c in _LABEL_CHARS else "_" for c in text)[:MAX_LABEL_LEN]
    while out and out[0] in ".-":
        out = out[1:]
    return out if out else "_"


def _session_id(first: int, last: int, request_id: str = "") -> str:
    if request_id:
        return _label("r" + request_id + "-s" + str(first) + "-" + str(last))
    return "s" + str(first) + "-" + str(last)


def _ranks_of(role: str, replicas: int, ranks: Sequence[int]) -> list[int]:
    """The trainer is rank 0, rollouters ``0..replicas-1``; ``ranks`` (non-empty) selects."""
    if role == "trainer":
        every = [0]
    elif role == "rollouter":
        every = list(range(replicas if replicas > 1 else 1))
    else:
        every = []
    return [r for r in every if len(ranks) == 0 or r in ranks]


def _targets(roles: Sequence[str], replicas: int, ranks: Sequence[int]) -> list[tuple[str, int]]:
    out = []
    for role in roles:
        for rank in _ranks_of(role, replicas, ranks):
            out.append((role, rank))
    return out


def _replicas_before(msgs: Sequence[Fact], i: int) -> int:
    """``rollout.replicas`` of the latest RunStarted before position ``i`` (1 if none)."""
    replicas = 1
    for m in msgs[:i]:
        if isinstance(m, RunStarted):
            node = m.config.get("rollout") if isinstance(m.config, dict) else None
            value = node.get("replicas") if isinstance(node, dict) else None
            replicas = value if type(value) is int and value > 0 else 1
    return replicas


def _joined(cmd: StartProfile, m: ProfileStarted | ProfileStopped) -> bool:
    """A rollouter beyond the replicas (it joined the run later) that the command addresses
    (its role listed, its rank listed or every rank): its reports count too."""
    return m.role == "rollouter" and "rollouter" in cmd.roles and (
        len(cmd.ranks) == 0 or m.rank in cmd.ranks)


def _counted_reports(msgs: Sequence[Fact]) -> list[bool]:
    """For each position: is it a ProfileStarted/ProfileStopped that counts? Only for a
    session whose StartProfile came earlier, from a process that session targets (with
    the replicas of the run at that point) or addresses (a rollouter that joined later)."""
    out = []
    for i, m in enumerate(msgs):
        counts = False
        if isinstance(m, ProfileStarted | ProfileStopped):
            cmd = next((c for c in msgs[:i] if isinstance(c, StartProfile)
                        and c.session_id == m.session_id), None)
            counts = cmd is not None and ((m.role, m.rank) in _targets(
                cmd.roles, _replicas_before(msgs, i), cmd.ranks) or _joined(cmd, m))
        out.append(counts)
    return out


def _roles_with_ranks(roles: Sequence[str], replicas: int, ranks: Sequence[int]) -> list[str]:
    out: list[str] = []
    for role in roles:
        # A rollouter rank past the replicas may join later: the role stays (not waited for).
        if role in ROLES and role not in out and (role == "rollouter"
                                                  or _ranks_of(role, replicas, ranks)):
            out.append(role)
    return out


def _spans(steps: Sequence[int], continuous: bool) -> list[tuple[int, int]]:
    """Sessions' step ranges: runs of consecutive steps (continuous) or one per step."""
    spans: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if continuous and spans and spans[-1][1] == step - 1:
            spans[-1] = (spans[-1][0], step)
        else:
            spans.append((step, step))
    return spans


def _shared_roles(a: StartProfile, b: StartProfile) -> list[str]:
    return [r for r in a.roles if r in b.roles]


def _steps_meet(a: StartProfile, b: StartProfile) -> bool:
    """The two inclusive step ranges intersect: the later start is not after the earlier
    end."""
    return max(a.first_step, b.first_step) <= min(a.last_step, b.last_step)


def _clash(a: StartProfile, b: StartProfile) -> bool:
    return bool(_shared_roles(a, b)) and _steps_meet(a, b)


def _refusal(req: ProfileRequest, reason: str) -> ProfileRequestRefused:
    return ProfileRequestRefused(request_id=req.request_id, reason=reason, ts=req.ts)


# --------------------------------------------------------------------------- the schedule


def _planned(cfg: ProfilerConfig, facts: _Facts) -> list[StartProfile]:
    """``global_profiler.steps`` as sessions: steps in 1..total, every configured role that
    has a rank, stamped with the latest RunStarted's time."""
    assert facts.run_started is not None and cfg.tool is not None
    roles = _roles_with_ranks(cfg.roles, facts.replicas, cfg.ranks)
    if not roles:
        return []
    total = facts.total
    steps = [s for s in cfg.steps if s >= 1 and (total is None or s <= total)]
    return [
        StartProfile(session_id=_session_id(first, last), roles=list(roles), tool=cfg.tool,
                     first_step=first, last_step=last, ranks=list(cfg.ranks),
                     contents=list(cfg.contents), ts=facts.run_started.ts)
        for first, last in _spans(steps, cfg.profile_continuous_steps)
    ]


# --------------------------------------------------------------------------- requests

# The rules a runtime request must pass, in the order the service applies them. Each gets
# (cfg, facts, request, barrier) and returns the refusal's reason, or None. Steps are
# computed by _requested_steps once the shape of the request is known to be sound.
Rule = Callable[[ProfilerConfig, _Facts, ProfileRequest, int], str | None]


def _rule_tool_off(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if cfg.tool is None:
        return "profiling is off: global_profiler.tool is null in the profiler service config"
    return None


def _rule_run_off(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if facts.run_profiling_off:
        return ("profiling is off for this run: it was started with global_profiler.tool null, "
                "so its trainer and rollouters hold no profiler and no trace could be written")
    return None


def _rule_id(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if _is_label(req.request_id, MAX_REQUEST_ID_LEN):
        return None
    return f"request id must be 1-{MAX_REQUEST_ID_LEN} letters, digits, '_', '.' or '-'"


def _rule_finished(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if facts.run_finished is None:
        return None
    return f"the run has finished (after step {facts.run_finished.steps})"


def _rule_roles(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if req.roles and all(r in ROLES for r in req.roles):
        return None
    return f"roles must be a non-empty subset of {list(ROLES)}, got {req.roles}"


def _rule_ranks(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if _roles_with_ranks(req.roles, facts.replicas, cfg.ranks):
        return None
    return f"no rank of roles {req.roles} is selected by global_profiler.ranks={cfg.ranks}"


def _rule_one_form(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if len(req.steps) > 0 and req.next_steps != 0:
        return "give either steps or next_steps, not both"
    return None


def _rule_next_sign(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    return f"next_steps must be >= 1, got {req.next_steps}" if req.next_steps < 0 else None


def _rule_size(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    if max(req.next_steps, len(req.steps)) > MAX_REQUEST_STEPS:
        return f"a request may cover at most {MAX_REQUEST_STEPS} steps"
    return None


def _requested_steps(facts: _Facts, req: ProfileRequest, barrier: int) -> list[int]:
    """``next:N`` counts from the later of the last StepStarted and the barrier."""
    if req.next_steps > 0:
        begun = max(facts.last_started, barrier)
        return [begun + i for i in range(1, req.next_steps + 1)]
    return sorted(set(req.steps))


def _rule_steps(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    steps = _requested_steps(facts, req, b)
    if not steps:
        return "the request names no step"
    if steps[0] < 1:
        return f"steps are 1-based, got {steps[0]}"
    if any(later != earlier + 1 for earlier, later in itertools.pairwise(steps)):
        return f"steps {steps} are not consecutive; one request is one session"
    return None


def _rule_future(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    first = _requested_steps(facts, req, b)[0]
    started = facts.last_started
    begun = max(started, b)
    if first <= started:
        return (f"step {first} is not in the future: trainer step {started} has already "
                f"started, so the earliest step a request can profile is {begun + 1}")
    if first <= b:
        return (f"step {first} is not in the future: trainer step {begun} has already begun "
                f"(the trainer closed commands for steps up to {begun}), so the earliest step "
                f"a request can profile is {begun + 1}")
    return None


def _rule_within_run(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, b: int) -> str | None:
    last = _requested_steps(facts, req, b)[-1]
    total = facts.total
    if total is not None and last > total:
        return f"step {last} is past the run's last step (trainer.total_training_steps={total})"
    return None


RULES: tuple[Rule, ...] = (
    _rule_tool_off, _rule_run_off, _rule_id, _rule_finished, _rule_roles, _rule_ranks,
    _rule_one_form, _rule_next_sign, _rule_size, _rule_steps, _rule_future, _rule_within_run,
)


def _reasons(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest,
             barrier: int) -> Iterator[str]:
    for rule in RULES:
        reason = rule(cfg, facts, req, barrier)
        if reason is not None:
            yield reason


def _judge(cfg: ProfilerConfig, facts: _Facts, req: ProfileRequest, barrier: int,
           taken: Sequence[StartProfile]) -> StartProfile | ProfileRequestRefused:
    """The answer to one request: the first rule it breaks, else a session, unless that
    session shares a role and a step with one of ``taken`` (the first such one is named)."""
    for reason in _reasons(cfg, facts, req, barrier):
        return _refusal(req, reason)
    assert cfg.tool is not None
    steps = _requested_steps(facts, req, barrier)
    first, last = steps[0], steps[-1]
    session = StartProfile(
        session_id=_session_id(first, last, req.request_id),
        roles=_roles_with_ranks(req.roles, facts.replicas, cfg.ranks), tool=cfg.tool,
        first_step=first, last_step=last, ranks=list(cfg.ranks), contents=list(cfg.contents),
        request_id=req.request_id, ts=req.ts,
    )
    for other in taken:
        if _clash(session, other):
            return _refusal(req, (
                f"steps {first}-{last} overlap session {other.session_id} "
                f"(steps {other.first_step}-{other.last_step}) on "
                f"{', '.join(_shared_roles(session, other))}"))
    return session


def _expired(req: ProfileRequest, arrived_ms: int | None, now_ms: int | None) -> str | None:
    """The expiry reason, by the Redis clock: older than its own timeout when answered."""
    if now_ms is None or arrived_ms is None:
        return None
    age_ms = now_ms - arrived_ms
    if age_ms * 1.0 <= req.timeout_s * 1000.0:
        return None
    return (f"expired: the request arrived {age_ms / 1000:.1f} s before the profiler service "
            f"could answer it, past its timeout of {req.timeout_s:g} s; nobody is waiting for "
            "the answer any more, so no session is scheduled for it")


# --------------------------------------------------------------------------- decide


def _finished_answer(facts: _Facts, sessions: Sequence[StartProfile]) -> ProfilerFinished | None:
    """ProfilerFinished once the run ended and every session that could run (first step
    within the run) stopped on every expected process, or the service gave up waiting."""
    end = facts.run_finished
    if end is None or facts.profiler_finished:
        return None
    waiting = [
        (s.session_id, role, rank)
        for s in sessions if s.first_step <= end.steps
        for role, rank in _targets(s.roles, facts.replicas, s.ranks)
        if (s.session_id, role, rank) not in facts.stopped
    ]
    if waiting and not facts.gave_up:
        return None
    return ProfilerFinished(manifest_path=MANIFEST_NAME, sessions=len(sessions), ts=end.ts)


def reference_decide(
    cfg: ProfilerConfig, log: Sequence[Item], barrier: int = 0, now_ms: int | None = None
) -> list[Command | Event]:
    """What the service must publish after reading ``log`` (docs/profiling.md, "The
    protocol"), given the step ``barrier`` and the Redis clock ``now_ms`` (None: requests
    are not judged by age)."""
    facts = _Facts(log)
    pending = facts.unanswered()
    if cfg.tool is None:  # profiling off in the service: refusals only, at once
        return [_judge(cfg, facts, req, barrier, []) for req, _ in pending]
    if facts.run_started is None:  # only a request nobody waits for is answered early
        out: list[Command | Event] = []
        for req, arrived in pending:
            reason = _expired(req, arrived, now_ms)
            if reason is not None:
                out.append(_refusal(req, reason))
        return out
    out = []
    sessions = list(facts.sent)
    sent_ids = {s.session_id for s in sessions}
    ready_ids: list[str] = []
    for planned in _planned(cfg, facts):
        if planned.session_id in sent_ids:
            ready_ids.append(planned.session_id)
        elif facts.run_finished is None and not any(_clash(planned, s) for s in sessions):
            out.append(planned)
            sessions.append(planned)
            ready_ids.append(planned.session_id)
    if not facts.ready and facts.run_finished is None:
        out.append(ProfilerReady(session_ids=ready_ids, ts=facts.run_started.ts))
    for req, arrived in pending:
        reason = _expired(req, arrived, now_ms)
        answer = _refusal(req, reason) if reason else _judge(cfg, facts, req, barrier, sessions)
        out.append(answer)
        if isinstance(answer, StartProfile):
            sessions.append(answer)
    finished = _finished_answer(facts, sessions)
    if finished is not None:
        out.append(finished)
    return out


# --------------------------------------------------------------------------- the manifest


def _trace_path(raw: str) -> str:
    """A reported trace path as the manifest keeps it: relative POSIX inside the folder,
    else "" (absolute, or climbing out with '..')."""
    if raw == "":
        return ""
    path = PurePosixPath(raw.replace("\\", "/"))
    if raw.replace("\\", "/").startswith("/") or ".." in path.parts:
        return ""
    return str(path)


def _stop_fields(stop: ProfileStopped) -> dict[str, Any]:
    return {"first_step": stop.first_step, "last_step": stop.last_step, "tool": stop.tool,
            "path": _trace_path(stop.path), "bytes": stop.bytes,
            "status": stop.status if stop.status else "ok", "duration_s": stop.duration_s}


def _ok(stop: ProfileStopped) -> bool:
    return stop.status in ("", "ok")


_NEVER_RAN = ("missed", "cancelled", "unavailable")


def _gone_reason(m: Fact) -> tuple[str, int, str] | None:
    """``(role, rank, why)`` when ``m`` says a process is gone (docs/profiling.md)."""
    if isinstance(m, RunStarted) and m.resumed:
        return "trainer", 0, "the trainer restarted inside the session (RunStarted, resumed)"
    if isinstance(m, TrainerResumed):
        return ("trainer", 0, "the trainer restarted inside the session (TrainerResumed "
                f"after step {m.step})")
    if isinstance(m, ComponentFailed):
        error = m.error if len(m.error) <= 200 else m.error[:200] + "..."
        return m.role, m.rank, f"{m.role}{m.rank} failed inside the session ({error})"
    return None


class _Target:
    """What the log says of one ``(session, role, rank)``, replayed from the start: its
    run in progress, the steps it lost, its recorded stop and that stop's file check."""

    def __init__(self, msgs: Sequence[Fact], counted: Sequence[bool], key: tuple[str, str, int]):
        _, role, rank = key
        self.started = False
        self.run: int | None = None  # step the run in progress began at
        self.lost: list[tuple[int, int | None, str]] = []
        self.stop: ProfileStopped | None = None
        self.check: str | None = None
        who = role + str(rank)
        for i, m in enumerate(msgs):
            mine = (isinstance(m, ProfileStarted | ProfileStopped | TraceChecked)
                    and (m.session_id, m.role, m.rank) == key)
            gone = _gone_reason(m)
            if isinstance(m, ProfileStarted) and mine and counted[i]:
                self.started = True
                if self.run == m.step:
                    continue
                if self.run is not None:
                    self.lost.append((self.run, m.step - 1, f"{who} restarted inside the "
                                      f"session (profiling began again at step {m.step})"))
                elif self.stop is not None and _ok(self.stop):
                    self.lost.append((self.stop.first_step, self.stop.last_step,
                                      f"{who} profiled the session again from step {m.step}; "
                                      "its new trace replaces the earlier one"))
                self.run = m.step
            elif isinstance(m, ProfileStopped) and mine and counted[i]:
                if self.run is not None and m.status in _NEVER_RAN:
                    self.lost.append((self.run, None, f"{who} restarted inside the session "
                                      f"(a later process reported it {m.status})"))
                self.run = None
                if self.stop is not None and _ok(self.stop) and not _ok(m):
                    continue
                self.stop, self.check = m, None
            elif isinstance(m, TraceChecked) and mine:
                if self.stop is not None and _ok(self.stop) and m.stopped == self.stop:
                    self.check = m.problem
            elif gone is not None and gone[:2] == (role, rank) and self.run is not None:
                self.lost.append((self.run, None, gone[2]))
                self.run = None

    def missing(self, cmd: StartProfile, end: int | None, final: bool) -> list[int]:
        top = cmd.last_step if end is None else min(cmd.last_step, end)
        steps = set()
        for first, last, _ in self.lost:
            upto = top if last is None else min(last, top)
            steps |= {k for k in range(max(first, cmd.first_step), upto + 1)}
        if self.stop is not None and _ok(self.stop) and self.check == "":
            steps -= set(range(self.stop.first_step, self.stop.last_step + 1))
        if self.run is not None and not final:
            steps -= set(range(self.run, top + 1))
        return sorted(steps)


def _settle(entry: dict[str, Any], target: _Target, cmd: StartProfile, end: int | None,
            final: bool) -> None:
    if target.stop is not None:
        entry.update(_stop_fields(target.stop))
    missing = target.missing(cmd, end, final)
    problem = ""
    # Status rules, first match wins (docs/profiling.md, "Outputs").
    if target.stop is None and target.run is not None:
        status = "running"
    elif target.stop is None and target.lost:
        status = "lost"
    elif target.stop is None:
        status = "running" if target.started else "scheduled"
    elif not _ok(target.stop):
        status = "lost" if target.lost else entry["status"]
    elif target.check is None:
        status = "unchecked"
    elif target.check != "":
        status, problem = "missing", target.check
    elif missing:
        status = "partial"
    else:
        status = "ok"
    if final and status in ("scheduled", "running"):
        status = "not_reached" if end is not None and entry["first_step"] > end else "missing"
    entry["status"] = status
    entry["missing_steps"] = missing
    reasons = [problem] if problem else []
    if missing or status == "lost" or problem:
        for _, _, why in target.lost:
            if why not in reasons:
                reasons.append(why)
    if reasons:
        entry["reason"] = "; ".join(reasons)


def reference_manifest(run_id: str, log: Sequence[Item], final: bool = False) -> dict[str, Any]:
    """The manifest the log implies (docs/profiling.md, "Outputs"): one entry per sent
    session and expected process, in the order sent, then any other process that reported
    a stop that counts, in the order of its first report. ``final`` (or ProfilerFinished, or
    the give-up warning in the log) turns what never stopped into ``missing``, or
    ``not_reached`` when the run ended before the session's first step."""
    facts = _Facts(log)
    msgs = _msgs(log)
    counted = _counted_reports(msgs)
    final = final or facts.profiler_finished or facts.gave_up
    end = facts.run_finished.steps if facts.run_finished is not None else None
    commands = {cmd.session_id: cmd for cmd in facts.sent}
    keys: list[tuple[str, str, int]] = []
    for cmd in facts.sent:
        for role, rank in _targets(cmd.roles, facts.replicas, cmd.ranks):
            if (cmd.session_id, role, rank) not in keys:
                keys.append((cmd.session_id, role, rank))
    expected = len(keys)
    for i, m in enumerate(msgs):
        if isinstance(m, ProfileStopped) and counted[i]:
            key = (m.session_id, m.role, m.rank)
            if key not in keys:
                keys.append(key)
    entries = []
    for n, key in enumerate(keys):
        cmd = commands[key[0]]
        entry: dict[str, Any] = {"id": key[0], "role": key[1], "rank": key[2]}
        if n < expected:
            entry.update({"first_step": cmd.first_step, "last_step": cmd.last_step,
                          "tool": cmd.tool, "path": "", "bytes": 0, "status": "scheduled"})
        entry["request_id"] = cmd.request_id
        _settle(entry, _Target(msgs, counted, key), cmd, end, final)
        entries.append(entry)
    return {"run_id": run_id, "sessions": entries}
