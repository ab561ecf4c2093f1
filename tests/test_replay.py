"""Replay stored group-workflow histories: a non-deterministic code change fails here."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from timeslice.workers.control import WORKFLOWS
from timeslice.workers.sandbox import workflow_runner
from timeslice.workflows.group_lease import LABELLED_LEASE_WAITS
from timeslice.workflows.group_patches import (
    AGENT_QUEUES_WAITED_FOR,
    BOUNDED_EVICTION_REPORT_WAIT,
    EVICTION_REPORTS_FOR_STAGING,
    FORGET_GONE_EVICTOR,
    ONE_DEADLINE_TIMER,
    PATCHES_AT_START,
    STAGED_RESTORES,
    STREAMED_SWITCHES,
    UNCONFIRMED_EVICTIONS_KEPT,
)
from timeslice.workflows.job_base import PHASES_END_WITH_A_CANCELLED_JOB
from timeslice.workflows.pool import (
    POOL_ASYNC_MOVES,
    POOL_DECISION_EVENTS,
    POOL_MOVES,
    POOL_MOVES_FOR_QUEUE,
    POOL_PROFILE_DRIFT,
)
from timeslice.workflows.pool_job import POOL_ASYNC_PROFILES
from timeslice.workflows.pool_job import POOL_MOVES as JOB_POOL_MOVES
from timeslice.workflows.pool_job import POOL_PROFILE_DRIFT as JOB_POOL_PROFILE_DRIFT
from timeslice.workflows.rl_job import JOB_PROTOCOL_V5, SEARCHED_STATES_ONLY

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def _replay_failure(history: WorkflowHistory) -> Exception | None:
    replayer = Replayer(
        workflows=WORKFLOWS,
        data_converter=pydantic_data_converter,
        workflow_runner=workflow_runner(),
    )
    result = asyncio.run(replayer.replay_workflow(history, raise_on_replay_failure=False))
    return result.replay_failure


def test_histories_are_stored():
    # The recorder covers continue-as-new, so several runs are stored.
    assert len(HISTORIES) >= 2


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_stored_history_replays(path: Path):
    text = path.read_text()
    # Replayed under the id it ran with: a workflow may check its own id (RLJobWorkflow does).
    started = json.loads(text)["events"][0]["workflowExecutionStartedEventAttributes"]
    history = WorkflowHistory.from_json(started.get("workflowId", path.stem), text)
    failure = _replay_failure(history)
    assert failure is None, f"{path.name} no longer replays: {failure}"


def _patch_markers(text: str) -> set[str]:
    """The ``workflow.patched`` ids whose markers a history recorded."""
    found: set[str] = set()
    for event in json.loads(text)["events"]:
        marker = event.get("markerRecordedEventAttributes")
        if marker is None or marker.get("markerName") != "core_patch":
            continue
        for payload in marker["details"]["patch-data"]["payloads"]:
            found.add(json.loads(base64.b64decode(payload["data"]))["id"])
    return found


@pytest.mark.parametrize(
    "patch",
    [
        BOUNDED_EVICTION_REPORT_WAIT,
        FORGET_GONE_EVICTOR,
        ONE_DEADLINE_TIMER,
        STREAMED_SWITCHES,
        STAGED_RESTORES,
        PATCHES_AT_START,
        EVICTION_REPORTS_FOR_STAGING,
        UNCONFIRMED_EVICTIONS_KEPT,
        AGENT_QUEUES_WAITED_FOR,
        SEARCHED_STATES_ONLY,
        JOB_PROTOCOL_V5,
        PHASES_END_WITH_A_CANCELLED_JOB,
        LABELLED_LEASE_WAITS,
        POOL_MOVES,
        POOL_DECISION_EVENTS,
        POOL_MOVES_FOR_QUEUE,
        POOL_PROFILE_DRIFT,
        POOL_ASYNC_MOVES,
        POOL_ASYNC_PROFILES,
    ],
)
def test_a_stored_history_takes_the_patched_path(patch: str):
    """A history recorded after the patch (tests/histories/record_eviction_wait.py,
    record_one_timer.py, record_streamed.py, record_staged.py, record_rl_states.py, record_rl_v5.py,
    record_rl_labelled.py, record_pool.py, record_patches_at_start.py, record_rl_cancelled.py),
    so the replay above runs the new branch too, not only the old one."""
    recorded = {path.name for path in HISTORIES if patch in _patch_markers(path.read_text())}
    assert recorded, f"no stored history records the {patch!r} patch"


def test_a_group_that_asked_patches_at_start_records_no_other_patch():
    """A run down PATCHES_AT_START takes every older patch's branch without asking it: no
    marker of its own that a handler could record after the main loop's timer (the SDK
    ordering of the known history below). The run's jobs restore themselves at their grants,
    so the one restore the group scheduled is the staged one: that branch ran."""
    path = Path(__file__).parent / "histories" / "gpu_group_patches_at_start_run0.json"
    text = path.read_text()
    # Only the patches asked in __init__, before any handler could run.
    assert _patch_markers(text) == {
        PATCHES_AT_START,
        EVICTION_REPORTS_FOR_STAGING,
        UNCONFIRMED_EVICTIONS_KEPT,
        AGENT_QUEUES_WAITED_FOR,
    }
    events = json.loads(text)["events"]
    scheduled = [e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
                 for e in events if "activityTaskScheduledEventAttributes" in e]  # fmt: skip
    assert scheduled.count("timeslice.restore") == 1, scheduled


def test_pool_moves_are_one_patch_for_the_pool_and_its_jobs():
    """The pool's weighing and the job's move and measured profile share a patch id, so the
    stored pool histories from before moves (``pool_*``, recorded on the code before) replay
    with neither, and those after (``pool_moves_*``) with both (every pool that weighed a move,
    and the jobs that moved or measured their profile; the async scenario's pool recorded
    before async jobs measured profiles moved its one job by hand and weighed none:
    ``pool-async-moves`` marks it)."""
    assert POOL_MOVES == JOB_POOL_MOVES
    assert POOL_PROFILE_DRIFT == JOB_POOL_PROFILE_DRIFT
    recordings: dict[str, list[bool]] = {}
    for path in HISTORIES:
        if not path.name.startswith("pool_"):
            continue
        marked = POOL_MOVES in _patch_markers(path.read_text())
        if not path.name.startswith("pool_moves_"):
            assert not marked, path.name
        elif "_pool" in path.name:
            weighed = path.name != "pool_moves_async_pool0.json"
            assert marked is weighed, path.name
            if not weighed:
                assert POOL_ASYNC_MOVES in _patch_markers(path.read_text()), path.name
        else:  # a job that neither moved nor measured its profile has no need of the patch
            recordings.setdefault(path.name.rsplit("_job", 1)[0], []).append(marked)
    assert recordings and all(any(jobs) for jobs in recordings.values()), recordings


@pytest.mark.xfail(
    strict=True,
    reason="known: a group flooded by raw updates (tests/test_renewal_flood.py) recorded a "
    "timer its main loop started (event 297) before the update accepted in the same workflow "
    "task (298, sequenced at 294); every replay of that history fails with the SDK's "
    "nondeterminism error 'Update machine does not handle this event: TimerStarted' "
    "(temporalio 1.35.0), and the group's workflow task fails from then on",
)
def test_a_flooded_groups_history_with_a_timer_before_an_accepted_update_replays():
    """A deterministic reproduction of the wedged group seen in CI runs of the raw flood (its
    first 300 events, the last ones the workflow task that started the timer and accepted the
    update). Strict: when a fix (ours or the SDK's) makes it replay, this fails until the mark
    goes."""
    path = Path(__file__).parent / "histories" / "known" / "gpu_group_flood_update_after_timer.json"
    history = WorkflowHistory.from_json("gpu-group-raw-flood", path.read_text())
    failure = _replay_failure(history)
    assert failure is None, str(failure)


@pytest.mark.xfail(
    strict=True,
    reason="known, the same SDK ordering as above: a flooded group's main loop started a timer "
    "(event 150) and a renewal's update handler, in the same workflow task, called "
    "workflow.patched('late-renewal-renews') for the first time (its marker and version "
    "search attribute, 151-152); every replay fails with the SDK's nondeterminism error "
    "'UpsertWorkflowSearchAttributesMachine does not handle HistoryEvent(id: 150, "
    "TimerStarted)' (temporalio 1.35.0), and the group's workflow task fails from then on",
)
def test_a_flooded_groups_history_with_a_timer_before_a_handlers_patch_marker_replays():
    """A second deterministic reproduction, from a CI run of the raw flood on 2026-12-04 (its
    first 156 events, the last ones the task that started the timer, recorded the patch and
    answered two updates). Strict, as above."""
    path = Path(__file__).parent / "histories" / "known" / "gpu_group_flood_patch_after_timer.json"
    history = WorkflowHistory.from_json("gpu-group-raw-flood-1s", path.read_text())
    failure = _replay_failure(history)
    assert failure is None, str(failure)
