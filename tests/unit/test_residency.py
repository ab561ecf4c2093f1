"""The residency checker of the Ray tests and bench catches two jobs on one device at once."""

from __future__ import annotations

from bench.residency import overlaps, residencies, union

STATES = ("sampler", "trainer")


def move(state: str, action: str, start: float, end: float) -> dict[str, object]:
    return {"state": state, "action": action, "start": start, "end": end, "bytes": 1}


def test_a_rank_is_resident_from_setup_or_restore_until_its_last_state_leaves() -> None:
    moves = [
        move("*", "setup", 0.0, 1.0),
        move("sampler", "evict", 2.0, 2.5),
        move("trainer", "evict", 2.5, 3.0),  # both out: resident 0.0 .. 3.0
        move("trainer", "restore", 5.0, 5.5),
        move("trainer", "evict", 6.0, 6.2),
        move("sampler", "restore", 8.0, 8.1),  # never evicted again
    ]
    assert residencies(moves, STATES) == [(0.0, 3.0), (5.0, 6.2), (8.0, float("inf"))]


def test_an_eviction_before_any_restore_opens_nothing() -> None:
    """A driver's actors hold state from before their first lease: not counted until the
    first restore."""
    moves = [move("torch", "evict", 1.0, 2.0), move("torch", "restore", 3.0, 4.0)]
    assert residencies(moves, ("torch",)) == [(3.0, float("inf"))]


def test_overlaps_counts_only_different_jobs_on_one_place() -> None:
    apart = {"gpu0": {"a": [(0.0, 1.0), (2.0, 3.0)], "b": [(1.0, 2.0), (3.0, 4.0)]}}
    assert overlaps(apart) == 0
    same_job = {"gpu0": {"a": [(0.0, 2.0), (1.0, 3.0)]}}
    assert overlaps(same_job) == 0
    clash = {"gpu0": {"a": [(0.0, 2.0)], "b": [(1.9, 3.0)]}, "gpu1": {"a": [(0.0, 9.0)]}}
    assert overlaps(clash) == 1
    restored_before_evicted = {"n0": {"a": [(0.0, 5.0)], "b": [(4.0, float("inf"))]}}
    assert overlaps(restored_before_evicted) == 1


def test_union_merges_a_nodes_ranks() -> None:
    assert union([(2.0, 3.0), (0.0, 1.0), (0.5, 2.5)]) == [(0.0, 3.0)]
    assert union([(0.0, 1.0), (2.0, 3.0)]) == [(0.0, 1.0), (2.0, 3.0)]
