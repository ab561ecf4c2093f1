"""bench/boundary.py: what a phase boundary counts as waiting for another job's phase."""

from __future__ import annotations

from typing import Any

import pytest

from bench.boundary import _Activity, _boundary

pytestmark = pytest.mark.unit


def phase(name: str, request_id: str, at: float, result: dict[str, Any]) -> _Activity:
    """A phase activity scheduled at ``at``, started and completed right after; its result on
    the same clock (wall_offset_s 0)."""
    return _Activity(
        name=name,
        scheduled=at,
        request_id=request_id,
        started=at + 0.01,
        completed=at + 1.0,
        result={"wall_offset_s": 0.0, **result},
        task_started_after=at + 1.01,
    )


TRAIN = "timeslice.job.train"
SAMPLE = "timeslice.job.sample"


def test_a_kept_carry_s_wait_for_the_groups_answer_is_overhead():
    train = phase(TRAIN, "j:train", 0.0, {"mono_start": 0.0, "mono_end": 0.99})
    # The sample waited 0.3 s for the answer to the carry (asked/granted say so); the train's
    # own grant had waited 5 s: none of that is this boundary's.
    sample = phase(
        SAMPLE,
        "j:train",
        1.02,
        {"mono_start": 1.4, "mono_end": 2.0, "request_id": "j:train", "granted_mono": 1.33},
    )
    b = _boundary("j", train, sample, {"j:train": 5.0})
    assert b is not None and b.waited_s == 0.0
    assert b.overhead_s == pytest.approx(1.4 - 0.99)


def test_a_sample_under_its_or_else_waited_for_the_other_job():
    train = phase(TRAIN, "j:train", 0.0, {"mono_start": 0.0, "mono_end": 0.99})
    # Refused: it ran under the order asked ahead, which the group granted after 1 s.
    sample = phase(
        SAMPLE,
        "j:train",
        1.02,
        {"mono_start": 2.3, "mono_end": 3.0, "request_id": "j:ahead", "granted_mono": 2.2},
    )
    b = _boundary("j", train, sample, {"j:train": 5.0, "j:ahead": 1.0})
    assert b is not None and b.waited_s == pytest.approx(1.0)
    assert b.overhead_s == pytest.approx(2.3 - 0.99 - 1.0)
