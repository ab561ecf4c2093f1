"""Async RL jobs end to end: AsyncRLJobWorkflow on the control worker, a real job process.

Every job process here is a real `timeslice job worker` subprocess running the `simulated`
workload in its async mode; jobs start from the SDK, the `temporal` CLI or `timeslice job start`
against the session's dev server. The simulated workload's checkpoint lists every training step
the model holds (step, batch, weights version): what "each step applied once" is read from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Worker
from timeslice.cli.server import temporal_binary
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_any_job_config, start_any_rl_job
from timeslice.protocol.async_rl_job import AsyncRLJobProgress, AsyncRLJobResult
from timeslice.protocol.group import GRANT_SIGNAL, HolderView, group_workflow_id, job_task_queue
from timeslice.protocol.rl_job import (
    DESCRIBE_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    DescribeInput,
    DescribeResult,
    rl_job_workflow_id,
)
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, stop_process
from tests.helpers import (
    assert_the_phase_ended_before_the_lease_went_back,
    cancel_in_phase,
    run_cli,
    wait_for,
)

SIZE = 1 << 20
# The trainer is the slower: batches queue up, and the staleness bound is what holds them back.
PIPELINE = {"sample_s": 0.05, "reward_s": 0.02, "train_s": 0.15, "sync_bytes": SIZE}


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def job_worker(address: str, tmp_path: Path, checkpoints: Path) -> Iterator[Callable[..., Any]]:
    procs: list[subprocess.Popen] = []

    def start(job_id: str, workload: str = "simulated") -> subprocess.Popen:
        proc = start_service(
            ["job", "worker", "--address", address, "--job-id", job_id, "--workload", workload,
             "--checkpoint-dir", str(checkpoints), "--threads", "1"],
            f"job {job_id} rank 0",
            tmp_path / f"{job_id}.log",
        )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop_process(proc)


def job_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def run(coro_fn: Callable[[Client], Any], address: str) -> Any:
    async def main() -> Any:
        return await coro_fn(await connect(connect_config(address)))

    return asyncio.run(main())


def async_config(job: str, **extra: Any) -> dict[str, Any]:
    return {
        "mode": "async",
        "job_id": job,
        "workload": "simulated",
        "workload_options": PIPELINE,
        "sampler_group": f"s-{job}",
        "trainer_group": f"t-{job}",
        "epochs": 12,
        "checkpoint_every": 4,
        "max_staleness": 2,
        "sync_every": 2,
        **extra,
    }


def start(address: str, config: dict[str, Any]) -> None:
    async def go(client: Client) -> None:
        await start_any_rl_job(client, parse_any_job_config(config))

    run(go, address)


def result(address: str, job: str) -> AsyncRLJobResult:
    async def go(client: Client) -> AsyncRLJobResult:
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=AsyncRLJobResult)
        return await handle.result()

    return run(go, address)


def progress(address: str, job: str) -> AsyncRLJobProgress:
    async def go(client: Client) -> AsyncRLJobProgress:
        handle = client.get_workflow_handle(rl_job_workflow_id(job))
        return await handle.query("progress", result_type=AsyncRLJobProgress)

    return run(go, address)


def handler_descriptions(address: str, job: str) -> dict[str, str]:
    """The job workflow's signals and queries, with their descriptions, as the server's
    metadata query answers them (built-in queries left out)."""

    async def go(client: Client) -> WorkflowMetadata:
        handle = client.get_workflow_handle(rl_job_workflow_id(job))
        return await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)

    definition = run(go, address).definition
    handlers = [*definition.signal_definitions, *definition.query_definitions]
    return {h.name: h.description for h in handlers if not h.name.startswith("__")}


def applied_steps(done: AsyncRLJobResult) -> list[list[int]]:
    """(step, batch, weights version) of every step the final model holds, from its checkpoint."""
    assert done.last_checkpoint is not None
    assert done.last_checkpoint.epochs_done == done.epochs_done
    saved = Path(done.last_checkpoint.path) / "rank-0" / "simulated.json"
    return json.loads(saved.read_text())["applied"]


def assert_every_step_once(done: AsyncRLJobResult, steps: int) -> None:
    assert done.epochs_done == steps and not done.stopped
    applied = applied_steps(done)
    assert [s for s, _, _ in applied] == list(range(steps)), "a step missing or applied twice"
    batches = [b for _, b, _ in applied]
    assert len(set(batches)) == steps, f"a batch trained on twice: {batches}"
    assert all(b < done.next_batch for b in batches)
    # The workflow's records say the same as the model.
    assert [(r.epoch, r.batch, r.weights_version) for r in done.records] == [
        tuple(a) for a in applied[-len(done.records) :]
    ]
    # Every batch id drawn was trained on once — by a step the model holds, or by one a rewind
    # undid — or dropped and counted.
    assert done.next_batch == steps + done.redone_epochs + done.dropped_batches


def test_async_job_never_exceeds_its_staleness_and_overlaps_sampler_and_trainer(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("async")
    job_worker(job)
    start(address, async_config(job))
    done = result(address, job)
    assert_every_step_once(done, 12)
    assert done.rewinds == 0 and done.dropped_batches == 0 and done.stale_dropped == 0
    staleness = [r.staleness for r in done.records]
    assert all(0 <= s <= 2 for s in staleness), staleness
    assert [r.epoch - r.weights_version for r in done.records] == staleness
    assert sum(done.staleness_counts) == 12 and len(done.staleness_counts) <= 3
    # It ran asynchronously: batches were sampled with weights older than the step's, and the
    # sampler held its group while the trainer held its own.
    assert max(staleness) >= 1, "every batch was fresh: the sampler never ran ahead"
    samples = [h for r in done.records for h in r.holds if h.phase == "sample"]
    trains = [h for r in done.records for h in r.holds if h.phase == "train"]
    assert {h.group_id for h in samples} == {f"s-{job}"}
    assert {h.group_id for h in trains} == {f"t-{job}"}
    assert any(
        s.mono_start < t.mono_end and t.mono_start < s.mono_end for s in samples for t in trains
    ), "no sampling overlapped a training step"
    # Weights published every 2 steps (not after the last), each moving the declared bytes.
    assert [r.published for r in done.records] == [
        (r.epoch + 1) % 2 == 0 and r.epoch + 1 < 12 for r in done.records
    ]
    assert done.syncs == 5 and done.sync_bytes == 5 * SIZE
    # The sampler loaded newer weights (each through host memory, under its own lease) at
    # most once per publication, each load moving the declared bytes.
    assert 1 <= done.loads <= done.syncs and done.load_bytes == done.loads * SIZE
    # Its progress says what its phases took and waited, as a sync job's does (it said
    # nothing of either, nor of records shed, before the async progress extended the sync one).
    shown = progress(address, job)
    assert (shown.status, shown.epoch, shown.sampler_phase) == ("completed", 12, "completed")
    assert shown.phase_s == done.phase_s and shown.wait_s == done.wait_s
    # Every step sampled, scored and trained; the weights were published (sync) and loaded.
    assert shown.phase_s.keys() == {"sample", "rewards", "train", "load", "sync"}
    assert shown.wait_s.keys() == {"sample", "train"} and shown.shed_records == 0
    # What `temporal workflow metadata` and the Web UI show: every handler says what it does.
    described = handler_descriptions(address, job)
    assert described.keys() >= {"progress", "stop", GRANT_SIGNAL}
    assert all(len(text) > 40 for text in described.values()), described


def test_max_staleness_zero_is_the_sync_schedule(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("fresh")
    job_worker(job)
    start(address, async_config(job, epochs=5, max_staleness=0, sync_every=1))
    done = result(address, job)
    assert_every_step_once(done, 5)
    assert [r.staleness for r in done.records] == [0] * 5
    assert [r.weights_version for r in done.records] == list(range(5))


def test_killed_job_process_rewinds_and_applies_every_step_once(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("akill")
    proc = job_worker(job)
    start(address, async_config(job, epochs=14, checkpoint_every=3, heartbeat_timeout_s=3))
    # Past a checkpoint, with batches queued and a step in hand, and a step applied since the
    # last checkpoint, two before the next (a kill as a checkpoint lands leaves nothing to redo).
    wait_for(
        lambda: _past_its_checkpoint(progress(address, job), 5, every=3),
        timeout=120,
        what="step 5 of the job, a step past its last checkpoint",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    job_worker(job)  # a fresh process: no state, no batch, until the job re-prepares it
    done = result(address, job)
    assert done.rewinds >= 1 and done.redone_epochs >= 1
    assert_every_step_once(done, 14)
    assert all(r.staleness <= 2 for r in done.records)
    assert done.stale_dropped == 0


def _past_its_checkpoint(p: AsyncRLJobProgress, steps: int, every: int) -> bool:
    saved = p.last_checkpoint.epochs_done if p.last_checkpoint is not None else None
    return p.epoch >= steps and saved is not None and p.epoch == saved + 1 and p.epoch % every == 1


def test_async_job_from_the_temporal_cli_and_stop(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("acli")
    job_worker(job)
    config = async_config(job, epochs=1000, checkpoint_every=50)
    out = subprocess.run(
        [str(temporal_binary()), "workflow", "start", "--address", address,
         "--type", "AsyncRLJobWorkflow", "--task-queue", "timeslice",
         "--workflow-id", rl_job_workflow_id(job), "--input", json.dumps(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    wait_for(lambda: progress(address, job).epoch >= 3, timeout=120, what="step 3")
    stopped = run_cli("job", "stop", job, "--address", address, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert f"asked job {job} to stop after its current step" in stopped.stdout
    done = result(address, job)
    assert done.stopped and 3 <= done.epochs_done < 1000
    assert done.last_checkpoint is not None
    assert done.last_checkpoint.epochs_done == done.epochs_done
    applied = applied_steps(done)
    assert [s for s, _, _ in applied] == list(range(done.epochs_done))
    # Batches handed over but never trained are counted, not lost.
    assert done.next_batch == done.epochs_done + done.dropped_batches
    shown = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "job", "progress", job, "--address", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"step {done.epochs_done}/1000" in shown.stdout


def test_async_job_continues_as_new_with_an_empty_pipeline(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("acan")
    job_worker(job)

    async def go(client: Client) -> tuple[AsyncRLJobResult, WorkflowExecutionStatus | None]:
        handle = await start_any_rl_job(
            client, parse_any_job_config(async_config(job, epochs=9, continue_as_new_every=4))
        )
        done = await handle.result()
        first = client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
        return done, (await first.describe()).status

    done, first_status = run(go, address)
    assert first_status == WorkflowExecutionStatus.CONTINUED_AS_NEW
    assert_every_step_once(done, 9)
    assert done.dropped_batches == 0  # the trainer drained each run's batches before it ended


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"sync_every": 4}, "sync_every=4 with max_staleness=2"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 257}, "max_staleness"),
        ({"trainer_group": None}, "need two groups"),
        ({"ranks": 2}, "one rank"),
        ({"epochs": 0}, "epochs"),
    ],
)
def test_bad_async_config_fails_the_workflow_at_once(
    address: str, change: dict[str, Any], complaint: str
) -> None:
    job = job_id("abad")
    config = {k: v for k, v in {**async_config(job), **change}.items() if v is not None}
    with pytest.raises(InvalidArgumentError, match=complaint):
        parse_any_job_config(config)

    async def go(client: Client) -> None:
        handle = await client.start_workflow(
            "AsyncRLJobWorkflow", config, id=rl_job_workflow_id(job), task_queue="timeslice"
        )
        await handle.result()

    with pytest.raises(WorkflowFailureError) as failed:
        run(go, address)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == "InvalidConfig" and cause.non_retryable
    assert complaint in cause.message


def test_a_workload_without_an_async_mode_is_refused(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("anoasync")
    workload = "tests.sync_only_workload:create"
    job_worker(job, workload)
    start(address, async_config(job, workload=workload, workload_options={}))
    with pytest.raises(WorkflowFailureError) as failed:
        result(address, job)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidConfig"
    assert "has no async mode" in cause.message


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (
            [
                "--mode",
                "async",
                "--trainer-group",
                "t",
                "--max-staleness",
                "1",
                "--sync-every",
                "3",
            ],
            "sync_every=3",
        ),
        (["--mode", "async"], "need two groups"),
        (["--max-staleness", "2"], "max_staleness set for a sync job"),
        (["--mode", "async", "--max-staleness", "-2", "--trainer-group", "t"], "max_staleness"),
        (["--mode", "later"], "invalid choice"),
    ],
)
def test_job_start_refuses_bad_async_flags_before_connecting(
    flags: list[str], complaint: str
) -> None:
    # No server at this address: the config is refused before any connection is tried.
    out = run_cli(
        "job", "start", "--address", "127.0.0.1:9", "--job-id", "j", "--workload", "simulated",
        "--sampler-group", "s", "--epochs", "3", *flags, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert complaint in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_report_reads_an_async_job(
    address: str, job_worker: Callable[..., Any], tmp_path: Path
) -> None:
    from timeslice.report import collect_report, write_report

    job = job_id("areport")
    job_worker(job)
    start(address, async_config(job, epochs=6))
    done = result(address, job)

    async def go(client: Client) -> Any:
        return await collect_report(client, groups=[f"s-{job}", f"t-{job}"], jobs=[job])

    report = run(go, address)
    (found,) = report.jobs
    assert found.job_id == job and found.status == "completed"
    assert found.epochs_done == 6 and found.rewards == done.rewards
    # Both loops' phases, read from the job's history: 6 batches sampled and scored, 6 steps.
    phases = sorted(
        s.kind for s in report.spans if s.job_id == job and s.kind in ("sample", "rewards", "train")
    )
    assert phases == ["rewards"] * 6 + ["sample"] * 6 + ["train"] * 6
    # A lane per loop: the sampler's phases in one, the trainer's in the other.
    lanes = {lane.name: lane for lane in report.lanes if lane.kind == "job"}
    assert set(lanes) == {f"{job} · sampler", f"{job} · trainer"}
    assert {s.kind for s in lanes[f"{job} · trainer"].spans} <= {"train", "waiting", "switching"}
    assert "train" not in {s.kind for s in lanes[f"{job} · sampler"].spans}
    # Each step's staleness, read from the history, is the workflow's own record of it.
    assert found.mode == "async"
    assert found.staleness == [r.staleness for r in done.records]
    trained = [s.label for s in lanes[f"{job} · trainer"].spans if s.kind == "train"]
    assert [label.rsplit("staleness ", 1)[1] for label in trained] == [
        str(r.staleness) for r in done.records
    ]
    shown = run_cli(
        "report", "--address", address, "--job", job, "--group", f"s-{job}",
        "--group", f"t-{job}", "--text-only", timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert job in shown.stdout and "Traceback" not in shown.stderr
    assert f"async: staleness max {max(found.staleness)}" in shown.stdout
    files = write_report(report, tmp_path / "report")  # the page and picture draw both lanes
    page = files.html.read_text()
    assert all(f"{job} \\u00b7 {loop}" in page for loop in ("sampler", "trainer"))


def test_a_revoked_sampler_lease_stops_the_sampling_and_fails_the_loop(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("arevoke")
    proc = job_worker(job)
    sampler = f"s-{job}"

    async def go(client: Client) -> AsyncRLJobResult:
        config = async_config(
            job,
            # A long first sampling to revoke in the middle of; the lease is checked every 1 s.
            workload_options={"sample_s": 30.0, "reward_s": 0.05, "train_s": 0.05},
            epochs=1,
            lease_ttl_s=4,
            max_failures=0,
        )
        handle = await start_any_rl_job(client, parse_any_job_config(config))
        group_handle = client.get_workflow_handle(group_workflow_id(sampler))

        async def holder() -> HolderView | None:
            return await group_handle.query("holder", result_type=HolderView | None)

        # The sampling's own lease: the same holder for 1 s while the sampler samples (not the
        # preparation's lease, which may still be handed back as sampling starts).
        seen: tuple[int, float] | None = None
        while True:
            with contextlib.suppress(RPCError):
                held = await holder()
                now = await handle.query("progress", result_type=AsyncRLJobProgress)
                if held is not None and now.sampler_phase == "batch 0 · sample":
                    if seen is None or seen[0] != held.token:
                        seen = (held.token, time.monotonic())
                    elif time.monotonic() - seen[1] >= 1.0:
                        break
                else:
                    seen = None
            await asyncio.sleep(0.1)
        # Revoked the way a lease is: its process stops renewing (frozen) and the TTL runs out.
        proc.send_signal(signal.SIGSTOP)
        try:
            while (current := await holder()) is not None and current.token == held.token:
                await asyncio.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGCONT)
        return await handle.result()

    with pytest.raises(WorkflowFailureError) as failed:
        run(go, address)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "JobFailed"
    assert "LeaseRevoked" in cause.message
    assert "was revoked" in cause.message or "was not confirmed within" in cause.message


def test_grpo_toy_async_with_max_staleness_zero_learns_as_the_sync_job(
    address: str, job_worker: Callable[..., Any]
) -> None:
    torch = pytest.importorskip("torch")
    grpo = {"workload": "grpo-toy", "epochs": 6, "batch_size": 8, "group_size": 4, "seed": 7}
    sync_job, async_job = job_id("gsync"), job_id("gasync")
    job_worker(sync_job, "grpo-toy")
    job_worker(async_job, "grpo-toy")

    async def go(client: Client) -> tuple[Any, AsyncRLJobResult]:
        sync_config = {"job_id": sync_job, "sampler_group": f"g-{sync_job}", **grpo}
        configs = [
            sync_config,
            {
                **async_config(async_job, workload_options={}),
                **grpo,
                "max_staleness": 0,
                "sync_every": 1,
            },
        ]
        handles = [await start_any_rl_job(client, parse_any_job_config(c)) for c in configs]
        return await handles[0].result(), await handles[1].result()

    synced, done = run(go, address)
    assert done.epochs_done == synced.epochs_done == 6
    assert [r.staleness for r in done.records] == [0] * 6
    # The same schedule, so the same learning: rewards and trained weights bit for bit.
    assert done.rewards == synced.rewards
    assert done.rewards[-1] > done.rewards[0]

    def trainer_state(ref: Any) -> dict[str, Any]:
        return torch.load(Path(ref.path) / "rank-0" / "trainer.pt", weights_only=True)

    mine, theirs = trainer_state(done.last_checkpoint), trainer_state(synced.last_checkpoint)
    for name, tensor in theirs["policy"].items():
        assert torch.equal(mine["policy"][name], tensor), name
    for ours, sync_state in zip(mine["optimizer"], theirs["optimizer"], strict=True):
        assert all(torch.equal(ours[k], sync_state[k]) for k in sync_state)


def test_a_job_process_without_async_activities_is_refused_at_once(address: str) -> None:
    """A job process of a release before async jobs serves the sync job's describe only: the
    async job fails at once, saying so, instead of waiting process_wait_s for it."""
    job = job_id("aold")

    @activity.defn(name=DESCRIBE_ACTIVITY)
    async def describe(inp: DescribeInput) -> DescribeResult:
        return DescribeResult(
            workload="simulated",
            sampler_backends=["sampler"],
            trainer_backends=["trainer"],
            epochs_done=None,
            protocol=JOB_PROTOCOL_VERSION,
        )

    async def go(client: Client) -> None:
        async with Worker(client, task_queue=job_task_queue(job, 0), activities=[describe]):
            # Without the refusal it would wait for another process this long, then time out.
            config = async_config(job, process_wait_s=30)
            handle = await start_any_rl_job(client, parse_any_job_config(config))
            await handle.result()

    with pytest.raises(WorkflowFailureError) as failed:
        run(go, address)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "ProtocolMismatch"
    assert "serves no async jobs" in cause.message


def test_job_start_mode_async_waits_and_shows_both_loops(
    address: str, job_worker: Callable[..., Any], tmp_path: Path
) -> None:
    job = job_id("await")
    job_worker(job)
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"workload_options": PIPELINE, "checkpoint_every": 3}))
    out = run_cli(
        "job", "start", "--address", address, "--config", str(config), "--mode", "async",
        "--job-id", job, "--workload", "simulated", "--sampler-group", f"s-{job}",
        "--trainer-group", f"t-{job}", "--epochs", "6", "--max-staleness", "3",
        "--sync-every", "2", "--wait", timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"job {job} completed after 6 steps" in out.stdout
    assert "trainer:" in out.stdout and "sampler:" in out.stdout  # the progress lines
    done = result(address, job)
    assert done.max_staleness == 3 and all(r.staleness <= 3 for r in done.records)
    assert done.syncs == 2  # after steps 2 and 4 (not after the last)


def test_stop_cancels_the_sampling_no_step_would_train(
    address: str, job_worker: Callable[..., Any]
) -> None:
    job = job_id("astop")
    job_worker(job)
    # The first batch samples for 60 s: the stop comes while it does.
    start(address, async_config(job, workload_options={**PIPELINE, "sample_s": 60.0}))
    wait_for(
        lambda: progress(address, job).sampler_phase == "batch 0 · sample",
        timeout=120,
        what="the first sampling",
    )

    async def stop_and_wait(client: Client) -> tuple[AsyncRLJobResult, list[Any]]:
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=AsyncRLJobResult)
        await handle.signal("stop")
        done = await handle.result()
        events = [e async for e in handle.fetch_history_events()]
        return done, events

    done, events = run(stop_and_wait, address)
    assert done.stopped and done.epochs_done == 0
    assert done.next_batch == 1 and done.dropped_batches == 1
    # The sampling was cancelled, not waited for: no step would have trained its batch.
    kinds = {e.event_type for e in events}
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED in kinds


def test_a_cancelled_async_job_ends_its_phases_before_it_hands_its_leases_back(
    address: str, job_worker: Callable[..., Any]
) -> None:
    """Cancelling an async job's run while its sampler samples cancels both loops, each ending
    its phase's activity, before the job hands its leases back."""
    job = job_id("acancel")
    job_worker(job)
    sampler = f"s-{job}"

    async def go(client: Client) -> list[str]:
        config = async_config(
            job, workload_options={"sample_s": 60.0, "reward_s": 0.05, "train_s": 0.05}, epochs=1
        )
        handle = await start_any_rl_job(client, parse_any_job_config(config))
        group_handle = client.get_workflow_handle(group_workflow_id(sampler))

        async def sampling() -> bool:
            held = await group_handle.query("holder", result_type=HolderView | None)
            now = await handle.query("progress", result_type=AsyncRLJobProgress)
            return held is not None and now.sampler_phase == "batch 0 · sample"

        return await cancel_in_phase(handle, sampling)

    assert_the_phase_ended_before_the_lease_went_back(run(go, address))
