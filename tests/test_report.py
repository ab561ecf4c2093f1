"""`timeslice report`: the figures on hand-built data, and end to end on two simulated jobs.

The end-to-end test runs two real `timeslice job worker` processes with the `simulated` workload
on one fresh group, then checks the report's busy utilization against the jobs' own phase
intervals (their processes' monotonic clocks), an account independent of the group's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from timeslice.activities.group_requests import start_group
from timeslice.connection import connect, connect_config
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.report import (
    JobReport,
    MissingDependencyError,
    Report,
    collect_report,
    format_html,
    format_text,
    group_report,
    human_bytes,
    job_report_from_result,
    timeline,
    write_report,
)
from timeslice.workflows.protocol import (
    GroupConfig,
    GroupStats,
    GroupStatus,
    HolderView,
    LeaseOutcome,
    LeaseRecord,
    SwitchRecord,
)
from timeslice.workflows.rl_protocol import EpochRecord, PhaseResult, RLJobResult

from tests.conftest import start_service, stop_process

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GIB = 2**30


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def lease(job: str, token: int, start: float, end: float) -> LeaseRecord:
    return LeaseRecord(
        job_id=job, token=token, start=at(start), end=at(end), outcome=LeaseOutcome.RELEASED
    )


def hand_built_status(holder: HolderView | None = None) -> GroupStatus:
    """A group 10 s old: job a held 0-2 s, a switch 2-2.5 s, job b held 3-5 s."""
    busy = 4.0
    return GroupStatus(
        group_id="g-hand",
        holder=holder,
        queue=[],
        resident_job="b",
        faulted_jobs={},
        utilization=busy / 10,
        wall_s=10.0,
        idle_s=10.0 - busy - 0.5,
        wait_p50_s=0.25,
        wait_p99_s=1.5,
        stats=GroupStats(
            created_at=T0,
            leases=2,
            released=2,
            switches=1,
            busy_s=busy,
            switching_s=0.5,
            bytes_moved=3 * GIB,
            wait_samples_s=[0.25, 1.5],
        ),
        history=[lease("a", 1, 0.0, 2.0), lease("b", 2, 3.0, 5.0)],
        switch_history=[
            SwitchRecord(from_job="a", to_job="b", start=at(2.0), end=at(2.5), bytes=3 * GIB)
        ],
    )


def phase(epoch: int, name: str, start: float, seconds: float, token: int | None) -> PhaseResult:
    return PhaseResult(
        epoch=epoch,
        phase=name,  # type: ignore[arg-type]
        metrics={},
        seconds=seconds,
        mono_start=start,
        mono_end=start + seconds,
        group_id="g-hand" if token else None,
        token=token,
    )


def hand_built_result() -> RLJobResult:
    records = [
        EpochRecord(
            epoch=e,
            reward_mean=0.5 + 0.1 * e,
            wait_s={"sample": 0.25, "train": 0.5},
            phase_s={"sample": 1.0, "rewards": 0.5, "train": 1.0},
            holds=[phase(e, "sample", 10.0 * e, 1.0, 1), phase(e, "train", 10.0 * e + 2, 1.0, 2)],
        )
        for e in range(2)
    ]
    return RLJobResult(
        job_id="a",
        epochs_done=2,
        stopped=False,
        last_checkpoint=None,
        rewinds=0,
        redone_epochs=0,
        records=records,
        rewards=[r.reward_mean for r in records],
        phase_s={"sample": 2.0, "rewards": 1.0, "train": 2.0},
        wait_s={"sample": 0.5, "train": 1.0},
    )


def hand_built_report() -> Report:
    return Report(
        generated_at=at(10.0),
        groups=[group_report(hand_built_status())],
        jobs=[job_report_from_result(hand_built_result(), wall_s=10.0)],
    )


# ---------------------------------------------------------------- pure: no server


def test_group_utilization_of_known_intervals_is_exact() -> None:
    g = group_report(hand_built_status())
    assert (g.busy, g.switching, g.idle) == (0.4, 0.05, 0.55)
    assert g.start == T0 and g.end == at(10.0)
    assert [(x.job_id, x.start, x.end) for x in g.leases] == [
        ("a", at(0), at(2)),
        ("b", at(3), at(5)),
    ]
    assert [(s.from_job, s.to_job, s.bytes) for s in g.switch_marks] == [("a", "b", 3 * GIB)]
    # The group's busy time is exactly its recorded leases here (none is cut off).
    assert sum((x.end - x.start).total_seconds() for x in g.leases) == g.busy_s


def test_lease_held_now_counts_as_busy_up_to_the_query() -> None:
    holder = HolderView(job_id="a", token=3, held_s=1.0, expires_in_s=19.0)
    g = group_report(hand_built_status(holder))
    assert (g.busy, g.switching, g.idle) == (0.5, 0.05, 0.45)
    assert g.leases[-1].model_dump(include={"job_id", "start", "end", "outcome"}) == {
        "job_id": "a",
        "start": at(9.0),
        "end": at(10.0),
        "outcome": "held",
    }
    assert g.holder == "a"


def test_report_time_extends_a_status_to_the_query() -> None:
    # The status runs to the group's last event (t = 10 s); queried at t = 12 s, the two
    # seconds since were idle, or, with a holder, held.
    g = group_report(hand_built_status(), now=at(12.0))
    assert (g.wall_s, g.busy_s, g.switching_s, g.idle_s) == (12.0, 4.0, 0.5, 7.5)
    assert g.end == at(12.0)
    holder = HolderView(job_id="a", token=3, held_s=1.0, expires_in_s=19.0)
    g = group_report(hand_built_status(holder), now=at(12.0))
    assert (g.wall_s, g.busy_s, g.idle_s) == (12.0, 7.0, 4.5)
    assert (g.leases[-1].start, g.leases[-1].end) == (at(9.0), at(12.0))
    # A query clock behind the group's never shortens the status.
    assert group_report(hand_built_status(), now=at(5.0)).wall_s == 10.0


def test_job_totals_and_slowdown_against_dedicated_time() -> None:
    job = job_report_from_result(hand_built_result(), wall_s=10.0)
    assert job.phase_s == {"sample": 2.0, "rewards": 1.0, "train": 2.0}
    assert job.wait_s == {"sample": 0.5, "train": 1.0} and job.waiting_s == 1.5
    assert job.dedicated_s == 5.0 and job.slowdown == 2.0
    assert (job.reward_first, job.reward_last) == (0.5, 0.6)
    assert JobReport(job_id="x", status="running", epochs_done=0).slowdown is None


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * GIB, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 GiB",
        "5.0 TiB",
    ]


def test_text_tables_are_aligned_and_carry_the_rows() -> None:
    text = format_text(hand_built_report())
    lines = text.splitlines()
    group_row = next(line for line in lines if line.startswith("g-hand"))
    assert group_row.split() == [
        "g-hand", "10.0", "40.0%", "5.0%", "55.0%", "2", "1", "3.0", "GiB", "0.250", "1.500",
    ]  # fmt: skip
    job_row = next(line for line in lines if line.startswith("a "))
    assert job_row.split() == [
        "a", "completed", "2", "2.00", "1.00", "2.00", "1.50", "10.0", "2.00x", "0.500", "→",
        "0.600",
    ]  # fmt: skip
    # Every line of a table is as wide as its header: the columns line up.
    header = next(i for i, line in enumerate(lines) if line.startswith("group "))
    assert len(lines[header]) == len(lines[header + 1]) == len(group_row)


def test_timeline_counts_seconds_from_the_first_lease() -> None:
    tl = timeline(hand_built_report())
    (row,) = tl.rows
    assert [(b.job_id, b.start, b.end) for b in row.leases] == [("a", 0.0, 2.0), ("b", 3.0, 5.0)]
    assert [(s.start, s.end) for s in row.switches] == [(2.0, 2.5)]
    assert list(tl.colours) == ["a", "b"] and len(set(tl.colours.values())) == 2
    assert tl.span_s == 5.0


def check_png(path: Path) -> tuple[int, int]:
    Image = pytest.importorskip("PIL.Image")  # comes with matplotlib

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
    assert width >= 600 and height >= 150
    return width, height


def check_html(path: Path, group_ids: list[str], job_ids: list[str]) -> str:
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    ElementTree.fromstring(svg)  # well-formed
    for name in [*group_ids, *job_ids]:
        assert name in page
    # Self-contained: no scripts, no external stylesheets, fonts or images.
    lowered = page.lower()
    for external in ("<script", "<link", "@import", "url(", 'src="', "https://"):
        assert external not in lowered, external
    return page


def test_malformed_ids_are_refused_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        asyncio.run(collect_report(None, groups=["no spaces"]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="invalid job id"):
        asyncio.run(collect_report(None, groups=[], jobs=["x/y"]))  # type: ignore[arg-type]


def test_write_report_on_hand_built_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = write_report(hand_built_report(), tmp_path / "out")
    check_png(files.png)
    page = check_html(files.html, ["g-hand"], ["a"])
    assert page.count("<rect") >= 3  # two leases and a switch (plus the legend)
    assert files.text.read_text(encoding="utf-8") == format_text(hand_built_report())


def test_empty_report_still_renders(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    empty = Report(generated_at=T0, groups=[], jobs=[])
    assert "none" in format_text(empty)
    files = write_report(empty, tmp_path)
    check_png(files.png)
    assert "<svg" in format_html(empty)


# ---------------------------------------------------------------- end to end

# Phases long enough that a lease's overhead is small next to them.
OPTIONS = {
    "sample_s": 0.4,
    "reward_s": 0.4,
    "train_s": 0.4,
    "state_bytes": 2 * GIB,
    "snapshot_s": 0.05,
}
EPOCHS = 3
# What a lease holds besides its phases (see the end-to-end test): about 0.1 s measured on a
# loaded 2-core machine; 0.3 s leaves room for a slower one.
LEASE_OVERHEAD_S = 0.3


@pytest.fixture
def job_workers(address: str, tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen]]:
    """Start `timeslice job worker` processes (simulated workload); all stop at the end."""
    procs: list[subprocess.Popen] = []

    def start(job_id: str) -> subprocess.Popen:
        proc = start_service(
            [
                "job", "worker", "--address", address, "--job-id", job_id,
                "--workload", "simulated", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                "--threads", "1",
            ],
            f"job {job_id} rank 0",
            tmp_path / f"{job_id}.log",
        )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc)


async def create_group(address: str, group: str) -> None:
    await start_group(await connect(connect_config(address)), GroupConfig(group_id=group))


async def until(probe: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Re-evaluate an async probe until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.1)  # a poll interval: visibility is eventually consistent
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_report_of_two_time_sliced_jobs(
    address: str, job_workers: Callable[[str], subprocess.Popen], group: str, tmp_path: Path
) -> None:
    jobs = [f"rep{k}-{uuid.uuid4().hex[:8]}" for k in "ab"]
    # The group exists before the job processes start: it idles while they come up, and the
    # report's window (and the check of its busy time below) counts that too.
    asyncio.run(create_group(address, group))
    for job in jobs:
        job_workers(job)

    async def go() -> tuple[list[RLJobResult], Report, Report]:
        client = await connect(connect_config(address))
        configs = [
            {
                "job_id": job,
                "workload": "simulated",
                "workload_options": OPTIONS,
                "sampler_group": group,
                "epochs": EPOCHS,
            }
            for job in jobs
        ]
        handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        named = await collect_report(client, groups=[group], jobs=jobs)

        async def discovered() -> Report | None:
            report = await collect_report(client)
            found_groups = {g.group_id for g in report.groups}
            found_jobs = {j.job_id for j in report.jobs}
            return report if group in found_groups and set(jobs) <= found_jobs else None

        return results, named, await until(discovered, "the group and jobs in visibility")

    results, report, everything = asyncio.run(go())
    (g,) = report.groups
    assert g.group_id == group and g.holder is None

    # Busy utilization, independently: the jobs' own GPU phase intervals (process monotonic
    # clocks) over the same window, the group's life up to the status query. Every phase ran
    # inside one of the group's leases, hence inside that window.
    holds = [h for r in results for rec in r.records for h in rec.holds if h.group_id == group]
    assert len(holds) == 2 * 2 * EPOCHS  # sample + train, per epoch, per job
    holds_busy_s = sum(h.mono_end - h.mono_start for h in holds)
    # Each phase lies within a lease of its job (matched by fencing token; a lease may carry
    # the train phase of one epoch on to the sampling of the next), so a lease's time is at
    # least its phases' time.
    by_token = {x.token: x for x in g.leases}
    phases_of: dict[int, float] = {}
    for h in holds:
        assert h.token is not None and by_token[h.token].job_id in jobs
        phases_of[h.token] = phases_of.get(h.token, 0.0) + h.mono_end - h.mono_start
    gaps = []
    for token, phases_s in phases_of.items():
        held = by_token[token]
        gaps.append((held.end - held.start).total_seconds() - phases_s)
    assert min(gaps) >= -1e-3, gaps
    # The group's busy time exceeds the phases' by what each lease holds besides its phases
    # (moving the job's state in and out counts as switching, not busy): the grant reaching
    # the job, the phase's dispatch to the job process and its release travelling back (a few
    # workflow round trips); for a lease carried from train to the next sampling, the round
    # trip in between; for the first lease of each job, preparing it. Measured at about 0.1 s
    # a lease on a loaded 2-core machine; LEASE_OVERHEAD_S a lease is the tolerance.
    assert g.lease_count == len(g.leases)
    tolerance = g.lease_count * LEASE_OVERHEAD_S / g.wall_s
    print(
        f"busy {g.busy:.4f}, from the phases {holds_busy_s / g.wall_s:.4f}, tolerance "
        f"{tolerance:.4f}; {(g.busy_s - holds_busy_s) / g.lease_count:.3f} s a lease besides "
        f"its phases over {g.lease_count} leases"
    )
    assert holds_busy_s / g.wall_s <= g.busy <= holds_busy_s / g.wall_s + tolerance
    assert g.idle > 0  # at least while the job processes started
    assert g.busy + g.switching + g.idle == pytest.approx(1.0, abs=1e-9)
    # Every move of state is on the timeline: the switch marks add up to the group's totals.
    assert g.switching > 0 and g.bytes_moved > 0
    assert g.bytes_moved == sum(s.bytes for s in g.switch_marks)
    marked_s = sum((s.end - s.start).total_seconds() for s in g.switch_marks)
    assert marked_s == pytest.approx(g.switching_s, abs=1e-3)
    assert {s.bytes for s in g.switch_marks} <= {OPTIONS["state_bytes"], 2 * OPTIONS["state_bytes"]}
    assert g.wait_p50_s is not None and g.wait_p99_s is not None
    assert 0 <= g.wait_p50_s <= g.wait_p99_s

    by_job = {j.job_id: j for j in report.jobs}
    assert set(by_job) == set(jobs)
    for result in results:
        j = by_job[result.job_id]
        assert j.status == "completed" and j.epochs_done == EPOCHS
        assert j.phase_s["sample"] == pytest.approx(EPOCHS * 0.4, rel=0.25)
        assert j.reward_first == 0.5 and j.reward_last == pytest.approx(1 - 0.5 * 0.9**2)
        assert j.waiting_s == pytest.approx(sum(sum(r.wait_s.values()) for r in result.records))
        # Time-sliced with another job of the same profile, each job takes longer than alone.
        assert j.slowdown is not None and j.slowdown > 1.0

    assert {group} <= {x.group_id for x in everything.groups}

    text = format_text(report)
    print(text)
    assert group in text and all(job in text for job in jobs)
    assert f"{g.busy:.1%}" in text and "GiB" in text
    try:
        files = write_report(report, tmp_path / "report")
    except MissingDependencyError:  # no matplotlib: text and HTML are written all the same
        assert importlib.util.find_spec("matplotlib") is None
    else:
        check_png(files.png)
    check_html(tmp_path / "report" / "report.html", [group], jobs)
    assert (tmp_path / "report" / "report.txt").read_text(encoding="utf-8") == text

    # The same through the command line.
    cli = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "report", "--address", address,
         "--group", group, *(arg for job in jobs for arg in ("--job", job)),
         "--out", str(tmp_path / "cli")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert group in cli.stdout and all(job in cli.stdout for job in jobs)
    for name in ("report.txt", "report.html", "timeline.png"):
        assert (tmp_path / "cli" / name).stat().st_size > 0
