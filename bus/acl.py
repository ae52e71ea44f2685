"""Redis ACL users of one run: each component's user holds exactly the commands and keys it
uses, so Redis itself enforces one writer per fact (:mod:`runschema.authority`).

The rules are built here from the run's key names (:class:`bus.keys.RunKeys`) and written
to deploy/redis/users.acl by ``python -m bus.acl`` (the file is a template: ``@RUN@`` and the
password hashes are put in by deploy/redis/start-redis.sh); a test checks that the file is
what this module generates.

How a user is made of parts (Redis 7 ACL selectors): the root permissions hold the string
keys (liveness, positions, rank claims, lease, barrier, blobs) and the commands for them; a
selector per group of streams holds the stream commands for those streams only. A command
passes when the root or one selector allows it with all its keys, so a user that may XADD to
its own log stream may not SET, PEXPIRE or DEL it. Lua scripts (the trainer's fenced writes, the
profiler's barrier-guarded command) are allowed on the run's keys, and every command a
script runs is checked against the same permissions. No component user has SCAN: peers are
found through their role's members set (:func:`bus.liveness.members_key`) and blobs through
the run's blobs set, so no user sees another run's key names.

Functions
    ``acl_rules(run) -> dict[str, str]``  user name -> its rules (after ``user NAME on #HASH``)
    ``acl_file() -> str``                 the deploy/redis/users.acl template
"""

from __future__ import annotations

import sys

__all__ = ["COMPONENT_USERS", "acl_file", "acl_rules"]

COMPONENT_USERS = ("trainer", "rollouter", "profiler", "logger", "operator")

_CONNECTION = ("resetchannels -@all +ping +hello +client|setname +select +multi +exec +discard "
               "+script|load +script|exists"
               # The run's one clock (Bus.server_time: an entry's age by Redis's clock, never
               # by comparing hosts' clocks), which any role may read: keyless, read only.
               " +time"
               # A write refused for the server's memory names used/max (bus.client): INFO
               # is keyless and read only, and holds no secret.
               " +info"
               # Redis Cluster (bus.client): the slot table and the command table (where each
               # command's keys are) a cluster client reads at connect, ASKING while a slot
               # moves; CLUSTER MYID tells a plain URL that names a cluster node.
               " +cluster|slots +command +asking +cluster|myid")
_LIVENESS = "+get +mget +set +del +exists +pexpire +pttl +sadd +smembers"
_READ_STREAM = "+xread +xrange +xrevrange +xlen +exists"
_GROUP = ("+xreadgroup +xack +xautoclaim +xclaim +xpending +xgroup|create +xinfo|groups "
          "+xinfo|consumers")


def _keys(prefix: str, *names: str, read_only: bool = False) -> str:
    mark = "%R~" if read_only else "~"
    return " ".join(f"{mark}{prefix}:{name}" for name in names)


def _read_log(p: str) -> str:
    """A selector: read every stream of the run's log and the control stream (XREAD over
    several streams needs them all in one selector)."""
    return f"({_keys(p, 'events', 'events:*', 'control', read_only=True)} {_READ_STREAM})"


def _dead_letters(p: str) -> str:
    """Selectors for a writer of the dead-letter stream (bus.groups): each batch of dead
    letters trims the stream to its cap and counts what that dropped. XTRIM gives no more
    than XADD's own MAXLEN already does."""
    return f"({_keys(p, 'dlq')} +xtrim) ({_keys(p, 'dlq:dropped')} +incrby)"


def _scripts(p: str) -> str:
    return f"(~{p}:* +eval +evalsha)"


def _trainer(p: str) -> str:
    strings = _keys(p, "barrier", "trainer-lease", "archive", "blob:*", "blobs",
                    "weights-round", "alive:trainer:*")
    return " ".join([
        _CONNECTION, strings, _keys(p, "alive:*", "position:*", read_only=True),
        _LIVENESS, "+srem +incr",
        f"({_keys(p, 'events', 'prompts', 'samples', 'dlq')} ~rlbus:runs +xadd {_READ_STREAM} "
        f"{_GROUP} +xgroup|delconsumer +xtrim)",
        _dead_letters(p), _read_log(p), _scripts(p),
    ])


def _component(p: str, role: str, *, position: str, reads: tuple[str, ...],
               appends: tuple[str, ...], extra: str = "") -> str:
    """A component other than the trainer: its own liveness keys and position, ``reads``
    (string keys, read only), XADD to ``appends`` (its log stream first), the whole log."""
    return " ".join(part for part in [
        _CONNECTION, _keys(p, f"alive:{role}:*", position),
        _keys(p, "alive:*", *reads, read_only=True), _LIVENESS,
        f"({_keys(p, *appends)} +xadd)", extra, _read_log(p), _scripts(p),
    ] if part)


def _rollouter(p: str) -> str:
    return _component(p, "rollouter", position="position:rollouter*",
                      reads=("blob:*", "barrier", "trainer-lease", "weights-round"),
                      appends=("events:rollouter", "samples", "dlq"),
                      extra=f"{_keys(p, 'rank:rollouter:*')} "
                            f"({_keys(p, 'prompts')} {_GROUP} {_READ_STREAM}) "
                            f"{_dead_letters(p)}")


def _profiler(p: str) -> str:
    return _component(p, "profiler", position="position:profiler",
                      reads=("barrier", "trainer-lease", "archive"),
                      appends=("events:profiler", "control"))


def _logger(p: str) -> str:
    return _component(p, "logger", position="position:logger",
                      reads=("trainer-lease", "archive"), appends=("events:logger",))


def _operator(p: str) -> str:
    return " ".join([
        _CONNECTION.replace(" +script|load +script|exists", ""),
        f"%R~{p}:* %R~rlbus:runs +get +mget +pttl +smembers +xinfo|groups {_READ_STREAM}",
        f"({_keys(p, 'events:operator')} +xadd)",
    ])


_BUILDERS = {"trainer": _trainer, "rollouter": _rollouter, "profiler": _profiler,
             "logger": _logger, "operator": _operator}


def acl_rules(run: str) -> dict[str, str]:
    """Each component user's ACL rules for run ``run`` (no ``user``/``on``/password part)."""
    prefix = f"rlbus:{{{run}}}"
    return {user: _BUILDERS[user](prefix) for user in COMPONENT_USERS}


_HEADER = """\
# Redis 7 ACL users of one rlbus run (docker-compose.yml). Generated by `python -m bus.acl`
# from bus/acl.py (tests/test_acl.py checks it is current): edit that, not this file.
# A template: start-redis.sh puts the run id in for @RUN@ and each user's password, as a
# SHA-256 hash, for @..._HASH@, from the environment. One user per component:
#   ~pattern  read and write   %R~pattern  read only   (...)  a selector: these commands on
#   these keys only. Each role appends only to its own stream of the log (events for the
#   trainer, events:ROLE for the others); no user but admin may SET, PEXPIRE or DEL a
#   stream, touch another role's liveness keys, SCAN, or reach another run's keys.
user default on nopass resetchannels -@all +ping
user admin on #@ADMIN_HASH@ ~* &* +@all
"""


def acl_file() -> str:
    """The text of deploy/redis/users.acl."""
    lines = [f"user {user} on #@{user.upper()}_HASH@ {rules}"
             for user, rules in acl_rules("@RUN@").items()]
    return _HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(acl_file())
