"""Sandbox hygiene: what a workflow run loads inside Temporal's sandbox, and what it shares."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.workers.sandbox import PASSED_THROUGH, workflow_runner

from .sandbox_probe import SandboxProbe

REPO = Path(__file__).resolve().parent.parent
QUEUE = "test-sandbox"


def _loaded_in_sandbox(address: str) -> dict[str, int]:
    async def go() -> dict[str, int]:
        client = await Client.connect(address)
        async with Worker(
            client, task_queue=QUEUE, workflows=[SandboxProbe], workflow_runner=workflow_runner()
        ):
            return await client.execute_workflow(
                SandboxProbe.run, id=f"sandbox-probe-{uuid.uuid4().hex[:8]}", task_queue=QUEUE
            )

    return asyncio.run(go())


def test_only_workflow_modules_load_in_the_sandbox(address):
    loaded = _loaded_in_sandbox(address)
    # Importing a workflow module must not drag the client, its worker, telemetry or the
    # snapshot backends into every workflow run (the root package loads lazily).
    allowed = {"timeslice", "timeslice.workflows", "timeslice.protocol"}
    outside = sorted(
        name
        for name in loaded
        if name not in allowed
        and not name.startswith(("timeslice.workflows.", "timeslice.protocol."))
    )
    assert outside == [], f"non-workflow modules loaded in the sandbox: {outside}"
    assert "timeslice.workflows.gpu_group" in loaded and "timeslice.workflows.rl_job" in loaded


def test_protocol_and_group_core_are_passed_through_the_rest_reimported(address):
    loaded = _loaded_in_sandbox(address)
    shared = {
        name
        for name, ident in loaded.items()
        if name in sys.modules and id(sys.modules[name]) == ident
    }
    copies = set(loaded) - shared  # imported again inside the sandbox, for this run
    passed = {name for name in PASSED_THROUGH if name.startswith("timeslice")}
    # The models and the workflows' helpers load once per worker, not once per workflow run
    # (the protocol package with every module under it; a helper that only another passed
    # module imports is not in the sandbox's modules at all) ...
    assert not copies & passed, sorted(copies & passed)
    assert not [name for name in copies if name.startswith("timeslice.protocol")], copies
    assert {"timeslice.protocol.group", "timeslice.workflows.job_leases"} <= shared
    # ... and the modules that define workflows stay sandboxed (their state is per run).
    for defines in ("gpu_group", "rl_job", "async_rl_job", "job_base", "pool", "snapshot_job"):
        assert f"timeslice.workflows.{defines}" in loaded
        assert f"timeslice.workflows.{defines}" not in shared


def test_passthrough_is_declared_in_one_place():
    """Workflow modules import plainly; workers/sandbox.py says what is passed through."""
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("workflows", "tests")
        for path in (REPO / folder).glob("*.py")
        if "imports_passed_through" in path.read_text() and path.name != "test_sandbox.py"
    ]
    assert offenders == []
