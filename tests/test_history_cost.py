"""What a lease and an epoch cost in history, read from the real histories of contended runs
(bench/history_cost.py counts; docs/architecture.md, "What a lease costs", says what each
remaining event is for)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice.activities.group_requests import start_group
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import (
    GroupConfig,
    GroupQuery,
    GroupSignal,
    GroupStatus,
    GroupUpdate,
    group_workflow_id,
)
from timeslice.protocol.rl_job import (
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.transport.connection import connect, connect_config

from bench.history_cost import (
    HistoryCost,
    acquire_answers,
    event_name,
    group_cost,
    rl_job_cost,
    steady_epochs,
    update_names,
)
from tests.conftest import start_service, stop_process
from tests.helpers import run_simulated_jobs, wait_for

ROUNDS = 5


def histories_of(address: str, workflow_id: str) -> list[WorkflowHistory]:
    """Every run of the workflow (continue-as-new included)."""

    async def fetch() -> list[WorkflowHistory]:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        found = []
        async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
            handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
            found.append(await handle.fetch_history())
        return found

    return asyncio.run(fetch())


def test_a_contended_group_starts_at_most_one_timer_per_lease(address, group, make_client):
    """Three processes take turns, each acquire parked behind another's lease. Every wait of
    the group once started and cancelled its own timer (about 3.7 a lease, and 25 events a
    lease); one timer for the earliest deadline leaves the lease its updates' events."""
    clients = [make_client(job_id=f"j{i}", snapshot_backends=[]) for i in range(3)]
    failures: list[BaseException] = []

    def take_turns(client) -> None:
        try:
            for _ in range(ROUNDS):
                client.release(client.acquire(group, timeout=120))
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=take_turns, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads), "a process never finished its turns"
    leases = clients[0].group_status(group).stats.leases
    assert leases == 3 * ROUNDS

    cost: HistoryCost = group_cost(histories_of(address, group_workflow_id(group)))
    assert cost.units == leases, cost  # every lease's grant is found in the history
    assert cost.timers_started <= leases, cost
    # An acquire and a release each: accepted, completed, and at most one workflow task.
    assert cost.events_per_unit <= 12, cost.by_type


def stored(name: str) -> list[WorkflowHistory]:
    paths = sorted((Path(__file__).parent / "histories").glob(f"{name}*.json"))
    assert paths, name
    # One group's runs: read under one id, so a token answered in two runs is one lease.
    return [WorkflowHistory.from_json(name, p.read_text()) for p in paths]


def test_the_recorded_group_histories_show_the_timer_churn_gone():
    """The stored histories the replay test runs, before and after `one-deadline-timer`."""
    before = group_cost(stored("gpu_group_coop_run"))
    after = group_cost(stored("gpu_group_one_timer_run"))
    assert before.timers_per_unit > 3, before
    assert after.timers_per_unit <= 1, after


def test_an_rl_jobs_epoch_upserts_no_search_attribute(address, group, tmp_path):
    """Each phase once upserted TimeslicePhase (three or four events an epoch, 26 in all); the
    job's searched state changes at prepare, running and completed only, and a continued run
    starts with the attributes it carries."""
    schedule = {"epochs": 5, "checkpoint_every": 5, "continue_as_new_every": 2}
    result, job = _run_alone(address, group, tmp_path, "cost", schedule)
    assert result.epochs_done == 5, result

    histories = histories_of(address, rl_job_workflow_id(job))
    assert len(histories) == 3  # runs of epochs 0-1, 2-3 and 4
    epochs = steady_epochs(histories)
    assert len(epochs) == 2, epochs
    for epoch in epochs:
        assert not [name for name in epoch if name.startswith("upsert")], epoch
    assert statistics.mean(sum(e.values()) for e in epochs) <= 23, epochs
    ours = [
        name
        for h in histories
        for event in h.events
        if (name := event_name(event)).startswith("upsert") and "TemporalChangeVersion" not in name
    ]
    # TimeslicePhase: prepare, running, completed; TimesliceJob was set by the start.
    assert ours == ["upsert_workflow_search_attributes:TimeslicePhase"] * 3, ours
    assert rl_job_cost(histories).units == 5


def carried_epochs(history: WorkflowHistory) -> list[tuple[bool, list[str], int, int]]:
    """Per steady epoch of one run (as ``steady_epochs`` cuts them: one sample's scheduling to
    the next's): whether its train kept the lease (the group carried it into the next sample),
    the signals the workflow sent, its events and its workflow tasks."""
    epochs: list[tuple[bool, list[str], int, int]] = []
    activities: dict[int, str] = {}
    current: dict | None = None
    for event in history.events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            activities[event.event_id] = name
            if name == SAMPLE_ACTIVITY:
                if current is not None:
                    epochs.append(tuple(current.values()))
                current = {"kept": False, "signals": [], "events": 0, "tasks": 0}
        if current is None:
            continue
        current["events"] += 1
        current["tasks"] += kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            done = event.activity_task_completed_event_attributes
            if activities.get(done.scheduled_event_id) == TRAIN_ACTIVITY:
                current["kept"] = json.loads(done.result.payloads[0].data)["kept"]
        if kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signal = event.signal_external_workflow_execution_initiated_event_attributes
            current["signals"].append(signal.signal_name)
    return epochs


def test_a_carried_epoch_sends_the_group_no_cancel(address, group, tmp_path):
    """A train whose lease the group carries into the next sample never sends the acquire it
    was told to ask ahead (its process still holds the group). The workflow once cancelled that
    order anyway: a signal to a group that never had the request, 2 events and a workflow task
    of the job's epoch (23 events an epoch), and a signal and a task of the group's. From
    protocol v5 the process says it did not send it, and the order is forgotten: 3 activities
    and the 3 workflow tasks that follow them, 18 events."""
    schedule = {"epochs": 6, "checkpoint_every": 6}
    result, job = _run_alone(address, group, tmp_path, "carry", schedule)
    assert result.epochs_done == 6, result

    (history,) = histories_of(address, rl_job_workflow_id(job))
    epochs = carried_epochs(history)
    assert len(epochs) == 5, epochs
    carried = [e for e in epochs if e[0]]
    # Nobody else uses the group: every train's lease is carried into the next sample.
    assert len(carried) == 5, epochs
    for _kept, signals, _events, _tasks in carried:
        assert GroupSignal.CANCEL not in signals, epochs
    assert statistics.mean(events for *_, events, _ in carried) <= 20, epochs
    assert statistics.mean(tasks for *_, tasks in carried) <= 3.5, epochs
    # The group was sent no cancel either, and every acquire it got was granted: no order the
    # workflow forgot had reached it.
    group_histories = histories_of(address, group_workflow_id(group))
    group_signals = [
        event.workflow_execution_signaled_event_attributes.signal_name
        for h in group_histories
        for event in h.events
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    ]
    assert GroupSignal.CANCEL not in group_signals, group_signals
    acquires, granted = set(), set()
    for h in group_histories:
        for update_id, answer in acquire_answers(h).items():
            acquires.add(update_id)
            if answer and json.loads(answer[0].data).get("outcome") == "granted":
                granted.add(update_id)
    assert acquires and acquires == granted, (acquires, granted)


def _run_alone(address: str, group: str, tmp_path: Path, prefix: str, schedule: dict) -> tuple:
    """One `simulated` job of 0.05-s phases alone on ``group`` with its own job process
    (``schedule``: epochs, checkpoint_every, ...); its result and id."""
    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    proc = start_service(
        ["job", "worker", "--address", address, "--job-id", job, "--workload", "simulated",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--threads", "1"],
        f"job {job} rank 0",
        tmp_path / "job.log",
    )  # fmt: skip
    config = {
        "job_id": job,
        "workload": "simulated",
        "workload_options": {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05},
        "sampler_group": group,
        **schedule,
    }

    async def go() -> RLJobResult:
        client = await connect(connect_config(address))
        return await (await start_rl_job(client, parse_job_config(config))).result()

    try:
        return asyncio.run(go()), job
    finally:
        stop_process(proc)


# Two jobs that always want the group back (rewards far shorter than their GPU phases): nearly
# every release finds the other job waiting, so the holder evicts its own state.
_CONTENDED = {"sample_s": 0.25, "reward_s": 0.02, "train_s": 0.25, "state_bytes": 1 << 20,
              "snapshot_s": 0.02}  # fmt: skip
# Measured on this 2-core machine, FIFO (no carried leases), 4 epochs each, 18 leases: 17.3-17.4
# events a lease while every own eviction sent its `report_moved` (15 of them: each an update and
# most of a workflow task), 13.6 since the report goes with the holder's next release.
GROUP_EVENTS_PER_LEASE = 15.5
# A staged restore (the next holder's state brought in beside the lease, when the memory holds
# both) is an activity of the group's, scheduled in a task the group runs anyway: its start and
# completion and the workflow task that learns of it. A staged state taken off again unused is
# one more such activity. (Its patch adds no marker: a group run asks only `patches-at-start`.)
STAGED_MOVE_EVENTS = 6


@pytest.mark.parametrize("room", ["memory-for-both", "host-memory"])
def test_a_shared_groups_lease_costs_no_eviction_report_of_its_own(address, group, tmp_path, room):
    """Two job processes take turns on one group with memory for both, or with no memory
    declared and states in host memory (as torch's on the CPU, the README's jobs). A holder
    that evicts its own state on release once reported it with an update of its own; the group
    now lets that report wait for the holder's next release there (the next holder's restore
    never waited for it), so a lease reads as acquire, release and a renewal at most on the
    group's timeline."""
    epochs = 4
    jobs = [f"pair{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    per_job = 2 * _CONTENDED["state_bytes"]  # simulated jobs have a sampler and a trainer state
    on_host = room == "host-memory"
    options = {**_CONTENDED, "state_on_host": True} if on_host else _CONTENDED
    memory = None if on_host else 2 * per_job

    async def go() -> list[RLJobResult]:
        client = await connect(connect_config(address))
        await start_group(
            client, GroupConfig(group_id=group, memory_bytes=memory, grant_policy="fifo")
        )
        return await run_simulated_jobs(
            client, jobs, group, options, epochs=epochs, checkpoint_every=epochs
        )

    procs = [_job_process(address, job, tmp_path) for job in jobs]
    try:
        results = asyncio.run(go())
    finally:
        for proc in procs:
            stop_process(proc)
    assert [r.epochs_done for r in results] == [epochs, epochs], results

    histories = histories_of(address, group_workflow_id(group))
    updates = update_names(histories)
    cost = group_cost(histories)
    status = _group_status(address, group)
    print(f"group: {cost.events_per_unit:.1f} events a lease ({cost.units} leases), {updates}")
    own = [s for s in status.switch_history if s.by_holder and s.from_job]
    assert own, "no holder evicted its own state on release: the test did not contend"
    # At most one a job: the last eviction's bytes, told as its process leaves.
    assert updates[GroupUpdate.MOVED] <= len(jobs), updates
    # Every byte the holders moved is still counted (with their next release, or on leaving).
    assert status.stats.bytes_moved > 0 and status.stats.snapshot_failures == 0, status.stats
    staged_moves = status.stats.staged_restores + status.stats.staged_unused
    budget = GROUP_EVENTS_PER_LEASE * cost.units
    if staged_moves:
        budget += STAGED_MOVE_EVENTS * staged_moves
    assert cost.events <= budget, (cost, updates, status.stats)


def _job_process(address: str, job: str, tmp_path: Path):
    return start_service(
        ["job", "worker", "--address", address, "--job-id", job, "--workload", "simulated",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--threads", "1"],
        f"job {job} rank 0",
        tmp_path / f"{job}.log",
    )  # fmt: skip


def _group_status(address: str, group: str) -> GroupStatus:
    async def go() -> GroupStatus:
        client = await connect(connect_config(address))
        handle = client.get_workflow_handle(group_workflow_id(group))
        return await handle.query(GroupQuery.STATUS, result_type=GroupStatus)

    return asyncio.run(go())


def test_a_jobs_wait_for_a_lease_is_a_labelled_row_of_its_timeline(
    address, group, make_client, tmp_path
):
    """A job workflow's wait for its grant (here the prepare's, behind another process's lease)
    starts a timer whose summary names it, so the Web UI's Timeline shows the wait as a row of
    its own (``prepare · waiting for g-…``), where it was a gap."""
    holder = make_client(job_id=f"holder-{uuid.uuid4().hex[:6]}", snapshot_backends=[])
    lease = holder.acquire(group, timeout=60)
    job = f"waits-{uuid.uuid4().hex[:6]}"
    proc = _job_process(address, job, tmp_path)
    fast = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05}
    config = {"job_id": job, "workload": "simulated", "sampler_group": group, "epochs": 1,
              "workload_options": fast}  # fmt: skip

    async def start() -> Any:
        client = await connect(connect_config(address))
        return await start_rl_job(client, parse_job_config(config))

    async def result(handle: Any) -> RLJobResult:
        return await handle.result()

    try:
        handle = asyncio.run(start())
        wait_for(
            lambda: any(w.job_id == job for w in holder.group_status(group).queue),
            what="the job queued behind the holder",
        )
        holder.release(lease)
        assert asyncio.run(result(handle)).epochs_done == 1
    finally:
        stop_process(proc)
    labels = [
        json.loads(event.user_metadata.summary.data)
        for h in histories_of(address, rl_job_workflow_id(job))
        for event in h.events
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
        and event.user_metadata.HasField("summary")
    ]
    assert f"prepare · waiting for {group}" in labels, labels
