"""trainer.rowsplit: the rows each trainer rank trains (trainer.balance_batch)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainer.rowsplit import balanced_rows, rank_loads, seqlen_metrics, strided_rows

tokens_lists = st.lists(st.integers(1, 4096), min_size=1, max_size=64)
worlds = st.integers(1, 8)


@given(tokens_lists, worlds)
def test_every_row_goes_to_one_rank_and_counts_stay_within_one(tokens: list[int],
                                                               world: int) -> None:
    parts = balanced_rows(tokens, world)
    assert len(parts) == world
    assert sorted(i for rows in parts for i in rows) == list(range(len(tokens)))
    sizes = [len(rows) for rows in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(rows == sorted(rows) for rows in parts)


@given(tokens_lists, worlds)
def test_balanced_is_never_worse_than_strided_and_always_the_same(tokens: list[int],
                                                                  world: int) -> None:
    parts = balanced_rows(tokens, world)
    assert max(rank_loads(tokens, parts)) <= max(rank_loads(tokens, strided_rows(
        len(tokens), world)))
    assert balanced_rows(list(tokens), world) == parts  # a replay splits the same way


def test_long_rows_strided_onto_one_rank_are_spread() -> None:
    tokens = [100, 5, 100, 5, 100, 5, 100, 5]
    assert rank_loads(tokens, strided_rows(8, 2)) == [400, 20]
    parts = balanced_rows(tokens, 2)
    assert rank_loads(tokens, parts) == [210, 210]
    assert [len(rows) for rows in parts] == [4, 4]


def test_more_ranks_than_rows_leaves_some_ranks_empty() -> None:
    parts = balanced_rows([3, 7], 4)
    assert sorted(map(len, parts)) == [0, 0, 1, 1]
    assert sorted(rank_loads([3, 7], parts)) == [0, 0, 3, 7]


def test_seqlen_metrics_are_verls_names_and_values() -> None:
    m = seqlen_metrics([400, 20], [210, 210])
    assert m == {"global_seqlen/min": 20.0, "global_seqlen/max": 400.0,
                 "global_seqlen/minmax_diff": 380.0, "global_seqlen/balanced_min": 210.0,
                 "global_seqlen/balanced_max": 210.0, "global_seqlen/mean": 210.0}
