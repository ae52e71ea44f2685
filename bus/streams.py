"""Redis Streams for rlbus: :class:`Bus`, the one client a process holds.

``Bus`` is the composition of the bus's command groups, one module per concern; each
module's docstring states its decisions, each method's docstring the Redis command(s) it
wraps:

- :mod:`bus.client`: connection, the retry/deadline policy, error mapping, ``command`` /
  ``pipeline`` / ``run_script``, ``ping``, ``server_time``, ``server_version``, ``close``
- :mod:`bus.publish`: ``publish``, ``publish_many``, ``publish_multi``, ``publish_raw``
- :mod:`bus.logs`: reading a stream as a log (``read_all``, ``read_after``,
  ``latest``, ``read_ids``, ``read_page``, ``decode_entry``, ``length``)
- :mod:`bus.groups`: consumer groups (:class:`Consumer`, dead letters, reclaiming, pending
  owners, group admin)
- :mod:`bus.trim`: safe trimming and reader positions
- :mod:`bus.barrier`: step barriers and guarded appends
- :mod:`bus.keyspace`: plain keys (text values, EXISTS, DEL, SCAN)

This module re-exports the names other packages import from it.
"""

from __future__ import annotations

from bus.barrier import BarrierCommands
from bus.entries import BadEntry, Entry, entry_key
from bus.groups import (
    EXCEEDED_REASON,
    TRIMMED_REASON,
    Consumer,
    ConsumerStats,
    Delivery,
    GroupCommands,
    GroupInfo,
    default_dlq,
)
from bus.keyspace import KeyCommands
from bus.logs import LogCommands
from bus.publish import PublishCommands
from bus.trim import TrimCommands

__all__ = [
    "EXCEEDED_REASON",
    "TRIMMED_REASON",
    "BadEntry",
    "Bus",
    "Consumer",
    "ConsumerStats",
    "Delivery",
    "Entry",
    "GroupInfo",
    "default_dlq",
    "entry_key",
]


class Bus(
    PublishCommands,
    LogCommands,
    GroupCommands,
    TrimCommands,
    BarrierCommands,
    KeyCommands,
):
    """A Redis Streams client for one process. Build it with :meth:`from_url`."""
