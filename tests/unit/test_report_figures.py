"""The report's figures, lanes, tables, trace and files, on hand-built data (no server)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from timeslice.protocol.group import (
    GroupStats,
    GroupStatus,
    HolderView,
    LeaseOutcome,
    LeaseRecord,
    SnapshotReport,
    SwitchRecord,
)
from timeslice.protocol.rl_job import PhaseResult
from timeslice.report import (
    Lane,
    Report,
    Span,
    format_text,
    human_bytes,
    trace_events,
    write_html,
    write_report,
)
from timeslice.report.figures import (
    JobRecord,
    build_lanes,
    group_figures,
    job_figures,
    job_spans,
    status_with_utilization,
)

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
GIB = 2**30
# The job process's clocks: monotonic 1000.0 is T0 on the wall.
OFFSET = T0.timestamp() - 1000.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def lease(job: str, token: int, start: float, end: float) -> LeaseRecord:
    return LeaseRecord(
        job_id=job, token=token, start=at(start), end=at(end), outcome=LeaseOutcome.RELEASED
    )


def status(holder: HolderView | None = None, *, client_lease: bool = False) -> GroupStatus:
    """A group 10 s old: job a held 0-2 s (its phase ran 0.5-1.5 s), a switch 2-2.5 s, job b
    held 3-5 s (an embedded client, or an RL job whose phase ran 3-4 s)."""
    return GroupStatus(
        group_id="g",
        holder=holder,
        queue=[],
        resident_job="b",
        faulted_jobs={},
        held_share=0.4,
        wall_s=10.0,
        idle_s=5.5,
        wait_p50_s=0.25,
        wait_p99_s=1.5,
        stats=GroupStats(
            created_at=T0,
            leases=2,
            released=2,
            switches=1,
            busy_s=4.0,
            switching_s=0.5,
            bytes_moved=3 * GIB,
            wait_samples_s=[0.25, 1.5],
        ),
        history=[lease("a", 1, 0.0, 2.0), lease("b", 2, 3.0, 5.0)],
        switch_history=[
            SwitchRecord(from_job="a", to_job="b", start=at(2.0), end=at(2.5), bytes=3 * GIB)
        ],
    )


def phase(
    epoch: int, name: str, start: float, seconds: float, *, asked: float | None = None,
    restored_s: float = 0.0, group: str | None = "g",
) -> PhaseResult:  # fmt: skip
    leased = name != "rewards"
    return PhaseResult(
        epoch=epoch,
        phase=name,  # type: ignore[arg-type]
        metrics={},
        seconds=seconds,
        mono_start=1000.0 + start,
        mono_end=1000.0 + start + seconds,
        wall_offset_s=OFFSET,
        group_id=group if leased else None,
        token=1 if leased else None,
        asked_mono=None if asked is None else 1000.0 + asked,
        granted_mono=None if asked is None else 1000.0 + start - restored_s,
        restored=[SnapshotReport(job_id="a", backend="t", mode="m", bytes=5, seconds=restored_s)]
        if restored_s
        else [],
    )


def job_a() -> JobRecord:
    """Job a: sampled 0.5-1.5 s after waiting 0.2-0.4 s and restoring 0.4-0.5 s, rewards
    1.5-2.5 s; epoch 1's train 6-7 s."""
    phases = [
        phase(0, "sample", 0.5, 1.0, asked=0.2, restored_s=0.1),
        phase(0, "rewards", 1.5, 1.0),
        phase(1, "train", 6.0, 1.0, asked=6.0),
    ]
    return JobRecord(
        job_id="a",
        status="completed",
        epochs_done=2,
        epochs=2,
        groups=["g"],
        phases=phases,
        completed_at=[None] * len(phases),
        rewards=[0.1, 0.4],
        started=at(0.0),
        ended=at(8.0),
    )


def test_job_lane_and_figures_come_from_the_phases_own_intervals():
    job = job_a()
    spans = job_spans(job)
    kinds = [(s.kind, s.start, s.end) for s in spans]
    assert kinds == [
        ("waiting", at(0.2), at(0.4)),
        ("switching", at(0.4), at(0.5)),
        ("sample", at(0.5), at(1.5)),
        ("rewards", at(1.5), at(2.5)),
        ("waiting", at(6.0), at(6.0)),
        ("train", at(6.0), at(7.0)),
    ]
    figures = job_figures(job, spans)
    assert figures.phase_s == {"sample": 1.0, "rewards": 1.0, "train": 1.0}
    assert figures.waiting_s == pytest.approx(0.2)
    assert figures.switching_s == pytest.approx(0.1)
    assert figures.wall_s == 8.0 and figures.own_s == 3.0
    # No run alone was measured: no slowdown (its own phase time is no run alone).
    assert figures.slowdown is None
    assert job_figures(job, spans, dedicated_s=4.0).slowdown == 2.0  # measured baseline
    assert (figures.reward_first, figures.reward_last) == (0.1, 0.4)


def test_a_phase_without_a_wall_anchor_is_placed_by_its_activity_completion():
    job = job_a()
    job.phases = [job.phases[1].model_copy(update={"wall_offset_s": None})]
    job.completed_at = [at(2.5)]  # the server recorded the completion as the phase ended
    (rewards,) = job_spans(job)
    assert (rewards.start, rewards.end) == (at(1.5), at(2.5))


def a_sample_and_b_train() -> list[Span]:
    """Two RL jobs' phases on g: a's sample (0.5-1.5 s) and b's train (3-4 s)."""
    a_phases = [
        s for s in job_spans(job_a()) if s.kind in ("sample", "train") and s.group_id == "g"
    ]
    b_phase = job_spans(
        JobRecord(job_id="b", status="completed", phases=[phase(0, "train", 3.0, 1.0)],
                  completed_at=[None])
    )  # fmt: skip
    return [a_phases[0], *b_phase]


def test_group_shares_add_up_and_phase_time_is_what_the_phases_ran():
    g, spans = group_figures(status(), None, a_sample_and_b_train(), {"a", "b"})
    # a's sample (1 s) and b's train (1 s) ran inside leases of 4 s: 2 s of overhead.
    assert (g.phase_s, g.overhead_s, g.switching_s, g.idle_s) == (2.0, 2.0, 0.5, 5.5)
    assert g.fraction(g.phase_s) + g.fraction(g.overhead_s) + g.fraction(g.switching_s) + (
        g.fraction(g.idle_s)
    ) == pytest.approx(1.0)
    assert g.utilization == 0.2
    assert [(s.kind, s.job_id, s.start, s.end) for s in spans] == [
        ("lease", "a", at(0), at(2)),
        ("lease", "b", at(3), at(5)),
        ("switching", "b", at(2.0), at(2.5)),
        ("idle", None, at(2.5), at(3.0)),  # the lane shows the table's idle time too
        ("idle", None, at(5.0), at(10.0)),
    ]


def test_the_group_reads_in_both_windows_by_the_one_definition(tmp_path: Path):
    job = job_a()
    phases = [s for s in job_spans(job) if s.kind in ("sample", "train") and s.group_id == "g"]
    g, _ = group_figures(status(), None, phases, {"a"})  # b: a client, its lease 3-5 s a phase
    # Phases: a's sample 0.5-1.5 s, b's lease 3-5 s, a's train 6-7 s: 4 s of the 10 s since
    # the group was created, of the 6.5 s from the first phase's start to the last one's end.
    assert (g.active_start, g.active_end) == (at(0.5), at(7.0))
    assert str(g.since_created) == "40.0% of 10.0 s since the group was created"
    assert str(g.while_jobs_ran) == "61.5% of 6.5 s while jobs ran"
    assert g.utilization == g.since_created.share
    text = format_text(Report(generated_at=at(10.0), groups=[g], jobs=[], lanes=[], problems=[]))
    assert "  g: 40.0% of 10.0 s since the group was created; 61.5% of 6.5 s while jobs ran" in text
    # A simulated run (`timeslice plan --html`) has no group life before its first phase.
    simulated = Report(
        generated_at=at(10.0), groups=[g], jobs=[], lanes=[], problems=[], simulated=True
    )
    page = write_html(simulated, tmp_path / "page.html").read_text()
    for made in (format_text(simulated), page):
        assert "61.5% of 6.5 s while jobs ran" in made
        assert "since the group was created" not in made


def test_the_status_json_says_the_reports_utilization_and_the_held_share_apart():
    """`timeslice status --json`: ``utilization`` is the report's (GPU phases, 2 of 10 s), not
    the share of the group's life it was held (4 of 10 s), which is ``held_share``."""
    read = status()
    g, _ = group_figures(read, None, a_sample_and_b_train(), {"a", "b"})
    said = json.loads(status_with_utilization(read, g).model_dump_json())
    assert said["utilization"] == g.utilization == 0.2
    assert said["utilization_while_jobs_ran"] == g.while_jobs_ran.share == pytest.approx(2 / 3.5)
    assert said["held_share"] == 0.4
    assert GroupStatus.model_validate(said).utilization == 0.2  # what it prints reads back
    # The group itself answers no utilization (it sees leases), and advancing a status to a
    # later reading drops one filled in: the phases since are not known.
    assert read.utilization is None
    advanced = GroupStatus.model_validate({**said, "as_of": at(10.0)}).advanced_to(at(20.0))
    assert advanced.utilization is None and advanced.utilization_while_jobs_ran is None


def test_a_status_from_a_group_before_the_rename_reads_its_utilization_as_held_share():
    """A running group of the previous release answers its held share as ``utilization`` (and
    sends no ``held_share``): it parses, as the held share, never as GPU-phase utilization."""
    old = status().model_dump(mode="json", exclude={"utilization", "utilization_while_jobs_ran"})
    old["utilization"] = old.pop("held_share")
    for read in (GroupStatus.model_validate(old), GroupStatus.model_validate_json(json.dumps(old))):
        assert read.held_share == 0.4 and read.utilization is None
    with pytest.raises(ValueError, match="held_share"):
        GroupStatus.model_validate({k: v for k, v in old.items() if k != "utilization"})


def test_a_status_with_a_clock_is_advanced_the_clients_way():
    """The report brings a status to its reading by ``GroupStatus.advanced_to``, as the
    clients and `timeslice status` do: one figure for the same moment."""
    holder = HolderView(job_id="a", token=3, held_s=1.0, expires_in_s=None)
    # Held 4 s before, and 1 s by the holder now: the group's own share is 5 of 10 s.
    read = status(holder).model_copy(update={"as_of": at(10.0), "held_share": 0.5})
    g, _ = group_figures(read, at(12.0), [], set())
    advanced = read.advanced_to(at(12.0))
    assert (g.wall_s, g.end) == (advanced.wall_s, at(12.0))
    assert g.phase_s + g.overhead_s == pytest.approx(advanced.held_share * advanced.wall_s)


def test_a_client_lease_is_all_phase():
    job = job_a()
    phases = [s for s in job_spans(job) if s.kind == "sample"]
    g, _ = group_figures(status(), None, phases, {"a"})  # b reports no phases: a client
    assert (g.phase_s, g.overhead_s) == (3.0, 1.0)


def test_a_lease_held_now_counts_up_to_the_query():
    holder = HolderView(job_id="a", token=3, held_s=1.0, expires_in_s=19.0)
    g, spans = group_figures(status(holder), at(12.0), [], set())
    # Held 9-10 s by the group's last event, and 10-12 s since: 7 s busy, all client leases.
    assert (g.wall_s, g.phase_s, g.overhead_s, g.idle_s) == (12.0, 7.0, 0.0, 4.5)
    (held,) = [s for s in spans if s.label.endswith("held now")]
    assert (held.start, held.end) == (at(9.0), at(12.0))
    assert g.holder == "a"
    # A query clock behind the group's never shortens the status.
    assert group_figures(status(), at(5.0), [], set())[0].wall_s == 10.0


def report() -> Report:
    job = job_a()
    jspans = job_spans(job)
    g, gspans = group_figures(status(), at(10.0), [s for s in jspans if s.group_id], {"a"})
    lanes = build_lanes(
        [Lane(name="a", kind="job", spans=jspans)], [Lane(name="g", kind="group", spans=gspans)]
    )
    return Report(generated_at=at(10.0), groups=[g], jobs=[job_figures(job, jspans)], lanes=lanes)


def test_text_tables_name_every_figure_and_line_up():
    text = format_text(report())
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("g "))
    # 10 s: a's two phases (1 s each) and b's client lease (2 s) fill the 4 s held.
    assert row.split()[:6] == ["g", "10.0", "40.0%", "0.0%", "5.0%", "55.0%"]
    header = next(i for i, line in enumerate(lines) if line.startswith("group "))
    assert len(lines[header]) == len(lines[header + 1]) == len(row)
    job = next(line for line in lines if line.startswith("a "))
    assert job.split()[:11] == [
        "a", "completed", "2/2", "1.00", "1.00", "1.00", "0.20", "0.10", "8.0", "-", "-",
    ]  # fmt: skip
    assert "slowdown = wall time / the same job's wall time alone, only where" in text


def test_a_slowdown_says_its_baseline_and_a_failure_its_reason():
    job = job_a()
    job.status, job.failure, job.earlier_runs = "failed", "InvalidConfig: bad lr", 1
    spans = job_spans(job)
    measured = job_figures(job, spans, dedicated_s=4.0)
    text = format_text(Report(generated_at=at(10.0), groups=[], jobs=[measured], lanes=[]))
    row = next(line for line in text.splitlines() if line.startswith("a "))
    assert row.split()[9:11] == ["4.0", "2.00x"]
    assert "alone: 4.0 s measured" in text
    assert "failed: InvalidConfig: bad lr" in text
    assert "the latest run of this job id; 1 earlier run(s) left out" in text
    simulated = measured.model_copy(update={"dedicated_from": "simulated"})
    assert "alone: 4.0 s simulated" in format_text(
        Report(generated_at=at(10.0), groups=[], jobs=[simulated], lanes=[])
    )


def test_the_picture_legend_lists_only_the_kinds_drawn():
    from timeslice.report.picture import legend_kinds

    r = report()
    drawn = {s.kind for s in r.spans}
    assert set(legend_kinds(r)) == drawn - {"lease"}
    assert legend_kinds(Report(generated_at=T0, groups=[], jobs=[])) == []


def test_picture_and_table_cover_one_window_and_the_idle_time_shows():
    """The picture, the page and the trace draw the window the group figures cover (the
    group's creation to the report), and the group lane's idle bars add up to the table's
    idle share."""
    from timeslice.report.picture import bars

    r = report()
    (g,) = r.groups
    assert r.window == (g.start, g.end) == (T0, at(10.0))
    lane = next(lane for lane in r.lanes if lane.kind == "group")
    idle = [(start, width) for kind, start, width in bars(lane, r.window[0]) if kind == "idle"]
    assert idle == [(2.5, 0.5), (5.0, 5.0)]
    assert sum(width for _, width in idle) == pytest.approx(g.idle_s)
    row = next(line for line in format_text(r).splitlines() if line.startswith("g "))
    assert row.split()[5] == f"{sum(w for _, w in idle) / g.wall_s:.1%}"  # "55.0%"
    assert trace_events(r)["otherData"]["origin"] == r.window[0].isoformat()


def test_a_group_without_its_first_leases_is_drawn_idle_from_its_oldest_record():
    shed = status()
    shed.stats.leases = 5  # three earlier leases are no longer kept: their gaps are unknown
    _, spans = group_figures(shed, None, [], set())
    idle = [(s.start, s.end) for s in spans if s.kind == "idle"]
    assert idle == [(at(2.5), at(3.0)), (at(5.0), at(10.0))]
    # Nothing kept at all: no idle bar (the table still has the idle time, from the totals).
    bare = shed.model_copy(update={"history": [], "switch_history": []})
    assert group_figures(bare, None, [], set())[1] == []


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * GIB, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 GiB",
        "5.0 TiB",
    ]


def test_trace_has_a_track_per_lane_and_the_same_intervals():
    r = report()
    trace = json.loads(json.dumps(trace_events(r)))  # plain JSON, as written
    names = {
        (e["pid"], e["args"]["name"])
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert names == {(1, "a"), (2, "g")}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(r.spans)
    origin = min(s.start for s in r.spans)
    expected = sorted(
        (round((s.start - origin).total_seconds() * 1e6, 1), round(s.seconds * 1e6, 1))
        for s in r.spans
    )
    assert sorted((e["ts"], e["dur"]) for e in complete) == expected
    sample = next(e for e in complete if e["cat"] == "sample")
    assert sample["args"]["epoch"] == 0 and sample["args"]["job_id"] == "a"


def test_files_are_written_and_the_page_is_self_contained(tmp_path: Path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("plotly")
    files = write_report(report(), tmp_path / "out")
    assert files.png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert files.text.read_text() == format_text(report())
    assert json.loads(files.trace.read_text())["traceEvents"]
    page = files.html.read_text()
    assert page.startswith("<!doctype html>") and "timeline" in page
    # plotly.js is written once beside the page and loaded from there: the page loads
    # nothing else, and nothing from the network.
    scripts = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", page)
    assert scripts == ["plotly.min.js"]
    assert not re.search(r"<link\b|@import|https?://[^\s\"]*\.js", page)
    assert (tmp_path / "out" / "plotly.min.js").stat().st_size > 1_000_000
    assert len(page) < 100_000  # its own data, not plotly.js (4.8 MB)
    assert "a (job)" in page and "g (group)" in page


def test_an_empty_report_renders(tmp_path: Path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("plotly")
    empty = Report(generated_at=T0, groups=[], jobs=[])
    assert "none" in format_text(empty)
    files = write_report(empty, tmp_path)
    assert files.png.stat().st_size > 1000 and files.html.stat().st_size > 1000


def test_carried_leases_show_in_the_lanes_figures_and_text():
    """A train that asked the group to carry its lease into the next sample: its label says
    the group's answer, the job counts it, and the group's line says who carries into what."""
    job = job_a()
    kept = phase(0, "train", 2.5, 0.5).model_copy(
        update={"kept": True, "carry": "carrying into sample"}
    )
    handed = phase(1, "train", 6.0, 1.0).model_copy(
        update={"released": True, "carry": "fifo: 1 waiting"}
    )
    job.phases = [job.phases[0], kept, handed]
    job.completed_at = [None] * 3
    spans = job_spans(job)
    labels = [s.label for s in spans if s.kind == "train"]
    assert labels == [
        "train on g · kept: carrying into sample",
        "train on g · handed on: fifo: 1 waiting",
    ]
    figures = job_figures(job, spans)
    assert (figures.carries_asked, figures.carries_kept) == (2, 1)
    holder = HolderView(job_id="a", token=3, held_s=1.0, expires_in_s=19.0, waiting=1,
                        carrying_into="sample")  # fmt: skip
    carried = status(holder)
    carried.stats.carried = 4
    g, _ = group_figures(carried, at(10.0), [], set())
    assert (g.carried, g.carrying_into) == (4, "sample")
    text = format_text(Report(generated_at=at(10.0), groups=[g], jobs=[figures], lanes=[]))
    assert "held by a: carrying into sample" in text
    assert "4 leases carried past waiters into their next phase" in text
    assert "lease kept into the next phase 1 of 2 times asked" in text


def test_preemptions_show_in_the_figures_the_text_and_the_status():
    from timeslice.cli.main import format_status

    preempted = status()
    quiet, _ = group_figures(preempted, at(10.0), [], set())
    assert "preempted" not in format_text(
        Report(generated_at=at(10.0), groups=[quiet], jobs=[], lanes=[])
    )
    preempted.stats.preemptions = 1
    g, _ = group_figures(preempted, at(10.0), [], set())
    assert g.preemptions == 1
    text = format_text(Report(generated_at=at(10.0), groups=[g], jobs=[], lanes=[]))
    assert "g: 1 preempted (a lease ran out without yielding" in text
    assert "preemptions 1," in format_status(preempted)
