"""One definition of a group's utilization (timeslice.protocol.utilization, docs/report.md):
the figure every command prints, in both windows, and the demand bound beside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from timeslice.protocol.utilization import (
    SINCE_CREATED,
    WHILE_JOBS_RAN,
    Utilization,
    active_window,
    both,
    demand_bound,
    merged,
    phase_time,
    since_created,
    while_jobs_ran,
)

REPO = Path(__file__).resolve().parents[2]


def test_both_windows_of_one_run():
    # Created at 0, phases 2-4 and 6-9, read at 12: 5 s of phases.
    phases = [(6.0, 9.0), (2.0, 4.0)]
    ran, life = both(phases, created=0.0, until=12.0)
    assert (ran.phase_s, ran.window_s, ran.window) == (5.0, 7.0, WHILE_JOBS_RAN)
    assert ran.share == pytest.approx(5 / 7)
    assert (life.phase_s, life.window_s, life.window) == (5.0, 12.0, SINCE_CREATED)
    assert str(life) == "41.7% of 12.0 s since the group was created"
    assert str(ran) == "71.4% of 7.0 s while jobs ran"
    assert active_window(phases) == (2.0, 9.0)


def test_overlapping_intervals_count_once_and_the_window_clips():
    assert merged([(3.0, 5.0), (1.0, 2.0), (1.5, 4.0), (7.0, 7.0)]) == [(1.0, 5.0)]
    assert phase_time([(0.0, 2.0), (1.0, 3.0)]) == 3.0
    assert phase_time([(0.0, 2.0), (5.0, 8.0)], window=(1.0, 6.0)) == 2.0
    # A phase placed before the group's creation (clocks) is cut at its creation.
    assert since_created([(-1.0, 1.0)], created=0.0, until=4.0).phase_s == 1.0


def test_no_phases_and_empty_windows_read_zero():
    assert while_jobs_ran([]) == Utilization(0.0, 0.0, WHILE_JOBS_RAN)
    assert while_jobs_ran([]).share == 0.0
    assert active_window([]) is None
    assert since_created([], created=5.0, until=4.0).window_s == 0.0
    assert Utilization(3.0, 2.0, SINCE_CREATED).share == 1.0  # never over 100%


def test_demand_bound_sums_the_shares_and_caps_them():
    assert demand_bound([0.3, 0.25]) == pytest.approx(0.55)
    assert demand_bound([0.6, 0.7]) == 1.0
    assert demand_bound([]) == 0.0


# The commands that print a group's utilization, and the one name each must call.
USERS = {
    "report/figures.py": "phase_time",
    "report/model.py": "Utilization",
    "plan/simulator.py": "Utilization",
    "plan/search.py": "demand_bound",
    "bench/replay.py": "while_jobs_ran",
    "bench/plan_check.py": "demand_bound",
    "examples/demo.py": "Utilization",
    "cli/main.py": "utilization_line",
}


@pytest.mark.parametrize("path", sorted(USERS))
def test_each_command_takes_it_from_the_one_definition(path: str) -> None:
    """No command computes its own: each names the definition's module and uses it."""
    source = (REPO / path).read_text()
    tree = ast.parse(source, path)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert USERS[path] in names, f"{path} does not use {USERS[path]}"
