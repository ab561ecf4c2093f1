"""`timeslice plan --html`: the simulated run as the report's timeline, and as plain rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from timeslice.plan.profile import Overheads, StateProfile
from timeslice.plan.search import Layout, plan
from timeslice.plan.simulator import GroupSpec, Placement, rl_profile, simulate
from timeslice.plan.timeline import to_report, write_timeline


def jobs() -> list:
    state = StateProfile(name="s", pool="sampler", bytes=10, snapshot_s=0.2, restore_s=0.3)
    return [
        rl_profile("a", sample_s=1, rewards_s=1, train_s=1, epochs=3, states=[state]),
        rl_profile("b", sample_s=1, rewards_s=2, train_s=0.5, epochs=3, states=[state]),
    ]


def test_simulated_run_becomes_a_report() -> None:
    a, b = jobs()
    outcome = simulate(
        [Placement(a, "g", "g"), Placement(b, "g", "g", start_s=0.5)],
        groups={"g": GroupSpec(memory_bytes=20)},
        overheads=Overheads.zero(),
        record=True,
    )
    best = plan([a, b], Layout(groups=("g",), memory_bytes=20), overheads=Overheads.zero())
    report = to_report(outcome, best.assignments[0])
    group = report.groups[0]
    assert group.phase_s == pytest.approx(outcome.groups["g"].busy_s)
    assert group.utilization == pytest.approx(outcome.groups["g"].utilization)
    lanes = {lane.name: lane for lane in report.lanes}
    assert set(lanes) == {"a", "b", "g"}
    # Job lanes: 3 epochs of sample, rewards and train each, plus waits and restores.
    kinds = [s.kind for s in lanes["b"].spans]
    assert kinds.count("sample") == kinds.count("train") == kinds.count("rewards") == 3
    assert "waiting" in kinds and "switching" in kinds
    # Group lane: one lease per grant.
    leases = [s for s in lanes["g"].spans if s.kind == "lease"]
    assert len(leases) == outcome.groups["g"].leases
    job_b = next(j for j in report.jobs if j.job_id == "b")
    assert job_b.wall_s == pytest.approx(outcome.jobs["b"].completion_s)
    # The plan's own figure, while jobs ran (it once printed 0.0% of 0.0 s), and the
    # simulated baseline of the slowdown, said so.
    assert report.simulated
    assert str(group.while_jobs_ran) == str(outcome.groups["g"].while_jobs_ran)
    assert group.while_jobs_ran.window_s > 0
    assert job_b.dedicated_from == "simulated"


def test_a_simulated_groups_shares_add_up_to_its_wall_time_with_moves_beside_leases() -> None:
    """With memory for both jobs' states, moves run beside the other job's lease (overlapped,
    staged): those are no switching time, and phases, overhead, switching and idle add up to
    the wall time (the group's table once summed to 134%)."""
    from timeslice.plan.simulator import GroupSpec

    a, b = jobs()
    best = plan([a, b], Layout(groups=("g",), memory_bytes=40), overheads=Overheads.zero())
    outcome = simulate(
        [Placement(a, "g", "g"), Placement(b, "g", "g", start_s=0.5)],
        groups={"g": GroupSpec(memory_bytes=40)},
        overheads=Overheads.zero(),
        record=True,
    )
    (group,) = to_report(outcome, best.assignments[0]).groups
    parts = (group.phase_s, group.overhead_s, group.switching_s, group.idle_s)
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(group.wall_s)


def test_write_timeline(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    result = plan(jobs(), Layout(groups=("g1", "g2")))
    best = result.assignments[0]
    from timeslice.plan.search import Planner

    outcome = Planner(jobs(), Layout(groups=("g1", "g2"))).timeline(best)
    rows_path, html_path = write_timeline(outcome, best, tmp_path / "plan.html")
    rows = json.loads(rows_path.read_text())
    assert {r["job"] for r in rows} == {"a", "b"}
    assert {"phase", "lease"} <= {r["kind"] for r in rows}
    assert all(r["end"] >= r["start"] for r in rows)
    page = html_path.read_text()
    assert "simulated by timeslice plan" in page
    assert "<title>timeslice plan · a simulated run (predicted from profiles, not measured)" in page
    assert "seconds from the start of the simulated run" in page
    assert "0.0% of 0.0 s while jobs ran" not in page and "% of " in page
    assert (tmp_path / "plotly.min.js").exists()
