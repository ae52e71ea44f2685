"""Which rows of a mini-batch each trainer rank trains (verl's ``trainer.balance_batch``).

Every rank builds the whole mini-batch and takes its share of the rows. The split must be
the same on every rank and on a replay, so it is a pure function of the rows' token counts.
A step takes as long as its slowest rank: :func:`balanced_rows` evens out the tokens each
rank gets (prompt + response, what a forward pays for) while keeping the row counts within
one of each other, as verl does before it dispatches a batch to its data-parallel ranks.
:func:`strided_rows` is the split without balancing (every ``world``-th row).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_rows", "rank_loads", "seqlen_metrics", "strided_rows"]


def strided_rows(n: int, world: int) -> list[list[int]]:
    """Rank ``r`` gets rows ``r, r + world, ...``."""
    return [list(range(rank, n, world)) for rank in range(world)]


def rank_loads(tokens: Sequence[int], parts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens each rank of ``parts`` trains on."""
    return [sum(tokens[i] for i in rows) for rows in parts]


def balanced_rows(tokens: Sequence[int], world: int) -> list[list[int]]:
    """Each rank's rows (ascending), the counts within one of each other and the most
    tokens on one rank as low as a greedy can make it: the longest row first, each to the
    least-loaded rank that has room (ties: fewer rows, then the lower rank). Never worse
    than :func:`strided_rows`, which it returns when the greedy is not better."""
    n = len(tokens)
    base, extra = divmod(n, world)
    parts: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    big = 0  # ranks holding base + 1 rows: at most `extra` of them
    for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world)
                    if len(parts[r]) < base or (len(parts[r]) == base and big < extra)),
                   key=lambda r: (loads[r], len(parts[r]), r))
        parts[rank].append(i)
        loads[rank] += tokens[i]
        big += len(parts[rank]) == base + 1
    strided = strided_rows(n, world)
    if max(rank_loads(tokens, strided), default=0) <= max(loads, default=0):
        return strided
    return [sorted(rows) for rows in parts]


def seqlen_metrics(strided: Sequence[int], balanced: Sequence[int]) -> dict[str, float]:
    """verl's ``global_seqlen/*`` from the tokens per rank of a step: without balancing
    (``min``, ``max``, ``minmax_diff``; verl's are of contiguous chunks, ours of the strided
    split that ``balance_batch=false`` trains), with it (``balanced_min``, ``balanced_max``)
    and the mean per rank."""
    return {
        "global_seqlen/min": float(min(strided)),
        "global_seqlen/max": float(max(strided)),
        "global_seqlen/minmax_diff": float(max(strided) - min(strided)),
        "global_seqlen/balanced_min": float(min(balanced)),
        "global_seqlen/balanced_max": float(max(balanced)),
        "global_seqlen/mean": sum(balanced) / len(balanced),
    }
