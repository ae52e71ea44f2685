"""Step barriers: an int key that only rises, and appends refused once it passed a step.

The trainer raises the run's barrier to ``k`` before it lets any role begin step ``k``;
the profiler service appends a command for steps from ``first_step`` on only while the
barrier is below ``first_step``. Check and append run in one Lua script, so a command is
either in the stream before the barrier passed its first step, or not written at all.

Decisions:

- The barrier **never moves backwards**: raising it is GET + SET in one script, so
  concurrent callers cannot lower it. A missing key reads as 0.
- A **retried guarded append** whose first reply was lost may have written its entry even
  though the retry reports a refusal (the barrier moved meanwhile): callers that care look
  for it in the stream.
"""

from __future__ import annotations

from bus.client import BusClient
from runschema.messages import FIELD, Message, encode

__all__ = ["BarrierCommands"]

# Monotonic step barrier. KEYS[1] the barrier key; ARGV[1] the step. Never lowers it.
_SET_BARRIER_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local step = tonumber(ARGV[1])
if cur < step then
  redis.call('SET', KEYS[1], ARGV[1])
  return step
end
return cur
"""

# Guarded publish. KEYS[1] stream; KEYS[2] barrier key; ARGV[1] field; ARGV[2] encoded
# message; ARGV[3] first step. XADD only while the barrier is below the first step.
_PUBLISH_GUARDED_LUA = """
local barrier = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if barrier < tonumber(ARGV[3]) then
  return redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
end
return false
"""


class BarrierCommands(BusClient):
    """Monotonic barriers and the appends they guard."""

    async def publish_guarded(
        self, stream: str, msg: Message, guard_key: str, first_step: int
    ) -> str | None:
        """Append ``msg`` only if the int at ``guard_key`` (0 when missing) is below
        ``first_step``; returns the entry id, or None when refused (nothing was written).

        Wraps one Lua script (EVALSHA, EVAL when the server does not have it yet: GET, then
        XADD), so the check and the write are atomic: an accepted entry was appended before
        any :meth:`set_barrier` that raised the key to ``first_step`` or above. ``stream``
        and ``guard_key`` must share a hash slot on a cluster (a run's keys do). See the
        module docstring for a retry whose first reply was lost.
        """
        entry_id: bytes | None = await self.run_script(
            _PUBLISH_GUARDED_LUA, [stream, guard_key], [FIELD, encode(msg), int(first_step)],
            op="XADD",
        )
        return None if entry_id is None else entry_id.decode()

    async def set_barrier(self, key: str, step: int) -> int:
        """Raise the int at ``key`` to ``step``; never lower it. Returns the value it holds
        afterwards (``step`` or a higher one already there).

        Wraps one Lua script (EVALSHA/EVAL: GET, then SET only if the value is lower), so
        concurrent callers cannot move it backwards.
        """
        return int(await self.run_script(_SET_BARRIER_LUA, [key], [int(step)], op="SET"))

    async def get_barrier(self, key: str) -> int:
        """The int at ``key``, 0 when it is missing. Wraps GET."""
        raw = await self.command("GET", key)
        return 0 if raw is None else int(raw)
