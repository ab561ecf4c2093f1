"""Replay stored group-workflow histories: a non-deterministic code change fails here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from timeslice.workers.control import WORKFLOWS
from timeslice.workers.sandbox import workflow_runner

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_histories_are_stored():
    # The recorder covers continue-as-new, so several runs are stored.
    assert len(HISTORIES) >= 2


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_stored_history_replays(path: Path):
    text = path.read_text()
    # Replayed under the id it ran with: a workflow may check its own id (RLJobWorkflow does).
    started = json.loads(text)["events"][0]["workflowExecutionStartedEventAttributes"]
    history = WorkflowHistory.from_json(started.get("workflowId", path.stem), text)
    replayer = Replayer(
        workflows=WORKFLOWS,
        data_converter=pydantic_data_converter,
        workflow_runner=workflow_runner(),
    )
    result = asyncio.run(replayer.replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure}"
