"""`timeslice report` end to end: two simulated RL jobs time-sliced on one group.

Two real `timeslice job worker` processes with the `simulated` workload share one fresh group;
the report, read back from Temporal (the group's status, the jobs' histories), must account
for every phase the jobs themselves recorded, its shares must add up, and the command line must
write the same files. The figures on hand-built data: tests/unit/test_report_figures.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from timeslice.activities.group_requests import start_group
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import GroupConfig
from timeslice.protocol.rl_job import RLJobResult
from timeslice.report import Report, collect_report, format_text, write_report
from timeslice.transport.connection import connect, connect_config

from tests.conftest import ARTIFACTS, start_service, stop_process
from tests.helpers import run_cli

GIB = 2**30


def test_malformed_ids_are_refused_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError, match="invalid group id"):
        asyncio.run(collect_report(None, groups=["no spaces"]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="invalid job id"):
        asyncio.run(collect_report(None, groups=[], jobs=["x/y"]))  # type: ignore[arg-type]


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
        # One job shown (`--job`): the group's figures still count the other's phases, not
        # its leases whole as an embedded client's.
        one = await collect_report(client, groups=[group], jobs=jobs[:1])
        (all_g,), (one_g,) = named.groups, one.groups
        assert one_g.phase_s == pytest.approx(all_g.phase_s, abs=1e-3)
        assert [j.job_id for j in one.jobs] == jobs[:1]
        assert jobs[1] not in {lane.name for lane in one.lanes}

        async def discovered() -> Report | None:
            report = await collect_report(client)
            found_groups = {g.group_id for g in report.groups}
            found_jobs = {j.job_id for j in report.jobs}
            return report if group in found_groups and set(jobs) <= found_jobs else None

        return results, named, await until(discovered, "the group and jobs in visibility")

    results, report, everything = asyncio.run(go())
    (g,) = report.groups
    assert g.group_id == group and g.holder is None

    # Phase time, independently: the jobs' own GPU phase intervals as their results carry them
    # (process monotonic clocks). The report read the same phases from the jobs' histories,
    # every run of them: it must find every one.
    holds = [h for r in results for rec in r.records for h in rec.holds if h.group_id == group]
    assert len(holds) == 2 * 2 * EPOCHS  # sample + train, per epoch, per job
    holds_s = sum(h.mono_end - h.mono_start for h in holds)
    assert g.phase_s == pytest.approx(holds_s, abs=1e-4)  # datetimes hold microseconds
    # The shares of the group's wall time add up, and each is what it says.
    parts = (g.phase_s, g.overhead_s, g.switching_s, g.idle_s)
    assert sum(g.fraction(x) for x in parts) == pytest.approx(1.0, abs=1e-9)
    assert all(x >= 0 for x in parts) and g.idle_s > 0  # idle at least while jobs started
    # Lease overhead: held with no phase running — the grant reaching the job, a lease kept
    # from train to the next sampling, each job's first lease while it was prepared. About
    # 0.1 s a lease measured on a loaded 2-core machine; LEASE_OVERHEAD_S is the tolerance.
    print(f"overhead {g.overhead_s / g.leases:.3f} s a lease over {g.leases} leases")
    assert 0 < g.overhead_s <= g.leases * LEASE_OVERHEAD_S
    assert g.switching_s > 0 and g.bytes_moved > 0 and g.switches > 0
    assert g.wait_p50_s is not None and g.wait_p99_s is not None

    by_job = {j.job_id: j for j in report.jobs}
    assert set(by_job) == set(jobs)
    for result in results:
        j = by_job[result.job_id]
        assert j.status == "completed" and j.epochs_done == EPOCHS and j.groups == [group]
        own = [h for rec in result.records for h in rec.holds]
        for name in ("sample", "train"):
            expected = sum(h.mono_end - h.mono_start for h in own if h.phase == name)
            assert j.phase_s[name] == pytest.approx(expected, abs=1e-4)
        assert j.phase_s["rewards"] == pytest.approx(EPOCHS * OPTIONS["reward_s"], rel=0.25)
        assert j.waiting_s == pytest.approx(sum(h.waited_s for h in own), abs=1e-4)
        assert j.reward_first == 0.5 and j.reward_last == pytest.approx(1 - 0.5 * 0.9**2)
        # No run alone was measured here: no slowdown is claimed (the demo measures one).
        assert j.slowdown is None and j.wall_s is not None and j.wall_s > j.own_s

    # The lanes: one per job, then one per group; a job's lane holds every phase it ran.
    assert [(lane.name, lane.kind) for lane in report.lanes] == [
        *((job, "job") for job in jobs),
        (group, "group"),
    ]
    for lane in report.lanes[:2]:
        assert sum(1 for s in lane.spans if s.kind in ("sample", "rewards", "train")) == 3 * EPOCHS
    assert {group} <= {x.group_id for x in everything.groups}

    text = format_text(report)
    print(text)
    assert group in text and all(job in text for job in jobs)
    assert f"{g.fraction(g.phase_s):.1%}" in text and "GiB" in text
    # Kept as test artifacts, to look at.
    files = write_report(report, ARTIFACTS / "report")
    assert files.png.read_bytes().startswith(b"\x89PNG")
    assert files.text.read_text(encoding="utf-8") == text
    trace = json.loads(files.trace.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {*jobs, group}
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(report.spans)

    # The same through the command line, with a trace file of its own.
    cli = run_cli(
        "report", "--address", address, "--group", group,
        *(arg for job in jobs for arg in ("--job", job)),
        "--out", str(tmp_path / "cli"), "--trace", str(tmp_path / "cli.trace.json"), timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert group in cli.stdout and all(job in cli.stdout for job in jobs)
    for name in ("report.txt", "report.html", "timeline.png", "trace.json"):
        assert (tmp_path / "cli" / name).stat().st_size > 0
    assert json.loads((tmp_path / "cli.trace.json").read_text())["traceEvents"]


def test_report_reads_a_job_ids_latest_run_and_says_why_it_failed(
    address: str, job_workers: Callable[[str], subprocess.Popen], group: str
) -> None:
    """A job id started again after its run ended is another run: the report shows the
    latest alone (its status, epochs and phases, never mixed with the first's), says there
    was an earlier one, and gives a failed run's reason rather than its last phase."""
    job = f"twice-{uuid.uuid4().hex[:8]}"
    job_workers(job)
    fast = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05}

    async def go() -> Report:
        client = await connect(connect_config(address))
        config = {"job_id": job, "workload": "simulated", "workload_options": fast,
                  "sampler_group": group, "epochs": 2}  # fmt: skip
        first = await start_rl_job(client, parse_job_config(config))
        done = await first.result()
        assert done.epochs_done == 2
        first_phases.extend(r.phase_s[p] for r in done.records for p in ("sample", "train"))
        # Past `job start`'s guard (the temporal CLI): a second run, which no process serves.
        second = await client.start_workflow(
            "RLJobWorkflow",
            {**config, "epochs": 3, "process_wait_s": 2},
            id=first.id,
            task_queue="timeslice",
        )
        await asyncio.gather(second.result(), return_exceptions=True)
        return await collect_report(client, groups=[group], jobs=[job])

    first_phases: list[float] = []
    report = asyncio.run(go())
    (j,) = report.jobs
    assert (j.status, j.epochs_done, j.epochs, j.phase_s) == ("failed", 0, 3, {})
    # The group's figures count the first run's GPU phases, which ran on it, as phases (not
    # as leases with no phase running) though the job's own figures leave that run out.
    (g,) = report.groups
    assert len(first_phases) == 4
    assert g.phase_s == pytest.approx(sum(first_phases), abs=0.005)
    assert j.failure is not None and j.failure.startswith("NoJobProcess: job " + job)
    assert j.earlier_runs == 1 and j.note is None  # not "phase: waiting for job processes"
    text = format_text(report)
    assert f"failed: NoJobProcess: job {job}: no job process served it" in text
    assert "the latest run of this job id; 1 earlier run(s) left out" in text
